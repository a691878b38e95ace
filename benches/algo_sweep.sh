#!/usr/bin/env bash
# The [B] algorithm-choice sweep: all-reduce (float sum) from 8 B to 64 MiB on 2..8 local ranks
# over loopback TCP, comparing the algorithm forced to ring, tree and rd (recursive doubling)
# with the cost model's choice ("auto"). oxccl-perf --algo runs them side by side inside one
# set of processes: for each size, --rounds rounds of ring, tree, rd, auto in turn, each row the
# median round, so the drift of a shared machine hits all four alike. A point's time is the mean
# of the out-of-place and in-place times.
#
# Usage: benches/algo_sweep.sh [OUT_DIR [ROUNDS]]   (defaults build/algo_sweep, 3)
#   RANKS="2 4" DOCS=/tmp benches/algo_sweep.sh     fewer rank counts; plot and table elsewhere
# Writes OUT_DIR/n<ranks>-{small,64M}.json (oxccl-perf rows) and .log (OXCCL_DEBUG=INFO: each
# algorithm's chunk), then benches/algo_sweep.py writes docs/algo_sweep.png and
# docs/algo_sweep.md, prints the share of points where auto is within 10% of the faster of
# ring and tree, and fits the cost model's alpha, beta, gamma to the forced runs.
# Needs matplotlib: python3 -m venv build/venv && build/venv/bin/pip install matplotlib
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/algo_sweep}
rounds=${2:-3}
ranks=${RANKS:-"2 3 4 5 6 7 8"}
cargo build --release --bin oxccl-perf
perf=target/release/oxccl-perf
mkdir -p "$out"
export OXCCL_SOCKET_IFNAME=lo OXCCL_DEBUG=INFO
unset OXCCL_ALGO NCCL_ALGO OXCCL_CHUNK_SIZE NCCL_CHUNK_SIZE
cmp=(--algo ring,tree,rd,auto --rounds "$rounds" -c 0 -T 3000)
for n in $ranks; do
  echo "$n ranks: 8 B .. 32 MiB" >&2
  # Quick mode: 8 B .. 32 MiB by x4, iterations scaled to move 128 MiB per size.
  "$perf" all_reduce --ranks "$n" "${cmp[@]}" --json "$out/n$n-small.json" >"$out/n$n-small.txt" 2>"$out/n$n-small.log"
  echo "$n ranks: 64 MiB" >&2
  "$perf" all_reduce --ranks "$n" -b 64M -e 64M -n 2 -w 1 "${cmp[@]}" --json "$out/n$n-64M.json" >"$out/n$n-64M.txt" 2>"$out/n$n-64M.log"
done
py=build/venv/bin/python
[ -x "$py" ] || py=python3
"$py" benches/algo_sweep.py "$out" --docs "${DOCS:-docs}"
