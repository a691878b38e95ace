"""oxccl: collective communication with NCCL's API, from Python.

>>> import numpy as np, oxccl
>>> with oxccl.Communicator.from_env() as comm:      # torchrun / mpirun / srun
...     grad = np.ones(1 << 20, dtype=np.float32)
...     comm.all_reduce(grad, op="avg")               # in place

Layers: :mod:`oxccl._ffi` (ctypes declarations of every nccl.h function, errors raised as
:class:`Error`), :class:`Communicator` (arrays in, arrays out), and :mod:`oxccl.torch`
(a ``torch.distributed`` backend named ``"oxccl"``).
"""

from ._ffi import Error, NotAvailableError, lib
from ._lib import LibraryNotFound, find_library
from .alloc import empty, zeros
from .comm import Communicator, get_unique_id, group, version
from .types import DataType, ReduceOp

__all__ = [
    "Communicator",
    "DataType",
    "Error",
    "LibraryNotFound",
    "NotAvailableError",
    "ReduceOp",
    "empty",
    "find_library",
    "get_unique_id",
    "group",
    "lib",
    "version",
    "zeros",
]
__version__ = "0.1.0"
