"""The Pythonic layer: :class:`Communicator`, :func:`get_unique_id`, :func:`group`."""

from __future__ import annotations

import contextlib
import ctypes
import operator
import os
import threading
import time
from typing import Any, Iterator, Optional, Union

from . import env as _env
from ._ffi import NCCL_UNIQUE_ID_BYTES, RESULT_NAMES, Error, NotAvailableError, UniqueId, lib
from .buffers import Buffer, as_buffer
from .types import DataType, ReduceOp, reduce_op

OpLike = Union[ReduceOp, str, int]


def get_unique_id() -> bytes:
    """``ncclGetUniqueId``: 128 bytes to hand to every rank (picklable). Starts the
    rendezvous root in this process, so the process that calls it must stay alive until
    every rank has joined."""
    uid = UniqueId()
    lib().ncclGetUniqueId(ctypes.byref(uid))
    return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)


def version() -> int:
    """``ncclGetVersion``: the NCCL API level implemented (e.g. 22304)."""
    v = ctypes.c_int()
    lib().ncclGetVersion(ctypes.byref(v))
    return v.value


class _GroupState(threading.local):
    depth = 0
    keep: list

    def __init__(self):
        self.keep = []


_group = _GroupState()


@contextlib.contextmanager
def group() -> Iterator[None]:
    """``ncclGroupStart`` / ``ncclGroupEnd`` around the block: the operations issued inside
    run together at the end of the block (so paired sends and receives cannot deadlock).
    Buffers passed inside are kept alive until the group ends. Groups nest, as in NCCL."""
    lib().ncclGroupStart()
    _group.depth += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _group.depth -= 1
        try:
            lib().ncclGroupEnd()
        except Exception:
            if ok:
                raise
        finally:
            if _group.depth == 0:
                _group.keep.clear()


def _id_bytes(unique_id: Union[bytes, bytearray, str]) -> bytes:
    if isinstance(unique_id, str):
        try:
            unique_id = bytes.fromhex(unique_id)
        except ValueError:
            raise ValueError("a unique id given as text must be 256 hex digits") from None
    if not isinstance(unique_id, (bytes, bytearray)):
        raise TypeError(f"unique_id must be the bytes of get_unique_id(), not {type(unique_id).__name__}")
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"unique_id must be {NCCL_UNIQUE_ID_BYTES} bytes (got {len(unique_id)})")
    return bytes(unique_id)


