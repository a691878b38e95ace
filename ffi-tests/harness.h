/*
 * ffi-tests/harness.h: what every C test program shares: the CHECK and FAIL macros and the launcher.
 *
 * A program calls launch(argc, argv, name, rank_main) from main. Started as `prog NRANKS`, the
 * process is the parent: it calls ncclGetUniqueId, starts NRANKS copies of itself (fork + exec)
 * as `prog NRANKS RANK ID_HEX`, waits for them and exits 0 only if every rank exited 0. Started
 * with those three arguments, it runs rank_main(nranks, rank, id) and exits with its status.
 */
#ifndef OXCCL_FFI_TEST_HARNESS_H
#define OXCCL_FFI_TEST_HARNESS_H

#include <nccl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int g_rank = -1;
/* A rank that is meant to kill itself with SIGKILL (the parent does not count it as failed). */
static int g_victim = -1;

#define CHECK(call)                                                                    \
  do {                                                                                 \
    ncclResult_t r_ = (call);                                                          \
    if (r_ != ncclSuccess) {                                                           \
      fprintf(stderr, "rank %d: %s failed: %s (%d): %s\n", g_rank, #call,              \
              ncclGetErrorString(r_), (int)r_, ncclGetLastError(NULL));                \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

/* Fails this rank with a printf-style message (for checks that are not an nccl call). */
#define FAIL(...)                         \
  do {                                    \
    fprintf(stderr, "rank %d: ", g_rank); \
    fprintf(stderr, __VA_ARGS__);         \
    fprintf(stderr, "\n");                \
    exit(1);                              \
  } while (0)

static int launch(int argc, char **argv, const char *name, int (*rank_main)(int nranks, int rank, ncclUniqueId id)) {
  if (argc == 4) {
    ncclUniqueId id;
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
      unsigned v;
      if (sscanf(argv[3] + 2 * i, "%2x", &v) != 1) return 2;
      id.internal[i] = (char)v;
    }
    g_rank = atoi(argv[2]);
    return rank_main(atoi(argv[1]), g_rank, id);
  }
  int nranks = argc > 1 ? atoi(argv[1]) : 2;
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  char hex[2 * NCCL_UNIQUE_ID_BYTES + 1];
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) sprintf(hex + 2 * i, "%02x", (unsigned char)id.internal[i]);
  pid_t pids[64];
  for (int r = 0; r < nranks && r < 64; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      char n[16], rk[16];
      snprintf(n, sizeof n, "%d", nranks);
      snprintf(rk, sizeof rk, "%d", r);
      execl("/proc/self/exe", argv[0], n, rk, hex, (char *)NULL);
      _exit(127);
    }
  }
  int failed = 0;
  for (int r = 0; r < nranks && r < 64; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (r == g_victim && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) continue;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
  }
  printf("%s: %d ranks, %s\n", name, nranks, failed ? "FAILED" : "ok");
  return failed ? 1 : 0;
}

#endif
