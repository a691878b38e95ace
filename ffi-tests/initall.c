/*
 * ffi-tests/initall.c: one process drives NDEV ranks (ncclCommInitAll) from one thread with
 * grouped collectives, as single-process NCCL programs do; and a config struct from an older
 * header (shorter `size`) is read only up to its size.
 */
#include "harness.h"
#include <stddef.h>
#include <string.h>

int main(int argc, char **argv) {
  (void)launch; /* this program is one process: no launcher */
  int ndev = argc > 1 ? atoi(argv[1]) : 4;
  ncclComm_t comms[16];
  if (ndev < 1 || ndev > 16) return 2;
  CHECK(ncclCommInitAll(comms, ndev, NULL));
  enum { N = 1000 };
  static double send[16][N], recv[16][N];
  for (int d = 0; d < ndev; d++) {
    int r = -1;
    CHECK(ncclCommUserRank(comms[d], &r));
    if (r != d) { fprintf(stderr, "comm %d has rank %d\n", d, r); return 1; }
    for (int i = 0; i < N; i++) send[d][i] = d * 0.25 + i;
  }
  CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; d++) CHECK(ncclAllReduce(send[d], recv[d], N, ncclDouble, ncclMax, comms[d], NULL));
  CHECK(ncclGroupEnd());
  for (int d = 0; d < ndev; d++)
    for (int i = 0; i < N; i++) {
      double want = send[0][i];
      for (int q = 1; q < ndev; q++) want = send[q][i] > want ? send[q][i] : want;
      if (recv[d][i] != want) { fprintf(stderr, "rank %d [%d] = %g, want %g\n", d, i, recv[d][i], want); return 1; }
    }
  /* PreMulSum on every rank of the group: sum_d (d + 2) * x_d. */
  ncclRedOp_t ops[16];
  float fs[16][8], fr[16][8], scal[16];
  for (int d = 0; d < ndev; d++) {
    scal[d] = (float)(d + 2);
    for (int i = 0; i < 8; i++) fs[d][i] = (float)(i - d);
    CHECK(ncclRedOpCreatePreMulSum(&ops[d], &scal[d], ncclFloat, ncclScalarHostImmediate, comms[d]));
  }
  CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; d++) CHECK(ncclAllReduce(fs[d], fr[d], 8, ncclFloat, ops[d], comms[d], NULL));
  CHECK(ncclGroupEnd());
  for (int d = 0; d < ndev; d++)
    for (int i = 0; i < 8; i++) {
      double want = 0;
      for (int q = 0; q < ndev; q++) want += (q + 2.0) * (i - q);
      if (fr[d][i] != (float)want) { fprintf(stderr, "premul rank %d [%d] = %g, want %g\n", d, i, fr[d][i], want); return 1; }
    }
  for (int d = 0; d < ndev; d++) {
    CHECK(ncclRedOpDestroy(ops[d], comms[d]));
    CHECK(ncclCommDestroy(comms[d]));
  }
  /* An older caller's config: only the fields up to `blocking` exist; the rest of our struct
   * is garbage here and must not be read. One rank, so init completes alone. */
  ncclConfig_t old;
  memset(&old, 0x5a, sizeof old);
  ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
  memcpy(&old, &init, offsetof(ncclConfig_t, cgaClusterSize));
  old.size = offsetof(ncclConfig_t, cgaClusterSize);
  old.blocking = 1;
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  ncclComm_t one;
  CHECK(ncclCommInitRankConfig(&one, 1, id, 0, &old));
  CHECK(ncclCommDestroy(one));
  printf("initall: %d ranks, ok\n", ndev);
  return 0;
}
