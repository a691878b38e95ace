#!/usr/bin/env python3
"""Summarises benches/algo_sweep.sh: a plot and a table of forced ring / tree / rd against the
cost model's choice ("auto"), the share of points where auto is within 10% of the faster of ring
and tree (or recursive doubling, when auto picks it, within 10% of that), and a least-squares
calibration of the model's alpha/beta/gamma against the forced runs.

Usage: algo_sweep.py OUT_DIR [--docs DIR] [--name SUFFIX] [--try ALPHA,BETA,GAMMA] [--stale-log]
  --try: also replay the sweep with these constants; --stale-log: go on although the logged
  predictions came from another version of the model (replays and fits use this script's model)
  writes DIR/algo_sweep<SUFFIX>.md and DIR/algo_sweep<SUFFIX>.png (DIR default docs)

The cost model of src/algo/tuning.rs is restated here (features()); the script checks the
restatement against the predictions the library logged (OXCCL_DEBUG=INFO) and stops if they
differ, so a change to tuning.rs cannot silently invalidate the fit.
"""
import glob
import json
import math
import os
import re
import statistics
import sys

ALGOS = ["ring", "tree", "rd", "auto"]
HERE = os.path.dirname(os.path.abspath(__file__))
LOG_RE = re.compile(
    r"all_reduce of (\d+) B on (\d+) ranks over (\w+): algorithm (\w+), chunk (\d+) KiB, predicted ([\d.]+) us"
)


def load(out):
    """Times {(n, algo, bytes): us}, chunks {(n, algo, bytes): bytes}, picks {(n, bytes): name},
    logged predictions [(n, algo, bytes, chunk, kind, us)] and the transport kind seen."""
    times, chunks, picks, logged, kinds = {}, {}, {}, [], set()
    for path in sorted(glob.glob(os.path.join(out, "n*-*.json"))):
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
                m = LOG_RE.search(line)
                if m:
                    s, n, kind, algo, chunk, pred = m.groups()
                    s, n, chunk = int(s), int(n), int(chunk) << 10
                    chunks[(n, algo, s)] = chunk
                    kinds.add(kind)
                    logged.append((n, algo, s, chunk, kind, float(pred)))
    return times, chunks, picks, logged, kinds


def constants():
    """{kind: (alpha, beta, gamma)} as written in src/algo/tuning.rs (Params::of)."""
    src = open(os.path.join(HERE, "..", "src", "algo", "tuning.rs")).read()
    num = r"([\d.]+(?:\s*/\s*[\d.]+)?)"
    out = {}
    for m in re.finditer(
        r"TransportKind::(\w+) => Params \{ alpha: " + num + r", beta: " + num + r", gamma: " + num + r" \}", src
    ):
        vals = [eval(x) for x in m.groups()[1:]]  # plain numbers and "1.0 / 900.0"
        out[m.group(1).lower()] = tuple(vals)
    return out


# ---- the cost model of src/algo/tuning.rs, restated for the fit -------------------------------


def btree(n, rank):
    """(parent, children) of `rank` in the binary tree of tree::btree."""
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


def dtree(n, r):
    """[(parent, children)] of rank r in both trees of tree::dtree."""
    if n % 2:
        p, k = btree(n, (r - 1) % n)
        second = (None if p is None else (p + 1) % n, [(c + 1) % n for c in k])
    else:
        p, k = btree(n, n - 1 - r)
        second = (None if p is None else n - 1 - p, [n - 1 - c for c in k])
    return [btree(n, r), second]


def dtree_height(n):
    return max(height(n, lambda r: dtree(n, r)[t][0]) for t in (0, 1))


def dtree_load(n):
    """(messages sent, children) per chunk of each tree, on the busiest rank."""
    sends = max(sum((p is not None) + len(k) for p, k in dtree(n, r)) for r in range(n))
    kids = max(sum(len(k) for _, k in dtree(n, r)) for r in range(n))
    return sends, kids


