"""Every collective binding on 2 and 3 ranks (separate processes, loopback TCP), for every
NCCL data type and reduction operator, in place and out of place, against independent
references (see data.py). Collectives that the loaded liboxccl does not export yet are
skipped with the missing symbol named."""

from __future__ import annotations

import pytest

from data import ALL_TYPES
from ranks import require_ml_dtypes, require_symbol

SIZES = [2, 3]
COUNT = 61  # not a multiple of the rank counts, so segments are uneven


def _run(pools, size, check, *args):
    results = pools.get(size).run(check, *args)
    assert all(r and r > 0 for r in results), f"{check} verified nothing: {results}"
    return results


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_all_reduce(pools, size, dtype):
    require_ml_dtypes(dtype)
    for count in (1, COUNT, 1000):
        _run(pools, size, "all_reduce", dtype, count, 1)


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_count_zero_is_a_no_op(pools, size):
    assert pools.get(size).run("all_reduce", "float32", 0, 1) == [10] * size


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_large_pipelined(pools, size, dtype):
    require_ml_dtypes(dtype)
    _run(pools, size, "large_all_reduce", dtype, 600_001, 2)  # > 2 MiB: many chunks


# (check in checks.py, the liboxccl functions it needs)
COLLECTIVES = [
    ("broadcast", ("ncclBroadcast",)),
    ("reduce", ("ncclReduce",)),
    ("all_gather", ("ncclAllGather",)),
    ("reduce_scatter", ("ncclReduceScatter",)),
    ("all_to_all", ("ncclAlltoAll",)),
    ("gather", ("ncclGather",)),
    ("scatter", ("ncclScatter",)),
    ("send_recv", ("ncclSend", "ncclRecv")),
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ALL_TYPES)
@pytest.mark.parametrize("check, symbols", COLLECTIVES, ids=[c for c, _ in COLLECTIVES])
def test_collective(pools, check, symbols, size, dtype):
    """Every root and operator the collective takes (see checks.py), out of place and in place."""
    require_ml_dtypes(dtype)
    require_symbol(*symbols)
    _run(pools, size, check, dtype, COUNT, 3 + [c for c, _ in COLLECTIVES].index(check))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", [COUNT, 1_000_000])
def test_grouped_send_recv_to_every_peer(pools, size, count):
    require_symbol("ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd")
    assert pools.get(size).run("group_send_recv", "float32", count, 11) == [size - 1] * size


@pytest.mark.parametrize("size", SIZES)
def test_grouped_collectives(pools, size):
    require_symbol("ncclGroupStart", "ncclGroupEnd")
    assert pools.get(size).run("group_collectives", 12) == [3] * size


@pytest.mark.parametrize("size", SIZES)
def test_barrier_waits_for_the_last_rank(pools, size):
    delay = 0.3
    times = pools.get(size).run("barrier", delay)
    last_arrival = max(a for a, _ in times)
    assert max(a for a, _ in times) - min(a for a, _ in times) >= delay * (size - 1) * 0.9
    for rank, (_, left) in enumerate(times):
        assert left >= last_arrival, f"rank {rank} left the barrier before the last rank arrived"


@pytest.mark.parametrize("size", SIZES)
def test_buffer_kinds(pools, size):
    kinds = pools.get(size).run("buffer_kinds", 13)
    assert kinds == [["dlpack", "buffer-protocol", "array-interface", "2-d"]] * size


@pytest.mark.parametrize("size", SIZES)
def test_torch_cpu_tensors(pools, size):
    pytest.importorskip("torch", reason="torch is not installed (scripts/python-tests.sh installs it)")
    assert all(len(r) == 8 for r in pools.get(size).run("torch_tensors", 14))


@pytest.mark.parametrize("size", [2, 3])
def test_deterministic_all_reduce_is_the_rank_order_fold(pools, size):
    require_symbol("oxcclCommSetDeterministic")
    _run(pools, size, "deterministic_all_reduce", 100_003)
