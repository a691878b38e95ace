//! Codecs of the narrow float types (f16, bf16, fp8): widened exactly to `f32`, reduced in
//! `f32`, narrowed once (round to nearest even).
//!
//! Conversions are the branch-free ones of `minifloat`, so the kernels' staging loops
//! vectorise. On x86-64 CPUs with F16C, f16 blocks use the hardware conversion instructions
//! (`vcvtph2ps` / `vcvtps2ph` with round-to-nearest-even), which give the same results.

use super::convert::{round_f64, Format};
use super::kernels::Codec;
use super::{fp8, minifloat};

/// A narrow float format reduced through `f32`.
pub(crate) trait Narrow {
    /// Bytes per element (1 or 2).
    const SIZE: usize;
    /// Rounding parameters for [`Codec::encode_f64`].
    const FORMAT: Format;
    /// Whether blocks may use the x86 F16C instructions (IEEE binary16 only).
    const F16C: bool = false;
    /// Exact widening of the raw bits.
    fn widen(raw: u32) -> f32;
    /// Narrowing to raw bits: nearest even, the format's overflow rule.
    fn narrow(x: f32) -> u32;
}

macro_rules! narrow_format {
    ($($name:ident: $size:expr, $format:ident, $f16c:expr, $widen:expr, $narrow:expr;)*) => {$(
        #[doc = concat!("Marker for the `", stringify!($format), "` format.")]
        pub(crate) struct $name;
        impl Narrow for $name {
            const SIZE: usize = $size;
            const FORMAT: Format = Format::$format;
            const F16C: bool = $f16c;
            #[inline(always)]
            fn widen(raw: u32) -> f32 { $widen(raw) }
            #[inline(always)]
            fn narrow(x: f32) -> u32 { $narrow(x) }
        }
    )*};
}
narrow_format! {
    F16: 2, F16, true, |r| minifloat::f16_to_f32(r as u16), |x| u32::from(minifloat::f32_to_f16(x));
    BF16: 2, BF16, false, |r| minifloat::bf16_to_f32(r as u16), |x| u32::from(minifloat::f32_to_bf16(x));
    E4M3: 1, E4M3, false, |r| fp8::e4m3_to_f32(r as u8), |x| u32::from(fp8::f32_to_e4m3(x));
    E5M2: 1, E5M2, false, |r| fp8::e5m2_to_f32(r as u8), |x| u32::from(fp8::f32_to_e5m2(x));
}

/// [`Codec`] of a [`Narrow`] format.
pub(crate) struct Via32<N>(std::marker::PhantomData<N>);

impl<N: Narrow> Codec for Via32<N> {
    type C = f32;
    const SIZE: usize = N::SIZE;
    #[inline(always)]
    fn decode(bytes: &[u8], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if N::F16C && super::kernels::x86::f16c() {
            // SAFETY: the CPU supports AVX and F16C, checked just above.
            unsafe { f16c::widen(bytes, out) };
            return;
        }
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(N::SIZE)) {
            let mut le = [0u8; 4];
            le[..N::SIZE].copy_from_slice(c);
            *o = N::widen(u32::from_le_bytes(le));
        }
    }
    #[inline(always)]
    fn encode(vals: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if N::F16C && super::kernels::x86::f16c() {
            // SAFETY: the CPU supports AVX and F16C, checked just above.
            unsafe { f16c::narrow(vals, out) };
            return;
        }
        for (v, c) in vals.iter().zip(out.chunks_exact_mut(N::SIZE)) {
            c.copy_from_slice(&N::narrow(*v).to_le_bytes()[..N::SIZE]);
        }
    }
    fn encode_f64(v: f64, out: &mut [u8]) {
        let raw = round_f64(v, N::FORMAT);
        out.copy_from_slice(&raw.to_le_bytes()[..N::SIZE]);
    }
}

/// Hardware f16 ⇄ f32 conversion, 8 elements per instruction. Loads and stores go through
/// `bytemuck` (any alignment), so the only `unsafe` is the feature contract.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{__m128i, __m256, _mm256_cvtph_ps, _mm256_cvtps_ph, _MM_FROUND_TO_NEAREST_INT};

    /// Widens little-endian f16 `bytes` into `out` (the caller passes `2 * out.len()` bytes).
    ///
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(bytes: &[u8], out: &mut [f32]) {
        let mut o = out.chunks_exact_mut(8);
        let mut b = bytes.chunks_exact(16);
        for (o, b) in (&mut o).zip(&mut b) {
            let h: __m128i = bytemuck::pod_read_unaligned(b);
            o.copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(_mm256_cvtph_ps(h)));
        }
        for (o, b) in o.into_remainder().iter_mut().zip(b.remainder().chunks_exact(2)) {
            *o = super::minifloat::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }
    }

    /// Narrows `vals` into little-endian f16 `out` (`2 * vals.len()` bytes), nearest even.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow(vals: &[f32], out: &mut [u8]) {
        let mut o = out.chunks_exact_mut(16);
        let mut v = vals.chunks_exact(8);
        for (o, v) in (&mut o).zip(&mut v) {
            let f: __m256 = bytemuck::pod_read_unaligned(bytemuck::cast_slice::<f32, u8>(v));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
            o.copy_from_slice(&bytemuck::cast::<__m128i, [u8; 16]>(h));
        }
        for (o, v) in o.into_remainder().chunks_exact_mut(2).zip(v.remainder()) {
            o.copy_from_slice(&super::minifloat::f32_to_f16(*v).to_le_bytes());
        }
    }
}
