#!/usr/bin/env bash
# Install a single-node Slurm (with accounting), munge and Open MPI from apt, plus the Python
# packages the launcher uses with them. Safe to run again: it installs only what is missing.
#
# apt must not start any daemon: start.sh runs every daemon itself, with all of its state under
# one folder, so nothing is left behind in /etc or /var outside the package files.
set -euo pipefail

APT_PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server openmpi-bin libopenmpi-dev)
PIP_PACKAGES=(mpi4py)
PYTHON="${PYTHON:-python3}"

log="$(mktemp -t moetron-slurm-install.XXXXXX)"
trap 'rm -f "$log"' EXIT

fail() {
    echo "slurm/install.sh: $1 (output follows)" >&2
    cat "$log" >&2
    exit 1
}

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    # dpkg-query prints "install ok installed" only for fully configured packages.
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]})); then
    if [[ $EUID -ne 0 ]]; then
        echo "slurm/install.sh: installing ${missing[*]} needs root; run it as root or with sudo" >&2
        exit 1
    fi
    # policy-rc.d exiting 101 tells invoke-rc.d that no service may start; put back whatever
    # was there before, even when apt fails.
    policy=/usr/sbin/policy-rc.d
    saved=""
    if [[ -e "$policy" ]]; then
        saved="$(mktemp -t moetron-policy-rc.XXXXXX)"
        cp -p "$policy" "$saved"
    fi
    restore_policy() {
        if [[ -n "$saved" ]]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi
        rm -f "$log"
    }
    trap restore_policy EXIT
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"

    export DEBIAN_FRONTEND=noninteractive
    # Refresh the package lists only when a first attempt cannot find the packages.
    apt_install() {
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1
    }
    if ! apt_install; then
        apt-get update -q >>"$log" 2>&1 || fail "apt-get update failed"
        apt_install || fail "apt-get install ${missing[*]} failed"
    fi
fi

# find_spec asks the import system without importing (or loading MPI), which is much faster
# than one `pip show` per package.
read -r -a pip_missing < <("$PYTHON" - "${PIP_PACKAGES[@]}" <<'PY'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name) is None))
PY
)
if ((${#pip_missing[@]})); then
    "$PYTHON" -m pip install -q "${pip_missing[@]}" >>"$log" 2>&1 || fail "pip install ${pip_missing[*]} failed"
fi
