#!/usr/bin/env bash
# Runs every test of the project on a fresh machine: installs what is missing (a C compiler
# for ffi-tests via apt-get; Python test dependencies via pip once python-bindings exists),
# then cargo tests (unit, multi-process, header, C programs) and the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
command -v patchelf >/dev/null 2>&1 || need_apt+=(patchelf)  # libnccl.so.2 alias (tests/dropin.rs)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing ${need_apt[*]} (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

# Every rank in these tests lives on this machine: keep all traffic on loopback.
export OXCCL_SOCKET_IFNAME=lo

echo "== cargo test (tests/device_standin.rs runs the device path on the CUDA stand-in, cuda-standin/)"
cargo test --release --all-targets 2>&1

echo "== NVRTC check: cuda/*.cu with NVIDIA's NVRTC 12 and 13 (scripts/nvrtc-check.sh)"
scripts/nvrtc-check.sh

if [ -d python-bindings/tests ]; then
  echo "== python tests"
  scripts/python-tests.sh
fi
