"""Device buffers from Python, on the CUDA stand-in (cuda-standin/, built here with ``cc``).

torch here is CPU-only, so the device arrays are objects exposing ``__cuda_array_interface__``
over memory allocated through the stand-in's libcuda (tests/device_checks.py). Each rank runs
all-reduce, broadcast, all-gather, reduce-scatter and all-to-all on them (float32 and int32, on
a stream of its own and on the default stream) and checks the values against numpy; the
``OXCCL_DEBUG=INFO`` log of every rank must show that the device path ran (CUDA IPC on this
host), not the host path.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    for tool in ("cc", "c++", "bash"):
        if shutil.which(tool) is None:
            pytest.skip(f"SKIPPED: building the CUDA stand-in needs {tool}")
    out = ROOT / "target" / "cuda-standin-py"
    subprocess.run(["bash", str(ROOT / "cuda-standin" / "build.sh"), str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_cuda_array_interface_objects_route_to_the_device_path(standin, tmp_path, size):
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {
        "LD_LIBRARY_PATH": f"{standin}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "OXCCL_STANDIN_CACHE": str(standin / "cache"),
        "OXCCL_KERNEL_CACHE": str(standin / "kernel-cache"),
        "OXCCL_STANDIN_WAIT_MS": "60000",
        "OXCCL_DEBUG": "INFO",
        "OXCCL_DEBUG_FILE": str(logs / "rank.%p.log"),
        # Small IPC areas: the calls below run in several chunks.
        "OXCCL_CUDA_IPC_BUFFER": "4096",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        pool = ranks.RankPool(size, "device_checks")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        for use_stream in (True, False):
            done = pool.run("collectives", 1500, use_stream)
            assert all(len(d) == 10 for d in done), done
    finally:
        pool.close()
    # One log per process (the ranks and this one, which made the unique id).
    text = "".join(Path(f).read_text(errors="replace") for f in glob.glob(str(logs / "rank.*.log")))
    for r in range(size):
        for coll in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "alltoall"):
            line = f"rank {r}: device {coll} path: ipc"
            assert line in text, f"{line!r} missing: the call did not take the device IPC path:\n{text[-3000:]}"
        assert "path: staged" not in text, text[-3000:]
