/* Minimal stand-in for the CUDA runtime header, for compiling NVIDIA's nccl.h without CUDA. */
#ifndef OXCCL_STUB_CUDA_RUNTIME_H
#define OXCCL_STUB_CUDA_RUNTIME_H
#include <stddef.h>
#include <stdint.h>
#define CUDART_VERSION 12000
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
#endif
