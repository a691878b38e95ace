/*
 * ffi-tests/collectives.c: every NCCL collective through the C API only (#include <nccl.h>).
 *
 * Usage: collectives NRANKS
 * The parent calls ncclGetUniqueId and starts NRANKS copies of itself (fork + exec); each joins
 * with ncclCommInitRank and runs ncclBroadcast, ncclBcast, ncclReduce, ncclAllGather,
 * ncclReduceScatter, ncclAlltoAll, ncclGather, ncclScatter (out of place and in place, roots
 * 0 and last), a ring exchange with ncclSend/ncclRecv inside nested groups, a send to itself,
 * a group of collectives, and argument errors. Every element is checked against a reference
 * computed here. Exit status 0 means every rank saw correct results.
 */
#include "harness.h" /* nccl.h, CHECK, launch */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int g_wrong = 0;

/* Rank r's input element i (small integers, exact in float). */
static float val(int r, size_t i) { return (float)((int)((i * 7 + (size_t)r * 13) % 11) - 5); }

static void expect(const char *what, size_t i, float got, float want) {
  if (got != want) {
    if (g_wrong < 10) fprintf(stderr, "rank %d: %s[%zu] = %g, want %g\n", g_rank, what, i, got, want);
    g_wrong++;
  }
}

static float *fill(size_t n, int r, size_t offset) {
  float *b = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++) b[i] = val(r, offset + i);
  return b;
}

static void rooted(ncclComm_t comm, int n, size_t count, int root) {
  /* Broadcast out of place, then ncclBcast in place. */
  float *send = fill(count, g_rank, 0), *recv = fill(count, -1, 0);
  CHECK(ncclBroadcast(send, recv, count, ncclFloat, root, comm, NULL));
  for (size_t i = 0; i < count; i++) expect("broadcast", i, recv[i], val(root, i));
  float *buf = fill(count, g_rank, 0);
  CHECK(ncclBcast(buf, count, ncclFloat, root, comm, NULL));
  for (size_t i = 0; i < count; i++) expect("bcast", i, buf[i], val(root, i));
  /* Reduce (max), recvbuff only at the root. */
  CHECK(ncclReduce(send, g_rank == root ? recv : NULL, count, ncclFloat, ncclMax, root, comm, NULL));
  if (g_rank == root)
    for (size_t i = 0; i < count; i++) {
      float want = -100;
      for (int r = 0; r < n; r++) want = val(r, i) > want ? val(r, i) : want;
      expect("reduce", i, recv[i], want);
    }
  /* Gather and scatter: blocks of `count` at the root, in place there. */
  float *all = fill(count * n, -1, 0);
  for (size_t i = 0; i < count; i++) all[(size_t)g_rank * count + i] = val(g_rank, i);
  CHECK(ncclGather(g_rank == root ? all + (size_t)root * count : send, all, count, ncclFloat, root, comm, NULL));
  if (g_rank == root)
    for (size_t i = 0; i < count * n; i++) expect("gather", i, all[i], val((int)(i / count), i % count));
  float *table = fill(count * n, g_rank, 0), *mine = fill(count, -1, 0);
  CHECK(ncclScatter(table, mine, count, ncclFloat, root, comm, NULL));
  for (size_t i = 0; i < count; i++) expect("scatter", i, mine[i], val(root, (size_t)g_rank * count + i));
  free(send), free(recv), free(buf), free(all), free(table), free(mine);
}

static void unrooted(ncclComm_t comm, int n, size_t count) {
  size_t total = count * n;
  /* All-gather out of place and in place. */
  float *send = fill(count, g_rank, 0), *recv = fill(total, -1, 0);
  CHECK(ncclAllGather(send, recv, count, ncclFloat, comm, NULL));
  for (size_t i = 0; i < total; i++) expect("all_gather", i, recv[i], val((int)(i / count), i % count));
  float *ip = fill(total, -1, 0);
  memcpy(ip + (size_t)g_rank * count, send, count * sizeof(float));
  CHECK(ncclAllGather(ip + (size_t)g_rank * count, ip, count, ncclFloat, comm, NULL));
  for (size_t i = 0; i < total; i++) expect("all_gather in place", i, ip[i], val((int)(i / count), i % count));
  /* Reduce-scatter (sum) out of place and in place. */
  float *big = fill(total, g_rank, 0), *part = fill(count, -1, 0);
  CHECK(ncclReduceScatter(big, part, count, ncclFloat, ncclSum, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, (size_t)g_rank * count + i);
    expect("reduce_scatter", i, part[i], want);
  }
  CHECK(ncclReduceScatter(big, big + (size_t)g_rank * count, count, ncclFloat, ncclSum, comm, NULL));
  for (size_t i = 0; i < count; i++) expect("reduce_scatter in place", i, big[(size_t)g_rank * count + i], part[i]);
  /* All-to-all: block p of my output is block `rank` of rank p's input. */
  float *a = fill(total, g_rank, 0), *b = fill(total, -1, 0);
  CHECK(ncclAlltoAll(a, b, count, ncclFloat, comm, NULL));
  for (size_t i = 0; i < total; i++) expect("alltoall", i, b[i], val((int)(i / count), (size_t)g_rank * count + i % count));
  free(send), free(recv), free(ip), free(big), free(part), free(a), free(b);
}

