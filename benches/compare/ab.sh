#!/usr/bin/env bash
# Interleaved A/B of oxccl-perf all-reduce settings on one size: ROUNDS rounds, each running
# every configuration once in turn; prints each configuration's per-round busbw (GB/s, out of
# place/in place), or time per call in µs with TIME=1, and the load average.
#
#   bash benches/compare/ab.sh SIZE ROUNDS CONFIG...
#     CONFIG: "-" (defaults) or space-separated VAR=VALUE environment settings
#   env: ITERS (timed calls, default 500), RANKS (default 2), EXTRA (more oxccl-perf flags)
#
#   EXTRA="--bind none" bash benches/compare/ab.sh 128M 3 - "OXCCL_SHM_RING=4M"   # default --bind auto
#   TIME=1 ITERS=20000 bash benches/compare/ab.sh 8 4 - "OXCCL_SPIN_US=1000"
set -euo pipefail
cd "$(dirname "$0")/../.."
size=$1; rounds=$2; shift 2
export OXCCL_SOCKET_IFNAME=lo
iters=${ITERS:-500}
declare -A res
for _ in $(seq "$rounds"); do
  for cfg in "$@"; do
    e=(); [ "$cfg" != "-" ] && read -r -a e <<< "$cfg"
    # shellcheck disable=SC2086
    line=$(env "${e[@]}" target/release/oxccl-perf all_reduce -b "$size" -e "$size" -n "$iters" \
      -w $((iters / 10 + 2)) -c 0 --stat median --ranks "${RANKS:-2}" ${EXTRA:-} | grep -v "^#" | tail -1)
    if [ -n "${TIME:-}" ]; then cols='{print $6 "/" $10}'; else cols='{print $8 "/" $12}'; fi
    res["$cfg"]+="$(echo "$line" | awk "$cols") "
  done
done
for cfg in "$@"; do echo "$cfg: ${res[$cfg]}"; done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
