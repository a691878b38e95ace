"""What the peer benchmarks (gloo_allreduce.py, mpi_allreduce.py) share: size parsing, the
common options, the calibration of the iteration count and the nccl-tests-like table.

Method: per size, warm-up, then a batch of k back-to-back calls with k doubled until the batch
takes >= target/10 on the slowest rank; iters = target / (batch time / k), clamped. Each timed
call is then measured on every rank; per-iteration time = max over ranks; the table gives the
median (and min, p90). algbw = bytes / time (1 GB = 1e9 B), busbw = algbw * 2(n-1)/n.
"""
import statistics

DEFAULT_SIZES = "8,1K,64K,1M,16M,128M"


def parse_size(s):
    """'8', '1K', '64KiB', '2M', '1G' (binary multiples) -> bytes."""
    s = s.strip().upper()
    mult = 1
    for suf, m in (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30),
                   ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("B", 1)):
        if s.endswith(suf):
            s, mult = s[: -len(suf)], m
            break
    return int(float(s) * mult)


def add_args(p):
    """The options every peer benchmark takes."""
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of bytes per rank, K/M/G suffixes = KiB/MiB/GiB")
    p.add_argument("--target-time", type=float, default=0.5, help="seconds of timed iterations per size")
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=200000)
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations before calibration")


def sizes(args):
    return [parse_size(s) for s in args.sizes.split(",") if s.strip()]


def print_header(first_line):
    print(first_line, flush=True)
    print("#  float32 sum; time = median over iters of max-over-ranks per-iteration time")
    print(f"# {'size':>10} {'count':>11} {'type':>7} {'redop':>5} {'iters':>7} "
          f"{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'min':>10} {'p90':>10}")
    print(f"# {'(B)':>10} {'(elements)':>11} {'':>7} {'':>5} {'':>7} "
          f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(us)':>10} {'(us)':>10}", flush=True)


def iterations(batch, args):
    """`batch(k)` runs k calls and returns the slowest rank's seconds (same on every rank)."""
    k = 1
    while True:
        el = batch(k)
        if el >= args.target_time / 10 or k >= args.max_iters:
            break
        k *= 2
    return int(min(args.max_iters, max(args.min_iters, args.target_time / (el / k))))


def print_row(nbytes, iters, times_ns, wrong, n):
    """One table line from the per-iteration max-over-ranks times (ns)."""
    ts = sorted(t / 1e3 for t in times_ns)  # us
    med = statistics.median(ts)
    algbw = nbytes / (med * 1e-6) / 1e9
    busbw = algbw * 2.0 * (n - 1) / n
    print(f"  {nbytes:>10} {nbytes // 4:>11} {'float':>7} {'sum':>5} {iters:>7} "
          f"{med:>10.2f} {algbw:>7.3f} {busbw:>7.3f} {wrong:>6} "
          f"{ts[0]:>10.2f} {ts[min(iters - 1, int(0.9 * iters))]:>10.2f}", flush=True)
