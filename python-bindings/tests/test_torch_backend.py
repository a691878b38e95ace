"""The torch.distributed backend "oxccl": collectives through torch's API on 2 and 3 ranks,
and DistributedDataParallel training that ends with the same parameters as with "gloo"."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/python-tests.sh installs it)")

from ranks import require_symbol, run_processes  # noqa: E402

SIZES = [2, 3]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pool(pools, size):
    return pools.get(size, "torch_checks", setup_args=lambda: (_port(),))


@pytest.mark.parametrize("size", SIZES)
def test_backend_is_registered_and_used(pools, size):
    assert _pool(pools, size).run("backend_name") == [("oxccl", "ProcessGroupOxccl")] * size


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_every_op(pools, size):
    results = _pool(pools, size).run("all_reduce", 1)
    assert results == [3 * 5 + 2 * 4 + 4] * size  # 3 float types x 5 ops, 2 int types x 4, 4 extra


@pytest.mark.parametrize("size", SIZES)
def test_unsupported_op_is_a_clear_error(pools, size):
    for msg in _pool(pools, size).run("unsupported_op"):
        assert "not supported by the oxccl backend" in msg, msg


@pytest.mark.parametrize("size", SIZES)
def test_errors_reach_the_caller(pools, size):
    for found in _pool(pools, size).run("errors"):
        assert "NCCL has no type for" in found["dtype"]
        for how in ("sync", "wait", "future"):
            assert "communicator was destroyed" in found.get(how, ""), (how, found)


@pytest.mark.parametrize("size", SIZES)
def test_broadcast(pools, size):
    assert _pool(pools, size).run("broadcast", 2) == [size] * size


@pytest.mark.parametrize("size", SIZES)
def test_reduce(pools, size):
    assert _pool(pools, size).run("reduce", 3) == [size] * size


@pytest.mark.parametrize("size", SIZES)
def test_all_gather(pools, size):
    assert _pool(pools, size).run("all_gather", 4) == [2] * size


@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter(pools, size):
    assert _pool(pools, size).run("reduce_scatter", 5) == [2] * size


@pytest.mark.parametrize("size", SIZES)
def test_barrier(pools, size):
    times = _pool(pools, size).run("barrier", 0.3)
    last = max(a for a, _ in times)
    assert all(left >= last for _, left in times)


@pytest.mark.parametrize("size", SIZES)
def test_send_recv(pools, size):
    require_symbol("ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd")
    assert _pool(pools, size).run("send_recv", 6) == [2] * size


@pytest.mark.parametrize("size", SIZES)
def test_ddp_matches_gloo(size):
    """Same seed, same data, 5 SGD steps: DDP over "oxccl" ends with the parameters DDP over
    "gloo" ends with. Tolerance: 1e-6 relative + 1e-7 absolute, for the order in which 3
    ranks' float32 gradients are summed (2 ranks agree bit for bit)."""
    results = run_processes("torch_workers.ddp_train", size, args=(_port(), 5), timeout=300)
    runs = {b: [{k: torch.from_numpy(v) for k, v in r[b].items()} for r in results] for b in ("gloo", "oxccl")}
    for rank in range(size):
        g, o = runs["gloo"][rank], runs["oxccl"][rank]
        assert g.keys() == o.keys()
        for name in g:
            torch.testing.assert_close(o[name], g[name], rtol=1e-6, atol=1e-7, msg=f"rank {rank} parameter {name}")
            if size == 2:
                assert torch.equal(o[name], g[name]), f"rank {rank} parameter {name} differs from gloo"
    # Every rank holds the same model, and training moved it.
    for name in runs["oxccl"][0]:
        assert all(torch.equal(runs["oxccl"][r][name], runs["oxccl"][0][name]) for r in range(size))
    assert any(
        not torch.equal(runs["oxccl"][0][n], runs["oxccl"][0][n + ".initial"])
        for n in runs["oxccl"][0]
        if not n.endswith(".initial")
    )


def test_base_class_follows_what_torch_offers():
    """The backend is a c10d Backend where torch lets Python construct one (its wheels carry
    the PyBackend trampoline from 2.14), and a ProcessGroup on older torch."""
    from torch._C._distributed_c10d import Backend, ProcessGroup

    from oxccl.torch import ProcessGroupOxccl, compat

    if compat.torch_version() >= (2, 14):
        assert compat.PER_DEVICE
    assert issubclass(ProcessGroupOxccl, Backend if compat.PER_DEVICE else ProcessGroup)


def test_torch_older_than_the_minimum_is_refused_by_name():
    """``import oxccl.torch`` under a torch older than the minimum raises an ImportError that
    names the version (not pybind's "No constructor defined!" at the first group)."""
    import subprocess
    import sys

    code = "import torch; torch.__version__ = '2.5.1+cu124'; import oxccl.torch"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ImportError: oxccl.torch needs torch >= 2.6; the loaded torch is 2.5.1+cu124" in p.stderr, p.stderr
