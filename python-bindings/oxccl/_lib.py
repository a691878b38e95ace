"""Finding and loading liboxccl.so.

Only two places are ever used, so that no library planted where the program happens to run
can be loaded into it:

1. ``OXCCL_LIBRARY``: a path to the library file (an error if it names a missing file).
2. The copy shipped inside the package: ``oxccl/lib/liboxccl.so``, or the one ``pip install``
   built into it (setup.py, named ``oxccl/lib/liboxccl.<python tag>.so``).

Neither the current directory nor its parents nor a source checkout's ``target/`` folder is
searched: to use a library built with cargo, name it in ``OXCCL_LIBRARY``. When nothing is
found, :class:`LibraryNotFound` names every place that was looked at.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import List, Optional

LIBRARY_FILE = "liboxccl.so"
PACKAGE_DIR = Path(__file__).resolve().parent


class LibraryNotFound(OSError):
    """liboxccl.so was not found; the message names every place looked at."""


def candidates(env: Optional[dict] = None, package_dir: Path = PACKAGE_DIR) -> List[Path]:
    """Every path looked at, in order (for ``OXCCL_LIBRARY``, only that path)."""
    env = os.environ if env is None else env
    explicit = env.get("OXCCL_LIBRARY", "").strip()
    if explicit:
        return [Path(explicit)]
    return [package_dir / "lib" / LIBRARY_FILE, *sorted((package_dir / "lib").glob("liboxccl.*.so"))]


def find_library(env: Optional[dict] = None, package_dir: Path = PACKAGE_DIR) -> Path:
    """The path of liboxccl.so by the order above; :class:`LibraryNotFound` if none."""
    env = os.environ if env is None else env
    paths = candidates(env, package_dir)
    for p in paths:
        if p.is_file():
            return p
    if env.get("OXCCL_LIBRARY", "").strip():
        raise LibraryNotFound(f"OXCCL_LIBRARY={env['OXCCL_LIBRARY']} does not name a file")
    looked = "\n  ".join(str(p) for p in [package_dir / "lib" / LIBRARY_FILE, package_dir / "lib" / "liboxccl.*.so"])
    raise LibraryNotFound(
        f"{LIBRARY_FILE} not found. Looked for the copy inside the package:\n  {looked}\n"
        "and OXCCL_LIBRARY is unset. Install the package with its library (`pip install ./python-bindings` "
        "in the oxccl checkout builds it in), or set OXCCL_LIBRARY=/path/to/liboxccl.so "
        "(e.g. target/release/liboxccl.so after `cargo build --release`). The current directory "
        "and source checkouts are never searched."
    )


def load(path: Optional[Path] = None) -> ctypes.CDLL:
    """Loads the library (found by :func:`find_library` unless a path is given)."""
    path = find_library() if path is None else path
    return ctypes.CDLL(str(path))
