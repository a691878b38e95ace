#!/usr/bin/env bash
# Interleaved side-by-side of oxccl-perf builds/settings and Open MPI's MPI_Allreduce on one size:
# ROUNDS rounds, each running every configuration once in turn, so a burst of load on the shared
# machine hits all of them alike. Prints per configuration one entry per round:
#   oxccl:    time µs / busbw GB/s out of place | same in place   (--stat median, slowest rank)
#   ompi:     time µs / busbw GB/s (benches/compare/mpi_allreduce_bench.c, median, out of place)
#   ompi-ip:  the same in place (with IP=1)
# Binding as mpirun's default on both sides: oxccl-perf --bind auto (one CPU per rank when
# ranks <= CPUs, else none), mpirun --bind-to core when ranks <= CPUs, else none (--oversubscribe).
#
#   bash benches/compare/vs_ompi.sh SIZE ROUNDS RANKS ITERS CONFIG...
#     CONFIG: "ompi", or a command prefix ending in an oxccl-perf binary, e.g.
#             target/release/oxccl-perf  or  "env OXCCL_SPIN_US=0 target/release/oxccl-perf"
#   IP=1 bash benches/compare/vs_ompi.sh 1M 5 2 200 target/release/oxccl-perf ompi
# Needs Open MPI (benches/compare/setup.sh installs it) and build/compare/mpi_allreduce_bench:
#   mpicc -O2 -o build/compare/mpi_allreduce_bench benches/compare/mpi_allreduce_bench.c
set -euo pipefail
cd "$(dirname "$0")/../.."
size=$1; rounds=$2; ranks=$3; iters=$4; shift 4
export OXCCL_SOCKET_IFNAME=lo
ob=(); [ "$ranks" -le "$(nproc)" ] && ob=(--bind-to core)
mpi() { mpirun --allow-run-as-root --oversubscribe "${ob[@]}" -np "$ranks" build/compare/mpi_allreduce_bench \
          -a 4096 -s "$size" -t 0.3 "$@" 2>/dev/null | grep -v '^#' | tail -1 | awk '{print $6 "us/" $8}'; }
for _ in $(seq "$rounds"); do
  for cfg in "$@"; do
    if [ "$cfg" = ompi ]; then
      echo "ompi@ $(mpi)"
      if [ -n "${IP:-}" ]; then echo "ompi-ip@ $(mpi -i)"; fi
    else
      # shellcheck disable=SC2086
      echo "$cfg@ $($cfg all_reduce -b "$size" -e "$size" -n "$iters" -w $((iters / 10 + 2)) -c 0 --stat median \
        --ranks "$ranks" | grep -v '^#' | tail -1 | awk '{print $6 "us/" $8 "|" $10 "us/" $12}')"
    fi
  done
done | awk -F@ '{k[NR]=$1; a[$1]=a[$1] $2} END {for (i=1;i<=NR;i++) if (!(k[i] in s)) {s[k[i]]=1; print k[i] ":" a[k[i]]}}'
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
