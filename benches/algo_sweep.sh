#!/usr/bin/env bash
# The [B] algorithm-choice sweep: all-reduce (float sum) from 8 B to 64 MiB on 2..8 ranks of this
# host, comparing the algorithm forced to ring, tree and rd (recursive doubling) with what a
# program gets when nothing is forced ("auto": the one-shot exchange on two ranks below
# OXCCL_ONESHOT_BYTES, else the cost model's choice). oxccl-perf --algo runs them side by side
# inside one set of processes: for each size, --rounds rounds of ring, tree, rd, auto in turn,
# each row the median round, so the drift of a shared machine hits all four alike. A point's time
# is the mean of the out-of-place and in-place times.
#
# Usage: benches/algo_sweep.sh [OUT_DIR [ROUNDS]]   (defaults build/algo_sweep, 5)
#   RANKS="2 4"        rank counts (default 2..8)
#   TRANSPORT=tcp      links over loopback TCP instead of shared memory (OXCCL_TRANSPORT)
#   DOCS=/tmp NAME=_x  where benches/algo_sweep.py writes algo_sweep<NAME>.{md,png} (docs, "")
# Writes OUT_DIR/n<ranks>-{small,large,64M}.json (oxccl-perf rows) and .log (OXCCL_DEBUG=INFO:
# each algorithm's chunk and predicted time), then benches/algo_sweep.py writes the table and the
# plot, prints the share of points where auto is within 10% of the faster of ring and tree, and
# fits the cost model's alpha, beta, gamma to the forced runs.
# Needs matplotlib and numpy: python3 -m venv build/venv && build/venv/bin/pip install matplotlib numpy
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/algo_sweep}
rounds=${2:-5}
ranks=${RANKS:-"2 3 4 5 6 7 8"}
cargo build --release --bin oxccl-perf
perf=target/release/oxccl-perf
mkdir -p "$out"
export OXCCL_SOCKET_IFNAME=lo OXCCL_DEBUG=INFO OXCCL_TRANSPORT=${TRANSPORT:-auto}
unset OXCCL_ALGO NCCL_ALGO OXCCL_CHUNK_SIZE NCCL_CHUNK_SIZE OXCCL_ONESHOT_BYTES
cmp=(--algo ring,tree,rd,auto --rounds "$rounds" -c 0 -T 3000)
uptime >"$out/uptime.txt"
for n in $ranks; do
  echo "$n ranks ($OXCCL_TRANSPORT): 8 B .. 128 KiB, 512 KiB .. 32 MiB, 64 MiB (x4 steps)" >&2
  run() { # name, then size options
    local name=$1
    shift
    "$perf" all_reduce --ranks "$n" "$@" "${cmp[@]}" --json "$out/n$n-$name.json" >"$out/n$n-$name.txt" 2>"$out/n$n-$name.log"
  }
  # Many iterations where a call is short, so a time slice lost to another process averages out.
  run small -b 8 -e 128K -f 4 -n 50 -w 10
  run large -b 512K -e 32M -f 4 -n 10 -w 2
  run 64M -b 64M -e 64M -n 3 -w 1
  uptime >>"$out/uptime.txt"
done
py=build/venv/bin/python
[ -x "$py" ] || py=python3
"$py" benches/algo_sweep.py "$out" --docs "${DOCS:-docs}" --name "${NAME:-}"
