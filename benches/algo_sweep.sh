#!/usr/bin/env bash
# The [B] algorithm-choice sweep: all-reduce (float sum) from 8 B to 64 MiB on 2..8 local ranks
# over loopback TCP, with the algorithm forced to ring, tree and rd (recursive doubling), and
# chosen by the cost model ("auto"). Runs are interleaved (for each repetition, each rank count:
# ring, tree, rd, auto back to back) so that the drift of a shared machine hits all alike; each
# point is the median over repetitions of the mean of the out-of-place and in-place times.
#
# Usage: benches/algo_sweep.sh [OUT_DIR [REPS]]     (defaults build/algo_sweep, 3)
#   RANKS="2 4" DOCS=/tmp benches/algo_sweep.sh     fewer rank counts; plot and table elsewhere
# Writes OUT_DIR/*.json (oxccl-perf rows), OUT_DIR/*.log (OXCCL_DEBUG=INFO: algorithm and chunk), then
# runs benches/algo_sweep.py, which writes docs/algo_sweep.png, docs/algo_sweep.md and prints the
# share of points where auto is within 10% of the faster of ring and tree, and the calibration.
# Needs matplotlib: python3 -m venv build/venv && build/venv/bin/pip install matplotlib
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/algo_sweep}
reps=${2:-3}
ranks=${RANKS:-"2 3 4 5 6 7 8"}
cargo build --release --bin oxccl-perf
perf=target/release/oxccl-perf
mkdir -p "$out"
export OXCCL_SOCKET_IFNAME=lo
run() { # algo n rep
  local algo=$1 n=$2 rep=$3 tag="$out/n$2-$1-r$3"
  local envs=(OXCCL_ALGO="$algo" OXCCL_DEBUG=INFO)
  [ "$algo" = auto ] && envs=(OXCCL_ALGO= OXCCL_DEBUG=INFO)
  # Quick mode: 8 B .. 32 MiB by x4, iterations scaled to move 128 MiB per size; then 64 MiB.
  env "${envs[@]}" "$perf" all_reduce --ranks "$n" -c 0 -T 900 --json "$tag-a.json" >/dev/null 2>"$tag-a.log"
  env "${envs[@]}" "$perf" all_reduce --ranks "$n" -b 64M -e 64M -n 3 -w 1 -c 0 -T 900 --json "$tag-b.json" >/dev/null 2>"$tag-b.log"
}
for rep in $(seq 1 "$reps"); do
  for n in $ranks; do
    for algo in ring tree rd auto; do
      echo "rep $rep/$reps: $n ranks, $algo" >&2
      run "$algo" "$n" "$rep"
    done
  done
done
py=build/venv/bin/python
[ -x "$py" ] || py=python3
"$py" benches/algo_sweep.py "$out" --docs "${DOCS:-docs}"
