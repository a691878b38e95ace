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


def test_only_the_bundled_library_is_a_candidate(tmp_path):
    pkg = tmp_path / "oxccl"
    (pkg / "lib").mkdir(parents=True)
    built = pkg / "lib" / "liboxccl.cpython-311-x86_64-linux-gnu.so"
    built.write_bytes(b"")
    paths = _lib.candidates(env={}, package_dir=pkg)
    assert paths == [pkg / "lib" / "liboxccl.so", built]
    assert _lib.find_library(env={}, package_dir=pkg) == built


def test_a_library_planted_in_a_checkout_around_the_working_directory_is_not_loaded(tmp_path):
    # A folder that looks like an oxccl checkout, with a target/release/liboxccl.so whose
    # constructor would leave a marker file; a copy of the package without its own library is
    # imported from below it, with no OXCCL_LIBRARY: it must refuse, naming what it looked for.
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the planted library")
    planted = tmp_path / "checkout"
    (planted / "target" / "release").mkdir(parents=True)
    (planted / "Cargo.toml").write_text('[package]\nname = "oxccl"\n')
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "evil.c"
    src.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void ran(void) {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
        "int ncclGetVersion(int *v) { *v = 0; return 0; }\n"
    )
    lib = planted / "target" / "release" / "liboxccl.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    pkg = tmp_path / "site" / "oxccl"
    shutil.copytree(_lib.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("lib", "__pycache__"))
    cwd = planted / "sub" / "dir"
    cwd.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OXCCL_LIBRARY", "CARGO_TARGET_DIR")}
    env["PYTHONPATH"] = str(pkg.parent)
    env["CARGO_TARGET_DIR"] = str(planted / "target")
    code = "import oxccl, sys; print(oxccl.__file__, file=sys.stderr); oxccl.lib()"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert str(pkg) in out.stderr, out.stderr  # the copy without a library was the one imported
    assert out.returncode != 0, out.stderr
    assert "LibraryNotFound" in out.stderr and str(pkg / "lib" / "liboxccl.so") in out.stderr, out.stderr
    assert "OXCCL_LIBRARY" in out.stderr, out.stderr
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    # Named in OXCCL_LIBRARY, the same file is what loads (the check above can fail).
    env["OXCCL_LIBRARY"] = str(lib)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert marker.exists(), out.stderr
