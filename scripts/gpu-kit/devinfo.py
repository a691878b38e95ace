#!/usr/bin/env python3
"""GPU check kit: what the CUDA driver on the loader path reports, through ctypes only.

Prints one `key: value` line per fact: the driver and NVRTC versions, each device's name,
compute capability, SMs, memory, compute mode, unified addressing and stream memory operations,
whether an MPS control daemon looks active, and a device-to-device copy bandwidth of GPU 0
(`d2d_gbps:`, bytes read + written per second, 64 MiB copies timed on the host). Exit status 1
when no CUDA device is usable.
"""
import ctypes
import ctypes.util
import glob
import os
import sys
import time

ATTRS = [
    ("compute_capability_major", 75),
    ("compute_capability_minor", 76),
    ("multiprocessors", 16),
    ("compute_mode", 20),  # 0 default, 1 exclusive thread (gone), 2 prohibited, 3 exclusive process
    ("unified_addressing", 41),
    ("pci_bus_id", 33),
    ("can_use_stream_mem_ops", 92),
    ("can_use_64_bit_stream_mem_ops", 93),
    ("can_use_stream_wait_value_nor", 94),
    ("can_map_host_memory", 19),
]
COMPUTE_MODES = {0: "default", 1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}


def load(names):
    for n in names:
        try:
            return ctypes.CDLL(n), n
        except OSError:
            continue
    return None, None


def main() -> int:
    cu, name = load(["libcuda.so.1", "libcuda.so"])
    if cu is None:
        print("cuda: no libcuda.so.1 on the loader path")
        return 1
    print(f"libcuda: {name}")
    r = cu.cuInit(0)
    if r != 0:
        print(f"cuda: cuInit failed ({r})")
        return 1
    v = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(v))
    print(f"driver_cuda_version: {v.value // 1000}.{v.value % 1000 // 10}")
    nv, nvname = load(["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"])
    if nv is not None:
        a, b = ctypes.c_int(), ctypes.c_int()
        nv.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
        print(f"nvrtc: {nvname} {a.value}.{b.value}")
    else:
        print("nvrtc: none on the loader path (kernels cannot be compiled)")
    n = ctypes.c_int()
    cu.cuDeviceGetCount(ctypes.byref(n))
    print(f"devices: {n.value}")
    if n.value < 1:
        return 1
    for d in range(n.value):
        dev = ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), d)
        buf = ctypes.create_string_buffer(256)
        cu.cuDeviceGetName(buf, 256, dev)
        mem = ctypes.c_size_t()
        cu.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        print(f"device{d}.name: {buf.value.decode(errors='replace')}")
        print(f"device{d}.memory_gib: {mem.value / 2**30:.1f}")
        for key, attr in ATTRS:
            val = ctypes.c_int(-1)
            r = cu.cuDeviceGetAttribute(ctypes.byref(val), attr, dev)
            shown = val.value if r == 0 else f"error {r}"
            if key == "compute_mode" and r == 0:
                shown = f"{val.value} ({COMPUTE_MODES.get(val.value, '?')})"
            print(f"device{d}.{key}: {shown}")
    mps = [p for p in glob.glob("/proc/[0-9]*/comm") if _read(p).startswith("nvidia-cuda-mps")]
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    print(f"mps: {'daemon running' if mps else 'no daemon process seen'}; pipe dir {pipe} {'exists' if os.path.isdir(pipe) else 'absent'}")
    print(f"d2d_gbps: {copy_bandwidth(cu):.1f}")
    return 0


def _read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return ""


def copy_bandwidth(cu) -> float:
    """Device-to-device copy of 64 MiB on GPU 0: (read + written) bytes per second / 1e9."""
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0 or cu.cuCtxSetCurrent(ctx) != 0:
        return 0.0
    size = 64 << 20
    a, b = ctypes.c_uint64(), ctypes.c_uint64()
    if cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(size)) != 0:
        return 0.0
    if cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(size)) != 0:
        cu.cuMemFree_v2(a)
        return 0.0
    cu.cuMemsetD8_v2(a, 1, ctypes.c_size_t(size))
    cu.cuMemcpyDtoD_v2(b, a, ctypes.c_size_t(size))
    cu.cuCtxSynchronize()
    iters, t0 = 0, time.perf_counter()
    while iters < 50 and (iters < 3 or time.perf_counter() - t0 < 0.5):
        cu.cuMemcpyDtoD_v2(b, a, ctypes.c_size_t(size))
        iters += 1
    cu.cuCtxSynchronize()
    dt = time.perf_counter() - t0
    cu.cuMemFree_v2(a)
    cu.cuMemFree_v2(b)
    return 2.0 * size * iters / dt / 1e9


if __name__ == "__main__":
    sys.exit(main())
