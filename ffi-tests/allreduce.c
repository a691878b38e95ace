/*
 * ffi-tests/allreduce.c: a C program written against NCCL's API only (#include <nccl.h>).
 *
 * Usage: allreduce NRANKS
 * The parent calls ncclGetUniqueId, then starts NRANKS copies of itself (fork + exec) that
 * each join with ncclCommInitRank and run all-reduces (several types and ops, in place and
 * out of place), checking every element against a reference computed here. Exit status 0
 * means every rank saw correct results.
 */
#include "harness.h" /* nccl.h, CHECK, launch */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static double value(int rank, size_t i) { return (double)((int)((i * 7 + (size_t)rank * 13) % 11) - 5); }

static int check_float_sum(ncclComm_t comm, int nranks, size_t count, int inplace) {
  float *send = malloc(count * sizeof(float)), *recv = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) send[i] = (float)value(g_rank, i);
  if (inplace) memcpy(recv, send, count * sizeof(float));
  CHECK(ncclAllReduce(inplace ? (const void *)recv : send, recv, count, ncclFloat, ncclSum, comm, NULL));
  int wrong = 0;
  for (size_t i = 0; i < count; i++) {
    double want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    if (recv[i] != (float)want) wrong++;
  }
  free(send);
  free(recv);
  return wrong;
}

static int check_int32_max(ncclComm_t comm, int nranks, size_t count) {
  int32_t *send = malloc(count * sizeof(int32_t)), *recv = malloc(count * sizeof(int32_t));
  for (size_t i = 0; i < count; i++) send[i] = (int32_t)value(g_rank, i) * 1000;
  CHECK(ncclAllReduce(send, recv, count, ncclInt32, ncclMax, comm, NULL));
  int wrong = 0;
  for (size_t i = 0; i < count; i++) {
    int32_t want = INT32_MIN;
    for (int r = 0; r < nranks; r++) {
      int32_t v = (int32_t)value(r, i) * 1000;
      if (v > want) want = v;
    }
    if (recv[i] != want) wrong++;
  }
  free(send);
  free(recv);
  return wrong;
}

static int check_double_avg(ncclComm_t comm, int nranks, size_t count) {
  double *buf = malloc(count * sizeof(double));
  for (size_t i = 0; i < count; i++) buf[i] = value(g_rank, i);
  CHECK(ncclAllReduce(buf, buf, count, ncclDouble, ncclAvg, comm, NULL));
  int wrong = 0;
  for (size_t i = 0; i < count; i++) {
    double want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    want /= nranks;
    double d = buf[i] - want;
    if (d > 1e-12 || d < -1e-12) wrong++;
  }
  free(buf);
  return wrong;
}

static int run_rank(int nranks, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int n = -1, me = -1, dev = 0, version = 0;
  CHECK(ncclCommCount(comm, &n));
  CHECK(ncclCommUserRank(comm, &me));
  CHECK(ncclCommCuDevice(comm, &dev));
  CHECK(ncclGetVersion(&version));
  if (n != nranks || me != rank || version != NCCL_VERSION_CODE) {
    fprintf(stderr, "rank %d: count %d rank %d version %d (want %d)\n", rank, n, me, version, NCCL_VERSION_CODE);
    return 1;
  }
  size_t counts[] = {0, 1, 7, (size_t)nranks + 3, 1000003};
  int wrong = 0;
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    wrong += check_float_sum(comm, nranks, counts[c], 0);
    wrong += check_float_sum(comm, nranks, counts[c], 1);
    wrong += check_int32_max(comm, nranks, counts[c]);
    wrong += check_double_avg(comm, nranks, counts[c]);
  }
  /* A bad data type is rejected with ncclInvalidArgument and a message, and the
     communicator still works afterwards. */
  float x = 1;
  ncclResult_t bad = ncclAllReduce(&x, &x, 1, (ncclDataType_t)99, ncclSum, comm, NULL);
  if (bad != ncclInvalidArgument || strstr(ncclGetLastError(NULL), "data type") == NULL) {
    fprintf(stderr, "rank %d: bad type gave %d (%s)\n", rank, (int)bad, ncclGetLastError(NULL));
    return 1;
  }
  wrong += check_float_sum(comm, nranks, 5, 0);
  CHECK(ncclCommDestroy(comm));
  if (wrong) fprintf(stderr, "rank %d: %d wrong elements\n", rank, wrong);
  return wrong ? 1 : 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "allreduce", run_rank); }
