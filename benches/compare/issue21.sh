#!/usr/bin/env bash
# The table of issue 21 ([P] host-memory speed) in one run: oxccl-perf against Open MPI's
# MPI_Allreduce (benches/compare/mpi_allreduce_bench.c), float32 sum, medians, both pinned as
# mpirun pins by default (oxccl-perf --bind auto, mpirun --bind-to core when ranks <= CPUs).
#
#   bash benches/compare/issue21.sh [ROUNDS] [OXCCL_PERF]      (default 5, target/release/oxccl-perf)
#
# Every case runs ROUNDS rounds; a round runs oxccl-perf (out of place and in place in one
# run) and Open MPI (out of place, then in place with -i) back to back, so a burst of load on a
# shared machine hits both alike. A case's ratio is the median of its per-round ratios (time:
# oxccl / Open MPI, lower is better; busbw: oxccl / Open MPI, higher is better), printed with
# the range over rounds. The last rows are the stability check: oxccl-perf at 8 B, 2 ranks, 5
# runs unpinned (--bind none, --stat mean) against 5 runs pinned (--stat median): the worst
# unpinned mean over the median of the pinned medians; and, as a control, the worst of 5 pinned
# means over the same median (how far the host's noise alone moves a mean).
# CASES="2 8,4 1M" limits the run to those cases; STABILITY=0 skips the last row; SETTLE=s is
# the pause before each run (default 1 s); PERF_ARGS="-R 1" adds oxccl-perf options to the table's
# rows (-R 1: buffers in shareable host memory, as ncclMemAlloc returns it; the stability row
# keeps the defaults).
# Needs Open MPI and build/compare/mpi_allreduce_bench (see vs_ompi.sh); ~3-6 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
SETTLE=${SETTLE:-1}
perf=${2:-target/release/oxccl-perf}
export OXCCL_SOCKET_IFNAME=lo
out=$(mktemp)
trap 'rm -f "$out"' EXIT

iters() { # oxccl-perf iterations for a size in bytes
  local b=$1
  if [ "$b" -le 4096 ]; then echo 20000; elif [ "$b" -le 262144 ]; then echo 2000
  elif [ "$b" -le 4194304 ]; then echo 200; elif [ "$b" -le 16777216 ]; then echo 20; else echo 5; fi
}
bytes() { numfmt --from=iec "$1"; }
mpi() { # ranks size [-i] -> "time busbw"
  local ob=(); [ "$1" -le "$(nproc)" ] && ob=(--bind-to core)
  mpirun --allow-run-as-root --oversubscribe "${ob[@]}" -np "$1" build/compare/mpi_allreduce_bench \
    -a 4096 -s "$2" -t 0.3 "${@:3}" 2>/dev/null | grep -v '^#' | tail -1 | awk '{print $6, $8}'
}
ox() { # ranks size [extra...] -> "time_oop busbw_oop time_ip busbw_ip"
  local n; n=$(iters "$(bytes "$2")")
  # shellcheck disable=SC2086
  "$perf" all_reduce -b "$2" -e "$2" -n "$n" -w $((n / 10 + 2)) -c 0 --stat median --ranks "$1" ${PERF_ARGS:-} "${@:3}" \
    | grep -v '^#' | tail -1 | awk '{print $6, $8, $10, $12}'
}

cases=("2 8" "2 64K" "2 256K" "2 1M" "2 4M" "2 16M" "2 128M" "4 8" "4 1M" "4 128M")
# CASES="2 8,4 1M" runs only those cases (for a quick look at a few rows).
[ -n "${CASES:-}" ] && IFS=, read -r -a cases <<<"$CASES"
for r in $(seq "$rounds"); do
  for c in "${cases[@]}"; do
    set -- $c
    # A pause before each run: the previous run's processes (mpirun tears its ranks down after
    # it returns) must not share the CPUs with the next one.
    sleep "$SETTLE"; echo "ox $1 $2 $r $(ox "$1" "$2")" >>"$out"
    sleep "$SETTLE"; echo "mpi $1 $2 $r $(mpi "$1" "$2")" >>"$out"
    sleep "$SETTLE"; echo "mpi-ip $1 $2 $r $(mpi "$1" "$2" -i)" >>"$out"
  done
