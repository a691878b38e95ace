/* The floor of a small all-reduce between two processes: each iteration, each side writes one
 * 64-byte line (its sequence number) and waits for the other's. Two processes pinned to CPUs 0
 * and 1; prints the median and 10th percentile per side. docs/perf-log/2026-11.md, [P] round 3.
 *   cc -O2 -o build/compare/line_exchange benches/compare/line_exchange.c && build/compare/line_exchange */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>
#include <sys/wait.h>
struct line { _Atomic uint32_t seq; uint32_t pad[15]; } __attribute__((aligned(128)));
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return (x>y)-(x<y);}
int main(int argc,char**argv){
  int iters=200000;
  struct line *l = mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  pid_t p=fork(); int me = p==0;
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(me,&s); sched_setaffinity(0,sizeof s,&s);
  double *t=malloc(sizeof(double)*iters);
  for(int i=1;i<=iters;i++){
    double t0=now();
    l[me].pad[0]=i; atomic_store_explicit(&l[me].seq,i,memory_order_release);
    while(atomic_load_explicit(&l[1-me].seq,memory_order_acquire)<(uint32_t)i) __builtin_ia32_pause();
    t[i-1]=now()-t0;
  }
  qsort(t,iters,sizeof(double),cmp);
  printf("rank %d: median %.0f ns p10 %.0f\n",me,t[iters/2],t[iters/10]);
  if(p) wait(0);
  return 0;
}
