//! 8-bit floating-point conversions (OCP FP8 formats as NCCL and CUDA define them).
//!
//! * **E4M3** (`ncclFloat8e4m3`, CUDA `__nv_fp8_e4m3`, the OCP "E4M3FN" variant): 1 sign bit,
//!   4 exponent bits (bias 7), 3 mantissa bits. There are no infinities; `0x7F`/`0xFF` are
//!   NaN, and the largest finite magnitude is 448 (`0x7E`).
//! * **E5M2** (`ncclFloat8e5m2`, CUDA `__nv_fp8_e5m2`): 1 sign bit, 5 exponent bits (bias 15),
//!   2 mantissa bits, IEEE-like: exponent 31 with mantissa 0 is ±infinity, non-zero mantissa NaN.
//!   The largest finite magnitude is 57344 (`0x7B`).
//!
//! Narrowing (`f32 → fp8`) matches CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ..)`:
//! round to nearest, ties to even; finite values beyond the largest finite value and ±infinity
//! saturate to ±max finite; subnormals are rounded correctly; a NaN input gives the canonical
//! NaN `0x7F` for both formats (CUDA canonicalises the `float` NaN to `0x7FFFFFFF` before
//! narrowing, which yields `0x7F` in E5M2 as well). Widening is exact; NaN codes widen to a
//! quiet `f32` NaN.
//!
//! Both directions are branch-free (shared code in the private `minifloat` module), so loops over them
//! auto-vectorise.

use super::minifloat::{narrow, widen, E4M3, E5M2};

/// Canonical NaN code produced by narrowing a NaN (both formats).
pub const NAN_CODE: u8 = 0x7F;

/// Decodes an E4M3 (E4M3FN) code to `f32`. Exact; `0x7F`/`0xFF` give a quiet NaN.
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    widen(u32::from(code), E4M3)
}

/// Decodes an E5M2 code to `f32`. Exact; `0x7C`/`0xFC` are ±infinity, `0x7D..=0x7F` (and their
/// negatives) give a quiet NaN.
#[inline(always)]
pub fn e5m2_to_f32(code: u8) -> f32 {
    widen(u32::from(code), E5M2)
}

/// Narrows an `f32` to E4M3 (E4M3FN): round to nearest even, saturating to ±448 (also for
/// ±infinity), NaN → `0x7F`. Matches `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    narrow(x, E4M3) as u8
}

