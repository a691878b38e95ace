"""Per-call cost of ``dist.all_reduce`` on an 8-byte tensor through the "oxccl" backend (a
Python c10d Backend: torch's C++ dispatcher calls back into Python, a worker thread runs
the call) against Gloo (C++), one rank, so only the call path is timed. Blocks of calls
alternate between the two groups; the median block is reported.

    OXCCL_SOCKET_IFNAME=lo python torch_call_overhead.py
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = {"gloo": dist.group.WORLD, "oxccl": dist.new_group(backend="oxccl")}
    t = torch.ones(2)
    per = {b: [] for b in groups}
    for rep in range(21):
        for b, g in groups.items():
            n = 300
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t, group=g)
            if rep:
                per[b].append((time.perf_counter() - t0) / n * 1e6)
    for b, v in per.items():
        print(f"{b:6s} dist.all_reduce(8 B), 1 rank: median {statistics.median(v):7.1f} us per call")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
