"""Turning user arrays into (pointer, element count, data type) for the C calls.

Accepted, in this order of detection (no library is imported here unless the object is one
of its types):

- numpy arrays (including ml_dtypes bfloat16 / float8_e4m3fn / float8_e5m2 dtypes);
- torch tensors (CPU, or CUDA with the current stream);
- objects with ``__cuda_array_interface__`` (cupy, numba, ...): device memory;
- objects with ``__dlpack__`` (any device; the capsule is read with ctypes);
- other host objects with ``__array_interface__`` or the buffer protocol (viewed with numpy,
  never copied).

Buffers must be contiguous (C order); output buffers must be writable. Violations raise
``TypeError`` (unsupported object or element type) or ``ValueError`` (layout, read-only).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Optional, Sequence

from .types import SUPPORTED, DataType, from_dlpack, from_name, from_typestr


class Buffer:
    """A validated view of a user buffer."""

    __slots__ = ("ptr", "count", "dtype", "device", "stream", "owner", "obj", "name")

    def __init__(
        self, ptr: int, count: int, dtype: DataType, device: bool, stream: int, owner: Any, obj: Any, name: str
    ):
        #: Address of the first element.
        self.ptr = ptr
        #: Number of elements.
        self.count = count
        #: Element type.
        self.dtype = dtype
        #: True for CUDA device memory.
        self.device = device
        #: CUDA stream to order the call on (0: default / none).
        self.stream = stream
        #: What keeps the memory alive during the call.
        self.owner = owner
        #: The user's object, and the argument's name (for error messages).
        self.obj, self.name = obj, name

    @property
    def what(self) -> str:
        """Human-readable description (built only for error messages)."""
        return describe(self.obj, self.name)


def describe(obj: Any, name: str) -> str:
    """``name (kind, dtype, shape)`` of a buffer object, for error messages."""
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and isinstance(obj, np.ndarray):
        return f"{name} (numpy array, dtype {obj.dtype}, shape {obj.shape})"
    if torch is not None and isinstance(obj, torch.Tensor):
        return f"{name} (torch tensor, dtype {obj.dtype}, shape {tuple(obj.shape)}, device {obj.device})"
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        shape = tuple(cai.get("shape", ()))
        return f"{name} ({type(obj).__name__} on a CUDA device, typestr {cai.get('typestr')}, shape {shape})"
    return f"{name} ({type(obj).__name__})"


def _unsupported_dtype(name: str, what: str) -> TypeError:
    return TypeError(f"{what} has element type {name}, which NCCL has no type for; supported: {SUPPORTED}")


def _c_contiguous(shape: Sequence[int], strides: Optional[Sequence[int]], unit: int) -> bool:
    """True when strides (in units of `unit`; None: compact) describe C order."""
    if strides is None:
        return True
    expected = unit
    for dim, stride in zip(reversed(list(shape)), reversed(list(strides))):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


_NP_TYPES: dict = {}


def _numpy_type(dt: Any) -> Optional[DataType]:
    """The data type of a numpy dtype (cached: this is on every call's path)."""
    try:
        return _NP_TYPES[dt]
    except KeyError:
        t = from_name(dt.name) if dt.isnative else None
        _NP_TYPES[dt] = t
        return t


def _numpy(arr: Any, name: str, writable: bool, obj: Any = None) -> Buffer:
    obj = arr if obj is None else obj
    dtype = _numpy_type(arr.dtype)
    if dtype is None:
        raise _unsupported_dtype(str(arr.dtype) + ("" if arr.dtype.isnative else " (non-native byte order)"), name)
    flags = arr.flags
    if not flags.c_contiguous:
        raise ValueError(
            f"{describe(obj, name)} is not C-contiguous; pass numpy.ascontiguousarray(...) (and copy results back)"
        )
    if writable and not flags.writeable:
        raise ValueError(f"{describe(obj, name)} is read-only but receives the result")
    return Buffer(arr.__array_interface__["data"][0], arr.size, dtype, False, 0, arr, obj, name)


def _torch(t: Any, name: str, writable: bool) -> Buffer:
    dtype = from_name(str(t.dtype))
    if dtype is None:
        raise _unsupported_dtype(str(t.dtype), name)
    if t.layout != sys.modules["torch"].strided:
        raise TypeError(f"{describe(t, name)} has layout {t.layout}; only dense (strided) tensors are supported")
    if not t.is_contiguous():
        raise ValueError(f"{describe(t, name)} is not contiguous; pass tensor.contiguous() (and copy results back)")
    device = t.device.type
    if device == "cpu":
        return Buffer(t.data_ptr(), t.numel(), dtype, False, 0, t, t, name)
    if device == "cuda":
        torch = sys.modules["torch"]
        stream = torch.cuda.current_stream(t.device).cuda_stream
        return Buffer(t.data_ptr(), t.numel(), dtype, True, stream, t, t, name)
    raise TypeError(f"{describe(t, name)} is on device type {device!r}; oxccl takes CPU and CUDA tensors")


def _cuda_array_interface(obj: Any, name: str, writable: bool) -> Buffer:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dtype = from_typestr(cai["typestr"])
    if dtype is None:
        raise _unsupported_dtype(cai["typestr"], name)
    if not _c_contiguous(shape, cai.get("strides"), dtype.itemsize):
        raise ValueError(f"{describe(obj, name)} is not C-contiguous")
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise ValueError(f"{describe(obj, name)} is read-only but receives the result")
    count = 1
    for d in shape:
        count *= d
    # Version 3's "stream" (None: no ordering needed; 1 and 2 are cudaStreamLegacy and
    # cudaStreamPerThread, valid stream handles as they are) is passed to the call.
    return Buffer(ptr or 0, count, dtype, True, cai.get("stream") or 0, obj, obj, name)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLManagedTensor starts with its DLTensor; kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3,
# kDLCUDAManaged = 13.
_DL_HOST = (1, 3)
_DL_CUDA = (2, 13)
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack(obj: Any, name: str, writable: bool) -> Buffer:
    # The capsule keeps the producer's memory alive; dropping it (unconsumed) calls the
    # producer's deleter, so it is stored as the buffer's owner.
    capsule = obj.__dlpack__()
    addr = _get_pointer(capsule, b"dltensor")
    # SAFETY-equivalent: the capsule named "dltensor" holds a DLManagedTensor whose first
    # member is a DLTensor; it stays valid while `capsule` is alive.
    t = _DLTensor.from_address(addr)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = None if not t.strides else [t.strides[i] for i in range(t.ndim)]
    dev = t.device.device_type
    what = f"{describe(obj, name)} via DLPack (device type {dev}, shape {tuple(shape)})"
    dtype = from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    if dtype is None:
        raise _unsupported_dtype(f"DLPack (code {t.dtype.code}, bits {t.dtype.bits}, lanes {t.dtype.lanes})", name)
    if not _c_contiguous(shape, strides, 1):
        raise ValueError(f"{what} is not C-contiguous")
    if dev not in _DL_HOST + _DL_CUDA:
        raise TypeError(f"{what}: oxccl takes host and CUDA memory only")
    count = 1
    for d in shape:
        count *= d
    return Buffer((t.data or 0) + t.byte_offset, count, dtype, dev in _DL_CUDA, 0, capsule, obj, name)


def as_buffer(obj: Any, name: str, writable: bool) -> Buffer:
    """Validates `obj` as a collective buffer named `name` (``send``/``recv``)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return _numpy(obj, name, writable)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch(obj, name, writable)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cuda_array_interface(obj, name, writable)
    if hasattr(obj, "__dlpack__"):
        return _dlpack(obj, name, writable)
    if isinstance(obj, (list, tuple, int, float, complex, str)) or obj is None:
        raise TypeError(
            f"{name} is a {type(obj).__name__}; pass an array (numpy, torch, cupy, or anything with "
            "__cuda_array_interface__, __dlpack__, __array_interface__ or the buffer protocol)"
        )
    import numpy

    try:
        view = numpy.asarray(memoryview(obj) if not hasattr(obj, "__array_interface__") else obj)
    except TypeError:
        raise TypeError(f"{name} is a {type(obj).__name__}, which is not an array oxccl can read") from None
    return _numpy(view, name, writable, obj)
