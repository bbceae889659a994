#!/usr/bin/env bash
# Configure and start a real single-node Slurm on localhost: munged, MariaDB, slurmdbd (so that
# sacct works), slurmctld (which forks slurmscriptd) and slurmd, with every piece of their state
# under one folder:
#
#   ${MOETRON_SLURM_HOME:-/tmp/moetron-slurm}/
#     etc/    slurm.conf, slurmdbd.conf, munge.key, mariadb password
#     run/    pid files, munge and MariaDB sockets
#     log/    one log per daemon
#     spool/  slurmctld state, slurmd spool, munge seed
#     mysql/  MariaDB data
#     env     `export SLURM_CONF=...`, to source
#
# Prints `export SLURM_CONF=...` on stdout (so `eval "$(slurm/start.sh)"` works) and returns once
# `sinfo` shows the node idle. Running it again while everything runs only prints that line;
# daemons that died are started again. Job state persists across stop/start, as on a real cluster,
# so job ids keep growing and sacct stays unambiguous. slurm/stop.sh (`make stop`) stops exactly these
# daemons; slurm/status.sh lists them.
#
# Ports: MOETRON_SLURM_PORT (default 6817) for slurmctld, then +1 slurmd, +2 slurmdbd, +3 MariaDB.
# MOETRON_SLURM_CPUS declares more CPUs than the machine has (e.g. 4 ranks on 2 cores).
#
# MOETRON_SLURM_NODES=N (N > 1, on a cold start) makes it a cluster of N nodes n1..nN on this one
# machine, one slurmd each (`slurmd -N n1`; this Slurm build runs several), listening on ports +4,
# +5, ... and each with the machine's CPUs; etc/nodes names them for stop.sh and status.sh. A node
# is declared down 10 s after its slurmd stops answering (SlurmdTimeout; Slurm's default is 300),
# so that losing one can be tried. The node names do not resolve: jobs that need their master's
# address must be given MASTER_ADDR=127.0.0.1.
set -euo pipefail

root="${MOETRON_SLURM_HOME:-/tmp/moetron-slurm}"
port="${MOETRON_SLURM_PORT:-6817}"
node_count="${MOETRON_SLURM_NODES:-1}"
ctld_port=$port
slurmd_port=$((port + 1))
dbd_port=$((port + 2))
db_port=$((port + 3))
cluster=moetron
host="$(hostname -s)"
started_at=$(date +%s.%N)

conf="$root/etc/slurm.conf"
dbd_conf="$root/etc/slurmdbd.conf"
munge_socket="$root/run/munge.socket"
db_socket="$root/run/mariadb.sock"

die() {
    echo "slurm/start.sh: $1" >&2
    exit 1
}

