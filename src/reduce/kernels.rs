//! Generic element kernels behind the byte-slice API in [`reduce`](super).
//!
//! Two traits carry all per-type knowledge:
//!
//! * [`Arith`]: the arithmetic type a reduction computes in (the integer and `f32`/`f64`
//!   types; `f32` also for f16, bf16 and fp8), with NCCL's operator semantics.
//! * [`Codec`]: a storage type (one per [`DataType`](crate::types::DataType)) that decodes
//!   little-endian element bytes into its `Arith` type and encodes them back.
//!
//! There is one kernel per shape, written once and instantiated per type:
//!
//! * [`binary`]: `dst = a op b` (or `dst = dst op b`). For the natively stored types on a
//!   little-endian host with suitably aligned slices it runs straight-line loops over typed
//!   slices (`bytemuck` casts), which LLVM auto-vectorises. Otherwise it stages
//!   [`CHUNK`]-element blocks through stack arrays: decode, compute, encode. The staging path
//!   serves unaligned slices of every type and is the only path of the narrow float types,
//!   whose decoders and encoders are branch-free so it vectorises as well.
//! * [`map`]: `buf = f(buf)`, the same two paths, for `divide` and `scale`.
//!
//! On x86-64 both kernels are also compiled for AVX2 + F16C and picked at run time (the only
//! `unsafe` in the module: calling those `#[target_feature]` functions after detection).
//! The narrow float codecs live in [`narrow`](super::narrow).

use bytemuck::{Pod, Zeroable};

/// Elements per staging block (on the stack; at most 2 KiB per array for `f64`).
pub(crate) const CHUNK: usize = 256;

/// The type a reduction computes in, with NCCL's device-side operator semantics.
pub(crate) trait Arith: Copy + Zeroable {
    /// `+`; wrapping for integers.
    fn add(self, o: Self) -> Self;
    /// `*`; wrapping for integers.
    fn mul(self, o: Self) -> Self;
    /// Maximum; for floats C `fmax` (a NaN operand yields the other operand).
    fn max(self, o: Self) -> Self;
    /// Minimum; for floats C `fmin`.
    fn min(self, o: Self) -> Self;
    /// `self / n`: truncating integer division, or floating division rounded once.
    fn div_count(self, n: usize) -> Self;
    /// `self / n` computed in `f64` and truncated (integers; exact only where
    /// [`F64_EXACT_DIVISOR`] says), or floating division.
    fn div_f64(self, n: f64) -> Self;
    /// `self * factor`: see [`scale`](super::scale) for the integer rule.
    fn scale_by(self, factor: f64) -> Self;
    /// Exact (floats, small integers) or nearest (64-bit integers) `f64` value.
    fn to_f64(self) -> f64;
}

/// Divisors below this divide integers of up to 32 bits exactly in `f64`: for |x| < 2^32 the
/// rounded quotient is off by less than 2^32 * 2^-53 = 2^-21 from x/n, while a quotient that is
/// not an integer lies at least 1/n > 2^-21 from the next one, so truncating it gives the
/// integer quotient; an integer quotient is exact. A division in `f64` costs a fraction of a
/// 64-bit integer division, which made the average of integers 25x slower than of floats.
pub(crate) const F64_EXACT_DIVISOR: usize = 1 << 21;

macro_rules! arith_int {
    ($($t:ty => $wide:ty, $mul:ty);* $(;)?) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)]
            fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)]
            fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                // `n` clamped to the wide type's range: a clamped divisor still exceeds |self|,
                // so the quotient (0) is unchanged. `n >= 1` is guaranteed by the caller.
                let n = Ord::max(<$wide>::try_from(n).unwrap_or(<$wide>::MAX), 1);
                (<$wide>::from(self) / n) as $t
            }
            #[inline(always)]
            fn div_f64(self, n: f64) -> Self {
                // Exact for types of up to 32 bits and counts below F64_EXACT_DIVISOR. `as`
                // truncates toward zero; the quotient's magnitude is at most |self| (in range).
                (self as f64 / n) as $t
            }
            #[inline(always)]
            fn scale_by(self, factor: f64) -> Self {
                // Wrapping product modulo 2^bits with the `as`-cast (saturating) factor.
                (self as $mul).wrapping_mul(factor as $mul) as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
arith_int! {
    i8 => i64, i64; u8 => u64, u64; i32 => i64, i64; u32 => u64, u64; i64 => i128, i64; u64 => u64, u64;
}

macro_rules! arith_float {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self + o }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self * o }
            // `f32::max` is LLVM's `maxnum`, i.e. C `fmax`. (A hand-written select would be
            // turned into a masked store in the in-place loop, which is slow on AMD CPUs.)
            #[inline(always)]
            fn max(self, o: Self) -> Self { <$t>::max(self, o) }
            #[inline(always)]
            fn min(self, o: Self) -> Self { <$t>::min(self, o) }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self { self / n as $t }
            #[inline(always)]
            fn div_f64(self, n: f64) -> Self { self / n as $t }
            #[inline(always)]
            fn scale_by(self, factor: f64) -> Self { self * factor as $t }
            #[inline(always)]
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
arith_float!(f32, f64);

