"""Work objects for the oxccl backend: an ordered worker thread that runs operations, and
completer threads that complete their futures.

Futures are completed off the worker thread: torch runs a future's ``.then()`` callbacks on
the thread that completes it, and a callback may start (and wait for) another operation of
the same group, which only the worker can run (PowerSGD's hook does). Completions go to a
small pool that grows when every completer is busy in a callback, so a blocked callback
never holds up the worker, nor another operation's completion.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

#: Most completer threads alive at once (each is busy only while callbacks run).
MAX_COMPLETERS = 64


class _Completers:
    """Threads that complete futures (set_result / set_exception run the callbacks)."""

    def __init__(self):
        self._q: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def complete(self, fut: torch.futures.Future, result: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            spawn = self._idle == 0 and self._threads < MAX_COMPLETERS
            if spawn:
                self._threads += 1
            else:
                self._idle -= 1
        self._q.put((fut, result, error))
        if spawn:
            threading.Thread(target=self._loop, name="oxccl-complete", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fut, result, error = self._q.get()
            try:
                fut.set_result(_Failed(error) if error is not None else result)
            except Exception:  # a callback's own failure is recorded in its chained future
                pass
            with self._lock:
                self._idle += 1


_completers = _Completers()


class _Failed:
    """The value that makes :func:`_unwrap` raise ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(src: torch.futures.Future) -> Any:
    """Callback between a Work's source future and the one it hands out: a failure raised
    here marks the handed-out future failed in C++ (``Future.set_exception`` would only be
    seen by Python callers of that very Python object, not through torch's C++ Work)."""
    v = src.value()
    if isinstance(v, _Failed):
        raise v.error
    return v


def _seconds(timeout: Any) -> Optional[float]:
    """A wait timeout as seconds (None: wait for the operation's own bound). As in c10d,
    zero means no timeout (``kNoTimeout``), and a negative one is unset."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return None if s <= 0 else s


#: Guards the lazily made parts of every OpWork (its event and futures) against finish().
_LOCK = threading.Lock()


class OpWork(dist._Work):
    """A c10d Work of one operation of the oxccl backend.

    ``wait(timeout)`` returns once the operation completed, raises its error (a RuntimeError
    naming the operation, carrying liboxccl's message), or raises after ``timeout``.
    ``get_future()`` completes on a completer thread, never on the worker.

    The event a waiter sleeps on and the futures are made only when asked for: a synchronous
    call run on the caller's thread needs neither (they were most of its Python cost).
    """

    def __init__(self, what: str, result: Any, source: int = -1):
        super().__init__()
        self._what = what
        self._result = result
        self._finished = False
        self._event: Optional[threading.Event] = None
        self._error: Optional[BaseException] = None
        self._src: Optional[torch.futures.Future] = None
        self._fut: Optional[torch.futures.Future] = None
        self.source = source
        self._profiled: Any = None

    def profile(self, name: str) -> None:
        """Records the operation as profiler event ``name`` (started now, ended when the
        operation completes: an async event when another thread runs it)."""
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        # torch ends the event in a callback of this future, which carries this thread's
        # profiler state to whichever thread completes it (ended directly on another thread,
        # the event would be dropped: the profiler's state is thread-local).
        self._profiled = torch.futures.Future()
        rf._call_end_callbacks_on_future(self._profiled)

    def finish(self, error: Optional[BaseException], inline: bool = False) -> None:
        """Marks the work complete and completes its future, if one was asked for: on a
        completer thread when called by the worker, on this thread when the caller ran the
        operation itself.

        The profiler event ends first, before a waiter wakes: ended later (by a future's
        callback on a completer thread) it could end after the caller had left the
        profiler's context, a lost event or a crash inside the profiler."""
        ended, self._profiled = self._profiled, None
        if ended is not None:
            ended.set_result(None)
        with _LOCK:
            self._error = error
            self._finished = True
            event, src = self._event, self._src
        if event is not None:
            event.set()
        if src is not None:
            if inline:
                src.set_result(_Failed(error) if error is not None else self._result)
            else:
                _completers.complete(src, self._result, error)

    def wait(self, timeout=None) -> bool:
        if not self._finished:
            with _LOCK:
                event = None
                if not self._finished:
                    if self._event is None:
                        self._event = threading.Event()
                    event = self._event
            s = _seconds(timeout)
            if event is not None and not event.wait(s):
                raise RuntimeError(
                    f"oxccl {self._what}: Timed out waiting {s * 1000:.0f} ms for the operation to complete "
                    "(Work.wait timeout)"
                )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self):
        return self._error

    def result(self) -> List[torch.Tensor]:
        r = self._result
        return list(r) if isinstance(r, (list, tuple)) else ([r] if isinstance(r, torch.Tensor) else [])

    def source_rank(self) -> int:
        return self.source

    def _source_rank(self) -> int:
        return self.source

    def get_future(self) -> torch.futures.Future:
        with _LOCK:
            if self._fut is not None:
                return self._fut
            self._src = torch.futures.Future()
            self._fut = self._src.then(_unwrap)
            finished = self._finished
        if finished:
            # Already complete: completed here, so callbacks added later run on the thread that
            # adds them (as torch does for any completed future), never on the worker.
            self._src.set_result(_Failed(self._error) if self._error is not None else self._result)
        return self._fut


def done_work(what: str, result: Any) -> OpWork:
    """A Work that is already complete with ``result``."""
    w = OpWork(what, result)
    w.finish(None)
    return w


def _run(fn: Callable[[], None], work: OpWork, inline: bool) -> None:
    try:
        fn()
    except BaseException as e:  # delivered to whoever waits on the work
        work.finish(failure(work._what, e), inline)
    else:
        work.finish(None, inline)


def failure(what: str, e: BaseException) -> RuntimeError:
    """The error a Work reports: the operation's name and liboxccl's (or Python's) message."""
    if isinstance(e, RuntimeError) and str(e).startswith("oxccl "):
        return e
    if getattr(e, "result_name", "") == "ncclTimeout":
        err = RuntimeError(f"oxccl {what}: Timed out (no progress within the group's timeout): {e}")
    else:
        err = RuntimeError(f"oxccl {what} failed: {e}")
    err.__cause__ = e
    return err


class Worker:
    """Runs submitted operations one at a time, in submission order, on a daemon thread.

    A synchronous call may run on the caller's thread instead (:meth:`run_inline`) when
    nothing is queued or running: it saves two thread hand-offs, and order is kept because
    every operation runs under one lock."""

    def __init__(self, name: str):
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], work: OpWork) -> OpWork:
        """Queues ``fn``; ``work`` completes after it ran (with its error, if it raised)."""
        with self._lock:
            self._pending += 1
        self._q.put((fn, work))
        return work

    def run_inline(self, fn: Callable[[], None], work: OpWork) -> bool:
        """Runs ``fn`` now on this thread if no operation is queued or running (False:
        nothing was run, submit it)."""
        with self._lock:
            if self._pending:
                return False
            self._pending += 1
        try:
            with self._running:
                _run(fn, work, inline=True)
        finally:
            with self._lock:
                self._pending -= 1
        return True

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, work = item
            try:
                with self._running:
                    _run(fn, work, inline=False)
            finally:
                with self._lock:
                    self._pending -= 1

    def close(self, timeout: float = 30.0) -> None:
        """Stops after the queued operations (waits at most ``timeout`` seconds)."""
        if self._thread.is_alive():
            self._q.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