for tool in munged mungekey mariadbd mariadb-install-db slurmdbd slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || die "$tool not found; run slurm/install.sh first"
done
[[ $EUID -eq 0 ]] || die "the daemons run as root here (SlurmUser=root); run as root"
# Unix socket paths are limited to 107 bytes; the MariaDB socket is the longest under run/.
((${#db_socket} <= 107)) || die "MOETRON_SLURM_HOME=$root is too long for a unix socket path; use a folder under 80 characters"

# shellcheck source=live_pid.sh
source "$(dirname "${BASH_SOURCE[0]}")/live_pid.sh"

# True when the pid file names a live daemon named $2.
alive() {
    [[ -n "$(live_pid "$1" "$2")" ]]
}

# Wait up to $2 seconds for the command "${@:3}" to succeed; on timeout show the log $1 and fail.
wait_for() {
    local log="$1" seconds="$2" what="$3"
    shift 3
    local deadline=$(($(date +%s) + seconds))
    until "$@" >/dev/null 2>&1; do
        if (($(date +%s) >= deadline)); then
            echo "slurm/start.sh: $what did not come up within ${seconds}s; last lines of $log:" >&2
            tail -n 20 "$log" >&2 || true
            exit 1
        fi
        sleep 0.1
    done
}

print_env() {
    echo "export SLURM_CONF=$conf"
}

mkdir -p "$root"/{etc,run,log,spool/ctld,spool/d,spool/munge}
# munged refuses key, socket and log folders that others may write to.
chmod 755 "$root" "$root"/{etc,run,log,spool,spool/munge}

# One start at a time per folder: two test sessions starting together must not both start daemons.
# The daemons must not inherit the lock's descriptor (9>&- below), or they would hold it forever.
exec 9>"$root/run/start.lock"
flock -w 120 9 || die "another slurm/start.sh holds $root/run/start.lock for over 120 s"

all_running=1
any_running=0
for entry in "${SLURM_DAEMONS[@]}"; do
    if alive "$root/run/${entry#*:}" "${entry%%:*}"; then any_running=1; else all_running=0; fi
done
if ((all_running)); then
    print_env
    exit 0
fi

# --- configuration: written on a cold start; daemons restarted next to running ones reuse it ---

alive "$root/run/munged.pid" munged || {
    [[ -s "$root/etc/munge.key" ]] || mungekey --create --keyfile="$root/etc/munge.key" >/dev/null
    chmod 600 "$root/etc/munge.key"
}
[[ -s "$root/etc/mariadb.pass" ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$root/etc/mariadb.pass")
db_pass="$(<"$root/etc/mariadb.pass")"

write_config() {
    local node_line overrides
    # The node line comes from slurmd itself, so CPUs and memory match what it will report.
    node_line="$(slurmd -C | head -n 1)"
    [[ "$node_line" == NodeName=* ]] || die "slurmd -C printed '$node_line', expected a NodeName= line"
    node_line="NodeName=$host NodeAddr=127.0.0.1 ${node_line#NodeName=* }"
    overrides=""
    if [[ -n "${MOETRON_SLURM_CPUS:-}" ]]; then
        node_line="NodeName=$host NodeAddr=127.0.0.1 CPUs=${MOETRON_SLURM_CPUS} $(grep -o 'RealMemory=[0-9]*' <<<"$node_line")"
        overrides="SlurmdParameters=config_overrides"
    fi

    per_node=""  # the slurmd files of each node, when there are several: %n is its name
    if ((node_count > 1)); then
        per_node="-%n"
        node_line="$(grep -o 'CPUs=[0-9]*' <<<"$node_line") $(grep -o 'RealMemory=[0-9]*' <<<"$node_line")"
        node_line="$(for ((i = 1; i <= node_count; i++)); do
            echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 3 + i)) $node_line State=UNKNOWN"
        done)"
        overrides="$overrides
SlurmdTimeout=10"
        seq -f 'n%g' "$node_count" >"$root/etc/nodes"
    else
        node_line="$node_line State=UNKNOWN"
        rm -f "$root/etc/nodes"
    fi

    cat >"$conf" <<EOF
# Written by slurm/start.sh; rewritten on every cold start.
ClusterName=$cluster
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only once its credential expired (cred_expire + 1 s later): 5 s,
# the least Slurm accepts, instead of 120 s. Every step's launch must reach slurmd within it.
AuthInfo=socket=$munge_socket,cred_expire=5
StateSaveLocation=$root/spool/ctld
SlurmdSpoolDir=$root/spool/d${per_node}
SlurmctldPidFile=$root/run/slurmctld.pid
SlurmdPidFile=$root/run/slurmd${per_node}.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd${per_node}.log
# No cgroups in containers: track processes through /proc and bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MailProg=/bin/true
$overrides
# Preemption: a job in 'urgent' requeues jobs in 'debug', which first get their --signal.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
# Accounting through slurmdbd, so sacct works (moetron status reads finished jobs from it).
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
AccountingStoragePass=$munge_socket
JobAcctGatherType=jobacct_gather/none
$node_line
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF

    (umask 077 && cat >"$dbd_conf" <<EOF
# Written by slurm/start.sh. slurmdbd refuses this file unless it is mode 600.
AuthType=auth/munge
AuthInfo=socket=$munge_socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$root/run/slurmdbd.pid
LogFile=$root/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$dbd_conf"
}
if ((!any_running)) || [[ ! -s "$conf" || ! -s "$dbd_conf" ]]; then
    write_config
fi
export SLURM_CONF="$conf"

# --- daemons, in dependency order ---

if ! alive "$root/run/munged.pid" munged; then
    rm -f "$munge_socket" "$munge_socket.lock"
    munged --force --key-file="$root/etc/munge.key" --socket="$munge_socket" \
        --pid-file="$root/run/munged.pid" --log-file="$root/log/munged.log" \
        --seed-file="$root/spool/munge/munged.seed" 9>&- >>"$root/log/munged.log" 2>&1 ||
        { tail -n 20 "$root/log/munged.log" >&2; die "munged failed to start"; }
fi

if ! alive "$root/run/mariadb.pid" mariadbd; then
    if [[ ! -d "$root/mysql/mysql" ]]; then
        # A half-made data folder (interrupted first start) is thrown away and made again.
        # Seen once on a fresh machine with two clusters starting at once: a first try that fails
        # and a second that works, so it gets two tries before giving up.
        for try in 1 2; do
            rm -rf "$root/mysql"
            mariadb-install-db --no-defaults --user=root --datadir="$root/mysql" --skip-test-db \
                --auth-root-authentication-method=socket >"$root/log/mariadb-install.log" 2>&1 && break
            ((try < 2)) || { tail -n 20 "$root/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
            sleep 1
        done
    fi
    rm -f "$db_socket"
    # mariadbd does not daemonize itself; setsid detaches it from the caller's session.
    setsid mariadbd --no-defaults --user=root --datadir="$root/mysql" --socket="$db_socket" \
        --pid-file="$root/run/mariadb.pid" --bind-address=127.0.0.1 --port="$db_port" \
        --skip-name-resolve --log-error="$root/log/mariadb.log" --skip-log-bin \
        --innodb-buffer-pool-size=32M 9>&- </dev/null >>"$root/log/mariadb.log" 2>&1 &
    wait_for "$root/log/mariadb.log" 60 MariaDB test -S "$db_socket"
    # root logs in through the socket as the unix user root; slurmdbd gets its own TCP account,
    # whose password is set again on every start so the data folder and etc/ never disagree.
    mariadb --no-defaults --socket="$db_socket" -u root >>"$root/log/mariadb.log" 2>&1 <<EOF ||
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
        { tail -n 20 "$root/log/mariadb.log" >&2; die "could not create the MariaDB account for slurmdbd"; }
fi

if ! alive "$root/run/slurmdbd.pid" slurmdbd; then
    slurmdbd 9>&- >>"$root/log/slurmdbd.log" 2>&1 || { tail -n 20 "$root/log/slurmdbd.log" >&2; die "slurmdbd failed to start"; }
    # slurmctld registers the cluster with slurmdbd when it starts, so slurmdbd must listen first.
    wait_for "$root/log/slurmdbd.log" 60 slurmdbd sacctmgr -n list cluster
fi

if ! alive "$root/run/slurmctld.pid" slurmctld; then
    slurmctld 9>&- >>"$root/log/slurmctld.log" 2>&1 || { tail -n 20 "$root/log/slurmctld.log" >&2; die "slurmctld failed to start"; }
fi

if [[ -s "$root/etc/nodes" ]]; then
    while read -r node; do
        if ! alive "$root/run/slurmd-$node.pid" slurmd; then
            slurmd -N "$node" 9>&- >>"$root/log/slurmd-$node.log" 2>&1 ||
                { tail -n 20 "$root/log/slurmd-$node.log" >&2; die "slurmd -N $node failed to start"; }
        fi
    done <"$root/etc/nodes"
elif ! alive "$root/run/slurmd.pid" slurmd; then
    slurmd 9>&- >>"$root/log/slurmd.log" 2>&1 || { tail -n 20 "$root/log/slurmd.log" >&2; die "slurmd failed to start"; }
fi

node_idle() {
    local states
    if [[ -s "$root/etc/nodes" ]]; then
        states="$(sinfo -h -N -o %T 2>/dev/null)"
    else
        states="$(sinfo -h -N -n "$host" -o %T 2>/dev/null | head -n 1)"
    fi
    [[ -n "$states" ]] && ! grep -qvE '^(idle|mixed|allocated)$' <<<"$states"
}
wait_for "$root/log/slurmctld.log" 60 "node $host" node_idle

print_env >"$root/env"
print_env
awk -v a="$started_at" -v b="$(date +%s.%N)" 'BEGIN { printf "slurm/start.sh: local Slurm up in %.1f s\n", b - a }' >&2