/// A reduction operator, applied elementwise.
pub(crate) trait KernelOp {
    /// `a op b`.
    fn apply<T: Arith>(a: T, b: T) -> T;
}

macro_rules! ops {
    ($($name:ident => $method:ident),*) => {$(
        #[doc = concat!("The `", stringify!($method), "` operator.")]
        pub(crate) struct $name;
        impl KernelOp for $name {
            #[inline(always)]
            fn apply<T: Arith>(a: T, b: T) -> T { a.$method(b) }
        }
    )*};
}
ops!(SumOp => add, ProdOp => mul, MaxOp => max, MinOp => min);

/// A storage type: how one [`DataType`](crate::types::DataType)'s element bytes map to its
/// [`Arith`] type.
pub(crate) trait Codec {
    /// Type the arithmetic happens in.
    type C: Arith;
    /// Bytes per element.
    const SIZE: usize;
    /// Decodes `out.len()` elements from the start of `bytes` (little-endian, any alignment).
    fn decode(bytes: &[u8], out: &mut [Self::C]);
    /// Encodes `vals` into the start of `out`.
    fn encode(vals: &[Self::C], out: &mut [u8]);
    /// Encodes one `f64`, rounding once (see [`from_f64`](super::from_f64)).
    fn encode_f64(v: f64, out: &mut [u8]);
    /// Typed fast path for `dst = a op b` / `dst = dst op b`; returns false when it does not
    /// apply (slices misaligned, big-endian host, or a type stored as something else).
    #[inline(always)]
    fn direct_binary<O: KernelOp>(_dst: &mut [u8], _a: Option<&[u8]>, _b: &[u8]) -> bool {
        false
    }
    /// Typed fast path for `buf = f(buf)`; same conditions as [`Codec::direct_binary`].
    #[inline(always)]
    fn direct_map(_buf: &mut [u8], _f: impl Fn(Self::C) -> Self::C) -> bool {
        false
    }
}

/// Straight-line, auto-vectorisable `dst[i] = dst[i] op b[i]`.
#[inline(always)]
fn zip_into<T: Arith, O: KernelOp>(dst: &mut [T], b: &[T]) {
    for (x, y) in dst.iter_mut().zip(b) {
        *x = O::apply(*x, *y);
    }
}

/// Straight-line, auto-vectorisable `dst[i] = a[i] op b[i]`.
#[inline(always)]
fn zip_to<T: Arith, O: KernelOp>(dst: &mut [T], a: &[T], b: &[T]) {
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = O::apply(*x, *y);
    }
}

/// Typed fast path shared by every natively stored type.
#[inline(always)]
fn typed_binary<T: Arith + Pod, O: KernelOp>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8]) -> bool {
    if cfg!(target_endian = "big") {
        return false;
    }
    let (Ok(d), Ok(b)) = (bytemuck::try_cast_slice_mut::<u8, T>(dst), bytemuck::try_cast_slice::<u8, T>(b)) else {
        return false;
    };
    match a.map(bytemuck::try_cast_slice::<u8, T>) {
        None => zip_into::<T, O>(d, b),
        Some(Ok(a)) => zip_to::<T, O>(d, a, b),
        Some(Err(_)) => return false,
    }
    true
}

/// Typed fast path of [`map`] for natively stored types.
#[inline(always)]
fn typed_map<T: Arith + Pod>(buf: &mut [u8], f: impl Fn(T) -> T) -> bool {
    if cfg!(target_endian = "big") {
        return false;
    }
    let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(buf) else {
        return false;
    };
    for x in d.iter_mut() {
        *x = f(*x);
    }
    true
}

