#!/usr/bin/env bash
# System packages for tests/slurm on a fresh Debian machine (run as root): Debian's Slurm
# (slurmctld, slurmd, the client tools) and MUNGE. Only the binaries: the tests start their own
# private daemons (tests/slurm/local_cluster.py), so no system service is started or enabled here.
# Safe to run again: installed packages are kept.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -gt 0 ]; then
    # The packages' postinst runs `invoke-rc.d <service> start`, which on a machine with systemd
    # or SysV init would start munged and slurmctld/slurmd. A policy-rc.d that answers 101
    # ("forbidden") makes invoke-rc.d skip the start. A policy already there (Docker images ship
    # one that answers 101) is left as it is.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The postinst also enables the services for the next boot (update-rc.d, deb-systemd-helper):
    # undo that for the packages installed here, never for ones that were there before.
    for p in "${missing[@]}"; do
        case "$p" in munge | slurmctld | slurmd) ;; *) continue ;; esac
        update-rc.d "$p" disable >/dev/null 2>&1 || true
        deb-systemd-helper disable "$p.service" >/dev/null 2>&1 || true
    done
fi

for daemon in slurmctld slurmd munged; do
    PATH="$PATH:/usr/sbin" command -v "$daemon" >/dev/null || { echo "slurm-setup: $daemon not found" >&2; exit 1; }
done
echo "$(PATH="$PATH:/usr/sbin" slurmctld -V), $(PATH="$PATH:/usr/sbin" munged --version | head -1)"
