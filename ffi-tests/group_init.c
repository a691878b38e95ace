/*
 * ffi-tests/group_init.c: one thread creates several ranks inside ncclGroupStart/End, as NCCL
 * allows (nccl-tests does this with several GPUs per process).
 *
 * One process, one thread: ncclGetUniqueId, then in one group ncclCommInitRank for ranks
 * 0..N-1 (the group's end waits for all of them), a grouped all-reduce over all ranks checked
 * against a sum computed here, then in groups: ncclCommSplit (even/odd colors, last rank
 * NCCL_SPLIT_NOCOLOR) and ncclCommShrink (rank 1 excluded), each child all-reducing.
 */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

#define N 4
#define COUNT 1000

#define CHECK(call)                                                                          \
  do {                                                                                       \
    ncclResult_t r_ = (call);                                                                \
    if (r_ != ncclSuccess) {                                                                 \
      fprintf(stderr, "%s failed: %s (%d): %s\n", #call, ncclGetErrorString(r_), (int)r_,   \
              ncclGetLastError(NULL));                                                       \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

#define FAIL(...)                   \
  do {                              \
    fprintf(stderr, __VA_ARGS__);   \
    fprintf(stderr, "\n");          \
    exit(1);                        \
  } while (0)

static int input(int r, int i) { return (i * 13 + r * 7) % 41 - 20; }

static int send[N][COUNT], recv[N][COUNT];

/* All-reduces on comms[k] for the k in `which` (count m) in one group; checks each result is
 * the sum of input(parent rank) over `members` (count nm). */
static void allreduce_check(ncclComm_t *comms, const int *which, int m, const int *members, int nm, const char *what) {
  CHECK(ncclGroupStart());
  for (int k = 0; k < m; k++)
    CHECK(ncclAllReduce(send[which[k]], recv[which[k]], COUNT, ncclInt32, ncclSum, comms[k], NULL));
  CHECK(ncclGroupEnd());
  for (int k = 0; k < m; k++)
    for (int i = 0; i < COUNT; i++) {
      int want = 0;
      for (int j = 0; j < nm; j++) want += input(members[j], i);
      if (recv[which[k]][i] != want) FAIL("%s: rank %d at %d: %d, want %d", what, which[k], i, recv[which[k]][i], want);
    }
}

int main(void) {
  for (int r = 0; r < N; r++)
    for (int i = 0; i < COUNT; i++) send[r][i] = input(r, i);
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  ncclComm_t comms[N];
  CHECK(ncclGroupStart());
  for (int r = 0; r < N; r++) CHECK(ncclCommInitRank(&comms[r], N, id, r));
  CHECK(ncclGroupEnd());
  for (int r = 0; r < N; r++) {
    int c = 0, u = -1;
    CHECK(ncclCommCount(comms[r], &c));
    CHECK(ncclCommUserRank(comms[r], &u));
    if (c != N || u != r) FAIL("init: count %d rank %d for %d", c, u, r);
  }
  int all[N] = {0, 1, 2, 3};
  allreduce_check(comms, all, N, all, N, "all-reduce");

  /* Split: colors by parity, the last rank takes no color. */
  ncclComm_t kids[N];
  CHECK(ncclGroupStart());
  for (int r = 0; r < N; r++) CHECK(ncclCommSplit(comms[r], r == N - 1 ? NCCL_SPLIT_NOCOLOR : r % 2, r, &kids[r], NULL));
  CHECK(ncclGroupEnd());
  if (kids[N - 1] != NULL) FAIL("NOCOLOR rank got a child");
  int even[] = {0, 2}, odd[] = {1};
  ncclComm_t ek[] = {kids[0], kids[2]}, ok[] = {kids[1]};
  allreduce_check(ek, even, 2, even, 2, "split even");
  allreduce_check(ok, odd, 1, odd, 1, "split odd");
  for (int r = 0; r < N - 1; r++) CHECK(ncclCommDestroy(kids[r]));

  /* Shrink without rank 1. */
  int ex = 1, surv[] = {0, 2, 3};
  ncclComm_t small[3];
  CHECK(ncclGroupStart());
  for (int k = 0; k < 3; k++) CHECK(ncclCommShrink(comms[surv[k]], &ex, 1, &small[k], NULL, NCCL_SHRINK_DEFAULT));
  CHECK(ncclGroupEnd());
  allreduce_check(small, surv, 3, surv, 3, "shrink");
  for (int k = 0; k < 3; k++) CHECK(ncclCommDestroy(small[k]));
  for (int r = 0; r < N; r++) CHECK(ncclCommDestroy(comms[r]));
  printf("group_init: ok\n");
  return 0;
}
