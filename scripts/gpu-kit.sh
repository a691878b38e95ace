#!/usr/bin/env bash
# Builds the GPU check kit: a self-contained, relocatable folder that checks oxccl's device path
# on a machine with no Rust toolchain and no network (needs only bash, coreutils and python3
# there). See docs/GPU.md.
#
# Usage: scripts/gpu-kit.sh DIR [--prebuilt]
#   DIR          the kit folder to (re)create
#   --prebuilt   build nothing: take the release build already in the target directory
#                (target/release and the newest test executables in target/release/deps);
#                for use from `cargo test`, where a cargo inside would wait on cargo's lock
#
# DIR holds: run (the runner: DIR/run [--quick] [--standin]), bin/ (stripped test executables of
# the device suites, oxccl-perf, gpu_kernel_bench), lib/ (liboxccl.so and its libnccl.so.2
# alias), python/oxccl (the Python package), tools/ (device information, torch checks),
# standin/ (the CPU stand-in of CUDA with its kernel image prebuilt, when cc is here) and
# KIT (what was built from which commit).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:?usage: scripts/gpu-kit.sh DIR [--prebuilt]}"
prebuilt=0
[ "${2:-}" = --prebuilt ] && prebuilt=1
target="${CARGO_TARGET_DIR:-$root/target}"
rel="$target/release"
suites=(gpu device_standin device_colls device_failures device_sync_semantics device_small device_window device_graph
  device_group device_vmm device_late_peer device_async)
# The device tool carries at most 64 MiB: the kit and the tracked tree (about 5 MiB) together.
limit_mib=56

rm -rf "$dir"
mkdir -p "$dir"/{bin,lib,tools,python,standin}
dir="$(cd "$dir" && pwd)"

declare -A exe=()
if [ "$prebuilt" = 0 ]; then
  cd "$root"
  echo "== cargo build --release (oxccl-perf, gpu_kernel_bench, liboxccl.so)" >&2
  cargo build --release --bin oxccl-perf --example gpu_kernel_bench --lib >&2
  args=()
  for s in "${suites[@]}"; do args+=(--test "$s"); done
  echo "== cargo test --release --no-run ${args[*]}" >&2
  json="$(cargo test --release --no-run --message-format=json "${args[@]}")"
  while read -r name path; do exe[$name]="$path"; done < <(python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' <<<"$json")
else
  for s in "${suites[@]}"; do
    # The newest executable named <suite>-<16 hex digits>: the one this build made.
    f="$(ls -t "$rel"/deps/"$s"-???????????????? 2>/dev/null | head -n 1 || true)"
    [ -n "$f" ] && [ -x "$f" ] && exe[$s]="$f"
  done
fi

missing=()
for s in "${suites[@]}"; do [ -n "${exe[$s]:-}" ] || missing+=("test executable $s"); done
lib="$rel/liboxccl.so"
[ -f "$lib" ] || lib="$rel/deps/liboxccl.so"
for f in "$rel/oxccl-perf" "$rel/examples/gpu_kernel_bench" "$lib"; do [ -f "$f" ] || missing+=("$f"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "gpu-kit: missing: ${missing[*]}" >&2
  echo "gpu-kit: build them first: cargo build --release --bin oxccl-perf --example gpu_kernel_bench --lib && cargo test --release --no-run $(printf -- '--test %s ' "${suites[@]}")" >&2
  exit 1
fi

for s in "${suites[@]}"; do strip -o "$dir/bin/$s" "${exe[$s]}"; done
strip -o "$dir/bin/oxccl-perf" "$rel/oxccl-perf"
strip -o "$dir/bin/gpu_kernel_bench" "$rel/examples/gpu_kernel_bench"
strip -o "$dir/lib/liboxccl.so" "$lib"

# libnccl.so.2: oxccl under NCCL's soname (patchelf), or else a stub with that soname that
# needs liboxccl.so next to it (cc), so a program linked against NCCL loads oxccl.
if command -v patchelf >/dev/null 2>&1; then
  cp "$dir/lib/liboxccl.so" "$dir/lib/libnccl.so.2"
  patchelf --set-soname libnccl.so.2 "$dir/lib/libnccl.so.2"
elif command -v "${CC:-cc}" >/dev/null 2>&1; then
  echo '/* libnccl.so.2 alias: every symbol comes from liboxccl.so (DT_NEEDED). */' >"$dir/lib/.alias.c"
  "${CC:-cc}" -shared -fPIC -o "$dir/lib/libnccl.so.2" "$dir/lib/.alias.c" -Wl,-soname,libnccl.so.2 \
    -Wl,--no-as-needed -L"$dir/lib" -l:liboxccl.so -Wl,-rpath,'$ORIGIN'
  rm -f "$dir/lib/.alias.c"
else
  echo "gpu-kit: neither patchelf nor cc: no libnccl.so.2 alias (the torch nccl step will skip)" >&2
fi
[ -f "$dir/lib/libnccl.so.2" ] && ln -sfn libnccl.so.2 "$dir/lib/libnccl.so"

# The Python package (without caches or a built library of its own).
cp -r "$root/python-bindings/oxccl" "$dir/python/oxccl"
find "$dir/python" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$dir/python/oxccl/lib"

cp "$root"/scripts/gpu-kit/*.py "$root/scripts/nccl_bench.py" "$dir/tools/"
cp "$root/scripts/gpu-kit/run" "$dir/run"
chmod +x "$dir/run"

# The CPU stand-in of CUDA, with the kernel image compiled here so the target needs no compiler.
if command -v "${CC:-cc}" >/dev/null 2>&1 && command -v "${CXX:-c++}" >/dev/null 2>&1; then
  bash "$root/cuda-standin/build.sh" "$dir/standin" >/dev/null
  cp "$root/cuda/host_shim.h" "$dir/standin/host_shim.h"
  mkdir -p "$dir/standin/cache"
  if ! env LD_LIBRARY_PATH="$dir/standin" OXCCL_STANDIN_CACHE="$dir/standin/cache" \
    OXCCL_STANDIN_SHIM="$dir/standin/host_shim.h" "$dir/bin/gpu_kernel_bench" 65536 >"$dir/standin/prebuild.log" 2>&1; then
    cat "$dir/standin/prebuild.log" >&2
    echo "gpu-kit: compiling the kernels for the stand-in failed" >&2
    exit 1
  fi
  rm -f "$dir"/standin/cache/*.cu "$dir"/standin/cache/*.log "$dir"/standin/cache/lock "$dir/standin/prebuild.log"
  strip "$dir"/standin/cache/*.so "$dir"/standin/*.so* 2>/dev/null || true
else
  rm -rf "$dir/standin"
  echo "gpu-kit: no cc/c++: the kit has no stand-in (run --standin will refuse)" >&2
fi

{
  echo "oxccl GPU check kit"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%FT%TZ) on $(uname -m)"
  echo "suites: ${suites[*]}"
} >"$dir/KIT"

size_kib="$(du -sk "$dir" | cut -f1)"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
  echo "gpu-kit: $dir is $((size_kib / 1024)) MiB, over the $limit_mib MiB limit" >&2
  exit 1
fi
echo "gpu-kit: $dir ($((size_kib / 1024)) MiB); run it with $dir/run [--quick] [--standin]" >&2
echo "$dir"
