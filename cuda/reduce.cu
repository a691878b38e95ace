// oxccl device kernels: reduce-copy, average and pre-multiplied scaling for every NCCL data type.
//
// Compiled at run time by NVRTC (src/device/kernels.rs embeds this file) for the GPU's own
// architecture. The same file also compiles as plain host C++ with cuda/host_shim.h force-
// included (tests/device_cpu.rs), where each kernel is run thread by thread: so the arithmetic,
// the 16-byte vector path and the tails are checked against the host reductions of src/reduce
// on machines without a GPU.
//
// Semantics are those of src/reduce (NCCL's): integers wrap, float max/min ignore a NaN operand
// (fmax/fmin), f16/bf16/fp8 are widened exactly to float, combined in float, rounded once
// (nearest even; f16/bf16 overflow to infinity, fp8 saturates as __NV_SATFINITE). The narrow
// conversions are written out here (a port of src/reduce/minifloat.rs) instead of coming from
// cuda_fp16.h / cuda_bf16.h / cuda_fp8.h: that keeps the file free of headers (it compiles with
// any NVRTC and on the host) and bit-identical to the host path; on the GPU, f16 (and fp8 on
// sm_89 and newer) use the hardware cvt instructions, which round the same way.
//
// Entry points (extern "C", one per type T and operator OP; T in i8 u8 i32 u32 i64 u64 f16 f32
// f64 bf16 e4m3 e5m2, OP in sum prod max min avg):
//   oxccl_reduce_T_OP(T* dst, const T* a, const T* b, unsigned long long n, unsigned int div)
//       dst[i] = a[i] OP b[i]; for avg, the sum is then divided by `div` when div > 1.
//   oxccl_fold_T_OP(const u64* table, unsigned long long n, unsigned int nsrc, unsigned int ndst,
//                   unsigned int div, unsigned int guarded)
//       the fold of window plans: every table[nsrc + j] gets table[0][i] OP ... OP
//       table[nsrc - 1][i], accumulated in the compute type and rounded once. With `guarded`
//       set, the table is a guarded table of board words (see fold_copy).
//   oxccl_divide_T(T* dst, const T* src, unsigned long long n, unsigned int div)
//       dst[i] = src[i] / div (integers truncate toward zero).
//   oxccl_scale_T(T* dst, const T* src, unsigned long long n, double factor)
//       dst[i] = src[i] * factor (PreMulSum; integer rule of src/reduce::scale).
//   oxccl_ll_T_OP(T* dst, const T* src, unsigned long long n, const u64* ctl, unsigned int flag)
//       a whole small all-reduce in one launch (the LL flow, src/device/small.rs): this rank's
//       `src` goes out in 16-byte lines (8 bytes of data, each 4-byte half beside a copy of
//       `flag`) into its slot in every peer's region, the peers' lines are awaited in this
//       rank's slots, and dst gets the fold of all ranks in rank order, as oxccl_fold_T_OP
//       computes it (avg divides by the number of ranks). `ctl` is the communicator's table
//       (LL_* below). See ll_all_reduce.
// dst may equal a, b or src (in place). Every kernel is a grid-stride loop: any grid works.

#ifndef OXCCL_HOST_TEST
#define OX_DEV __device__ __forceinline__
#define OX_GLOBAL extern "C" __global__
#define ox_fence_system() __threadfence_system()
// A waiting thread's pause between polls (the host build yields its CPU instead).
#define ox_pause()
// Polls of a waiting LL thread between two looks at its stop word (host memory, read over the bus).
#define OX_STOP_EVERY 4096u
typedef unsigned long long ox_uptr;
#endif

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// ---------------------------------------------------------------------------------------------
// Bit casts and narrow float formats.
// ---------------------------------------------------------------------------------------------

OX_DEV u32 f2u(float x) {
  union { float f; u32 u; } c;
  c.f = x;
  return c.u;
}
OX_DEV float u2f(u32 x) {
  union { float f; u32 u; } c;
  c.u = x;
  return c.f;
}

// Parameters of a narrow format (see src/reduce/minifloat.rs, field by field).
struct Fmt {
  u32 bits, man, bias;
  bool ieee;
  u32 overflow_bits, overflow_code, nan;
};

#define FMT_F16 Fmt{16, 10, 15, true, 0x47800000u, 0x7C00u, 0x7E00u}
#define FMT_E4M3 Fmt{8, 3, 7, false, 0x43E00000u, 0x7Eu, 0x7Fu}
#define FMT_E5M2 Fmt{8, 2, 15, true, 0x47600000u, 0x7Bu, 0x7Fu}

