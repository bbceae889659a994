#!/usr/bin/env bash
# slurm/run_then_stop.sh COMMAND...: run COMMAND and exit with its status. If the local Slurm
# (slurm/status.sh) was down when COMMAND started and is up when it ends, stop it (slurm/stop.sh),
# after a failure or Ctrl-C too; one that was already running is someone's, and stays.
#
# `make test` runs pytest through it: the Slurm tests start the daemons themselves.
set -uo pipefail

here="$(dirname "${BASH_SOURCE[0]}")"

bash "$here/status.sh" >/dev/null
if (($? == 3)); then
    trap 'bash "$here/status.sh" >/dev/null; (($? == 3)) || bash "$here/stop.sh"' EXIT
fi
trap 'exit 130' INT
trap 'exit 143' TERM
"$@"
