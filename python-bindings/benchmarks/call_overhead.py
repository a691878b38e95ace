"""Per-call cost of the Python layers on an 8-byte all-reduce, in one process.

A 1-rank communicator makes ncclAllReduce a local copy, so what is timed is the call path:
``Communicator.all_reduce`` (buffer checks, then the ctypes call), the bare ctypes call
``lib().ncclAllReduce(ptr, ptr, ...)`` with the pointers computed beforehand, and (when torch
is installed) ``Communicator.all_reduce`` on CPU tensors. Variants are interleaved in blocks
and the median block is reported, so machine load drifts affect all alike.

    OXCCL_SOCKET_IFNAME=lo python python-bindings/benchmarks/call_overhead.py
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import oxccl


def main() -> int:
    comm = oxccl.Communicator(0, 1, oxccl.get_unique_id())
    a, b = np.ones(2, np.float32), np.zeros(2, np.float32)
    f, h = oxccl.lib().ncclAllReduce, comm.handle
    pa, pb = a.ctypes.data, b.ctypes.data
    variants = {
        "ctypes ncclAllReduce (pointers precomputed)": lambda: f(pa, pb, 2, 7, 0, h, None),
        "Communicator.all_reduce(numpy, numpy)": lambda: comm.all_reduce(a, b),
        "Communicator.all_reduce(numpy) in place": lambda: comm.all_reduce(b),
    }
    try:
        import torch

        ta, tb = torch.ones(2), torch.zeros(2)
        variants["Communicator.all_reduce(tensor, tensor)"] = lambda: comm.all_reduce(ta, tb)
    except ImportError:
        pass
    calls, blocks = 2000, 15
    per_call = {k: [] for k in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - t) / calls * 1e6)
    base = statistics.median(per_call["ctypes ncclAllReduce (pointers precomputed)"])
    print("| call | median µs per call | over the bare ctypes call |")
    print("| --- | --- | --- |")
    for name, v in per_call.items():
        m = statistics.median(v)
        print(f"| {name} | {m:.2f} | {m - base:+.2f} |")
    comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