// Exact widening of a narrow code to float.
OX_DEV float widen(u32 code, Fmt f) {
  const u32 abs_mask = (1u << (f.bits - 1)) - 1;
  const u32 abs = code & abs_mask;
  const u32 sign = (code >> (f.bits - 1)) << 31;
  const u32 shift = 23 - f.man;
  const u32 rebias = (127 - f.bias) << 23;
  const u32 normal = (abs << shift) + rebias;
  const u32 min_normal = rebias + (1u << 23);
  const u32 sub = f2u(u2f(normal + (1u << 23)) - u2f(min_normal));
  const u32 inf_code = (abs_mask >> f.man) << f.man;
  const u32 quiet = abs > inf_code ? 0x00400000u : 0u;
  const u32 special = (abs << shift) | 0x7F800000u | quiet;
  u32 mag;
  if (f.ieee && abs >= inf_code) mag = special;
  else if (!f.ieee && abs == abs_mask) mag = 0x7FC00000u;
  else if (abs < (1u << f.man)) mag = sub;
  else mag = normal;
  return u2f(mag | sign);
}

// Narrowing: nearest even, overflow to f.overflow_code, NaN to f.nan.
OX_DEV u32 narrow(float x, Fmt f) {
  const u32 bits = f2u(x);
  const u32 sign = (bits >> 31) << (f.bits - 1);
  const u32 abs = bits & 0x7FFFFFFFu;
  const u32 shift = 23 - f.man;
  const u32 rebias = (127 - f.bias) << 23;
  const u32 min_normal_bits = (1u << 23) + rebias;
  const u32 rebiased = abs - rebias;
  const u32 lsb = (rebiased >> shift) & 1u;
  const u32 normal = (rebiased + ((1u << (shift - 1)) - 1u + lsb)) >> shift;
  const float magic = u2f((127 - f.bias + shift + 1) << 23);
  const u32 sub = f2u(u2f(abs) + magic) - f2u(magic);
  u32 mag;
  if (abs >= f.overflow_bits) mag = f.overflow_code;
  else if (abs >= min_normal_bits) mag = normal;
  else mag = sub;
  return abs > 0x7F800000u ? f.nan : (mag | sign);
}

OX_DEV float f16_to_float(unsigned short h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return widen(h, FMT_F16);
#endif
}

OX_DEV unsigned short float_to_f16(float x) {
#if defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  // The hardware gives some NaN; make it the canonical one, as on the host.
  return ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0) ? (unsigned short)0x7E00u : h;
#else
  return (unsigned short)narrow(x, FMT_F16);
#endif
}

OX_DEV float bf16_to_float(unsigned short b) { return u2f((u32)b << 16); }

