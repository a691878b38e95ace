"""64 MiB all-reduce on 2 ranks, alternating call by call inside the same two processes:

- ``Communicator.all_reduce`` on page-aligned buffers (``oxccl.empty``);
- the bare ctypes ``ncclAllReduce`` on the same buffers (what the Python layer adds);
- ``Communicator.all_reduce`` on buffers 16 bytes past a page boundary (numpy's default
  placement for large arrays).

Alternating call by call cancels the machine's load drifts, which interleaving whole runs
(allreduce_vs_perf.py) only averages out. Prints the median milliseconds of each variant.

    OXCCL_SOCKET_IFNAME=lo python python-bindings/benchmarks/placement.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

MIB64 = 64 << 20


def _rank(rank: int, size: int, uid: bytes, calls: int, q) -> None:
    import numpy as np

    import oxccl

    n = MIB64 // 4

    def placed(offset: int):
        raw = oxccl.empty(MIB64 + 4096, np.uint8)
        a = raw[offset : offset + MIB64].view(np.float32)
        a[:] = rank + 1
        return a

    with oxccl.Communicator(rank, size, uid) as comm:
        f, h = oxccl.lib().ncclAllReduce, comm.handle
        page = (placed(0), placed(0))
        off16 = (placed(16), placed(16))
        ptrs = [a.__array_interface__["data"][0] for a in page]
        variants = {
            "Communicator.all_reduce, page-aligned": lambda: comm.all_reduce(*page),
            "bare ctypes ncclAllReduce, page-aligned": lambda: f(ptrs[0], ptrs[1], n, 7, 0, h, None),
            "Communicator.all_reduce, page + 16 B": lambda: comm.all_reduce(*off16),
        }
        times = {k: [] for k in variants}
        names = list(variants)
        for i in range(calls):
            for name in names[i % 3 :] + names[: i % 3]:  # rotate which variant goes first
                fn = variants[name]
                t = time.perf_counter()
                fn()
                if i >= 2:  # warm-up
                    times[name].append((time.perf_counter() - t) * 1e3)
        q.put((rank, {k: statistics.median(v) for k, v in times.items()}))


def main() -> int:
    import oxccl

    os.environ.setdefault("OXCCL_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = oxccl.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, 2, uid, 62, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    print("| variant | rank 0 median ms | rank 1 median ms |")
    print("| --- | --- | --- |")
    for name in res[0]:
        print(f"| {name} | {res[0][name]:.1f} | {res[1][name]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
