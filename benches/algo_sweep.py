#!/usr/bin/env python3
"""Summarises benches/algo_sweep.sh: docs/algo_sweep.png, docs/algo_sweep.md, the share of points
where the cost model's choice ("auto") is within 10% of the faster of ring and tree, and a
least-squares calibration of the model's alpha/beta/gamma against the forced runs.

Usage: algo_sweep.py OUT_DIR [--docs DIR]
"""
import glob
import json
import math
import os
import re
import sys

ALGOS = ["ring", "tree", "rd", "auto"]


def load(out):
    """{(n, algo, bytes): time_us}, {(n, algo, bytes): chunk}, {(n, bytes): auto's algorithm}."""
    times, chunks, picks = {}, {}, {}
    for path in glob.glob(os.path.join(out, "n*-*.json")):
        with open(path) as f:
            for row in json.load(f):
                n, size, label = row["nranks"], row["size"], row["algo"]
                algo = "auto" if label.startswith("auto") else label
                if label.startswith("auto:"):
                    picks[(n, size)] = label[5:]
                times[(n, algo, size)] = (row["oop_time_us"] + row["ip_time_us"]) / 2
        log = path[:-5] + ".log"
        if os.path.exists(log):
            for line in open(log):
                m = re.search(r"all_reduce of (\d+) B on (\d+) ranks over \w+: algorithm (\w+), chunk (\d+) KiB", line)
                if m:
                    chunks[(int(m.group(2)), m.group(3), int(m.group(1)))] = int(m.group(4)) << 10
    return times, chunks, picks


# ---- the cost model of src/algo/tuning.rs, restated for the fit -------------------------------

def btree(n, rank):
    if n <= 1:
        return None, []
    bit = 1
    while bit < n and bit & rank == 0:
        bit <<= 1
    if rank == 0:
        return None, [bit >> 1]
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    low = bit >> 1
    kids = [rank - low] if low else []
    step = low
    while step and rank + step >= n:
        step >>= 1
    if step:
        kids.append(rank + step)
    return up, kids


def height(n, parent):
    best = 0
    for r in range(n):
        d, at = 0, r
        while parent(at) is not None:
            d, at = d + 1, parent(at)
        best = max(best, d)
    return best


def dtree_height(n):
    h0 = height(n, lambda r: btree(n, r)[0])
    if n % 2:
        p1 = lambda r: (None if btree(n, (r - 1) % n)[0] is None else (btree(n, (r - 1) % n)[0] + 1) % n)
    else:
        p1 = lambda r: (None if btree(n, n - 1 - r)[0] is None else n - 1 - btree(n, n - 1 - r)[0])
    return max(h0, height(n, p1))


def shape(algo, s, n):
    """(depth, pipelined, width, path bytes, reduced bytes) as in tuning.rs (all-reduce)."""
    if algo == "ring":
        return 2 * (n - 1), False, 1, s / n, s * (n - 1) / n
    if algo == "tree":
        return 2 * dtree_height(n), True, (2 if n <= 2 else 4), s / 2, s
    rounds = int(math.log2(n)) + (0 if n & (n - 1) == 0 else 2)
    return rounds, True, rounds, s, s * int(math.log2(n))


def features(algo, s, n, chunk):
    """The coefficients of alpha, beta and gamma in the model's time for this call."""
    depth, pipelined, width, path, red = shape(algo, s, n)
    c = max(1.0, min(chunk, path))
    k = max(1.0, math.ceil(path / c))
    if pipelined:
        return [depth + k - 1, depth * c + (path - c) * width, red]
    return [depth * k, depth * path, red]


def fit(rows):
    """Least squares on relative error: T ~ alpha*A + beta*B + gamma*G, coefficients >= 0."""
    import numpy as np

    active = [0, 1, 2]
    while True:
        a = np.array([[f[i] / t for i in active] for f, t in rows])
        x, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
        if (x >= 0).all() or len(active) == 1:
            out = [0.0, 0.0, 0.0]
            for i, v in zip(active, x):
                out[i] = max(0.0, float(v))
            return out
        active = [i for i, v in zip(active, x) if v >= 0]


