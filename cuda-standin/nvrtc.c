// libnvrtc.so stand-in: "compiles" a CUDA C++ program as host C++ (g++ -shared with
// cuda/host_shim.h force-included, OXCCL_STANDIN and the program's -D options defined) and returns a stand-in image that
// names the built .so and each kernel's parameter list (read from `nm`), which the stand-in
// cuModuleLoadData dlopens. Builds are cached by content under $OXCCL_STANDIN_CACHE (default
// $TMPDIR/oxccl-standin-<uid>), so the processes of a test share one compile.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "standin.h"

#define EXPORT __attribute__((visibility("default")))

typedef int nvrtcResult;
enum {
  NVRTC_SUCCESS = 0,
  NVRTC_ERROR_OUT_OF_MEMORY = 1,
  NVRTC_ERROR_INVALID_INPUT = 3,
  NVRTC_ERROR_INVALID_PROGRAM = 4,
  NVRTC_ERROR_INVALID_OPTION = 5,
  NVRTC_ERROR_COMPILATION = 6,
  NVRTC_ERROR_INTERNAL_ERROR = 11,
};

#ifndef OXCCL_STANDIN_SHIM
#define OXCCL_STANDIN_SHIM "cuda/host_shim.h"
#endif

struct Prog {
  char* src;
  char* log;
  char* image;  // stand-in image text
  int cubin;    // compiled for sm_XY (else compute_XY: PTX only)
};
typedef struct Prog* nvrtcProgram;

static const int ARCHS[] = {75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121};

EXPORT nvrtcResult nvrtcVersion(int* major, int* minor) {
  *major = 13;
  *minor = 0;
  return NVRTC_SUCCESS;
}
EXPORT nvrtcResult nvrtcGetNumSupportedArchs(int* n) {
  *n = (int)(sizeof ARCHS / sizeof ARCHS[0]);
  return NVRTC_SUCCESS;
}
EXPORT nvrtcResult nvrtcGetSupportedArchs(int* out) {
  memcpy(out, ARCHS, sizeof ARCHS);
  return NVRTC_SUCCESS;
}
EXPORT const char* nvrtcGetErrorString(nvrtcResult r) { return r == 0 ? "NVRTC_SUCCESS" : "NVRTC_ERROR (stand-in)"; }

EXPORT nvrtcResult nvrtcCreateProgram(nvrtcProgram* p, const char* src, const char* name, int nh, const char* const* h,
                                      const char* const* hn) {
  (void)name;
  (void)h;
  (void)hn;
  if (!p || !src) return NVRTC_ERROR_INVALID_INPUT;
  if (nh != 0) return NVRTC_ERROR_INVALID_INPUT;  // no in-memory headers in the stand-in
  struct Prog* g = calloc(1, sizeof *g);
  g->src = strdup(src);
  *p = g;
  return NVRTC_SUCCESS;
}
EXPORT nvrtcResult nvrtcDestroyProgram(nvrtcProgram* p) {
  if (!p || !*p) return NVRTC_ERROR_INVALID_PROGRAM;
  free((*p)->src);
  free((*p)->log);
  free((*p)->image);
  free(*p);
  *p = NULL;
  return NVRTC_SUCCESS;
}

static uint64_t fnv(uint64_t h, const char* s, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  return h;
}
static char* slurp(const char* path, size_t* len) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char* b = malloc(cap + 1);
  size_t r;
  while ((r = fread(b + n, 1, cap - n, f)) > 0) {
    n += r;
    if (n == cap) b = realloc(b, (cap *= 2) + 1);
  }
  fclose(f);
  b[n] = 0;
  if (len) *len = n;
  return b;
}

// One parameter's letter from its demangled type (see standin.h).
static char param_class(const char* t, size_t n) {
  while (n && t[n - 1] == ' ') n--;
  while (n && *t == ' ') t++, n--;
  if (n && (t[n - 1] == '*' || t[n - 1] == '&')) return 'q';
#define IS(s) (n == strlen(s) && strncmp(t, s, n) == 0)
  if (IS("double")) return 'd';
  if (IS("float")) return 'f';
  if (IS("char") || IS("signed char") || IS("unsigned char") || IS("bool")) return 'b';
  if (IS("short") || IS("unsigned short")) return 'h';
  if (IS("int") || IS("unsigned int")) return 'w';
  if (IS("long") || IS("unsigned long") || IS("long long") || IS("unsigned long long")) return 'q';
#undef IS
  return 'x';
}

