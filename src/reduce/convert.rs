//! Correctly rounded `f64 → narrow float` encoding for [`from_f64`](super::from_f64).
//!
//! This is deliberately a separate, arithmetic implementation (scale by a power of two, round
//! with `round_ties_even`, re-encode) rather than a chain of hardware conversions: going
//! `f64 → f32 → f16` would round twice, and the tests use this module as an independent
//! reference for the bit-twiddling converters in the kernels and in [`fp8`](super::fp8).

/// A binary floating-point format narrower than `f64`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Format {
    /// Mantissa (fraction) bits.
    man: u32,
    /// Exponent bits.
    exp: u32,
    /// Exponent bias.
    bias: i32,
    /// Largest finite magnitude.
    max: f64,
    /// SATFINITE: out-of-range values and infinities become ±max finite (the fp8 formats);
    /// otherwise IEEE overflow to ±infinity.
    saturate: bool,
    /// Code returned for a NaN input.
    nan: u32,
}

impl Format {
    /// IEEE binary16.
    pub(crate) const F16: Format = Format { man: 10, exp: 5, bias: 15, max: 65504.0, saturate: false, nan: 0x7E00 };
    /// bfloat16.
    pub(crate) const BF16: Format =
        Format { man: 7, exp: 8, bias: 127, max: 3.389_531_389_251_535_5e38, saturate: false, nan: 0x7FC0 };
    /// OCP E4M3FN, saturating (no infinities).
    pub(crate) const E4M3: Format = Format { man: 3, exp: 4, bias: 7, max: 448.0, saturate: true, nan: 0x7F };
    /// OCP E5M2, saturating as CUDA's `__NV_SATFINITE`.
    pub(crate) const E5M2: Format = Format { man: 2, exp: 5, bias: 15, max: 57344.0, saturate: true, nan: 0x7F };
}

/// `2^k` for `k` in the normal `f64` exponent range (exact).
fn pow2(k: i32) -> f64 {
    let k = k.clamp(-1022, 1023);
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Unbiased binary exponent of a positive finite `f64` (subnormals report -1023 or less, which
/// only matters for values far below every narrow format's range).
fn exponent(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

/// Rounds `x` to the nearest value of `fmt` (ties to even) and returns its bit pattern.
///
/// Overflow gives ±infinity for IEEE formats and ±max finite for saturating ones; NaN gives
/// `fmt`'s canonical (positive, quiet) NaN.
pub(crate) fn round_f64(x: f64, fmt: Format) -> u32 {
    let sign = if x.is_sign_negative() { 1u32 << (fmt.man + fmt.exp) } else { 0 };
    if x.is_nan() {
        return fmt.nan;
    }
    let inf = ((1u32 << fmt.exp) - 1) << fmt.man;
    let a = x.abs();
    let emin = 1 - fmt.bias;
    // Round with an unbounded exponent range above, gradual underflow below.
    let r = if a.is_infinite() {
        a
    } else {
        let q = exponent(a).max(emin) - fmt.man as i32;
        (a * pow2(-q)).round_ties_even() * pow2(q)
    };
    if r > fmt.max {
        return sign | if fmt.saturate { encode_exact(fmt.max, fmt) } else { inf };
    }
    sign | encode_exact(r, fmt)
}

/// Bit pattern of a non-negative value that `fmt` represents exactly.
fn encode_exact(r: f64, fmt: Format) -> u32 {
    if r == 0.0 {
        return 0;
    }
    let emin = 1 - fmt.bias;
    let e = exponent(r);
    if e < emin {
        // Subnormal: r = m * 2^(emin - man).
        (r * pow2(fmt.man as i32 - emin)) as u32
    } else {
        let m = (r * pow2(fmt.man as i32 - e)) as u32 - (1 << fmt.man);
        (((e + fmt.bias) as u32) << fmt.man) | m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn matches_half_on_exact_and_f32_inputs() {
        // For inputs that are already f32, half's (f32 → narrow) rounding is a single rounding.
        let mut s = 0x1234_5678u32;
        for _ in 0..200_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = f32::from_bits(s);
            if x.is_nan() {
                assert_eq!(round_f64(f64::from(x), Format::F16), 0x7E00);
                continue;
            }
            assert_eq!(round_f64(f64::from(x), Format::F16), u32::from(f16::from_f32(x).to_bits()), "{x:e}");
            assert_eq!(round_f64(f64::from(x), Format::BF16), u32::from(bf16::from_f32(x).to_bits()), "{x:e}");
        }
        for b in 0..=u16::MAX {
            let h = f16::from_bits(b);
            if !h.is_nan() {
                assert_eq!(round_f64(h.to_f64(), Format::F16), u32::from(b));
            }
            let h = bf16::from_bits(b);
            if !h.is_nan() {
                assert_eq!(round_f64(h.to_f64(), Format::BF16), u32::from(b));
            }
        }
    }

    #[test]
    fn single_rounding_from_f64() {
        // 1 + 2^-11 + 2^-40 is just above the f16 midpoint between 1 and 1 + 2^-10; going through
        // f32 first would land exactly on the midpoint and round down to 1.0.
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(round_f64(x, Format::F16), 0x3C01);
        assert_eq!(round_f64(1.0 + 2f64.powi(-11), Format::F16), 0x3C00);
        // Overflow: IEEE formats go to infinity at max + half ulp, fp8 formats saturate.
        assert_eq!(round_f64(65519.99, Format::F16), 0x7BFF);
        assert_eq!(round_f64(65520.0, Format::F16), 0x7C00);
        assert_eq!(round_f64(-1e300, Format::BF16), 0xFF80);
        assert_eq!(round_f64(f64::INFINITY, Format::E4M3), 0x7E);
        assert_eq!(round_f64(f64::NEG_INFINITY, Format::E5M2), 0xFB);
        assert_eq!(round_f64(-0.0, Format::E4M3), 0x80);
        assert_eq!(round_f64(5e-324, Format::BF16), 0);
        assert_eq!(round_f64(f64::NAN, Format::E5M2), 0x7F);
    }
}
