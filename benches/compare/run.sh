#!/usr/bin/env bash
# Side-by-side host-memory all-reduce: oxccl vs Gloo (torch.distributed) vs Open MPI, one run.
#
#   bash benches/compare/run.sh            # 2 and 4 ranks, 8 B .. 128 MiB by x4 (and 1 MiB), float32 sum
#   RANKS="2" SIZES="8,1M" bash benches/compare/run.sh   # a subset
#   ROUNDS=3 bash benches/compare/run.sh   # each library 3 times, interleaved; medians reported
#
# Installs what it needs (setup.sh: Debian Open MPI, a venv with torch/numpy/matplotlib/mpi4py
# under build/), builds oxccl-perf and the C MPI benchmark, then for each rank count runs, one
# after the other on the same sizes:
#   oxccl-perf   (out of place and in place; iterations scaled to ~0.5 s per size)
#   Gloo         gloo_allreduce.py: torch.distributed backend "gloo", CPU tensors, in place
#   Open MPI C   mpi_allreduce_bench.c: MPI_Allreduce out of place, page-aligned buffers
#   Open MPI py  mpi_allreduce.py: mpi4py comm.Allreduce, page-aligned numpy buffers
# Binding as mpirun does by default: with no more ranks than CPUs each rank is pinned to one CPU
# (Open MPI: --bind-to core; oxccl-perf --bind cpu; gloo_allreduce.py --bind); with more ranks
# than CPUs nothing is pinned (Open MPI binds to none when oversubscribed).
# Raw outputs go to build/compare/; report.py writes docs/compare.md and docs/compare.png.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=benches/compare
OUT=${OUT:-build/compare}
VENV=${VENV:-build/venv-torch}
RANKS=${RANKS:-"2 4"}
SIZES=${SIZES:-"8,32,128,512,2K,8K,32K,128K,512K,1M,2M,8M,32M,128M"}
TARGET=${TARGET:-0.5}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
rm -f "$OUT"/*.txt "$OUT"/*.json

bash "$HERE/setup.sh"
cargo build --release --bin oxccl-perf
mpicc -O2 -o "$OUT/mpi_allreduce_bench" "$HERE/mpi_allreduce_bench.c"
PY="$VENV/bin/python"
MPIRUN="mpirun --allow-run-as-root --oversubscribe"   # Open MPI's default binding
export OXCCL_SOCKET_IFNAME=lo   # every rank is on this machine

bytes() { "$PY" -c "import sys; sys.path.insert(0, '$HERE'); import report; print(report.parse_size('$1'))"; }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -r), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "rounds: $ROUNDS (libraries interleaved within each round), ${TARGET} s of timed calls per size"
  echo "binding: one CPU per rank when ranks <= $(nproc) CPUs (all libraries), none otherwise"
  echo "oxccl: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
  echo "gloo: torch $("$PY" -c 'import torch; print(torch.__version__)')"
  echo "mpi: $(mpirun --version | head -1)"
} > "$OUT/meta.txt"

for n in $RANKS; do
 for r in $(seq "$ROUNDS"); do
  echo "=== $n ranks, round $r of $ROUNDS (load $(cut -d' ' -f1-3 /proc/loadavg))"
  BIND_OX=(); BIND_GLOO=()
  if [ "$n" -le "$(nproc)" ]; then BIND_OX=(--bind cpu); BIND_GLOO=(--bind); fi
  # oxccl-perf: one invocation per size, iterations chosen so each size runs ~TARGET seconds
  # (--stat median: its time is the median over iterations of the slowest rank's per-iteration
  # time, the peers' method, so one preemption on a 2-core machine does not move a point).
  for s in ${SIZES//,/ }; do
    b=$(bytes "$s")
    iters=$("$PY" -c "print(max(20, min(200000, int($TARGET / (3e-6 + $b / 2e9)))))")
    warm=$(( iters / 10 > 5 ? iters / 10 : 5 ))
    target/release/oxccl-perf all_reduce -b "$b" -e "$b" -n "$iters" -w "$warm" -d float -o sum --stat median "${BIND_OX[@]}" \
      --ranks "$n" --json "$OUT/oxccl_n${n}_${b}_r$r.json" | tee -a "$OUT/oxccl_n$n.txt"
  done
  timeout 1800 "$PY" "$HERE/gloo_allreduce.py" -n "$n" "${BIND_GLOO[@]}" --sizes "$SIZES" --target-time "$TARGET" | tee "$OUT/gloo_n${n}_r$r.txt"
  timeout 1800 $MPIRUN -np "$n" "$OUT/mpi_allreduce_bench" -a 4096 -s "$SIZES" -t "$TARGET" | tee "$OUT/ompi_c_n${n}_r$r.txt"
  timeout 1800 $MPIRUN -np "$n" "$PY" "$HERE/mpi_allreduce.py" --align 4096 --sizes "$SIZES" --target-time "$TARGET" | tee "$OUT/ompi_py_n${n}_r$r.txt"
 done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/meta.txt"

"$PY" "$HERE/report.py" "$OUT" docs/compare.md docs/compare.png
echo "wrote docs/compare.md and docs/compare.png"
