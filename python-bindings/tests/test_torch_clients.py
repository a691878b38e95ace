"""The "oxccl" torch backend under the clients that need it registered per device type
(DeviceMesh, DTensor, DCP, gather_object, functional collectives), with tags, any-source
receives, timeouts, monitored_barrier and comm-hook callbacks, on 2 and 3 ranks."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/python-tests.sh installs it)")

SIZES = [2, 3]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pool(pools, size):
    return pools.get(size, "torch_client_checks", setup_args=lambda: (_port(),))


@pytest.mark.parametrize("size", SIZES)
def test_registered_for_cpu_and_cuda(pools, size):
    assert _pool(pools, size).run("registered_per_device") == [["ProcessGroupOxccl", "ProcessGroupOxccl", "oxccl"]] * size


@pytest.mark.parametrize("size", SIZES)
def test_gather_scatter_objects_complex_uneven_all_to_all(pools, size):
    assert _pool(pools, size).run("gather_scatter", 11) == [4] * size


@pytest.mark.parametrize("size", SIZES)
def test_tags_match_and_recv_from_any_source(pools, size):
    results = _pool(pools, size).run("tags_and_any_source")
    assert results[0] == list(range(1, size)) and all(r == [] for r in results[1:])


def test_any_source_receives_under_the_profiler_count_every_event(pools):
    """The flaky test_send_recv_any_source_autograd_profiler of torch's suite at 3 ranks,
    150 times in one group (the old code crashed in the profiler within ~300)."""
    assert _pool(pools, 3).run("profiled_any_source", 150, timeout=240) == [[]] * 3


def test_init_is_bounded_by_the_group_timeout(tmp_path):
    """Two ranks of three join, the third never does: both raise within the group's timeout
    (3 s), the first to give up with ncclTimeout, although OXCCL_TIMEOUT_MS is 120 s. The
    bound here allows for a loaded machine; the figure recorded in docs/PERFORMANCE.md is
    within timeout + 1 s."""
    from ranks import run_processes

    got = run_processes(
        "torch_client_checks.join_without_the_last_rank", 2, args=(str(tmp_path / "store"), 3.0), timeout=120,
        env={"OXCCL_TIMEOUT_MS": "120000"},
    )
    # The first rank to give up leaves; the root may then end the rendezvous for the other one a
    # moment before its own timeout ("the bootstrap root ended the rendezvous"): also in bound.
    # When the first to give up is rank 0, whose process hosts the root, and that process exits
    # before the root's next check for departed ranks (every 20 ms), the other rank sees the
    # root's connection close instead: also in bound, and the error names the root.
    assert any("ncclTimeout" in msg and "not every rank joined" in msg and took >= 2.9 for msg, took in got), got
    for msg, took in got:
        timed_out = "ncclTimeout" in msg and "not every rank joined" in msg
        root_gone = "at the bootstrap root" in msg and "closed the connection" in msg
        assert timed_out or "ended the rendezvous" in msg or root_gone, msg
        assert took <= 6.0, took


@pytest.mark.parametrize("size", SIZES)
def test_callback_starting_an_all_reduce_completes(pools, size):
    assert _pool(pools, size).run("callbacks_off_the_worker") == [True] * size


@pytest.mark.parametrize("size", SIZES)
def test_powersgd_hook_trains(pools, size):
    assert _pool(pools, size).run("powersgd", 5) == [True] * size


@pytest.mark.parametrize("size", SIZES)
def test_device_mesh_dtensor_functional_collectives(pools, size):
    assert _pool(pools, size).run("mesh_dtensor_functional") == [True] * size


def test_checkpoint_save_load(pools, tmp_path):
    """A plain tensor is replicated in DCP's model: rank 0's copy is saved, every rank loads it."""
    got = _pool(pools, 2).run("checkpoint", str(tmp_path / "ckpt"))
    assert got == [[float(i) for i in range(6)]] * 2


def test_monitored_barrier_names_the_missing_rank(pools):
    msgs = _pool(pools, 3).run("monitored", timeout=120)
    assert "Rank 1 failed to pass monitoredBarrier" in msgs[0], msgs
    assert msgs[1] == ""
    assert "Rank 2 successfully reached monitoredBarrier, but received errors" in msgs[2], msgs


def test_wait_timeout_raises_in_time_and_the_work_still_completes(pools):
    raised, took = _pool(pools, 2).run("wait_timeout", 4.0)[0]
    assert "Timed out" in raised and "all_reduce" in raised, raised
    assert 0.9 <= took <= 2.0, took


def test_group_timeout_bounds_operations(pools):
    msg, took = _pool(pools, 2).run("group_timeout", 2)[0]
    assert "ncclTimeout" in msg or "ncclRemoteError" in msg, msg
    assert 1.5 <= took <= 15.0, took


def test_bitwise_ops_are_named_in_the_error(pools):
    for msgs in _pool(pools, 2).run("reduce_op_names"):
        assert [m.split("reduce op ")[1].split()[0] for m in msgs] == ["BAND", "BOR", "BXOR"], msgs


def test_rendezvous_secret_is_random_with_a_fixed_address(monkeypatch):
    """With OXCCL_COMM_ID set (an id built from an address), the id put in the store carries
    a random secret, not the zero default, and ranks join with it."""
    import torch.distributed as dist

    from oxccl.torch.backend import exchange_id

    from oxccl import Communicator

    monkeypatch.setenv("OXCCL_COMM_ID", f"127.0.0.1:{_port()}")
    monkeypatch.delenv("OXCCL_SECRET", raising=False)
    monkeypatch.delenv("NCCL_SECRET", raising=False)
    ids = [exchange_id(dist.HashStore(), 0) for _ in range(2)]
    assert all(any(i[24:40]) for i in ids) and ids[0][24:40] != ids[1][24:40]
    store = dist.HashStore()
    uid = exchange_id(store, 0)
    assert exchange_id(store, 1) == uid
    with Communicator(0, 1, uid) as c:
        assert c.size == 1


@pytest.mark.parametrize("size", SIZES)
def test_split_group_splits_the_communicator(pools, size):
    from oxccl.torch import compat

    if not compat.PER_DEVICE:
        pytest.skip(f"split_group needs a per-device backend (torch {torch.__version__} has no Python Backend)")
    for rank, (got, want, kind, members) in enumerate(_pool(pools, size).run("split")):
        assert got == want and kind == "ProcessGroupOxccl", (rank, got, want, kind)
        assert members == len(range(rank % 2, size, 2))
