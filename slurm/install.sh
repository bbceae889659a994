#!/usr/bin/env bash
# Install a single-node Slurm (with accounting), munge and Open MPI from apt. Safe to run again: it
# installs only the packages that are missing, says which before it does, and upgrades no package
# already installed except a library one of them needs a newer version of (it names those first).
# No Python package: mpi4py, which loads this Open MPI, is one of moetron's own dependencies.
#
# apt must not start any daemon: start.sh runs every daemon itself, with all of its state under
# one folder, so nothing is left behind in /etc or /var outside the package files.
set -euo pipefail

APT_PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server openmpi-bin libopenmpi-dev)

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
    # --no-upgrade: a package already installed stays at its version unless a new one requires more.
    apt_args=(-q --no-install-recommends --no-upgrade "${missing[@]}")
    # announce: say what apt will install, and name any installed package it must upgrade for them
    # ("Inst NAME [OLD] (NEW ...)" in its simulation); fails when apt cannot find the packages.
    announce() {
        local plan upgrades
        plan="$(apt-get install -s "${apt_args[@]}" 2>>"$log")" || return 1
        upgrades="$(awk '$1 == "Inst" && $3 ~ /^\[/ { gsub(/[][]/, "", $3); sub(/^[(]/, "", $4); printf "%s %s -> %s, ", $2, $3, $4 }' <<<"$plan")"
        echo "slurm/install.sh: apt-get install ${missing[*]} ($(grep -c '^Inst ' <<<"$plan" || true) packages with their dependencies)" >&2
        if [[ -n "$upgrades" ]]; then
            echo "slurm/install.sh: they need newer versions of installed packages, which apt upgrades: ${upgrades%, }" >&2
        fi
    }
    apt_install() {
        apt-get install -y "${apt_args[@]}" >>"$log" 2>&1
    }
    # Refresh the package lists only when apt cannot find or fetch the packages with the ones it has.
    if ! { announce && apt_install; }; then
        apt-get update -q >>"$log" 2>&1 || fail "apt-get update failed"
        announce || fail "apt-get cannot install ${missing[*]}"
        apt_install || fail "apt-get install ${missing[*]} failed"
    fi
fi
