//! The codec's loops, written so that the compiler vectorises them: [`LANES`] elements at a
//! time through fixed-size arrays, every per-element decision a select (no branch), the
//! non-finite check done once per block (a block without one never looks at them again).
//!
//! Every function here is `#[inline(always)]` and safe; [`super::dispatch`] instantiates them
//! twice on x86-64, once for the baseline target and once inside an AVX2 `#[target_feature]`
//! function, so the same source gives both. The arithmetic is plain IEEE `f32` in both (Rust
//! neither contracts to FMA nor flushes subnormals), so the two are bit-identical to each other
//! and to the per-element definitions in the parent module ([`super::f32_to_bf16`],
//! [`super::e4m3_code`], [`super::e4m3_value`]); the tests check that over random bits.
use super::{bf16_to_f32, e4m3_code, f32_to_bf16, rne_byte, scaling, BLOCK, FP8_QMAX, INT8_QMAX};

/// Elements per inner step (16 `f32` = two AVX2 registers).
pub(super) const LANES: usize = 16;

/// The `LANES` little-endian `u32`s of `c`.
#[inline(always)]
fn words(c: &[u8]) -> [u32; LANES] {
    let c: &[u8; 4 * LANES] = c.try_into().expect("a chunk of LANES words");
    // A plain loop, not `std::array::from_fn`: the latter may stay an out-of-line scalar
    // function outside the AVX2 instantiation (measured: a fifth of a leader's CPU time).
    let mut x = [0u32; LANES];
    for (j, v) in x.iter_mut().enumerate() {
        *v = u32::from_le_bytes([c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]]);
    }
    x
}

