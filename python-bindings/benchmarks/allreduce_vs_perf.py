"""All-reduce through the Python bindings vs oxccl-perf, same sizes, same method, interleaved.

For each round, in rotating order: ``oxccl-perf all_reduce`` (2 local ranks, float32 sum)
and the same all-reduce issued from Python (2 spawned ranks, through
``Communicator.all_reduce``) on page-aligned numpy buffers (``oxccl.empty``, placed like
oxccl-perf's) and on plain ``numpy.empty`` buffers (16 bytes past a page boundary), at
64 MiB and at 8 B. Both measure like nccl-tests: ``-w``
warm-up calls, ``-n`` timed calls back to back, time = elapsed / n per rank, max over ranks,
out-of-place then in-place.

Usage (from the repository root, after cargo build --release and pip install ./python-bindings):

    OXCCL_SOCKET_IFNAME=lo python python-bindings/benchmarks/allreduce_vs_perf.py --rounds 6

Prints each round and the median ratios python / oxccl-perf (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"64M": 64 << 20, "8": 8}


def _perf(perf: str, size: int, iters: int, warmup: int) -> tuple:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "perf.json"
        cmd = [perf, "all_reduce", "-b", str(size), "-e", str(size), "-n", str(iters), "-w", str(warmup), "-c", "0"]
        cmd += ["--ranks", "2", "-d", "float", "-o", "sum", "--json", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        (row,) = json.loads(out.read_text())
        return row["oop_time_us"], row["ip_time_us"]


def _rank(rank: int, size: int, uid: bytes, nbytes: int, iters: int, warmup: int, aligned: bool, q) -> None:
    import numpy as np

    import oxccl

    with oxccl.Communicator(rank, size, uid) as comm:
        n = nbytes // 4
        alloc = oxccl.empty if aligned else np.empty
        send, recv = alloc(n, np.float32), alloc(n, np.float32)
        send[:] = rank + 1
        recv[:] = 0
        times = []
        for in_place in (False, True):
            args = (recv,) if in_place else (send, recv)
            for _ in range(warmup):
                comm.all_reduce(*args)
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(*args)
            times.append((time.perf_counter() - t0) / iters * 1e6)
        q.put((rank, times))


def _python(nbytes: int, iters: int, warmup: int, aligned: bool) -> tuple:
    import oxccl

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = oxccl.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, 2, uid, nbytes, iters, warmup, aligned, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    oop = max(t[0] for _, t in res)
    ip = max(t[1] for _, t in res)
    return oop, ip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--perf", default="target/release/oxccl-perf")
    ap.add_argument("--big-iters", type=int, default=10)
    ap.add_argument("--big-warmup", type=int, default=3)
    ap.add_argument("--small-iters", type=int, default=2000)
    ap.add_argument("--small-warmup", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("OXCCL_SOCKET_IFNAME", "lo")
    counts = {"64M": (args.big_iters, args.big_warmup), "8": (args.small_iters, args.small_warmup)}
    kinds = ("perf", "aligned", "numpy")
    ratios = {(label, k, half): [] for label in SIZES for k in kinds[1:] for half in ("oop", "ip")}
    print(
        "| round | size | oxccl-perf oop / ip (us) | python, aligned oop / ip (us) | ratio oop / ip "
        "| python, numpy.empty oop / ip (us) | ratio oop / ip |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rnd in range(args.rounds):
        for label, nbytes in SIZES.items():
            iters, warmup = counts[label]
            order = kinds[rnd % 3 :] + kinds[: rnd % 3]  # rotate who goes first
            t = {}
            for who in order:
                t[who] = (
                    _perf(args.perf, nbytes, iters, warmup)
                    if who == "perf"
                    else _python(nbytes, iters, warmup, who == "aligned")
                )
            cells = [f"{t['perf'][0]:.1f} / {t['perf'][1]:.1f}"]
            for k in kinds[1:]:
                r = (t[k][0] / t["perf"][0], t[k][1] / t["perf"][1])
                ratios[(label, k, "oop")].append(r[0])
                ratios[(label, k, "ip")].append(r[1])
                cells += [f"{t[k][0]:.1f} / {t[k][1]:.1f}", f"{r[0]:.3f} / {r[1]:.3f}"]
            print(f"| {rnd} | {label} B | " + " | ".join(cells) + " |", flush=True)
    print()
    for label in SIZES:
        for k in kinds[1:]:
            o, i = statistics.median(ratios[(label, k, "oop")]), statistics.median(ratios[(label, k, "ip")])
            print(f"{label} B, {k} buffers: median python / oxccl-perf time: out-of-place {o:.3f}, in-place {i:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
