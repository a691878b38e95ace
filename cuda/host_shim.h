// Host build of cuda/reduce.cu for CPU tests (force-included with `-include cuda/host_shim.h`).
//
// CUDA qualifiers become plain C++; blockIdx/threadIdx/blockDim/gridDim are globals set by
// oxccl_host_set_thread() before each simulated thread runs a kernel body (thread-local, so
// tests may simulate launches concurrently). The kernels have no shared memory or barriers,
// so running the threads one after another is exact.
//
// Two users: tests/device_kernels_host.rs (kernels are extern "C", looked up with dlsym) and the
// CUDA stand-in's NVRTC (cuda-standin/, which defines OXCCL_STANDIN): there the kernels keep C++
// linkage, so their mangled names carry the parameter types the stand-in launch needs.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <sched.h>

#define OXCCL_HOST_TEST 1
#define OX_DEV inline
#ifdef OXCCL_STANDIN
#define OX_GLOBAL __attribute__((visibility("default")))
#else
#define OX_GLOBAL extern "C" __attribute__((visibility("default")))
#endif
typedef uintptr_t ox_uptr;
#define ox_fence_system() std::atomic_thread_fence(std::memory_order_seq_cst)
// An LL wait (cuda/reduce.cu) yields its CPU between polls (the peer's simulated thread must
// run) and looks at its stop word every time.
#define ox_pause() sched_yield()
#define OX_STOP_EVERY 1u

struct OxDim {
  unsigned int x;
};
static thread_local OxDim blockIdx, threadIdx, blockDim, gridDim;  // per test thread

extern "C" __attribute__((visibility("default"))) void oxccl_host_set_thread(unsigned int block, unsigned int thread,
                                                                              unsigned int block_dim, unsigned int grid_dim) {
  blockIdx.x = block;
  threadIdx.x = thread;
  blockDim.x = block_dim;
  gridDim.x = grid_dim;
}
