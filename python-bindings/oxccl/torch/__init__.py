"""A ``torch.distributed`` backend named ``"oxccl"``.

``import oxccl.torch`` registers it, after which::

    dist.init_process_group("oxccl")            # under torchrun, or with rank/world_size/store

works for CPU tensors: all_reduce (SUM, PRODUCT, MIN, MAX, AVG), broadcast, all_gather,
all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, reduce, barrier, send/recv
(batch_isend_irecv is coalesced into one NCCL group), with Work objects and futures, so
``DistributedDataParallel`` works. CUDA tensors go through the same calls (data pointer and
the current stream) and work once liboxccl has its CUDA path; until then they raise
:class:`oxccl.NotAvailableError`.

Design: the backend is a Python subclass of ``torch.distributed.ProcessGroup`` (as in
torch's own ``test_c10d_pypg.py``), returned by the creator registered with
``Backend.register_backend``. Rank 0 makes the unique id and shares it through the c10d
store given to the creator. Operations on CPU tensors run in order on one worker thread per
process group (ctypes releases the GIL, so communication overlaps the caller's compute); the
returned Work wraps a ``torch.futures.Future`` completed by that thread.
"""

from __future__ import annotations

import torch.distributed as _dist

from .backend import BACKEND_NAME, ProcessGroupOxccl, create

__all__ = ["BACKEND_NAME", "ProcessGroupOxccl", "create", "register"]


def register() -> None:
    """Registers the ``"oxccl"`` backend with torch.distributed (done on import; idempotent)."""
    if BACKEND_NAME.upper() in getattr(_dist.Backend, "_plugins", {}):
        return
    _dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])


register()