// Writes "name mangled sig" lines for every C++ function exported by `so` (kernels are C++
// functions under OXCCL_STANDIN, so the mangled name carries the parameter types).
static int describe(const char* so, FILE* out) {
  char cmd[8192];
  snprintf(cmd, sizeof cmd, "nm -D --defined-only -p '%s' && echo '--' && nm -DC --defined-only -p '%s'", so, so);
  FILE* p = popen(cmd, "r");
  if (!p) return -1;
  char** mangled = NULL;
  int nm = 0, cap = 0, second = 0, k = 0;
  char line[4096];
  while (fgets(line, sizeof line, p)) {
    line[strcspn(line, "\n")] = 0;
    if (strcmp(line, "--") == 0) {
      second = 1;
      continue;
    }
    char* sym = strchr(line, ' ');
    if (!sym || !(sym = strchr(sym + 1, ' '))) continue;
    sym++;
    if (!second) {
      if (nm == cap) mangled = realloc(mangled, (size_t)(cap = cap ? 2 * cap : 256) * sizeof *mangled);
      mangled[nm++] = strdup(sym);
      continue;
    }
    int idx = k++;
    char* lp = strchr(sym, '(');
    if (idx >= nm || !lp || strncmp(mangled[idx], "_Z", 2) != 0) continue;
    char sig[16];
    int ns = 0;
    char* q = lp + 1;
    int depth = 0;
    char* start = q;
    for (; *q; q++) {
      if (*q == '<' || *q == '(') depth++;
      if (*q == '>') depth--;
      if ((*q == ',' && depth == 0) || (*q == ')' && depth == 0)) {
        if (q > start && ns < 15) sig[ns++] = param_class(start, (size_t)(q - start));
        if (*q == ')') break;
        start = q + 1;
      } else if (*q == ')') {
        depth--;
      }
    }
    sig[ns] = 0;
    if (ns == 1 && sig[0] == 'x' && strncmp(lp, "()", 2) == 0) ns = 0;
    fprintf(out, "%.*s %s %s\n", (int)(lp - sym), sym, mangled[idx], ns ? sig : "-");
  }
  for (int i = 0; i < nm; i++) free(mangled[i]);
  free(mangled);
  return pclose(p) == 0 ? 0 : -1;
}

