#!/usr/bin/env python3
"""GPU check kit: what a cross-process handshake costs when two processes share GPU 0.

Two processes (each its own CUDA context on GPU 0) ping-pong ROUNDS times through flags in a
shared host page, three ways, and print the mean round trip of each:

* `stream`: the handshake oxccl's device barriers use. Each process enqueues, per round, a
  `cuStreamWriteValue32` into the peer's flag and a `cuStreamWaitValue32 GEQ` on its own flag
  (the page is registered with `cuMemHostRegister`, device-mapped), then synchronises once at
  the end. The GPU's front end waits; the host does not.
* `host`: the host waits instead. A process spins on its flag in host memory, then enqueues a
  4-byte `cuMemsetD32Async`, synchronises its stream, and writes the peer's flag.
* `threads`: the `stream` handshake between two streams of ONE context (one process, two
  threads), where no context switch is needed.

Without MPS, contexts of different processes time-slice the GPU: if a front-end wait holds
the GPU until the time slice ends, `stream` costs milliseconds per round while `host` and
`threads` cost microseconds. Exit status 0 when every variant completed (a round that does
not complete within 20 s is a FAIL).

Usage: timeslice.py [ROUNDS]   (default 200)
"""
import ctypes
import mmap
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time

PAGE = 4096
WAIT_GEQ = 0
WRITE_DEFAULT = 0
REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2


def cuda():
    cu = ctypes.CDLL("libcuda.so.1")
    u64, vp, u32 = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint32
    cu.cuStreamWriteValue32_v2.argtypes = [vp, u64, u32, u32]
    cu.cuStreamWaitValue32_v2.argtypes = [vp, u64, u32, u32]
    cu.cuMemHostRegister_v2.argtypes = [vp, ctypes.c_size_t, u32]
    cu.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(u64), vp, u32]
    cu.cuMemsetD32Async.argtypes = [u64, u32, ctypes.c_size_t, vp]
    cu.cuStreamSynchronize.argtypes = [vp]
    cu.cuMemHostUnregister.argtypes = [vp]
    return cu


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what} failed ({r})")


def context(cu):
    ck(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def stream(cu):
    s = ctypes.c_void_p()
    ck(cu.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")  # non-blocking
    return s


class Flags:
    """The shared page: word i is process i's flag."""

    def __init__(self, cu, path):
        self.f = open(path, "r+b")
        self.m = mmap.mmap(self.f.fileno(), PAGE)
        self.words = (ctypes.c_uint32 * (PAGE // 4)).from_buffer(self.m)
        self.host = ctypes.addressof(self.words)
        self.cu = cu
        self.dev = None

    def register(self):
        ck(self.cu.cuMemHostRegister_v2(self.host, PAGE, REGISTER_PORTABLE_DEVICEMAP), "cuMemHostRegister")
        d = ctypes.c_uint64()
        ck(self.cu.cuMemHostGetDevicePointer_v2(ctypes.byref(d), self.host, 0), "cuMemHostGetDevicePointer")
        self.dev = d.value

    def word(self, i):
        return self.dev + 4 * i


def stream_rounds(cu, s, flags, me, peer, rounds, base):
    for k in range(1, rounds + 1):
        v = base + k
        if me == 0:
            ck(cu.cuStreamWriteValue32_v2(s, flags.word(peer), v, WRITE_DEFAULT), "cuStreamWriteValue32")
            ck(cu.cuStreamWaitValue32_v2(s, flags.word(me), v, WAIT_GEQ), "cuStreamWaitValue32")
        else:
            ck(cu.cuStreamWaitValue32_v2(s, flags.word(me), v, WAIT_GEQ), "cuStreamWaitValue32")
            ck(cu.cuStreamWriteValue32_v2(s, flags.word(peer), v, WRITE_DEFAULT), "cuStreamWriteValue32")
    ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")


def host_rounds(cu, s, flags, me, peer, rounds, base, scratch):
    deadline = time.monotonic() + 20

    def wait(v):
        while flags.words[me] < v:
            if time.monotonic() > deadline:
                raise RuntimeError("host round did not complete within 20 s")

    for k in range(1, rounds + 1):
        v = base + k
        if me == 1:
            wait(v)
        ck(cu.cuMemsetD32Async(scratch, v, 1, s), "cuMemsetD32Async")
        ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
        flags.words[peer] = v
        if me == 0:
            wait(v)


def proc_main(me, path, rounds, q, go):
    try:
        cu = cuda()
        context(cu)
        s = stream(cu)
        flags = Flags(cu, path)
        flags.register()
        scratch = ctypes.c_uint64()
        ck(cu.cuMemAlloc_v2(ctypes.byref(scratch), 64), "cuMemAlloc")
        peer = 1 - me
        out = {}
        for name, base in (("stream", 0), ("host", 1 << 20)):
            go.wait()  # both processes set up, both at the start of the variant
            t0 = time.perf_counter()
            if name == "stream":
                stream_rounds(cu, s, flags, me, peer, rounds, base)
            else:
                host_rounds(cu, s, flags, me, peer, rounds, base, scratch.value)
            out[name] = (time.perf_counter() - t0) / rounds * 1e6
        q.put((me, out, None))
    except Exception as e:  # reported by the parent
        q.put((me, None, str(e)))


def threads_variant(path, rounds):
    cu = cuda()
    ctx = context(cu)
    flags = Flags(cu, path)
    flags.register()
    base = 1 << 24
    errs, times = [], {}

    def body(me):
        try:
            ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            s = stream(cu)
            t0 = time.perf_counter()
            stream_rounds(cu, s, flags, me, 1 - me, rounds, base)
            times[me] = (time.perf_counter() - t0) / rounds * 1e6
        except Exception as e:
            errs.append(str(e))

    ts = [threading.Thread(target=body, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errs or len(times) < 2:
        raise RuntimeError(f"threads variant: {errs or 'did not finish in 30 s'}")
    return max(times.values())


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    fd, path = tempfile.mkstemp(prefix="oxccl-timeslice-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(fd, PAGE)
    os.close(fd)
    try:
        ctx = mp.get_context("spawn")
        q, go = ctx.Queue(), ctx.Barrier(2)
        ps = [ctx.Process(target=proc_main, args=(i, path, rounds, q, go)) for i in (0, 1)]
        for p in ps:
            p.start()
        res = {}
        for _ in ps:
            me, out, err = q.get(timeout=60)
            if err:
                print(f"FAIL: process {me}: {err}")
                for p in ps:
                    p.kill()
                return 1
            res[me] = out
        for p in ps:
            p.join(10)
        with open(path, "r+b") as f:  # fresh flags for the one-process variant
            f.write(b"\0" * PAGE)
        thr = threads_variant(path, rounds)
    finally:
        os.unlink(path)
    print(f"# one GPU, 2 contexts, {rounds} handshake rounds; mean round trip in us")
    print(f"{'variant':<10} {'us/round':>10}")
    for name in ("stream", "host"):
        print(f"{name:<10} {max(r[name] for r in res.values()):>10.1f}")
    print(f"{'threads':<10} {thr:>10.1f}")
    s, h = max(r["stream"] for r in res.values()), max(r["host"] for r in res.values())
    print(f"NOTE: 2 processes on GPU 0: stream-wait round {s:.0f} us, host-wait round {h:.0f} us; one process {thr:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