def main():
    out = sys.argv[1]
    docs = sys.argv[sys.argv.index("--docs") + 1] if "--docs" in sys.argv else "docs"
    med, chunks, picks = load(out)
    ranks = sorted({k[0] for k in med})
    sizes = sorted({k[2] for k in med if k[2] > 0})
    lines = [
        "| ranks | size (B) | ring (us) | tree (us) | rd (us) | auto (us) | auto picks | auto / best of ring, tree |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = total = 0
    misses = []
    for n in ranks:
        for s in sizes:
            r, t, d, a = (med.get((n, x, s), float("nan")) for x in ALGOS)
            if any(math.isnan(v) for v in (r, t, a)):
                continue
            best = min(r, t)
            ratio = a / best
            total += 1
            ok += ratio <= 1.10
            if ratio > 1.10:
                misses.append((n, s, ratio))
            pick = picks.get((n, s), "?")
            lines.append(f"| {n} | {s} | {r:.1f} | {t:.1f} | {d:.1f} | {a:.1f} | {pick} | {ratio:.2f} |")
    summary = f"auto within 10% of the faster of ring and tree at {ok} of {total} points ({100.0 * ok / max(total, 1):.0f}%)"
    with open(os.path.join(docs, "algo_sweep.md"), "w") as f:
        f.write("<!-- generated by benches/algo_sweep.py -->\n")
        f.write(f"{summary}.\n\n" + "\n".join(lines) + "\n")
    print(summary)
    for n, s, ratio in misses:
        print(f"  miss: {n} ranks, {s} B: auto/best {ratio:.2f}")

    # Calibration against the forced runs, with the chunk each run used.
    rows = []
    for (n, algo, s), t in med.items():
        if algo in ("ring", "tree", "rd") and s > 0 and not math.isnan(t):
            chunk = chunks.get((n, algo, s), 512 << 10)
            rows.append((features(algo, s, n, chunk), t))
    if len(rows) >= 3:
        alpha, beta, gamma = fit(rows)
        inv = lambda v: (1.0 / v) if v > 0 else float("inf")
        print(f"calibration over {len(rows)} points: alpha {alpha:.2f} us, beta 1/{inv(beta):.0f} us/B ({inv(beta) / 1e3:.2f} GB/s), gamma 1/{inv(gamma):.0f} us/B")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cols = min(4, len(ranks))
    rows_n = math.ceil(len(ranks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False, sharex=True)
    style = {"ring": ("tab:blue", "-"), "tree": ("tab:green", "-"), "rd": ("tab:gray", ":"), "auto": ("tab:red", "--")}
    for i, n in enumerate(ranks):
        ax = axes[i // cols][i % cols]
        for algo in ALGOS:
            xs = [s for s in sizes if (n, algo, s) in med]
            if xs:
                color, ls = style[algo]
                ax.plot(xs, [med[(n, algo, s)] for s in xs], ls, color=color, marker="o", ms=2.5, lw=1.4 if algo == "auto" else 1.0, label=algo)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{n} ranks")
        ax.grid(True, which="both", alpha=0.25)
        if i % cols == 0:
            ax.set_ylabel("time per all-reduce (us)")
        if i // cols == rows_n - 1:
            ax.set_xlabel("bytes")
    for j in range(len(ranks), rows_n * cols):
        axes[j // cols][j % cols].axis("off")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("oxccl all-reduce over loopback TCP, float sum: forced ring / tree / rd vs cost model (auto)")
    fig.tight_layout()
    fig.savefig(os.path.join(docs, "algo_sweep.png"), dpi=110)
    print(f"wrote {docs}/algo_sweep.png and {docs}/algo_sweep.md")


if __name__ == "__main__":
    main()
