"""Builds liboxccl.so from the oxccl crate one folder up (cargo, through setuptools-rust) and
ships it inside the package as oxccl/lib/liboxccl*.so, so `pip install ./python-bindings` on a
machine with cargo gives a working `import oxccl`, and `pip wheel ./python-bindings` a platform
wheel that installs elsewhere without Rust. The library has no Python binding (ctypes loads it).

The library is built with its transports (the `ofi` feature: libfabric where its headers are
found, loaded at run time) and without the perf tool's plotting, into a target directory of
its own (python-bindings/build/cargo, unless CARGO_TARGET_DIR names another), so it never
replaces a checkout's target/release/liboxccl.so built with other features.

OXCCL_PY_NO_BUILD=1 skips the cargo build: the package then needs OXCCL_LIBRARY to name
liboxccl.so at run time (see oxccl/_lib.py).
"""

import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

rust_extensions = []
if os.environ.get("OXCCL_PY_NO_BUILD", "") in ("", "0"):
    os.environ.setdefault("CARGO_TARGET_DIR", os.path.join(HERE, "build", "cargo"))
    from setuptools_rust import Binding, RustExtension, Strip

    rust_extensions.append(
        RustExtension(
            "oxccl.lib.liboxccl",
            path=os.path.join(HERE, "..", "Cargo.toml"),
            binding=Binding.NoBinding,
            # The library with its transports; not oxccl-perf's plotting dependencies.
            features=["ofi"],
            args=["--no-default-features"],
            debug=False,
            # The release profile keeps line tables (debug = 1) for backtraces; a wheel need not.
            strip=Strip.Debug,
        )
    )

setup(rust_extensions=rust_extensions, zip_safe=False)
