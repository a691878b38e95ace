"""Shared fixtures: pools of ranks (2 and 3 processes) that live for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ["OXCCL_SOCKET_IFNAME"] = "lo"
os.environ.setdefault("OXCCL_TIMEOUT_MS", "30000")

import ranks  # noqa: E402  (after the environment is set)


class Pools:
    """One live :class:`ranks.RankPool` per (module, size), recreated after a failure."""

    def __init__(self):
        self._pools = {}

    def get(self, size: int, module: str = "checks", setup_args=None) -> ranks.RankPool:
        key = (module, size)
        pool = self._pools.get(key)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.kill()
            pool = ranks.RankPool(size, module, setup_args() if callable(setup_args) else setup_args)
            self._pools[key] = pool
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
