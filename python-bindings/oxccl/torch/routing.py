"""Point-to-point calls on oxccl groups go to the backend's Python object.

torch hands a Work made by a Python backend back through C++ (``PyWorkHolder``), which
forwards only ``wait()`` and ``get_future()``: ``is_completed()`` then stays False forever
and ``_source_rank()`` (the sender of a receive from any source) raises. So for groups whose
CPU backend is oxccl, ``isend`` and ``irecv`` (which ``send``, ``recv`` and
``batch_isend_irecv`` call) ask the backend directly and return its own Work, whose methods
all answer. Calls on other groups go to torch's functions unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_installed = False


def _oxccl_backend(group):
    from .backend import ProcessGroupOxccl

    try:
        b = group._get_backend(torch.device("cpu"))
    except Exception:  # no CPU backend in this group
        return None
    return b if isinstance(b, ProcessGroupOxccl) else None


def _route(group, tensor):
    """The oxccl backend to call and the tensor to pass, or (None, None)."""
    if not isinstance(tensor, torch.Tensor) or c10d._rank_not_in_group(group):
        return None, None
    g = c10d._group_or_default_group(group)
    backend = _oxccl_backend(g)
    if backend is None:
        return None, None
    return (backend, g), (torch.view_as_real(tensor) if tensor.is_complex() else tensor)


def install() -> None:
    """Wraps ``torch.distributed.isend`` and ``irecv`` (idempotent)."""
    global _installed
    if _installed:
        return
    isend0, irecv0 = c10d.isend, c10d.irecv

    @functools.wraps(isend0)
    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        (bg, t) = _route(group, tensor)
        if bg is None or tensor.device.type != "cpu":
            return isend0(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        backend, g = bg
        peer = c10d._canonicalize_group_rank(g, dst, group_dst)
        c10d._check_not_self_rank(g, peer, "destination")
        return backend.send([t], peer, tag)

    @functools.wraps(irecv0)
    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        (bg, t) = _route(group, tensor)
        if bg is None or tensor.device.type != "cpu":
            return irecv0(tensor, src=src, group=group, tag=tag, group_src=group_src)
        backend, g = bg
        if src is None and group_src is None:
            return backend.recv_anysource([t], tag)
        peer = c10d._canonicalize_group_rank(g, src, group_src)
        c10d._check_not_self_rank(g, peer, "source")
        return backend.recv([t], peer, tag)

    for m in (c10d, dist):
        m.isend, m.irecv = isend, irecv
    _installed = True
