#!/usr/bin/env python3
"""GPU check kit: two ranks as communicators of one process (ncclCommInitAll on GPU 0, one
thread driving both through ncclGroupStart/ncclGroupEnd, a stream each, as nccl-tests `-g 2`
does) against two ranks as separate processes (oxccl-perf, read from PROCS_JSON).

Float sum all-reduce, out of place, 8 B..MAX by factors of 4; the time of a size is the mean
over its iterations of one group (both ranks), measured on the host around stream
synchronisations. Each size's result is checked (1 + 2 = 3 everywhere). Prints one row per
size: bytes, us (threads), busbw (threads), us (processes), busbw (processes).

Usage: threads_vs_procs.py MAX_BYTES [PROCS_JSON [FIRST_BYTES]]   (liboxccl from OXCCL_LIBRARY;
sizes FIRST_BYTES (default 8) times powers of 4 up to MAX_BYTES; PROCS_JSON may be "-")
"""
import ctypes
import json
import os
import struct
import sys
import time

vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def main():
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    arg = sys.argv[1] if len(sys.argv) > 1 else "64M"
    def parse(a):
        return int(a[:-1]) * mult[a[-1]] if a[-1] in mult else int(a)

    hi = parse(arg)
    first = parse(sys.argv[3]) if len(sys.argv) > 3 else 8
    procs = {}
    if len(sys.argv) > 2 and os.path.exists(sys.argv[2]):
        with open(sys.argv[2]) as f:
            for row in json.load(f):
                procs[row["size"]] = (row["oop_time_us"], row["oop_busbw"])
    cu = ctypes.CDLL("libcuda.so.1")
    nc = ctypes.CDLL(os.environ["OXCCL_LIBRARY"])
    nc.ncclAllReduce.argtypes = [vp, vp, sz, ci, ci, vp, vp]
    nc.ncclGetLastError.restype = ctypes.c_char_p
    nc.ncclGetLastError.argtypes = [vp]
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), sz]
    cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    cu.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, sz, vp]
    cu.cuMemcpyDtoH_v2.argtypes = [vp, ctypes.c_uint64, sz]
    cu.cuStreamSynchronize.argtypes = [vp]

    def ck(r, what):
        if r != 0:
            fail(f"{what} returned {r}")

    ck(cu.cuInit(0), "cuInit")
    dev, ctx = ci(), vp()
    ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    comms = (vp * 2)()
    ck(nc.ncclCommInitAll(comms, 2, (ci * 2)(0, 0)), "ncclCommInitAll")
    streams = [vp(), vp()]
    for s in streams:
        ck(cu.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
    one, two = struct.unpack("<I", struct.pack("<f", 1.0))[0], struct.unpack("<I", struct.pack("<f", 2.0))[0]

    def group(bufs, count):
        ck(nc.ncclGroupStart(), "ncclGroupStart")
        for r in range(2):
            res = nc.ncclAllReduce(bufs[r][0].value, bufs[r][1].value, count, 7, 0, comms[r], streams[r])
            if res != 0:
                fail(f"ncclAllReduce on communicator {r}: {res} {nc.ncclGetLastError(comms[r])}")
        res = nc.ncclGroupEnd()
        if res != 0:
            fail(f"ncclGroupEnd: {res} {nc.ncclGetLastError(comms[0])}")

    def sync():
        for s in streams:
            ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")

    print("# 2 ranks on GPU 0, float sum, out of place: one process (InitAll + group) vs processes")
    print(f"# {'bytes':>12} {'threads us':>11} {'busbw':>8} {'procs us':>10} {'busbw':>8}")
    size = first
    while size <= hi:
        count = size // 4
        bufs = []
        for r in range(2):
            s, d = ctypes.c_uint64(), ctypes.c_uint64()
            ck(cu.cuMemAlloc_v2(ctypes.byref(s), size), "cuMemAlloc")
            ck(cu.cuMemAlloc_v2(ctypes.byref(d), size), "cuMemAlloc")
            # On the stream of the communicator that reads it: the synchronous memset is
            # ordered on the legacy stream only, which the non-blocking streams do not wait for.
            ck(cu.cuMemsetD32Async(s, one if r == 0 else two, count, streams[r]), "cuMemsetD32Async")
            bufs.append((s, d))
        group(bufs, count)
        sync()
        for r in range(2):
            got = (ctypes.c_float * count)()
            ck(cu.cuMemcpyDtoH_v2(got, bufs[r][1], size), "cuMemcpyDtoH")
            if any(v != 3.0 for v in got):
                fail(f"{size} B: communicator {r} got {[v for v in got if v != 3.0][:4]}, want 3.0")
        iters = 20 if size < (16 << 20) else 5
        t0 = time.perf_counter()
        for _ in range(iters):
            group(bufs, count)
        sync()
        us = (time.perf_counter() - t0) / iters * 1e6
        busbw = size / us / 1e3  # 2 ranks: busbw = algbw
        p = procs.get(size)
        pt = f"{p[0]:>10.1f} {p[1]:>8.2f}" if p else f"{'-':>10} {'-':>8}"
        print(f"  {size:>12} {us:>11.1f} {busbw:>8.2f} {pt}")
        for s, d in bufs:
            cu.cuMemFree_v2(s)
            cu.cuMemFree_v2(d)
        size *= 4
    for c in comms:
        nc.ncclCommDestroy(vp(c))
    print("NOTE: one process driving both ranks completed and checked every size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
