#!/usr/bin/env bash
# The bound of issue 21's 2-rank rows: per size, in the same rounds, Open MPI's busbw (as
# issue21.sh runs it), the target it sets (1.5x, 2.5x at 128 MiB), oxccl's busbw, and the busbw of
# pair_floor.c, a minimal correct 2-process all-reduce through shared memory (least traffic,
# per-piece flags, nothing else). A target above ~90 % of the floor asks more of a library than
# the bare schedule leaves.
#
#   bash benches/compare/pair_bound.sh [ROUNDS] [OXCCL_PERF]   (default 3, target/release/oxccl-perf)
#
# Needs Open MPI, build/compare/mpi_allreduce_bench (see vs_ompi.sh) and
# `cc -O3 -march=native -o build/compare/pair_floor benches/compare/pair_floor.c`; ~3 minutes.
# SIZES="1M 4M" limits the sizes.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
perf=${2:-target/release/oxccl-perf}
export OXCCL_SOCKET_IFNAME=lo
out=$(mktemp)
trap 'rm -f "$out"' EXIT
read -r -a sizes <<<"${SIZES:-256K 1M 4M 16M 128M}"

mpi() { # size [-i] -> busbw
  mpirun --allow-run-as-root --oversubscribe --bind-to core -np 2 build/compare/mpi_allreduce_bench \
    -a 4096 -s "$1" -t 0.3 "${@:2}" 2>/dev/null | grep -v '^#' | tail -1 | awk '{print $8}'
}
floor() { # bytes oop(0|1) -> busbw (the slower rank's best)
  local it=100; [ "$1" -ge 16777216 ] && it=10
  OOP=$2 build/compare/pair_floor "$1" "$it" 65536 | sed 's/.*busbw \([0-9.]*\).*/\1/' | sort -n | head -1
}
ox() { # size -> "busbw_oop busbw_ip"
  local b n; b=$(numfmt --from=iec "$1"); n=200; [ "$b" -ge 16777216 ] && n=10
  "$perf" all_reduce -b "$1" -e "$1" -n "$n" -w $((n / 10 + 2)) -c 0 --stat median --ranks 2 \
    | grep -v '^#' | tail -1 | awk '{print $8, $12}'
}
for r in $(seq "$rounds"); do
  for s in "${sizes[@]}"; do
    b=$(numfmt --from=iec "$s")
    sleep 1; o=$(ox "$s")
    sleep 1; m_oop=$(mpi "$s"); sleep 1; m_ip=$(mpi "$s" -i)
    f_oop=$(floor "$b" 1); f_ip=$(floor "$b" 0)
    echo "$s oop $r $m_oop $(echo "$o" | cut -d' ' -f1) $f_oop" >>"$out"
    echo "$s ip $r $m_ip $(echo "$o" | cut -d' ' -f2) $f_ip" >>"$out"
  done
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$out" <<'EOF'
import statistics as st, sys
d = {}
for l in open(sys.argv[1]):
    s, mode, r, m, o, f = l.split()
    d.setdefault((s, mode), []).append((float(m), float(o), float(f)))
print("| size | placement | Open MPI | target | oxccl | floor (pair_floor) | target / floor | oxccl / floor |")
print("|---|---|---|---|---|---|---|---|")
for (s, mode), v in d.items():
    k = 2.5 if s == "128M" else 1.5
    m, o, f = (st.median(x[i] for x in v) for i in range(3))
    # Ratios per round, then the median: the host's speed moves between rounds.
    tf = st.median(k * x[0] / x[2] for x in v)
    of = st.median(x[1] / x[2] for x in v)
    place = "out of place" if mode == "oop" else "in place"
    print(f"| {s} | {place} | {m:.2f} | {k * m:.2f} ({k}x) | {o:.2f} | {f:.2f} | {tf:.2f} | {of:.2f} |")
EOF