def shape(algo, s, n):
    """(depth, pipelined, width, path bytes, reduced bytes) as in tuning.rs (all-reduce)."""
    if algo == "ring":
        return 2 * (n - 1), False, 1, s / n, s * (n - 1) / n
    if algo == "tree":
        sends, kids = dtree_load(n)
        return 2 * dtree_height(n), True, sends, s / 2, kids * s / 2
    # rd, and the one-shot exchange (recursive doubling's single round on two ranks)
    log = n.bit_length() - 1
    rounds = log + (0 if n & (n - 1) == 0 else 2)
    return rounds, True, rounds, s, s * log


def features(algo, s, n, chunk):
    """The coefficients of alpha, beta and gamma in the model's time for this call."""
    if n <= 1 or s == 0:
        return [0.0, 0.0, 0.0]
    depth, pipelined, width, path, red = shape(algo, s, n)
    c = max(1.0, min(chunk, path))
    k = max(1.0, math.ceil(path / c))
    if pipelined:
        return [depth + k - 1, depth * c + (path - c) * width, red]
    return [depth * k, depth * path, red]


def predict(p, algo, s, n, chunk):
    return sum(a * b for a, b in zip(p, features(algo, s, n, chunk)))


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


CHUNKS = [16 << 10 << i for i in range(9)]  # tuning::CHUNK_CANDIDATES


def choose(p, s, n, chunk=None):
    """The model's pick among ring, tree, rd (as tuning::choose, chunk sizes included)."""
    best = None
    for algo in ("ring", "tree", "rd"):
        for c in [chunk] if chunk else CHUNKS:
            t = predict(p, algo, s, n, c)
            if best is None or t < best[0]:
                best = (t, algo)
    return best[1]


def replay(p, med):
    """Share of points where the algorithm these constants pick measured within 10% of
    min(ring, tree) (on two ranks up to OXCCL_ONESHOT_BYTES the one-shot runs, measured as rd;
    points where the pick was not measured are left out)."""
    ok = total = 0
    for (n, algo, s), t in med.items():
        if algo != "ring" or (n, "tree", s) not in med:
            continue
        pick = "rd" if n == 2 and s <= 256 << 10 else choose(p, s, n)
        if (n, pick, s) in med:
            total += 1
            ok += med[(n, pick, s)] <= 1.10 * min(t, med[(n, "tree", s)])
    return ok, total


