#!/usr/bin/env bash
# 2-rank all-reduce over loopback TCP (oxccl-perf) beside raw full-duplex TCP throughput
# (oxccl-iperf: same socket settings, full-size buffers) in one run. The machine's speed
# drifts by 2x within minutes, so the two are interleaved at 128 MiB and the ratio is taken
# per pair. Usage: benches/tcp_vs_raw.sh [OUT_DIR] [PAIRS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/tcp_vs_raw}
pairs=${2:-5}
mkdir -p "$out"
cargo build --release --bins -q
export OXCCL_SOCKET_IFNAME=lo
echo "# sweep: oxccl-perf all_reduce 8 B .. 128 MiB, 2 ranks, float sum"
target/release/oxccl-perf all_reduce -b 8 -e 128M -f 4 --ranks 2 -n 10 -w 3 -d float -o sum --json "$out/allreduce.json" | tee "$out/allreduce.txt"
echo "# raw full duplex at 1 MiB, 16 MiB, 128 MiB (full-size buffers)"
for s in 1M 16M 128M; do target/release/oxccl-iperf --size $s -n 5 | tail -1; done | tee "$out/raw.txt"
echo "# interleaved at 128 MiB: raw GB/s (full-size buffers), raw GB/s (1 MiB cache-hot buffer),"
echo "# all-reduce busbw GB/s (out-of-place), ratio to each raw figure"
for i in $(seq "$pairs"); do
  raw=$(target/release/oxccl-iperf --size 128M -n 3 | tail -1 | awk '{print $3}')
  hot=$(target/release/oxccl-iperf --size 128M --buf 1M -n 3 | tail -1 | awk '{print $3}')
  ar=$(target/release/oxccl-perf all_reduce -b 128M -e 128M --ranks 2 -n 5 -w 1 | awk '/^ +[0-9]/ {print $8}')
  echo "$raw $hot $ar $(awk -v a="$ar" -v r="$raw" -v h="$hot" 'BEGIN {printf "%.2f %.2f", a / r, a / h}')"
done | tee "$out/pairs.txt"
