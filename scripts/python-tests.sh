#!/usr/bin/env bash
# Python tests: creates or reuses a cached venv under build/venv-py with numpy, pytest,
# ml_dtypes, setuptools-rust and torch, installs ./python-bindings into it (as a user does:
# setup.py builds liboxccl into the package with cargo), and runs pytest against the library
# inside the package.
#
# The package's library is built in this checkout's target/ (CARGO_TARGET_DIR, unless set), where
# its dependencies are already built: about 45 s here, against about 150 s in the package's own
# target directory. That build has other features than the checkout's (no plotting), and cargo
# would leave it at target/release/liboxccl.so, so the checkout's copy is set aside and put back.
#
# torch comes from PyPI (its Linux wheel is the CUDA build: ~4 GB with its nvidia-* wheels,
# ~70 s to install here); it is installed once and reused. If it cannot be installed, the
# tests that need it skip with a visible reason and the rest still run.
#
# With torch, it then runs PyTorch's own distributed_test suite against Gloo and "oxccl" at
# 2 and 3 ranks on a fixed subset (python-bindings/torch_suite/compare.py --subset; the full
# comparison is `compare.py` without --subset, ~30 min here). OXCCL_SKIP_TORCH_SUITE=1 skips it.
#
# Options: `--venv-only` prepares the venv and exits; other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/build/venv-py"
py="$venv/bin/python"

if [ ! -x "$py" ]; then
  echo "== creating $venv"
  python3 -m venv "$venv"
fi
if ! "$py" -c 'import numpy, pytest, ml_dtypes, expecttest, setuptools, setuptools_rust, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null; then
  echo "== installing numpy, pytest, ml_dtypes, expecttest, setuptools, setuptools-rust"
  # expecttest: imported by torch.testing._internal (PyTorch's distributed_test suite)
  "$py" -m pip install -q --disable-pip-version-check numpy pytest ml_dtypes expecttest "setuptools>=71" "setuptools-rust>=1.5"
fi
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "== installing torch from PyPI: a ~4 GB download with its nvidia-* wheels (once; cached in $venv)"
  if ! "$py" -m pip install -q --disable-pip-version-check torch; then
    echo "!! torch could not be installed: the torch tests will be SKIPPED (see pytest's skip reasons)"
  fi
fi
if [ "${1:-}" = "--venv-only" ]; then
  exit 0
fi

echo "== installing ./python-bindings (builds liboxccl into the package with cargo)"
tdir=${CARGO_TARGET_DIR:-$root/target}
own="$tdir/release/liboxccl.so"
kept="$tdir/release/.liboxccl.so.kept"
if [ -e "$own" ]; then mv -f "$own" "$kept"; fi
set +e
CARGO_TARGET_DIR="$tdir" "$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall ./python-bindings
rc=$?
set -e
if [ -e "$kept" ]; then rm -f "$own" && mv -f "$kept" "$own"; fi
[ "$rc" -eq 0 ] || exit "$rc"

# Every rank in these tests lives on this machine: keep all traffic on loopback.
export OXCCL_SOCKET_IFNAME=lo
# The tests use the library inside the installed package (tests/test_packaging.py checks it).
unset OXCCL_LIBRARY
export OXCCL_EXPECT_BUNDLED=1
# Run from the repository root, where no oxccl/ folder shadows the installed package.
"$py" -c 'import oxccl; print("== testing", oxccl.__file__, "with", oxccl.find_library())'
# pytest exits 5 when it collects no test: treat that as the failure it is.
set +e
"$py" -m pytest -ra --durations=10 "$@" python-bindings/tests
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "!! pytest collected no tests" >&2
  exit 1
fi
if [ "${OXCCL_SKIP_TORCH_SUITE:-0}" != 1 ] && "$py" -c 'import torch, expecttest' 2>/dev/null; then
  echo "== PyTorch distributed_test subset: Gloo vs oxccl, 2 and 3 ranks"
  if ! "$py" python-bindings/torch_suite/compare.py --subset --budget 900; then
    rc=1
  fi
else
  echo "== PyTorch distributed_test subset: SKIPPED (torch or expecttest missing, or OXCCL_SKIP_TORCH_SUITE=1)"
fi
exit $rc
