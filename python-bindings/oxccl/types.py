"""NCCL data types and reduction operators, and how array libraries' types map to them."""

from __future__ import annotations

import enum
from typing import Optional, Union


class DataType(enum.IntEnum):
    """``ncclDataType_t`` (same values as nccl.h)."""

    int8 = 0
    uint8 = 1
    int32 = 2
    uint32 = 3
    int64 = 4
    uint64 = 5
    float16 = 6
    float32 = 7
    float64 = 8
    bfloat16 = 9
    float8_e4m3 = 10
    float8_e5m2 = 11

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DataType.int8: 1,
    DataType.uint8: 1,
    DataType.int32: 4,
    DataType.uint32: 4,
    DataType.int64: 8,
    DataType.uint64: 8,
    DataType.float16: 2,
    DataType.float32: 4,
    DataType.float64: 8,
    DataType.bfloat16: 2,
    DataType.float8_e4m3: 1,
    DataType.float8_e5m2: 1,
}


class ReduceOp(enum.IntEnum):
    """``ncclRedOp_t`` built-in operators (same values as nccl.h)."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


_OP_NAMES = {
    "sum": ReduceOp.SUM,
    "prod": ReduceOp.PROD,
    "product": ReduceOp.PROD,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "avg": ReduceOp.AVG,
    "mean": ReduceOp.AVG,
}


def reduce_op(op: Union[ReduceOp, str, int]) -> int:
    """An operator given as :class:`ReduceOp`, a name (``"sum"``) or an ``ncclRedOp_t`` value
    (values from ``ncclNumOps`` up are user-created operators and are passed through)."""
    if op.__class__ is ReduceOp:
        return op
    if isinstance(op, str):
        try:
            return int(_OP_NAMES[op.lower()])
        except KeyError:
            raise ValueError(f"unknown reduction operator {op!r}; expected one of {sorted(_OP_NAMES)}") from None
    if isinstance(op, bool) or not isinstance(op, int):
        raise TypeError(f"reduction operator must be a ReduceOp, a name or an int, not {type(op).__name__}")
    if op < 0:
        raise ValueError(f"reduction operator {op} is negative")
    return int(op)


# Names used by numpy (and ml_dtypes), torch and the array interface's kind+size.
_BY_NAME = {
    "int8": DataType.int8,
    "uint8": DataType.uint8,
    "int32": DataType.int32,
    "uint32": DataType.uint32,
    "int64": DataType.int64,
    "uint64": DataType.uint64,
    "float16": DataType.float16,
    "half": DataType.float16,
    "float32": DataType.float32,
    "float": DataType.float32,
    "float64": DataType.float64,
    "double": DataType.float64,
    "bfloat16": DataType.bfloat16,
    "float8_e4m3fn": DataType.float8_e4m3,
    "float8_e5m2": DataType.float8_e5m2,
}

_BY_KIND = {
    ("i", 1): DataType.int8,
    ("u", 1): DataType.uint8,
    ("i", 4): DataType.int32,
    ("u", 4): DataType.uint32,
    ("i", 8): DataType.int64,
    ("u", 8): DataType.uint64,
    ("f", 2): DataType.float16,
    ("f", 4): DataType.float32,
    ("f", 8): DataType.float64,
}

SUPPORTED = (
    "int8, uint8, int32, uint32, int64, uint64, float16, float32, float64, "
    "bfloat16 / float8_e4m3fn / float8_e5m2 (ml_dtypes or torch)"
)


def from_name(name: str) -> Optional[DataType]:
    """The data type of a numpy / ml_dtypes / torch dtype name (``"float32"``,
    ``"torch.bfloat16"``); None when NCCL has no such type."""
    return _BY_NAME.get(name.rsplit(".", 1)[-1])


def from_typestr(typestr: str) -> Optional[DataType]:
    """The data type of an array-interface type string (``"<f4"``); None when unsupported or
    not in native byte order."""
    import sys

    if len(typestr) < 3:
        return None
    order, kind, size = typestr[0], typestr[1], typestr[2:]
    native = "<" if sys.byteorder == "little" else ">"
    if order not in ("|", "=", native) or not size.isdigit():
        return None
    return _BY_KIND.get((kind, int(size)))


def from_dlpack(code: int, bits: int, lanes: int) -> Optional[DataType]:
    """The data type of a DLPack ``DLDataType``; None when unsupported."""
    if lanes != 1:
        return None
    kind = {0: "i", 1: "u", 2: "f"}.get(code)
    if kind is not None:
        return _BY_KIND.get((kind, bits // 8)) if bits % 8 == 0 else None
    # kDLBfloat = 4; DLPack 1.1 float8: kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12.
    return {(4, 16): DataType.bfloat16, (10, 8): DataType.float8_e4m3, (12, 8): DataType.float8_e5m2}.get((code, bits))
