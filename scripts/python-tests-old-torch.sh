#!/usr/bin/env bash
# The torch backend's tests under an older torch than the one scripts/python-tests.sh installs:
# one whose c10d Backend has no Python constructor (torch 2.6 to 2.13), where oxccl's backend
# is a ProcessGroup instead (python-bindings/oxccl/torch/compat.py). Not part of
# scripts/test.sh (a second torch is a ~3 GB download with its nvidia-* wheels and the run takes
# ~4 min on 2 cores); run it after changing python-bindings/oxccl/torch/.
#
# Usage: scripts/python-tests-old-torch.sh [TORCH_VERSION] [pytest args...]
#   TORCH_VERSION defaults to 2.10.0; the venv is cached in build/venv-torch-TORCH_VERSION.
# It uses the library built here (cargo build --release --lib) and the package from the
# source tree (PYTHONPATH), and runs test_torch_backend.py and test_torch_clients.py.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
version="${1:-2.10.0}"
[ $# -gt 0 ] && shift
venv="$root/build/venv-torch-$version"
py="$venv/bin/python"

echo "== cargo build --release (liboxccl.so)"
cargo build --release --lib 2>&1
if [ ! -x "$py" ]; then
  echo "== creating $venv"
  python3 -m venv "$venv"
fi
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "== installing torch==$version, numpy, pytest, ml_dtypes"
  "$py" -m pip install -q --disable-pip-version-check "torch==$version" numpy pytest ml_dtypes
fi
export OXCCL_SOCKET_IFNAME=lo
export OXCCL_LIBRARY="$root/target/release/liboxccl.so"
export PYTHONPATH="$root/python-bindings"
"$py" -c 'import torch, oxccl.torch as t; print("== testing", t.__file__, "with torch", torch.__version__, "per-device backend:", t.compat.PER_DEVICE)'
cd python-bindings/tests
exec "$py" -m pytest -ra "$@" test_torch_backend.py test_torch_clients.py
