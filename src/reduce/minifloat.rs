//! Branch-free conversions between `f32` and the narrow float formats (f16, bf16, fp8).
//!
//! The reduction kernels widen every narrow element to `f32`, compute, and narrow once. These
//! converters use only integer arithmetic, one float add/sub, and selects, so loops over them
//! auto-vectorise (the `half` crate's scalar conversions branch per element, and its slice
//! conversions go through a non-inlined call per 8 elements). Widening builds subnormals by an
//! exact subtraction of normal numbers, never by multiplying an `f32` subnormal (which costs a
//! microcode assist on some x86 CPUs).
//!
//! Narrowing rounds to nearest, ties to even. Overflow goes to ±infinity (f16, bf16) or
//! saturates to ±max finite (fp8, CUDA's `__NV_SATFINITE`); NaN becomes a canonical quiet NaN.
//! The tests check f16/bf16 bit-for-bit against the `half` crate.

/// Parameters of a narrow format handled by [`widen`] and [`narrow`].
#[derive(Clone, Copy)]
pub(crate) struct Fmt {
    /// Total bits (8 or 16).
    bits: u32,
    /// Mantissa (fraction) bits.
    man: u32,
    /// Exponent bias.
    bias: u32,
    /// IEEE-style specials: an all-ones exponent encodes infinity (mantissa 0) or NaN. When
    /// false (E4M3FN) only the all-ones magnitude is NaN and there is no infinity.
    ieee: bool,
    /// `f32` magnitude bit pattern from which narrowing returns `overflow_code` (|x| ≥ it).
    overflow_bits: u32,
    /// Magnitude code for overflow: infinity, or max finite when saturating.
    overflow_code: u32,
    /// Code returned for a NaN input (no sign).
    nan: u32,
}

/// IEEE binary16: overflow (|x| ≥ 65520 after rounding) to ±infinity.
pub(crate) const F16: Fmt =
    Fmt { bits: 16, man: 10, bias: 15, ieee: true, overflow_bits: 0x4780_0000, overflow_code: 0x7C00, nan: 0x7E00 };
/// OCP E4M3FN, saturating at ±448 (`0x43E0_0000` is 448.0).
pub(crate) const E4M3: Fmt =
    Fmt { bits: 8, man: 3, bias: 7, ieee: false, overflow_bits: 0x43E0_0000, overflow_code: 0x7E, nan: 0x7F };
/// OCP E5M2, saturating at ±57344 (`0x4760_0000` is 57344.0).
pub(crate) const E5M2: Fmt =
    Fmt { bits: 8, man: 2, bias: 15, ieee: true, overflow_bits: 0x4760_0000, overflow_code: 0x7B, nan: 0x7F };

/// Widens a narrow code (in the low `f.bits` bits of `code`) to `f32`, exactly.
#[inline(always)]
pub(crate) fn widen(code: u32, f: Fmt) -> f32 {
    let abs_mask = (1 << (f.bits - 1)) - 1;
    let abs = code & abs_mask;
    let sign = (code >> (f.bits - 1)) << 31;
    let shift = 23 - f.man;
    let rebias = (127 - f.bias) << 23;
    // Normal: move the fields into place and rebias the exponent.
    let normal = (abs << shift) + rebias;
    // Subnormal: read the mantissa as `1.m * 2^emin` and subtract `2^emin` (exact, no
    // subnormal operands).
    let min_normal = rebias + (1 << 23);
    let sub = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(min_normal)).to_bits();
    // Infinity / NaN (IEEE formats): all-ones f32 exponent, payload kept, NaN made quiet.
    let inf_code = abs_mask >> f.man << f.man;
    let quiet = if abs > inf_code { 0x0040_0000 } else { 0 };
    let special = (abs << shift) | 0x7F80_0000 | quiet;
    let mag = if f.ieee && abs >= inf_code {
        special
    } else if !f.ieee && abs == abs_mask {
        0x7FC0_0000
    } else if abs < (1 << f.man) {
        sub
    } else {
        normal
    };
    f32::from_bits(mag | sign)
}

