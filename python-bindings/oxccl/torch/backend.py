"""The oxccl process group: a Python ``torch.distributed.ProcessGroup`` over
:class:`oxccl.Communicator`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _ffi
from ..comm import Communicator, get_unique_id, group
from ..types import ReduceOp
from . import emulate
from .work import Worker, done_work, make_work

BACKEND_NAME = "oxccl"
_ID_KEY = "oxccl/unique_id"

_TORCH_OPS = [
    (dist.ReduceOp.SUM, ReduceOp.SUM),
    (dist.ReduceOp.PRODUCT, ReduceOp.PROD),
    (dist.ReduceOp.MIN, ReduceOp.MIN),
    (dist.ReduceOp.MAX, ReduceOp.MAX),
    (dist.ReduceOp.AVG, ReduceOp.AVG),
]


def _reduce_op(opts: Any) -> ReduceOp:
    """The NCCL operator of a torch ``*Options`` object (or a bare torch ReduceOp)."""
    top = getattr(opts, "reduceOp", opts)
    if top is None:
        return ReduceOp.SUM
    for t, o in _TORCH_OPS:
        if top == t:
            return o
    raise ValueError(f"reduce op {top} is not supported by the oxccl backend (SUM, PRODUCT, MIN, MAX, AVG are)")


def _one(tensors: Any, what: str) -> torch.Tensor:
    """The single tensor of a per-process tensor list (one tensor per process, as NCCL)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"{what}: the oxccl backend takes one tensor per process, got {len(tensors)}")
    return tensors[0]


