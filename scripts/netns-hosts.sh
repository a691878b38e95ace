#!/usr/bin/env bash
# Stand-in hosts on one machine: `up N` creates network namespaces oxh0..oxh{N-1}, each with a
# veth interface (oxv0 inside, oxb0 in the bridge namespace) on a bridge that lives in its own
# namespace (oxhbr), so nothing is added to the root namespace's network. Host i gets
# 10.213.0.(i+1)/24 on its veth and loopback up. `down` removes every namespace it made (the
# veth pairs and the bridge go with them). Idempotent: `up` first removes what a previous
# `up` left; `down` ignores what is already gone. Needs root and iproute2.
#
#   scripts/netns-hosts.sh up 3      # oxh0 10.213.0.1, oxh1 10.213.0.2, oxh2 10.213.0.3
#   ip netns exec oxh1 <command>     # run a "host 1" process
#   scripts/netns-hosts.sh down
#
# Environment: OXH_PREFIX (namespace prefix, default oxh), OXH_NET (first three octets, default
# 10.213.0; `none`: no IPv4 address), OXH_NET6 (an IPv6 /64 prefix such as fd00:213:0:0, unset
# by default: host i also gets OXH_NET6::(i+1)/64, without duplicate address detection so it is
# usable at once), OXH_MTU (veth MTU, default 1500: an ordinary Ethernet NIC).
set -euo pipefail

P=${OXH_PREFIX:-oxh}
NET=${OXH_NET:-10.213.0}
NET6=${OXH_NET6:-}
MTU=${OXH_MTU:-1500}
BR="${P}br"

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${P}[0-9]+$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
  ip netns del "$BR" 2>/dev/null || true
}

up() {
  local n=$1
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || { echo "usage: $0 up N (1..250)" >&2; exit 2; }
  [ "$NET" != none ] || [ -n "$NET6" ] || { echo "$0: OXH_NET=none needs OXH_NET6" >&2; exit 2; }
  down
  ip netns add "$BR"
  ip -n "$BR" link set lo up
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  for ((i = 0; i < n; i++)); do
    local ns="${P}${i}"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Create the pair inside the host namespace, then move the bridge end out.
    ip -n "$ns" link add oxv0 mtu "$MTU" type veth peer name "oxb$i" mtu "$MTU"
    ip -n "$ns" link set "oxb$i" netns "$BR"
    ip -n "$BR" link set "oxb$i" master br0
    ip -n "$BR" link set "oxb$i" up
    [ "$NET" = none ] || ip -n "$ns" addr add "$NET.$((i + 1))/24" dev oxv0
    [ -z "$NET6" ] || ip -n "$ns" addr add "$NET6::$((i + 1))/64" dev oxv0 nodad
    ip -n "$ns" link set oxv0 up
  done
  # Wait until every bridge port forwards (no STP: at once, but the state change is async).
  for ((t = 0; t < 50; t++)); do
    if [ "$(bridge -n "$BR" link show | grep -c 'state forwarding')" -ge "$n" ]; then
      break
    fi
    sleep 0.1
  done
  for ((i = 0; i < n; i++)); do
    echo "${P}${i} $([ "$NET" = none ] || echo "$NET.$((i + 1))") $([ -z "$NET6" ] || echo "$NET6::$((i + 1))") oxv0" | tr -s ' '
  done
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  *) echo "usage: $0 up N | down" >&2; exit 2 ;;
esac
