// libcudart.so stand-in: the CUDA runtime calls that small C programs use, on top of the
// stand-in driver (each runtime call makes the current device's primary context current).
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "standin.h"

#define EXPORT __attribute__((visibility("default")))

typedef int cudaError_t;
typedef CUstream cudaStream_t;
typedef CUevent cudaEvent_t;
enum { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
struct cudaPointerAttributes {
  int type;  // 0 unregistered, 1 host, 2 device, 3 managed
  int device;
  void* devicePointer;
  void* hostPointer;
};

CUresult cuInit(unsigned);
CUresult cuDeviceGetCount(int*);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemHostAlloc(void**, size_t, unsigned);
CUresult cuMemFreeHost(void*);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpy(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
CUresult cuEventCreate(CUevent*, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventQuery(CUevent);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventElapsedTime(float*, CUevent, CUevent);
CUresult cuPointerGetAttribute(void*, int, CUdeviceptr);
CUresult cuCtxSynchronize(void);

static __thread int t_dev;
static __thread cudaError_t t_last;

static cudaError_t rec(CUresult r) {
  if (r != CUDA_SUCCESS) t_last = r;
  return r;
}
static cudaError_t enter(void) {
  CUresult r = cuInit(0);
  CUcontext c;
  if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&c, t_dev);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(c);
  return rec(r);
}
#define ENTER()                     \
  do {                              \
    cudaError_t e_ = enter();       \
    if (e_ != CUDA_SUCCESS) return e_; \
  } while (0)

EXPORT cudaError_t cudaGetDeviceCount(int* n) {
  CUresult r = cuInit(0);
  return rec(r ? r : cuDeviceGetCount(n));
}
EXPORT cudaError_t cudaSetDevice(int d) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e) return e;
  if (d < 0 || d >= n) return rec(CUDA_ERROR_INVALID_DEVICE);
  t_dev = d;
  return enter();
}
EXPORT cudaError_t cudaGetDevice(int* d) {
  *d = t_dev;
  return CUDA_SUCCESS;
}
EXPORT cudaError_t cudaMalloc(void** p, size_t n) {
  ENTER();
  CUdeviceptr d = 0;
  CUresult r = cuMemAlloc_v2(&d, n);
  if (r == CUDA_SUCCESS) *p = (void*)(uintptr_t)d;
  return rec(r);
}
EXPORT cudaError_t cudaFree(void* p) {
  ENTER();
  return rec(cuMemFree_v2((CUdeviceptr)(uintptr_t)p));
}
EXPORT cudaError_t cudaMallocHost(void** p, size_t n) {
  ENTER();
  return rec(cuMemHostAlloc(p, n, 0));
}
EXPORT cudaError_t cudaFreeHost(void* p) {
  ENTER();
  return rec(cuMemFreeHost(p));
}
EXPORT cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, int kind, cudaStream_t st) {
  (void)kind;  // unified addressing: the stand-in's generic copy handles every direction
  ENTER();
  return rec(cuMemcpyAsync((CUdeviceptr)(uintptr_t)d, (CUdeviceptr)(uintptr_t)s, n, st));
}
// The synchronous forms have the driver's synchronisation (a pageable upload or a memset into
// device memory may land after the call returns, on the legacy stream).
EXPORT cudaError_t cudaMemcpy(void* d, const void* s, size_t n, int kind) {
  (void)kind;
  ENTER();
  return rec(cuMemcpy((CUdeviceptr)(uintptr_t)d, (CUdeviceptr)(uintptr_t)s, n));
}
EXPORT cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t st) {
  ENTER();
  return rec(cuMemsetD8Async((CUdeviceptr)(uintptr_t)d, (unsigned char)v, n, st));
}
EXPORT cudaError_t cudaMemset(void* d, int v, size_t n) {
  ENTER();
  return rec(cuMemsetD8_v2((CUdeviceptr)(uintptr_t)d, (unsigned char)v, n));
}
EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  ENTER();
  return rec(cuStreamCreate(s, flags));
}
EXPORT cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  ENTER();
  return rec(cuStreamSynchronize(s));
}
EXPORT cudaError_t cudaStreamQuery(cudaStream_t s) {
  ENTER();
  return cuStreamQuery(s);
}
EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) {
  ENTER();
  return rec(cuStreamDestroy_v2(s));
}
EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
  ENTER();
  return rec(cuStreamWaitEvent(s, e, f));
}
EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned f) {
  ENTER();
  return rec(cuEventCreate(e, f));
}
EXPORT cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  ENTER();
  return rec(cuEventRecord(e, s));
}
EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  ENTER();
  return rec(cuEventSynchronize(e));
}
EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) {
  ENTER();
  return cuEventQuery(e);
}
EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) {
  ENTER();
  return rec(cuEventDestroy_v2(e));
}
EXPORT cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  ENTER();
  return rec(cuEventElapsedTime(ms, a, b));
}
EXPORT cudaError_t cudaDeviceSynchronize(void) {
  ENTER();
  return rec(cuCtxSynchronize());
}
EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* a, const void* p) {
  ENTER();
  if (!a) return rec(CUDA_ERROR_INVALID_VALUE);
  memset(a, 0, sizeof *a);
  unsigned type = 0, managed = 0;
  int dev = 0;
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
  if (cuPointerGetAttribute(&type, 2, d) != CUDA_SUCCESS) return CUDA_SUCCESS;  // unregistered host memory
  cuPointerGetAttribute(&managed, 8, d);
  cuPointerGetAttribute(&dev, 9, d);
  a->type = managed ? 3 : (int)type;
  a->device = dev;
  a->devicePointer = (void*)p;
  a->hostPointer = type == 1 || managed ? (void*)p : NULL;
  return CUDA_SUCCESS;
}
EXPORT cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last;
  t_last = CUDA_SUCCESS;
  return e;
}
EXPORT cudaError_t cudaPeekAtLastError(void) { return t_last; }
EXPORT const char* cudaGetErrorString(cudaError_t e) {
  static __thread char buf[48];
  snprintf(buf, sizeof buf, e ? "CUDA stand-in error %d" : "no error", e);
  return buf;
}
EXPORT const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
EXPORT cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
EXPORT cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
