"""Collectives built from all-reduce, for a liboxccl that lacks the native symbol.

Used by the torch backend only while the loaded liboxccl does not export ``ncclBroadcast``,
``ncclReduce``, ``ncclAllGather`` or ``ncclReduceScatter``; with them, the native calls are
used. Results are bit-exact: blocks a rank does not own are filled with the identity of
addition that preserves every value, ``-0.0`` for floats (``x + -0.0 == x`` for every x,
including ``-0.0``, infinities and NaN) and ``0`` for integers. They move ``size`` times
more data than the native calls.
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from ..types import ReduceOp


def _fill_identity(t: torch.Tensor) -> None:
    t.fill_(-0.0 if t.is_floating_point() else 0)


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> None:
    """In-place broadcast of root's ``t``."""
    if comm.rank != root:
        _fill_identity(t)
    comm.all_reduce(t, op=ReduceOp.SUM)


def all_gather(comm: Communicator, src: torch.Tensor, flat: torch.Tensor) -> None:
    """``flat`` (size x src) gets rank i's ``src`` at block i."""
    n = src.numel()
    _fill_identity(flat)
    flat.view(-1)[comm.rank * n : (comm.rank + 1) * n].copy_(src.reshape(-1))
    comm.all_reduce(flat, op=ReduceOp.SUM)


def reduce(comm: Communicator, t: torch.Tensor, op: ReduceOp, root: int) -> None:
    """In-place reduce to root; other ranks' ``t`` is left unchanged."""
    tmp = t.clone()
    comm.all_reduce(tmp, op=op)
    if comm.rank == root:
        t.copy_(tmp)


def reduce_scatter(comm: Communicator, flat: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
    """``out`` gets block ``rank`` of the reduction of every rank's ``flat``."""
    tmp = flat.contiguous().clone()
    comm.all_reduce(tmp, op=op)
    n = out.numel()
    out.view(-1).copy_(tmp.view(-1)[comm.rank * n : (comm.rank + 1) * n])
