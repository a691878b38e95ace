"""Process bodies for the torch backend tests (run by ranks.run_processes)."""

from __future__ import annotations


def _train(rank: int, size: int, group, steps: int):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    # Rank-dependent initial weights: DDP's first broadcast must make them equal.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)
    ddp = DDP(model, process_group=group)
    # numpy copies: torch tensors would travel through shared memory that the exiting
    # process takes away
    initial = {n + ".initial": p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24 * size, 8, generator=g), torch.randn(24 * size, 2, generator=g)
    xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        opt.step()
    return {**{n: p.detach().numpy().copy() for n, p in model.named_parameters()}, **initial}


def ddp_train(rank: int, size: int, port: int, steps: int):
    """Trains the same small MLP with DDP for `steps` SGD steps on this rank's shard of a
    fixed data set, once over "gloo" and once over "oxccl"; returns both runs' final
    parameters (and the initial ones after DDP's broadcast, as NAME.initial)."""
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401

    from torch_checks import init

    init("gloo", rank, size, port)
    try:
        ox = dist.new_group(backend="oxccl")
        assert dist.get_backend(ox) == "oxccl", dist.get_backend(ox)
        return {"gloo": _train(rank, size, dist.group.WORLD, steps), "oxccl": _train(rank, size, ox, steps)}
    finally:
        dist.destroy_process_group()
