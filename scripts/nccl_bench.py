#!/usr/bin/env python3
"""NCCL's own all-reduce on N processes sharing GPU 0 (torch.distributed "nccl" backend), for
comparison with `oxccl-perf --mem cuda` in scripts/gpu-check.sh.

Prints nccl-tests-like rows: size, time (us), algbw, busbw (GB/s; busbw = algbw * 2(n-1)/n),
float32 sum, out of place, time = max over ranks of the mean of N iterations (CUDA events).
Usage: python3 scripts/nccl_bench.py NRANKS MIN_BYTES MAX_BYTES
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, n, lo, hi, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_MULTI_RANK_GPU_ENABLE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=torch.device("cuda", 0))
    size = lo
    if rank == 0:
        print(f"# NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} all_reduce float sum, {n} ranks on GPU 0")
        print(f"# {'size':>12} {'time(us)':>10} {'algbw':>8} {'busbw':>8}")
    while size <= hi:
        count = max(size // 4, 1)
        x = torch.ones(count, dtype=torch.float32, device="cuda:0")
        y = torch.empty_like(x)
        iters = 20 if size >= (64 << 20) else 100
        for _ in range(5):
            y.copy_(x)
            dist.all_reduce(y)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(y)
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) / 1e3 / iters], device="cuda:0")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        secs = t.item()
        algbw = count * 4 / secs / 1e9
        if rank == 0:
            print(f"  {count * 4:>12} {secs * 1e6:>10.2f} {algbw:>8.2f} {algbw * 2 * (n - 1) / n:>8.2f}", flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    n, lo, hi = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(rank_main, args=(n, lo, hi, 29500 + n), nprocs=n, join=True)
