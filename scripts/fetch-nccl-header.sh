#!/usr/bin/env bash
# Downloads NVIDIA's nvidia-nccl-cu12 wheel from PyPI once (cached in build/, never committed)
# and unpacks its include/ directory. Prints the directory holding nccl.h; exits 2 when the
# wheel cannot be had (offline), so callers can skip visibly.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="$root/build/nvidia-nccl"
version="${OXCCL_NCCL_WHEEL_VERSION:-2.32.3}"
inc="$cache/nvidia/nccl/include"
if [ ! -f "$inc/nccl.h" ]; then
  mkdir -p "$cache"
  whl=$(ls "$cache"/nvidia_nccl_cu12-"$version"-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    echo "== downloading NVIDIA's nvidia-nccl-cu12==$version wheel (~340 MB, once; cached in build/nvidia-nccl)" >&2
    timeout 600 python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache" "nvidia-nccl-cu12==$version" >&2 || exit 2
    whl=$(ls "$cache"/nvidia_nccl_cu12-"$version"-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || exit 2
  fi
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if '/include/' in n]" "$whl" "$cache" || exit 2
fi
echo "$inc"
