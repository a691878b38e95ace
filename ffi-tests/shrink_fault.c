/*
 * ffi-tests/shrink_fault.c: ncclCommShrink after a rank died, through the C API.
 *
 * 4 ranks all-reduce in a loop; rank 2 kills itself with SIGKILL before its 4th call. The
 * survivors get an error (and ncclCommGetAsyncError reports it), shrink the failed parent with
 * NCCL_SHRINK_ABORT through a nonblocking config (polling ncclCommGetAsyncError), check the
 * child's size and ranks, and all-reduce doubles on it against a reference computed here.
 */
#include "harness.h"

#include <string.h>
#include <time.h>

#define VICTIM 2
#define COUNT (1 << 16)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double input(int r, int i) { return (double)((i * 5 + r * 11) % 23) / 4.0 - 2.5; }

static int rank_main(int n, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  static double send[COUNT], recv[COUNT];
  for (int i = 0; i < COUNT; i++) send[i] = input(rank, i);
  ncclResult_t res = ncclSuccess;
  double t0 = now();
  for (int it = 0; res == ncclSuccess; it++) {
    if (rank == VICTIM && it == 3) kill(getpid(), SIGKILL);
    if (now() - t0 > 30.0) FAIL("no failure after 30 s");
    res = ncclAllReduce(send, recv, COUNT, ncclDouble, ncclSum, comm, NULL);
  }
  ncclResult_t async = ncclSuccess;
  CHECK(ncclCommGetAsyncError(comm, &async));
  if (async == ncclSuccess) FAIL("the parent reports no error after a failed all-reduce (%d)", (int)res);

  int ex = VICTIM;
  ncclComm_t child = NULL;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  res = ncclCommShrink(comm, &ex, 1, &child, &cfg, NCCL_SHRINK_ABORT);
  if (res != ncclSuccess && res != ncclInProgress) FAIL("shrink: %d: %s", (int)res, ncclGetLastError(NULL));
  do {
    CHECK(ncclCommGetAsyncError(child, &async));
    if (now() - t0 > 60.0) FAIL("shrink still in progress after 60 s");
  } while (async == ncclInProgress);
  if (async != ncclSuccess) FAIL("shrink failed: %d: %s", (int)async, ncclGetLastError(NULL));

  int cn = 0, cr = -1;
  CHECK(ncclCommCount(child, &cn));
  CHECK(ncclCommUserRank(child, &cr));
  if (cn != n - 1 || cr != (rank < VICTIM ? rank : rank - 1)) FAIL("child: count %d rank %d", cn, cr);
  CHECK(ncclAllReduce(send, recv, COUNT, ncclDouble, ncclSum, child, NULL));
  for (int i = 0; i < COUNT; i++) {
    double want = 0;
    for (int r = 0; r < n; r++)
      if (r != VICTIM) want += input(r, i);
    if (recv[i] != want) FAIL("child all-reduce at %d: %g, want %g", i, recv[i], want);
  }
  CHECK(ncclCommDestroy(child));
  CHECK(ncclCommDestroy(comm));
  return 0;
}

int main(int argc, char **argv) {
  g_victim = VICTIM;
  return launch(argc, argv, "shrink_fault", rank_main);
}
