#!/usr/bin/env bash
# GPU verification of issues [F] and [I]: builds, runs the GPU tests and the CUDA stand-in's
# device tests against the real driver (tests/device_standin.rs, OXCCL_DEVICE_TESTS_REAL=1), and times
#   (a) the reduce-copy kernel against a device-to-device copy of the same bytes,
#   (b) oxccl all-reduce, 2 and 4 ranks sharing GPU 0, 8 B .. 1 GiB (oxccl-perf --mem cuda),
#   (c) NCCL itself in the same run (torch.distributed "nccl", NCCL_MULTI_RANK_GPU_ENABLE=1).
# Writes everything to stdout and to $OUT (default ./gpu-check-out): gpu-check.txt plus one file
# per part.
#
# Needs: the NVIDIA driver (libcuda.so), NVRTC (libnvrtc.so.13 or .12: from the CUDA toolkit or
# the pip wheel nvidia-cuda-nvrtc, found automatically in Python's site-packages), and for (c)
# PyTorch with NCCL. The build needs no CUDA. Without network access cargo must build offline:
# carry a vendored registry or a filled cargo home at ./.cargo-home (CARGO_HOME is set to it when
# present) and this script passes --offline when OXCCL_OFFLINE=1 or .cargo-home exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu-check.txt"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
run() { say "\$ $*"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

export OXCCL_SOCKET_IFNAME=lo
OFFLINE=()
if [ -d .cargo-home ]; then export CARGO_HOME="$PWD/.cargo-home"; OFFLINE=(--offline); fi
[ "${OXCCL_OFFLINE:-0}" = 1 ] && OFFLINE=(--offline)

# NVRTC from a pip wheel if the system has none on the loader path.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  for py in python3 python; do
    dir=$($py - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libnvrtc.so*"), recursive=True)]
print(os.path.dirname(sorted(hits)[-1]) if hits else "")
PY
)
    if [ -n "$dir" ]; then export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
  done
fi

say "== GPU check $(date -u +%FT%TZ)"
run nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

status=0
say "== build"
run cargo build --release "${OFFLINE[@]}" --bin oxccl-perf --example gpu_kernel_bench || exit 1

say "== GPU tests (all types x ops, 1..4 ranks on GPU 0, IPC and proxy, in/out of place)"
OXCCL_GPU_TESTS_REQUIRED=1 run cargo test --release "${OFFLINE[@]}" --test gpu --test device_kernels_host -- --nocapture --test-threads=1 || status=1

say "== stand-in device tests against the real driver (IPC/proxy matrix, every collective on the IPC and staged paths, streams, kill -9, SIGSTOP, abort)"
OXCCL_DEVICE_TESTS_REAL=1 run cargo test --release "${OFFLINE[@]}" --test device_standin --test device_colls --test device_failures -- --test-threads=1 || status=1

say "== (a) reduce-copy kernel vs device-to-device copy"
run target/release/examples/gpu_kernel_bench | tee "$OUT/a-kernel.txt" || status=1

for n in 2 4; do
  for ipc in 1 0; do
    say "== (b) oxccl all_reduce, $n ranks on GPU 0, OXCCL_CUDA_IPC=$ipc"
    OXCCL_CUDA_IPC=$ipc run target/release/oxccl-perf all_reduce --mem cuda --ranks "$n" -b 8 -e 1G -f 2 -n 20 -w 5 -d float -o sum \
      --json "$OUT/b-oxccl-$n-ipc$ipc.json" | tee "$OUT/b-oxccl-$n-ipc$ipc.txt" || status=1
  done
  say "== (c) NCCL all_reduce, $n ranks on GPU 0"
  run python3 scripts/nccl_bench.py "$n" 8 $((1 << 30)) | tee "$OUT/c-nccl-$n.txt" || say "(NCCL comparison failed; see above)"
done

say "== summary (busbw GB/s, out of place; oxccl IPC mode vs NCCL)"
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def nccl(n):
    rows = {}
    try:
        for line in open(os.path.join(out, f"c-nccl-{n}.txt")):
            f = line.split()
            if len(f) == 4 and f[0].isdigit():
                rows[int(f[0])] = (float(f[1]), float(f[3]))
    except OSError:
        pass
    return rows
for n in (2, 4):
    try:
        ox = {r["size"]: r for r in json.load(open(os.path.join(out, f"b-oxccl-{n}-ipc1.json")))}
    except (OSError, ValueError, KeyError):
        print(f"{n} ranks: no oxccl results"); continue
    nc = nccl(n)
    print(f"{n} ranks: {'size':>12} {'oxccl us':>10} {'NCCL us':>10} {'oxccl busbw':>12} {'NCCL busbw':>11}")
    for size in sorted(ox):
        t, b = ox[size].get("oop_time_us") or float("nan"), ox[size].get("oop_busbw") or float("nan")
        ct, cb = nc.get(size, (float("nan"), float("nan")))
        print(f"         {size:>12} {t:>10.2f} {ct:>10.2f} {b:>12.2f} {cb:>11.2f}")
PY
say "== done: status $status (results in $OUT)"
exit $status
