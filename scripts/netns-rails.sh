#!/usr/bin/env bash
# Two stand-in hosts with two NICs each: `up` creates network namespaces <P>0 and <P>1 joined by
# two veth pairs, rail0 and rail1 on both ends, on two subnets (<NET>.0.0/24 and <NET>.1.0/24;
# host i is .(i+1)), each end shaped with `tc qdisc ... tbf` (RATE0 for rail0, RATE1 for rail1).
# `run H CMD...` runs CMD in host H with a private /dev/shm (a tmpfs of its own, as a separate
# machine has). `bench` compares a 64 MiB all-reduce on rail0 alone with rail0,rail1 (one rank
# per host, results checked), and rail1 alone. `down` removes the namespaces (the veth pairs go with them).
# `hosts N` makes N such hosts (<P>0..<P>N-1, unshaped) instead of two: each rail is a bridge
# (br0, br1) in namespace <P>sw, and host i's rail0 and rail1 are veth ends on them.
# Needs root, iproute2 and tc.
#
#   scripts/netns-rails.sh up 1gbit 1gbit     # (the defaults)
#   scripts/netns-rails.sh bench              # prints busbw per setting, and the ratio
#   scripts/netns-rails.sh up 1gbit 2gbit; scripts/netns-rails.sh bench
#   scripts/netns-rails.sh down
#
# Environment: OXR_PREFIX (namespace prefix, default oxr), OXR_NET (first two octets, default
# 10.231), RAILS (veth pairs of `up`, 2 or 3, default 2: `RAILS=3 ... up R0 R1 R2` adds rail2
# on <NET>.2.0/24, shaped with R2, default 1gbit; `bench` uses rail0 and rail1), OXR_PORT
# (rendezvous port, default 29571), PERF (the perf tool, default target/release/oxccl-perf),
# PERF_ARGS (default "all_reduce -b 64M -e 64M -n 5 -w 1"), NET (socket, the default, or ofi:
# the links run over libfabric's PROVIDER, default "tcp;ofi_rxm"; `NET="socket ofi" bench`
# runs both, one after the other).
set -euo pipefail

P=${OXR_PREFIX:-oxr}
NETS=${NET:-socket}
NET=${OXR_NET:-10.231}
NRAILS=${RAILS:-2}
PORT=${OXR_PORT:-29571}
PERF=${PERF:-target/release/oxccl-perf}
PERF_ARGS=${PERF_ARGS:-all_reduce -b 64M -e 64M -n 5 -w 1}
PROVIDER=${PROVIDER:-tcp;ofi_rxm}

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${P}([0-9]+|sw)$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
}

# hosts N: N hosts on two bridged rails (see the top).
hosts() {
  local n=$1 sw="${P}sw"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 64 ] || { echo "usage: $0 hosts N (2..64)" >&2; exit 2; }
  down
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  for r in 0 1; do
    ip -n "$sw" link add "br$r" type bridge
    ip -n "$sw" link set "br$r" up
  done
  for ((h = 0; h < n; h++)); do
    ip netns add "$P$h"
    ip -n "$P$h" link set lo up
    for r in 0 1; do
      ip -n "$P$h" link add "rail$r" type veth peer name "h${h}r$r"
      ip -n "$P$h" link set "h${h}r$r" netns "$sw"
      ip -n "$sw" link set "h${h}r$r" master "br$r"
      ip -n "$sw" link set "h${h}r$r" up
      ip -n "$P$h" addr add "$NET.$r.$((h + 1))/24" dev "rail$r"
      ip -n "$P$h" link set "rail$r" up
    done
  done
  # Every bridge port forwards (no STP: at once, but the state change is asynchronous).
  for ((t = 0; t < 50; t++)); do
    [ "$(bridge -n "$sw" link show | grep -c 'state forwarding')" -ge $((2 * n)) ] && break
    sleep 0.1
  done
  for ((h = 0; h < n; h++)); do echo "$P$h rail0 $NET.0.$((h + 1)) rail1 $NET.1.$((h + 1))"; done
}

