#!/usr/bin/env bash
# Which daemons of the local Slurm in ${MOETRON_SLURM_HOME:-/tmp/moetron-slurm} run: one line each,
# `NAME running (pid N)` or `NAME stopped`, slurmctld's slurmscriptd included.
#
# Exit status, as an init script's `status`: 0 when all six run, 3 when none does, 1 when only some
# do (slurm/start.sh starts the missing ones, slurm/stop.sh stops the rest).
set -euo pipefail

root="${MOETRON_SLURM_HOME:-/tmp/moetron-slurm}"

# shellcheck source=live_pid.sh
source "$(dirname "${BASH_SOURCE[0]}")/live_pid.sh"

running=0
total=0
report() {
    total=$((total + 1))
    if [[ -n "$2" ]]; then
        echo "$1 running (pid $2)"
        running=$((running + 1))
    else
        echo "$1 stopped"
    fi
}

for entry in "${SLURM_DAEMONS[@]}"; do
    name="${entry%%:*}"
    pid="$(live_pid "$root/run/${entry#*:}" "$name")"
    report "$name" "$pid"
    if [[ "$name" == slurmctld ]]; then
        report slurmscriptd "$(scriptd_pid "$pid")"
    fi
done

((running == total)) && exit 0
((running == 0)) && exit 3
exit 1
