/* A minimal correct 2-rank in-place all-reduce through shared memory, to bound what oxccl's
 * 2-rank rows can reach on a machine: the least traffic (4 S per rank, as traffic_floor.c) in
 * pieces, but synchronised as a real schedule must be, with nothing else (no engine, no
 * signatures, no wake-ups: both ranks spin, pinned to CPUs 0 and 1).
 *
 * Per piece p of CHUNK bytes (its two halves: one reduced here, one by the peer):
 *   1. copy the half the peer reduces into a shared slot, post it;
 *   2. wait for the peer's slot, reduce own half with it in blocks of 8 KiB, each block written
 *      to the buffer and copied to a result slot right away (as oxccl's forwarded reduction),
 *      free the peer's slot and post the result;
 *   3. wait for the peer's result, copy it into the buffer, free it.
 * SLOTS slots per direction and kind (default 4) let a rank run up to SLOTS pieces ahead of
 * its peer's consumption. With OOP=1 in the environment the input and the output are two
 * buffers (out of place: the reduction reads the input and writes the output, the peer's
 * result goes to the output). Prints the best time over ITERS calls and its busbw (S / time).
 *
 *   cc -O3 -march=native -o build/compare/pair_floor benches/compare/pair_floor.c
 *   build/compare/pair_floor BYTES [ITERS [CHUNK [SLOTS]]]   (BYTES a multiple of CHUNK,
 *   CHUNK a multiple of 8; defaults 50, 65536, 4)
 * docs/perf-log/2026-11.md, [P] round 6. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
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

/* One rank's counters, each on its own 128-byte line pair: pieces posted to its input and
 * result slots, and pieces of the peer's slots it has finished reading. */
typedef struct {
  _Alignas(128) atomic_ulong posted_in;
  _Alignas(128) atomic_ulong posted_res;
  _Alignas(128) atomic_ulong used_in;
  _Alignas(128) atomic_ulong used_res;
} Ctl;

static void wait_for(atomic_ulong *w, unsigned long v) {
  while (atomic_load_explicit(w, memory_order_acquire) < v) {
  }
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s BYTES [ITERS [CHUNK [SLOTS]]]\n", argv[0]);
    return 2;
  }
  size_t S = strtoul(argv[1], 0, 0);
  int iters = argc > 2 ? atoi(argv[2]) : 50;
  size_t C = argc > 3 ? strtoul(argv[3], 0, 0) : 65536;
  unsigned long K = argc > 4 ? strtoul(argv[4], 0, 0) : 4;
  if (S == 0 || C == 0 || C % 8 || S % C || K == 0 || iters <= 0) {
    fprintf(stderr, "BYTES must be a positive multiple of CHUNK, CHUNK of 8; ITERS, SLOTS > 0\n");
    return 2;
  }
  size_t h = C / 2 / sizeof(float), pieces = S / C, blk = 2048;
  size_t ctl_bytes = 4096, slot_bytes = 4 * K * (C / 2);
  char *shm = mmap(0, ctl_bytes + slot_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  memset(shm, 0, ctl_bytes + slot_bytes);
  Ctl *ctl = (Ctl *)shm;
  float *slots = (float *)(shm + ctl_bytes);
  for (int r = 0; r < 2; r++) {
    if (fork() != 0) continue;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(r, &set);
    sched_setaffinity(0, sizeof set, &set);
    float *buf = aligned_alloc(4096, S);
    float *obuf = getenv("OOP") && atoi(getenv("OOP")) ? aligned_alloc(4096, S) : buf;
    if (!buf || !obuf) return 1;
    for (size_t i = 0; i < S / sizeof(float); i++) buf[i] = obuf[i] = (float)(i % 1000);
    Ctl *me = &ctl[r], *pe = &ctl[1 - r];
    float *my_in = slots + (2 * r) * K * h, *my_res = slots + (2 * r + 1) * K * h;
    float *pe_in = slots + (2 * (1 - r)) * K * h, *pe_res = slots + (2 * (1 - r) + 1) * K * h;
    double best = 1e9;
    unsigned long seq = 0;
    for (int it = 0; it < iters; it++) {
      double t0 = now();
      for (size_t p = 0; p < pieces; p++, seq++) {
        size_t at = p * (C / sizeof(float));
        float *own = buf + at + r * h, *other = buf + at + (1 - r) * h;
        float *out_own = obuf + at + r * h, *out_other = obuf + at + (1 - r) * h;
        size_t k = seq % K;
        if (seq >= K) wait_for(&pe->used_in, seq - K + 1);
        memcpy(my_in + k * h, other, h * sizeof(float));
        atomic_store_explicit(&me->posted_in, seq + 1, memory_order_release);
        wait_for(&pe->posted_in, seq + 1);
        if (seq >= K) wait_for(&pe->used_res, seq - K + 1);
        float *in = pe_in + k * h, *res = my_res + k * h;
        for (size_t b = 0; b < h; b += blk) {
          size_t e = b + blk < h ? b + blk : h;
          for (size_t i = b; i < e; i++) out_own[i] = own[i] + in[i];
          memcpy(res + b, out_own + b, (e - b) * sizeof(float));
        }
        atomic_store_explicit(&me->used_in, seq + 1, memory_order_release);
        atomic_store_explicit(&me->posted_res, seq + 1, memory_order_release);
        wait_for(&pe->posted_res, seq + 1);
        memcpy(out_other, pe_res + k * h, h * sizeof(float));
        atomic_store_explicit(&me->used_res, seq + 1, memory_order_release);
      }
      double t = now() - t0;
      if (t < best) best = t;
    }
    printf("rank %d: %s, %zu B in pieces of %zu, %lu slots: best %.1f us, busbw %.2f GB/s\n", r, obuf == buf ? "in place" : "out of place", S, C, K, best * 1e6,
           S / best / 1e9);
    return 0;
  }
  while (wait(0) > 0) {
  }
  return 0;
}