OX_DEV unsigned short float_to_bf16(float x) {
  const u32 bits = f2u(x);
  const u32 rounded = (bits + (0x7FFFu + ((bits >> 16) & 1u))) >> 16;
  const u32 nan = (bits >> 16) | 0x0040u;
  return (unsigned short)((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// ---------------------------------------------------------------------------------------------
// Element types: storage S, compute type C, conversions and arithmetic.
// ---------------------------------------------------------------------------------------------

// Saturating float -> integer casts with Rust's `as` rules (NaN -> 0).
OX_DEV i64 sat_i64(double f) {
  if (f != f) return 0;
  if (f >= 9223372036854775808.0) return (i64)0x7FFFFFFFFFFFFFFFull;
  if (f <= -9223372036854775808.0) return (i64)0x8000000000000000ull;
  return (i64)f;
}
OX_DEV u64 sat_u64(double f) {
  if (!(f > 0.0)) return 0;
  if (f >= 18446744073709551616.0) return 0xFFFFFFFFFFFFFFFFull;
  return (u64)f;
}

// Integer types: storage is the compute type; sum/prod wrap (done in the unsigned type).
template <class S, class U, bool SIGNED>
struct IntT {
  typedef S St;
  typedef S C;
  static OX_DEV C load(S x) { return x; }
  static OX_DEV S store(C x) { return x; }
  static OX_DEV C add(C a, C b) { return (C)(U)((U)a + (U)b); }
  static OX_DEV C mul(C a, C b) { return (C)(U)((U)a * (U)b); }
  static OX_DEV C max(C a, C b) { return a > b ? a : b; }
  static OX_DEV C min(C a, C b) { return a < b ? a : b; }
  static OX_DEV C div(C a, u32 n) {
    if (SIGNED) return (C)((i64)a / (i64)n);
    return (C)((u64)a / (u64)n);
  }
  static OX_DEV C scale(C a, double f) {
    if (SIGNED) return (C)(U)((u64)(i64)a * (u64)sat_i64(f));
    return (C)(U)((u64)a * sat_u64(f));
  }
};

// Native floats; max/min return the other operand when one is NaN (CUDA's fmax/fmin, Rust's
// f32::max). The host build spells that out: glibc's fmax turns a signalling NaN into NaN.
#if defined(__CUDA_ARCH__)
OX_DEV float fmx(float a, float b) { return fmaxf(a, b); }
OX_DEV double fmx(double a, double b) { return fmax(a, b); }
OX_DEV float fmn(float a, float b) { return fminf(a, b); }
OX_DEV double fmn(double a, double b) { return fmin(a, b); }
#else
template <class F>
OX_DEV F fmx(F a, F b) { return a != a ? b : (b != b ? a : (a > b ? a : b)); }
template <class F>
OX_DEV F fmn(F a, F b) { return a != a ? b : (b != b ? a : (a < b ? a : b)); }
#endif

// Narrow float conversions (w: widen to float, n: narrow from float).
struct CvF16 {
  static OX_DEV float w(unsigned short x) { return f16_to_float(x); }
  static OX_DEV unsigned short n(float x) { return float_to_f16(x); }
};
struct CvBf16 {
  static OX_DEV float w(unsigned short x) { return bf16_to_float(x); }
  static OX_DEV unsigned short n(float x) { return float_to_bf16(x); }
};
// fp8: sm_89 and newer convert in hardware (the cvt instructions behind cuda_fp8.h's
// __nv_cvt_fp8_to_halfraw and __nv_cvt_float_to_fp8(.., __NV_SATFINITE, ..)): widening through
// f16 is exact, narrowing rounds to nearest even and saturates to the largest finite value, as
// the software path does; a NaN is made the canonical one, as on the host.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define OX_FP8_HW 1
#define OX_FP8_CVT(fmt)                                                                          \
  OX_DEV float fmt##_to_float(unsigned char x) {                                                \
    unsigned int h2;                                                                             \
    unsigned short in = x, h;                                                                    \
    float f;                                                                                     \
    asm("cvt.rn.f16x2." #fmt "x2 %0, %1;" : "=r"(h2) : "h"(in));                              \
    h = (unsigned short)(h2 & 0xFFFFu);                                                          \
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));                                              \
    return f;                                                                                    \
  }                                                                                              \
  OX_DEV unsigned char float_to_##fmt(float x) {                                                \
    unsigned short r;                                                                            \
    asm("cvt.rn.satfinite." #fmt "x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));          \
    return x != x ? (unsigned char)0x7Fu : (unsigned char)(r & 0xFFu);                           \
  }
OX_FP8_CVT(e4m3)
OX_FP8_CVT(e5m2)
#endif

struct CvE4m3 {
#ifdef OX_FP8_HW
  static OX_DEV float w(unsigned char x) { return e4m3_to_float(x); }
  static OX_DEV unsigned char n(float x) { return float_to_e4m3(x); }
#else
  static OX_DEV float w(unsigned char x) { return widen(x, FMT_E4M3); }
  static OX_DEV unsigned char n(float x) { return (unsigned char)narrow(x, FMT_E4M3); }
#endif
};
struct CvE5m2 {
#ifdef OX_FP8_HW
  static OX_DEV float w(unsigned char x) { return e5m2_to_float(x); }
  static OX_DEV unsigned char n(float x) { return float_to_e5m2(x); }
#else
  static OX_DEV float w(unsigned char x) { return widen(x, FMT_E5M2); }
  static OX_DEV unsigned char n(float x) { return (unsigned char)narrow(x, FMT_E5M2); }
#endif
};

// Float types: storage S, computed in CT (float for the narrow types), CV converts between.
template <class S>
struct CvSame {
  static OX_DEV S w(S x) { return x; }
  static OX_DEV S n(S x) { return x; }
};

template <class S, class CT, class CV>
struct FloatT {
  typedef S St;
  typedef CT C;
  static OX_DEV C load(S x) { return CV::w(x); }
  static OX_DEV S store(C x) { return CV::n(x); }
  static OX_DEV C add(C a, C b) { return a + b; }
  static OX_DEV C mul(C a, C b) { return a * b; }
  static OX_DEV C max(C a, C b) { return fmx(a, b); }
  static OX_DEV C min(C a, C b) { return fmn(a, b); }
  static OX_DEV C div(C a, u32 n) { return a / (C)n; }
  static OX_DEV C scale(C a, double f) { return a * (C)f; }
};

typedef IntT<signed char, unsigned char, true> T_i8;
typedef IntT<unsigned char, unsigned char, false> T_u8;
typedef IntT<int, unsigned int, true> T_i32;
typedef IntT<unsigned int, unsigned int, false> T_u32;
typedef IntT<long long, unsigned long long, true> T_i64;
typedef IntT<unsigned long long, unsigned long long, false> T_u64;
typedef FloatT<unsigned short, float, CvF16> T_f16;
typedef FloatT<float, float, CvSame<float> > T_f32;
typedef FloatT<double, double, CvSame<double> > T_f64;
typedef FloatT<unsigned short, float, CvBf16> T_bf16;
typedef FloatT<unsigned char, float, CvE4m3> T_e4m3;
typedef FloatT<unsigned char, float, CvE5m2> T_e5m2;

// ---------------------------------------------------------------------------------------------
// Operators: each maps (a, b) -> a OP b in the compute type, then `fin` finishes (avg divides).
// ---------------------------------------------------------------------------------------------

template <class T> struct OpSum { static OX_DEV typename T::C f(typename T::C a, typename T::C b, u32) { return T::add(a, b); } };
template <class T> struct OpProd { static OX_DEV typename T::C f(typename T::C a, typename T::C b, u32) { return T::mul(a, b); } };
template <class T> struct OpMax { static OX_DEV typename T::C f(typename T::C a, typename T::C b, u32) { return T::max(a, b); } };
template <class T> struct OpMin { static OX_DEV typename T::C f(typename T::C a, typename T::C b, u32) { return T::min(a, b); } };
template <class T> struct OpAvg {
  static OX_DEV typename T::C f(typename T::C a, typename T::C b, u32 div) {
    // The sum is rounded to the element type before dividing, as when the division runs
    // over a stored sum (src/reduce: reduce_to, then divide).
    typename T::C s = T::add(a, b);
    return div > 1 ? T::div(T::load(T::store(s)), div) : s;
  }
};

// ---------------------------------------------------------------------------------------------
// The loops: an unaligned head, 16-byte packs (UNROLL packs in flight per thread), a tail.
//
// Pointers that share one offset modulo 16 (any offset that is a multiple of the element size:
// a buffer 2 or 4 bytes past an allocation's start) are split where the first reaches a 16-byte
// boundary: the head (at most 15 elements) and the tail run one element per thread, the body in
// packs. Pointers mutually misaligned (offsets modulo 16 that differ) have no common boundary:
// a pack of one would straddle two of another, so the whole range runs element-wise, each
// thread a grid-stride share (coalesced 1-8 byte accesses; NCCL's reduce-copy does the same).
// ---------------------------------------------------------------------------------------------

#define UNROLL 4

struct alignas(16) Pack16 {
  u64 lo, hi;
};

template <class S>
union PackOf {
  Pack16 v;
  S e[16 / sizeof(S)];
};

OX_DEV u64 thread_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
OX_DEV u64 thread_count() { return (u64)gridDim.x * blockDim.x; }

// Elements before the packed body: those before p0's first 16-byte boundary when every pointer
// shares p0's offset modulo 16 (`diff`, the OR of each pointer XOR p0, has no low bits) and that
// offset is a whole number of elements; otherwise all n (no packs).
template <class S>
OX_DEV u64 head_of(ox_uptr p0, ox_uptr diff, u64 n) {
  if ((diff & 15) != 0 || (p0 % sizeof(S)) != 0) return n;
  const u64 h = ((16 - (p0 & 15)) & 15) / sizeof(S);
  return h < n ? h : n;
}

// dst[i] = OP(a[i], b[i]). dst may equal a or b (each element is read before it is written by
// the same thread), so the pointers carry no __restrict__.
template <class T, template <class> class OP>
OX_DEV void reduce_copy(typename T::St* dst, const typename T::St* a, const typename T::St* b, u64 n, u32 div) {
  typedef typename T::St S;
  const int E = 16 / sizeof(S);
  const u64 tid = thread_index(), nt = thread_count();
  const u64 head = head_of<S>((ox_uptr)dst, ((ox_uptr)a ^ (ox_uptr)dst) | ((ox_uptr)b ^ (ox_uptr)dst), n);
  const u64 np = (n - head) / E;
  const Pack16* a4 = (const Pack16*)(a + head);
  const Pack16* b4 = (const Pack16*)(b + head);
  Pack16* d4 = (Pack16*)(dst + head);
  for (u64 base = tid; base < np; base += nt * UNROLL) {
    PackOf<S> pa[UNROLL], pb[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const u64 p = base + (u64)u * nt;
      if (p < np) {
        pa[u].v = a4[p];
        pb[u].v = b4[p];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const u64 p = base + (u64)u * nt;
      if (p < np) {
        PackOf<S> r;
#pragma unroll
        for (int k = 0; k < E; k++) r.e[k] = T::store(OP<T>::f(T::load(pa[u].e[k]), T::load(pb[u].e[k]), div));
        d4[p] = r.v;
      }
    }
  }
  for (u64 i = tid; i < head; i += nt) dst[i] = T::store(OP<T>::f(T::load(a[i]), T::load(b[i]), div));
  for (u64 i = head + np * E + tid; i < n; i += nt) dst[i] = T::store(OP<T>::f(T::load(a[i]), T::load(b[i]), div));
}

// The fold of window plans: table[0..nsrc) are the sources, table[nsrc..nsrc+ndst) the
// destinations; every destination gets src0 OP src1 OP ... (left fold in table order) of each
// element, accumulated in the compute type (float for the narrow floats) and rounded once; for
// avg, the sum is divided by `div` at the last source. A destination may be a source (in place:
// each element is read from every source before it is written).
//
// Guarded tables (`guarded` set): the direct all-reduce of ranks that share a process publishes
// each rank's call on the device, in a board of four 64-bit words in its region:
// [tag, count, send, recv] (tag: barrier sequence number << 32 | type << 8 | operator). Each
// source entry of the table is then the address of a rank's `send` word and each destination
// entry the address of a rank's `recv` word; two words follow the entries: `off`, and the
// address of the fault word. The fold's addresses are the board words plus `off` bytes. The
// fold runs only when every board named carries the same tag (never 0, the value of a board
// nobody published since the set-up zeroed it) and count (the ranks made the same call, and
// each published it for this call, not an earlier one); otherwise one thread writes 1 into
// the fault word (a word of the rank's host-mapped flag page, which its watchdog reads) and
// nothing is read or written.
//
// Every thread resolves the fold's addresses once, before any store, into a local array (the
// first FOLD_ADDRS of them; a larger table resolves the rest where used): the table and the
// boards are neither re-read after each store (which, through untyped pointers, the compiler
// would have to assume may alias them) nor, for a guarded table, read twice per use.
OX_DEV const u64* board_of(const u64* table, u32 k, u32 nsrc) {
  return (const u64*)(table[k] - (k < nsrc ? 16 : 24));
}

#define FOLD_ADDRS 16

template <class T, template <class> class OP>
OX_DEV void fold_copy(const u64* __restrict__ table, u64 n, u32 nsrc, u32 ndst, u32 div, u32 guarded) {
  typedef typename T::St S;
  typedef typename T::C C;
  const int E = 16 / sizeof(S);
  const u64 tid = thread_index(), nt = thread_count();
  const u32 nk = nsrc + ndst;
  const u64 off = guarded ? table[nk] : 0;
  if (guarded) {
    const u64* b0 = board_of(table, 0, nsrc);
    bool same = b0[0] != 0;  // a board nobody published since the set-up zeroed it
    for (u32 k = 0; k < nk; k++) {
      const u64* b = board_of(table, k, nsrc);
      same = same && b[0] == b0[0] && b[1] == b0[1];
    }
    if (!same) {
      if (tid == 0) {
        *(volatile u32*)table[nk + 1] = 1;
        ox_fence_system();
      }
      return;
    }
  }
  // Address k of the fold: the table's word, or for a guarded table the board word it names
  // plus `off` (boards stay unchanged during the kernel).
#define RESOLVE(k) (guarded ? *(const u64*)table[k] + off : table[k])
  u64 at[FOLD_ADDRS];
  at[0] = RESOLVE(0);
  ox_uptr diff = 0;
  for (u32 k = 1; k < nk; k++) {
    const u64 a = RESOLVE(k);
    if (k < FOLD_ADDRS) at[k] = a;
    diff |= a ^ at[0];
  }
#define AT(k) ((k) < FOLD_ADDRS ? at[k] : RESOLVE(k))
  const u64 head = head_of<S>(at[0], diff, n);
  const u64 np = (n - head) / E;
  const u64 hb = head * sizeof(S);
  for (u64 base = tid; base < np; base += nt * UNROLL) {
    C acc[UNROLL][E];
    {
      const Pack16* s0 = (const Pack16*)(at[0] + hb);
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const u64 p = base + (u64)u * nt;
        if (p < np) {
          PackOf<S> x;
          x.v = s0[p];
#pragma unroll
          for (int k = 0; k < E; k++) acc[u][k] = T::load(x.e[k]);
        }
      }
    }
    for (u32 j = 1; j < nsrc; j++) {
      const Pack16* sj = (const Pack16*)(AT(j) + hb);
      const u32 d = j + 1 == nsrc ? div : 1;
      PackOf<S> x[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const u64 p = base + (u64)u * nt;
        if (p < np) x[u].v = sj[p];
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const u64 p = base + (u64)u * nt;
        if (p < np) {
#pragma unroll
          for (int k = 0; k < E; k++) acc[u][k] = OP<T>::f(acc[u][k], T::load(x[u].e[k]), d);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const u64 p = base + (u64)u * nt;
      if (p < np) {
        PackOf<S> r;
#pragma unroll
        for (int k = 0; k < E; k++) r.e[k] = T::store(acc[u][k]);
        for (u32 j = 0; j < ndst; j++) ((Pack16*)(AT(nsrc + j) + hb))[p] = r.v;
      }
    }
  }
  // The head, then the tail, one element per thread.
  for (int part = 0; part < 2; part++) {
    const u64 lo = part == 0 ? 0 : head + np * E, hi = part == 0 ? head : n;
    for (u64 i = lo + tid; i < hi; i += nt) {
      C acc = T::load(((const S*)at[0])[i]);
      for (u32 j = 1; j < nsrc; j++) acc = OP<T>::f(acc, T::load(((const S*)AT(j))[i]), j + 1 == nsrc ? div : 1);
      const S r = T::store(acc);
      for (u32 j = 0; j < ndst; j++) ((S*)AT(nsrc + j))[i] = r;
    }
  }
}
#undef AT
#undef RESOLVE

// dst[i] = MAP(src[i]) for a unary map (divide, scale); dst may equal src.
template <class T, class M>
OX_DEV void map_copy(typename T::St* dst, const typename T::St* src, u64 n, M m) {
  typedef typename T::St S;
  const int E = 16 / sizeof(S);
  const u64 tid = thread_index(), nt = thread_count();
  const u64 head = head_of<S>((ox_uptr)dst, (ox_uptr)src ^ (ox_uptr)dst, n);
  const u64 np = (n - head) / E;
  const Pack16* s4 = (const Pack16*)(src + head);
  Pack16* d4 = (Pack16*)(dst + head);
  for (u64 p = tid; p < np; p += nt) {
    PackOf<S> x;
    x.v = s4[p];
#pragma unroll
    for (int k = 0; k < E; k++) x.e[k] = T::store(m(T::load(x.e[k])));
    d4[p] = x.v;
  }
  for (u64 i = tid; i < head; i += nt) dst[i] = T::store(m(T::load(src[i])));
  for (u64 i = head + np * E + tid; i < n; i += nt) dst[i] = T::store(m(T::load(src[i])));
}

template <class T>
struct DivBy {
  u32 n;
  OX_DEV typename T::C operator()(typename T::C x) const { return T::div(x, n); }
};
// Identity on raw storage (a divide by 1 copies the bits, as the host does).
template <class S>
struct Same {
  OX_DEV S operator()(S x) const { return x; }
};
template <class T>
struct ScaleBy {
  double f;
  OX_DEV typename T::C operator()(typename T::C x) const { return T::scale(x, f); }
};

// ---------------------------------------------------------------------------------------------
// The LL flow: a small all-reduce in one launch between ranks whose memory is mapped into each
// other's (src/device/small.rs chooses it and lays the slots out).
//
// A line is 16 bytes: {data0, flag, data1, flag}, 8 bytes of the sender's buffer split in two
// 4-byte halves, each beside a copy of the call's flag. The sender writes a line with one
// 16-byte volatile store; the reader loads it with one 16-byte volatile load and takes it when
// both flag copies equal the call's flag: each 8-byte half (naturally aligned, so written and
// read whole) then holds this call's data, whatever order the halves became visible in. No
// fence and no separate flag word: data and flag travel together. The flag is the call's
// sequence number (never 0, the value of the zeroed slots), so nothing is reset between calls;
// the flag's parity picks one of two sets of slots, and a sender can reuse a set only after
// the reader's kernel of the previous call on it ended (src/device/small.rs says why).
//
// Thread t of the grid sends lines t, t + T, ... (T threads) to every peer, then waits for and
// folds the same lines: every rank splits the lines alike (the host launches the same grid on
// every rank), so a rank's thread t waits only for lines the peers' thread t sends (the CPU
// stand-in, which runs a grid's threads one after another, relies on that). A wait looks at the
// rank's stop word every OX_STOP_EVERY polls and gives up when it is set (the watchdog's
// release, or a peer's failure): the kernel then ends with dst partly written.
// ---------------------------------------------------------------------------------------------

// Writes line `at` (a device address): data `v` (low half first), both flag copies `flag`.
OX_DEV void ll_store(u64 at, u64 v, u32 flag) {
  const u32 lo = (u32)v, hi = (u32)(v >> 32);
#if defined(__CUDA_ARCH__)
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(lo), "r"(flag), "r"(hi), "r"(flag)
               : "memory");
#else
  __atomic_store_n((u64*)at, (u64)lo | ((u64)flag << 32), __ATOMIC_RELEASE);
  __atomic_store_n((u64*)(at + 8), (u64)hi | ((u64)flag << 32), __ATOMIC_RELEASE);
#endif
}

// Reads line `at`: true, with its data in *v, when both flag copies equal `flag`.
OX_DEV bool ll_load(u64 at, u32 flag, u64* v) {
  u32 d0, f0, d1, f1;
#if defined(__CUDA_ARCH__)
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
               : "l"(at)
               : "memory");
#else
  const u64 a = __atomic_load_n((const u64*)at, __ATOMIC_ACQUIRE);
  const u64 b = __atomic_load_n((const u64*)(at + 8), __ATOMIC_ACQUIRE);
  d0 = (u32)a, f0 = (u32)(a >> 32), d1 = (u32)b, f1 = (u32)(b >> 32);
#endif
  *v = (u64)d0 | ((u64)d1 << 32);
  return f0 == flag && f1 == flag;
}

// Waits for line `at` to carry `flag`; false when the stop word was set first.
OX_DEV bool ll_wait(u64 at, u32 flag, const u32* stop, u64* v) {
  u32 polls = 0;
  while (!ll_load(at, flag, v)) {
    if (++polls % OX_STOP_EVERY == 0 && *(const volatile u32*)stop != 0) return false;
    ox_pause();
  }
  return true;
}

// Line `l` of `src` (n elements): its 8 bytes, zero past the end.
template <class S>
OX_DEV u64 ll_payload(const S* src, u64 n, u64 l) {
  const int E = 8 / sizeof(S);
  const u64 first = l * E;
  if (first + E <= n && ((ox_uptr)src & 7) == 0) return ((const u64*)src)[l];
  union {
    u64 u;
    S e[8 / sizeof(S)];
  } x;
  x.u = 0;
  for (int k = 0; k < E && first + k < n; k++) x.e[k] = src[first + k];
  return x.u;
}

// The words of a communicator's LL table (`ctl`, written once at set-up by src/device/small.rs):
// the number of ranks, this rank, the bytes of a slot, the device address of this rank's abort
// word (its stop word), of its LL area (set 0; set 1 follows n slots later), then for set p and
// rank q at LL_PEERS + p * n + q the address of this rank's slot in rank q's set p.
#define LL_NRANKS 0
#define LL_ME 1
#define LL_SLOT 2
#define LL_STOP 3
#define LL_MINE 4
#define LL_PEERS 5

template <class T, template <class> class OP>
OX_DEV void ll_all_reduce(typename T::St* dst, const typename T::St* src, u64 n, const u64* ctl, u32 flag) {
  typedef typename T::St S;
  typedef typename T::C C;
  const int E = 8 / sizeof(S);
  const u32 nranks = (u32)ctl[LL_NRANKS], me = (u32)ctl[LL_ME], div = nranks, parity = flag & 1u;
  const u64 slot = ctl[LL_SLOT];
  const u32* stop = (const u32*)ctl[LL_STOP];
  const u64 mine = ctl[LL_MINE] + (u64)parity * nranks * slot;
  const u64* peers = ctl + LL_PEERS + (u64)parity * nranks;
  const u64 lines = (n + E - 1) / E;
  const u64 tid = thread_index(), nt = thread_count();
  for (u64 l = tid; l < lines; l += nt) {
    const u64 v = ll_payload<S>(src, n, l);
    for (u32 q = 0; q < nranks; q++)
      if (q != me) ll_store(peers[q] + l * 16, v, flag);
  }
  for (u64 l = tid; l < lines; l += nt) {
    union {
      u64 u;
      S e[8 / sizeof(S)];
    } x;
    // Rank q's line: this rank's from src, a peer's from its slot here.
#define LL_LINE(q) ((q) == me ? (x.u = ll_payload<S>(src, n, l), true) : ll_wait(mine + (u64)(q) * slot + l * 16, flag, stop, &x.u))
    if (!LL_LINE(0)) return;
    C acc[8 / sizeof(S)];
#pragma unroll
    for (int k = 0; k < E; k++) acc[k] = T::load(x.e[k]);
    for (u32 q = 1; q < nranks; q++) {
      if (!LL_LINE(q)) return;
      const u32 d = q + 1 == nranks ? div : 1;
#pragma unroll
      for (int k = 0; k < E; k++) acc[k] = OP<T>::f(acc[k], T::load(x.e[k]), d);
    }
#undef LL_LINE
    const u64 first = l * E;
#pragma unroll
    for (int k = 0; k < E; k++) x.e[k] = T::store(acc[k]);
    if (first + E <= n && ((ox_uptr)dst & 7) == 0) {
      ((u64*)dst)[l] = x.u;
    } else {
      for (int k = 0; k < E && first + k < n; k++) dst[first + k] = x.e[k];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points: 12 types x (5 reduce-copies, 5 folds, divide, scale, 5 LL all-reduces), or one
// unit of them.
// ---------------------------------------------------------------------------------------------

#define OX_REDUCE(t, op, OP)                                                                         \
  OX_GLOBAL void oxccl_reduce_##t##_##op(T_##t::St* dst, const T_##t::St* a, const T_##t::St* b, \
                                         u64 n, u32 div) {                                          \
    reduce_copy<T_##t, OP>(dst, a, b, n, div);                                                       \
  }                                                                                                  \
  OX_GLOBAL void oxccl_fold_##t##_##op(const u64* table, u64 n, u32 nsrc, u32 ndst, u32 div,       \
                                       u32 guarded) {                                               \
    fold_copy<T_##t, OP>(table, n, nsrc, ndst, div, guarded);                                        \
  }

#define OX_LL(t, op, OP)                                                                             \
  OX_GLOBAL void oxccl_ll_##t##_##op(T_##t::St* dst, const T_##t::St* src, u64 n, const u64* ctl, u32 flag) { \
    ll_all_reduce<T_##t, OP>(dst, src, n, ctl, flag);                                                        \
  }

#define OX_MAPS(t)                                                                                 \
  OX_GLOBAL void oxccl_divide_##t(T_##t::St* dst, const T_##t::St* src, u64 n, u32 div) {          \
    if (div > 1) {                                                                                 \
      DivBy<T_##t> m = {div};                                                                      \
      map_copy<T_##t>(dst, src, n, m);                                                             \
    } else {                                                                                       \
      map_copy<IntT<T_##t::St, T_##t::St, false> >(dst, src, n, Same<T_##t::St>());                \
    }                                                                                              \
  }                                                                                                \
  OX_GLOBAL void oxccl_scale_##t(T_##t::St* dst, const T_##t::St* src, u64 n, double factor) {     \
    ScaleBy<T_##t> m = {factor};                                                                   \
    map_copy<T_##t>(dst, src, n, m);                                                               \
  }

