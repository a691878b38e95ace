"""Data-parallel SGD on numpy: each rank computes the gradient of its shard of the data, an
all-reduce sums the gradients, and every rank takes the same step. The result matches
single-process training on the full batch (up to float64 summation order).

Run on N local ranks (spawned here):      python numpy_sgd.py --ranks 2
Or under a launcher (one process a rank): torchrun --nproc-per-node 2 numpy_sgd.py
                                          mpirun -np 2 -x OXCCL_COMM_ID=host:port python numpy_sgd.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

import numpy as np

import oxccl

FEATURES, SAMPLES, STEPS, LR = 16, 1000, 100, 0.1


def make_data(seed: int = 0):
    """A linear-regression problem: y = X w_true + noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES))
    w_true = rng.standard_normal(FEATURES)
    return x, x @ w_true + 0.1 * rng.standard_normal(SAMPLES)


def gradient_sum(w, x, y):
    """Sum over the rows given of the gradient of 0.5 * (x w - y)^2."""
    return x.T @ (x @ w - y)


def train_single(x, y):
    """Full-batch gradient descent in one process (the reference)."""
    w = np.zeros(FEATURES)
    for _ in range(STEPS):
        w -= LR * gradient_sum(w, x, y) / len(y)
    return w


def train_data_parallel(comm: oxccl.Communicator, x, y):
    """The same descent, each rank holding rows rank::size of the data."""
    xs, ys = x[comm.rank :: comm.size], y[comm.rank :: comm.size]
    w = np.zeros(FEATURES)
    for _ in range(STEPS):
        g = gradient_sum(w, xs, ys)
        comm.all_reduce(g, op="sum")  # in place: the full batch's gradient sum on every rank
        w -= LR * g / len(y)
    return w


def run(comm: oxccl.Communicator) -> float:
    x, y = make_data()
    w = train_data_parallel(comm, x, y)
    diff = float(np.max(np.abs(w - train_single(x, y))))
    if comm.rank == 0:
        loss = 0.5 * np.mean((x @ w - y) ** 2)
        print(f"{comm.size} ranks, {STEPS} steps: loss {loss:.6f}; max |w - w_single_process| = {diff:.3e}")
    return diff


def _rank_main(rank: int, size: int, uid: bytes, results) -> None:
    with oxccl.Communicator(rank, size, uid) as comm:
        results.put(run(comm))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=0, help="spawn this many local ranks (default: join a launcher's job)")
    args = ap.parse_args()
    if args.ranks:
        ctx = mp.get_context("spawn")
        uid, results = oxccl.get_unique_id(), ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, uid, results)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        diffs = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
        ok = all(p.exitcode == 0 for p in procs) and max(diffs) < 1e-12
    else:
        with oxccl.Communicator.from_env() as comm:
            ok = run(comm) < 1e-12
    print("OK: matches single-process training" if ok else "MISMATCH", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
