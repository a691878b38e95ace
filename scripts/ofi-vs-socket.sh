#!/usr/bin/env bash
# all_reduce bus bandwidth over OXCCL_NET=socket and OXCCL_NET=ofi side by side: 2 stand-in
# hosts (network namespaces of scripts/netns-hosts.sh) x 2 ranks, rounds interleaved, one
# oxccl-perf row per round and transport (busbw out of place, in place). Needs root, iproute2,
# libfabric with its tcp provider, and target/release/oxccl-perf (cargo build --release).
#
#   scripts/ofi-vs-socket.sh                    # 64M, 3 rounds, 10 iterations
#   SIZE=16M ROUNDS=5 PROVIDER=tcp scripts/ofi-vs-socket.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-64M}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-10}
PROVIDER=${PROVIDER:-"tcp;ofi_rxm"}
PERF=target/release/oxccl-perf
P=oxofi
tmp=$(mktemp -d)
OXH_PREFIX=$P OXH_NET=10.219.0 scripts/netns-hosts.sh up 2 >/dev/null
trap 'OXH_PREFIX=$P scripts/netns-hosts.sh down; rm -rf "$tmp"' EXIT

run() {
  local net=$1 port=$((29000 + RANDOM % 1000)) r
  for r in 0 1 2 3; do
    ip netns exec "$P$((r / 2))" env OXCCL_RANK=$r OXCCL_NRANKS=4 OXCCL_COMM_ID=10.219.0.1:$port \
      OXCCL_SOCKET_IFNAME=oxv0 OXCCL_NET="$net" OXCCL_OFI_PROVIDER="$PROVIDER" \
      "$PERF" all_reduce -b "$SIZE" -e "$SIZE" -n "$ITERS" -w 3 >"$tmp/$net.$r" 2>&1 &
  done
  wait
  awk -v net="$net" '$1 ~ /^[0-9]+$/ && NF >= 12 { printf "%-7s busbw %s GB/s out of place, %s in place\n", net, $8, $12 }' "$tmp/$net.0"
}

echo "all_reduce $SIZE, 2 hosts x 2 ranks, provider $PROVIDER for ofi"
for ((i = 1; i <= ROUNDS; i++)); do
  run socket
  run ofi
done
