/*
 * ffi-tests/bad_input.c: every kind of bad input gives a clear error, and a collective
 * mismatch fails both ranks with ncclInvalidUsage (then ncclCommGetAsyncError reports it and
 * the communicator refuses further calls until destroyed).
 *
 * Usage: bad_input 2   (exactly 2 ranks; exit status 0 when every check held)
 */
#include "harness.h" /* nccl.h, CHECK, launch */
#include <stdint.h>
#include <string.h>

static int failures = 0;

/* Checks that `got` is `want` and that the last error text contains `text`. */
static void expect(const char *what, ncclResult_t got, ncclResult_t want, const char *text) {
  const char *msg = ncclGetLastError(NULL);
  if (got != want || (text && strstr(msg, text) == NULL)) {
    fprintf(stderr, "rank %d: %s gave %d (want %d), last error \"%s\" (want \"%s\")\n", g_rank, what, (int)got,
            (int)want, msg, text ? text : "");
    failures++;
  }
}

static int run_rank(int nranks, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  float buf[8] = {0}, out[8] = {0};
  ncclUniqueId garbage;
  memset(&garbage, 0x5a, sizeof garbage);
  expect("init nranks 0", ncclCommInitRank(&comm, 0, id, 0), ncclInvalidArgument, "nranks");
  expect("init rank >= nranks", ncclCommInitRank(&comm, nranks, id, nranks), ncclInvalidArgument, "out of range");
  expect("init garbage id", ncclCommInitRank(&comm, 1, garbage, 0), ncclInvalidArgument, "unique id");
  expect("init NULL comm", ncclCommInitRank(NULL, nranks, id, rank), ncclInvalidArgument, "NULL");
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));

  ncclResult_t async = ncclInternalError;
  CHECK(ncclCommGetAsyncError(comm, &async));
  expect("async error while healthy", async, ncclSuccess, NULL);
  expect("NULL comm", ncclAllReduce(buf, out, 8, ncclFloat, ncclSum, NULL, NULL), ncclInvalidArgument, "comm is NULL");
  expect("NULL sendbuff", ncclAllReduce(NULL, out, 8, ncclFloat, ncclSum, comm, NULL), ncclInvalidArgument, "sendbuff is NULL");
  expect("NULL recvbuff", ncclAllReduce(buf, NULL, 8, ncclFloat, ncclSum, comm, NULL), ncclInvalidArgument, "recvbuff is NULL");
  expect("count overflow", ncclAllReduce(buf, out, SIZE_MAX / 4, ncclDouble, ncclSum, comm, NULL), ncclInvalidArgument,
         "overflows");
  expect("bad type", ncclAllReduce(buf, out, 8, (ncclDataType_t)99, ncclSum, comm, NULL), ncclInvalidArgument, "data type");
  expect("bad op", ncclAllReduce(buf, out, 8, ncclFloat, (ncclRedOp_t)99, comm, NULL), ncclInvalidArgument, "reduction op");
  expect("root out of range", ncclBroadcast(buf, out, 8, ncclFloat, nranks, comm, NULL), ncclInvalidArgument, "root");
  expect("peer out of range", ncclSend(buf, 8, ncclFloat, nranks + 5, comm, NULL), ncclInvalidArgument, "peer");
  expect("async NULL out", ncclCommGetAsyncError(comm, NULL), ncclInvalidArgument, "asyncError");

  /* Bad arguments do not break the communicator: a matched call still works. */
  for (int i = 0; i < 8; i++) buf[i] = (float)(rank + i);
  CHECK(ncclAllReduce(buf, out, 8, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < 8; i++)
    if (out[i] != (float)(nranks * i + nranks * (nranks - 1) / 2)) failures++;

  /* Mismatch: rank 0 reduces 8 floats, the others 4. */
  ncclResult_t r = ncclAllReduce(buf, out, rank == 0 ? 8 : 4, ncclFloat, ncclSum, comm, NULL);
  expect("mismatched count", r, ncclInvalidUsage, "collective mismatch");
  CHECK(ncclCommGetAsyncError(comm, &async));
  expect("async error after mismatch", async, ncclInvalidUsage, NULL);
  expect("call after failure", ncclAllReduce(buf, out, 8, ncclFloat, ncclSum, comm, NULL), ncclInvalidUsage,
         "must be destroyed");
  CHECK(ncclCommDestroy(comm));
  expect("destroy twice", ncclCommDestroy(comm), ncclInvalidArgument, "not a live communicator");
  expect("call after destroy", ncclAllReduce(buf, out, 8, ncclFloat, ncclSum, comm, NULL), ncclInvalidArgument,
         "not a live communicator");

  /* Abort of a one-rank communicator; the handle is dead afterwards. */
  ncclUniqueId solo;
  ncclComm_t one;
  CHECK(ncclGetUniqueId(&solo));
  CHECK(ncclCommInitRank(&one, 1, solo, 0));
  CHECK(ncclCommAbort(one));
  expect("call after abort", ncclAllReduce(buf, out, 8, ncclFloat, ncclSum, one, NULL), ncclInvalidArgument,
         "not a live communicator");
  if (failures) fprintf(stderr, "rank %d: %d checks failed\n", rank, failures);
  return failures ? 1 : 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "bad_input", run_rank); }
