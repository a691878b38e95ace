"""The oxccl backend over :class:`oxccl.Communicator`: a c10d ``Backend`` written in Python
that torch registers per device type, so a ``ProcessGroup`` finds it with
``_get_backend(device)`` as it finds Gloo (the Python API, the C++ dispatcher and DCP all
reach it); on older torch, a ``ProcessGroup`` itself (see :mod:`.compat`).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from .. import _ffi
from ..comm import Communicator, get_unique_id
from . import compat, emulate, monitored, ops
from .ops import Out, inp, one, op_for, raw, reduce_op
from .p2p import Messages, payload
from .work import OpWork, Worker, done_work, failure

BACKEND_NAME = "oxccl"
_ID_KEY = "oxccl/unique_id"
_SECRET = slice(24, 40)  # the secret's bytes in an oxccl unique id (see src/bootstrap/mod.rs)
#: torch's default process-group timeout (used when the creator is given none).
DEFAULT_TIMEOUT = timedelta(minutes=30)


def exchange_id(store: dist.Store, rank: int) -> bytes:
    """Rank 0 makes the unique id and puts it in the store; the others read it.

    An id built from a fixed address (``OXCCL_COMM_ID`` set) carries ``OXCCL_SECRET`` or,
    unset, the zero secret: rank 0 then puts a random one in it, so the rendezvous secret is
    never the zero default (only ranks that can read the job's store learn it)."""
    if rank == 0:
        uid = bytearray(get_unique_id())
        if not any(uid[_SECRET]):
            uid[_SECRET] = os.urandom(_SECRET.stop - _SECRET.start)
        uid = bytes(uid)
        store.set(_ID_KEY, uid)
        return uid
    return bytes(store.get(_ID_KEY))


def set_comm_timeout(comm: Communicator, timeout: timedelta) -> bool:
    """Bounds every operation of ``comm`` by ``timeout`` (``oxcclCommSetTimeout``); False when
    the loaded liboxccl lacks the call (then ``OXCCL_TIMEOUT_MS`` bounds them)."""
    lib = _ffi.lib()
    if not lib.has("oxcclCommSetTimeout"):
        return False
    lib.oxcclCommSetTimeout(comm.handle, max(1, int(timeout.total_seconds() * 1000)))
    return True


def _profiling() -> bool:
    return torch.autograd._profiler_enabled()


class ProcessGroupOxccl(*compat.BASES):
    """The backend of a process group whose collectives run on liboxccl (per device type, or
    the group itself on older torch: :mod:`.compat`)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: Optional[timedelta] = None,
        comm: Optional[Communicator] = None,
        deterministic: Optional[bool] = None,
        compress: Optional[str] = None,
    ):
        """``deterministic``: bitwise-reproducible reductions for this group
        (:attr:`oxccl.Communicator.deterministic`); None: ``OXCCL_DETERMINISTIC``.
        ``compress``: the wire encoding between hosts of float32 sum/avg all-reduces,
        reduce-scatters and reduces (:attr:`oxccl.Communicator.compress`); None:
        ``OXCCL_COMPRESS``."""
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._store = store
        self._timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
        if comm is None:
            # The join is bounded by the group's timeout too (not only OXCCL_TIMEOUT_MS).
            comm = Communicator(rank, size, exchange_id(store, rank), timeout=self._timeout.total_seconds())
        self.comm = comm
        if deterministic is not None:
            self.comm.deterministic = deterministic
        if compress is not None:
            self.comm.compress = compress
        set_comm_timeout(self.comm, self._timeout)
        self._worker = Worker(f"oxccl-pg-rank{rank}")
        self._msgs = Messages(self.comm, store, self._timeout.total_seconds())
        self._coalescing: Optional[list] = None
        self._barrier_seq = 0
        self._seq = 0
        self._tls = threading.local()
        #: (dtype, device) pairs already validated (the check builds a buffer: done once).
        self._valid: set = set()
        lib = _ffi.lib()
        self._all_reduce_c = lib.ncclAllReduce
        self._native = {
            n: lib.has(n)
            for n in ("ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter", "ncclGather", "ncclScatter")
        }

    def getBackendName(self) -> str:
        """The backend's name, "oxccl"."""
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name, "oxccl" (what ``ProcessGroup.name()`` reports)."""
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ProcessGroupOxccl(rank={self._rank}, size={self._size})"

    @property
    def options(self):  # noqa: D401 - torch reads the group timeout here
        """The backend's options (its timeout)."""
        return compat.Backend.Options(BACKEND_NAME, self._timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the bound on later operations (the communicator's timeout)."""
        self._timeout = timeout
        self._msgs.timeout_s = timeout.total_seconds()
        set_comm_timeout(self.comm, timeout)

    def _set_sequence_number_for_group(self) -> None:
        """Starts the group's operation count (every rank counts the same operations)."""
        self._seq = 0

    def _get_sequence_number_for_group(self) -> int:
        """Operations submitted so far (torch's debug wrapper compares it across ranks)."""
        return self._seq

    # -- running operations -----------------------------------------------------------------

    def _submit(self, what: str, fn: Callable[[], None], result: Any, tensors: Sequence[torch.Tensor] = ()) -> OpWork:
        """Runs ``fn`` on the worker (or, for CUDA tensors, now on the caller's thread, ordered
        on the current stream); returns its Work. Validates tensors in the caller's thread so
        that no rank enters a collective another rank refuses locally."""
        sync, self._tls.sync = getattr(self._tls, "sync", False), False
        for t in tensors:
            self._validate(t, what)
        work = OpWork(what, result)
        self._seq += 1
        if self._coalescing is not None:
            self._coalescing.append(("call", fn, work))
            return work
        if _profiling():
            work.profile(f"{BACKEND_NAME}:{what}")
        if any(t.device.type != "cpu" for t in tensors):
            try:
                fn()
            except BaseException as e:
                raise failure(what, e) from e
            work.finish(None)
            return work
        if sync and self._worker.run_inline(fn, work):
            return work
        return self._worker.submit(fn, work)

    def _mark(self, opts: Any) -> None:
        """Notes that the next operation of this thread is synchronous (``asyncOp`` False:
        torch waits for it at once), so that it may run on this thread."""
        self._tls.sync = getattr(opts, "asyncOp", True) is False

    def _validate(self, t: torch.Tensor, what: str) -> None:
        if t.layout != torch.strided:
            raise TypeError(f"oxccl {what}: tensor has layout {t.layout}; this operation takes dense tensors")
        key = (t.dtype, t.device)
        if key in self._valid:
            return
        try:
            self.comm._buf(torch.empty(0, dtype=raw(t).dtype, device=t.device), "tensor", False)
        except TypeError as e:
            raise TypeError(f"oxccl {what}: {e}") from None
        self._valid.add(key)

    def _op(self, what, issue, result, tensors, outs=(), after=None) -> OpWork:
        def run():
            issue()
            if after is not None:
                after()
            for o in outs:
                o.finish()

        return self._submit(what, run, result, tensors)

    @property
    def supports_coalescing(self) -> bool:
        """True when liboxccl has group calls: batch_isend_irecv then runs as one batch."""
        return _ffi.lib().has("ncclGroupStart")

    def _start_coalescing(self, device=None) -> None:
        if self._coalescing is not None:
            raise RuntimeError("oxccl: coalescing already started")
        self._coalescing = []

    def _end_coalescing(self, device=None) -> OpWork:
        items, self._coalescing = self._coalescing or [], None
        sends = [(p, peer, tag) for kind, p, peer, tag, _ in (i for i in items if i[0] == "send")]
        recvs = [(o.buf, peer, tag) for kind, o, peer, tag, _ in (i for i in items if i[0] == "recv")]
        works = [i[-1] for i in items]

        def run():
            try:
                if sends or recvs:
                    self._msgs.batch(sends, recvs)
                for i in items:
                    if i[0] == "recv":
                        i[1].finish()
                for i in items:
                    if i[0] == "call":
                        i[1]()
            except BaseException as e:
                err = failure("coalesced operations", e)
                for w in works:
                    w.finish(err)
                raise
            for w in works:
                w.finish(None)

        return self._worker.submit(run, OpWork("coalesced operations", None))

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    # -- collectives --------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        self._mark(opts)
        t = one(tensors, "all_reduce")
        if t.layout == torch.sparse_coo:
            return self.allreduce_sparse(tensors, opts)
        out, op = Out(t), op_for(t, reduce_op(opts, "all_reduce"), "all_reduce")
        buf = out.buf
        dtype = ops.host_dtype(buf)
        if dtype is None:
            return self._op("all_reduce", lambda: self.comm.all_reduce(buf, op=op), [t], [t], [out])
        # A dense CPU tensor of a known type (checked above): straight to the C call, in place.
        ptr, count, call, comm = buf.data_ptr(), buf.numel(), self._all_reduce_c, self.comm

        def issue():
            call(ptr, ptr, count, dtype, op, comm.handle, None)

        return self._op("all_reduce", issue, [t], [t], [out])

    def allreduce_coalesced(self, tensors, opts=None):
        outs = [Out(t) for t in tensors]
        red = [op_for(t, reduce_op(opts, "all_reduce_coalesced"), "all_reduce_coalesced") for t in tensors]

        def issue():
            for o, op in zip(outs, red):
                self.comm.all_reduce(o.buf, op=op)

        return self._op("all_reduce_coalesced", issue, list(tensors), tensors, outs)

    def allreduce_sparse(self, tensors, opts=None):
        """Sparse COO all-reduce (SUM): indices and values of every rank are gathered and
        summed; the input tensor is replaced by the coalesced sum, as Gloo does."""
        t = one(tensors, "all_reduce")
        if reduce_op(opts, "all_reduce (sparse)") != ops.ReduceOp.SUM:
            raise ValueError("oxccl all_reduce: sparse tensors support SUM only")
        if t.device.type != "cpu":
            raise ValueError("oxccl all_reduce: sparse tensors must be on the CPU")

        def run():
            s = t.coalesce()
            idx, val = s.indices().contiguous(), s.values().contiguous()
            counts = torch.empty(self._size, dtype=torch.int64)
            self.comm.all_gather(torch.tensor([idx.shape[1]], dtype=torch.int64), counts)
            most = int(counts.max())
            pi = torch.zeros((idx.shape[0], most), dtype=torch.int64)
            pi[:, : idx.shape[1]] = idx
            pv = torch.zeros((most, *val.shape[1:]), dtype=val.dtype)
            pv[: val.shape[0]] = val
            gi = torch.empty((self._size, *pi.shape), dtype=torch.int64)
            gv = torch.empty((self._size, *pv.shape), dtype=val.dtype)
            self.comm.all_gather(pi, gi)
            self.comm.all_gather(raw(pv), raw(gv))
            all_i = torch.cat([gi[r][:, : int(counts[r])] for r in range(self._size)], dim=1)
            all_v = torch.cat([gv[r][: int(counts[r])] for r in range(self._size)], dim=0)
            total = torch.sparse_coo_tensor(all_i, all_v, s.shape).coalesce()
            t.copy_(total)

        self._validate(t._values(), "all_reduce")
        return self._submit("all_reduce", run, [t])

    def broadcast(self, tensors, opts=None):
        self._mark(opts)
        t = one(tensors, "broadcast")
        root = getattr(opts, "rootRank", 0)
        out = Out(t)
        if self._native["ncclBroadcast"]:
            return self._op("broadcast", lambda: self.comm.broadcast(out.buf, root=root), [t], [t], [out])
        return self._op("broadcast", lambda: emulate.broadcast(self.comm, out.buf, root), [t], [t], [out])

    def reduce(self, tensors, opts=None):
        self._mark(opts)
        t = one(tensors, "reduce")
        root, out = getattr(opts, "rootRank", 0), Out(t)
        op = op_for(t, reduce_op(opts, "reduce"), "reduce")
        if self._native["ncclReduce"]:
            return self._op("reduce", lambda: self.comm.reduce(out.buf, op=op, root=root), [t], [t], [out])
        return self._op("reduce", lambda: emulate.reduce(self.comm, out.buf, op, root), [t], [t], [out])

    def _gather_into(self, src_t: torch.Tensor, flat: torch.Tensor) -> Callable[[], None]:
        src = inp(src_t)
        if self._native["ncclAllGather"]:
            return lambda: self.comm.all_gather(src, raw(flat))
        return lambda: emulate.all_gather(self.comm, src, raw(flat))

    def _check_blocks(self, blocks: Sequence[torch.Tensor], like: torch.Tensor, what: str, side: str) -> None:
        """One tensor per rank, each with ``like``'s type and element count."""
        if len(blocks) != self._size or any(b.numel() != like.numel() or b.dtype != like.dtype for b in blocks):
            raise ValueError(
                f"oxccl {what}: needs {self._size} {side} tensors of {like.numel()} {like.dtype} elements, "
                f"got {[(b.numel(), b.dtype) for b in blocks]}"
            )

    def _allgather_list(self, outs: Sequence[torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
        flat = torch.empty(self._size * x.numel(), dtype=x.dtype, device=x.device)
        gather, n = self._gather_into(x, flat), x.numel()

        def run():
            gather()
            for i, o in enumerate(outs):
                o.copy_(flat[i * n : (i + 1) * n].view(o.shape))

        return run

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._mark(opts)
        x = one(input_tensors, "all_gather")
        outs = one(output_tensors, "all_gather")
        self._check_blocks(outs, x, "all_gather", "output")
        return self._submit("all_gather", self._allgather_list(outs, x), output_tensors, [x, *outs])

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``output_lists[r][i]`` receives rank r's ``input_tensors[i]``."""
        if len(output_lists) != self._size or any(len(o) != len(input_tensors) for o in output_lists):
            raise ValueError(
                f"oxccl all_gather_coalesced: needs {self._size} output lists (one per rank) of "
                f"{len(input_tensors)} tensors (one per input)"
            )
        runs = []
        for i, x in enumerate(input_tensors):
            outs = [output_lists[r][i] for r in range(self._size)]
            self._check_blocks(outs, x, "all_gather_coalesced", "output")
            runs.append(self._allgather_list(outs, x))

        def run():
            for r in runs:
                r()

        flat_outs = [o for outs in output_lists for o in outs]
        return self._submit("all_gather_coalesced", run, output_lists, [*input_tensors, *flat_outs])

    def _allgather_base(self, output, input, opts=None):
        self._mark(opts)
        if output.numel() != self._size * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"oxccl all_gather_into_tensor: output must hold {self._size} x {input.numel()} {input.dtype} elements"
            )
        out = Out(output)
        return self._op("_allgather_base", self._gather_into(input, out.contig.view(-1)), output, [input, output], [out])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        runs, outs = [], []
        for o, i in zip(outputs, inputs):
            if o.numel() != self._size * i.numel() or o.dtype != i.dtype:
                raise ValueError(
                    f"oxccl allgather_into_tensor_coalesced: output must hold {self._size} x {i.numel()} elements"
                )
            out = Out(o)
            outs.append(out)
            runs.append(self._gather_into(i, out.contig.view(-1)))

        def issue():
            for r in runs:
                r()

        return self._op("allgather_into_tensor_coalesced", issue, list(outputs), [*inputs, *outputs], outs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _scatter_from(self, flat: torch.Tensor, out: Out, op) -> Callable[[], None]:
        src = raw(flat)
        if self._native["ncclReduceScatter"]:
            return lambda: self.comm.reduce_scatter(src, out.buf, op=op)
        return lambda: emulate.reduce_scatter(self.comm, src, out.buf, op)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._mark(opts)
        t = one(output_tensors, "reduce_scatter")
        ins = one(input_tensors, "reduce_scatter")
        self._check_blocks(ins, t, "reduce_scatter", "input")
        flat = torch.cat([i.reshape(-1) for i in ins])
        out = Out(t)
        op = op_for(t, reduce_op(opts, "reduce_scatter"), "reduce_scatter")
        return self._op("reduce_scatter", self._scatter_from(flat, out, op), output_tensors, [t, *ins], [out])

    def _reduce_scatter_base(self, output, input, opts=None):
        self._mark(opts)
        if input.numel() != self._size * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"oxccl reduce_scatter_tensor: input must hold {self._size} x {output.numel()} {output.dtype} elements"
            )
        out = Out(output)
        op = op_for(output, reduce_op(opts, "reduce_scatter_tensor"), "reduce_scatter_tensor")
        flat = input.contiguous().view(-1)
        return self._op("_reduce_scatter_base", self._scatter_from(flat, out, op), output, [input, output], [out])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        runs, outs = [], []
        for o, i in zip(outputs, inputs):
            if i.numel() != self._size * o.numel() or o.dtype != i.dtype:
                raise ValueError(
                    f"oxccl reduce_scatter_tensor_coalesced: input must hold {self._size} x {o.numel()} elements"
                )
            out = Out(o)
            outs.append(out)
            op = op_for(o, reduce_op(opts, "reduce_scatter_tensor_coalesced"), "reduce_scatter_tensor_coalesced")
            runs.append(self._scatter_from(i.contiguous().view(-1), out, op))

        def issue():
            for r in runs:
                r()

        return self._op("reduce_scatter_tensor_coalesced", issue, list(outputs), [*inputs, *outputs], outs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        self._mark(opts)
        x = one(input_tensors, "gather")
        root = getattr(opts, "rootRank", 0)
        outs = list(one(output_tensors, "gather")) if self._rank == root else []
        if self._rank == root:
            self._check_blocks(outs, x, "gather", "output")
        elif output_tensors and any(len(o) for o in output_tensors):
            raise ValueError(f"oxccl gather: only the root (rank {root}) takes output tensors")
        src = inp(x)
        flat = torch.empty(self._size * x.numel(), dtype=x.dtype) if self._rank == root else None
        n = x.numel()

        def run():
            if self._native["ncclGather"]:
                self.comm.gather(src, raw(flat) if flat is not None else None, root=root)
            else:
                full = torch.empty(self._size * n, dtype=x.dtype)
                emulate.all_gather(self.comm, src, raw(full))
                if flat is not None:
                    flat.copy_(full)
            for i, o in enumerate(outs):
                o.copy_(flat[i * n : (i + 1) * n].view(o.shape))

        return self._submit("gather", run, output_tensors, [x, *outs])

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._mark(opts)
        t = one(output_tensors, "scatter")
        root = getattr(opts, "rootRank", 0)
        ins = list(one(input_tensors, "scatter")) if self._rank == root else []
        if self._rank == root:
            self._check_blocks(ins, t, "scatter", "input")
        elif input_tensors and any(len(i) for i in input_tensors):
            raise ValueError(f"oxccl scatter: only the root (rank {root}) takes input tensors")
        flat = raw(torch.cat([i.reshape(-1) for i in ins])) if ins else None
        out = Out(t)
        if not self._native["ncclScatter"]:
            raise NotImplementedError("oxccl scatter: this liboxccl lacks ncclScatter")
        return self._op("scatter", lambda: self.comm.scatter(flat, out.buf, root=root), output_tensors, [t, *ins], [out])

    def _exchange(self, sends: List[torch.Tensor], recvs: List[torch.Tensor]) -> None:
        """Block i of ``sends`` goes to rank i, block i of ``recvs`` comes from rank i (one
        NCCL group of sends and receives; this rank's own block is copied)."""
        from ..comm import group

        me = self._rank
        with group():
            for peer in range(self._size):
                if peer == me:
                    continue
                if sends[peer].numel():
                    self.comm.send(sends[peer], peer)
                if recvs[peer].numel():
                    self.comm.recv(recvs[peer], peer)
        recvs[me].copy_(sends[me])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._mark(opts)
        n = self._size
        if output.dtype != input.dtype:
            raise ValueError("oxccl all_to_all_single: input and output must have the same dtype")

        def splits(t: torch.Tensor, sizes: List[int], side: str) -> List[int]:
            if not sizes:
                if t.shape[0] % n if t.dim() else True:
                    raise ValueError(f"oxccl all_to_all_single: {side} dim 0 ({t.shape}) does not split into {n}")
                return [t.shape[0] // n] * n
            if len(sizes) != n or sum(sizes) != t.shape[0]:
                raise ValueError(f"oxccl all_to_all_single: {side} split sizes {sizes} do not add up to {t.shape[0]}")
            return list(sizes)

        isz, osz = splits(input, input_split_sizes, "input"), splits(output, output_split_sizes, "output")
        src, out = inp(input), Out(output)

        def run():
            sends = list(torch.split(src.reshape(src.shape[0], -1) if src.dim() else src, isz))
            recvs = list(torch.split(out.buf.reshape(out.buf.shape[0], -1) if out.buf.dim() else out.buf, osz))
            self._exchange([s.contiguous() for s in sends], recvs)

        return self._op("all_to_all", run, output, [input, output], [out])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"oxccl all_to_all: needs {self._size} input and output tensors")
        outs = [Out(o) for o in output_tensors]
        ins = [inp(i) for i in input_tensors]
        return self._op(
            "all_to_all", lambda: self._exchange(ins, [o.buf for o in outs]), output_tensors,
            [*input_tensors, *output_tensors], outs,
        )

    def barrier(self, opts=None):
        self._mark(opts)
        return self._submit("barrier", self.comm.barrier, None)

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False):
        """Gloo's monitored barrier, through the store (see :mod:`.monitored`); synchronous."""
        timeout = getattr(opts, "timeout", opts)
        if not isinstance(timeout, timedelta) or timeout.total_seconds() < 0:
            timeout = self._timeout
        self._barrier_seq += 1
        monitored.monitored_barrier(self._store, self._rank, self._size, self._barrier_seq, timeout, wait_all_ranks)
        return done_work("monitored_barrier", None)

    # -- point to point -----------------------------------------------------------------------

    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"oxccl {what}: invalid peer rank {peer} (this is rank {self._rank} of {self._size})")
        return peer

    def send(self, tensors, dstRank, tag=0):
        t = one(tensors, "send")
        dst = self._peer(dstRank, "send")
        self._validate(t, "send")
        p = payload(t)
        if self._coalescing is not None:
            w = OpWork("send", tensors)
            self._coalescing.append(("send", p, dst, tag, w))
            return w
        return self._submit("send", lambda: self._msgs.send(p, dst, tag), tensors, [t])

    def recv(self, tensors, srcRank, tag=0):
        t = one(tensors, "recv")
        src = self._peer(srcRank, "recv")
        self._validate(t, "recv")
        out = Out(t)
        buf = out.contig.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if self._coalescing is not None:
            w = OpWork("recv", tensors)
            out.buf = buf
            self._coalescing.append(("recv", out, src, tag, w))
            return w
        return self._op("recv", lambda: self._msgs.recv(buf, src, tag), tensors, [t], [out])

    def recv_anysource(self, tensors, tag=0):
        t = one(tensors, "recv")
        self._validate(t, "recvAnySource")
        out = Out(t)
        buf = out.contig.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        work = OpWork("recvAnySource", tensors)

        def run():
            work.source = self._msgs.recv_any(buf, tag)
            out.finish()

        if _profiling():
            work.profile(f"{BACKEND_NAME}:recvAnySource")
        return self._worker.submit(run, work)

    # -- splitting ----------------------------------------------------------------------------

    @property
    def supports_splitting(self) -> bool:
        """True when liboxccl has ncclCommSplit and the backend is per device (see
        :mod:`.compat`): ``split_group`` then splits this communicator."""
        return compat.PER_DEVICE and _ffi.lib().has("ncclCommSplit")

    def split(self, store, ranks, opts=None):
        """``ncclCommSplit`` of this group's communicator into the group of ``ranks`` (this
        group's ranks, in the new group's order); ranks outside it take no part (color
        ``NCCL_SPLIT_NOCOLOR``) and get None. Runs after the operations queued before it."""
        import ctypes

        ranks = [int(r) for r in ranks]
        member = self._rank in ranks
        color, key = (min(ranks), ranks.index(self._rank)) if member else (-1, 0)
        handle = ctypes.c_void_p()
        done = OpWork("split", None)
        self._worker.submit(
            lambda: _ffi.lib().ncclCommSplit(self.comm.handle, color, key, ctypes.byref(handle), None), done
        )
        done.wait()
        if not member or not handle.value:
            return None
        timeout = getattr(opts, "_timeout", None) if opts is not None else None
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            timeout = self._timeout
        child = Communicator.adopt(handle.value, key, len(ranks))
        pg = ProcessGroupOxccl(
            store,
            key,
            len(ranks),
            timeout,
            comm=child,
            deterministic=self.comm.deterministic,
            compress=self.comm.compress,
        )
        _ALIVE.add(pg)
        return pg

    # -- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finishes queued operations, then destroys the communicator."""
        self._worker.close()
        self.comm.destroy()
        _ALIVE.discard(self)

    def abort(self) -> None:
        """Aborts the communicator (interrupting a running operation), then stops."""
        self.comm.abort()
        self._worker.close(timeout=5.0)
        _ALIVE.discard(self)


#: Every live backend: torch may hold one only through C++ (a debug wrapper does), and a
#: Python-derived backend whose Python object died would lose its overrides.
_ALIVE: "set[ProcessGroupOxccl]" = set()


def create(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: Optional[timedelta] = None,
    deterministic: Optional[bool] = None,
    compress: Optional[str] = None,
) -> ProcessGroupOxccl:
    """The creator registered with ``torch.distributed.Backend.register_backend``;
    ``deterministic`` and ``compress`` as :class:`ProcessGroupOxccl` takes them (torch passes
    none: the group follows ``OXCCL_DETERMINISTIC`` and ``OXCCL_COMPRESS``); split groups
    inherit both."""
    pg = ProcessGroupOxccl(store, rank, size, timeout, deterministic=deterministic, compress=compress)
    _ALIVE.add(pg)
    return pg