done
for r in $(seq "$([ "${STABILITY:-1}" = 0 ] && echo 0 || echo 5)"); do
  echo "pinned 2 8 $r $(ox 2 8)" >>"$out"
  n=$(iters 8)
  echo "unpinned 2 8 $r $("$perf" all_reduce -b 8 -e 8 -n "$n" -w $((n / 10 + 2)) -c 0 --stat mean --bind none \
    --ranks 2 | grep -v '^#' | tail -1 | awk '{print $6, $8, $10, $12}')" >>"$out"
  # The control: the same mean, pinned. What the host's noise alone does to a mean.
  echo "pinnedmean 2 8 $r $("$perf" all_reduce -b 8 -e 8 -n "$n" -w $((n / 10 + 2)) -c 0 --stat mean --bind cpu \
    --ranks 2 | grep -v '^#' | tail -1 | awk '{print $6, $8, $10, $12}')" >>"$out"
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$out" <<'EOF'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
d = {}
for r in rows:
    d.setdefault((r[0], r[1], r[2]), {})[int(r[3])] = [float(x) for x in r[4:]]
med = st.median
def fmt(v): return f"{v:.3g}"
targets = {("2", "8"): ("time", 0.8), ("2", "128M"): ("bw", 2.5), ("4", "8"): ("time", 1.0),
           ("4", "1M"): ("bw", 1.2), ("4", "128M"): ("bw", 2.0)}
print("| case | oxccl | Open MPI | ratio (median, range over rounds) | target | met |")
print("|---|---|---|---|---|---|")
seen = []
for r in rows:
    if r[0] == "ox" and (r[1], r[2]) not in seen:
        seen.append((r[1], r[2]))
for n, s in seen:
    kind, tgt = targets.get((n, s), ("bw", 1.5) if n == "2" else ("bw", None))
    ox, mo, mi = d[("ox", n, s)], d[("mpi", n, s)], d[("mpi-ip", n, s)]
    for place, oi, m in (("out of place", 0, mo), ("in place", 2, mi)):
        rs = sorted(m.keys() & ox.keys())
        if kind == "time":
            per = [ox[k][oi] / m[k][0] for k in rs]
            a, b, unit, ok = med(ox[k][oi] for k in rs), med(m[k][0] for k in rs), "µs", lambda x: x <= tgt
            t = f"time <= {tgt}x"
        else:
            per = [ox[k][oi + 1] / m[k][1] for k in rs]
            a, b, unit, ok = med(ox[k][oi + 1] for k in rs), med(m[k][1] for k in rs), "GB/s", lambda x: x >= tgt
            t = f"busbw >= {tgt}x" if tgt else "-"
        q = med(per)
        met = ("yes" if ok(q) else "**no**") if tgt else "-"
        print(f"| {n} ranks {s} {place} | {fmt(a)} {unit} | {fmt(b)} {unit} | {q:.2f} ({min(per):.2f}-{max(per):.2f}) | {t} | {met} |")
if ("pinned", "2", "8") not in d:
    sys.exit(0)
pin = [v[0] for v in d[("pinned", "2", "8")].values()] + [v[2] for v in d[("pinned", "2", "8")].values()]
unp = [v[0] for v in d[("unpinned", "2", "8")].values()] + [v[2] for v in d[("unpinned", "2", "8")].values()]
q = max(unp) / med(pin)
print(f"| 2 ranks 8 B unpinned mean / pinned median, 5 runs each (oop and ip) | worst mean {fmt(max(unp))} µs | pinned median {fmt(med(pin))} µs | {q:.2f} (means {fmt(min(unp))}-{fmt(max(unp))}) | <= 1.3x | {'yes' if q <= 1.3 else '**no**'} |")
pm = [v[0] for v in d[("pinnedmean", "2", "8")].values()] + [v[2] for v in d[("pinnedmean", "2", "8")].values()]
print(f"| control: 2 ranks 8 B *pinned* mean / pinned median, same 5 rounds | worst mean {fmt(max(pm))} µs | pinned median {fmt(med(pin))} µs | {max(pm) / med(pin):.2f} (means {fmt(min(pm))}-{fmt(max(pm))}) | - | - |")
EOF
