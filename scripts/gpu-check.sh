#!/usr/bin/env bash
# GPU check on a machine that has cargo: builds the GPU check kit (scripts/gpu-kit.sh) into
# build/gpu-kit and runs it (build/gpu-kit/run). Arguments go to the runner: --quick for the
# smoke step alone, --only REGEX, --budget SECONDS, --standin for the CPU stand-in of CUDA.
# Output under $OUT (default ./gpu-kit-out); the summary table is printed last. A machine
# without cargo takes a kit built elsewhere and runs DIR/run itself (docs/GPU.md).
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${KIT_DIR:-build/gpu-kit}"
bash scripts/gpu-kit.sh "$kit" >/dev/null
exec "$kit/run" "$@"
