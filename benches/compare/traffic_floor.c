/* The memory-traffic floor of a 2-rank in-place all-reduce on one host without a single-copy
 * path: the least bytes any schedule over shared memory moves, with no synchronisation at all.
 * Per rank and call, for a message of S bytes:
 *   1. copy the half the peer reduces into a shared slot          (read S/2, write S/2)
 *   2. reduce its own half from its buffer and the peer's slot,
 *      writing the result to its buffer and to a shared slot      (read S,   write S)
 *   3. copy the peer's reduced half out of the peer's slot         (read S/2, write S/2)
 * = 4 S of traffic per rank, both ranks at once (pinned to CPUs 0 and 1), in pieces of CHUNK
 * bytes of the message (default: the whole message) through slots of CHUNK / 2 bytes that every
 * piece reuses, so that with a small CHUNK the slots stay in the caches as a pipelined schedule's
 * rings do. Prints the best time of ITERS calls and the busbw it gives (S / time for 2 ranks): no
 * all-reduce over shared memory that copies each byte through a shared buffer in pieces of that
 * size can beat it on this machine. docs/perf-log/2026-11.md, [P] round 5.
 *   cc -O3 -march=native -o build/compare/traffic_floor benches/compare/traffic_floor.c
 *   build/compare/traffic_floor BYTES [ITERS [CHUNK]]  (BYTES a multiple of CHUNK, CHUNK of 8) */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s BYTES [ITERS]\n", argv[0]);
    return 2;
  }
  size_t S = strtoul(argv[1], 0, 0);
  int iters = argc > 2 ? atoi(argv[2]) : 50;
  size_t C = argc > 3 ? strtoul(argv[3], 0, 0) : S;
  if (S == 0 || C == 0 || C % 8 || S % C) {
    fprintf(stderr, "BYTES must be a positive multiple of CHUNK, CHUNK of 8\n");
    return 2;
  }
  size_t h = C / 2 / sizeof(float), q = C / sizeof(float), pieces = S / C;
  /* Four slots of C bytes: rank r's input slot is 2r, its result slot 2r+1 (halves used). */
  float *shm = mmap(0, 4 * C, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  memset(shm, 0, 4 * C);
  for (int r = 0; r < 2; r++) {
    if (fork() != 0) continue;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(r, &set);
    sched_setaffinity(0, sizeof set, &set);
    float *buf = malloc(S);
    for (size_t i = 0; i < S / sizeof(float); i++) buf[i] = (float)i;
    float *in = shm + 2 * r * q, *res = shm + (2 * r + 1) * q;
    float *peer_in = shm + 2 * (1 - r) * q, *peer_res = shm + (2 * (1 - r) + 1) * q;
    double best = 1e9;
    for (int k = 0; k < iters; k++) {
      double t0 = now();
      for (size_t p = 0; p < pieces; p++) {
        float *own = buf + p * q + r * h, *other = buf + p * q + (1 - r) * h;
        memcpy(in, other, h * sizeof(float));
        for (size_t i = 0; i < h; i++) {
          float v = own[i] + peer_in[i];
          own[i] = v;
          res[i] = v;
        }
        memcpy(other, peer_res, h * sizeof(float));
      }
      double t = now() - t0;
      if (t < best) best = t;
    }
    printf("rank %d: %zu B in pieces of %zu: best %.1f us, busbw %.2f GB/s\n", r, S, C, best * 1e6, S / best / 1e9);
    return 0;
  }
  while (wait(0) > 0) {
  }
  return 0;
}
