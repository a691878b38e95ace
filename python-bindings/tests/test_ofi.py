"""The package's library over the libfabric transport: two ranks on loopback with shared
memory off and OXCCL_NET=ofi (provider tcp;ofi_rxm), against a numpy reference. The wheel
is built with the ofi feature (setup.py), so this runs wherever libfabric is installed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import oxccl
from ranks import run_processes


def _libfabric_missing():
    try:
        ctypes.CDLL("libfabric.so.1")
    except OSError as e:
        return f"libfabric.so.1 cannot be loaded ({e}): install libfabric1"
    return None


def test_package_library_links_two_ranks_over_ofi():
    why = _libfabric_missing()
    if why:
        pytest.skip(why)
    count, size = 300_001, 2
    env = {
        "OXCCL_TEST_UID": oxccl.get_unique_id().hex(),
        "OXCCL_NET": "ofi",
        "OXCCL_OFI_PROVIDER": "tcp;ofi_rxm",
        "OXCCL_TRANSPORT": "tcp",
        "OXCCL_DEBUG": "INFO",
        "OXCCL_TIMEOUT_MS": "60000",
    }
    got = run_processes("workers.ofi_all_reduce", size, args=(count,), env=env, timeout=120)
    for rank, (result, log) in enumerate(got):
        if isinstance(result, str) and "built without libfabric" in result:
            pytest.skip(f"the package's library was built without libfabric's headers: {result}")
        if isinstance(result, str) and "tcp;ofi_rxm" in log and "fi_getinfo" in result:
            pytest.skip(f"libfabric offers no tcp;ofi_rxm provider here: {result}")
        assert not isinstance(result, str), f"rank {rank}: {result}\n{log}"
        assert f"rank {rank}: rank {1 - rank} via OFI (tcp;ofi_rxm)" in log, log
    want = sum(np.arange(count, dtype=np.float64) * (r + 1) + r / 8 for r in range(size))
    for rank, (result, _) in enumerate(got):
        np.testing.assert_array_equal(np.asarray(result), want, err_msg=f"rank {rank}")
