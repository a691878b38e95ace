"""A ``torch.distributed`` backend named ``"oxccl"``.

``import oxccl.torch`` registers it, after which::

    dist.init_process_group("oxccl")            # under torchrun, or with rank/world_size/store

works for CPU tensors: every collective of torch.distributed (all_reduce with SUM, PRODUCT,
MIN, MAX, AVG, sparse SUM; broadcast; reduce; all_gather and its coalesced and
into-tensor forms; reduce_scatter and its tensor forms; gather; scatter; all_to_all with
uneven splits; barrier; monitored_barrier), send/recv with tags and from any source, and
batch_isend_irecv; Work objects honour ``wait(timeout)``, futures and their callbacks.
CUDA tensors go through the same calls (data pointer and the current stream) and work once
liboxccl has its CUDA path; until then they raise :class:`oxccl.NotAvailableError`.

Design: the backend is a Python subclass of torch's c10d ``Backend`` (through torch's
Backend trampoline), registered for the "cpu" and "cuda" device types with
``Backend.register_backend``; torch puts it in a ``ProcessGroup`` per device as it does
Gloo, so ``group._get_backend(device)``, the C++ dispatcher (functional collectives,
DTensor, DeviceMesh) and DCP reach it. On torch whose ``Backend`` has no Python constructor
(2.6 to 2.13) it is a ``ProcessGroup`` subclass instead, and older torch is refused on
import (see :mod:`.compat`). Rank 0 makes the unique id and shares it through the c10d store
given to the creator. Operations on CPU tensors run in order on one worker thread per group
(ctypes releases the GIL, so communication overlaps the caller's compute); their futures
complete on separate threads, so callbacks never block the worker. torch's ``isend`` and
``irecv`` (and, where the backend is the group itself, ``batch_isend_irecv`` and
``monitored_barrier``) are wrapped to reach the backend on oxccl groups (see :mod:`.routing`).
"""

from __future__ import annotations

from . import compat  # noqa: F401  (first: refuses a torch older than compat.MIN_TORCH)

import torch.distributed as _dist  # noqa: E402

from . import routing  # noqa: E402
from .backend import BACKEND_NAME, ProcessGroupOxccl, create  # noqa: E402

__all__ = ["BACKEND_NAME", "ProcessGroupOxccl", "create", "register"]


def register() -> None:
    """Registers the ``"oxccl"`` backend with torch.distributed (done on import; idempotent),
    and routes point-to-point calls on oxccl groups to it (see :mod:`.routing`)."""
    routing.install()
    if BACKEND_NAME.upper() in getattr(_dist.Backend, "_plugins", {}):
        return
    _dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])


register()
