#!/usr/bin/env bash
# Installs oxccl for C/C++ users under PREFIX:
#   PREFIX/include/{nccl.h,oxccl.h}
#   PREFIX/lib/liboxccl.so.X.Y.Z (SONAME liboxccl.so.<major>, or .so.0.<minor> before 1.0, as
#       cargo-c names it), with liboxccl.so.<soversion> and liboxccl.so links
#   PREFIX/lib/libnccl.so.2 (the same library, SONAME libnccl.so.2) and libnccl.so -> it
#   PREFIX/lib/pkgconfig/{oxccl,nccl}.pc       pkg-config --cflags --libs oxccl (or nccl)
#   PREFIX/lib/cmake/oxccl/oxcclConfig*.cmake  find_package(oxccl): oxccl::oxccl, oxccl::nccl
# The libraries carry no rpath; a program built against a PREFIX outside the loader's path
# finds them with -Wl,-rpath,PREFIX/lib (CMake adds it for imported targets), LD_LIBRARY_PATH,
# or ldconfig.
#
# Usage: scripts/install.sh PREFIX [--lib-dir DIR]
#   --lib-dir DIR: take liboxccl.so from DIR instead of running `cargo build --release --lib`.
#
# Why not cargo-c: it does this for Rust cdylibs, but it must be built from crates.io first:
# `cargo install cargo-c@0.10.24` (the newest needs rustc 1.97) had not finished after 40 min
# on this project's shared 2-core machine (niced, load ~20), still compiling its gix/cargo
# dependencies. This script uses cargo's own output and the templates in packaging/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { sed -n '2,17p' "$0" >&2; exit 2; }
prefix=$1
shift
libdir_in=""
while [ $# -gt 0 ]; do
  case "$1" in
    --lib-dir) libdir_in=$2; shift 2 ;;
    *) echo "unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [ -z "$libdir_in" ]; then
  (cd "$root" && cargo build --release --lib)
  libdir_in="$root/target/release"
fi
[ -f "$libdir_in/liboxccl.so" ] || { echo "no liboxccl.so in $libdir_in" >&2; exit 1; }
if ! command -v patchelf >/dev/null 2>&1; then
  echo "== installing patchelf (apt-get)" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf >&2
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)
IFS=. read -r major minor _patch <<<"$version"
if [ "$major" = 0 ]; then soversion="0.$minor"; else soversion="$major"; fi
soname="liboxccl.so.$soversion"
nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$root/include/oxccl.h" | paste -sd.)
[ -n "$nccl_version" ] || nccl_version=2

mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
lib="$prefix/lib"
mkdir -p "$prefix/include" "$lib/pkgconfig" "$lib/cmake/oxccl"

install -m 644 "$root/include/nccl.h" "$root/include/oxccl.h" "$prefix/include/"

tmp="$lib/.liboxccl.$$"
cp "$libdir_in/liboxccl.so" "$tmp"
patchelf --set-soname "$soname" "$tmp"
chmod 755 "$tmp"
mv -f "$tmp" "$lib/liboxccl.so.$version"
ln -sfn "liboxccl.so.$version" "$lib/$soname"
ln -sfn "$soname" "$lib/liboxccl.so"

cp "$libdir_in/liboxccl.so" "$tmp"
patchelf --set-soname libnccl.so.2 "$tmp"
chmod 755 "$tmp"
mv -f "$tmp" "$lib/libnccl.so.2"
ln -sfn libnccl.so.2 "$lib/libnccl.so"

subst() {
  sed -e "s|@PREFIX@|$prefix|g" -e "s|@VERSION@|$version|g" -e "s|@NCCL_VERSION@|$nccl_version|g" \
    -e "s|@SONAME@|$soname|g" -e "s|@MAJOR@|$major|g" -e "s|@MINOR@|$minor|g" "$1" >"$2"
}
subst "$root/packaging/oxccl.pc.in" "$lib/pkgconfig/oxccl.pc"
subst "$root/packaging/nccl.pc.in" "$lib/pkgconfig/nccl.pc"
subst "$root/packaging/oxcclConfig.cmake.in" "$lib/cmake/oxccl/oxcclConfig.cmake"
subst "$root/packaging/oxcclConfigVersion.cmake.in" "$lib/cmake/oxccl/oxcclConfigVersion.cmake"

echo "oxccl $version installed under $prefix (SONAME $soname; libnccl.so.2 alias)"
echo "  pkg-config: PKG_CONFIG_PATH=$lib/pkgconfig pkg-config --cflags --libs oxccl"
echo "  CMake:      -DCMAKE_PREFIX_PATH=$prefix, then find_package(oxccl) and oxccl::oxccl"
