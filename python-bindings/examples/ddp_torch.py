"""DistributedDataParallel training of a small torch model on CPU with the "oxccl" backend.

Run under torchrun:          torchrun --nproc-per-node 2 ddp_torch.py
Or spawn N local ranks here: python ddp_torch.py --ranks 2
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxccl.torch  # noqa: F401  (registers the "oxccl" backend)

STEPS = 30


def train() -> float:
    """Trains an MLP on a fixed regression task, each rank on its shard; returns the loss."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 20, generator=g)
    y = x[:, :5].sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=g)
    xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()  # DDP all-reduces the gradients through oxccl here
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == STEPS - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    # Every rank ends with the same parameters: check it with one more collective.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    assert torch.equal(spread, flat), "ranks disagree on the parameters"
    return loss.item()


def _rank_main(rank: int, size: int, port: int) -> None:
    dist.init_process_group("oxccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        train()
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=0, help="spawn this many local ranks (default: torchrun's job)")
    args = ap.parse_args()
    if not args.ranks:
        dist.init_process_group("oxccl")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
        try:
            train()
        finally:
            dist.destroy_process_group()
        return 0
    os.environ.setdefault("OXCCL_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
