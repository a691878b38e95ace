/*
 * ffi-tests/grow.c: ncclCommGetUniqueId + ncclCommGrow through the C API.
 *
 * Run with 4 processes: ranks 0 and 1 form a 2-rank communicator; rank 0 makes the grow id
 * with ncclCommGetUniqueId and hands it to ranks 2 and 3 out of band (a file named after the
 * launcher's pid). Existing ranks grow with rank = -1 (rank 0 passes the id, rank 1 NULL);
 * joining ranks pass comm = NULL and a nonblocking config, polling ncclCommGetAsyncError.
 * The grown communicator all-reduces ints, checked against a sum computed here; the parent
 * stays usable.
 */
#include "harness.h"

#include <string.h>
#include <time.h>

#define OLD 2
#define COUNT 4099

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int input(int r, int i) { return (i * 7 + r * 3) % 101 - 50; }

static void check_sum(const int *recv, int ranks, const char *what) {
  for (int i = 0; i < COUNT; i++) {
    int want = 0;
    for (int r = 0; r < ranks; r++) want += input(r, i);
    if (recv[i] != want) FAIL("%s at %d: %d, want %d", what, i, recv[i], want);
  }
}

static int rank_main(int n, int rank, ncclUniqueId id) {
  char path[64], tmp[72];
  snprintf(path, sizeof path, "/tmp/oxccl-grow-%d.id", (int)getppid());
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  static int send[COUNT], recv[COUNT];
  for (int i = 0; i < COUNT; i++) send[i] = input(rank, i);
  ncclComm_t parent = NULL, grown = NULL;
  if (rank < OLD) {
    CHECK(ncclCommInitRank(&parent, OLD, id, rank));
    ncclComm_t bad;
    if (ncclCommGrow(parent, n, NULL, rank, &bad, NULL) != ncclInvalidArgument) FAIL("grow with rank != -1 accepted");
    ncclUniqueId gid;
    if (rank == 0) {
      CHECK(ncclCommGetUniqueId(parent, &gid));
      FILE *f = fopen(tmp, "wb");
      if (!f || fwrite(&gid, sizeof gid, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) FAIL("publish the grow id");
    }
    CHECK(ncclCommGrow(parent, n, rank == 0 ? &gid : NULL, -1, &grown, NULL));
  } else {
    ncclComm_t bad;
    if (ncclCommGrow(NULL, n, NULL, rank, &bad, NULL) != ncclInvalidArgument) FAIL("joining without an id accepted");
    ncclUniqueId gid;
    double t0 = now();
    FILE *f;
    while (!(f = fopen(path, "rb"))) {
      if (now() - t0 > 30.0) FAIL("no grow id after 30 s");
      usleep(10000);
    }
    if (fread(&gid, sizeof gid, 1, f) != 1) FAIL("read the grow id");
    fclose(f);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t res = ncclCommGrow(NULL, n, &gid, rank, &grown, &cfg);
    if (res != ncclSuccess && res != ncclInProgress) FAIL("grow: %d: %s", (int)res, ncclGetLastError(NULL));
    ncclResult_t st;
    do {
      CHECK(ncclCommGetAsyncError(grown, &st));
      if (now() - t0 > 60.0) FAIL("grow still in progress after 60 s");
    } while (st == ncclInProgress);
    if (st != ncclSuccess) FAIL("grow failed: %d: %s", (int)st, ncclGetLastError(NULL));
  }
  int gn = 0, gr = -1;
  CHECK(ncclCommCount(grown, &gn));
  CHECK(ncclCommUserRank(grown, &gr));
  if (gn != n || gr != rank) FAIL("grown: count %d rank %d", gn, gr);
  CHECK(ncclAllReduce(send, recv, COUNT, ncclInt32, ncclSum, grown, NULL));
  check_sum(recv, n, "grown all-reduce");
  if (parent) {
    CHECK(ncclAllReduce(send, recv, COUNT, ncclInt32, ncclSum, parent, NULL));
    check_sum(recv, OLD, "parent all-reduce after grow");
    CHECK(ncclCommDestroy(parent));
  }
  if (rank == 0) unlink(path);
  CHECK(ncclCommDestroy(grown));
  return 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "grow", rank_main); }
