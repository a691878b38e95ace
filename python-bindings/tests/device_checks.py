"""Rank-side checks of device buffers on the CUDA stand-in (cuda-standin/), run by
test_device_standin.py through a :class:`ranks.RankPool`.

Each rank allocates "device" memory through the stand-in's libcuda (ctypes), wraps it in an
object exposing ``__cuda_array_interface__`` (version 3, with the stream to order the call
on), and passes it to :class:`oxccl.Communicator`: the call must route to the device path
(liboxccl classifies the pointer with the same driver) and the result, copied back to the host
after the stream is synchronised, must match a numpy reference.
"""

from __future__ import annotations

import ctypes

import numpy as np

import oxccl

_cu = None


def _driver() -> ctypes.CDLL:
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
    return _cu


def _ok(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


class DeviceArray:
    """A C-contiguous float32/int32 array in stand-in device memory, with a stream."""

    def __init__(self, count: int, dtype: np.dtype, stream: int):
        cu = _driver()
        self.count, self.dtype, self.stream = count, np.dtype(dtype), stream
        self.nbytes = max(count * self.dtype.itemsize, 16)
        p = ctypes.c_uint64()
        _ok(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(self.nbytes)), "cuMemAlloc")
        self.ptr = p.value

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.count,),
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": self.stream,
        }

    def upload(self, a: np.ndarray) -> None:
        """Copies `a` in before the array's stream uses it. A synchronous cuMemcpyHtoD from
        pageable memory may land after it returns, ordered on the legacy stream only: enough
        for the default stream (the library must order its work after it), not for a
        non-blocking stream, where the copy goes on that stream and is waited for."""
        a = np.ascontiguousarray(a, dtype=self.dtype)
        src = a.ctypes.data_as(ctypes.c_void_p)
        cu, dst, n = _driver(), ctypes.c_uint64(self.ptr), ctypes.c_size_t(a.nbytes)
        if self.stream == 0:
            _ok(cu.cuMemcpyHtoD_v2(dst, src, n), "HtoD")
            return
        stream = ctypes.c_void_p(self.stream)
        _ok(cu.cuMemcpyHtoDAsync_v2(dst, src, n, stream), "HtoDAsync")
        _ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def download(self) -> np.ndarray:
        out = np.empty(self.count, dtype=self.dtype)
        dst = out.ctypes.data_as(ctypes.c_void_p)
        _ok(_driver().cuMemcpyDtoH_v2(dst, ctypes.c_uint64(self.ptr), ctypes.c_size_t(out.nbytes)), "DtoH")
        return out

    def free(self) -> None:
        if self.ptr:
            _driver().cuMemFree_v2(ctypes.c_uint64(self.ptr))
            self.ptr = 0


class Ctx:
    def __init__(self, comm: oxccl.Communicator, stream: int):
        self.comm, self.stream = comm, stream


def setup(rank: int, size: int, uid: bytes) -> Ctx:
    cu = _driver()
    _ok(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    s = ctypes.c_void_p()
    _ok(cu.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
    return Ctx(oxccl.Communicator(rank, size, uid), s.value or 0)


def teardown(ctx: Ctx) -> None:
    ctx.comm.destroy()


def _input(rank: int, count: int, seed: int, dtype) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 13 + seed) % 23 - 11).astype(dtype)


def collectives(ctx: Ctx, count: int, use_stream: bool) -> list:
    """Runs all-reduce, broadcast, all-gather, reduce-scatter and all-to-all on device arrays
    (float32 and int32), on this rank's stream or the default one; returns the names checked."""
    comm, n, me = ctx.comm, ctx.comm.size, ctx.comm.rank
    stream = ctx.stream if use_stream else 0
    cu = _driver()
    done = []
    for dt in (np.float32, np.int32):
        for seed, name in enumerate(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"]):
            blocks = n if name in ("reduce_scatter", "all_to_all") else 1
            ins = [_input(r, count * blocks, seed, dt) for r in range(n)]
            rcount = count * n if name in ("all_gather", "all_to_all") else count
            send, recv = DeviceArray(count * blocks, dt, stream), DeviceArray(rcount, dt, stream)
            send.upload(ins[me])
            recv.upload(np.full(rcount, 99, dtype=dt))
            if name == "all_reduce":
                comm.all_reduce(send, recv)
                want = np.sum(ins, axis=0, dtype=dt)
            elif name == "broadcast":
                comm.broadcast(send, recv, root=n - 1)
                want = ins[n - 1]
            elif name == "all_gather":
                comm.all_gather(send, recv)
                want = np.concatenate(ins)
            elif name == "reduce_scatter":
                comm.reduce_scatter(send, recv)
                want = np.sum(ins, axis=0, dtype=dt)[me * count : (me + 1) * count]
            else:
                comm.all_to_all(send, recv)
                want = np.concatenate([x[me * count : (me + 1) * count] for x in ins])
            # The call returned with the work enqueued on the stream: synchronise it, then read.
            _ok(cu.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")
            got = recv.download()
            send.free()
            recv.free()
            np.testing.assert_array_equal(got, want, err_msg=f"rank {me}: {name} {np.dtype(dt).name}")
            done.append(f"{name}/{np.dtype(dt).name}")
    return done
