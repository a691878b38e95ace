"""Work objects for the oxccl process group: an ordered worker thread completing futures."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class _FutureWork(dist._Work):
    """A c10d Work completed by a ``torch.futures.Future``.

    Not torch's ``_create_work_from_future``: its ``wait()`` returns True even when the future
    failed, which would hide a failed collective. Here ``wait()`` raises the future's error;
    the C++ side (DDP's reducer) reaches ``wait`` and ``get_future`` through torch's Python
    Work trampoline.
    """

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises the operation's error
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


def make_work(fut: torch.futures.Future):
    """A c10d Work that completes with ``fut`` (``wait()`` raises the future's error)."""
    return _FutureWork(fut)


def done_work(result: Any):
    """A Work that is already complete with ``result``."""
    fut = torch.futures.Future()
    fut.set_result(result)
    return make_work(fut)


class Worker:
    """Runs submitted operations one at a time, in submission order, on a daemon thread;
    each completes its future with the given result, or with the exception it raised."""

    def __init__(self, name: str):
        self._q: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], result: Any) -> torch.futures.Future:
        """Queues ``fn``; the returned future completes with ``result`` after it ran."""
        fut = torch.futures.Future()
        self._q.put((fn, result, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, result, fut = item
            try:
                fn()
            except BaseException as e:  # delivered to whoever waits on the work
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def close(self, timeout: float = 30.0) -> None:
        """Stops after the queued operations (waits at most ``timeout`` seconds)."""
        if self._thread.is_alive():
            self._q.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
