#!/usr/bin/env bash
# Compiles every cuda/*.cu with NVIDIA's real NVRTC, CUDA 12 and CUDA 13 (PyPI wheels
# nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvrtc, installed once into build/nvrtc/), for sm_80,
# sm_90 and sm_100, with exactly the options of src/device/kernels.rs (NVRTC_OPTIONS), every
# entry point at once; fails on any error. CUDA 13 builds cubins (what the library loads); CUDA
# 12 builds PTX, which the nvcc wheel's ptxas (nvidia-cuda-nvcc-cu12) compiles for the same
# arch, recording registers and spills per kernel (ptxas -v) into build/nvrtc/ptxas-<arch>.txt
# and failing on spills. (A cubin and PTX of one NVRTC for one arch share the front end: each
# pair is compiled once.) No GPU needed. Set OXCCL_SKIP_NVRTC_CHECK=1 to skip (e.g. offline).
#
# `scripts/nvrtc-check.sh first-call` instead times, with CUDA 13 for sm_90 and no cache, the
# units the library compiles before the first result of an f32 sum all-reduce (the set-up's
# probe, u8 divide/scale, and the f32 sum's reduce-copy and fold; src/device/kernels.rs), each
# compiled as the library does (the selection's -D options); it fails when they take more than
# 3 s of CPU. OXCCL_NVRTC_WHOLE=1 also times the whole file, for comparison.
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
[ "${1:-}" = first-call ] || install "$dir/cu12" "nvidia-cuda-nvrtc-cu12>=12.4,<13" "nvidia-cuda-nvcc-cu12>=12.4,<13"
install "$dir/cu13" "nvidia-cuda-nvrtc>=13,<14"

cc -O1 -o "$dir/nvrtc-check" scripts/nvrtc-check.c -ldl
mapfile -t opts < <(sed -n '/nvrtc-options-begin/,/nvrtc-options-end/p' src/device/kernels.rs | grep -oE '"--[^"]+"' | tr -d '"')
[ "${#opts[@]}" -gt 0 ] || { echo "nvrtc-check: no NVRTC_OPTIONS found in src/device/kernels.rs"; exit 1; }
ptxas=$(find "$dir/cu12" -name ptxas -type f 2>/dev/null | head -1 || true)
if [ "${1:-}" = first-call ]; then
  lib=$(find "$dir/cu13" -name 'libnvrtc.so*' ! -name '*builtins*' | sort | tail -1)
  TIMEFORMAT='%U %S %R'
  timed() { # label, -D options...: compiles the selection, prints CPU and wall seconds, adds the CPU to $total
    local label="$1" t; shift
    t=$( { time LD_LIBRARY_PATH="$(dirname "$lib")" "$dir/nvrtc-check" "$lib" cuda/reduce.cu sm_90 \
      "$dir/first-call.cubin" "${opts[@]}" "$@" >/dev/null; } 2>&1 ) || { echo "$t"; exit 1; }
    read -r u s w <<<"$t"
    cpu=$(awk -v u="$u" -v s="$s" 'BEGIN{printf "%.2f", u+s}')
    printf 'NVRTC 13.x sm_90 %-22s %6s s CPU %6s s wall\n' "$label" "$cpu" "$w"
  }
  timed "probe (u8 divide/scale)" -DOX_SEL_TYPE=u8 -DOX_SEL_MAP=1; c1=$cpu
  timed "f32 sum" -DOX_SEL_TYPE=f32 -DOX_SEL_OP=sum; c2=$cpu
  total=$(awk -v a="$c1" -v b="$c2" 'BEGIN{printf "%.2f", a+b}')
  echo "== first f32 sum all-reduce, cold cache: $total s of NVRTC CPU (target <= 3 s)"
  [ "${OXCCL_NVRTC_WHOLE:-0}" = 1 ] && timed "every entry point" && echo "== (the whole file: $cpu s)"
  awk -v t="$total" 'BEGIN{exit !(t <= 3)}'
  exit
fi
# one VER SRC ARCH: compiles one (NVRTC version, file, arch) job; its output goes to its own log.
one() {
  local ver="$1" src="$2" arch="$3" lib libdir base out regs spills rc=0
  lib=$(find "$dir/$ver" -name 'libnvrtc.so*' ! -name '*builtins*' | sort | tail -1)
  [ -n "$lib" ] || { echo "nvrtc-check: no libnvrtc in $dir/$ver"; return 1; }
  libdir=$(dirname "$lib")
  base="$dir/$(basename "$src" .cu)-$ver-$arch"
  if [ "$ver" = cu13 ]; then
    LD_LIBRARY_PATH="$libdir" "$dir/nvrtc-check" "$lib" "$src" "sm_$arch" "$base.cubin" "${opts[@]}" || rc=1
  else
    rm -f "$base.ptx"
    LD_LIBRARY_PATH="$libdir" "$dir/nvrtc-check" "$lib" "$src" "compute_$arch" "$base.ptx" "${opts[@]}" || rc=1
  fi
  if [ -n "$ptxas" ] && [ "$ver" = cu12 ] && [ -f "$base.ptx" ]; then
    out="$dir/ptxas-$(basename "$src" .cu)-sm_$arch.txt"
    "$ptxas" -arch="sm_$arch" -v "$base.ptx" -o /dev/null >"$out" 2>&1 || { cat "$out"; rc=1; }
    regs=$(grep -oE 'Used [0-9]+ registers' "$out" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')
    spills=$(grep -oE '[0-9]+ bytes spill (stores|loads)' "$out" | awk '$1 > 0' | wc -l)
    echo "ptxas sm_$arch $(basename "$src"): registers per thread {${regs% }}, kernels with spills: $spills ($out)"
    [ "$spills" = 0 ] || rc=1
  fi
  return $rc
}
# The jobs are independent: run as many at once as there are CPUs (each NVRTC is one thread),
# then print each job's output in order.
jobs_max=$(nproc 2>/dev/null || echo 2)
names=()
for ver in cu12 cu13; do
  for src in cuda/*.cu; do
    for arch in 80 90 100; do
      while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
      name="$ver-$(basename "$src" .cu)-sm_$arch"
      rm -f "$dir/job-$name.rc"
      { one "$ver" "$src" "$arch" >"$dir/job-$name.log" 2>&1; echo $? >"$dir/job-$name.rc"; } &
      names+=("$name")
    done
  done
done
wait
status=0
for name in "${names[@]}"; do
  cat "$dir/job-$name.log"
  [ "$(cat "$dir/job-$name.rc" 2>/dev/null)" = 0 ] || { status=1; echo "!! NVRTC job $name failed"; }
done
[ $status = 0 ] && echo "== NVRTC check passed" || echo "== NVRTC check FAILED"
exit $status
