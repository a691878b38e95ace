/* How fast the kernel's cross-memory copy (process_vm_readv, Open MPI's and oxccl's single-copy
 * path) is against memcpy on this host: 16 MiB copied in chunks of 16 KiB .. 16 MiB, best of 5,
 * once from a forked child's memory and once from this process's own. GB/s of bytes copied;
 * wall time by default, CPU time of this thread with `cpu` as the first argument (so that other
 * tenants' load does not count).
 *
 *   cc -O2 -o build/compare/cma_copy benches/compare/cma_copy.c && build/compare/cma_copy [cpu]
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static clockid_t clk = CLOCK_MONOTONIC;
static double now(void) {
    struct timespec t;
    clock_gettime(clk, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "cpu") == 0) clk = CLOCK_THREAD_CPUTIME_ID;
    size_t total = 16 << 20;
    char *src = aligned_alloc(4096, total), *dst = aligned_alloc(4096, total);
    memset(src, 1, total);
    memset(dst, 2, total);
    pid_t child = fork();
    if (child == 0) {
        pause();
        return 0;
    }
    pid_t from[2] = {child, getpid()};
    const char *name[2] = {"child", "self"};
    for (int w = 0; w < 2; w++) {
        for (size_t chunk = 16 << 10; chunk <= total; chunk *= 4) {
            double kbest = 1e9, ubest = 1e9;
            for (int r = 0; r < 5; r++) {
                double t = now();
                for (size_t off = 0; off < total; off += chunk) {
                    struct iovec l = {dst + off, chunk}, rm = {src + off, chunk};
                    if (process_vm_readv(from[w], &l, 1, &rm, 1, 0) != (ssize_t)chunk) {
                        perror("process_vm_readv");
                        kill(child, SIGKILL);
                        return 1;
                    }
                }
                t = now() - t;
                if (t < kbest) kbest = t;
                t = now();
                for (size_t off = 0; off < total; off += chunk) memcpy(dst + off, src + off, chunk);
                t = now() - t;
                if (t < ubest) ubest = t;
            }
            printf("%-5s chunk %6zu KiB: process_vm_readv %5.2f GB/s, memcpy %5.2f GB/s\n", name[w], chunk >> 10,
                   total / kbest / 1e9, total / ubest / 1e9);
        }
    }
    kill(child, SIGKILL);
    return 0;
}