/// Narrows an `f32` to `f`: nearest even, overflow to `f.overflow_code`, NaN to `f.nan`.
#[inline(always)]
pub(crate) fn narrow(x: f32, f: Fmt) -> u32 {
    let bits = x.to_bits();
    let sign = (bits >> 31) << (f.bits - 1);
    let abs = bits & 0x7FFF_FFFF;
    let shift = 23 - f.man;
    let rebias = (127 - f.bias) << 23;
    let min_normal_bits = (1 << 23) + rebias;

    // Normal range: rebias the exponent, then round the dropped bits to nearest, ties to even
    // (a carry into the exponent is the correct next binade, or infinity for f16).
    let rebiased = abs.wrapping_sub(rebias);
    let lsb = (rebiased >> shift) & 1;
    let normal = rebiased.wrapping_add((1 << (shift - 1)) - 1 + lsb) >> shift;

    // Subnormal range: adding 2^k whose ulp equals the narrow subnormal quantum makes the FPU
    // round (nearest even) at exactly the right bit; the difference of bit patterns is the code.
    let magic = f32::from_bits((127 - f.bias + shift + 1) << 23);
    let sub = (f32::from_bits(abs) + magic).to_bits().wrapping_sub(magic.to_bits());

    let mag = if abs >= f.overflow_bits {
        f.overflow_code
    } else if abs >= min_normal_bits {
        normal
    } else {
        sub
    };
    if abs > 0x7F80_0000 {
        f.nan
    } else {
        mag | sign
    }
}

/// Widens bfloat16 bits to `f32` (exact; the upper half of an `f32`).
#[inline(always)]
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Narrows an `f32` to bfloat16 bits: nearest even, overflow to ±infinity, NaN to a quiet NaN
/// with the sign and upper payload kept (as `half::bf16::from_f32`).
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    (if bits & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded }) as u16
}

/// Widens IEEE binary16 bits to `f32` (exact).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    widen(u32::from(h), F16)
}

/// Narrows an `f32` to IEEE binary16 bits (nearest even, overflow to ±infinity, NaN → `0x7E00`).
#[inline(always)]
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    narrow(x, F16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn same(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    #[test]
    fn widening_matches_half_exhaustively() {
        for b in 0..=u16::MAX {
            assert!(same(f16_to_f32(b), f16::from_bits(b).to_f32()), "f16 {b:#06x}");
            assert!(same(bf16_to_f32(b), bf16::from_bits(b).to_f32()), "bf16 {b:#06x}");
        }
    }

    /// Every 16-bit value, the midpoints between neighbours and one f32 ulp either side, plus a
    /// sweep over all f32 magnitudes: narrowing matches `half` bit for bit (NaNs: any NaN).
    #[test]
    fn narrowing_matches_half() {
        let mut probes: Vec<f32> = (0..=0x7F80_0000u32).step_by(997).map(f32::from_bits).collect();
        for b in 0..0x7C00u16 {
            let (x, y) = (f16::from_bits(b).to_f32(), f16::from_bits(b + 1).to_f32());
            let mid = (x + y) / 2.0;
            probes.extend([x, mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().saturating_sub(1))]);
        }
        for b in 0..0x7F80u16 {
            let x = bf16::from_bits(b).to_f32();
            let mid = f32::from_bits(x.to_bits() + 0x8000);
            probes.extend([x, mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
        }
        probes.extend([f32::INFINITY, f32::NAN, f32::MAX, 65504.0, 65519.99, 65520.0, 1e-8, f32::from_bits(1)]);
        for p in probes {
            for x in [p, -p] {
                let (got, want) = (f32_to_f16(x), f16::from_f32(x));
                assert!(got == want.to_bits() || (want.is_nan() && f16::from_bits(got).is_nan()), "f16 {x:e}");
                let (got, want) = (f32_to_bf16(x), bf16::from_f32(x));
                assert!(got == want.to_bits() || (want.is_nan() && bf16::from_bits(got).is_nan()), "bf16 {x:e}");
            }
        }
    }
}
