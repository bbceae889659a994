# Sourced by start.sh and stop.sh.
# live_pid PIDFILE NAME: print the pid in PIDFILE if it is a live (not zombie) process named NAME,
# else nothing. Zombies linger a few seconds after exit here, so /proc/PID existing does not mean
# the daemon still runs.
live_pid() {
    local pidfile="$1" name="$2" pid state comm
    [[ -s "$pidfile" ]] || return 0
    pid="$(<"$pidfile")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 0
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 0
    [[ "$comm" == "$name" ]] || return 0
    state="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" || return 0
    [[ "$state" == Z || "$state" == X ]] || echo "$pid"
}
