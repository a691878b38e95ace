"""Running test code on several ranks, each a separate process (spawned, never forked).

A :class:`RankPool` starts ``n`` processes that join one communicator, then runs named
functions of :mod:`checks` on every rank at once (``pool.run("name", *args)``) and returns
the per-rank results. Every wait is bounded: a rank that does not answer within the timeout
makes the pool kill all its processes and raise, so nothing can hang the test run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, List, Optional

# Ranks in these tests talk over loopback only; collectives that stall fail in bounded time.
os.environ["OXCCL_SOCKET_IFNAME"] = "lo"
os.environ.setdefault("OXCCL_TIMEOUT_MS", "30000")

DEFAULT_TIMEOUT = 120.0


class RankError(AssertionError):
    """A rank raised; the message holds its traceback."""


def _serve(rank: int, size: int, conn, module: str, setup_args: tuple) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
        ctx = mod.setup(rank, size, *setup_args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            name, args = msg
            try:
                conn.send(("ok", getattr(mod, name)(ctx, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        mod.teardown(ctx)


class RankPool:
    """``size`` ranks in separate processes sharing one communicator."""

    def __init__(
        self, size: int, module: str = "checks", setup_args: Optional[tuple] = None, timeout: float = DEFAULT_TIMEOUT
    ):
        """Starts the ranks; each calls ``module.setup(rank, size, *setup_args)`` (default:
        a fresh unique id) and hands the result to every check, then ``module.teardown``."""
        if setup_args is None:
            import oxccl

            setup_args = (oxccl.get_unique_id(),)
        self.size = size
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, size, child, module, setup_args), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect(timeout, "joining the communicator")

    def _collect(self, timeout: float, what: str) -> List[Any]:
        deadline = time.monotonic() + timeout
        results: List[Any] = []
        errors = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise TimeoutError(f"rank {rank} did not finish {what} within {timeout:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                self.kill()
                raise RankError(f"rank {rank} died during {what} (exit code {self._procs[rank].exitcode})") from None
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if errors:
            raise RankError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, name: str, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
        """Runs ``module.<name>(ctx, *args)`` on every rank; returns each rank's result."""
        if not self.alive():
            raise RankError("the rank pool was killed by an earlier failure")
        for conn in self._conns:
            conn.send((name, args))
        return self._collect(timeout, name)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, timeout: float = 30.0) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_processes(
    target: str, size: int, args=(), timeout: float = DEFAULT_TIMEOUT, env: Optional[dict] = None
) -> List[Any]:
    """Runs ``module.function(rank, size, *args)`` (``target``) in ``size`` fresh spawned
    processes with the extra environment ``env``; returns each one's result, by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_wrap, args=(target, r, size, q, args), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only ranks {sorted(results)} of {size} finished within {timeout:.0f} s")
            try:
                rank, status, value = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode != 0]
                if dead:
                    raise RankError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status == "error":
                raise RankError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(size)]


def _wrap(target: str, rank, size, q, args):
    try:
        import importlib

        module, _, name = target.rpartition(".")
        q.put((rank, "ok", getattr(importlib.import_module(module), name)(rank, size, *args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def require_symbol(*names: str) -> None:
    """Skips (visibly) when the loaded liboxccl lacks a function the test needs."""
    import pytest

    import oxccl

    missing = [n for n in names if not oxccl.lib().has(n)]
    if missing:
        pytest.skip(f"liboxccl at {oxccl.lib().path} does not export {', '.join(missing)} yet")


def require_ml_dtypes(name: str) -> None:
    """Skips (visibly) a narrow float type when ml_dtypes is not installed."""
    import pytest

    from data import ML_TYPES, ml_dtypes

    if name in ML_TYPES and ml_dtypes is None:
        pytest.skip(f"{name} needs ml_dtypes, which is not installed")
