"""Point-to-point calls on oxccl groups go to the backend's Python object.

torch hands a Work made by a Python backend back through C++ (``PyWorkHolder``), which
forwards only ``wait()`` and ``get_future()``: ``is_completed()`` then stays False forever
and ``_source_rank()`` (the sender of a receive from any source) raises. So for groups whose
CPU backend is oxccl, ``isend`` and ``irecv`` (which ``send``, ``recv`` and
``batch_isend_irecv`` call) ask the backend directly and return its own Work, whose methods
all answer. Where the backend is the group itself (older torch, :mod:`.compat`), torch's
``batch_isend_irecv`` would issue its operations one by one, each waiting for its peer on the
group's one worker; for such groups it runs them as one batch, as it does for per-device
backends; and ``monitored_barrier``, which that torch allows on Gloo groups only, calls
the group's own. Calls on other groups go to torch's functions unchanged.
"""

from __future__ import annotations

import functools
from datetime import timedelta

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

    batch0 = c10d.batch_isend_irecv

    @functools.wraps(batch0)
    def batch_isend_irecv(p2p_op_list):
        from .backend import ProcessGroupOxccl

        c10d._check_p2p_op_list(p2p_op_list)
        g = c10d._group_or_default_group(p2p_op_list[0].group)
        if not isinstance(g, ProcessGroupOxccl) or c10d._rank_not_in_group(g):
            return batch0(p2p_op_list)
        def peer(op):
            return {"group_dst" if op.op in (isend, isend0) else "group_src": op.group_peer}

        g._start_coalescing()
        try:
            works = [op.op(op.tensor, group=op.group, tag=op.tag, **peer(op)) for op in p2p_op_list]
        except BaseException:
            g._coalescing = None
            raise
        g._end_coalescing()
        return works

    barrier0 = c10d.monitored_barrier

    @functools.wraps(barrier0)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        from .backend import ProcessGroupOxccl

        g = c10d._group_or_default_group(group)
        if not isinstance(g, ProcessGroupOxccl) or c10d._rank_not_in_group(g):
            return barrier0(group, timeout, wait_all_ranks)
        if timeout is not None and not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        return g.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    for m in (c10d, dist):
        m.isend, m.irecv = isend, irecv
        m.batch_isend_irecv, m.monitored_barrier = batch_isend_irecv, monitored_barrier
    _installed = True