def _check_int(name: str, v: Any) -> int:
    """``v`` as an int (numpy integers too); bools and floats are refused."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(v).__name__}") from None


class Communicator:
    """One rank's membership in a group of ``size`` ranks (``ncclComm_t``).

    ``Communicator(rank, size, unique_id)`` joins the group (blocking until every rank has
    joined); ``Communicator.from_env()`` reads torchrun / mpirun / srun variables. Use it as a
    context manager, or call :meth:`destroy`.

    Collectives take arrays (numpy, torch, cupy, DLPack, ...; see :mod:`oxccl.buffers`),
    run to completion for host memory, and return the output array. Passing ``recv=None``
    where allowed makes the call in-place.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        unique_id: Union[bytes, bytearray, str],
        timeout: Optional[float] = None,
        deterministic: Optional[bool] = None,
        compress: Optional[str] = None,
    ):
        """``timeout`` (seconds) bounds the join: when not every rank joined within it, this
        rank gives up (``ncclTimeout``). None: liboxccl's own bound (``OXCCL_TIMEOUT_MS``).
        ``deterministic``: fixed-order reductions for this communicator (see
        :attr:`deterministic`); None: ``OXCCL_DETERMINISTIC``. ``compress``: the wire encoding
        between hosts (see :attr:`compress`); None: ``OXCCL_COMPRESS``."""
        rank, size = _check_int("rank", rank), _check_int("size", size)
        uid = UniqueId.from_buffer_copy(_id_bytes(unique_id))
        self._lib = lib()
        if timeout is not None:
            self._handle: Optional[int] = _init_within(self._lib, uid, size, rank, float(timeout))
        else:
            handle = ctypes.c_void_p()
            self._lib.ncclCommInitRank(ctypes.byref(handle), size, uid, rank)
            self._handle = handle.value
        self._rank, self._size = rank, size
        dev = ctypes.c_int(-1)
        lib().ncclCommCuDevice(self._handle, ctypes.byref(dev))
        self._cuda_device = dev.value
        if deterministic is not None:
            self.deterministic = deterministic
        if compress is not None:
            self.compress = compress

    @property
    def deterministic(self) -> bool:
        """Whether every all-reduce, reduce and reduce-scatter is bitwise reproducible: each
        element is the left fold of the ranks' inputs in rank order (``float32``/``float64`` in
        their own precision, ``float16``/``bfloat16``/fp8 accumulated in float32 and rounded
        once), whatever the algorithm, chunk size, message size, links or placement
        (``OXCCL_DETERMINISTIC``; ``oxcclCommSetDeterministic``). Setting it applies to later
        calls; every rank must set the same value."""
        on = ctypes.c_int(0)
        self._lib.oxcclCommGetDeterministic(self.handle, ctypes.byref(on))
        return bool(on.value)

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        self._lib.oxcclCommSetDeterministic(self.handle, 1 if on else 0)

    _COMPRESS_MODES = ("off", "bf16", "fp8", "int8")

    @property
    def compress(self) -> str:
        """The wire encoding between hosts of float32 sum and average all-reduces,
        reduce-scatters and reduces: ``"off"`` (exact), ``"bf16"``, ``"fp8"`` or ``"int8"``
        (``OXCCL_COMPRESS``; ``oxcclCommSetCompression``). Links within a host stay exact and
        an all-reduce gives every rank the same bits; docs/COMPRESSION.md gives the error bound. Setting it applies to later
        calls; every rank must set the same value."""
        mode = ctypes.c_int(0)
        self._lib.oxcclCommGetCompression(self.handle, ctypes.byref(mode))
        return self._COMPRESS_MODES[mode.value]

    @compress.setter
    def compress(self, mode: str) -> None:
        if mode not in self._COMPRESS_MODES:
            raise ValueError(f"compress must be one of {', '.join(self._COMPRESS_MODES)}, not {mode!r}")
        self._lib.oxcclCommSetCompression(self.handle, self._COMPRESS_MODES.index(mode))

    @classmethod
    def adopt(cls, handle: int, rank: int, size: int) -> "Communicator":
        """Takes ownership of a live ``ncclComm_t`` made elsewhere (e.g. by ``ncclCommSplit``);
        :meth:`destroy` frees it."""
        self = cls.__new__(cls)
        self._lib = lib()
        self._handle = handle
        self._rank, self._size = rank, size
        dev = ctypes.c_int(-1)
        lib().ncclCommCuDevice(handle, ctypes.byref(dev))
        self._cuda_device = dev.value
        return self

    @classmethod
    def from_env(cls) -> "Communicator":
        """Joins the group described by the launcher's environment (same rules as liboxccl's
        ``Communicator::from_env``; see :mod:`oxccl.env`)."""
        launch = _env.detect()
        if launch is None:
            raise ValueError(
                "no launcher environment found: expected RANK/WORLD_SIZE (torchrun), "
                "OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS "
                "or OXCCL_RANK/OXCCL_NRANKS"
            )
        kind, value = _env.rendezvous()
        if kind == "unique_id":
            return cls(launch.rank, launch.size, value)
        uid = _env.address_id(value, _env.env_secret())
        if launch.rank != 0 or _env.knob(os.environ, "COMM_ID") is not None:
            return cls(launch.rank, launch.size, uid)
        # Rank 0 starts the rendezvous root at the address: liboxccl does that when
        # OXCCL_COMM_ID is set, so set it for the duration of the call.
        os.environ["OXCCL_COMM_ID"] = value
        try:
            return cls(launch.rank, launch.size, uid)
        finally:
            del os.environ["OXCCL_COMM_ID"]

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def handle(self) -> int:
        """The ``ncclComm_t`` as an int (for calling :mod:`oxccl._ffi` directly)."""
        if self._handle is None:
            raise ValueError("communicator was destroyed")
        return self._handle

    @property
    def rank(self) -> int:
        """This rank's index (``ncclCommUserRank``)."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks (``ncclCommCount``)."""
        return self._size

    @property
    def cuda_device(self) -> int:
        """``ncclCommCuDevice``, asked of the library at each use: the GPU of the communicator's
        device calls, else of the CUDA context current on this thread, else -1 (host memory
        only so far: a communicator made before any CUDA context was current answers with the
        GPU once one is)."""
        if self._handle is not None:
            dev = ctypes.c_int(-1)
            lib().ncclCommCuDevice(self._handle, ctypes.byref(dev))
            self._cuda_device = dev.value
        return self._cuda_device

    def query_rank_and_size(self) -> tuple:
        """``(ncclCommUserRank, ncclCommCount)`` asked of the library."""
        r, n = ctypes.c_int(), ctypes.c_int()
        lib().ncclCommUserRank(self.handle, ctypes.byref(r))
        lib().ncclCommCount(self.handle, ctypes.byref(n))
        return r.value, n.value

    def destroy(self) -> None:
        """``ncclCommDestroy`` (idempotent)."""
        h, self._handle = self._handle, None
        if h is not None:
            lib().ncclCommDestroy(h)

    def abort(self) -> None:
        """``ncclCommAbort``: interrupts collectives running on other threads, then frees."""
        h, self._handle = self._handle, None
        if h is not None:
            lib().ncclCommAbort(h)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "destroyed" if self._handle is None else f"handle 0x{self._handle:x}"
        return f"<oxccl.Communicator rank {self._rank} of {self._size}, {state}>"

    group = staticmethod(group)

    # -- buffers -----------------------------------------------------------------------------

    def _buf(self, obj: Any, name: str, writable: bool) -> Buffer:
        b = as_buffer(obj, name, writable)
        if b.device and self._cuda_device < 0 and self.cuda_device < 0:
            raise NotAvailableError(
                "device buffer",
                f"{b.what} is CUDA memory, but this liboxccl communicator has no CUDA device "
                "(ncclCommCuDevice = -1: liboxccl found no CUDA driver, or no CUDA context is current "
                "on this thread yet, e.g. before torch.cuda.set_device): pass host memory, or make "
                "the buffer's device current first",
            )
        if _group.depth > 0:
            _group.keep.append(b.owner)
        return b

    def _pair(self, send: Any, recv: Any, blocks: str = ""):
        """Validates send/recv (recv None: in place). Counts are equal, or ``blocks`` names
        the side (``"send"``/``"recv"``) that holds one block of the other's size per rank."""
        if recv is None or recv is send:
            s = r = self._buf(send, "send (in place: receives the result)", True)
        else:
            s, r = self._buf(send, "send", False), self._buf(recv, "recv", True)
        _same_type(s, r)
        n = self._size
        want = {"send": (r.count * n, s.count), "recv": (s.count * n, r.count)}.get(blocks, (s.count, r.count))
        if want[0] != want[1]:
            raise ValueError(_count_message(s, r, blocks, n))
        if s.device != r.device:
            raise ValueError(f"{s.what} and {r.what} must both be host memory or both device memory")
        return s, r

    @staticmethod
    def _stream(b: Buffer) -> Optional[int]:
        return b.stream or None

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any = None, op: OpLike = ReduceOp.SUM) -> Any:
        """``ncclAllReduce``: every rank gets the reduction of all ranks' ``send``.
        ``recv`` (same type and size) defaults to ``send`` (in place). Returns the result."""
        s, r = self._pair(send, recv)
        self._lib.ncclAllReduce(s.ptr, r.ptr, s.count, s.dtype, reduce_op(op), self.handle, self._stream(r))
        return send if recv is None else recv

    def broadcast(self, send: Any, recv: Any = None, root: int = 0) -> Any:
        """``ncclBroadcast``: ``root``'s ``send`` is copied to every rank's ``recv`` (defaults
        to ``send``, in place). Returns the result."""
        s, r = self._pair(send, recv)
        self._lib.ncclBroadcast(s.ptr, r.ptr, s.count, s.dtype, self._root(root), self.handle, self._stream(r))
        return send if recv is None else recv

    def reduce(self, send: Any, recv: Any = None, op: OpLike = ReduceOp.SUM, root: int = 0) -> Any:
        """``ncclReduce``: the reduction of all ranks' ``send`` lands in ``root``'s ``recv``
        (defaults to ``send``, in place; ignored on other ranks). Returns ``recv``."""
        s, r = self._pair(send, recv)
        self._lib.ncclReduce(
            s.ptr, r.ptr, s.count, s.dtype, reduce_op(op), self._root(root), self.handle, self._stream(r)
        )
        return send if recv is None else recv

    def all_gather(self, send: Any, recv: Any) -> Any:
        """``ncclAllGather``: ``recv`` (``size`` times ``send``'s elements) gets rank i's
        ``send`` at block i on every rank. In place when ``send`` is ``recv``'s own block."""
        s, r = self._pair(send, recv, blocks="recv")
        self._lib.ncclAllGather(s.ptr, r.ptr, s.count, s.dtype, self.handle, self._stream(r))
        return recv

    def reduce_scatter(self, send: Any, recv: Any, op: OpLike = ReduceOp.SUM) -> Any:
        """``ncclReduceScatter``: ``send`` holds ``size`` blocks of ``recv``'s size; rank i's
        ``recv`` gets the reduction over all ranks of block i."""
        s, r = self._pair(send, recv, blocks="send")
        self._lib.ncclReduceScatter(s.ptr, r.ptr, r.count, s.dtype, reduce_op(op), self.handle, self._stream(r))
        return recv

    def all_to_all(self, send: Any, recv: Any) -> Any:
        """``ncclAlltoAll``: block j of ``send`` goes to rank j, landing in its ``recv`` at
        block i (this rank). Both hold ``size`` equal blocks."""
        s, r = self._pair(send, recv)
        if s.count % self._size:
            raise ValueError(f"{s.what}: {s.count} elements do not split into {self._size} equal blocks")
        self._lib.ncclAlltoAll(s.ptr, r.ptr, s.count // self._size, s.dtype, self.handle, self._stream(r))
        return recv

    def gather(self, send: Any, recv: Any = None, root: int = 0) -> Any:
        """``ncclGather``: ``root``'s ``recv`` (``size`` blocks) gets rank i's ``send`` at
        block i. ``recv`` is only needed on ``root``."""
        root = self._root(root)
        if self._rank == root or recv is not None:
            s, r = self._pair(send, recv if recv is not None else send, blocks="recv")
            rptr, stream = r.ptr, self._stream(r)
        else:
            s = self._buf(send, "send", False)
            rptr, stream = None, self._stream(s)
        self._lib.ncclGather(s.ptr, rptr, s.count, s.dtype, root, self.handle, stream)
        return recv

    def scatter(self, send: Any, recv: Any, root: int = 0) -> Any:
        """``ncclScatter``: block i of ``root``'s ``send`` lands in rank i's ``recv``. ``send``
        is only needed on ``root``."""
        root = self._root(root)
        if self._rank == root or send is not None:
            s, r = self._pair(send, recv, blocks="send")
            sptr = s.ptr
        else:
            r = self._buf(recv, "recv", True)
            sptr = None
        self._lib.ncclScatter(sptr, r.ptr, r.count, r.dtype, root, self.handle, self._stream(r))
        return recv

    def send(self, buf: Any, peer: int) -> None:
        """``ncclSend`` of ``buf`` to rank ``peer`` (which calls :meth:`recv` with the same
        type and size). Blocks until matched, unless inside :func:`group`."""
        b = self._buf(buf, "send", False)
        self._lib.ncclSend(b.ptr, b.count, b.dtype, self._peer(peer), self.handle, self._stream(b))

    def recv(self, buf: Any, peer: int) -> Any:
        """``ncclRecv`` into ``buf`` from rank ``peer``. Returns ``buf``."""
        b = self._buf(buf, "recv", True)
        self._lib.ncclRecv(b.ptr, b.count, b.dtype, self._peer(peer), self.handle, self._stream(b))
        return buf

    def barrier(self) -> None:
        """Returns once every rank has called it (an all-reduce of one byte)."""
        byte = ctypes.c_uint8(0)
        p = ctypes.addressof(byte)
        self._lib.ncclAllReduce(p, p, 1, DataType.uint8, ReduceOp.SUM, self.handle, None)

    def _root(self, root: int) -> int:
        root = _check_int("root", root)
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is out of range for {self._size} ranks")
        return root

    def _peer(self, peer: int) -> int:
        peer = _check_int("peer", peer)
        if not 0 <= peer < self._size:
            raise ValueError(f"peer {peer} is out of range for {self._size} ranks")
        return peer


class _ConfigHead(ctypes.Structure):
    """The leading fields of ``ncclConfig_t``: liboxccl reads ``size`` bytes of it and keeps
    ``NCCL_CONFIG_INITIALIZER``'s values for the rest."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("blocking", ctypes.c_int),
    ]


_NCCL_API_MAGIC = 0xCAFEBEEF
_IN_PROGRESS = RESULT_NAMES.index("ncclInProgress")
_TIMEOUT = RESULT_NAMES.index("ncclTimeout")


def _init_within(library, uid: UniqueId, size: int, rank: int, timeout: float) -> int:
    """Joins as a nonblocking communicator (``config.blocking = 0``) and polls
    ``ncclCommGetAsyncError`` until it is built, failed, or ``timeout`` seconds passed; on
    expiry ``ncclCommAbort`` cancels the pending handle and this raises ``ncclTimeout``."""
    cfg = _ConfigHead(ctypes.sizeof(_ConfigHead), _NCCL_API_MAGIC, version(), 0)
    handle = ctypes.c_void_p()
    deadline = time.monotonic() + max(0.0, timeout)
    try:
        library.ncclCommInitRankConfig(ctypes.byref(handle), size, uid, rank, ctypes.byref(cfg))
    except Error as e:
        if e.result != _IN_PROGRESS:
            raise
    h = handle.value
    state = ctypes.c_int(_IN_PROGRESS)
    step = 0.0005
    while True:
        library.ncclCommGetAsyncError(h, ctypes.byref(state))
        if state.value == 0:
            return h
        if state.value != _IN_PROGRESS:
            detail = library.last_error() or "(no detail recorded)"
            library.ncclCommAbort(h)
            raise Error("ncclCommInitRankConfig", state.value, detail)
        left = deadline - time.monotonic()
        if left <= 0:
            library.ncclCommAbort(h)
            raise Error(
                "ncclCommInitRank",
                _TIMEOUT,
                f"rank {rank} of {size}: not every rank joined within {timeout:.1f} s (the timeout given)",
            )
        time.sleep(min(step, left))
        step = min(step * 2, 0.01)


def _same_type(a: Buffer, b: Buffer) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{a.what} and {b.what} have different element types ({a.dtype.name} vs {b.dtype.name})")


def _count_message(s: Buffer, r: Buffer, blocks: str, size: int) -> str:
    if not blocks:
        return f"{s.what} has {s.count} elements but {r.what} has {r.count}: they must be equal"
    if blocks == "recv":
        return f"{r.what} must hold {size} x {s.count} = {s.count * size} elements (one block per rank), not {r.count}"
    return f"{s.what} must hold {size} x {r.count} = {r.count * size} elements (one block per rank), not {s.count}"
