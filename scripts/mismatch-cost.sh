#!/usr/bin/env bash
# Cost of collective mismatch detection: 8 B all-reduce on 2 local ranks, OXCCL_CHECK_MISMATCH=0
# and =1 interleaved (A/B/A/B...), ROUNDS rounds each, per transport; prints every round and the
# medians of the out-of-place time (µs per call, max over ranks), with the load average.
# Usage: scripts/mismatch-cost.sh [ROUNDS] [ITERS] [TRANSPORTS]   (defaults: 7 3000 "tcp shm");
# OXCCL_PERF=path/to/oxccl-perf measures another build; PERF_ARGS adds oxccl-perf options
# (e.g. PERF_ARGS="--bind cpu --stat median": ranks pinned as Open MPI pins them, median call).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
iters=${2:-3000}
transports=${3:-"tcp shm"}
export OXCCL_SOCKET_IFNAME=lo
perf=${OXCCL_PERF:-target/release/oxccl-perf}
[ -x "$perf" ] || cargo build --release --bin oxccl-perf
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for t in $transports; do
  off=(); on=()
  for r in $(seq "$rounds"); do
    for m in 0 1; do
      us=$(OXCCL_TRANSPORT=$t OXCCL_CHECK_MISMATCH=$m "$perf" all_reduce -b 8 -e 8 --ranks 2 -n "$iters" -w 300 ${PERF_ARGS:-} |
        awk '!/^#/ && NF >= 6 {print $6; exit}')
      echo "$t round $r check=$m: $us us"
      if [ "$m" = 0 ]; then off+=("$us"); else on+=("$us"); fi
    done
  done
  a=$(printf '%s\n' "${off[@]}" | median)
  b=$(printf '%s\n' "${on[@]}" | median)
  echo "$t: median off $a us, on $b us, cost $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%+.1f %%", (b - a) / a * 100}')"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
