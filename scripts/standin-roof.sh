#!/usr/bin/env bash
# The device all-reduce against the copy roof, on the CPU stand-in of CUDA (no GPU needed):
# the stand-in's device-to-device copy bandwidth B (bytes read + written per second, from
# gpu_kernel_bench), then 2-rank all-reduces of SIZE bytes through the direct flow (the
# default from 1 MiB) and the staged flow (OXCCL_CUDA_DIRECT=0), alternating ROUNDS times, as
# processes (oxccl-perf) and as communicators of one process driven by one thread
# (scripts/gpu-kit/threads_vs_procs.py; there the direct flow publishes the buffers in the
# boards).
# The roof for n ranks sharing one device is busbw = B (n - 1) / n^2 (B/4 for 2 ranks).
# Kernels run as one thread each (OXCCL_STANDIN_SERIAL_KERNELS=1), so a kernel costs what a
# plain loop over its bytes costs. These are stand-in figures: they show traffic and stream
# operations turned into time on this machine's CPUs, not a GPU's speed.
#
# Usage: scripts/standin-roof.sh [SIZE] [ROUNDS]     (default 256M 3)
set -euo pipefail
size="${1:-256M}"
rounds="${2:-3}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --release --lib --bin oxccl-perf --example gpu_kernel_bench >&2
dir="$root/target/standin-roof"
bash cuda-standin/build.sh "$dir" >/dev/null
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OXCCL_STANDIN_CACHE="$dir/cache" OXCCL_KERNEL_CACHE="$dir/kernels" OXCCL_STANDIN_SERIAL_KERNELS=1
bytes="$(numfmt --from=iec "$size")"
echo "== copy roof (gpu_kernel_bench $bytes)"
target/release/examples/gpu_kernel_bench "$bytes" | grep -E "^ +$bytes +float" || true
for r in $(seq "$rounds"); do
  for d in 1 0; do
    name=$([ "$d" = 1 ] && echo direct || echo staged)
    line="$(OXCCL_CUDA_DIRECT=$d target/release/oxccl-perf all_reduce --ranks 2 --mem cuda -b "$size" -e "$size" -n 5 -w 1 -c 0 2>/dev/null | grep -E "^ +$bytes ")"
    echo "round $r $name: $line"
  done
done
for r in $(seq "$rounds"); do
  for d in 1 0; do
    name=$([ "$d" = 1 ] && echo direct || echo staged)
    line="$(OXCCL_CUDA_DIRECT=$d OXCCL_LIBRARY="$root/target/release/liboxccl.so" python3 scripts/gpu-kit/threads_vs_procs.py "$bytes" - "$bytes" | grep -E '^ +[0-9]+ ' | tail -1)"
    echo "round $r threads $name (bytes, us, busbw): $line"
  done
done
