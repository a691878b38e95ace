#!/usr/bin/env bash
# The [B] algorithm-choice sweep: all-reduce (float sum) from 8 B to 64 MiB on 2..8 ranks of this
# host, comparing the algorithm forced to ring, tree and rd (recursive doubling) with what a
# program gets when nothing is forced ("auto": the one-shot exchange on two ranks below
# OXCCL_ONESHOT_BYTES, else the cost model's choice). oxccl-perf --algo runs them side by side
# inside one set of processes: for each size, --rounds rounds of ring, tree, rd, auto in turn,
# each row the median round, so the drift of a shared machine hits all four alike. A point's time
# is the mean of the out-of-place and in-place times.
#
# Usage: benches/algo_sweep.sh [OUT_DIR [ROUNDS]]   (defaults build/algo_sweep, 9)
#   RANKS="2 4"        rank counts (default 2..8)
#   LROUNDS=15         rounds from 8 MiB up (default ROUNDS + 6)
#   TRANSPORT=tcp      links over loopback TCP instead of shared memory (OXCCL_TRANSPORT)
#   DOCS=/tmp NAME=_x  where benches/algo_sweep.py writes algo_sweep<NAME>.{md,png} (docs, "")
# Writes OUT_DIR/n<ranks>-{small,mid,large,64M}.json (oxccl-perf rows) and .log (OXCCL_DEBUG=INFO:
# each algorithm's chunk and predicted time), then benches/algo_sweep.py writes the table and the
# plot, prints the share of points where auto is within 10% of the faster of ring and tree, and
# fits the cost model's alpha, beta, gamma to the forced runs.
# Needs matplotlib and numpy: python3 -m venv build/venv && build/venv/bin/pip install matplotlib numpy
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/algo_sweep}
rounds=${2:-9}
ranks=${RANKS:-"2 3 4 5 6 7 8"}
cargo build --release --bin oxccl-perf
perf=target/release/oxccl-perf
mkdir -p "$out"
export OXCCL_SOCKET_IFNAME=lo OXCCL_DEBUG=INFO OXCCL_TRANSPORT=${TRANSPORT:-auto}
unset OXCCL_ALGO NCCL_ALGO OXCCL_CHUNK_SIZE NCCL_CHUNK_SIZE OXCCL_ONESHOT_BYTES
# Long calls suffer most from a time slice lost to another process: more rounds for them.
lrounds=${LROUNDS:-$((rounds + 6))}
opts=(-c 0 -T 3000 --stat median)
uptime >"$out/uptime.txt"
for n in $ranks; do
  echo "$n ranks (OXCCL_TRANSPORT=$OXCCL_TRANSPORT): 8 B .. 64 MiB" >&2
  run() { # name, algorithms, rounds, then size options
    local name=$1 algos=$2 r=$3
    shift 3
    "$perf" all_reduce --ranks "$n" "$@" --algo "$algos" --rounds "$r" "${opts[@]}" --json "$out/n$n-$name.json" \
      >"$out/n$n-$name.txt" 2>"$out/n$n-$name.log"
  }
  # Short calls: many iterations, so a time slice lost to another process averages out.
  run small ring,tree,rd,auto "$rounds" -b 8 -e 128K -f 4 -n 20 -w 5
  run mid ring,tree,rd,auto "$rounds" -b 512K -e 2M -f 4 -n 5 -w 1
  # From 8 MiB recursive doubling (log2(n) times the ring's traffic) is far behind; leaving it out
  # keeps the rounds short, so that each round compares ring, tree and auto under the same load.
  run large ring,tree,auto "$lrounds" -b 8M -e 32M -f 4 -n 2 -w 1
  run 64M ring,tree,auto "$lrounds" -b 64M -e 64M -n 1 -w 1
  uptime >>"$out/uptime.txt"
done
py=build/venv/bin/python
[ -x "$py" ] || py=python3
"$py" benches/algo_sweep.py "$out" --docs "${DOCS:-docs}" --name "${NAME:-}"