class _Out:
    """An output tensor as a contiguous buffer NCCL can write (bool seen as uint8, complex
    as pairs of reals), copied back by :meth:`finish` when a temporary had to be made."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.contig = t if t.is_contiguous() else t.contiguous()
        self.buf = _raw(self.contig)

    def finish(self) -> None:
        if self.contig is not self.tensor:
            self.tensor.copy_(self.contig)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The view NCCL sees: bool as uint8, complex as its real pairs."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def _in(t: torch.Tensor) -> torch.Tensor:
    return _raw(t.contiguous())


def _op_for(t: torch.Tensor, op: ReduceOp) -> ReduceOp:
    """Operator adjusted to the view: on bool, SUM is logical or (MAX), PROD is and (MIN);
    on complex only SUM and AVG are elementwise on the real pairs."""
    if t.dtype == torch.bool:
        if op == ReduceOp.AVG:
            raise ValueError("AVG is not defined for bool tensors")
        return {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}.get(op, op)
    if t.is_complex() and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{op.name} is not defined for complex tensors (SUM and AVG are)")
    return op


@dataclass
class _Op:
    issue: Callable[[], None]
    finish: Callable[[], None]
    result: Any
    device: bool


def _exchange_id(store: dist.Store, rank: int) -> bytes:
    """Rank 0 makes the unique id and puts it in the store; the others read it."""
    if rank == 0:
        uid = get_unique_id()
        store.set(_ID_KEY, uid)
        return uid
    return bytes(store.get(_ID_KEY))


class ProcessGroupOxccl(dist.ProcessGroup):
    """A process group whose collectives run on an :class:`oxccl.Communicator`."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Optional[timedelta] = None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.comm = Communicator(rank, size, _exchange_id(store, rank))
        self._worker = Worker(f"oxccl-pg-rank{rank}")
        self._coalescing: Optional[List[tuple]] = None
        lib = _ffi.lib()
        self._native = {n: lib.has(n) for n in ("ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter")}

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # A Python group has no C++ backend to keep its name and description: keep them here.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"ProcessGroupOxccl(rank={self._rank}, size={self._size})"

    # -- running operations -----------------------------------------------------------------

    def _submit(self, op: _Op):
        if self._coalescing is not None:
            fut = torch.futures.Future()
            self._coalescing.append((op, fut))
            return make_work(fut)
        if op.device:
            # CUDA tensors: the call is ordered on the current stream (NCCL semantics), so it
            # is issued from the caller's thread and the work is complete as far as the host
            # is concerned.
            op.issue()
            op.finish()
            return done_work(op.result)

        def run():
            op.issue()
            op.finish()

        return make_work(self._worker.submit(run, op.result))

    def _op(
        self,
        issue: Callable[[], None],
        result: Any,
        tensors: Sequence[torch.Tensor],
        outs: Sequence[_Out] = (),
        after: Optional[Callable[[], None]] = None,
    ):
        """Submits an operation: ``issue`` makes the calls (deferred to the group's end when
        coalescing); then ``after`` and the outputs' copy-backs run."""

        def finish():
            if after is not None:
                after()
            for o in outs:
                o.finish()

        for t in tensors:
            self._validate(t)
        return self._submit(_Op(issue, finish, result, any(t.device.type != "cpu" for t in tensors)))

    def _validate(self, t: torch.Tensor) -> None:
        """Raises in the caller's thread what the worker would find: an element type NCCL
        lacks, a layout or device oxccl cannot take (so no rank enters a collective that
        another rank's call refuses locally)."""
        if t.layout != torch.strided:
            raise TypeError(f"tensor has layout {t.layout}; the oxccl backend takes dense tensors")
        self.comm._buf(torch.empty(0, dtype=_raw(t).dtype, device=t.device), "tensor", False)

    def _get_backend(self, device=None) -> "ProcessGroupOxccl":
        """This group serves every device itself (torch asks its "backend" for
        ``supports_coalescing`` in batch_isend_irecv; a Python group has no separate one)."""
        return self

    @property
    def supports_coalescing(self) -> bool:
        """True when liboxccl has group calls: batch_isend_irecv then runs as one group."""
        return _ffi.lib().has("ncclGroupStart")

    def start_coalescing(self, device=None) -> None:
        if self._coalescing is not None:
            raise RuntimeError("oxccl: coalescing already started")
        self._coalescing = []

    def end_coalescing(self, device=None):
        ops, self._coalescing = self._coalescing or [], None

        def run():
            try:
                with group():
                    for op, _ in ops:
                        op.issue()
                for op, _ in ops:
                    op.finish()
            except BaseException as e:
                for _, fut in ops:
                    fut.set_exception(e)
                raise
            for op, fut in ops:
                fut.set_result(op.result)

        return make_work(self._worker.submit(run, None))

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # -- collectives --------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        out, op = _Out(t), _op_for(t, _reduce_op(opts))
        return self._op(lambda: self.comm.all_reduce(out.buf, op=op), [t], [t], [out])

    def allreduce_coalesced(self, tensors, opts=None):
        outs = [_Out(t) for t in tensors]
        ops = [_op_for(t, _reduce_op(opts)) for t in tensors]

        def issue():
            for o, op in zip(outs, ops):
                self.comm.all_reduce(o.buf, op=op)

        return self._op(issue, list(tensors), tensors, outs)

    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        root = getattr(opts, "rootRank", 0)
        out = _Out(t)
        if self._native["ncclBroadcast"]:
            return self._op(lambda: self.comm.broadcast(out.buf, root=root), [t], [t], [out])
        return self._op(lambda: emulate.broadcast(self.comm, out.buf, root), [t], [t], [out])

    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        root, out, op = getattr(opts, "rootRank", 0), _Out(t), _op_for(t, _reduce_op(opts))
        if self._native["ncclReduce"]:
            return self._op(lambda: self.comm.reduce(out.buf, op=op, root=root), [t], [t], [out])
        return self._op(lambda: emulate.reduce(self.comm, out.buf, op, root), [t], [t], [out])

    def _gather_into(self, inp: torch.Tensor, flat: torch.Tensor) -> Callable[[], None]:
        src = _in(inp)
        if self._native["ncclAllGather"]:
            return lambda: self.comm.all_gather(src, _raw(flat))
        return lambda: emulate.all_gather(self.comm, src, _raw(flat))

    def _check_blocks(self, blocks: Sequence[torch.Tensor], like: torch.Tensor, what: str, side: str) -> None:
        """One tensor per rank, each with ``like``'s type and element count."""
        if len(blocks) != self._size or any(b.numel() != like.numel() or b.dtype != like.dtype for b in blocks):
            raise ValueError(
                f"{what} needs {self._size} {side} tensors of {like.numel()} {like.dtype} elements, "
                f"got {[(b.numel(), b.dtype) for b in blocks]}"
            )

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")
        self._check_blocks(outs, inp, "allgather", "output")
        flat = torch.empty(self._size * inp.numel(), dtype=inp.dtype, device=inp.device)
        gather = self._gather_into(inp, flat)
        n = inp.numel()

        def scatter_blocks():
            for i, o in enumerate(outs):
                o.copy_(flat[i * n : (i + 1) * n].view(o.shape))

        return self._op(gather, output_tensors, [inp, *outs], after=scatter_blocks)

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != self._size * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output must hold {self._size} x {input.numel()} {input.dtype} elements"
            )
        out = _Out(output)
        return self._op(self._gather_into(input, out.contig.view(-1)), output, [input, output], [out])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else done_work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _scatter_from(self, flat: torch.Tensor, out: _Out, op: ReduceOp) -> Callable[[], None]:
        src = _raw(flat)
        if self._native["ncclReduceScatter"]:
            return lambda: self.comm.reduce_scatter(src, out.buf, op=op)
        return lambda: emulate.reduce_scatter(self.comm, src, out.buf, op)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        t = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        self._check_blocks(ins, t, "reduce_scatter", "input")
        flat = torch.cat([i.reshape(-1) for i in ins])
        out = _Out(t)
        return self._op(self._scatter_from(flat, out, _op_for(t, _reduce_op(opts))), output_tensors, [t, *ins], [out])

    def reduce_scatter_single(self, output, input, opts=None):
        if input.numel() != self._size * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input must hold {self._size} x {output.numel()} {output.dtype} elements"
            )
        out = _Out(output)
        op = _op_for(output, _reduce_op(opts))
        return self._op(self._scatter_from(input.contiguous().view(-1), out, op), output, [input, output], [out])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else done_work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        return self._submit(_Op(self.comm.barrier, lambda: None, None, False))

    def send(self, tensors, dstRank, tag=0):
        t = _one(tensors, "send")
        src = _in(t)
        return self._op(
            lambda: self.comm.send(src, dstRank), list(tensors) if not isinstance(tensors, torch.Tensor) else [t], [t]
        )

    def recv(self, tensors, srcRank, tag=0):
        t = _one(tensors, "recv")
        out = _Out(t)
        return self._op(
            lambda: self.comm.recv(out.buf, srcRank),
            list(tensors) if not isinstance(tensors, torch.Tensor) else [t],
            [t],
            [out],
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finishes queued operations, then destroys the communicator."""
        self._worker.close()
        self.comm.destroy()

    def abort(self) -> None:
        """Aborts the communicator (interrupting a running operation), then stops."""
        self.comm.abort()
        self._worker.close(timeout=5.0)


def create(store: dist.Store, rank: int, size: int, timeout: Optional[timedelta] = None) -> ProcessGroupOxccl:
    """The creator registered with ``torch.distributed.Backend.register_backend``."""
    return ProcessGroupOxccl(store, rank, size, timeout)