up() {
  local rates=("${1:-1gbit}" "${2:-1gbit}" "${3:-1gbit}")
  case "$NRAILS" in 2 | 3) ;; *) echo "RAILS=$NRAILS: 2 or 3" >&2; exit 2 ;; esac
  down
  ip netns add "${P}0"
  ip netns add "${P}1"
  for h in 0 1; do ip -n "$P$h" link set lo up; done
  for r in $(seq 0 $((NRAILS - 1))); do
    ip link add "rail$r" netns "${P}0" type veth peer name "rail$r" netns "${P}1"
    for h in 0 1; do
      ip -n "$P$h" addr add "$NET.$r.$((h + 1))/24" dev "rail$r"
      ip -n "$P$h" link set "rail$r" up
      if [ "${rates[$r]}" != none ]; then
        ip netns exec "$P$h" tc qdisc add dev "rail$r" root tbf rate "${rates[$r]}" burst 1mbit latency 50ms
      fi
    done
  done
  echo "${P}0 rail0 $NET.0.1 rail1 $NET.1.1 (${rates[0]}, ${rates[1]})"
  echo "${P}1 rail0 $NET.0.2 rail1 $NET.1.2"
  if [ "$NRAILS" = 3 ]; then echo "rail2: ${P}0 $NET.2.1, ${P}1 $NET.2.2 (${rates[2]})"; fi
}

# run H CMD...: CMD in host H, with a private /dev/shm.
run() {
  local h=$1
  shift
  ip netns exec "$P$h" sh -c 'mount -t tmpfs -o size=1g oxr-shm /dev/shm && exec "$@"' sh "$@"
}

# busbw IFNAME [RAIL]: one run of PERF_ARGS on both hosts with OXCCL_SOCKET_IFNAME=IFNAME and the
# rendezvous on host 0's address of rail RAIL (default 0; a rank's address as the rendezvous
# sees it is where the others reach it, so a one-rail run must meet on that rail); prints rank
# 0's last result row.
busbw() {
  local ifname=$1 rail=${2:-0} net=${NET1:-socket} out
  out=$(mktemp)
  for h in 0 1; do
    run "$h" env OXCCL_RANK="$h" OXCCL_NRANKS=2 MASTER_ADDR="$NET.$rail.1" MASTER_PORT="$PORT" \
      OXCCL_SOCKET_IFNAME="$ifname" OXCCL_NET="$net" OXCCL_OFI_PROVIDER="$PROVIDER" OXCCL_DEBUG="${OXCCL_DEBUG:-INFO}" OXCCL_DEBUG_SUBSYS="${OXCCL_DEBUG_SUBSYS:-ALL}" \
      "$PERF" $PERF_ARGS >"$out.$h" 2>&1 &
  done
  wait
  grep -hE "via (TCP|OFI)" "$out.0" | head -1 >&2 || true
  grep -vE '^#|^$|INFO|WARN' "$out.0" | tail -1
  rm -f "$out" "$out.0" "$out.1"
}

# bench: rail0 alone, rail1 alone, both; the ratios from the out-of-place times (6th column of
# a nccl-tests row; the same bytes every run, so busbw scales as 1/time).
bench() {
  local one two both
  for NET1 in $NETS; do
    one=$(busbw =rail0)
    two=$(busbw =rail1 1)
    both=$(busbw rail0,rail1)
    echo "$NET1 rail0:        $one"
    echo "$NET1 rail1:        $two"
    echo "$NET1 rail0,rail1:  $both"
    awk -v n="$NET1" -v a="$one" -v b="$two" -v c="$both" 'BEGIN { split(a, x); split(b, y); split(c, z);
      printf "%s both/rail0 %.2f   both/(rail0+rail1) %.2f\n", n, x[6] / z[6], (1 / z[6]) / (1 / x[6] + 1 / y[6]) }'
  done
}

case "${1:-}" in
  up) up "${2:-}" "${3:-}" "${4:-}" ;;
  down) down ;;
  hosts) hosts "${2:-}" ;;
  run) shift; run "$@" ;;
  bench) bench ;;
  *) echo "usage: $0 up [RATE0 RATE1 [RATE2]] | hosts N | run H CMD... | bench | down" >&2; exit 2 ;;
esac