def main():
    out = sys.argv[1]
    arg = lambda flag, default: sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default
    docs, name = arg("--docs", "docs"), arg("--name", "")
    med, chunks, picks, logged, kinds = load(out)
    kind = "/".join(sorted(kinds)) or "?"

    # 1. The restated model must give what the library logged.
    consts = constants()
    worst = 0.0
    for n, algo, s, chunk, k, pred in logged:
        if k in consts and pred > 0:
            a = "rd" if algo == "oneshot" else algo
            worst = max(worst, abs(predict(consts[k], a, s, n, chunk) - pred) / pred)
    if logged:
        print(f"model restatement vs {len(logged)} logged predictions: worst relative difference {worst:.4f}")
        if worst > 0.01 and "--stale-log" not in sys.argv:
            sys.exit("benches/algo_sweep.py: the restated model no longer matches src/algo/tuning.rs")

    # 2. Table and the 10% criterion.
    ranks = sorted({k[0] for k in med})
    sizes = sorted({k[2] for k in med if k[2] > 0})
    lines = [
        "| ranks | size (B) | ring (us) | tree (us) | rd (us) | auto (us) | auto runs | auto / min(ring, tree) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = total = 0
    misses = []
    for n in ranks:
        for s in sizes:
            r, t, d, a = (med.get((n, x, s), float("nan")) for x in ALGOS)
            if any(math.isnan(v) for v in (r, t, a)):
                continue
            ratio = a / min(r, t)
            total += 1
            ok += ratio <= 1.10
            if ratio > 1.10:
                misses.append((n, s, picks.get((n, s), "?"), ratio))
            lines.append(
                f"| {n} | {s} | {r:.1f} | {t:.1f} | {'-' if math.isnan(d) else f'{d:.1f}'} | {a:.1f} | {picks.get((n, s), '?')} | {ratio:.2f} |"
            )
    pct = 100.0 * ok / max(total, 1)
    summary = f"auto within 10% of the faster of ring and tree at {ok} of {total} points ({pct:.0f}%)"
    print(f"[{kind}] {summary}")
    for n, s, pick, ratio in misses:
        print(f"  miss: {n} ranks, {s} B: auto ran {pick}, auto/min(ring,tree) {ratio:.2f}")

    # 3. Calibration against the forced runs, with the chunk each run used.
    rows = []
    for (n, algo, s), t in med.items():
        if algo in ("ring", "tree", "rd") and s > 0 and not math.isnan(t):
            rows.append((features(algo, s, n, chunks.get((n, algo, s), 512 << 10)), t))
    fitted = None
    if len(rows) >= 3:
        fitted = fit(rows)
        alpha, beta, gamma = fitted
        inv = lambda v: (1.0 / v) if v > 0 else float("inf")
        errs = sorted(abs(sum(a * b for a, b in zip(fitted, f)) - t) / t for f, t in rows)
        print(
            f"calibration over {len(rows)} forced points: alpha {alpha:.2f} us, beta 1/{inv(beta):.0f} us/B "
            f"({inv(beta) / 1e3:.2f} GB/s), gamma 1/{inv(gamma):.0f} us/B ({inv(gamma) / 1e3:.2f} GB/s); "
            f"median |error| {100 * statistics.median(errs):.0f}%"
        )
    for label, p in [("constants in tuning.rs", consts.get(kind)), ("fitted constants", fitted)]:
        if p:
            ok_, total_ = replay(p, med)
            print(f"replay with the {label} {tuple(round(x, 6) for x in p)}: {ok_} of {total_} points within 10%")
    if "--try" in sys.argv:
        p = tuple(eval(x) for x in arg("--try", "").split(","))
        print(f"replay with {p}: %d of %d points within 10%%" % replay(p, med))
    with open(os.path.join(docs, f"algo_sweep{name}.md"), "w") as f:
        f.write(f"<!-- generated by benches/algo_sweep.py from {out} -->\n")
        f.write(f"All-reduce, float sum, links: {kind}. Each time is the median of the interleaved rounds, ")
        f.write("the mean of the out-of-place and in-place times. ")
        f.write(f"{summary}.\n\n" + "\n".join(lines) + "\n")

    # 4. The plot.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cols = min(4, len(ranks))
    rows_n = math.ceil(len(ranks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.6 * cols, 2.9 * rows_n), squeeze=False, sharex=True)
    style = {"ring": ("tab:blue", "-"), "tree": ("tab:green", "-"), "rd": ("tab:gray", ":"), "auto": ("tab:red", "--")}
    for i, n in enumerate(ranks):
        ax = axes[i // cols][i % cols]
        for algo in ALGOS:
            xs = [s for s in sizes if (n, algo, s) in med]
            if xs:
                color, ls = style[algo]
                ys = [med[(n, algo, s)] for s in xs]
                ax.plot(xs, ys, ls, color=color, marker="o", ms=2.2, lw=1.4 if algo == "auto" else 1.0, label=algo)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{n} ranks", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.25)
        if i % cols == 0:
            ax.set_ylabel("us per all-reduce", fontsize=8)
        if i // cols == rows_n - 1 or i + cols >= len(ranks):
            ax.set_xlabel("bytes", fontsize=8)
    for j in range(len(ranks), rows_n * cols):
        axes[j // cols][j % cols].axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"oxccl all-reduce ({kind} links, float sum): forced ring / tree / rd vs auto; {summary}", fontsize=9)
    fig.tight_layout()
    png = os.path.join(docs, f"algo_sweep{name}.png")
    fig.savefig(png, dpi=80)
    print(f"wrote {png} ({os.path.getsize(png) // 1024} KiB) and {docs}/algo_sweep{name}.md")


if __name__ == "__main__":
    main()