/// Narrows an `f32` to E5M2: round to nearest even, saturating to ±57344 (also for ±infinity),
/// NaN → `0x7F`. Matches `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)`.
#[inline(always)]
pub fn f32_to_e5m2(x: f32) -> u8 {
    narrow(x, E5M2) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::convert::{round_f64, Format};

    /// Independent decoder straight from the format definition.
    fn formula(code: u8, man: i32, bias: i32, e4m3: bool) -> f64 {
        let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((code & 0x7F) >> man);
        let m = f64::from(code & ((1 << man) - 1));
        let emax = (1 << (7 - man)) - 1;
        if e4m3 && code & 0x7F == 0x7F {
            return f64::NAN;
        }
        if !e4m3 && e == emax {
            return if m == 0.0 { s * f64::INFINITY } else { f64::NAN };
        }
        if e == 0 {
            s * m * 2f64.powi(1 - bias - man)
        } else {
            s * (1.0 + m / f64::from(1 << man)) * 2f64.powi(e - bias)
        }
    }

    fn same(a: f64, b: f64) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    #[test]
    fn decode_matches_formula_and_roundtrips() {
        for c in 0..=255u8 {
            let d = e4m3_to_f32(c);
            assert!(same(f64::from(d), formula(c, 3, 7, true)), "e4m3 {c:#04x}: {d}");
            if d.is_nan() {
                assert_eq!(c & 0x7F, 0x7F);
                assert_eq!(f32_to_e4m3(d), NAN_CODE);
            } else {
                assert_eq!(f32_to_e4m3(d), c, "e4m3 roundtrip {c:#04x}");
            }
            let d = e5m2_to_f32(c);
            assert!(same(f64::from(d), formula(c, 2, 15, false)), "e5m2 {c:#04x}: {d}");
            if d.is_nan() {
                assert!(c & 0x7F > 0x7C);
                assert_eq!(f32_to_e5m2(d), NAN_CODE);
            } else if d.is_infinite() {
                assert_eq!(f32_to_e5m2(d), (c & 0x80) | 0x7B, "inf saturates");
            } else {
                assert_eq!(f32_to_e5m2(d), c, "e5m2 roundtrip {c:#04x}");
            }
        }
    }

    #[test]
    fn special_values() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
        assert_eq!(e5m2_to_f32(0x7C), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0xFC), f32::NEG_INFINITY);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        // Saturation (SATFINITE), including infinities.
        for x in [448.0f32, 449.0, 464.0, 465.0, 1e9, f32::MAX, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xFE, "{x}");
        }
        for x in [57344.0f32, 61440.0, 65536.0, 1e30, f32::INFINITY] {
            assert_eq!(f32_to_e5m2(x), 0x7B, "{x}");
            assert_eq!(f32_to_e5m2(-x), 0xFB, "{x}");
        }
        // NaN of either sign → canonical 0x7F.
        for x in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFFC0_1234)] {
            assert_eq!(f32_to_e4m3(x), 0x7F);
            assert_eq!(f32_to_e5m2(x), 0x7F);
        }
        // Signed zeros and f32 subnormals.
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e5m2(0.0), 0x00);
        assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00);
        assert_eq!(f32_to_e5m2(-f32::from_bits(0x007F_FFFF)), 0x80);
    }

    #[test]
    fn ties_to_even() {
        // E4M3: between 1.0 (0x38) and 1.125 (0x39) the midpoint goes to the even 0x38;
        // between 1.125 and 1.25 (0x3A) it goes to 0x3A.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(f32_to_e4m3(1.0625 + 1e-6), 0x39);
        assert_eq!(f32_to_e4m3(-1.1875), 0xBA);
        // 432 is between 416 (0x7D) and 448 (0x7E): tie to even 448.
        assert_eq!(f32_to_e4m3(432.0), 0x7E);
        assert_eq!(f32_to_e4m3(431.9), 0x7D);
        // Subnormals: quantum 2^-9. 0.5 q → 0 (even), 1.5 q → 2 q, 2.5 q → 2 q, 7.5 q → 8 q = min normal.
        let q = 2f32.powi(-9);
        assert_eq!(f32_to_e4m3(0.5 * q), 0x00);
        assert_eq!(f32_to_e4m3(0.5001 * q), 0x01);
        assert_eq!(f32_to_e4m3(1.5 * q), 0x02);
        assert_eq!(f32_to_e4m3(2.5 * q), 0x02);
        assert_eq!(f32_to_e4m3(7.5 * q), 0x08);
        // E5M2: 1.0 (0x3C) .. 1.25 (0x3D): 1.125 → 0x3C; 1.375 → 0x3E.
        assert_eq!(f32_to_e5m2(1.125), 0x3C);
        assert_eq!(f32_to_e5m2(1.375), 0x3E);
        let q = 2f32.powi(-16);
        assert_eq!(f32_to_e5m2(0.5 * q), 0x00);
        assert_eq!(f32_to_e5m2(1.5 * q), 0x02);
        assert_eq!(f32_to_e5m2(3.5 * q), 0x04);
        // 53248 is between 49152 (0x7A) and 57344 (0x7B): tie to even 0x7A.
        assert_eq!(f32_to_e5m2(53248.0), 0x7A);
    }

    /// Every fp8 value, the midpoints between neighbours, and points one f32 ulp either side,
    /// checked against the independent f64 rounding in `convert`.
    #[test]
    fn narrowing_matches_reference_around_every_code() {
        type Case = (fn(u8) -> f32, fn(f32) -> u8, Format);
        let cases: [Case; 2] = [(e4m3_to_f32, f32_to_e4m3, Format::E4M3), (e5m2_to_f32, f32_to_e5m2, Format::E5M2)];
        for (dec, enc, fmt) in cases {
            let mut probes = Vec::new();
            for c in 0..0x7Fu8 {
                let (a, b) = (dec(c), dec(c + 1));
                if !a.is_finite() || !b.is_finite() {
                    continue;
                }
                let mid = (a + b) / 2.0; // exact: fp8 values have few bits
                for v in [a, mid, b] {
                    probes.extend([v, f32::from_bits(v.to_bits() + 1)]);
                    if v > 0.0 {
                        probes.push(f32::from_bits(v.to_bits() - 1));
                    }
                }
            }
            // A coarse sweep over all f32 magnitudes too.
            probes.extend((0..=0x7F80_0000u32).step_by(4099).map(f32::from_bits));
            for x in probes {
                for x in [x, -x] {
                    let want = round_f64(f64::from(x), fmt) as u8;
                    assert_eq!(enc(x), want, "{x:e} ({:#010x})", x.to_bits());
                }
            }
        }
    }
}
