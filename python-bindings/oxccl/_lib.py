"""Finding and loading liboxccl.so.

Search order (the first that exists wins):

1. ``OXCCL_LIBRARY``: a path to the library file (an error if it names a missing file).
2. The copy shipped inside the package: ``oxccl/lib/liboxccl.so``, or the one ``pip install``
   built into it (setup.py, named ``oxccl/lib/liboxccl.<python tag>.so``).
3. The cargo target directory of a source checkout: ``$CARGO_TARGET_DIR`` and, from the
   package's own directory and from the current directory upwards, the first folder holding
   a ``Cargo.toml`` of the oxccl crate; in each, ``target/release`` then ``target/debug``.

When nothing is found, :class:`LibraryNotFound` lists every place that was looked at.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterable, List, Optional

LIBRARY_FILE = "liboxccl.so"
PACKAGE_DIR = Path(__file__).resolve().parent


class LibraryNotFound(OSError):
    """liboxccl.so was not found; the message lists every place searched."""


def _checkout_roots(starts: Iterable[Path]) -> List[Path]:
    """Folders at or above each start that hold the oxccl crate's Cargo.toml."""
    roots: List[Path] = []
    for start in starts:
        for d in [start, *start.parents]:
            manifest = d / "Cargo.toml"
            try:
                if manifest.is_file() and 'name = "oxccl"' in manifest.read_text(errors="replace"):
                    if d not in roots:
                        roots.append(d)
                    break
            except OSError:
                continue
    return roots


def candidates(env: Optional[dict] = None, package_dir: Path = PACKAGE_DIR, cwd: Optional[Path] = None) -> List[Path]:
    """Every path searched, in order (for ``OXCCL_LIBRARY``, only that path)."""
    env = os.environ if env is None else env
    explicit = env.get("OXCCL_LIBRARY", "").strip()
    if explicit:
        return [Path(explicit)]
    paths = [package_dir / "lib" / LIBRARY_FILE]
    paths += sorted((package_dir / "lib").glob("liboxccl.*.so"))
    targets: List[Path] = []
    if env.get("CARGO_TARGET_DIR", "").strip():
        targets.append(Path(env["CARGO_TARGET_DIR"]))
    cwd = Path.cwd() if cwd is None else cwd
    targets += [root / "target" for root in _checkout_roots([package_dir, cwd])]
    for t in targets:
        paths += [t / "release" / LIBRARY_FILE, t / "debug" / LIBRARY_FILE]
    return paths


def find_library(env: Optional[dict] = None, package_dir: Path = PACKAGE_DIR, cwd: Optional[Path] = None) -> Path:
    """The path of liboxccl.so by the search order above; :class:`LibraryNotFound` if none."""
    env = os.environ if env is None else env
    paths = candidates(env, package_dir, cwd)
    for p in paths:
        if p.is_file():
            return p
    if env.get("OXCCL_LIBRARY", "").strip():
        raise LibraryNotFound(f"OXCCL_LIBRARY={env['OXCCL_LIBRARY']} does not name a file")
    looked = "\n  ".join(str(p) for p in paths)
    raise LibraryNotFound(
        f"{LIBRARY_FILE} not found. Looked in:\n  {looked}\n"
        "Set OXCCL_LIBRARY=/path/to/liboxccl.so, or build it with `cargo build --release` in the "
        "oxccl source checkout (and run from inside it), or copy it to oxccl/lib/ in the package."
    )


def load(path: Optional[Path] = None) -> ctypes.CDLL:
    """Loads the library (found by :func:`find_library` unless a path is given)."""
    path = find_library() if path is None else path
    return ctypes.CDLL(str(path))
