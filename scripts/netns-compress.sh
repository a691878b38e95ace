#!/bin/bash
# Compressed all-reduce between two stand-in hosts: two network namespaces (c3m0, c3m1) joined by
# a veth shaped to 1 Gbit/s (tc tbf), PER_HOST ranks per namespace (default 2: ranks 0-1 in c3m0,
# 2-3 in c3m1; 1: one rank per host), f32 sum all-reduce of 64 MiB, modes off/bf16/fp8/int8,
# ROUNDS rounds. Per mode and round: wall time (median of 10 calls after 1 warm-up, slowest
# rank) and CPU time per call (-C 1: the busiest rank's process, every thread, mean of 10), out
# of place and in place; ratios are busbw(mode)/busbw(off) of the same round. Needs root.
#   usage: [PER_HOST=1|2] scripts/netns-compress.sh [OXCCL_PERF_BINARY (default: target/release/oxccl-perf)] [ROUNDS (2)]
set -u
BIN=$(readlink -f "${1:-target/release/oxccl-perf}")
ROUNDS=${2:-2}
PER_HOST=${PER_HOST:-2}
N=$((2 * PER_HOST))
NS=c3m; NET=10.245.19; PORT=29611
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
cleanup() { ip netns del ${NS}0 2>/dev/null; ip netns del ${NS}1 2>/dev/null; }
trap cleanup EXIT
cleanup
ip netns add ${NS}0 && ip netns add ${NS}1 && ip link add ${NS}v0 type veth peer name ${NS}v1 || exit 1
ip link set ${NS}v0 netns ${NS}0; ip link set ${NS}v1 netns ${NS}1
ip -n ${NS}0 addr add $NET.1/24 dev ${NS}v0; ip -n ${NS}1 addr add $NET.2/24 dev ${NS}v1
for i in 0 1; do ip -n ${NS}$i link set lo up; ip -n ${NS}$i link set ${NS}v$i up
  ip netns exec ${NS}$i tc qdisc add dev ${NS}v$i root tbf rate 1gbit burst 1mbit latency 50ms; done
OUT=$(mktemp -d)
# run MODE ARGS... -> "out_time in_time wrong_out wrong_in" (times in ms)
run() {
  local mode=$1; shift
  for r in $(seq 0 $((N - 1))); do ip netns exec ${NS}$((r / PER_HOST)) env OXCCL_RANK=$r OXCCL_NRANKS=$N \
    MASTER_ADDR=$NET.1 MASTER_PORT=$PORT OXCCL_SOCKET_IFNAME=${NS}v \
    "$BIN" all_reduce -b 64M -e 64M -n 10 -w 1 --compress $mode "$@" > $OUT/r$r 2>&1 & done; wait
  awk '$1 == 67108864 { printf "%.1f %.1f %s %s\n", $6/1000, $10/1000, $9, $13; f=1 } END { if (!f) print "FAIL FAIL - -" }' $OUT/r0
}
echo "# $(date -u) $BIN; $PER_HOST rank(s) per host; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "| round | mode | wall out (ms) | ×off | wall in (ms) | ×off | CPU out (ms/call) | CPU in | #wrong out/in |\n|---|---|---|---|---|---|---|---|---|\n"
for round in $(seq 1 $ROUNDS); do
  for mode in off bf16 fp8 int8; do
    read wo wi eo ei < <(run $mode --stat median)
    read co ci _ _ < <(run $mode -C 1 -c 0)
    [ $mode = off ] && { offo=$wo; offi=$wi; }
    ro=$(awk -v a=$offo -v b=$wo 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "-" }')
    ri=$(awk -v a=$offi -v b=$wi 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "-" }')
    echo "| $round | $mode | $wo | $ro | $wi | $ri | $co | $ci | $eo/$ei |"
  done
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf $OUT
