"""Checks of the "oxccl" torch backend as real clients use it, run on every rank of a
RankPool: per-device registration (DeviceMesh, DTensor, DCP, object collectives, functional
collectives), tags, any-source receives, timeouts, and futures whose callbacks start more
communication (PowerSGD). References: the inputs every rank can compute, and Gloo."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401  (registers the backend)
from torch_checks import init


def setup(rank: int, size: int, port: int):
    init("oxccl", rank, size, port)
    return rank


def teardown(_ctx) -> None:
    dist.destroy_process_group()


def registered_per_device(_ctx):
    """torch finds the backend through the group for both device types."""
    pg = dist.group.WORLD
    return [type(pg._get_backend(torch.device(d))).__name__ for d in ("cpu", "cuda")] + [dist.get_backend()]


def gather_scatter(_ctx, seed):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(5, 3, generator=g) for _ in range(n)]
    for root in range(n):
        outs = [torch.empty(5, 3) for _ in range(n)] if rank == root else None
        dist.gather(data[rank], outs, dst=root)
        if rank == root:
            assert all(torch.equal(o, d) for o, d in zip(outs, data)), "gather"
        got = torch.empty(5, 3)
        dist.scatter(got, [d + root for d in data] if rank == root else None, src=root)
        assert torch.equal(got, data[rank] + root), "scatter"
    objs = [None] * n if rank == 0 else None
    dist.gather_object({"rank": rank, "s": "x" * rank}, objs, dst=0)
    if rank == 0:
        assert objs == [{"rank": r, "s": "x" * r} for r in range(n)], objs
    # complex tensors and uneven all_to_all splits
    z = torch.complex(data[rank], -data[rank])
    zs = [torch.empty_like(z) for _ in range(n)]
    dist.all_gather(zs, z)
    assert all(torch.equal(zs[r], torch.complex(data[r], -data[r])) for r in range(n)), "complex all_gather"
    # rank r sends r+1+j rows to rank j
    send = torch.cat([torch.full((rank + 1 + j, 2), float(100 * rank + j)) for j in range(n)])
    recv = torch.empty(sum(r + 1 + rank for r in range(n)), 2)
    dist.all_to_all_single(recv, send, [rank + 1 + j for j in range(n)], [r + 1 + rank for r in range(n)])
    want = torch.cat([torch.full((r + 1 + rank, 2), float(100 * r + rank)) for r in range(n)])
    assert torch.equal(recv, want), "all_to_all_single with uneven splits"
    return 4


def tags_and_any_source(_ctx):
    """Two messages with different tags received in the other order arrive where their tag
    says (Gloo's matching), and recv from any source names each sender once."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        dist.send(torch.full((4,), 1.0), 1, tag=1)
        dist.send(torch.full((6,), 2.0), 1, tag=2)
    elif rank == 1:
        b, a = torch.zeros(6), torch.zeros(4)
        w2 = dist.irecv(b, 0, tag=2)
        w1 = dist.irecv(a, 0, tag=1)
        w2.wait()
        w1.wait()
        assert torch.equal(a, torch.full((4,), 1.0)) and torch.equal(b, torch.full((6,), 2.0)), (a, b)
    dist.barrier()
    senders = []
    if rank == 0:
        for _ in range(n - 1):
            t = torch.zeros(3)
            src = dist.recv(t, src=None, tag=7)
            assert torch.equal(t, torch.full((3,), float(src))), (src, t)
            senders.append(src)
    else:
        dist.send(torch.full((3,), float(rank)), 0, tag=7)
    dist.barrier()
    return sorted(senders)


def profiled_any_source(_ctx, reps):
    """torch's test_send_recv_any_source_autograd_profiler, ``reps`` times: each rank sends
    twice to every other, which receives from any source under the autograd profiler. Every
    profile holds 2 (n - 1) async "oxccl:send" and "oxccl:recvAnySource" events (the events
    ended after wait() returned used to end after the profiler's exit: lost, or a crash in
    the profiler within a few hundred profiles), every message names its sender, and the
    senders gathered from all ranks are each rank 2 (n - 1) times. Returns the problems."""
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    for rep in range(reps):
        senders = []
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            for dst in range(n):
                if dst != rank:
                    dist.send(torch.full((5,), float(rank)), dst)
                    dist.send(torch.full((5,), float(rank)), dst)
                    continue
                for _ in range(n - 1):
                    got = torch.full((5,), -1.0)
                    senders.append(dist.recv(got))
                    if not torch.equal(got, torch.full((5,), float(senders[-1]))):
                        problems.append((rep, "recv", senders[-1], got.tolist()))
                    got = torch.full((5,), -1.0)
                    w = dist.irecv(got)
                    w.wait()
                    senders.append(w._source_rank())
                    if not torch.equal(got, torch.full((5,), float(senders[-1]))):
                        problems.append((rep, "irecv", senders[-1], got.tolist()))
        for name in ("oxccl:send", "oxccl:recvAnySource"):
            events = [e for e in prof.function_events if e.name == name]
            count = sum(e.count for e in events)
            if count != 2 * (n - 1) or not all(e.is_async for e in events):
                problems.append((rep, name, count, [e.is_async for e in events]))
        everyone = [torch.empty(2 * (n - 1), dtype=torch.int64) for _ in range(n)]
        dist.all_gather(everyone, torch.tensor(senders, dtype=torch.int64))
        flat = sorted(int(x) for t in everyone for x in t)
        if flat != sorted(list(range(n)) * 2 * (n - 1)):
            problems.append((rep, "senders", flat))
    return problems


def join_without_the_last_rank(rank: int, size: int, path: str, timeout_s: float):
    """Rank ``rank`` of a group of ``size + 1`` ranks whose last rank never joins: it raises
    after about the group's timeout (OXCCL_TIMEOUT_MS is set far longer). Returns the
    error's text and the seconds init_process_group took."""
    store = dist.FileStore(path, size + 1)
    t0 = time.monotonic()
    try:
        dist.init_process_group("oxccl", store=store, rank=rank, world_size=size + 1, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return str(e), time.monotonic() - t0
    dist.destroy_process_group()
    return "", time.monotonic() - t0


def callbacks_off_the_worker(_ctx):
    """A future callback that runs another all_reduce of the same group and waits for it
    (PowerSGD does) completes; Gloo completes it too."""
    n = dist.get_world_size()
    t2 = torch.ones(4)

    def cb(fut):
        dist.all_reduce(t2)  # blocks until the worker ran it
        return fut.value()[0] + t2

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(cb)
    out = fut.wait()
    assert torch.equal(out, torch.full((4,), float(2 * n))), out
    return True


def powersgd(_ctx, steps):
    """DDP with the PowerSGD hook trains (it hung when callbacks ran on the worker);
    every rank ends with the same parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    all_flat = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(all_flat, flat)
    assert all(torch.equal(f, flat) for f in all_flat), "ranks disagree after PowerSGD training"
    return True


def mesh_dtensor_functional(_ctx):
    """DeviceMesh, DTensor and functional collectives reach the backend through torch's C++
    dispatcher."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(d.to_local(), full.chunk(n)[dist.get_rank()]), "DTensor shard"
    assert torch.equal(d.full_tensor(), full), "DTensor full_tensor (all_gather)"
    assert torch.equal((d * 2).sum().full_tensor(), full.sum() * 2), "DTensor sum (all_reduce)"
    r = fc.all_reduce(torch.ones(3) * (dist.get_rank() + 1), "sum", dist.group.WORLD)
    assert torch.equal(r.wait() if hasattr(r, "wait") else r, torch.full((3,), float(n * (n + 1) // 2)))
    return True


def checkpoint(_ctx, path):
    """torch.distributed.checkpoint saves and loads a sharded state dict."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    state = {"w": torch.arange(6.0) + rank, "step": torch.tensor([3])}
    dcp.save(state, checkpoint_id=path)
    back = {"w": torch.zeros(6), "step": torch.tensor([0])}
    dcp.load(back, checkpoint_id=path)
    assert torch.equal(back["step"], torch.tensor([3])), back
    return back["w"].tolist()


def monitored(_ctx):
    rank = dist.get_rank()
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    msg = ""
    if rank == 0:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=1))
        except RuntimeError as e:
            msg = str(e)
    elif rank == 1:
        pass  # never arrives
    else:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=10))
        except RuntimeError as e:
            msg = str(e)
    dist.barrier()
    return msg


def wait_timeout(_ctx, late_s):
    """Work.wait(timeout) raises once the timeout passed; the operation still completes when
    the late rank arrives."""
    rank = dist.get_rank()
    t = torch.ones(5)
    if rank == 1:
        time.sleep(late_s)
        dist.all_reduce(t)
        return None
    work = dist.all_reduce(t, async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=1))
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    took = time.monotonic() - start
    work.wait()
    assert torch.equal(t, torch.full((5,), float(dist.get_world_size())))
    return raised, took


def group_timeout(_ctx, timeout_s):
    """A group's timeout bounds its operations: an all_reduce that only rank 0 joins fails
    with liboxccl's timeout error after about that long."""
    g = dist.new_group(backend="oxccl", timeout=timedelta(seconds=timeout_s))
    dist.barrier(group=g)
    out = None
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), group=g)
            out = ("no error", time.monotonic() - start)
        except RuntimeError as e:
            out = (str(e), time.monotonic() - start)
    dist.barrier()
    dist.destroy_process_group(g)
    return out


def reduce_op_names(_ctx):
    out = []
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=op)
        except ValueError as e:
            out.append(str(e))
    return out


def split(_ctx):
    """split_group splits the communicator (ncclCommSplit): groups of even and odd ranks
    all-reduce their own ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    g = dist.split_group(split_ranks=[evens, odds])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g)
    b = g._get_backend(torch.device("cpu"))
    out = (t.item(), float(sum(mine)), type(b).__name__, b.comm.size)
    dist.destroy_process_group(g)
    return out
