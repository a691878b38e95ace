// libcuda.so.1 stand-in: a CPU model of the CUDA driver API entry points oxccl resolves.
//
// Device memory is a memfd mapped into the process (the CUdeviceptr is the mapping's address);
// each stream is served by a worker thread (or several streams share one, OXCCL_STANDIN_WORKERS);
// kernels are the project's cuda/*.cu compiled as host C++ by the stand-in NVRTC and run thread
// by thread on the worker; stream capture records operations into graphs (graph.inc). IPC
// handles carry (pid, memfd number); another process maps /proc/<pid>/fd/<n> at a new address.
// See README.md for knobs and limits.
#define _GNU_SOURCE
#include "standin.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAXDEV 8
#define CTX_MAGIC 0x43545831u
#define STREAM_MAGIC 0x53545231u
#define EVENT_MAGIC 0x45564e31u
#define FUNC_MAGIC 0x46554e31u
#define IPC_MAGIC 0x49504331u

// ---------------------------------------------------------------------------------------------
// Knobs and diagnostics.
// ---------------------------------------------------------------------------------------------

static long knob(const char* name, long dflt) {
  const char* v = getenv(name);
  return (v && *v) ? strtol(v, NULL, 0) : dflt;
}

static void say(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cuda-standin[%d]: %s\n", (int)getpid(), buf);
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int g_init;
static int g_ndev = 1;
static long g_wait_ms;     // bound of every device-side wait before it is reported as a deadlock
static long g_jitter_us;   // random delay before each stream operation
static long g_fail_copy;   // the n-th copy enqueue fails (1-based), 0 = never
static long g_no_memop64;  // 64-bit stream memory operations unsupported (attribute 122 is 0)
static long g_connections;  // CUDA_DEVICE_MAX_CONNECTIONS: hardware queues per device (0: one per stream)
static long g_corrupt_copy;  // the n-th copy flips its first byte
static long g_workers;     // streams share this many workers (0: one worker per stream)
static long g_pageable_ms;  // a synchronous pageable upload or device memset lands this late (-1: before return)
static long g_serial_kernels;  // kernels run as one thread (OXCCL_STANDIN_SERIAL_KERNELS)
static _Atomic long g_copies;
// Counters read by tests through oxccl_standin_count(): stream operations enqueued, by kind
// (indexes of the OP_* kinds in stream.inc), and driver queries of pointer attributes.
static _Atomic uint64_t g_enqueued[16];
static _Atomic uint64_t g_attr_queries;
static _Atomic uint64_t g_range_queries;
static _Atomic uint64_t g_recorded;  // operations recorded into graphs by stream capture (graph.inc)
static _Atomic uint64_t g_graph_launches;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;  // completions, registry, events
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

// ---------------------------------------------------------------------------------------------
// Contexts: one primary context per device; a per-thread stack of current contexts.
// ---------------------------------------------------------------------------------------------

struct SiStream;
struct SiCtx {
  uint32_t magic;
  int dev;
  int retained;
  struct SiStream* null_stream;
  struct SiStream* blocking;  // the context's blocking streams, newest first (g_mu; destroyed ones kept)
  struct SiStream* capturing;  // the context's streams in stream capture (g_mu; graph.inc)
};
static struct SiCtx g_ctx[MAXDEV];
static __thread struct SiCtx* t_stack[32];
static __thread int t_depth;

static struct SiCtx* current(void) { return t_depth > 0 ? t_stack[t_depth - 1] : NULL; }

#define NEED_INIT() \
  if (!g_init) return CUDA_ERROR_NOT_INITIALIZED

// A potentially unsafe call during stream capture (graph.inc: the capture interaction modes):
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the captures that forbid it are invalidated.
static CUresult capture_unsafe(const char* what);
#define UNSAFE(what)                       \
  do {                                     \
    CUresult unsafe_ = capture_unsafe(what); \
    if (unsafe_) return unsafe_;           \
  } while (0)
#define NEED_CTX(c)                                    \
  NEED_INIT();                                         \
  struct SiCtx* c = current();                         \
  if (!c || c->magic != CTX_MAGIC || !c->retained) return CUDA_ERROR_INVALID_CONTEXT

EXPORT CUresult cuInit(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  if (!g_init) {
    g_ndev = (int)knob("OXCCL_STANDIN_DEVICES", 1);
    if (g_ndev > MAXDEV) g_ndev = MAXDEV;
    g_wait_ms = knob("OXCCL_STANDIN_WAIT_MS", 60000);
    g_jitter_us = knob("OXCCL_STANDIN_JITTER_US", 0);
    g_fail_copy = knob("OXCCL_STANDIN_FAIL_COPY", 0);
    g_no_memop64 = knob("OXCCL_STANDIN_NO_MEMOP64", 0);
    g_connections = knob("CUDA_DEVICE_MAX_CONNECTIONS", 0);
    g_corrupt_copy = knob("OXCCL_STANDIN_CORRUPT_COPY", 0);
    g_workers = knob("OXCCL_STANDIN_WORKERS", 0);
    g_pageable_ms = knob("OXCCL_STANDIN_PAGEABLE_DELAY_MS", 20);
    g_serial_kernels = knob("OXCCL_STANDIN_SERIAL_KERNELS", 0);
    for (int i = 0; i < MAXDEV; i++) g_ctx[i] = (struct SiCtx){.magic = CTX_MAGIC, .dev = i};
    g_init = 1;
  }
  pthread_mutex_unlock(&g_mu);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDriverGetVersion(int* v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  *v = (int)knob("OXCCL_STANDIN_DRIVER_VERSION", 13000);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int* n) {
  NEED_INIT();
  if (!n) return CUDA_ERROR_INVALID_VALUE;
  *n = g_ndev;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  NEED_INIT();
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  NEED_INIT();
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, (size_t)len, "oxccl CUDA stand-in (CPU) %d", d);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
  NEED_INIT();
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = (size_t)8 << 30;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
  NEED_INIT();
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  long cc = knob("OXCCL_STANDIN_CC", 90);
  switch (attr) {
    case 1: *v = 1024; break;                          // max threads per block
    case 16: *v = (int)knob("OXCCL_STANDIN_SMS", 2); break;  // multiprocessors
    case 41: *v = 1; break;                            // unified addressing
    case 75: *v = (int)(cc / 10); break;               // compute capability major
    case 76: *v = (int)(cc % 10); break;               // minor
    case 92: *v = 1; break;                            // stream memory operations
    case 122: *v = !g_no_memop64; break;               // 64-bit stream memory operations
    case 33: *v = d + 1; break;                        // PCI bus id: one per simulated GPU
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
// Peer access: every pair of simulated GPUs can reach each other (host memory) unless
// OXCCL_STANDIN_NO_P2P=1. Enabling is tracked per (context, peer) like the driver's, which
// reports a second enable as CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (704); kernels are not
// checked against it (any simulated device memory is addressable).
static unsigned char g_peer[MAXDEV][MAXDEV];
EXPORT CUresult cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
  NEED_INIT();
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= g_ndev || peer < 0 || peer >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *can = d != peer && !knob("OXCCL_STANDIN_NO_P2P", 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  NEED_CTX(c);
  struct SiCtx* p = (struct SiCtx*)peer;
  if (flags || !p || p->magic != CTX_MAGIC || p == c) return CUDA_ERROR_INVALID_VALUE;
  if (knob("OXCCL_STANDIN_NO_P2P", 0)) return 217;  // CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
  pthread_mutex_lock(&g_mu);
  int again = g_peer[c->dev][p->dev];
  g_peer[c->dev][p->dev] = 1;
  pthread_mutex_unlock(&g_mu);
  return again ? 704 : CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  NEED_INIT();
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_mu);
  g_ctx[d].retained++;
  pthread_mutex_unlock(&g_mu);
  *c = &g_ctx[d];
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  NEED_INIT();
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_mu);
  if (g_ctx[d].retained > 0) g_ctx[d].retained--;
  pthread_mutex_unlock(&g_mu);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned* flags, int* active) {
  NEED_INIT();
  if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  if (flags) *flags = 0;
  if (active) *active = g_ctx[d].retained > 0;
  return CUDA_SUCCESS;
}
static int valid_ctx(struct SiCtx* c) { return c && c->magic == CTX_MAGIC; }
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c) {
  NEED_INIT();
  if (!valid_ctx(c) || !c->retained) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_depth >= 32) return CUDA_ERROR_INVALID_VALUE;
  t_stack[t_depth++] = c;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* c) {
  NEED_INIT();
  if (t_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  t_depth--;
  if (c) *c = t_stack[t_depth];
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
  NEED_INIT();
  if (c == NULL) {
    if (t_depth > 0) t_depth--;
    return CUDA_SUCCESS;
  }
  if (!valid_ctx(c) || !c->retained) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_depth == 0) t_depth = 1;
  t_stack[t_depth - 1] = c;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext* c) {
  NEED_INIT();
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  *c = current();
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
  NEED_CTX(c);
  *d = c->dev;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Memory registry: every range the "GPU" can address.
// ---------------------------------------------------------------------------------------------

enum { K_DEVICE = 1, K_HOST = 2, K_MANAGED = 3, K_IPC = 4, K_REGISTERED = 5, K_VMM = 6, K_POOL = 7 };
struct SiPhys;
struct SiPool;
struct Alloc {
  uintptr_t base;
  size_t len, maplen;
  int kind, dev, fd;
  struct Alloc* next;
  uint64_t serial;  // unique per allocation of the process: IPC handles of two allocations differ
  struct SiPhys* phys;  // K_VMM: the physical allocation mapped here (vmm.inc)
  struct SiPool* pool;  // K_POOL: the memory pool (own or imported) it lies in (pool.inc)
  size_t off;           // K_POOL: its offset in the pool
};
static uint64_t g_serial;
static struct Alloc* g_allocs;

// The allocation containing [p, p+len) (g_mu held), or NULL.
static struct Alloc* find_locked(uintptr_t p, size_t len) {
  for (struct Alloc* a = g_allocs; a; a = a->next)
    if (p >= a->base && p - a->base <= a->len && len <= a->len - (p - a->base)) return a;
  return NULL;
}
static int vmm_covered_locked(uintptr_t p, size_t len);
// The kind (K_*) of the allocation containing [p, p+len), or 0 when none does (K_VMM for a
// range over adjacent VMM mappings).
static int kind_of(uintptr_t p, size_t len) {
  pthread_mutex_lock(&g_mu);
  struct Alloc* a = find_locked(p, len ? len : 1);
  int k = a ? a->kind : vmm_covered_locked(p, len ? len : 1) ? K_VMM : 0;
  pthread_mutex_unlock(&g_mu);
  return k;
}
static CUresult legacy_wait(int dev);
static int known(uintptr_t p, size_t len) { return kind_of(p, len) != 0; }
static void add_alloc(uintptr_t base, size_t len, size_t maplen, int kind, int dev, int fd) {
  struct Alloc* a = calloc(1, sizeof *a);
  *a = (struct Alloc){base, len, maplen, kind, dev, fd, NULL, 0, NULL, NULL, 0};
  pthread_mutex_lock(&g_mu);
  a->serial = ++g_serial;
  a->next = g_allocs;
  g_allocs = a;
  pthread_mutex_unlock(&g_mu);
}
// Removes the allocation starting exactly at `base` of one of the kinds in `kinds` (bitmask).
static struct Alloc* take_alloc(uintptr_t base, int kinds) {
  pthread_mutex_lock(&g_mu);
  struct Alloc** pp = &g_allocs;
  while (*pp && !((*pp)->base == base && (kinds & (1 << (*pp)->kind)))) pp = &(*pp)->next;
  struct Alloc* a = *pp;
  if (a) *pp = a->next;
  pthread_mutex_unlock(&g_mu);
  return a;
}

static size_t page_round(size_t n) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return (n + pg - 1) / pg * pg;
}

