// Shared declarations of the CUDA stand-in (test support only; never linked into liboxccl).
//
// The stand-in is a CPU model of the parts of the CUDA driver API that oxccl and its tests use.
// See cuda-standin/README.md for what it models and what it cannot catch.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef struct SiCtx* CUcontext;
typedef struct SiStream* CUstream;
typedef struct SiEvent* CUevent;
typedef struct SiModule* CUmodule;
typedef struct SiFunc* CUfunction;
typedef struct SiGraph* CUgraph;
typedef struct SiGraphExec* CUgraphExec;
typedef struct SiGraphNode* CUgraphNode;  // never handed out: graphs expose no nodes here
typedef struct {
  char reserved[64];
} CUipcMemHandle;
typedef void (*CUhostFn)(void* userData);

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_MAP_FAILED = 205,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_FILE_NOT_FOUND = 301,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_TIMEOUT = 702,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_MERGE = 902,
  CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
  CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904,
  CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
  CUDA_ERROR_UNKNOWN = 999,
};

// Image produced by the stand-in NVRTC and accepted by the stand-in cuModuleLoadData:
//   "OXSTANDIN-IMAGE 1 <cubin|ptx> <arch>\n<path of the .so>\n" then "<name> <mangled> <sig>\n"
//   per kernel, NUL-terminated. <sig> has one letter per parameter: b/h/w/q = 1/2/4/8-byte
//   integer or pointer, f = float, d = double.
#define SI_IMAGE_MAGIC "OXSTANDIN-IMAGE 1 "
