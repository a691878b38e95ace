#!/usr/bin/env bash
# Multi-host comparison over veth: network namespaces as hosts (scripts/netns-hosts.sh), one
# rank per host, all in one run, rounds interleaved:
#   raw TCP     oxccl-iperf with as many streams as oxccl's sockets per peer (the ceiling a
#               ring hop can reach): full duplex between host 0 and host 1 for 2 hosts; for
#               more, a ring over every host (each sends to the next while receiving from the
#               previous), the slowest member's figure; each figure is the faster of
#               oxccl-iperf's two ways of driving the sockets (blocking threads, or one thread
#               with poll(2)), after a warm-up round
#   oxccl       oxccl-perf all_reduce, all_gather, broadcast (busbw, out of place), each rank
#               started with `ip netns exec` under OXCCL_RANK/OXCCL_NRANKS/OXCCL_COMM_ID, for
#               every configuration in CONFIGS: SOCKETS[:THREADS][/STRIPE] (OXCCL_NSOCKS,
#               OXCCL_NTHREADS helper threads per peer — 0 or absent: the engine thread drives
#               the sockets —, and OXCCL_SOCKET_STRIPE — absent: the default)
#   Gloo        benches/compare/gloo_allreduce.py (torch.distributed "gloo"), one process per
#               namespace, GLOO_SOCKET_IFNAME=oxv0
#   Open MPI    benches/compare/mpi_allreduce_bench.c under mpirun (launched into the namespaces
#               by netns-rsh.sh), TCP BTL over oxv0 (--mca btl tcp,self)
# Per cell the median over ROUNDS rounds. Writes build/multihost/table.md (and raw logs there).
#
#   bash benches/compare/multihost.sh
#   HOSTS="2" SIZES="64M" ROUNDS=5 CONFIGS="1 1:1 4:2 8/128K" bash benches/compare/multihost.sh
#   PEERS=0 ...     # skip Gloo and Open MPI
#   ITERS=20 ...    # oxccl-perf timed iterations per cell (default 5)
#   PY=/path/to/python-with-torch ...   (default build/venv-torch/bin/python, made by setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=benches/compare
OUT=${OUT:-build/multihost}
HOSTS=${HOSTS:-"2 3"}
SIZES=${SIZES:-"64M 128M"}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-5}
CONFIGS=${CONFIGS:-${NSOCKS:-"1 4"}}
PEERS=${PEERS:-1}
PY=${PY:-build/venv-torch/bin/python}
export PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
rm -f "$OUT"/*.txt

cargo build --release --bin oxccl-perf --bin oxccl-iperf
if [ "$PEERS" = 1 ]; then
  if [ ! -x "$PY" ] || ! command -v mpicc >/dev/null; then bash "$HERE/setup.sh"; fi
  mpicc -O2 -o "$OUT/mpi_allreduce_bench" "$HERE/mpi_allreduce_bench.c"
fi
NS=scripts/netns-hosts.sh
trap '$NS down >/dev/null 2>&1 || true' EXIT

bytes() { python3 -c "
s='$1'.upper(); m={'K':1<<10,'M':1<<20,'G':1<<30}
print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))"; }
ip_of() { echo "10.213.0.$(($1 + 1))"; }
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }
busbw() { awk '$1 ~ /^[0-9]+$/ {print $8; exit}' "$1"; }
busbw_of() { awk -v b="$2" '$1 == b {print $8; exit}' "$1"; }

# raw TCP over $3 hosts with $2 streams, $1 bytes; prints GB/s per direction.
raw() {
  if [ "${3:-2}" -gt 2 ]; then raw_ring "$@"; return; fi
  timeout 120 ip netns exec oxh0 target/release/oxccl-iperf --listen "$(ip_of 0):5201" --size "$1" --iters 5 --streams "$2" >/dev/null 2>&1 &
  local l=$! t
  # The client does not retry: wait until the listener is up (slow under load).
  for ((t = 0; t < 100; t++)); do
    ip netns exec oxh0 ss -Hltn "sport = :5201" 2>/dev/null | grep -q . && break
    sleep 0.1
  done
  timeout 120 ip netns exec oxh1 target/release/oxccl-iperf --connect "$(ip_of 0):5201" --size "$1" --iters 5 --streams "$2" 2>&1 | awk 'NF==3 && $1 ~ /^[0-9]+$/ {print $3}' | tail -1
  wait $l || true
}

# raw TCP ring over $3 hosts: host r sends to host r+1 and receives from host r-1; prints the
# slowest host's GB/s.
raw_ring() {
  local h=$3 pids=() r
  for ((r = 0; r < h; r++)); do
    timeout 120 ip netns exec "oxh$r" target/release/oxccl-iperf --listen "$(ip_of $r):5202" \
      --connect "$(ip_of $(((r + 1) % h))):5202" --size "$1" --iters 5 --streams "$2" >"$OUT/iperf.$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  for ((r = 0; r < h; r++)); do awk 'NF==3 && $1 ~ /^[0-9]+$/ {print $3}' "$OUT/iperf.$r.txt" | tail -1; done | sort -g | head -1
}

# oxccl-perf COLL BYTES HOSTS NSOCKS NTHREADS STRIPE: one rank per namespace; prints busbw (out
# of place).
oxccl() {
  local coll=$1 b=$2 h=$3 socks=$4 threads=$5 stripe=$6 pids=() r
  for ((r = 0; r < h; r++)); do
    OXCCL_RANK=$r OXCCL_NRANKS=$h OXCCL_COMM_ID="$(ip_of 0):29500" OXCCL_SOCKET_IFNAME=oxv0 OXCCL_NSOCKS=$socks \
      OXCCL_NTHREADS=$threads OXCCL_SOCKET_STRIPE=${stripe:-${OXCCL_SOCKET_STRIPE:-}} \
      timeout 300 ip netns exec "oxh$r" target/release/oxccl-perf "$coll" -b "$b" -e "$b" -n "$ITERS" -w 2 -c 0 >"$OUT/oxccl.$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  cat "$OUT/oxccl.0.txt" >>"$OUT/oxccl_${coll}_h${h}_s${socks}_t${threads}_${stripe:-default}.txt"
  busbw "$OUT/oxccl.0.txt"
}

# Gloo / Open MPI: every size in one run (their start-up is slow); fill R for each size.
gloo() {
  local sizes=$1 h=$2 pids=() r
  for ((r = 0; r < h; r++)); do
    RANK=$r WORLD_SIZE=$h GLOO_SOCKET_IFNAME=oxv0 \
      timeout 600 ip netns exec "oxh$r" "$PY" "$HERE/gloo_allreduce.py" --addr "$(ip_of 0)" --port 29533 --sizes "$sizes" \
      --target-time 1.0 >"$OUT/gloo.$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  cat "$OUT/gloo.0.txt" >>"$OUT/gloo_h${h}.txt"
  for s in $SIZES; do R[$h,$s,gloo]+="$(busbw_of "$OUT/gloo.0.txt" "$(bytes "$s")") "; done
}

# Open MPI: mpirun runs in host 0's namespace with a hostfile of the namespace addresses and
# netns-rsh.sh as its launch agent (it starts orted in the namespace owning each address instead
# of ssh), so its daemons, PMIx and every rank live in their host's namespace.
ompi() {
  local sizes=$1 h=$2 r
  for ((r = 0; r < h; r++)); do echo "$(ip_of $r) slots=1"; done >"$OUT/hostfile"
  timeout 300 ip netns exec oxh0 mpirun --allow-run-as-root -np "$h" --hostfile "$OUT/hostfile" \
    --mca plm_rsh_agent "$PWD/$HERE/netns-rsh.sh" --mca oob_tcp_if_include oxv0 \
    --mca btl tcp,self --mca btl_tcp_if_include oxv0 --mca pml ob1 \
    "$PWD/$OUT/mpi_allreduce_bench" -a 4096 -s "$sizes" -t 1.0 >"$OUT/ompi.txt" 2>&1 || true
  cat "$OUT/ompi.txt" >>"$OUT/ompi_h${h}.txt"
  for s in $SIZES; do R[$h,$s,ompi]+="$(busbw_of "$OUT/ompi.txt" "$(bytes "$s")") "; done
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -r), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "oxccl: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$OUT/meta.txt"

declare -A R
for h in $HOSTS; do
  $NS up "$h" >/dev/null
  for ((round = 1; round <= ROUNDS; round++)); do
    for s in $SIZES; do
      b=$(bytes "$s")
      echo "== $h hosts, $s, round $round (load $(cut -d' ' -f1 /proc/loadavg))" >&2
      declare -A done_raw=()
      for k in $CONFIGS; do
        base=${k%%/*}
        stripe=
        [[ $k == */* ]] && stripe=${k#*/}
        socks=${base%%:*}
        threads=0
        [[ $base == *:* ]] && threads=${base#*:}
        if [ -z "${done_raw[$socks]:-}" ]; then
          R[$h,$s,raw,$socks]+="$(raw "$b" "$socks" "$h") "
          done_raw[$socks]=1
        fi
        for c in all_reduce all_gather broadcast; do
          R[$h,$s,$c,$k]+="$(oxccl "$c" "$b" "$h" "$socks" "$threads" "$stripe") "
        done
      done
      unset done_raw
    done
    if [ "$PEERS" = 1 ]; then
      sz=$(echo $SIZES | tr ' ' ',')
      gloo "$sz" "$h"
      ompi "$sz" "$h"
    fi
  done
  $NS down >/dev/null
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/meta.txt"

med() { echo "${R[$1]:-}" | tr ' ' '\n' | { grep -E '^[0-9.]+$' || true; } | median; }
ratio() { python3 -c "a,b='$1','$2'; print('%.2f' % (float(a)/float(b)) if a not in ('-','') and b not in ('-','') and float(b) > 0 else '-')"; }
{
  echo "| hosts | size | sockets:threads/stripe | raw TCP GB/s | all_reduce busbw | ÷ raw | all_gather busbw | broadcast busbw | Gloo all_reduce | Open MPI all_reduce | oxccl ÷ Gloo |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for h in $HOSTS; do
    for s in $SIZES; do
      g=$(med "$h,$s,gloo"); o=$(med "$h,$s,ompi")
      for k in $CONFIGS; do
        kk=${k%%/*}
        rw=$(med "$h,$s,raw,${kk%%:*}"); ar=$(med "$h,$s,all_reduce,$k")
        echo "| $h | $s | $k | $rw | $ar | $(ratio "$ar" "$rw") | $(med "$h,$s,all_gather,$k") | $(med "$h,$s,broadcast,$k") | $g | $o | $(ratio "$ar" "$g") |"
      done
    done
  done
  echo
  echo "GB/s = 1e9 B/s, medians of $ROUNDS interleaved rounds; $(grep load "$OUT/meta.txt" | tr '\n' ';')"
} | tee "$OUT/table.md"
