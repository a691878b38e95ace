#!/usr/bin/env python3
"""GPU check kit: NCCL's own all-reduce figures (torch "nccl" backend, 2 ranks on GPU 0, with
NCCL_MULTI_RANK_GPU_ENABLE=1), only where torch's NCCL is 2.30 or newer: older NCCL refuses two
ranks on one GPU ("Duplicate GPU detected"), so on one GPU the roof to compare with is the copy
bandwidth (step 3-copy-roof). Exit 77 (SKIP) otherwise.

Usage: nccl_figures.py MAX_SIZE (bytes, K/M/G suffixes allowed)
"""
import os
import subprocess
import sys


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


try:
    import torch
except ImportError as e:
    skip(f"no torch ({e})")
if not torch.cuda.is_available():
    skip("torch sees no CUDA device")
ver = tuple(torch.cuda.nccl.version())
if ver < (2, 30):
    skip(f"torch's NCCL is {'.'.join(map(str, ver))} < 2.30: it refuses two ranks on one GPU")
arg = sys.argv[1] if len(sys.argv) > 1 else "256M"
mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
hi = int(arg[:-1]) * mult[arg[-1]] if arg[-1] in mult else int(arg)
env = dict(os.environ)
env.pop("LD_PRELOAD", None)
here = os.path.dirname(os.path.abspath(__file__))
sys.exit(subprocess.call([sys.executable, os.path.join(here, "nccl_bench.py"), "2", "8", str(hi)], env=env))
