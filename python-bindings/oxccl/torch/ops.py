"""Tensor and operator conversions shared by the oxccl torch backend: the buffer NCCL sees
for a tensor (bool as uint8, complex as real pairs), output copy-back, reduce operators."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..types import DataType, ReduceOp

_TORCH_OPS = [
    (dist.ReduceOp.SUM, ReduceOp.SUM),
    (dist.ReduceOp.PRODUCT, ReduceOp.PROD),
    (dist.ReduceOp.MIN, ReduceOp.MIN),
    (dist.ReduceOp.MAX, ReduceOp.MAX),
    (dist.ReduceOp.AVG, ReduceOp.AVG),
]

_OP_NAMES = {
    dist.ReduceOp.BAND: "BAND",
    dist.ReduceOp.BOR: "BOR",
    dist.ReduceOp.BXOR: "BXOR",
    dist.ReduceOp.PREMUL_SUM: "PREMUL_SUM",
}


def op_name(top: Any) -> str:
    """A readable name for a torch reduce operator (``ReduceOp`` objects print as addresses)."""
    for t, name in _OP_NAMES.items():
        try:
            if top == t:
                return name
        except TypeError:
            pass
    for t, o in _TORCH_OPS:
        if top == t:
            return o.name
    return str(getattr(top, "op", top)).replace("RedOpType.", "")


def reduce_op(opts: Any, what: str) -> ReduceOp:
    """The NCCL operator of a torch ``*Options`` object (or a bare torch ReduceOp)."""
    top = getattr(opts, "reduceOp", opts)
    if top is None:
        return ReduceOp.SUM
    for t, o in _TORCH_OPS:
        if top == t:
            return o
    raise ValueError(
        f"oxccl {what}: reduce op {op_name(top)} is not supported by the oxccl backend "
        "(SUM, PRODUCT, MIN, MAX, AVG are)"
    )


def one(tensors: Any, what: str) -> torch.Tensor:
    """The single tensor of a per-process tensor list (one tensor per process, as NCCL)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"oxccl {what}: the oxccl backend takes one tensor per process, got {len(tensors)}")
    return tensors[0]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The view NCCL sees: bool as uint8, complex as its real pairs."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def inp(t: torch.Tensor) -> torch.Tensor:
    """A contiguous input buffer of ``t``."""
    return raw(t.contiguous())


class Out:
    """An output tensor as a contiguous buffer NCCL can write, copied back by :meth:`finish`
    when a temporary had to be made."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.contig = t if t.is_contiguous() else t.contiguous()
        self.buf = raw(self.contig)

    def finish(self) -> None:
        if self.contig is not self.tensor:
            self.tensor.copy_(self.contig)


def op_for(t: torch.Tensor, op: ReduceOp, what: str) -> ReduceOp:
    """Operator adjusted to the view: on bool, SUM is logical or (MAX), PROD is and (MIN);
    on complex only SUM and AVG are elementwise on the real pairs."""
    if t.dtype == torch.bool:
        if op == ReduceOp.AVG:
            raise ValueError(f"oxccl {what}: AVG is not defined for bool tensors")
        return {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}.get(op, op)
    if t.is_complex() and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"oxccl {what}: {op.name} is not defined for complex tensors (SUM and AVG are)")
    return op


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (shares storage)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


#: NCCL's type of each torch dtype a raw (:func:`raw`) view can have.
_HOST_TYPES = {
    torch.int8: DataType.int8,
    torch.uint8: DataType.uint8,
    torch.int32: DataType.int32,
    torch.int64: DataType.int64,
    torch.float16: DataType.float16,
    torch.float32: DataType.float32,
    torch.float64: DataType.float64,
    torch.bfloat16: DataType.bfloat16,
}


def host_dtype(buf: torch.Tensor):
    """NCCL's type of a contiguous CPU buffer, or None when it takes the general path
    (another device, a type outside the table, a non-contiguous view)."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    return _HOST_TYPES.get(buf.dtype)
