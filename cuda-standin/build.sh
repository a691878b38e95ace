#!/usr/bin/env bash
# Builds the CUDA stand-in (libcuda.so.1, libnvrtc.so, libcudart.so) into $1 (default
# target/cuda-standin). Test support only: nothing here is linked into liboxccl. Put the output
# directory first on LD_LIBRARY_PATH to run a program on it. Safe to run concurrently: each
# library is built under a temporary name and renamed into place.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
out="${1:-$root/target/cuda-standin}"
mkdir -p "$out"
cc="${CC:-cc}"
flags=(-std=gnu11 -O2 -g -fPIC -shared -Wall -Wextra -Werror -Wno-unused-parameter -fvisibility=hidden -pthread)
tmp="$out/.tmp.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
"$cc" "${flags[@]}" -Wl,-soname,libcuda.so.1 -o "$tmp/libcuda.so.1" "$here/cuda.c" -ldl
"$cc" "${flags[@]}" -Wl,-soname,libnvrtc.so -DOXCCL_STANDIN_SHIM="\"$root/cuda/host_shim.h\"" \
  -o "$tmp/libnvrtc.so" "$here/nvrtc.c"
"$cc" "${flags[@]}" -Wl,-soname,libcudart.so -o "$tmp/libcudart.so" "$here/cudart.c" \
  -L"$tmp" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
ln -sf libcuda.so.1 "$tmp/libcuda.so"
ln -sf libnvrtc.so "$tmp/libnvrtc.so.13"
for f in libcuda.so.1 libcuda.so libnvrtc.so libnvrtc.so.13 libcudart.so; do mv -f "$tmp/$f" "$out/$f"; done
echo "$out"
