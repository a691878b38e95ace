"""Test data and independent references (Python integers and float64), shared by the checks
that run on every rank and by the parent test process.

Every rank's input is a deterministic function of (dtype, count, rank, seed), so each rank
can rebuild every other rank's input and compute the expected result itself.

Integers cover each type's full range; the reference is computed with Python integers and
wrapped to the type's width (NCCL's integer SUM/PROD wrap; AVG truncates the wrapped sum
toward zero). Floats take values in {-1, -0.5, 0, 0.5, 1}: sums of up to 3 ranks and their
products are exact in every NCCL float type down to float8 e5m2, so the float64 reference,
rounded once to the type (only AVG's division rounds), must match bit for bit.
"""

from __future__ import annotations

from typing import List

import numpy as np

try:
    import ml_dtypes
except ImportError:  # the narrow float types are skipped (visibly) without it
    ml_dtypes = None

INT_TYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64"]
FLOAT_TYPES = ["float16", "float32", "float64"]
ML_TYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
ALL_TYPES = INT_TYPES + FLOAT_TYPES + ML_TYPES
OPS = ["sum", "prod", "max", "min", "avg"]


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype for an NCCL type name (ml_dtypes for the narrow floats)."""
    if name in ML_TYPES:
        if ml_dtypes is None:
            raise RuntimeError("ml_dtypes is not installed")
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def is_int(name: str) -> bool:
    return name in INT_TYPES


def make(name: str, count: int, rank: int, seed: int) -> np.ndarray:
    """Rank `rank`'s input."""
    rng = np.random.default_rng([seed, rank, count, ALL_TYPES.index(name)])
    dt = np_dtype(name)
    if is_int(name):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt)
    return (rng.integers(-2, 3, size=count) * 0.5).astype(dt)


def _wrap(v: int, name: str) -> int:
    bits = np_dtype(name).itemsize * 8
    v &= (1 << bits) - 1
    if name.startswith("int") and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _int_fold(op: str, cols: List[List[int]], name: str) -> List[int]:
    out = []
    n = len(cols)
    for vals in zip(*cols):
        if op in ("sum", "avg"):
            s = _wrap(sum(vals), name)
            if op == "avg":
                q = abs(s) // n
                s = q if s >= 0 else -q
            out.append(s)
        elif op == "prod":
            p = 1
            for v in vals:
                p *= v
            out.append(_wrap(p, name))
        elif op == "max":
            out.append(max(vals))
        else:
            out.append(min(vals))
    return out


def reduce_ref(op: str, inputs: List[np.ndarray], name: str) -> np.ndarray:
    """The expected reduction of `inputs` as an array of the type."""
    dt = np_dtype(name)
    if is_int(name):
        cols = [[int(x) for x in a.tolist()] for a in inputs]
        return np.array(_int_fold(op, cols, name), dtype=dt).reshape(inputs[0].shape)
    f = np.stack([a.astype(np.float64) for a in inputs])
    if op == "sum":
        r = f.sum(axis=0)
    elif op == "prod":
        r = f.prod(axis=0)
    elif op == "max":
        r = f.max(axis=0)
    elif op == "min":
        r = f.min(axis=0)
    else:
        r = f.sum(axis=0) / len(inputs)
    return r.astype(dt)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Asserts identical type, shape and bits."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    g, w = got.view(np.uint8), want.view(np.uint8)
    if not np.array_equal(g, w):
        bad = np.flatnonzero(
            (got != want) if got.dtype.kind in "iu" else (got.astype(np.float64) != want.astype(np.float64))
        )
        i = int(bad[0]) if bad.size else 0
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements differ; "
            f"first at {i}: got {got.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r}"
        )
