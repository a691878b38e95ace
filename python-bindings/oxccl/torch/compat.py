"""Which c10d class the oxccl backend derives from, chosen by what the loaded torch offers.

- torch whose c10d ``Backend`` is constructible from Python (torch's ``PyBackend``
  trampoline, whose header the wheels carry from 2.14): the backend is a ``Backend``, and torch puts it in a
  ``ProcessGroup`` per device type, as it does Gloo. The C++ dispatcher (functional
  collectives, DTensor, DeviceMesh) reaches it.
- older torch (from :data:`MIN_TORCH`): ``Backend`` has no Python constructor, and the
  backend is a ``ProcessGroup`` (through torch's ``PyProcessGroup`` trampoline), which torch
  uses as the group itself. torch's Python API calls its methods directly. C++ callers (DDP's
  reducer, functional collectives) reach only the operations that trampoline forwards:
  ``allreduce``, ``allreduce_coalesced``, ``allgather``,
  ``allgather_into_tensor_coalesced``, ``reduce_scatter``,
  ``reduce_scatter_tensor_coalesced``, ``alltoall_base``, ``broadcast``, ``barrier``, ``send``
  and ``recv``. ``split_group`` is not offered there (``supports_splitting`` is False).

Older torch than :data:`MIN_TORCH` is refused on import with the version named.
"""

from __future__ import annotations

import torch

#: The oldest torch the backend supports: the ProcessGroup-based way is tested on 2.6.0, 2.7.1,
#: 2.8.0, 2.9.1 and 2.10.0; 2.5's trampoline lacks the methods that keep a group's name.
MIN_TORCH = (2, 6)


def torch_version() -> tuple:
    """(major, minor) of the loaded torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """Raises ImportError naming the loaded torch when it is older than :data:`MIN_TORCH`."""
    if torch_version() < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"oxccl.torch needs torch >= {need}; the loaded torch is {torch.__version__} "
            f"(from {torch.__file__})"
        )


def _backend_constructible() -> bool:
    """True when a Python subclass of c10d ``Backend`` can be made (torch's PyBackend
    trampoline); without it, pybind answers ``TypeError: ... No constructor defined!``."""

    class _Probe(Backend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return False
    return True


check_torch()

from torch._C._distributed_c10d import Backend, ProcessGroup  # noqa: E402  (after the check)

#: True: the backend derives from c10d ``Backend``; False: from ``ProcessGroup``.
PER_DEVICE = _backend_constructible()


class GroupMethods:
    """What a ``ProcessGroup`` that is its own backend answers itself: torch's C++ group keeps
    its name and description in its per-device backends, which this one has none of (the
    trampoline asks these methods), and torch's Python code asks it for its backend."""

    _oxccl_group_name = ""
    _oxccl_group_desc = ""

    def getGroupName(self) -> str:
        """The name torch gave the group (``group_name``)."""
        return self._oxccl_group_name

    def setGroupName(self, name: str) -> None:
        """Keeps the name torch gives the group."""
        self._oxccl_group_name = name

    def getGroupDesc(self) -> str:
        """The description torch gave the group (``group_desc``)."""
        return self._oxccl_group_desc

    def setGroupDesc(self, desc: str) -> None:
        """Keeps the description torch gives the group."""
        self._oxccl_group_desc = desc

    def _get_backend(self, device):
        """The group itself, for the device types it serves ("cpu" and "cuda")."""
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"oxccl: no backend for device type {kind}")
        return self


#: The c10d classes the backend derives from.
BASES = (Backend,) if PER_DEVICE else (GroupMethods, ProcessGroup)