/// Writes `x` as `LANES` little-endian `f32`s into `d`.
#[inline(always)]
fn put(x: &[f32; LANES], d: &mut [u8]) {
    let d: &mut [u8; 4 * LANES] = d.try_into().expect("a chunk of LANES words");
    for (j, v) in x.iter().enumerate() {
        d[4 * j..4 * j + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// The `f32` at byte offset `4i` of `s` (the tails shorter than `LANES`).
#[inline(always)]
fn word(s: &[u8]) -> u32 {
    u32::from_le_bytes([s[0], s[1], s[2], s[3]])
}

/// bf16 encoding of the `f32` bytes `src` into `dst` (`src.len() / 2` bytes).
#[inline(always)]
pub(super) fn encode_bf16(src: &[u8], dst: &mut [u8]) {
    let mut s = src.chunks_exact(4 * LANES);
    let mut d = dst.chunks_exact_mut(2 * LANES);
    for (s, d) in (&mut s).zip(&mut d) {
        let x = words(s);
        let d: &mut [u8; 2 * LANES] = d.try_into().expect("a chunk of LANES halves");
        for j in 0..LANES {
            d[2 * j..2 * j + 2].copy_from_slice(&f32_to_bf16(f32::from_bits(x[j])).to_le_bytes());
        }
    }
    for (s, d) in s.remainder().chunks_exact(4).zip(d.into_remainder().chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(f32::from_bits(word(s))).to_le_bytes());
    }
}

/// Largest magnitude (as bits) among the finite elements of the `f32` bytes `s`, 0 when there
/// is none, and whether any element is not finite.
#[inline(always)]
fn finite_max(s: &[u8]) -> (f32, bool) {
    let mut m = [0u32; LANES];
    let mut bad = [0u32; LANES];
    let mut it = s.chunks_exact(4 * LANES);
    for c in &mut it {
        let x = words(c);
        for j in 0..LANES {
            let a = x[j] & 0x7FFF_FFFF;
            let finite = a < 0x7F80_0000;
            m[j] = m[j].max(if finite { a } else { 0 });
            bad[j] |= u32::from(!finite);
        }
    }
    for c in it.remainder().chunks_exact(4) {
        let a = word(c) & 0x7FFF_FFFF;
        let finite = a < 0x7F80_0000;
        m[0] = m[0].max(if finite { a } else { 0 });
        bad[0] |= u32::from(!finite);
    }
    let m = m.iter().fold(0, |a, &b| a.max(b));
    (f32::from_bits(m), bad.iter().any(|&b| b != 0))
}

/// One block format: fp8 or int8, its largest scaled magnitude and its reserved codes.
#[derive(Clone, Copy)]
pub(super) struct Quant {
    fp8: bool,
    qmax: f32,
    nan: u8,
    pinf: u8,
    ninf: u8,
}

/// fp8 e4m3 codes (docs/COMPRESSION.md).
pub(super) const FP8: Quant = Quant { fp8: true, qmax: FP8_QMAX, nan: 0x7F, pinf: 0x7E, ninf: 0xFE };
/// Symmetric int8 codes.
pub(super) const INT8: Quant = Quant { fp8: false, qmax: INT8_QMAX, nan: 0x80, pinf: 0x7F, ninf: 0x81 };

/// int8 code of a scaled value (`|v| <= INT8_QMAX` for finite input; clamped anyway).
#[inline(always)]
pub(super) fn int8_code(v: f32) -> u8 {
    rne_byte(v.clamp(-INT8_QMAX, INT8_QMAX))
}

/// Encodes the `f32` bytes `src` block by block with `q` into `dst`.
#[inline(always)]
pub(super) fn encode_blocks(q: Quant, src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks(4 * BLOCK).zip(dst.chunks_mut(4 + BLOCK)) {
        let (head, codes) = d.split_at_mut(4);
        let (m, bad) = finite_max(s);
        let (scale, pre, inv) = scaling(m, q.qmax);
        if q.fp8 {
            quantise(s, codes, pre, inv, e4m3_code);
        } else {
            quantise(s, codes, pre, inv, int8_code);
        }
        if bad {
            mark_specials(s, codes, q);
        }
        head.copy_from_slice(&scale.to_le_bytes());
    }
}

/// `codes[i] = code(x[i] * pre * inv)` over one block (a non-finite element's code is garbage,
/// overwritten by [`mark_specials`]).
#[inline(always)]
fn quantise(s: &[u8], codes: &mut [u8], pre: f32, inv: f32, code: impl Fn(f32) -> u8) {
    let mut it = s.chunks_exact(4 * LANES);
    let mut out = codes.chunks_exact_mut(LANES);
    for (c, o) in (&mut it).zip(&mut out) {
        let x = words(c);
        let o: &mut [u8; LANES] = o.try_into().expect("a chunk of LANES codes");
        for j in 0..LANES {
            o[j] = code((f32::from_bits(x[j]) * pre) * inv);
        }
    }
    for (c, o) in it.remainder().chunks_exact(4).zip(out.into_remainder()) {
        *o = code((f32::from_bits(word(c)) * pre) * inv);
    }
}

/// Overwrites the codes of the non-finite elements of one block with the reserved ones.
#[cold]
#[inline(never)]
fn mark_specials(s: &[u8], codes: &mut [u8], q: Quant) {
    for (c, o) in s.chunks_exact(4).zip(codes.iter_mut()) {
        let v = f32::from_bits(word(c));
        if !v.is_finite() {
            *o = if v.is_nan() {
                q.nan
            } else if v > 0.0 {
                q.pinf
            } else {
                q.ninf
            };
        }
    }
}

/// `e4m3_value(c) × scale`, the reserved codes as their infinity or NaN, computed from the
/// code's bits (the value of a finite code is exact in `f32`: subnormal codes are `m·2⁻⁹`, the
/// others have the code's exponent rebiased by 120 and its three mantissa bits on top).
#[inline(always)]
fn fp8_value(c: u32, scale: f32) -> f32 {
    let mag = c & 0x7F;
    let sign = (c & 0x80) << 24;
    let normal = f32::from_bits((mag << 20) + (120 << 23));
    let sub = mag as f32 * (1.0 / 512.0);
    let v = f32::from_bits((if mag < 8 { sub } else { normal }).to_bits() | sign) * scale;
    let inf = f32::from_bits(0x7F80_0000 | sign);
    let v = if mag == 0x7E { inf } else { v };
    if mag == 0x7F {
        f32::NAN
    } else {
        v
    }
}

/// `code × scale` for an int8 code, the reserved codes as their infinity or NaN (`0x7F` +inf,
/// `0x80` NaN, `0x81` −inf).
#[inline(always)]
fn int8_value(c: u32, scale: f32) -> f32 {
    let q = ((c << 24) as i32 >> 24) as f32 * scale;
    let inf = f32::from_bits(0x7F80_0000 | ((c & 0x80) << 24));
    let r = if c.wrapping_sub(0x7F) <= 2 { inf } else { q };
    if c == 0x80 {
        f32::NAN
    } else {
        r
    }
}

/// Adds the `f32`s of `o` into `x` when `add`, then writes `x` over `o`.
#[inline(always)]
fn finish(x: &mut [f32; LANES], o: &mut [u8], add: bool) {
    if add {
        let a = words(o);
        x.iter_mut().zip(a).for_each(|(v, a)| *v += f32::from_bits(a));
    }
    put(x, o);
}

/// The same for one element (the tails).
#[inline(always)]
fn finish1(v: f32, o: &mut [u8], add: bool) {
    let v = if add { v + f32::from_bits(word(o)) } else { v };
    o.copy_from_slice(&v.to_le_bytes());
}

/// Decodes bf16 `src` into the `f32` bytes `dst` (adding into them when `add`).
#[inline(always)]
pub(super) fn decode_bf16(src: &[u8], dst: &mut [u8], add: bool) {
    let mut it = src.chunks_exact(2 * LANES);
    let mut out = dst.chunks_exact_mut(4 * LANES);
    for (c, o) in (&mut it).zip(&mut out) {
        let c: &[u8; 2 * LANES] = c.try_into().expect("a chunk of LANES halves");
        let mut x = [0f32; LANES];
        for (j, v) in x.iter_mut().enumerate() {
            *v = bf16_to_f32(u16::from_le_bytes([c[2 * j], c[2 * j + 1]]));
        }
        finish(&mut x, o, add);
    }
    for (c, o) in it.remainder().chunks_exact(2).zip(out.into_remainder().chunks_exact_mut(4)) {
        finish1(bf16_to_f32(u16::from_le_bytes([c[0], c[1]])), o, add);
    }
}

/// Decodes the blocks of `src` (format `q`) into the `f32` bytes `dst`
/// (adding into them when `add`).
#[inline(always)]
pub(super) fn decode_blocks(q: Quant, src: &[u8], dst: &mut [u8], add: bool) {
    for (s, d) in src.chunks(4 + BLOCK).zip(dst.chunks_mut(4 * BLOCK)) {
        let scale = f32::from_bits(word(s));
        if q.fp8 {
            decode_codes(&s[4..], d, scale, add, fp8_value);
        } else {
            decode_codes(&s[4..], d, scale, add, int8_value);
        }
    }
}

/// `d[i] (+)= value(codes[i], scale)` over one block.
#[inline(always)]
fn decode_codes(codes: &[u8], d: &mut [u8], scale: f32, add: bool, value: impl Fn(u32, f32) -> f32) {
    let mut it = codes.chunks_exact(LANES);
    let mut out = d.chunks_exact_mut(4 * LANES);
    for (c, o) in (&mut it).zip(&mut out) {
        let c: &[u8; LANES] = c.try_into().expect("a chunk of LANES codes");
        let mut x = [0f32; LANES];
        for (v, &c) in x.iter_mut().zip(c) {
            *v = value(u32::from(c), scale);
        }
        finish(&mut x, o, add);
    }
    for (&c, o) in it.remainder().iter().zip(out.into_remainder().chunks_exact_mut(4)) {
        finish1(value(u32::from(c), scale), o, add);
    }
}

/// Copies (or adds, when `add`) the `f32` bytes `src` into `dst`.
#[inline(always)]
pub(super) fn decode_exact(src: &[u8], dst: &mut [u8], add: bool) {
    let mut it = src.chunks_exact(4 * LANES);
    let mut out = dst.chunks_exact_mut(4 * LANES);
    for (c, o) in (&mut it).zip(&mut out) {
        let mut x = words(c).map(f32::from_bits);
        finish(&mut x, o, add);
    }
    for (c, o) in it.remainder().chunks_exact(4).zip(out.into_remainder().chunks_exact_mut(4)) {
        finish1(f32::from_bits(word(c)), o, add);
    }
}
