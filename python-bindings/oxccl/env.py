"""The launcher's environment, read by the same rules as liboxccl's ``src/bootstrap/env.rs``.

Rank and size: ``OXCCL_RANK``/``OXCCL_NRANKS``, then torchrun (``RANK``/``WORLD_SIZE``),
Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``), PMI (``PMI_RANK``/``PMI_SIZE``), Slurm
(``SLURM_PROCID``/``SLURM_NTASKS``).

Rendezvous: ``OXCCL_UNIQUE_ID`` (256 hex digits), then ``OXCCL_COMM_ID``/``NCCL_COMM_ID``
(``host:port``; rank 0 listens there), then ``MASTER_ADDR`` with ``OXCCL_MASTER_PORT`` or
``MASTER_PORT + 1``. An address-based id is built here exactly as liboxccl builds it
(``"OXID"``, version 1, family, big-endian port, 16 address bytes, 16 secret bytes, zeros),
with the secret derived from ``OXCCL_SECRET`` (all zeros when unset).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

ID_BYTES = 128
_LAUNCHERS = [
    ("oxccl", "OXCCL_RANK", "OXCCL_NRANKS", "OXCCL_LOCAL_RANK"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
]


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process."""

    rank: int
    size: int
    local_rank: int
    launcher: str


def _var(env: Mapping[str, str], name: str) -> Optional[str]:
    v = env.get(name)
    return v if v is not None and v.strip() else None


def knob(env: Mapping[str, str], name: str) -> Optional[str]:
    """``OXCCL_<name>``, falling back to ``NCCL_<name>`` (empty counts as unset)."""
    return _var(env, f"OXCCL_{name}") or _var(env, f"NCCL_{name}")


def _num(env: Mapping[str, str], name: str) -> Optional[int]:
    v = _var(env, name)
    if v is None:
        return None
    if not v.strip().isdigit():
        raise ValueError(f"environment variable {name}={v} is not a non-negative integer")
    return int(v.strip())


def detect(env: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The launcher found in the environment, or None."""
    env = os.environ if env is None else env
    for launcher, r, s, l in _LAUNCHERS:
        rank, size = _num(env, r), _num(env, s)
        if rank is not None and size is not None:
            if size == 0 or rank >= size:
                raise ValueError(f"{launcher} environment: {r}={rank} is not below {s}={size}")
            return Launch(rank, size, _num(env, l) or 0, launcher)
    return None


def rendezvous(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """``("unique_id", hex)`` or ``("address", "host:port")`` from the environment."""
    env = os.environ if env is None else env
    uid = _var(env, "OXCCL_UNIQUE_ID")
    if uid is not None:
        return "unique_id", uid
    addr = knob(env, "COMM_ID")
    if addr is not None:
        return "address", addr
    host = _var(env, "MASTER_ADDR")
    if host is not None:
        port = _num(env, "OXCCL_MASTER_PORT")
        if port is None:
            base = _num(env, "MASTER_PORT")
            if base is None:
                raise ValueError("MASTER_ADDR is set but MASTER_PORT is not")
            port = base + 1
        if port > 65535:
            raise ValueError(f"rendezvous port {port} is out of range")
        return "address", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise ValueError(
        "no rendezvous point in the environment: set OXCCL_COMM_ID=host:port (or NCCL_COMM_ID), "
        "or MASTER_ADDR and MASTER_PORT as torchrun does"
    )


def env_secret(env: Optional[Mapping[str, str]] = None) -> bytes:
    """The 16-byte secret of address-based ids, as liboxccl derives it: 32 hex digits in
    ``OXCCL_SECRET`` are the key itself; any other text is stretched with PBKDF2-HMAC-SHA256
    (200,000 rounds, salt ``oxccl-env-secret-v3``); zeros when OXCCL_SECRET is unset."""
    env = os.environ if env is None else env
    v = knob(env, "SECRET")
    if v is None:
        return bytes(16)
    t = v.strip()
    if len(t) == 32 and all(c in "0123456789abcdefABCDEF" for c in t):
        return bytes.fromhex(t)
    return hashlib.pbkdf2_hmac("sha256", v.encode(), b"oxccl-env-secret-v3", 200_000, 16)


def _resolve(hostport: str) -> Tuple[int, bytes, int]:
    """(family 4/6, 16 address bytes, port) of the first address `host:port` resolves to."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"rendezvous address {hostport!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"rendezvous address {hostport!r} does not resolve: {e}") from None
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            return 4, socket.inet_pton(socket.AF_INET, sockaddr[0]).ljust(16, b"\0"), int(port)
        if family == socket.AF_INET6:
            return 6, socket.inet_pton(socket.AF_INET6, sockaddr[0]), int(port)
    raise ValueError(f"rendezvous address {hostport!r} resolves to nothing")


def address_id(hostport: str, secret: bytes) -> bytes:
    """The unique id liboxccl builds for a fixed ``host:port`` (``OXCCL_COMM_ID`` form)."""
    if len(secret) != 16:
        raise ValueError("the secret is 16 bytes")
    family, addr, port = _resolve(hostport)
    head = b"OXID" + struct.pack(">BBH", 1, family, port)
    return (head + addr + secret).ljust(ID_BYTES, b"\0")
