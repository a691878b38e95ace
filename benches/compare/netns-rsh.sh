#!/usr/bin/env bash
# Open MPI launch agent (plm_rsh_agent) for namespace hosts of scripts/netns-hosts.sh: instead of
# ssh to HOST, runs the command in the namespace that owns HOST's address (10.213.0.(i+1) is
# oxh<i>; OXH_NET / OXH_PREFIX as in netns-hosts.sh).
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done   # ssh-style options, if any
host=$1
shift
net=${OXH_NET:-10.213.0}
i=$(( ${host##*.} - 1 ))
[ "${host%.*}" = "$net" ] || { echo "netns-rsh: $host is not in $net.0/24" >&2; exit 1; }
exec ip netns exec "${OXH_PREFIX:-oxh}$i" sh -c "$*"
