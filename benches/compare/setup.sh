#!/usr/bin/env bash
# Installs what the comparison needs, once (each step is skipped when already done):
#   - Open MPI from Debian (openmpi-bin, libopenmpi-dev) for the C MPI_Allreduce benchmark;
#   - a venv under build/venv-torch with PyPI's torch (Gloo backend; the Linux wheel pulls
#     ~4 GB of nvidia-* wheels it needs to import, even without a GPU), numpy, matplotlib,
#     and mpi4py compiled against that Open MPI (~3-4 minutes to build).
# build/ is git-ignored, so none of this ends up in the repository.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-build/venv-torch}

if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
  echo "== apt-get install openmpi-bin libopenmpi-dev"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== python venv $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, numpy, matplotlib" >/dev/null 2>&1; then
  echo "== pip install torch numpy matplotlib (large download, once)"
  "$VENV/bin/pip" install -q torch numpy matplotlib
fi
if ! "$VENV/bin/python" -c "import mpi4py" >/dev/null 2>&1; then
  echo "== pip install mpi4py, compiled against Open MPI's mpicc"
  MPICC=$(command -v mpicc) "$VENV/bin/pip" install -q --no-binary mpi4py --no-cache-dir mpi4py
fi
echo "== setup done: $("$VENV/bin/python" -c 'import torch, mpi4py; print("torch", torch.__version__, "mpi4py", mpi4py.__version__)')"