static CUresult dev_alloc(CUdeviceptr* out, size_t len, int kind, int dev) {
  if (!out || len == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t maplen = page_round(len);
  int fd = memfd_create("oxccl-standin-device", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)maplen) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void* p = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // Uninitialised device memory is garbage, never conveniently zero.
  if (knob("OXCCL_STANDIN_POISON", 1)) memset(p, 0xA5, len);
  add_alloc((uintptr_t)p, len, maplen, kind, dev, fd);
  *out = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

// Stream-ordered pools (pool.inc): whether `p` is a pool allocation, and its free (on `h`'s
// stream order, or at once after the legacy stream when `h` is NULL).
static int pool_owns(CUdeviceptr p);
static CUresult pool_free(CUdeviceptr p, CUstream h);

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t len) {
  NEED_CTX(c);
  UNSAFE("cuMemAlloc");
  return dev_alloc(p, len, K_DEVICE, c->dev);
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr* p, size_t len, unsigned flags) {
  (void)flags;
  NEED_CTX(c);
  UNSAFE("cuMemAllocManaged");
  return dev_alloc(p, len, K_MANAGED, c->dev);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  NEED_CTX(c);
  UNSAFE("cuMemFree");
  (void)c;
  if (p == 0) return CUDA_SUCCESS;
  if (pool_owns(p)) return pool_free(p, NULL);
  struct Alloc* a = take_alloc((uintptr_t)p, (1 << K_DEVICE) | (1 << K_MANAGED));
  if (!a) {
    say("cuMemFree(0x%llx): not a live allocation (double free?)", (unsigned long long)p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  // As the real cuMemFree, which synchronises: a deferred upload into it must not land after.
  legacy_wait(a->dev);
  munmap((void*)a->base, a->maplen);
  close(a->fd);
  free(a);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostAlloc(void** p, size_t len, unsigned flags) {
  (void)flags;
  NEED_CTX(c);
  UNSAFE("cuMemHostAlloc");
  CUdeviceptr d;
  CUresult r = dev_alloc(&d, len, K_HOST, c->dev);
  if (r == CUDA_SUCCESS) *p = (void*)(uintptr_t)d;
  return r;
}
EXPORT CUresult cuMemAllocHost_v2(void** p, size_t len) { return cuMemHostAlloc(p, len, 0); }
EXPORT CUresult cuMemFreeHost(void* p) {
  NEED_CTX(c);
  UNSAFE("cuMemFreeHost");
  (void)c;
  struct Alloc* a = take_alloc((uintptr_t)p, 1 << K_HOST);
  if (!a) return CUDA_ERROR_INVALID_VALUE;
  munmap((void*)a->base, a->maplen);
  close(a->fd);
  free(a);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostRegister_v2(void* p, size_t len, unsigned flags) {
  (void)flags;
  NEED_CTX(c);
  UNSAFE("cuMemHostRegister");
  if (!p || !len) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  int dup = find_locked((uintptr_t)p, 1) != NULL;
  pthread_mutex_unlock(&g_mu);
  if (dup) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  add_alloc((uintptr_t)p, len, 0, K_REGISTERED, c->dev, -1);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostUnregister(void* p) {
  NEED_CTX(c);
  UNSAFE("cuMemHostUnregister");
  (void)c;
  struct Alloc* a = take_alloc((uintptr_t)p, 1 << K_REGISTERED);
  if (!a) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  free(a);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
  NEED_CTX(c);
  (void)c;
  if (!d || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  struct Alloc* a = find_locked((uintptr_t)p, 1);
  int ok = a && (a->kind == K_HOST || a->kind == K_REGISTERED);
  pthread_mutex_unlock(&g_mu);
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  *d = (CUdeviceptr)(uintptr_t)p;  // unified addressing: the same address
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total) {
  NEED_CTX(c);
  (void)c;
  if (free_b) *free_b = (size_t)7 << 30;
  if (total) *total = (size_t)8 << 30;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
  NEED_INIT();
  atomic_fetch_add(&g_attr_queries, 1);
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  struct Alloc* a = find_locked((uintptr_t)p, 1);
  struct Alloc copy = a ? *a : (struct Alloc){0};
  pthread_mutex_unlock(&g_mu);
  if (!a) return CUDA_ERROR_INVALID_VALUE;
  int host = copy.kind == K_HOST || copy.kind == K_REGISTERED;
  switch (attr) {
    case 1: *(CUcontext*)data = &g_ctx[copy.dev]; break;                 // CONTEXT
    case 2: *(unsigned*)data = host ? 1u : 2u; break;                     // MEMORY_TYPE
    case 3: *(CUdeviceptr*)data = p; break;                               // DEVICE_POINTER
    case 4:                                                               // HOST_POINTER
      if (!host && copy.kind != K_MANAGED) return CUDA_ERROR_INVALID_VALUE;
      *(void**)data = (void*)(uintptr_t)p;
      break;
    case 8: *(unsigned*)data = copy.kind == K_MANAGED; break;             // IS_MANAGED
    case 9: *(int*)data = copy.dev; break;                                // DEVICE_ORDINAL
    case 11: *(CUdeviceptr*)data = copy.base; break;                      // RANGE_START_ADDR
    case 12: *(size_t*)data = copy.len; break;                            // RANGE_SIZE
    case 17: *(struct SiPool**)data = copy.kind == K_POOL ? copy.pool : NULL; break;  // MEMPOOL_HANDLE
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

// The allocation holding `p`, as the driver answers for memory it allocated on a device (device,
// managed, opened IPC memory, or one VMM mapping); pinned host memory and unknown addresses are CUDA_ERROR_NOT_FOUND.
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  NEED_CTX(c);
  (void)c;
  atomic_fetch_add(&g_range_queries, 1);
  pthread_mutex_lock(&g_mu);
  struct Alloc* a = find_locked((uintptr_t)p, 1);
  struct Alloc copy = a ? *a : (struct Alloc){0};
  pthread_mutex_unlock(&g_mu);
  if (!a || !(copy.kind == K_DEVICE || copy.kind == K_MANAGED || copy.kind == K_IPC || copy.kind == K_VMM ||
             copy.kind == K_POOL))
    return CUDA_ERROR_NOT_FOUND;
  if (base) *base = copy.base;
  if (size) *size = copy.len;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// IPC: the handle names the exporter's memfd; another process maps it at a new address.
// ---------------------------------------------------------------------------------------------

struct IpcWire {
  uint32_t magic;
  int32_t pid, fd, dev;
  uint64_t len, maplen, base, serial;
};

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  NEED_CTX(c);
  (void)c;
  if (!h) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  struct Alloc* a = find_locked((uintptr_t)p, 1);
  struct Alloc copy = a ? *a : (struct Alloc){0};
  pthread_mutex_unlock(&g_mu);
  if (!a || copy.kind != K_DEVICE || copy.base != (uintptr_t)p) return CUDA_ERROR_INVALID_VALUE;
  // As the real driver's, the handle names the allocation, not its address: a range freed and
  // allocated again at the same base (and fd) gets another handle.
  struct IpcWire w = {IPC_MAGIC, getpid(), copy.fd, copy.dev, copy.len, copy.maplen, copy.base, copy.serial};
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, &w, sizeof w);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  NEED_CTX(c);
  UNSAFE("cuIpcOpenMemHandle");
  struct IpcWire w;
  memcpy(&w, h.reserved, sizeof w);
  if (!out || w.magic != IPC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  // As the real driver: a process cannot open its own export.
  if (w.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  // Another GPU's export: the driver maps it when told to enable peer access on the way
  // (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, 1) and the two GPUs have it.
  if (w.dev != c->dev && !(flags & 1u)) return CUDA_ERROR_INVALID_DEVICE;
  if (w.dev != c->dev && knob("OXCCL_STANDIN_NO_P2P", 0)) return 217;  // CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;  // exporter gone or memory freed
  void* p = mmap(NULL, w.maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p != MAP_FAILED && (uintptr_t)p == w.base) {
    // Never the exporter's address: code that mixes the two must fail here too.
    void* q = mmap(NULL, w.maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    munmap(p, w.maplen);
    p = q;
  }
  close(fd);
  if (p == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
  add_alloc((uintptr_t)p, w.len, w.maplen, K_IPC, c->dev, -1);
  *out = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  return cuIpcOpenMemHandle_v2(out, h, flags);
}
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  NEED_CTX(c);
  UNSAFE("cuIpcCloseMemHandle");
  (void)c;
  struct Alloc* a = take_alloc((uintptr_t)p, 1 << K_IPC);
  if (!a) return CUDA_ERROR_INVALID_VALUE;
  munmap((void*)a->base, a->maplen);
  free(a);
  return CUDA_SUCCESS;
}

#include "stream.inc"
#include "graph.inc"
#include "vmm.inc"
#include "pool.inc"
