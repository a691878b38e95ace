#!/usr/bin/env bash
# Compiles every cuda/*.cu with NVIDIA's real NVRTC, CUDA 12 and CUDA 13 (PyPI wheels
# nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvrtc, installed once into build/nvrtc/), for sm_80,
# sm_90 and sm_100, with exactly the options of src/device/kernels.rs (NVRTC_OPTIONS); fails on
# any error. With the nvcc wheel's ptxas (nvidia-cuda-nvcc-cu12) it also records registers and
# spills per kernel (ptxas -v on the PTX) into build/nvrtc/ptxas-<arch>.txt and fails on spills.
# No GPU needed. Set OXCCL_SKIP_NVRTC_CHECK=1 to skip (e.g. offline).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${OXCCL_SKIP_NVRTC_CHECK:-0}" = 1 ]; then
  echo "SKIPPED: NVRTC check (OXCCL_SKIP_NVRTC_CHECK=1)"
  exit 0
fi
dir=build/nvrtc
mkdir -p "$dir"
py=$(command -v python3 || command -v python)
install() { # target-dir, packages...
  local t="$1"; shift
  if [ ! -f "$t/.done" ]; then
    echo "== downloading $* (pip, about 100 MB; cached in $t)"
    rm -rf "$t"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$t" "$@"
    touch "$t/.done"
  fi
}
install "$dir/cu12" "nvidia-cuda-nvrtc-cu12>=12.4,<13" "nvidia-cuda-nvcc-cu12>=12.4,<13"
install "$dir/cu13" "nvidia-cuda-nvrtc>=13,<14"

cc -O1 -o "$dir/nvrtc-check" scripts/nvrtc-check.c -ldl
mapfile -t opts < <(sed -n '/nvrtc-options-begin/,/nvrtc-options-end/p' src/device/kernels.rs | grep -oE '"--[^"]+"' | tr -d '"')
[ "${#opts[@]}" -gt 0 ] || { echo "nvrtc-check: no NVRTC_OPTIONS found in src/device/kernels.rs"; exit 1; }
ptxas=$(find "$dir/cu12" -name ptxas -type f | head -1 || true)
status=0
for ver in cu12 cu13; do
  lib=$(find "$dir/$ver" -name 'libnvrtc.so*' ! -name '*builtins*' | sort | tail -1)
  [ -n "$lib" ] || { echo "nvrtc-check: no libnvrtc in $dir/$ver"; exit 1; }
  libdir=$(dirname "$lib")
  for src in cuda/*.cu; do
    for arch in 80 90 100; do
      base="$dir/$(basename "$src" .cu)-$ver-$arch"
      LD_LIBRARY_PATH="$libdir" "$dir/nvrtc-check" "$lib" "$src" "sm_$arch" "$base.cubin" "${opts[@]}" || status=1
      LD_LIBRARY_PATH="$libdir" "$dir/nvrtc-check" "$lib" "$src" "compute_$arch" "$base.ptx" "${opts[@]}" >/dev/null || status=1
      if [ -n "$ptxas" ] && [ "$ver" = cu12 ] && [ -f "$base.ptx" ]; then
        out="$dir/ptxas-$(basename "$src" .cu)-sm_$arch.txt"
        "$ptxas" -arch="sm_$arch" -v "$base.ptx" -o /dev/null >"$out" 2>&1 || { cat "$out"; status=1; }
        regs=$(grep -oE 'Used [0-9]+ registers' "$out" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')
        spills=$(grep -oE '[0-9]+ bytes spill (stores|loads)' "$out" | awk '$1 > 0' | wc -l)
        echo "ptxas sm_$arch $(basename "$src"): registers per thread {${regs% }}, kernels with spills: $spills ($out)"
        [ "$spills" = 0 ] || status=1
      fi
    done
  done
done
[ $status = 0 ] && echo "== NVRTC check passed" || echo "== NVRTC check FAILED"
exit $status
