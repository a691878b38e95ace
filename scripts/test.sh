#!/usr/bin/env bash
# Runs every test of the project on a fresh machine (this is what CI runs): installs what is
# missing (a C compiler for ffi-tests via apt-get; the Python venv via scripts/python-tests.sh),
# then runs each step below even when an earlier one fails, and ends with a summary: per suite
# passed / failed / skipped, every skip named. Exits non-zero when any step failed.
#
# A test that printed a `SKIPPED: ...` line (tests/common `skipped`) counts as skipped, not
# passed. Each step's full output is kept in build/test-logs/NAME.log.
#
# To add a step, add one line `step NAME CMD...` to the list at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=build/test-logs
rm -rf "$logs"
mkdir -p "$logs"
steps=()

# step NAME CMD...: runs CMD with its output shown and kept in $logs/NAME.log; records its status.
step() {
  local name=$1
  shift
  echo
  echo "== step $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$rc $((SECONDS - start))" >"$logs/$name.status"
  steps+=("$name")
  [ "$rc" -eq 0 ] || echo "!! step $name failed (exit $rc)"
}

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
command -v patchelf >/dev/null 2>&1 || need_apt+=(patchelf)  # libnccl.so.2 alias (tests/dropin.rs, scripts/install.sh)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)  # tests/packaging.rs
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)  # tests/packaging.rs (find_package)
# The ofi transport: headers to build its shim (build.rs), the library it loads at run time
# (tests/ofi.rs, over libfabric's tcp provider).
[ -e /usr/include/rdma/fabric.h ] || need_apt+=(libfabric-dev)
ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1 ' || need_apt+=(libfabric1)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing ${need_apt[*]} (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

# Every rank in these tests lives on this machine: keep all traffic on loopback.
export OXCCL_SOCKET_IFNAME=lo

# NVIDIA's nccl.h (tests/dropin.rs compares ABIs with it) comes in a large wheel: fetch it here,
# where its notice shows, rather than silently inside the test.
scripts/fetch-nccl-header.sh >/dev/null || echo "!! NVIDIA's nccl.h is unavailable: tests/dropin.rs will report it SKIPPED"

# The steps, in order. Each runs even when an earlier one failed.
step fmt cargo fmt --check
# clippy also checks the declared rust-version (Cargo.toml): its incompatible_msrv lint flags
# any standard-library API newer than that version.
step clippy cargo clippy --all-targets --keep-going -- -D warnings
# rustdoc warnings (broken intra-doc links, e.g. a "[C]" milestone tag read as a link) fail.
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --bins
# The plain binaries the GPU check kit carries (tests/gpu_kit.rs builds the kit from them):
# `cargo test` builds examples only in its own test profile.
step build cargo build --release --bins --examples
step cargo-test cargo test --release --all-targets --no-fail-fast
step doctest cargo test --release --doc
# cuda/*.cu compiled by NVIDIA's real NVRTC 12 and 13 (wheels cached under build/nvrtc).
step nvrtc scripts/nvrtc-check.sh
if [ -d python-bindings/tests ]; then
  step python scripts/python-tests.sh
fi

python3 scripts/test-summary.py "$logs" "${steps[@]}"
