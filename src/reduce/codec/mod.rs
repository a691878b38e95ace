//! Wire encodings of `f32` data: how a plan's inter-host stage narrows what it sends
//! (docs/COMPRESSION.md).
//!
//! | encoding | bytes for `n` elements | per element |
//! |---|---|---|
//! | [`Encoding::Exact`] | `4n` | the `f32` bits |
//! | [`Encoding::Bf16`] | `2n` | bfloat16, round to nearest even |
//! | [`Encoding::Fp8`] | `n + 4⌈n/256⌉` | e4m3 code of `x / scale`, one `f32` scale per block |
//! | [`Encoding::Int8`] | `n + 4⌈n/256⌉` | `round(x / scale)` in `-126..=126`, one scale per block |
//!
//! **Blocks.** The block formats cut a message into blocks of [`BLOCK`] elements (the last one
//! shorter); each block is its scale (little-endian `f32`) followed by one code per element. The
//! scale is `m / QMAX` for `m` the largest magnitude among the block's *finite* elements
//! (`QMAX` = 416 for fp8, 126 for int8), so no finite element saturates and none overflows.
//!
//! **Non-finite values** travel as reserved codes, so every message of `n` elements has the
//! same size whatever its contents (plans fix message lengths up front): fp8 `0x7E` = +inf,
//! `0xFE` = −inf, `0x7F`/`0xFF` = NaN (fp8 scaling stops at 416 = `0x7D` to free `0x7E`); int8
//! `127` = +inf, `−127` = −inf, `−128` = NaN. bf16 carries them natively (a NaN stays a quiet
//! NaN; finite values saturate at ±bf16::MAX instead of rounding to infinity). A non-finite
//! element does not enter its block's scale, so the block's other elements keep their accuracy.
//! Zeros decode to zero (the block formats keep the sign of zero only for fp8).
//!
//! All functions take raw little-endian `f32` bytes of any alignment. The loops live in
//! `kernels` (branch-free per element, non-finite values found once per block); on x86-64 with
//! AVX2 the same loops run compiled for AVX2, chosen at run time, with bit-identical results.
#![deny(unsafe_code)]

mod kernels;
#[cfg(test)]
mod tests;

/// Elements per block of the block formats (each block carries one `f32` scale).
pub const BLOCK: usize = 256;
/// Largest scaled magnitude of the fp8 format: e4m3 `0x7D`; `0x7E` is +inf, `0x7F` NaN.
pub const FP8_QMAX: f32 = 416.0;
/// Largest code magnitude of the int8 format; `±127` and `−128` are reserved.
pub const INT8_QMAX: f32 = 126.0;

/// How `f32` elements are written on a link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// The `f32` bytes themselves.
    #[default]
    Exact,
    /// bfloat16, round to nearest even (2 bytes per element).
    Bf16,
    /// fp8 e4m3 with one `f32` scale per block of [`BLOCK`] elements.
    Fp8,
    /// Symmetric 8-bit integers with one `f32` scale per block of [`BLOCK`] elements.
    Int8,
}

impl Encoding {
    /// Every encoding, `Exact` first.
    pub const ALL: [Encoding; 4] = [Encoding::Exact, Encoding::Bf16, Encoding::Fp8, Encoding::Int8];

