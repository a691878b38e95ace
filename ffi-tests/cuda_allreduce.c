/*
 * ffi-tests/cuda_allreduce.c: a C program written against NCCL's API and the CUDA runtime, as a
 * user's would be: device buffers from cudaMalloc, a stream from cudaStreamCreate, ncclAllReduce
 * on that stream, results copied back after cudaStreamSynchronize. Also ncclCommCuDevice and
 * ncclMemAlloc (device memory when CUDA is in use). Run by tests/device_standin.rs on the CUDA
 * stand-in (or a real GPU). Usage: cuda_allreduce NRANKS
 */
#include <cuda_runtime.h>

#include "harness.h"
#include <string.h>

#define CUDA(call)                                                                              \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) FAIL("%s failed: %s (%d)", #call, cudaGetErrorString(e_), (int)e_); \
  } while (0)

static float value(int rank, size_t i) { return (float)((int)((i * 5 + (size_t)rank * 3) % 9) - 4); }

static int rank_main(int nranks, int rank, ncclUniqueId id) {
  CUDA(cudaSetDevice(0));
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int dev = -2;
  CHECK(ncclCommCuDevice(comm, &dev));
  if (dev != 0) FAIL("ncclCommCuDevice: %d, want 0", dev);
  cudaStream_t s;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t n = 12345;
  float *host = malloc(n * sizeof(float)), *dsend, *drecv;
  for (size_t i = 0; i < n; i++) host[i] = value(rank, i);
  CUDA(cudaMalloc((void **)&dsend, n * sizeof(float)));
  CHECK(ncclMemAlloc((void **)&drecv, n * sizeof(float)));
  struct cudaPointerAttributes a;
  CUDA(cudaPointerGetAttributes(&a, drecv));
  if (a.type != cudaMemoryTypeDevice) FAIL("ncclMemAlloc returned memory of type %d, want device", (int)a.type);
  CUDA(cudaMemcpyAsync(dsend, host, n * sizeof(float), cudaMemcpyHostToDevice, s));
  for (int k = 0; k < 3; k++) {
    CHECK(ncclAllReduce(dsend, drecv, n, ncclFloat, ncclSum, comm, s));
    CUDA(cudaMemcpyAsync(dsend, drecv, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
  memset(host, 0, n * sizeof(float));
  CUDA(cudaMemcpyAsync(host, drecv, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA(cudaStreamSynchronize(s));
  int wrong = 0;
  for (size_t i = 0; i < n; i++) {
    double want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    for (int k = 1; k < 3; k++) want *= nranks; /* each later call sums nranks equal copies */
    if (host[i] != (float)want) wrong++;
  }
  if (wrong) FAIL("%d of %zu elements wrong", wrong, n);
  CHECK(ncclMemFree(drecv));
  CUDA(cudaFree(dsend));
  CUDA(cudaStreamDestroy(s));
  CHECK(ncclCommDestroy(comm));
  free(host);
  return 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "cuda_allreduce", rank_main); }
