/*
 * ffi-tests/dropin.c: a program written for NCCL, run unchanged on oxccl (issue [H]).
 * It uses only nccl.h: it compiles against oxccl's include/nccl.h and against NVIDIA's
 * nccl.h (tests/dropin.rs), and links with -loxccl or -lnccl (oxccl's libnccl.so.2).
 *
 * Every rank: nonblocking ncclCommInitRankConfig (polled with ncclCommGetAsyncError), a wrong
 * config magic, AllReduce, PreMulSum (host-immediate and call-time scalars) in AllReduce and
 * ReduceScatter, AllGather, ReduceScatter, Broadcast, grouped Send/Recv ring, Split (with
 * NCCL_SPLIT_NOCOLOR and key ordering), Shrink (last rank excluded), memory/registration
 * calls, an unsupported call, Finalize, GetAsyncError, Abort. Expected values are computed
 * here from the inputs' formulas.
 */
#include "harness.h"
#include <string.h>
#include <time.h>

static void wait_ready(ncclComm_t c) {
  ncclResult_t st;
  for (int i = 0;; i++) {
    CHECK(ncclCommGetAsyncError(c, &st));
    if (st != ncclInProgress) break;
    if (i > 600000) FAIL("nonblocking init never finished");
    usleep(100);
  }
  if (st != ncclSuccess) FAIL("nonblocking init failed: %d %s", (int)st, ncclGetLastError(c));
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void check_ints(const char *what, const int *got, const long *want, int n) {
  for (int i = 0; i < n; i++)
    if ((long)got[i] != want[i]) FAIL("%s[%d] = %d, want %ld", what, i, got[i], want[i]);
}

static int rank_main(int n, int rank, ncclUniqueId id) {
  enum { K = 5 };
  /* A config with the wrong magic is refused before any network activity. */
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.magic = 0x1234;
  ncclComm_t none = NULL;
  if (ncclCommInitRankConfig(&none, n, id, rank, &bad) != ncclInvalidArgument) FAIL("bad magic accepted");

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&comm, n, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) FAIL("init: %d %s", (int)r, ncclGetLastError(NULL));
  wait_ready(comm);
  int count = 0, me = -1;
  CHECK(ncclCommCount(comm, &count));
  CHECK(ncclCommUserRank(comm, &me));
  if (count != n || me != rank) FAIL("count %d rank %d", count, me);

  /* AllReduce (float sum): x_r[i] = r + 1 + i. */
  float fs[K], fr[K];
  for (int i = 0; i < K; i++) fs[i] = (float)(rank + 1 + i);
  CHECK(ncclAllReduce(fs, fr, K, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < K; i++) {
    double want = 0;
    for (int q = 0; q < n; q++) want += q + 1 + i;
    if (fr[i] != (float)want) FAIL("allreduce[%d] = %g, want %g", i, fr[i], want);
  }

  /* PreMulSum, scalar read at creation: sum_r (r + 1) * (i + 1). */
  float scalar = (float)(rank + 1);
  ncclRedOp_t pre;
  CHECK(ncclRedOpCreatePreMulSum(&pre, &scalar, ncclFloat, ncclScalarHostImmediate, comm));
  scalar = 1000.0f; /* must not matter any more */
  for (int i = 0; i < K; i++) fs[i] = (float)(i + 1);
  CHECK(ncclAllReduce(fs, fr, K, ncclFloat, pre, comm, NULL));
  for (int i = 0; i < K; i++) {
    double want = 0;
    for (int q = 0; q < n; q++) want += (q + 1.0) * (i + 1);
    if (fr[i] != (float)want) FAIL("premulsum allreduce[%d] = %g, want %g", i, fr[i], want);
  }
  /* A PreMulSum op is only for its data type. */
  int is[K], ir[K];
  if (ncclAllReduce(is, ir, K, ncclInt32, pre, comm, NULL) != ncclInvalidArgument) FAIL("premulsum on another type accepted");
  CHECK(ncclRedOpDestroy(pre, comm));

  /* PreMulSum, scalar read at each call (ncclScalarDevice residence, host-visible memory). */
  double dscalar = 0.0;
  CHECK(ncclRedOpCreatePreMulSum(&pre, &dscalar, ncclDouble, ncclScalarDevice, comm));
  dscalar = 0.5 * (rank + 1);
  double ds[4 * 64], dr[64];
  for (int i = 0; i < n * 3; i++) ds[i] = (double)(i + rank);
  CHECK(ncclReduceScatter(ds, dr, 3, ncclDouble, pre, comm, NULL));
  for (int i = 0; i < 3; i++) {
    double want = 0;
    for (int q = 0; q < n; q++) want += 0.5 * (q + 1) * (rank * 3 + i + q);
    if (dr[i] != want) FAIL("premulsum reducescatter[%d] = %g, want %g", i, dr[i], want);
  }
  CHECK(ncclRedOpDestroy(pre, comm));

  /* AllGather (int32): x_r[i] = 100 r + i. */
  int ag[64 * 3];
  for (int i = 0; i < 3; i++) is[i] = 100 * rank + i;
  CHECK(ncclAllGather(is, ag, 3, ncclInt32, comm, NULL));
  long want[64 * 3] = {0};
  for (int q = 0; q < n; q++)
    for (int i = 0; i < 3; i++) want[q * 3 + i] = 100 * q + i;
  check_ints("allgather", ag, want, n * 3);

  /* ReduceScatter (int32 sum): x_r[j] = r + j. */
  int rs[64 * 2];
  for (int j = 0; j < n * 2; j++) rs[j] = rank + j;
  CHECK(ncclReduceScatter(rs, ir, 2, ncclInt32, ncclSum, comm, NULL));
  for (int i = 0; i < 2; i++) {
    want[i] = 0;
    for (int q = 0; q < n; q++) want[i] += q + rank * 2 + i;
  }
  check_ints("reducescatter", ir, want, 2);

  /* Broadcast from the last rank. */
  for (int i = 0; i < K; i++) is[i] = rank == n - 1 ? 7 * i + 1 : -1;
  CHECK(ncclBroadcast(is, ir, K, ncclInt32, n - 1, comm, NULL));
  for (int i = 0; i < K; i++) want[i] = 7 * i + 1;
  check_ints("broadcast", ir, want, K);

  /* Grouped Send/Recv ring. */
  for (int i = 0; i < K; i++) is[i] = 10 * rank + i;
  CHECK(ncclGroupStart());
  CHECK(ncclSend(is, K, ncclInt32, (rank + 1) % n, comm, NULL));
  CHECK(ncclRecv(ir, K, ncclInt32, (rank + n - 1) % n, comm, NULL));
  CHECK(ncclGroupEnd());
  for (int i = 0; i < K; i++) want[i] = 10 * ((rank + n - 1) % n) + i;
  check_ints("sendrecv", ir, want, K);

  /* Split by parity, keys reversing the order; the last rank (n > 2) takes no color. */
  int nocolor = n > 2 && rank == n - 1;
  ncclComm_t half = NULL;
  CHECK(ncclCommSplit(comm, nocolor ? NCCL_SPLIT_NOCOLOR : rank % 2, -rank, &half, NULL));
  if (nocolor) {
    if (half != NULL) FAIL("NOCOLOR got a communicator");
  } else {
    int members[64], m = 0;
    for (int q = n - 1; q >= 0; q--)
      if (q % 2 == rank % 2 && !(n > 2 && q == n - 1)) members[m++] = q;
    int hc = 0, hr = -1;
    CHECK(ncclCommCount(half, &hc));
    CHECK(ncclCommUserRank(half, &hr));
    if (hc != m || members[hr] != rank) FAIL("split: count %d (want %d), rank %d", hc, m, hr);
    int mine = rank, sum = 0;
    CHECK(ncclAllReduce(&mine, &sum, 1, ncclInt32, ncclSum, half, NULL));
    long ws = 0;
    for (int i = 0; i < m; i++) ws += members[i];
    if (sum != ws) FAIL("split allreduce %d, want %ld", sum, ws);
    CHECK(ncclCommFinalize(half));
    CHECK(ncclCommDestroy(half));
  }

  /* Host memory and registration. */
  void *buf = NULL, *handle = NULL;
  CHECK(ncclMemAlloc(&buf, 4096));
  CHECK(ncclCommRegister(comm, buf, 4096, &handle));
  CHECK(ncclCommDeregister(comm, handle));
  CHECK(ncclMemFree(buf));
  uint64_t stat = 99;
  CHECK(ncclCommMemStats(comm, 3, &stat));
  if (stat != 0) FAIL("memstats %llu", (unsigned long long)stat);

  /* A hardware feature oxccl lacks: ncclInvalidUsage, named in the last error. */
  ncclWindow_t win;
  if (ncclCommWindowRegister(comm, buf, 4096, &win, 0) != ncclInvalidUsage) FAIL("window register did not fail");
  if (!strstr(ncclGetLastError(NULL), "ncclCommWindowRegister")) FAIL("last error: %s", ncclGetLastError(NULL));

  /* Shrink: the last rank leaves; the others form a communicator in parent order. */
  if (rank != n - 1) {
    int ex = n - 1;
    ncclComm_t small = NULL;
    CHECK(ncclCommShrink(comm, &ex, 1, &small, NULL, NCCL_SHRINK_DEFAULT));
    int sc = 0, sr = -1, one = 1, total = 0;
    CHECK(ncclCommCount(small, &sc));
    CHECK(ncclCommUserRank(small, &sr));
    if (sc != n - 1 || sr != rank) FAIL("shrink: count %d rank %d", sc, sr);
    CHECK(ncclAllReduce(&one, &total, 1, ncclInt32, ncclSum, small, NULL));
    if (total != n - 1) FAIL("shrink allreduce %d", total);
    CHECK(ncclCommDestroy(small));
  }

  ncclResult_t async;
  CHECK(ncclCommGetAsyncError(comm, &async));
  if (async != ncclSuccess) FAIL("async error %d", (int)async);
  CHECK(ncclCommFinalize(comm));
  double t0 = now();
  CHECK(ncclCommAbort(comm));
  if (now() - t0 > 5.0) FAIL("abort took %.1f s", now() - t0);
  return 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "dropin", rank_main); }
