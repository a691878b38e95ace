"""Process bodies for the torch backend tests (run by ranks.run_processes)."""

from __future__ import annotations

import datetime


def ddp_train(rank: int, size: int, backend: str, port: int, steps: int):
    """Trains a small MLP with DDP for `steps` SGD steps on this rank's shard of a fixed data
    set; returns the final parameters (and the initial ones, as NAME.initial)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import oxccl.torch  # noqa: F401

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        # Rank-dependent initial weights: DDP's first broadcast must make them equal.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank * 0.01)
        ddp = DDP(model)
        # numpy copies: torch tensors would travel through shared memory the exiting
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
    finally:
        dist.destroy_process_group()
