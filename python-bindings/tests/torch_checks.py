"""Checks of the torch.distributed "oxccl" backend, run on every rank of a RankPool.

Each rank initialises the default process group with backend "oxccl" over a TCP store on
loopback; references are computed in float64 / int64 from every rank's deterministic input.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401  (registers the backend)

OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}


def init(backend: str, rank: int, size: int, port: int) -> None:
    """The default process group over a TCP store on loopback."""
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timeout)


def setup(rank: int, size: int, port: int):
    init("oxccl", rank, size, port)
    return rank


def teardown(_ctx) -> None:
    dist.destroy_process_group()


def _input(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        # halves in [-2, 2]: sums and products over 3 ranks are exact in float32
        return (torch.randint(-4, 5, (n,), generator=g).double() * 0.5).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _ref(op: str, inputs):
    f = torch.stack([x.double() for x in inputs])
    r = {"sum": f.sum(0), "product": f.prod(0), "min": f.min(0).values, "max": f.max(0).values, "avg": f.mean(0)}[op]
    return r


def backend_name(_ctx):
    return dist.get_backend(), type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__


def all_reduce(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16):
        for name, op in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            inputs = [_input(r, 33, dtype, seed) for r in range(n)]
            t = inputs[rank].clone()
            dist.all_reduce(t, op=op)
            want = _ref(name, inputs).to(dtype)
            assert torch.equal(t, want), f"all_reduce {dtype} {name}: {t} != {want}"
            checked += 1
    # async: the work completes later, wait() returns once it has
    t = torch.ones(1000) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert torch.equal(t, torch.full((1000,), float(n * (n + 1) // 2)))
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((3,), float(n)))
    # bool: SUM is logical or; a non-contiguous tensor is reduced through a temporary
    b = torch.tensor([rank == 0, False, True])
    dist.all_reduce(b)
    assert b.tolist() == [True, False, True]
    m = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    col = m[:, 1]
    dist.all_reduce(col)
    assert torch.equal(m[:, 1], torch.tensor([1.0, 5.0, 9.0]) * (n * (n + 1) // 2))
    return checked + 4


def unsupported_op(_ctx):
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def broadcast(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        t = _input(rank, 17, torch.float32, seed + root)
        dist.broadcast(t, src=root)
        assert torch.equal(t, _input(root, 17, torch.float32, seed + root)), f"broadcast from {root}"
    return n


def reduce(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        inputs = [_input(r, 17, torch.float64, seed + root) for r in range(n)]
        t = inputs[rank].clone()
        dist.reduce(t, dst=root, op=dist.ReduceOp.MAX)
        if rank == root:
            assert torch.equal(t, _ref("max", inputs)), f"reduce to {root}"
    return n


def all_gather(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    inputs = [_input(r, 10, torch.float32, seed) for r in range(n)]
    outs = [torch.zeros(10) for _ in range(n)]
    dist.all_gather(outs, inputs[rank])
    for r in range(n):
        assert torch.equal(outs[r], inputs[r]), f"all_gather block {r}"
    flat = torch.zeros(n * 10)
    dist.all_gather_into_tensor(flat, inputs[rank])
    assert torch.equal(flat, torch.cat(inputs)), "all_gather_into_tensor"
    return 2


def reduce_scatter(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    inputs = [_input(r, 8 * n, torch.float32, seed) for r in range(n)]
    want = _ref("sum", inputs).float()[rank * 8 : (rank + 1) * 8]
    out = torch.zeros(8)
    dist.reduce_scatter(out, list(inputs[rank].chunk(n)))
    assert torch.equal(out, want), "reduce_scatter"
    out2 = torch.zeros(8)
    dist.reduce_scatter_tensor(out2, inputs[rank], op=dist.ReduceOp.SUM)
    assert torch.equal(out2, want), "reduce_scatter_tensor"
    return 2


def barrier(_ctx, delay):
    import time

    time.sleep(dist.get_rank() * delay)
    arrive = time.time()
    dist.barrier()
    return arrive, time.time()


def send_recv(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    mine = _input(rank, 25, torch.float32, seed)
    got = torch.zeros(25)
    if rank == 0:
        dist.send(mine, nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(mine, nxt)
    assert torch.equal(got, _input(prv, 25, torch.float32, seed)), "send/recv ring"
    # batch_isend_irecv: everyone sends and receives at once (one NCCL group)
    got2 = torch.zeros(25)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, got2, prv)])
    for r in reqs:
        r.wait()
    assert torch.equal(got2, _input(prv, 25, torch.float32, seed)), "batch_isend_irecv"
    return 2


def errors(_ctx):
    """Errors reach the caller: at the call for what the caller's thread can see, through
    ``wait()`` and the future for what fails while the worker runs the operation."""
    found = {}
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int16))
    except TypeError as e:
        found["dtype"] = str(e)
    g = dist.new_group(backend="oxccl")
    g._get_backend(torch.device("cpu")).comm.destroy()  # every later operation of this group fails inside the worker
    try:
        dist.all_reduce(torch.ones(2), group=g)
    except RuntimeError as e:
        found["sync"] = str(e)
    work = dist.all_reduce(torch.ones(2), group=g, async_op=True)
    try:
        work.wait()
    except RuntimeError as e:
        found["wait"] = str(e)
    try:
        work.get_future().wait()
    except RuntimeError as e:
        found["future"] = str(e)
    dist.destroy_process_group(g)
    return found