static void groups(ncclComm_t comm, int n, size_t count) {
  int right = (g_rank + 1) % n, left = (g_rank + n - 1) % n;
  float *mine = fill(count, g_rank, 0), *got = fill(count, -1, 0), *self = fill(count, -1, 0);
  for (size_t i = 0; i < count; i++) got[i] = 12345.0f; /* sentinel: not received yet */
  /* Ring exchange inside nested groups, plus a send to itself: runs at the outer end. */
  CHECK(ncclGroupStart());
  CHECK(ncclSend(mine, count, ncclFloat, right, comm, NULL));
  CHECK(ncclGroupStart());
  CHECK(ncclRecv(got, count, ncclFloat, left, comm, NULL));
  CHECK(ncclSend(mine, count, ncclFloat, g_rank, comm, NULL));
  CHECK(ncclRecv(self, count, ncclFloat, g_rank, comm, NULL));
  CHECK(ncclGroupEnd());
  if (count > 0 && got[0] != 12345.0f) {
    fprintf(stderr, "rank %d: a grouped receive ran before the outermost ncclGroupEnd\n", g_rank);
    g_wrong++;
  }
  CHECK(ncclGroupEnd());
  for (size_t i = 0; i < count; i++) expect("ring recv", i, got[i], val(left, i));
  for (size_t i = 0; i < count; i++) expect("self recv", i, self[i], val(g_rank, i));
  /* A group of two collectives. */
  float *s1 = fill(count, g_rank, 0), *s2 = fill(count, g_rank, 0);
  CHECK(ncclGroupStart());
  CHECK(ncclAllReduce(s1, s1, count, ncclFloat, ncclSum, comm, NULL));
  CHECK(ncclBroadcast(s2, s2, count, ncclFloat, n - 1, comm, NULL));
  CHECK(ncclGroupEnd());
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, i);
    expect("grouped all_reduce", i, s1[i], want);
    expect("grouped broadcast", i, s2[i], val(n - 1, i));
  }
  free(mine), free(got), free(self), free(s1), free(s2);
}

static void errors(ncclComm_t comm, int n) {
  float x[4] = {0};
  ncclResult_t r = ncclBroadcast(x, x, 4, ncclFloat, n, comm, NULL);
  if (r != ncclInvalidArgument || !strstr(ncclGetLastError(NULL), "root")) {
    fprintf(stderr, "rank %d: root out of range gave %d (%s)\n", g_rank, (int)r, ncclGetLastError(NULL));
    g_wrong++;
  }
  r = ncclSend(x, 4, ncclFloat, -1, comm, NULL);
  if (r != ncclInvalidArgument) g_wrong++, fprintf(stderr, "rank %d: peer -1 gave %d\n", g_rank, (int)r);
  r = ncclGroupEnd();
  if (r != ncclInvalidUsage) g_wrong++, fprintf(stderr, "rank %d: unmatched ncclGroupEnd gave %d\n", g_rank, (int)r);
  /* An unpaired send to oneself fails at the group's end. */
  CHECK(ncclGroupStart());
  CHECK(ncclSend(x, 4, ncclFloat, g_rank, comm, NULL));
  r = ncclGroupEnd();
  if (r != ncclInvalidUsage) g_wrong++, fprintf(stderr, "rank %d: unpaired self send gave %d\n", g_rank, (int)r);
}

static int run_rank(int nranks, int rank, ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  size_t counts[] = {0, 1, 7, 4099, 200003};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    rooted(comm, nranks, counts[c], 0);
    rooted(comm, nranks, counts[c], nranks - 1);
    unrooted(comm, nranks, counts[c] / (size_t)nranks + (counts[c] > 0));
    groups(comm, nranks, counts[c]);
  }
  errors(comm, nranks);
  CHECK(ncclCommDestroy(comm));
  if (g_wrong) fprintf(stderr, "rank %d: %d wrong results\n", rank, g_wrong);
  return g_wrong ? 1 : 0;
}

int main(int argc, char **argv) { return launch(argc, argv, "collectives", run_rank); }
