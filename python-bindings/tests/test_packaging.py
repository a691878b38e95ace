"""The installed package carries its own liboxccl (setup.py builds it with cargo)."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

import oxccl
from oxccl import _lib


@pytest.mark.skipif(
    os.environ.get("OXCCL_EXPECT_BUNDLED") != "1", reason="only under scripts/python-tests.sh, which installs the package"
)
def test_installed_package_loads_its_own_library(tmp_path):
    # From a folder outside any checkout, with no OXCCL_LIBRARY: the library inside the package.
    env = {k: v for k, v in os.environ.items() if k not in ("OXCCL_LIBRARY", "CARGO_TARGET_DIR")}
    code = "import ctypes, oxccl; v = ctypes.c_int(); oxccl.lib().ncclGetVersion(ctypes.byref(v)); print(oxccl.find_library(), v.value)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, version = out.stdout.split()
    assert Path(path).parent == _lib.PACKAGE_DIR / "lib", path
    assert Path(path).name.startswith("liboxccl") and path.endswith(".so")
    mine = ctypes.c_int()
    oxccl.lib().ncclGetVersion(ctypes.byref(mine))
    assert int(version) == mine.value


def test_bundled_library_is_searched_before_checkouts(tmp_path):
    pkg = tmp_path / "oxccl"
    (pkg / "lib").mkdir(parents=True)
    built = pkg / "lib" / "liboxccl.cpython-311-x86_64-linux-gnu.so"
    built.write_bytes(b"")
    paths = _lib.candidates(env={}, package_dir=pkg, cwd=tmp_path)
    assert paths[:2] == [pkg / "lib" / "liboxccl.so", built]
    assert _lib.find_library(env={}, package_dir=pkg, cwd=tmp_path) == built