    /// The setting's spelling: `off` (exact), `bf16`, `fp8`, `int8`.
    pub const fn name(self) -> &'static str {
        match self {
            Encoding::Exact => "off",
            Encoding::Bf16 => "bf16",
            Encoding::Fp8 => "fp8",
            Encoding::Int8 => "int8",
        }
    }

    /// Parses a setting value (`off`, `exact`, `none`, `0`, `bf16`, `fp8`, `int8`; any case).
    pub fn parse(s: &str) -> Option<Encoding> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "exact" | "none" | "0" | "" => Some(Encoding::Exact),
            "bf16" => Some(Encoding::Bf16),
            "fp8" | "e4m3" => Some(Encoding::Fp8),
            "int8" => Some(Encoding::Int8),
            _ => None,
        }
    }

    /// Whether values change on the way (every encoding but `Exact`).
    pub const fn lossy(self) -> bool {
        !matches!(self, Encoding::Exact)
    }

    /// Encoded bytes of `n` elements.
    pub const fn size(self, n: usize) -> usize {
        match self {
            Encoding::Exact => 4 * n,
            Encoding::Bf16 => 2 * n,
            Encoding::Fp8 | Encoding::Int8 => n + 4 * n.div_ceil(BLOCK),
        }
    }

    /// Encodes the `f32` elements of `src` (little-endian bytes, `4n` of them) into `dst`
    /// (exactly [`Encoding::size`]`(n)` bytes).
    pub fn encode(self, src: &[u8], dst: &mut [u8]) {
        let n = src.len() / 4;
        debug_assert_eq!(dst.len(), self.size(n));
        match self {
            Encoding::Exact => dst.copy_from_slice(&src[..4 * n]),
            _ => dispatch::encode(self, &src[..4 * n], dst),
        }
    }

    /// Decodes `src` (as [`Encoding::encode`] wrote it) into the `f32` bytes of `dst`.
    pub fn decode(self, src: &[u8], dst: &mut [u8]) {
        self.decode_with(src, dst, false)
    }

    /// Decodes `src` and adds it, in `f32`, into the `f32` bytes of `acc`: `acc[i] += x[i]`.
    pub fn decode_add(self, src: &[u8], acc: &mut [u8]) {
        self.decode_with(src, acc, true)
    }

    fn decode_with(self, src: &[u8], dst: &mut [u8], add: bool) {
        let n = dst.len() / 4;
        debug_assert_eq!(src.len(), self.size(n));
        match self {
            Encoding::Exact if !add => dst[..4 * n].copy_from_slice(src),
            _ => dispatch::decode(self, src, &mut dst[..4 * n], add),
        }
    }
}

/// Runs the kernels, compiled for AVX2 where the CPU has it.
mod dispatch {
    use super::kernels::{self, FP8, INT8};
    use super::Encoding;

    /// The kernels for `enc`, inlined into whichever caller instantiates them.
    #[inline(always)]
    fn encode_any(enc: Encoding, src: &[u8], dst: &mut [u8]) {
        match enc {
            Encoding::Exact => dst.copy_from_slice(src),
            Encoding::Bf16 => kernels::encode_bf16(src, dst),
            Encoding::Fp8 => kernels::encode_blocks(FP8, src, dst),
            Encoding::Int8 => kernels::encode_blocks(INT8, src, dst),
        }
    }

    /// The decode kernels for `enc`, likewise.
    #[inline(always)]
    fn decode_any(enc: Encoding, src: &[u8], dst: &mut [u8], add: bool) {
        match enc {
            Encoding::Exact => kernels::decode_exact(src, dst, add),
            Encoding::Bf16 => kernels::decode_bf16(src, dst, add),
            Encoding::Fp8 => kernels::decode_blocks(FP8, src, dst, add),
            Encoding::Int8 => kernels::decode_blocks(INT8, src, dst, add),
        }
    }

    /// The baseline instantiation of the encoders (any CPU).
    pub(super) fn encode_base(enc: Encoding, src: &[u8], dst: &mut [u8]) {
        encode_any(enc, src, dst)
    }

