"""``monitored_barrier`` through the group's c10d store, with Gloo's error messages.

Every rank other than 0 reports its arrival; rank 0 waits for each (at most ``timeout``
in all), names the ranks that did not arrive, and publishes the outcome, which the other
ranks wait for (at most ``timeout``)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import List

import torch.distributed as dist

_PREFIX = "oxccl/monitored_barrier"


def _wait(store: dist.Store, key: str, seconds: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=max(seconds, 0.0)))
        return True
    except Exception:  # the store reports an expired wait as an error
        return False


def monitored_barrier(store: dist.Store, rank: int, size: int, seq: int, timeout: timedelta, wait_all: bool) -> None:
    """Raises RuntimeError naming the ranks that did not arrive within ``timeout``."""
    base = f"{_PREFIX}/{seq}"
    t = timeout.total_seconds()
    if rank != 0:
        store.set(f"{base}/arrived/{rank}", b"1")
        if not _wait(store, f"{base}/outcome", t):
            raise RuntimeError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank 0 (no outcome within {t * 1000:.0f} ms)"
            )
        outcome = store.get(f"{base}/outcome").decode()
        if outcome != "ok":
            raise RuntimeError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank 0: {outcome}"
            )
        return
    if t <= 0:
        msg = f"Rank 0 timed out in monitoredBarrier after {t * 1000:.0f} ms."
        store.set(f"{base}/outcome", msg.encode())
        raise RuntimeError(msg)
    deadline = time.monotonic() + t
    missing: List[int] = []
    for r in range(1, size):
        if not _wait(store, f"{base}/arrived/{r}", deadline - time.monotonic()):
            missing.append(r)
            if not wait_all:
                break
    if not missing:
        store.set(f"{base}/outcome", b"ok")
        return
    if len(missing) == 1:
        msg = f"Rank {missing[0]} failed to pass monitoredBarrier in {t * 1000:.0f} ms"
    else:
        msg = f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {t * 1000:.0f} ms"
    store.set(f"{base}/outcome", msg.encode())
    raise RuntimeError(msg)
