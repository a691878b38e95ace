#!/usr/bin/env python3
"""GPU check kit: the reduce-copy kernel against the copy roof at byte offsets 0, +2 and +4 and
for e4m3/e5m2, from gpu_kernel_bench's table. Runs the bench (its path and size as arguments),
requires a row for every (type, offset) it promises (float at +0 and +4; bfloat16, e4m3 and e5m2 at
+0, +2, +4 and mutually misaligned 0/2/4) and prints, per type and offset, the kernel's share
of the copy's bandwidth at the largest size (a NOTE line with the worst of them).

Usage: kernel_offsets.py GPU_KERNEL_BENCH MAX_BYTES
"""
import subprocess
import sys

WANT = {
    "float": ["+0", "+4"],
    "bfloat16": ["+0", "+2", "+4", "0/2/4"],
    "f8e4m3": ["+0", "+2", "+4", "0/2/4"],
    "f8e5m2": ["+0", "+2", "+4", "0/2/4"],
}


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    res = subprocess.run([sys.argv[1], sys.argv[2]], capture_output=True, text=True, timeout=600)
    print(res.stdout)
    print(res.stderr, file=sys.stderr)
    if res.returncode != 0:
        print(f"FAIL: gpu_kernel_bench exited {res.returncode}")
        return 1
    # (type, offset) -> (bytes, ratio %) of the largest size.
    rows = {}
    for line in res.stdout.splitlines():
        f = line.split()
        if line.startswith("#") or len(f) != 6:
            continue
        size, name, off, ratio = int(f[0]), f[1], f[2], float(f[5].rstrip("%"))
        if (name, off) not in rows or rows[(name, off)][0] <= size:
            rows[(name, off)] = (size, ratio)
    names = {n for n, _ in rows}
    missing = [f"{t} {o}" for t, offs in WANT.items() for o in offs if (t, o) not in rows]
    if missing:
        print(f"FAIL: no row for {', '.join(missing)} (types in the table: {sorted(names)})")
        return 1
    worst = min(((r, t, o) for (t, o), (_, r) in rows.items()), default=None)
    for (t, o), (size, r) in sorted(rows.items()):
        print(f"{t:>8} {o:>6}: {r:5.1f}% of the copy at {size} bytes")
    print(f"NOTE: reduce-copy vs copy roof at offsets 0/+2/+4, e4m3/e5m2 included; worst {worst[0]:.1f}% ({worst[1]} {worst[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
