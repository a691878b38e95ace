"""DDP step time with the "oxccl" backend against Gloo, same run, interleaved.

Two (or --ranks) local processes train the same ~25M-parameter MLP with
DistributedDataParallel, once over a Gloo group and once over an oxccl group, alternating
backend every repetition (so both see the same machine load). Prints the median step time of
each and their ratio (oxccl / Gloo: below 1 is faster).

    OXCCL_SOCKET_IFNAME=lo python ddp_step.py [--ranks 2] [--reps 12] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def model() -> torch.nn.Module:
    """1024 -> 4096 -> 4096 -> 1024: 25.2M parameters (96 MiB of float32 gradients)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    )


def rank_main(rank: int, size: int, port: int, reps: int, steps: int, q) -> None:
    torch.set_num_threads(1)
    import oxccl.torch  # noqa: F401

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    groups = {"gloo": dist.group.WORLD, "oxccl": dist.new_group(backend="oxccl")}
    ddps = {b: DDP(model(), process_group=g) for b, g in groups.items()}
    opts = {b: torch.optim.SGD(m.parameters(), lr=1e-3) for b, m in ddps.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)
    times = {b: [] for b in ddps}
    order = list(ddps)
    for rep in range(reps + 1):  # the first repetition warms up
        for b in order if rep % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                opts[b].zero_grad()
                torch.nn.functional.mse_loss(ddps[b](x), y).backward()
                opts[b].step()
            if rep:
                times[b].append((time.perf_counter() - t0) / steps)
    same = all(torch.equal(p, q_) for p, q_ in zip(ddps["gloo"].parameters(), ddps["oxccl"].parameters()))
    if rank == 0:
        q.put((times, same))
    dist.barrier()
    dist.destroy_process_group()


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    os.environ.setdefault("OXCCL_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, a.ranks, port, a.reps, a.steps, q)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    times, same = q.get(timeout=3600)
    for p in procs:
        p.join(120)
    med = {b: statistics.median(t) for b, t in times.items()}
    for b, t in times.items():
        print(f"{b:6s} step median {med[b] * 1000:8.1f} ms  (min {min(t) * 1000:.1f}, max {max(t) * 1000:.1f}, {len(t)} reps)")
    print(f"oxccl / gloo step time: {med['oxccl'] / med['gloo']:.2f}   parameters identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
