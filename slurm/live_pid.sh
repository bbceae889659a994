# Sourced by start.sh, stop.sh and status.sh.

# The daemons start.sh runs, in the order it starts them, as NAME:PIDFILE (in run/). slurmctld forks
# a sixth, slurmscriptd, which has no pid file of its own and ends with slurmctld.
SLURM_DAEMONS=(munged:munged.pid mariadbd:mariadb.pid slurmdbd:slurmdbd.pid slurmctld:slurmctld.pid)
# A cluster of several nodes on this machine (MOETRON_SLURM_NODES) runs one slurmd per node, each
# with its own pid file; etc/nodes names them.
if [[ -s "${root:-}/etc/nodes" ]]; then
    while read -r node; do
        SLURM_DAEMONS+=("slurmd:slurmd-$node.pid")
    done <"$root/etc/nodes"
else
    SLURM_DAEMONS+=(slurmd:slurmd.pid)
fi

# alive_as PID NAME: PID is a live process named NAME. Zombies linger a few seconds after exit here,
# so /proc/PID existing does not mean the daemon still runs; a recycled pid has another name.
alive_as() {
    local state
    [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$2" ]] || return 1
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" || return 1
    [[ "$state" != Z && "$state" != X ]]
}

# live_pid PIDFILE NAME: print the pid in PIDFILE if it is a live process named NAME, else nothing.
live_pid() {
    local pidfile="$1" name="$2" pid
    [[ -s "$pidfile" ]] || return 0
    pid="$(<"$pidfile")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 0
    if alive_as "$pid" "$name"; then echo "$pid"; fi
}

# scriptd_pid CTLD_PID: the pid of the live slurmscriptd that slurmctld CTLD_PID forked, or nothing.
# Read from /proc (no pgrep: procps is not on every fresh machine).
scriptd_pid() {
    local ctld="$1" stat line fields
    [[ -n "$ctld" ]] || return 0
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        [[ "$line" == *" (slurmscriptd) "* ]] || continue
        read -r -a fields <<<"${line##*) }"  # state, parent pid, ...
        if [[ "${fields[1]}" == "$ctld" && "${fields[0]}" != [ZX] ]]; then
            echo "${line%% *}"
            return 0
        fi
    done
}
