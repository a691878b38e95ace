#!/usr/bin/env python3
"""Turns the raw outputs of run.sh into a markdown table and a PNG plot.

usage: report.py RESULTS_DIR OUT.md OUT.png

RESULTS_DIR holds oxccl_n<N>_<bytes>[_r<R>].json (oxccl-perf --json), gloo_n<N>[_r<R>].txt,
ompi_c_n<N>[_r<R>].txt, ompi_py_n<N>[_r<R>].txt (nccl-tests-like tables: size count type redop
iters time algbw busbw #wrong min p90) and meta.txt. Time is in microseconds, bus bandwidth in
GB/s (1 GB = 1e9 B). With several rounds (_r1, _r2, ...) each cell is the round with the median
time (busbw is a function of time, so it is the median busbw too).
"""
import glob
import json
import os
import re
import sys

from bench_common import parse_size  # noqa: F401 (run.sh uses report.parse_size)


def human(b):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m} {unit}"
    return f"{b} B"


def median_rounds(runs):
    """{bytes: [(time, busbw, wrong), ...]} -> {bytes: the entry with the median time}
    (lower median for an even count); wrong counts are summed over the rounds."""
    out = {}
    for b, rs in runs.items():
        rs = sorted(rs)
        t, bw, _ = rs[(len(rs) - 1) // 2]
        out[b] = (t, bw, sum(r[2] for r in rs))
    return out


def read_tables(d, stem):
    """{bytes: (time_us, busbw, wrong)}: median over the rounds of nccl-tests-like tables
    <stem>.txt / <stem>_r<R>.txt."""
    runs = {}
    paths = [os.path.join(d, f"{stem}.txt")] + sorted(glob.glob(os.path.join(d, f"{stem}_r*.txt")))
    for path in paths:
        if not os.path.exists(path):
            continue
        for line in open(path):
            if line.startswith("#") or not line.strip():
                continue
            f = line.split()
            if len(f) >= 9 and f[0].isdigit():
                runs.setdefault(int(f[0]), []).append((float(f[5]), float(f[7]), int(f[8])))
    return median_rounds(runs)


def read_oxccl(d, n):
    """{'oop': {bytes: (time, busbw, wrong)}, 'ip': {...}}: median over the rounds of the
    oxccl-perf JSON files."""
    runs = {"oop": {}, "ip": {}}
    for path in glob.glob(os.path.join(d, f"oxccl_n{n}_*.json")):
        for r in json.load(open(path)):
            for h in ("oop", "ip"):
                runs[h].setdefault(r["size"], []).append((r[f"{h}_time_us"], r[f"{h}_busbw"], r[f"{h}_wrong"] or 0))
    return {h: median_rounds(v) for h, v in runs.items()}


def libraries(d, n):
    ox = read_oxccl(d, n)
    return {
        "oxccl (out of place)": ox["oop"],
        "oxccl (in place)": ox["ip"],
        "Gloo (in place)": read_tables(d, f"gloo_n{n}"),
        "Open MPI C": read_tables(d, f"ompi_c_n{n}"),
        "Open MPI mpi4py": read_tables(d, f"ompi_py_n{n}"),
    }


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def table(d, n):
    libs = libraries(d, n)
    names = list(libs)
    sizes = sorted(set().union(*[set(v) for v in libs.values()]))
    head = "| size | " + " | ".join(f"{k} µs / GB/s" for k in names) + " | oxccl/OMPI C | oxccl/Gloo |"
    out = [head, "|" + " --- |" * (len(names) + 3)]
    for b in sizes:
        cells = []
        for k in names:
            v = libs[k].get(b)
            cells.append("-" if v is None else f"{v[0]:.3g} / {v[1]:.3g}" + (f" ({v[2]} wrong)" if v[2] else ""))
        oop, ip = libs[names[0]].get(b), libs[names[1]].get(b)
        mpi, gloo = libs["Open MPI C"].get(b), libs["Gloo (in place)"].get(b)
        # Ratios of busbw (equivalently of inverse time): > 1 means oxccl is faster.
        r_mpi = ratio(mpi[0], oop[0]) if oop and mpi else "-"
        r_gloo = ratio(gloo[0], ip[0]) if ip and gloo else "-"
        out.append(f"| {human(b)} | " + " | ".join(cells) + f" | {r_mpi} | {r_gloo} |")
    return "\n".join(out)


def plot(d, ranks, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(ranks), figsize=(6.5 * len(ranks), 9), squeeze=False)
    for col, n in enumerate(ranks):
        libs = libraries(d, n)
        for name, rows in libs.items():
            if not rows:
                continue
            xs = sorted(rows)
            style = "-o" if name.startswith("oxccl") else "--s"
            axes[0][col].plot(xs, [rows[x][1] for x in xs], style, label=name, markersize=4)
            axes[1][col].plot(xs, [rows[x][0] for x in xs], style, label=name, markersize=4)
        for row, ylabel in ((0, "bus bandwidth (GB/s)"), (1, "time per all-reduce (µs)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if row == 1:
                ax.set_yscale("log")
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel(ylabel)
            ax.set_title(f"float32 sum all-reduce, {n} ranks, host memory")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=80)


def main():
    d, md, png = sys.argv[1:4]
    ranks = sorted({int(m.group(1)) for p in os.listdir(d) for m in [re.match(r"oxccl_n(\d+)\.txt", p)] if m})
    meta = open(os.path.join(d, "meta.txt")).read().strip() if os.path.exists(os.path.join(d, "meta.txt")) else ""
    parts = ["# Host all-reduce: oxccl vs Gloo vs Open MPI (one run)", "", "```", meta, "```", ""]
    parts += [
        "Each cell: time per call in µs / bus bandwidth in GB/s: the median over iterations of the",
        "slowest rank's per-iteration time (oxccl-perf --stat median; the peers time each call the",
        "same way); with several rounds, the round with the median time. Ratios are oxccl's busbw",
        "over the peer's, i.e. the peer's time over oxccl's (out of place vs Open MPI C, in place",
        "vs Gloo): above 1, oxccl is faster.",
        "",
    ]
    for n in ranks:
        parts += [f"## {n} ranks", "", table(d, n), ""]
    open(md, "w").write("\n".join(parts))
    plot(d, ranks, png)


if __name__ == "__main__":
    main()
