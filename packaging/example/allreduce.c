/* A check of an installed oxccl (tests/packaging.rs builds it with pkg-config and with CMake):
 * two ranks in this process (ncclCommInitAll) all-reduce in one group; each element must be
 * the sum of both ranks' inputs. Prints "ok <version>" and exits 0 on success. */
#include <nccl.h>
#include <stdio.h>

#define CHECK(call)                                                                    \
  do {                                                                                 \
    ncclResult_t r_ = (call);                                                          \
    if (r_ != ncclSuccess) {                                                           \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(void) {
  enum { N = 1000 };
  static float in[2][N], out[2][N];
  ncclComm_t comms[2];
  int version = 0;
  CHECK(ncclGetVersion(&version));
  CHECK(ncclCommInitAll(comms, 2, NULL));
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < N; i++) in[r][i] = (float)(i * (r + 1));
  CHECK(ncclGroupStart());
  for (int r = 0; r < 2; r++) CHECK(ncclAllReduce(in[r], out[r], N, ncclFloat, ncclSum, comms[r], NULL));
  CHECK(ncclGroupEnd());
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < N; i++)
      if (out[r][i] != (float)(3 * i)) {
        fprintf(stderr, "rank %d element %d: %f, expected %f\n", r, i, out[r][i], (double)(3 * i));
        return 1;
      }
  for (int r = 0; r < 2; r++) CHECK(ncclCommDestroy(comms[r]));
  printf("ok %d\n", version);
  return 0;
}