macro_rules! native_codec {
    ($($t:ty),*) => {$(
        impl Codec for $t {
            type C = $t;
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn decode(bytes: &[u8], out: &mut [$t]) {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(Self::SIZE)) {
                    let mut le = [0u8; std::mem::size_of::<$t>()];
                    le.copy_from_slice(c);
                    *o = <$t>::from_le_bytes(le);
                }
            }
            #[inline(always)]
            fn encode(vals: &[$t], out: &mut [u8]) {
                for (v, c) in vals.iter().zip(out.chunks_exact_mut(Self::SIZE)) {
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            fn encode_f64(v: f64, out: &mut [u8]) {
                Self::encode(&[v as $t], out);
            }
            #[inline(always)]
            fn direct_binary<O: KernelOp>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8]) -> bool {
                typed_binary::<$t, O>(dst, a, b)
            }
            #[inline(always)]
            fn direct_map(buf: &mut [u8], f: impl Fn($t) -> $t) -> bool {
                typed_map::<$t>(buf, f)
            }
        }
    )*};
}
native_codec!(i8, u8, i32, u32, i64, u64, f32, f64);

/// `dst = a op b` elementwise, or `dst = dst op b` when `a` is `None`.
///
/// All slices must already be cut to the same whole number of elements (the public API does
/// that); a longer `a` or `b` is ignored past `dst`'s length.
pub(crate) fn binary<K: Codec, O: KernelOp>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if x86::avx2() {
        // SAFETY: the CPU supports AVX2 and F16C (checked just above), the only requirement
        // of this `#[target_feature]` function.
        unsafe { x86::binary::<K, O>(dst, a, b) };
        return;
    }
    binary_body::<K, O>(dst, a, b)
}

#[inline(always)]
fn binary_body<K: Codec, O: KernelOp>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    if K::direct_binary::<O>(dst, a, b) {
        return;
    }
    let block = CHUNK * K::SIZE;
    let mut ta = [K::C::zeroed(); CHUNK];
    let mut tb = [K::C::zeroed(); CHUNK];
    let mut a_blocks = a.map(|a| a.chunks(block));
    for (d, b) in dst.chunks_mut(block).zip(b.chunks(block)) {
        let n = (d.len().min(b.len()) / K::SIZE).min(CHUNK);
        let (ta, tb) = (&mut ta[..n], &mut tb[..n]);
        match a_blocks.as_mut() {
            Some(blocks) => K::decode(blocks.next().unwrap_or_default(), ta),
            None => K::decode(d, ta),
        }
        K::decode(b, tb);
        zip_into::<K::C, O>(ta, tb);
        K::encode(ta, d);
    }
}

/// `dst = ((s0 op s1) op s2) ... op s(k-1)` elementwise over `len` bytes, where `srcs` are the
/// `k` sources; then `dst = finish(dst)`. The whole fold happens in `K::C` (the type's own
/// precision, `f32` for the narrow types), rounded once at the end. Block by block: every
/// source's block is read before the block of `dst` is written, so a source may be `dst` itself.
///
/// # Safety
/// `dst` must be writable and every source readable for `len` bytes; a source is either `dst`
/// or does not overlap it; nothing else writes these bytes during the call.
pub(crate) unsafe fn fold<K: Codec, O: KernelOp, F: Fn(K::C) -> K::C>(
    dst: *mut u8,
    srcs: &[*const u8],
    len: usize,
    finish: F,
) {
    #[cfg(target_arch = "x86_64")]
    if x86::avx2() {
        // SAFETY: the CPU supports AVX2 and F16C (checked just above); the rest is this
        // function's contract.
        unsafe { x86::fold::<K, O, F>(dst, srcs, len, finish) };
        return;
    }
    // SAFETY: this function's contract.
    unsafe { fold_body::<K, O, F>(dst, srcs, len, finish) }
}

