#!/usr/bin/env bash
# Makes oxccl loadable as NCCL: copies <dir>/liboxccl.so to <dir>/libnccl.so.2 with SONAME
# libnccl.so.2 (patchelf; installed with apt-get when missing) and links libnccl.so to it, so
# `-lnccl` at link time and libnccl.so.2 at run time both resolve to oxccl.
# Usage: scripts/install-nccl-alias.sh [DIR]   (default: target/release)
set -euo pipefail
dir="${1:-$(dirname "$0")/../target/release}"
[ -f "$dir/liboxccl.so" ] || { echo "no liboxccl.so in $dir (cargo build --release first)" >&2; exit 1; }
if ! command -v patchelf >/dev/null 2>&1; then
  echo "== installing patchelf (apt-get)" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf >&2
fi
tmp="$dir/.libnccl.so.2.$$"
cp "$dir/liboxccl.so" "$tmp"
patchelf --set-soname libnccl.so.2 "$tmp"
mv -f "$tmp" "$dir/libnccl.so.2"
ln -sfn libnccl.so.2 "$dir/libnccl.so"
echo "$dir/libnccl.so.2"
