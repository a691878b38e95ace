/*
 * nccl.h for oxccl: code written for NVIDIA NCCL includes this unchanged.
 * Everything is declared in the generated oxccl.h.
 */
#ifndef NCCL_H_
#define NCCL_H_
#include "oxccl.h"
#endif
