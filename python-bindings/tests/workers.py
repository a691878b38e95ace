"""Functions run in freshly spawned processes by :func:`ranks.run_processes`
(``fn(rank, size, *args)``; the return value goes back to the test)."""

from __future__ import annotations

import os


def from_env_all_reduce(rank: int, size: int, env: dict):
    """Sets this rank's launcher variables, joins with Communicator.from_env(), all-reduces."""
    import numpy as np

    import oxccl

    os.environ.update({k: v.format(rank=rank, size=size) for k, v in env.items()})
    with oxccl.Communicator.from_env() as comm:
        x = np.full(5, rank + 1, dtype=np.int64)
        comm.all_reduce(x)
        return comm.rank, comm.size, x.tolist(), "OXCCL_COMM_ID" in os.environ


def unique_id_hex(rank: int, size: int):
    """ncclGetUniqueId as liboxccl computes it in this environment (OXCCL_COMM_ID form)."""
    import oxccl

    return oxccl.get_unique_id().hex()


def join_expect_error(rank: int, size: int, uid: bytes, secret_bytes: bytes):
    """Joins with a unique id whose secret was replaced; returns the error text."""
    import oxccl

    bad = uid[:24] + secret_bytes + uid[40:] if rank == 1 else uid
    try:
        oxccl.Communicator(rank, size, bad).destroy()
    except oxccl.Error as e:
        return e.result_name
    return "joined"


def join_bounded(rank: int, size: int, ranks: int, timeout_s: float):
    """Joins a group of ``ranks`` with Communicator(timeout=): ranks 0..size-1 come, the
    others never do. Returns (result name or "ok", seconds, all-reduce sum or None)."""
    import time

    import numpy as np

    import oxccl

    uid = bytes.fromhex(os.environ["OXCCL_TEST_UID"])
    t0 = time.monotonic()
    try:
        comm = oxccl.Communicator(rank, ranks, uid, timeout=timeout_s)
    except oxccl.Error as e:
        return e.result_name, time.monotonic() - t0, None
    took = time.monotonic() - t0
    x = np.full(3, rank + 1, dtype=np.int64)
    comm.all_reduce(x)
    comm.destroy()
    return "ok", took, x.tolist()


def ofi_all_reduce(rank: int, size: int, count: int):
    """Joins over OXCCL_TEST_UID and all-reduces float64 data that differs per rank and
    element; returns (result, the library's log lines). The library's stderr (its INFO lines)
    goes to a file read back here, so the test can see which transport linked the ranks."""
    import tempfile

    import numpy as np

    log = tempfile.TemporaryFile()
    os.dup2(log.fileno(), 2)
    import oxccl

    uid = bytes.fromhex(os.environ["OXCCL_TEST_UID"])
    x = np.arange(count, dtype=np.float64) * (rank + 1) + rank / 8
    try:
        with oxccl.Communicator(rank, size, uid) as comm:
            comm.all_reduce(x)
        result = x.tolist()
    except oxccl.Error as e:
        result = f"{e.result_name}: {e}"
    log.seek(0)
    return result, log.read().decode(errors="replace")