    /// The baseline instantiation of the decoders (any CPU).
    pub(super) fn decode_base(enc: Encoding, src: &[u8], dst: &mut [u8], add: bool) {
        decode_any(enc, src, dst, add)
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    pub(super) mod avx2 {
        use super::Encoding;

        /// Whether this CPU runs the AVX2 instantiation (the std macro caches the answer).
        pub(in super::super) fn usable() -> bool {
            std::arch::is_x86_feature_detected!("avx2")
        }

        /// The AVX2 instantiation of the encoders.
        ///
        /// # Safety
        /// The CPU must support AVX2 ([`usable`]).
        #[target_feature(enable = "avx2")]
        pub(in super::super) unsafe fn encode(enc: Encoding, src: &[u8], dst: &mut [u8]) {
            super::encode_any(enc, src, dst)
        }

        /// The AVX2 instantiation of the decoders.
        ///
        /// # Safety
        /// The CPU must support AVX2 ([`usable`]).
        #[target_feature(enable = "avx2")]
        pub(in super::super) unsafe fn decode(enc: Encoding, src: &[u8], dst: &mut [u8], add: bool) {
            super::decode_any(enc, src, dst, add)
        }
    }

    /// Encodes with the fastest instantiation this CPU runs.
    pub(super) fn encode(enc: Encoding, src: &[u8], dst: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if avx2::usable() {
            // SAFETY: the CPU reports AVX2, the only requirement of the target_feature function.
            #[allow(unsafe_code)]
            unsafe {
                return avx2::encode(enc, src, dst);
            }
        }
        encode_base(enc, src, dst)
    }

    /// Decodes with the fastest instantiation this CPU runs.
    pub(super) fn decode(enc: Encoding, src: &[u8], dst: &mut [u8], add: bool) {
        #[cfg(target_arch = "x86_64")]
        if avx2::usable() {
            // SAFETY: the CPU reports AVX2, the only requirement of the target_feature function.
            #[allow(unsafe_code)]
            unsafe {
                return avx2::decode(enc, src, dst, add);
            }
        }
        decode_base(enc, src, dst, add)
    }
}

/// An encoding by its number (the C API's `OXCCL_COMPRESS_*`: 0 off, 1 bf16, 2 fp8, 3 int8).
impl TryFrom<i32> for Encoding {
    type Error = String;
    fn try_from(mode: i32) -> Result<Encoding, String> {
        usize::try_from(mode)
            .ok()
            .and_then(|m| Encoding::ALL.get(m).copied())
            .ok_or_else(|| format!("compression mode {mode} is not one of 0 (off), 1 (bf16), 2 (fp8), 3 (int8)"))
    }
}

/// bf16 bits of `x`: round to nearest even; NaN stays a quiet NaN; finite values saturate at
/// ±bf16::MAX (`0x7F7F`); infinities stay infinite.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let a = b & 0x7FFF_FFFF;
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let sign = ((b >> 16) & 0x8000) as u16;
    let is_nan = a > 0x7F80_0000;
    let is_inf = a == 0x7F80_0000;
    // A finite value rounding up to the infinity code saturates.
    let overflow = !is_inf & !is_nan & ((rounded & 0x7FFF) == 0x7F80);
    let r = if overflow { sign | 0x7F7F } else { rounded };
    if is_nan {
        ((b >> 16) as u16) | 0x0040
    } else {
        r
    }
}

/// The `f32` value of bf16 bits (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// A block's scale `m / qmax` and the factors `(pre, inv)` with `x * pre * inv` = `x / scale`
/// computed without overflow (`pre` lifts a block of tiny values into the normal range first).
#[inline]
fn scaling(m: f32, qmax: f32) -> (f32, f32, f32) {
    if m == 0.0 {
        return (0.0, 0.0, 0.0);
    }
    let pre = if m < f32::MIN_POSITIVE * 1024.0 { 2f32.powi(64) } else { 1.0 };
    (m / qmax, pre, qmax / (m * pre))
}

/// The low byte (two's complement) of `v` rounded to an integer, ties to even, for
/// `|v| <= 2^22`: adding 1.5·2^23 leaves the integer in the low mantissa bits, rounded by the
/// FPU's default mode (one add, where `round_ties_even` is a library call on baseline x86-64
/// and a saturating float-to-int cast does not vectorise well).
#[inline(always)]
fn rne_byte(v: f32) -> u8 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC).to_bits() as u8
}

/// e4m3 code of `v` with `|v| <= FP8_QMAX` (round to nearest even, subnormals included).
#[inline(always)]
fn e4m3_code(v: f32) -> u8 {
    let a = v.abs().min(FP8_QMAX);
    let sign = ((v.to_bits() >> 24) & 0x80) as u8;
    let u = a.to_bits();
    let r = u.wrapping_add(0x7_FFFF + ((u >> 20) & 1));
    let normal = ((((r >> 23) as i32 - 120) << 3) as u32 | ((r >> 20) & 7)) as u8;
    // Below 2^-6 the codes are multiples of 2^-9 (code 8 is 2^-6 itself).
    let sub = rne_byte(a * 512.0);
    sign | if a < 2f32.powi(-6) { sub } else { normal }
}

/// The value of a finite e4m3 code (exact); the kernels compute it from the bits.
#[cfg(test)]
fn e4m3_value(c: u8) -> f32 {
    let e = i32::from((c >> 3) & 15);
    let m = f32::from(c & 7);
    let mag = if e == 0 { m * 2f32.powi(-9) } else { (8.0 + m) * 2f32.powi(e - 10) };
    if c & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}
