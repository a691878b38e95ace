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
//! All functions take raw little-endian `f32` bytes of any alignment; they work block by block
//! through stack arrays, with no branch per element on the way (loops over `chunks_exact` that
//! the compiler vectorises).
#![forbid(unsafe_code)]

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
            Encoding::Bf16 => {
                for (s, d) in src.chunks(4 * BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
                    let mut x = [0f32; BLOCK];
                    let k = load(s, &mut x);
                    encode_bf16(&x[..k], d);
                }
            }
            Encoding::Fp8 | Encoding::Int8 => {
                for (s, d) in src.chunks(4 * BLOCK).zip(dst.chunks_mut(4 + BLOCK)) {
                    let mut x = [0f32; BLOCK];
                    let k = load(s, &mut x);
                    let (scale, codes) = d.split_at_mut(4);
                    let s =
                        if self == Encoding::Fp8 { encode_fp8(&x[..k], codes) } else { encode_int8(&x[..k], codes) };
                    scale.copy_from_slice(&s.to_le_bytes());
                }
            }
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
        debug_assert_eq!(src.len(), self.size(dst.len() / 4));
        let (unit, head) = match self {
            Encoding::Exact => (4, 0),
            Encoding::Bf16 => (2, 0),
            Encoding::Fp8 | Encoding::Int8 => (1, 4),
        };
        for (s, d) in src.chunks(head + unit * BLOCK).zip(dst.chunks_mut(4 * BLOCK)) {
            let mut x = [0f32; BLOCK];
            let k = d.len() / 4;
            match self {
                Encoding::Exact => {
                    load(s, &mut x);
                }
                Encoding::Bf16 => decode_bf16(s, &mut x[..k]),
                Encoding::Fp8 => {
                    let table = fp8_table(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
                    for (v, &c) in x[..k].iter_mut().zip(&s[4..]) {
                        *v = table[usize::from(c)];
                    }
                }
                Encoding::Int8 => decode_int8(f32::from_le_bytes([s[0], s[1], s[2], s[3]]), &s[4..], &mut x[..k]),
            }
            if add {
                let mut a = [0f32; BLOCK];
                load(d, &mut a);
                x[..k].iter_mut().zip(&a[..k]).for_each(|(v, a)| *v += *a);
            }
            store(&x[..k], d);
        }
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

/// Reads the little-endian `f32`s of `s` (at most [`BLOCK`]) into `x`; returns how many.
#[inline]
fn load(s: &[u8], x: &mut [f32; BLOCK]) -> usize {
    let k = s.len() / 4;
    for (v, b) in x.iter_mut().zip(s.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    k
}

/// Writes `x` as little-endian `f32` bytes into `d`.
#[inline]
fn store(x: &[f32], d: &mut [u8]) {
    for (v, b) in x.iter().zip(d.chunks_exact_mut(4)) {
        b.copy_from_slice(&v.to_le_bytes());
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

fn encode_bf16(x: &[f32], d: &mut [u8]) {
    for (v, b) in x.iter().zip(d.chunks_exact_mut(2)) {
        b.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}

fn decode_bf16(s: &[u8], x: &mut [f32]) {
    for (v, b) in x.iter_mut().zip(s.chunks_exact(2)) {
        *v = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Largest magnitude among the finite elements of `x` (0 when there is none), and whether
/// any element is not finite.
#[inline]
fn finite_max(x: &[f32]) -> (f32, bool) {
    // Magnitudes compare as integers; a non-finite one counts as 0.
    let (m, bad) = x.iter().fold((0u32, 0u32), |(m, bad), v| {
        let a = v.to_bits() & 0x7FFF_FFFF;
        let finite = a < 0x7F80_0000;
        (m.max(if finite { a } else { 0 }), bad | u32::from(!finite))
    });
    (f32::from_bits(m), bad != 0)
}

/// Overwrites the codes of the non-finite elements of `x` with the reserved ones.
#[cold]
fn mark_specials(x: &[f32], codes: &mut [u8], nan: u8, pinf: u8, ninf: u8) {
    for (v, c) in x.iter().zip(codes.iter_mut()) {
        if !v.is_finite() {
            *c = if v.is_nan() {
                nan
            } else if *v > 0.0 {
                pinf
            } else {
                ninf
            };
        }
    }
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

/// Encodes one block as fp8; returns its scale.
fn encode_fp8(x: &[f32], codes: &mut [u8]) -> f32 {
    let (m, bad) = finite_max(x);
    let (scale, pre, inv) = scaling(m, FP8_QMAX);
    for (v, c) in x.iter().zip(codes.iter_mut()) {
        *c = e4m3_code((v * pre) * inv);
    }
    if bad {
        mark_specials(x, codes, 0x7F, 0x7E, 0xFE);
    }
    scale
}

/// Encodes one block as int8; returns its scale.
fn encode_int8(x: &[f32], codes: &mut [u8]) -> f32 {
    let (m, bad) = finite_max(x);
    let (scale, pre, inv) = scaling(m, INT8_QMAX);
    for (v, c) in x.iter().zip(codes.iter_mut()) {
        // A non-finite element's code is garbage here and overwritten below.
        *c = rne_byte(((v * pre) * inv).clamp(-INT8_QMAX, INT8_QMAX));
    }
    if bad {
        mark_specials(x, codes, 0x80, 0x7F, 0x81);
    }
    scale
}

/// The value of every fp8 code in a block with `scale`: `code value × scale`, the reserved
/// codes as their infinity or NaN.
fn fp8_table(scale: f32) -> [f32; 256] {
    static VALUES: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    let values = VALUES.get_or_init(|| std::array::from_fn(|c| e4m3_value(c as u8)));
    let mut t = [0f32; 256];
    t.iter_mut().zip(values).for_each(|(t, v)| *t = v * scale);
    t[0x7E] = f32::INFINITY;
    t[0xFE] = f32::NEG_INFINITY;
    t[0x7F] = f32::NAN;
    t[0xFF] = f32::NAN;
    t
}

/// Decodes one int8 block: `code × scale`, the reserved codes as their infinity or NaN.
fn decode_int8(scale: f32, codes: &[u8], x: &mut [f32]) {
    for (v, &c) in x.iter_mut().zip(codes) {
        let q = f32::from(c as i8) * scale;
        let r = if c == 0x7F { f32::INFINITY } else { q };
        let r = if c == 0x81 { f32::NEG_INFINITY } else { r };
        *v = if c == 0x80 { f32::NAN } else { r };
    }
}

/// The value of a finite e4m3 code (exact).
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
