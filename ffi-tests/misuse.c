/*
 * ffi-tests/misuse.c: handles are never reused, and misuse is refused instead of run.
 *
 * Each of 2 ranks:
 * 1. creates and destroys a one-rank communicator 20 times: every handle differs from every
 *    earlier one, destroying a stale handle is ncclInvalidArgument and leaves the newest
 *    communicator alive; likewise PreMulSum operators and ncclCommRegister handles;
 * 2. GroupStart, AllReduce, CommDestroy, GroupEnd: GroupEnd is ncclInvalidUsage (both ranks);
 * 3. one communicator called from two threads at once: rank 0's first thread blocks in an
 *    all-reduce (rank 1 calls 1 s later), its second thread calls 200 ms in and must get
 *    ncclInvalidUsage at once; the first thread's call and rank 1's call then fail too (the
 *    communicator is failed), so no rank can pair one thread's data with another's.
 *
 * Usage: misuse 2
 */
#include "harness.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#define ROUNDS 20

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static ncclComm_t solo(void) {
  ncclUniqueId id;
  ncclComm_t c = NULL;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclCommInitRank(&c, 1, id, 0));
  return c;
}

static void handles_are_never_reused(void) {
  ncclComm_t seen[ROUNDS];
  for (int i = 0; i < ROUNDS; i++) {
    seen[i] = solo();
    for (int j = 0; j < i; j++)
      if (seen[j] == seen[i]) FAIL("round %d: the new communicator has round %d's handle %p", i, j, (void *)seen[i]);
    CHECK(ncclCommDestroy(seen[i]));
  }
  ncclComm_t live = solo();
  for (int i = 0; i < ROUNDS; i++) {
    ncclResult_t r = ncclCommDestroy(seen[i]);
    if (r != ncclInvalidArgument) FAIL("destroying stale handle %d gave %d, want ncclInvalidArgument", i, (int)r);
  }
  int n = 0;
  CHECK(ncclCommCount(live, &n)); /* the newest communicator survived the stale destroys */
  if (n != 1) FAIL("count %d", n);

  /* PreMulSum operators: a destroyed operator number stays invalid. */
  double scale = 2.0;
  ncclRedOp_t ops[ROUNDS];
  for (int i = 0; i < ROUNDS; i++) {
    CHECK(ncclRedOpCreatePreMulSum(&ops[i], &scale, ncclDouble, ncclScalarHostImmediate, live));
    for (int j = 0; j < i; j++)
      if (ops[j] == ops[i]) FAIL("operator %d reuses operator %d's number %d", i, j, (int)ops[i]);
    CHECK(ncclRedOpDestroy(ops[i], live));
  }
  double x = 1.0, y = 0.0;
  ncclResult_t r = ncclAllReduce(&x, &y, 1, ncclDouble, ops[0], live, NULL);
  if (r != ncclInvalidArgument) FAIL("all-reduce with a destroyed operator gave %d", (int)r);
  r = ncclRedOpDestroy(ops[1], live);
  if (r != ncclInvalidArgument) FAIL("destroying a destroyed operator gave %d", (int)r);
  ncclRedOp_t op;
  CHECK(ncclRedOpCreatePreMulSum(&op, &scale, ncclDouble, ncclScalarHostImmediate, live));
  CHECK(ncclAllReduce(&x, &y, 1, ncclDouble, op, live, NULL));
  if (y != 2.0) FAIL("PreMulSum on one rank gave %g, want 2", y);

  /* Buffer registrations. */
  void *h1 = NULL, *h2 = NULL;
  CHECK(ncclCommRegister(live, &x, sizeof x, &h1));
  CHECK(ncclCommDeregister(live, h1));
  CHECK(ncclCommRegister(live, &x, sizeof x, &h2));
  if (h1 == h2) FAIL("a new registration reuses a released handle");
  r = ncclCommDeregister(live, h1);
  if (r != ncclInvalidArgument) FAIL("deregistering a released handle gave %d", (int)r);
  CHECK(ncclCommDeregister(live, h2));
  CHECK(ncclCommDestroy(live));
}

static void destroy_inside_a_group(int n, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  float a[4] = {1, 2, 3, 4}, b[4];
  CHECK(ncclGroupStart());
  CHECK(ncclAllReduce(a, b, 4, ncclFloat, ncclSum, comm, NULL));
  CHECK(ncclCommDestroy(comm));
  double t0 = now();
  ncclResult_t r = ncclGroupEnd();
  if (r != ncclInvalidUsage) FAIL("GroupEnd after destroying the group's communicator gave %d, want %d", (int)r, (int)ncclInvalidUsage);
  if (!strstr(ncclGetLastError(NULL), "destroyed")) FAIL("message does not say destroyed: %s", ncclGetLastError(NULL));
  if (now() - t0 > 5.0) FAIL("GroupEnd took %.1f s", now() - t0);
}

struct call {
  ncclComm_t comm;
  float *buf;
  ncclResult_t result;
  double took;
};

static void *all_reduce_thread(void *arg) {
  struct call *c = arg;
  double t0 = now();
  c->result = ncclAllReduce(c->buf, c->buf, 1024, ncclFloat, ncclSum, c->comm, NULL);
  c->took = now() - t0;
  return NULL;
}

static void two_threads_on_one_comm(int n, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  static float a[1024], b[1024];
  for (int i = 0; i < 1024; i++) a[i] = b[i] = 1.0f;
  CHECK(ncclAllReduce(a, a, 1024, ncclFloat, ncclSum, comm, NULL)); /* links built */
  if (rank == 1) {
    sleep_ms(1000);
    ncclResult_t r = ncclAllReduce(b, b, 1024, ncclFloat, ncclSum, comm, NULL);
    if (r == ncclSuccess) FAIL("rank 1's all-reduce succeeded although rank 0's communicator was failed");
  } else {
    struct call first = {comm, a, ncclSuccess, 0}, second = {comm, b, ncclSuccess, 0};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, all_reduce_thread, &first);
    sleep_ms(200);
    pthread_create(&t2, NULL, all_reduce_thread, &second);
    pthread_join(t2, NULL);
    pthread_join(t1, NULL);
    if (second.result != ncclInvalidUsage) FAIL("the second thread's call gave %d, want ncclInvalidUsage", (int)second.result);
    if (second.took > 5.0) FAIL("the second thread waited %.1f s instead of being refused", second.took);
    if (first.result == ncclSuccess) FAIL("the first thread's call succeeded on a failed communicator");
  }
  ncclResult_t async = ncclSuccess;
  CHECK(ncclCommGetAsyncError(comm, &async));
  if (async == ncclSuccess) FAIL("no async error after concurrent use");
  CHECK(ncclCommDestroy(comm));
}

static int rank_main(int n, int rank, ncclUniqueId id) {
  handles_are_never_reused();
  /* The launcher's id serves one communicator: it carries the ids of the next two. */
  ncclComm_t base;
  CHECK(ncclCommInitRank(&base, n, id, rank));
  ncclUniqueId ids[2];
  if (rank == 0) {
    CHECK(ncclGetUniqueId(&ids[0]));
    CHECK(ncclGetUniqueId(&ids[1]));
  }
  CHECK(ncclBroadcast(ids, ids, sizeof ids, ncclChar, 0, base, NULL));
  CHECK(ncclCommDestroy(base));
  destroy_inside_a_group(n, rank, ids[0]);
  two_threads_on_one_comm(n, rank, ids[1]);
  return 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "misuse", rank_main); }