/// # Safety
/// As [`fold`].
#[inline(always)]
unsafe fn fold_body<K: Codec, O: KernelOp, F: Fn(K::C) -> K::C>(
    dst: *mut u8,
    srcs: &[*const u8],
    len: usize,
    finish: F,
) {
    let Some((&first, rest)) = srcs.split_first() else { return };
    let mut acc = [K::C::zeroed(); CHUNK];
    let mut t = [K::C::zeroed(); CHUNK];
    let mut off = 0;
    while off + K::SIZE <= len {
        let n = ((len - off) / K::SIZE).min(CHUNK);
        let bytes = n * K::SIZE;
        let (acc, t) = (&mut acc[..n], &mut t[..n]);
        // SAFETY: every source is readable for `len` bytes and `off + bytes <= len`; the views
        // end before `dst`'s block is written below.
        K::decode(unsafe { std::slice::from_raw_parts(first.add(off), bytes) }, acc);
        for &s in rest {
            // SAFETY: as above.
            K::decode(unsafe { std::slice::from_raw_parts(s.add(off), bytes) }, t);
            zip_into::<K::C, O>(acc, t);
        }
        for x in acc.iter_mut() {
            *x = finish(*x);
        }
        // SAFETY: `dst` is writable for `len` bytes, and no view of these bytes is alive.
        K::encode(acc, unsafe { std::slice::from_raw_parts_mut(dst.add(off), bytes) });
        off += bytes;
    }
}

/// `buf[i] = f(buf[i])` elementwise.
pub(crate) fn map<K: Codec, F: Fn(K::C) -> K::C>(buf: &mut [u8], f: F) {
    #[cfg(target_arch = "x86_64")]
    if x86::avx2() {
        // SAFETY: as in `binary`.
        unsafe { x86::map::<K, F>(buf, f) };
        return;
    }
    map_body::<K, F>(buf, f)
}

#[inline(always)]
fn map_body<K: Codec, F: Fn(K::C) -> K::C>(buf: &mut [u8], f: F) {
    if K::direct_map(buf, &f) {
        return;
    }
    let mut t = [K::C::zeroed(); CHUNK];
    for d in buf.chunks_mut(CHUNK * K::SIZE) {
        let t = &mut t[..(d.len() / K::SIZE).min(CHUNK)];
        K::decode(d, t);
        for x in t.iter_mut() {
            *x = f(*x);
        }
        K::encode(t, d);
    }
}

/// The same kernels compiled for AVX2 + F16C (x86-64 CPUs since 2013), chosen at run time:
/// 8-lane loops for the integer/float ops and the branch-free narrow conversions, and
/// hardware f16 conversion.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{binary_body, map_body, Codec, KernelOp};

    #[cfg(test)]
    thread_local! {
        /// Test hook: when set, this thread uses the portable kernels and conversions only.
        pub(crate) static PORTABLE_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Whether the CPU has AVX2 and F16C (cached by `std` after the first call).
    #[inline(always)]
    pub(crate) fn avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && f16c()
    }

    /// Whether the CPU has AVX and F16C (hardware f16 conversion).
    #[inline(always)]
    pub(crate) fn f16c() -> bool {
        #[cfg(test)]
        if PORTABLE_ONLY.with(|p| p.get()) {
            return false;
        }
        std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// [`super::binary`] for AVX2 + F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn binary<K: Codec, O: KernelOp>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
        binary_body::<K, O>(dst, a, b)
    }

    /// [`super::fold`] for AVX2 + F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; the rest as [`super::fold`].
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn fold<K: Codec, O: KernelOp, F: Fn(K::C) -> K::C>(
        dst: *mut u8,
        srcs: &[*const u8],
        len: usize,
        f: F,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe { super::fold_body::<K, O, F>(dst, srcs, len, f) }
    }

    /// [`super::map`] for AVX2 + F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn map<K: Codec, F: Fn(K::C) -> K::C>(buf: &mut [u8], f: F) {
        map_body::<K, F>(buf, f)
    }
}

/// Decodes every element of `bytes` to `f64`.
pub(crate) fn decode_f64<K: Codec>(bytes: &[u8]) -> Vec<f64> {
    let mut out = Vec::with_capacity(bytes.len() / K::SIZE);
    let mut t = [K::C::zeroed(); CHUNK];
    for c in bytes.chunks(CHUNK * K::SIZE) {
        let t = &mut t[..(c.len() / K::SIZE).min(CHUNK)];
        K::decode(c, t);
        out.extend(t.iter().map(|x| x.to_f64()));
    }
    out
}

/// Encodes `vals` into `out`, one rounding per value.
pub(crate) fn encode_f64<K: Codec>(vals: &[f64], out: &mut [u8]) {
    for (v, o) in vals.iter().zip(out.chunks_exact_mut(K::SIZE)) {
        K::encode_f64(*v, o);
    }
}
