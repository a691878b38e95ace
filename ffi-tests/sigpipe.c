/*
 * ffi-tests/sigpipe.c: a C host that keeps SIGPIPE's default action survives its peer's death.
 *
 * Rank 1 joins, takes part in one all-reduce, then a thread of it kills it with SIGKILL 200 ms
 * into a loop of 64 MiB all-reduces; a helper process pauses each survivor from 100 to 400 ms
 * (so the peer's reset waits for it), and the survivors poll ncclCommGetAsyncError between
 * calls as a watchdog would. Writes after the reset meet a dead socket: a write without
 * MSG_NOSIGNAL would kill the host with SIGPIPE (exit 141); oxccl must instead return an error.
 * Each survivor checks that its all-reduce fails within 30 s, that ncclCommGetAsyncError
 * reports it, and that destroy works. (tests/hardening.rs also drives each socket write of the
 * library into EPIPE directly, beside a control writev that does die.)
 *
 * Usage: sigpipe NRANKS (OXCCL_TRANSPORT picks tcp or shm links).
 */
#include "harness.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#define VICTIM 1
#define COUNT (16 << 20) /* floats: 64 MiB, far more than the socket buffers hold */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *killer(void *arg) {
  long ms = (long)arg;
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
  kill(getpid(), SIGKILL);
  return NULL;
}

static int rank_main(int n, int rank, ncclUniqueId id) {
  signal(SIGPIPE, SIG_DFL); /* what a C or C++ program has unless it changes it */
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  float *send = calloc(COUNT, sizeof(float)), *recv = calloc(COUNT, sizeof(float));
  if (!send || !recv) FAIL("out of memory");
  CHECK(ncclAllReduce(send, recv, 1024, ncclFloat, ncclSum, comm, NULL));
  if (rank == VICTIM) {
    /* Dies at a point of the transfer that differs from run to run. */
    pthread_t t;
    const char *ms = getenv("SIGPIPE_KILL_MS");
    pthread_create(&t, NULL, killer, (void *)(long)(ms ? atoi(ms) : 200));
  }
  if (rank != VICTIM) {
    /* A helper process pauses this rank around the kill (SIGSTOP at 100 ms, SIGCONT at 400 ms),
       so the peer's reset is waiting when this rank next touches the socket. */
    pid_t me = getpid();
    if (fork() == 0) {
      struct timespec a = {0, 100 * 1000 * 1000}, b = {0, 300 * 1000 * 1000};
      nanosleep(&a, NULL);
      kill(me, SIGSTOP);
      nanosleep(&b, NULL);
      kill(me, SIGCONT);
      _exit(0);
    }
  }
  double t0 = now();
  ncclResult_t r = ncclSuccess;
  while (r == ncclSuccess && now() - t0 < 30.0) {
    ncclResult_t polled = ncclSuccess; /* as a watchdog thread would, between calls */
    CHECK(ncclCommGetAsyncError(comm, &polled));
    if (polled != ncclSuccess) r = polled;
    else r = ncclAllReduce(send, recv, COUNT, ncclFloat, ncclSum, comm, NULL);
  }
  double took = now() - t0;
  if (r == ncclSuccess) FAIL("all-reduces with a rank killed mid-transfer kept succeeding for 30 s");
  ncclResult_t async = ncclSuccess;
  CHECK(ncclCommGetAsyncError(comm, &async));
  if (async == ncclSuccess) FAIL("no async error after the failed all-reduce");
  fprintf(stderr, "rank %d: all-reduce with the dead rank failed after %.3f s with %d: %s\n", rank, took, (int)r,
          ncclGetLastError(comm));
  CHECK(ncclCommDestroy(comm));
  free(send);
  free(recv);
  return 0;
}

int main(int argc, char **argv) {
  g_victim = VICTIM;
  return launch(argc, argv, "sigpipe", rank_main);
}
