#!/usr/bin/env bash
# Stop the local Slurm that slurm/start.sh started in ${MOETRON_SLURM_HOME:-/tmp/moetron-slurm}:
# slurmd, slurmctld and its slurmscriptd, slurmdbd, mariadbd and munged (`make stop` runs this).
#
# Only processes named by the pid files in that folder are signalled, and only when the process
# behind the pid is still the daemon it should be (a recycled pid is left alone). Jobs still
# queued or running are cancelled first, so no job step outlives its slurmd. Configuration, job
# state, accounting data and logs stay, so the next start.sh continues where this one left off;
# `rm -rf` the folder to forget them.
set -euo pipefail

root="${MOETRON_SLURM_HOME:-/tmp/moetron-slurm}"
run="$root/run"
export SLURM_CONF="$root/etc/slurm.conf"
started_at=$(date +%s.%N)

# shellcheck source=live_pid.sh
source "$(dirname "${BASH_SOURCE[0]}")/live_pid.sh"

# stop_pid PID NAME PATIENCE: if PID is still the live NAME, TERM it, wait for it to go, KILL it after
# PATIENCE seconds.
stop_pid() {
    local pid="$1" name="$2" patience="$3" waited=0
    [[ -n "$pid" ]] && alive_as "$pid" "$name" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    while alive_as "$pid" "$name"; do
        if ((waited >= patience * 10)); then
            echo "slurm/stop.sh: $name (pid $pid) ignored SIGTERM for ${patience}s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

# stop_daemon PIDFILE NAME PATIENCE: stop_pid on the daemon its pid file names, then drop the file.
stop_daemon() {
    stop_pid "$(live_pid "$run/$1" "$2")" "$2" "$3"
    rm -f "$run/$1"
}

if [[ ! -d "$run" ]]; then
    echo "slurm/stop.sh: nothing to stop: $run does not exist" >&2
    exit 0
fi

# Cancel jobs only through our own controller, and only if it answers.
if [[ -n "$(live_pid "$run/slurmctld.pid" slurmctld)" ]]; then
    jobs="$(squeue -h -o %i 2>/dev/null || true)"
    if [[ -n "$jobs" ]]; then
        # shellcheck disable=SC2086 # one id per word
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z "$(squeue -h -t running,completing -o %i 2>/dev/null || true)" ]] && break
            sleep 0.1
        done
    fi
fi

for entry in "${SLURM_DAEMONS[@]}"; do
    if [[ "${entry%%:*}" == slurmd ]]; then
        stop_daemon "${entry#*:}" slurmd 10
    fi
done
# slurmctld ends its slurmscriptd itself; should that one outlive it, it is stopped too.
scriptd="$(scriptd_pid "$(live_pid "$run/slurmctld.pid" slurmctld)")"
stop_daemon slurmctld.pid slurmctld 10
stop_pid "$scriptd" slurmscriptd 5
stop_daemon slurmdbd.pid slurmdbd 10
stop_daemon mariadb.pid mariadbd 30
stop_daemon munged.pid munged 10

awk -v a="$started_at" -v b="$(date +%s.%N)" 'BEGIN { printf "slurm/stop.sh: local Slurm stopped in %.1f s\n", b - a }' >&2
