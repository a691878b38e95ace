// Compiles a CUDA source with a given NVRTC library, exactly as src/device/kernels.rs does, and
// fails on any error. Usage: nvrtc-check LIBNVRTC FILE.cu ARCH OUT [OPTION...]
//   ARCH sm_XY writes a cubin to OUT; compute_XY writes PTX.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*create_t)(void**, const char*, const char*, int, const char* const*, const char* const*);
typedef int (*compile_t)(void*, int, const char* const*);
typedef int (*size_t_fn)(void*, size_t*);
typedef int (*get_t)(void*, char*);
typedef int (*version_t)(int*, int*);

static void* sym(void* h, const char* n) {
  void* p = dlsym(h, n);
  if (!p) {
    fprintf(stderr, "nvrtc-check: %s missing: %s\n", n, dlerror());
    exit(2);
  }
  return p;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s LIBNVRTC FILE.cu ARCH OUT [OPTION...]\n", argv[0]);
    return 2;
  }
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) {
    fprintf(stderr, "nvrtc-check: dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  FILE* f = fopen(argv[2], "rb");
  if (!f) return perror(argv[2]), 2;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* src = calloc(1, (size_t)n + 1);
  if (fread(src, 1, (size_t)n, f) != (size_t)n) return perror("read"), 2;
  fclose(f);
  int maj = 0, min = 0;
  ((version_t)sym(h, "nvrtcVersion"))(&maj, &min);
  void* prog = NULL;
  if (((create_t)sym(h, "nvrtcCreateProgram"))(&prog, src, "oxccl_reduce.cu", 0, NULL, NULL) != 0) return 1;
  int cubin = strncmp(argv[3], "sm_", 3) == 0;
  int nopt = argc - 5 + 1;
  const char** opts = calloc((size_t)nopt, sizeof *opts);
  char arch[64];
  snprintf(arch, sizeof arch, "--gpu-architecture=%s", argv[3]);
  opts[0] = arch;
  for (int i = 5; i < argc; i++) opts[i - 4] = argv[i];
  int r = ((compile_t)sym(h, "nvrtcCompileProgram"))(prog, nopt, opts);
  size_t ls = 0;
  ((size_t_fn)sym(h, "nvrtcGetProgramLogSize"))(prog, &ls);
  char* log = calloc(1, ls + 1);
  ((get_t)sym(h, "nvrtcGetProgramLog"))(prog, log);
  printf("NVRTC %d.%d %s: %s%s%s", maj, min, argv[3], r == 0 ? "ok" : "FAILED", *log ? "\n" : "", log);
  printf("\n");
  if (r != 0) return 1;
  size_t sz = 0;
  ((size_t_fn)sym(h, cubin ? "nvrtcGetCUBINSize" : "nvrtcGetPTXSize"))(prog, &sz);
  char* out = malloc(sz);
  if (((get_t)sym(h, cubin ? "nvrtcGetCUBIN" : "nvrtcGetPTX"))(prog, out) != 0) return 1;
  FILE* o = fopen(argv[4], "wb");
  if (!o || fwrite(out, 1, cubin ? sz : strlen(out), o) == 0) return perror(argv[4]), 1;
  fclose(o);
  return 0;
}