#define OX_TYPE(t)                                                                                 \
  OX_REDUCE(t, sum, OpSum)                                                                         \
  OX_REDUCE(t, prod, OpProd)                                                                       \
  OX_REDUCE(t, max, OpMax)                                                                         \
  OX_REDUCE(t, min, OpMin)                                                                         \
  OX_REDUCE(t, avg, OpAvg)                                                                         \
  OX_MAPS(t)                                                                                       \
  OX_LL(t, sum, OpSum)                                                                             \
  OX_LL(t, prod, OpProd)                                                                           \
  OX_LL(t, max, OpMax)                                                                             \
  OX_LL(t, min, OpMin)                                                                             \
  OX_LL(t, avg, OpAvg)

// One unit on its own (src/device/kernels.rs compiles only what a call needs):
//   -DOX_SEL_TYPE=t -DOX_SEL_OP=op   oxccl_reduce_t_op and oxccl_fold_t_op;
//   -DOX_SEL_TYPE=t -DOX_SEL_MAP=1   oxccl_divide_t and oxccl_scale_t;
//   -DOX_SEL_TYPE=t -DOX_SEL_OP=op -DOX_SEL_LL=1   oxccl_ll_t_op (the LL flow's kernel alone).
// Without OX_SEL_TYPE, every entry point (tests/device_kernels_host.rs, scripts/nvrtc-check.sh).
#define OX_OPCLASS_sum OpSum
#define OX_OPCLASS_prod OpProd
#define OX_OPCLASS_max OpMax
#define OX_OPCLASS_min OpMin
#define OX_OPCLASS_avg OpAvg
#define OX_CAT2(a, b) a##b
#define OX_CAT(a, b) OX_CAT2(a, b)
// Expands the selection macros before OX_REDUCE / OX_MAPS paste them into names.
#define OX_REDUCE_X(t, op, OP) OX_REDUCE(t, op, OP)
#define OX_MAPS_X(t) OX_MAPS(t)
#define OX_LL_X(t, op, OP) OX_LL(t, op, OP)