EXPORT nvrtcResult nvrtcCompileProgram(nvrtcProgram g, int nopt, const char* const* opts) {
  if (!g) return NVRTC_ERROR_INVALID_PROGRAM;
  int arch = 0, cubin = 0;
  char defs[2048] = "";  // the -D options, passed on to the host compiler
  for (int i = 0; i < nopt; i++) {
    const char* o = opts[i];
    const char* v = NULL;
    const char* d = strncmp(o, "-D", 2) == 0 ? o + 2 : strncmp(o, "--define-macro=", 15) == 0 ? o + 15 : NULL;
    if (d) {
      // Only NAME or NAME=VALUE of [A-Za-z0-9_], so the shell command needs no quoting.
      int okd = *d && d[strspn(d, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_=")] == 0;
      if (!okd || strlen(defs) + strlen(d) + 4 >= sizeof defs) {
        free(g->log);
        g->log = strdup("nvrtc stand-in: unsupported -D option (NAME or NAME=VALUE of letters, digits, _)");
        return NVRTC_ERROR_INVALID_OPTION;
      }
      strcat(defs, " -D");
      strcat(defs, d);
      continue;
    }
    if (strncmp(o, "--gpu-architecture=", 19) == 0) v = o + 19;
    else if (strncmp(o, "-arch=", 6) == 0) v = o + 6;
    if (v) {
      if (strncmp(v, "sm_", 3) == 0) cubin = 1, arch = atoi(v + 3);
      else if (strncmp(v, "compute_", 8) == 0) cubin = 0, arch = atoi(v + 8);
      else return NVRTC_ERROR_INVALID_OPTION;
    }
  }
  int ok = arch == 0;
  for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++) ok |= ARCHS[i] == arch;
  if (!ok) {
    free(g->log);
    g->log = strdup("nvrtc stand-in: unsupported architecture");
    return NVRTC_ERROR_INVALID_OPTION;
  }
  if (arch == 0) arch = 52, cubin = 0;
  const char* shim = getenv("OXCCL_STANDIN_SHIM");
  if (!shim || !*shim) shim = OXCCL_STANDIN_SHIM;
  size_t shim_len = 0;
  char* shim_text = slurp(shim, &shim_len);
  if (!shim_text) {
    free(g->log);
    g->log = strdup("nvrtc stand-in: cannot read the host shim (OXCCL_STANDIN_SHIM)");
    return NVRTC_ERROR_INTERNAL_ERROR;
  }
  uint64_t h = fnv(0xcbf29ce484222325ull, g->src, strlen(g->src));
  h = fnv(h, shim_text, shim_len);
  h = fnv(h, defs, strlen(defs));
  free(shim_text);
  char dir[1024];
  const char* cache = getenv("OXCCL_STANDIN_CACHE");
  if (cache && *cache) snprintf(dir, sizeof dir, "%s", cache);
  else snprintf(dir, sizeof dir, "%s/oxccl-standin-%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getuid());
  mkdir(dir, 0700);
  char so[1200], srcp[1200], desc[1200], lockp[1200], logp[1200], tmp[1300];
  snprintf(so, sizeof so, "%s/k-%016llx.so", dir, (unsigned long long)h);
  snprintf(desc, sizeof desc, "%s/k-%016llx.txt", dir, (unsigned long long)h);
  snprintf(srcp, sizeof srcp, "%s/k-%016llx.cu", dir, (unsigned long long)h);
  snprintf(logp, sizeof logp, "%s/k-%016llx.log", dir, (unsigned long long)h);
  snprintf(lockp, sizeof lockp, "%s/lock", dir);
  int lk = open(lockp, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lk >= 0) flock(lk, LOCK_EX);
  nvrtcResult res = NVRTC_SUCCESS;
  if (access(desc, R_OK) != 0) {
    FILE* f = fopen(srcp, "w");
    if (!f || fputs(g->src, f) < 0) res = NVRTC_ERROR_INTERNAL_ERROR;
    if (f) fclose(f);
    const char* cxx = getenv("CXX");
    char cmd[8192];
    snprintf(tmp, sizeof tmp, "%s.%d.so", so, (int)getpid());
    snprintf(cmd, sizeof cmd,
             "%s -std=c++17 -O2 -shared -fPIC -DOXCCL_STANDIN=1%s -include '%s' -x c++ '%s' -o '%s' >'%s' 2>&1",
             cxx && *cxx ? cxx : "c++", defs, shim, srcp, tmp, logp);
    if (res == NVRTC_SUCCESS && system(cmd) != 0) res = NVRTC_ERROR_COMPILATION;
    if (res == NVRTC_SUCCESS && rename(tmp, so) != 0) res = NVRTC_ERROR_INTERNAL_ERROR;
    if (res == NVRTC_SUCCESS) {
      snprintf(tmp, sizeof tmp, "%s.%d.txt", desc, (int)getpid());
      FILE* d = fopen(tmp, "w");
      if (!d || describe(so, d) != 0) res = NVRTC_ERROR_INTERNAL_ERROR;
      if (d) fclose(d);
      if (res == NVRTC_SUCCESS && rename(tmp, desc) != 0) res = NVRTC_ERROR_INTERNAL_ERROR;
    }
  }
  free(g->log);
  g->log = slurp(logp, NULL);
  if (!g->log) g->log = strdup("");
  if (res == NVRTC_SUCCESS) {
    size_t dl = 0;
    char* d = slurp(desc, &dl);
    if (!d) {
      res = NVRTC_ERROR_INTERNAL_ERROR;
    } else {
      size_t n = strlen(SI_IMAGE_MAGIC) + 64 + strlen(so) + dl;
      free(g->image);
      g->image = malloc(n);
      snprintf(g->image, n, "%s%s sm_%d\n%s\n%s", SI_IMAGE_MAGIC, cubin ? "cubin" : "ptx", arch, so, d);
      g->cubin = cubin;
      free(d);
    }
  }
  if (lk >= 0) close(lk);
  return res;
}

EXPORT nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram g, size_t* n) {
  if (!g) return NVRTC_ERROR_INVALID_PROGRAM;
  *n = (g->log ? strlen(g->log) : 0) + 1;
  return NVRTC_SUCCESS;
}
EXPORT nvrtcResult nvrtcGetProgramLog(nvrtcProgram g, char* out) {
  if (!g) return NVRTC_ERROR_INVALID_PROGRAM;
  strcpy(out, g->log ? g->log : "");
  return NVRTC_SUCCESS;
}
static nvrtcResult get_size(nvrtcProgram g, size_t* n, int want_cubin) {
  if (!g || !g->image) return NVRTC_ERROR_INVALID_PROGRAM;
  if (want_cubin && !g->cubin) return NVRTC_ERROR_INVALID_INPUT;  // compiled for compute_XY
  *n = strlen(g->image) + 1;
  return NVRTC_SUCCESS;
}
static nvrtcResult get(nvrtcProgram g, char* out, int want_cubin) {
  size_t n;
  nvrtcResult r = get_size(g, &n, want_cubin);
  if (r == NVRTC_SUCCESS) memcpy(out, g->image, n);
  return r;
}
EXPORT nvrtcResult nvrtcGetCUBINSize(nvrtcProgram g, size_t* n) { return get_size(g, n, 1); }
EXPORT nvrtcResult nvrtcGetCUBIN(nvrtcProgram g, char* out) { return get(g, out, 1); }
EXPORT nvrtcResult nvrtcGetPTXSize(nvrtcProgram g, size_t* n) { return get_size(g, n, 0); }
EXPORT nvrtcResult nvrtcGetPTX(nvrtcProgram g, char* out) { return get(g, out, 0); }
