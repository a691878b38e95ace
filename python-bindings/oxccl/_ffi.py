"""ctypes layer: one declaration per function of NVIDIA's ``nccl.h`` (2.x), bound lazily.

:data:`DECLARATIONS` holds each function's exact C signature (types as the header spells
them, with ``const`` dropped). A test parses ``include/oxccl.h`` and fails when a function
declared there has no entry here or a different signature, so this table follows the header
as it grows. Symbols are resolved on first use: a function that the loaded liboxccl does not
export yet raises :class:`NotAvailableError` when called, instead of failing at import.

Every function returning ``ncclResult_t`` is checked: a result other than ``ncclSuccess``
raises :class:`Error` with the result's name and ``ncclGetLastError``'s text.

``pnccl*`` profiling aliases resolve with the same signatures as their ``nccl*`` names.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Dict, List, Optional, Tuple

from . import _lib

NCCL_UNIQUE_ID_BYTES = 128

#: ``ncclResult_t`` names by value.
RESULT_NAMES = [
    "ncclSuccess",
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
    "ncclInProgress",
    "ncclTimeout",
]


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


class Error(RuntimeError):
    """A call into liboxccl failed.

    Attributes: ``function`` (C function name), ``result`` (``ncclResult_t`` value, or None
    when the call did not happen), ``result_name`` (e.g. ``"ncclInvalidArgument"``) and
    ``detail`` (``ncclGetLastError``'s text, or why the call could not be made).
    """

    def __init__(self, function: str, result: Optional[int], detail: str):
        self.function = function
        self.result = result
        if result is None:
            self.result_name = "notAvailable"
        elif 0 <= result < len(RESULT_NAMES):
            self.result_name = RESULT_NAMES[result]
        else:
            self.result_name = f"ncclResult({result})"
        self.detail = detail
        super().__init__(f"{function} failed: {self.result_name}: {detail}")


class NotAvailableError(Error, NotImplementedError):
    """The loaded liboxccl does not export this function (or this feature) yet."""

    def __init__(self, function: str, detail: str):
        super().__init__(function, None, detail)


# C type (as nccl.h spells it, without `const`) -> ctypes type.
_P = ctypes.POINTER
CTYPES: Dict[str, object] = {
    "void": None,
    "int": ctypes.c_int,
    "int*": _P(ctypes.c_int),
    "unsigned int": ctypes.c_uint,
    "size_t": ctypes.c_size_t,
    "int8_t*": _P(ctypes.c_int8),
    "int16_t*": _P(ctypes.c_int16),
    "int32_t*": _P(ctypes.c_int32),
    "int64_t*": _P(ctypes.c_int64),
    "uint8_t*": _P(ctypes.c_uint8),
    "uint16_t*": _P(ctypes.c_uint16),
    "uint32_t*": _P(ctypes.c_uint32),
    "uint64_t*": _P(ctypes.c_uint64),
    "char*": ctypes.c_char_p,
    "char**": _P(ctypes.c_char_p),
    "char***": _P(_P(ctypes.c_char_p)),
    "void*": ctypes.c_void_p,
    "void**": _P(ctypes.c_void_p),
    "ncclResult_t": ctypes.c_int,
    "ncclResult_t*": _P(ctypes.c_int),
    "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int,
    "ncclRedOp_t*": _P(ctypes.c_int),
    "ncclScalarResidence_t": ctypes.c_int,
    "ncclCommMemStat_t": ctypes.c_int,
    "ncclComm_t": ctypes.c_void_p,
    "ncclComm_t*": _P(ctypes.c_void_p),
    "ncclWindow_t": ctypes.c_void_p,
    "ncclEncryptionConfig_t": ctypes.c_void_p,
    "ncclWindow_t*": _P(ctypes.c_void_p),
    "ncclEncryptionConfig_t*": ctypes.c_void_p,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "ncclParamHandle_t": ctypes.c_void_p,
    "ncclParamHandle_t*": _P(ctypes.c_void_p),
    "ncclUniqueId": UniqueId,
    "ncclUniqueId*": _P(UniqueId),
    "ncclConfig_t*": ctypes.c_void_p,
    "ncclCollConfig_t*": ctypes.c_void_p,
    "ncclSimInfo_t*": ctypes.c_void_p,
    "ncclWaitSignalDesc_t*": ctypes.c_void_p,
    "cudaStream_t": ctypes.c_void_p,
}

R = "ncclResult_t"
_COLL_CONFIG = [("config", "ncclCollConfig_t*")]
_N, _DT, _OP, _ROOT = ("count", "size_t"), ("datatype", "ncclDataType_t"), ("op", "ncclRedOp_t"), ("root", "int")


def _coll(*middle: Tuple[str, str], bufs: Tuple[str, ...] = ("sendbuff", "recvbuff")):
    """A collective's declaration: its buffers (``void*``), ``middle``, then comm and stream."""
    return (R, [(b, "void*") for b in bufs] + list(middle) + [("comm", "ncclComm_t"), ("stream", "cudaStream_t")])


#: Every function of nccl.h 2.x: name -> (return type, [(parameter, C type), ...]).
DECLARATIONS: Dict[str, Tuple[str, List[Tuple[str, str]]]] = {
    "ncclMemAlloc": (R, [("ptr", "void**"), ("size", "size_t")]),
    "ncclMemFree": (R, [("ptr", "void*")]),
    "ncclGetVersion": (R, [("version", "int*")]),
    "ncclGetUniqueId": (R, [("uniqueId", "ncclUniqueId*")]),
    "ncclCommInitRankConfig": (
        R,
        [
            ("comm", "ncclComm_t*"),
            ("nranks", "int"),
            ("commId", "ncclUniqueId"),
            ("rank", "int"),
            ("config", "ncclConfig_t*"),
        ],
    ),
    "ncclCommInitRank": (R, [("comm", "ncclComm_t*"), ("nranks", "int"), ("commId", "ncclUniqueId"), ("rank", "int")]),
    "ncclCommInitAll": (R, [("comm", "ncclComm_t*"), ("ndev", "int"), ("devlist", "int*")]),
    "ncclCommFinalize": (R, [("comm", "ncclComm_t")]),
    "ncclCommDestroy": (R, [("comm", "ncclComm_t")]),
    "ncclCommAbort": (R, [("comm", "ncclComm_t")]),
    "ncclCommRevoke": (R, [("comm", "ncclComm_t"), ("revokeFlags", "int")]),
    "ncclCommSplit": (
        R,
        [
            ("comm", "ncclComm_t"),
            ("color", "int"),
            ("key", "int"),
            ("newcomm", "ncclComm_t*"),
            ("config", "ncclConfig_t*"),
        ],
    ),
    "ncclCommShrink": (
        R,
        [
            ("comm", "ncclComm_t"),
            ("excludeRanksList", "int*"),
            ("excludeRanksCount", "int"),
            ("newcomm", "ncclComm_t*"),
            ("config", "ncclConfig_t*"),
            ("shrinkFlags", "int"),
        ],
    ),
    "ncclCommGetUniqueId": (R, [("comm", "ncclComm_t"), ("uniqueId", "ncclUniqueId*")]),
    "ncclCommGrow": (
        R,
        [
            ("comm", "ncclComm_t"),
            ("nRanks", "int"),
            ("uniqueId", "ncclUniqueId*"),
            ("rank", "int"),
            ("newcomm", "ncclComm_t*"),
            ("config", "ncclConfig_t*"),
        ],
    ),
    "ncclCommInitRankScalable": (
        R,
        [
            ("newcomm", "ncclComm_t*"),
            ("nranks", "int"),
            ("myrank", "int"),
            ("nId", "int"),
            ("commIds", "ncclUniqueId*"),
            ("config", "ncclConfig_t*"),
        ],
    ),
    "ncclGetErrorString": ("char*", [("result", "ncclResult_t")]),
    "ncclGetLastError": ("char*", [("comm", "ncclComm_t")]),
    "ncclResetDebugInit": ("void", []),
    "ncclCommGetAsyncError": (R, [("comm", "ncclComm_t"), ("asyncError", "ncclResult_t*")]),
    "ncclCommCount": (R, [("comm", "ncclComm_t"), ("count", "int*")]),
    "ncclCommCuDevice": (R, [("comm", "ncclComm_t"), ("device", "int*")]),
    "ncclCommUserRank": (R, [("comm", "ncclComm_t"), ("rank", "int*")]),
    "ncclCommRegister": (R, [("comm", "ncclComm_t"), ("buff", "void*"), ("size", "size_t"), ("handle", "void**")]),
    "ncclCommDeregister": (R, [("comm", "ncclComm_t"), ("handle", "void*")]),
    "ncclCommSuspend": (R, [("comm", "ncclComm_t"), ("flags", "int")]),
    "ncclCommResume": (R, [("comm", "ncclComm_t")]),
    "ncclCommMemStats": (R, [("comm", "ncclComm_t"), ("stat", "int"), ("value", "uint64_t*")]),
    "ncclSetEncryption": (R, [("config", "ncclEncryptionConfig_t*")]),
    "ncclDevCommCreate": (R, [("comm", "ncclComm_t"), ("reqs", "void*"), ("outDevComm", "void*")]),
    "ncclDevCommDestroy": (R, [("comm", "ncclComm_t"), ("devComm", "void*")]),
    "ncclCommQueryProperties": (R, [("comm", "ncclComm_t"), ("props", "void*")]),
    "ncclGetLsaMultimemDevicePointer": (R, [("window", "ncclWindow_t"), ("offset", "size_t"), ("outPtr", "void**")]),
    "ncclGetLsaDevicePointer": (R, [("window", "ncclWindow_t"), ("offset", "size_t"), ("lsaRank", "int"), ("outPtr", "void**")]),
    "ncclGetPeerDevicePointer": (R, [("window", "ncclWindow_t"), ("offset", "size_t"), ("peer", "int"), ("outPtr", "void**")]),
    "ncclCommWindowRegister": (
        R,
        [("comm", "ncclComm_t"), ("buff", "void*"), ("size", "size_t"), ("win", "ncclWindow_t*"), ("winFlags", "int")],
    ),
    "ncclCommWindowDeregister": (R, [("comm", "ncclComm_t"), ("win", "ncclWindow_t")]),
    "ncclWinGetUserPtr": (R, [("comm", "ncclComm_t"), ("win", "ncclWindow_t"), ("outUserPtr", "void**")]),
    "ncclRedOpCreatePreMulSum": (
        R,
        [
            ("op", "ncclRedOp_t*"),
            ("scalar", "void*"),
            ("datatype", "ncclDataType_t"),
            ("residence", "ncclScalarResidence_t"),
            ("comm", "ncclComm_t"),
        ],
    ),
    "ncclRedOpDestroy": (R, [("op", "ncclRedOp_t"), ("comm", "ncclComm_t")]),
    "ncclReduce": _coll(_N, _DT, _OP, _ROOT),
    "ncclBcast": _coll(_N, _DT, _ROOT, bufs=("buff",)),
    "ncclBroadcast": _coll(_N, _DT, _ROOT),
    "ncclAllReduce": _coll(_N, _DT, _OP),
    "ncclReduceScatter": _coll(("recvcount", "size_t"), _DT, _OP),
    "ncclAllGather": _coll(("sendcount", "size_t"), _DT),
    "ncclAlltoAll": _coll(_N, _DT),
    "ncclGather": _coll(_N, _DT, _ROOT),
    "ncclScatter": _coll(_N, _DT, _ROOT),
    "ncclSend": _coll(_N, _DT, ("peer", "int"), bufs=("sendbuff",)),
    "ncclRecv": _coll(_N, _DT, ("peer", "int"), bufs=("recvbuff",)),
    "ncclPutSignal": (
        R,
        [
            ("localbuff", "void*"),
            ("count", "size_t"),
            ("datatype", "ncclDataType_t"),
            ("peer", "int"),
            ("peerWin", "ncclWindow_t"),
            ("peerWinOffset", "size_t"),
            ("sigIdx", "int"),
            ("ctx", "int"),
            ("flags", "uint32_t"),
            ("comm", "ncclComm_t"),
            ("stream", "cudaStream_t"),
        ],
    ),
    "ncclSignal": (
        R,
        [
            ("peer", "int"),
            ("sigIdx", "int"),
            ("ctx", "int"),
            ("flags", "uint32_t"),
            ("comm", "ncclComm_t"),
            ("stream", "cudaStream_t"),
        ],
    ),
    "ncclWaitSignal": (
        R,
        [
            ("nDesc", "int"),
            ("signalDescs", "ncclWaitSignalDesc_t*"),
            ("comm", "ncclComm_t"),
            ("stream", "cudaStream_t"),
        ],
    ),
    "ncclGroupStart": (R, []),
    "ncclGroupEnd": (R, []),
    "ncclGroupSimulateEnd": (R, [("simInfo", "ncclSimInfo_t*")]),
    "ncclParamBind": (R, [("out", "ncclParamHandle_t*"), ("key", "char*")]),
    **{
        f"ncclParamGet{s}{n}": (R, [("h", "ncclParamHandle_t"), ("out", f"{'u' if s == 'U' else ''}int{n}_t*")])
        for s in "IU"
        for n in (8, 16, 32, 64)
    },
    "ncclParamGetStr": (R, [("h", "ncclParamHandle_t"), ("out", "char**")]),
    "ncclParamGet": (R, [("h", "ncclParamHandle_t"), ("out", "void*"), ("maxLen", "int"), ("len", "int*")]),
    "ncclParamGetParameter": (R, [("key", "char*"), ("value", "char**"), ("valueLen", "int*")]),
    "ncclParamGetAllParameterKeys": (R, [("table", "char***"), ("tableLen", "int*")]),
    "ncclParamDumpAll": ("void", []),
    # oxccl's own extensions (src/ffi/oxccl_ext.rs)
    "oxcclCommSetTimeout": (R, [("comm", "ncclComm_t"), ("timeoutMs", "uint64_t")]),
    "oxcclCommSetDeterministic": (R, [("comm", "ncclComm_t"), ("on", "int")]),
    "oxcclCommGetDeterministic": (R, [("comm", "ncclComm_t"), ("on", "int*")]),
    "oxcclCommSetCompression": (R, [("comm", "ncclComm_t"), ("mode", "int")]),
    "oxcclCommGetCompression": (R, [("comm", "ncclComm_t"), ("mode", "int*")]),
}

# The per-collective-config variants: the plain signature plus a trailing ncclCollConfig_t*.
for _name in ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"):
    _ret, _params = DECLARATIONS[f"nccl{_name}"]
    DECLARATIONS[f"nccl{_name}Config"] = (_ret, _params + _COLL_CONFIG)


def declaration(name: str) -> Optional[Tuple[str, List[Tuple[str, str]]]]:
    """The declaration of ``name``; ``pncclX`` shares ``ncclX``'s. None when unknown."""
    if name.startswith("pnccl"):
        name = name[1:]
    return DECLARATIONS.get(name)


class Library:
    """liboxccl with lazily resolved, type-checked functions: ``lib.ncclAllReduce(...)``.

    ``has(name)`` tells whether the library exports a function. Attribute access to a known
    function that is missing gives a stub raising :class:`NotAvailableError` when called.
    """

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self._cdll = cdll
        self.path = path
        self._cache: Dict[str, Callable] = {}
        self._lock = threading.Lock()

    def has(self, name: str) -> bool:
        """True when the loaded library exports ``name``."""
        try:
            getattr(self._cdll, name)
            return True
        except AttributeError:
            return False

    def last_error(self) -> str:
        """``ncclGetLastError(NULL)``: the process-wide last error text."""
        text = self.ncclGetLastError(None)
        return text.decode(errors="replace") if text else ""

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("_"):
            raise AttributeError(name)
        with self._lock:
            f = self._cache.get(name)
            if f is None:
                f = self._bind(name)
                self._cache[name] = f
                # Later look-ups find the instance attribute without calling __getattr__.
                setattr(self, name, f)
        return f

    def _bind(self, name: str) -> Callable:
        decl = declaration(name)
        if decl is None:
            raise AttributeError(f"{name} is not a function of nccl.h")
        ret, params = decl
        try:
            f = getattr(self._cdll, name)
        except AttributeError:
            return _missing(name, self.path)
        f.argtypes = [CTYPES[t] for _, t in params]
        f.restype = CTYPES[ret]
        if ret == R:
            f.errcheck = self._check
        return f

    def _check(self, result: int, func, args):
        if result != 0:
            raise Error(func.__name__, result, self.last_error() or "(no detail recorded)")
        return result


def _missing(name: str, path: str) -> Callable:
    def stub(*_args, **_kwargs):
        raise NotAvailableError(
            name, f"{name} is not available in this liboxccl ({path}); a newer oxccl build provides it"
        )

    stub.__name__ = name
    return stub


_library: Optional[Library] = None
_library_lock = threading.Lock()


def lib() -> Library:
    """The process-wide :class:`Library`, loaded on first use (see :mod:`oxccl._lib`)."""
    global _library
    with _library_lock:
        if _library is None:
            path = _lib.find_library()
            _library = Library(_lib.load(path), str(path))
        return _library