#if defined(OX_SEL_TYPE) && defined(OX_SEL_OP) && defined(OX_SEL_LL)
OX_LL_X(OX_SEL_TYPE, OX_SEL_OP, OX_CAT(OX_OPCLASS_, OX_SEL_OP))
#elif defined(OX_SEL_LL)
#error "OX_SEL_LL needs OX_SEL_TYPE and OX_SEL_OP"
#elif defined(OX_SEL_TYPE) && defined(OX_SEL_OP)
OX_REDUCE_X(OX_SEL_TYPE, OX_SEL_OP, OX_CAT(OX_OPCLASS_, OX_SEL_OP))
#elif defined(OX_SEL_TYPE) && defined(OX_SEL_MAP)
OX_MAPS_X(OX_SEL_TYPE)
#elif defined(OX_SEL_TYPE) || defined(OX_SEL_OP) || defined(OX_SEL_MAP)
#error "OX_SEL_TYPE needs OX_SEL_OP or OX_SEL_MAP"
#else
OX_TYPE(i8)
OX_TYPE(u8)
OX_TYPE(i32)
OX_TYPE(u32)
OX_TYPE(i64)
OX_TYPE(u64)
OX_TYPE(f16)
OX_TYPE(f32)
OX_TYPE(f64)
OX_TYPE(bf16)
OX_TYPE(e4m3)
OX_TYPE(e5m2)
#endif
