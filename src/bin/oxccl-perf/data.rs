//! Test data for the correctness check.
//!
//! Every input element is a deterministic function of (rank, index, seed), so each rank can
//! compute every other rank's input and derive the expected result on its own, in `f64`. The
//! element codec below is deliberately independent of the library's (`oxccl::reduce`): a bug in
//! the library's conversions must not be able to hide itself by producing the same wrong values
//! on both sides of the comparison.
//!
//! Value sets (all exactly representable in every type, fp8 included):
//! * sum / avg / max / min / copies: integers in `[-A, A]` (signed and float types) or `[0, 2A]`
//!   (unsigned types), `A = 5`, lowered for sum/avg so that `nranks` of them cannot overflow the
//!   type (int8: 127, uint8: 255, e4m3: 448, e5m2: 57344, half: 65504);
//! * prod: per element one "special" rank contributes a value from {-2,-1,1,2} ({1,2,3} for
//!   unsigned types), every other rank ±1 (1 for unsigned), so every product has magnitude ≤ 3.
//!
//! Tolerance: integer results, and max/min/prod for every type, must match exactly. Float sum and
//! avg may round at every step of the reduction, in any order; with eps the type's machine epsilon
//! (e4m3 2^-3, e5m2 2^-2, half 2^-10, bfloat16 2^-7, float 2^-23, double 2^-52) the accepted error
//! is `|got - exact| <= nranks * eps * S`, where `S = sum over ranks of |x_r|` for sum and that
//! divided by `nranks` for avg. This bounds recursive summation in any order (`(n-1)·eps/2·S`),
//! a pre-multiplied or post-divided average, and the final rounding to the type. NaN never passes.
//! Integer avg is the exact sum divided by `nranks`, truncated toward zero.

use oxccl::{DataType, ReduceOp};

/// What one output element should hold, and how far off it may be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Expect {
    /// The exact expected value.
    pub value: f64,
    /// The largest accepted absolute error.
    pub tol: f64,
}

impl Expect {
    /// True when `got` is within tolerance (NaN never is).
    pub fn accepts(&self, got: f64) -> bool {
        (got - self.value).abs() <= self.tol
    }
}

/// Parameters shared by every element of one correctness check.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// Element type.
    pub dtype: DataType,
    /// The reduction, or `None` for collectives that only move data.
    pub op: Option<ReduceOp>,
    /// Number of ranks.
    pub nranks: usize,
    /// Varies the data between checks so stale results do not pass.
    pub seed: u64,
    amp: u64,
    /// Extra tolerance of a compressed wire ([`Case::with_wire`]): `rel` times the sum of the
    /// magnitudes plus `abs` times the largest input magnitude times the rank count.
    wire: (f64, f64),
}

const K_IDX: u64 = 0x9E37_79B9_7F4A_7C15;
const K_RANK: u64 = 0xC2B2_AE3D_27D4_EB4F;
const K_SEED: u64 = 0x1656_67B1_9E37_79F9;
const K_SPECIAL: u64 = 0x27D4_EB2F_1656_67C5;

/// A 64-bit finaliser (MurmurHash3 fmix64): cheap and well mixed.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// True for the types that can hold negative values.
pub fn is_signed(dt: DataType) -> bool {
    !matches!(dt, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

/// Machine epsilon of a float type (0 for integer types).
pub fn eps(dt: DataType) -> f64 {
    match dt {
        DataType::Float8e4m3 => 2f64.powi(-3),
        DataType::Float8e5m2 => 2f64.powi(-2),
        DataType::Float16 => 2f64.powi(-10),
        DataType::Bfloat16 => 2f64.powi(-7),
        DataType::Float32 => 2f64.powi(-23),
        DataType::Float64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

/// The largest magnitude a result may reach in `dt` without overflow (for sizing sums).
fn limit(dt: DataType) -> u64 {
    match dt {
        DataType::Int8 => 127,
        DataType::Uint8 => 255,
        DataType::Float8e4m3 => 448,
        DataType::Float8e5m2 => 57344,
        DataType::Float16 => 65504,
        _ => u64::MAX,
    }
}

impl Case {
    /// A check of `op` (or a plain copy when `None`) on `dtype` over `nranks` ranks.
    pub fn new(dtype: DataType, op: Option<ReduceOp>, nranks: usize, seed: u64) -> Case {
        let n = nranks.max(1) as u64;
        let amp = match op {
            Some(ReduceOp::Sum | ReduceOp::Avg) => {
                // Unsigned values span [0, 2A], signed ones [-A, A]: n of them must fit.
                let per_rank = limit(dtype) / n;
                5.min(if is_signed(dtype) { per_rank } else { per_rank / 2 })
            }
            _ => 5,
        };
        Case { dtype, op, nranks, seed, amp, wire: (0.0, 0.0) }
    }

    /// The same check, accepting the error of a compressed inter-host stage whose documented
    /// bound (docs/COMPRESSION.md) is `rel · Σ|x| + abs · (block maximum of the sum)`.
    pub fn with_wire(self, rel: f64, abs: f64) -> Case {
        Case { wire: (rel, abs), ..self }
    }

    fn hash(&self, rank: usize, idx: usize) -> u64 {
        mix((idx as u64).wrapping_mul(K_IDX) ^ (rank as u64).wrapping_mul(K_RANK) ^ self.seed.wrapping_mul(K_SEED))
    }

    /// Element `idx` of `rank`'s send buffer.
    pub fn input(&self, rank: usize, idx: usize) -> f64 {
        let h = self.hash(rank, idx);
        let signed = is_signed(self.dtype);
        if self.op == Some(ReduceOp::Prod) {
            let special =
                mix((idx as u64).wrapping_mul(K_SPECIAL) ^ self.seed.wrapping_mul(K_SEED)) % self.nranks.max(1) as u64;
            return match (special == rank as u64, signed) {
                (true, true) => [-2.0, -1.0, 1.0, 2.0][(h % 4) as usize],
                (true, false) => (1 + h % 3) as f64,
                (false, true) => {
                    if h & 1 == 0 {
                        1.0
                    } else {
                        -1.0
                    }
                }
                (false, false) => 1.0,
            };
        }
        let v = (h % (2 * self.amp + 1)) as f64;
        if signed {
            v - self.amp as f64
        } else {
            v
        }
    }

    /// Rank `rank`'s input element `idx`, expected to arrive unchanged (gather, broadcast, ...).
    pub fn copied(&self, rank: usize, idx: usize) -> Expect {
        Expect { value: self.input(rank, idx), tol: 0.0 }
    }

    /// The reduction over all ranks of input element `idx`.
    pub fn reduced(&self, idx: usize) -> Expect {
        let op = self.op.unwrap_or(ReduceOp::Sum);
        let n = self.nranks.max(1);
        let mut acc = self.input(0, idx);
        let mut abs_sum = acc.abs();
        for r in 1..n {
            let x = self.input(r, idx);
            abs_sum += x.abs();
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc + x,
                ReduceOp::Prod => acc * x,
                ReduceOp::Max => acc.max(x),
                ReduceOp::Min => acc.min(x),
            };
        }
        let float = self.dtype.is_float();
        let (value, scale) = match op {
            ReduceOp::Avg if float => (acc / n as f64, abs_sum / n as f64),
            ReduceOp::Avg => ((acc / n as f64).trunc(), 0.0),
            ReduceOp::Sum => (acc, abs_sum),
            _ => (acc, 0.0),
        };
        let tol = if float { n as f64 * eps(self.dtype) * scale } else { 0.0 };
        let div = if op == ReduceOp::Avg { n as f64 } else { 1.0 };
        let wire = self.wire.0 * scale + self.wire.1 * (n as u64 * self.amp) as f64 / div;
        Expect { value, tol: tol + wire }
    }
}

/// Layout of an 8-bit float format.
#[derive(Clone, Copy)]
struct F8 {
    mbits: u32,
    bias: i32,
    /// Largest finite encoding (without sign).
    max_bits: u8,
    /// E4M3 "fn": no infinities, 0x7F is NaN, overflow saturates.
    finite_only: bool,
}

const E4M3: F8 = F8 { mbits: 3, bias: 7, max_bits: 0x7E, finite_only: true };
const E5M2: F8 = F8 { mbits: 2, bias: 15, max_bits: 0x7B, finite_only: false };

fn f8_decode(b: u8, f: F8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let mag = b & 0x7F;
    let e = i32::from(mag >> f.mbits);
    let m = f64::from(mag & ((1 << f.mbits) - 1));
    if f.finite_only && mag == 0x7F {
        return f64::NAN;
    }
    if !f.finite_only && mag > f.max_bits {
        return if mag == 0x7C { sign * f64::INFINITY } else { f64::NAN };
    }
    let scale = f64::from(1u32 << f.mbits);
    if e == 0 {
        sign * m / scale * 2f64.powi(1 - f.bias)
    } else {
        sign * (1.0 + m / scale) * 2f64.powi(e - f.bias)
    }
}

/// Encodes with round-to-nearest-even; out of range saturates (E4M3) or becomes inf (E5M2).
fn f8_encode(v: f64, f: F8) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    let min_exp = 1 - f.bias;
    let exp = if a == 0.0 { min_exp } else { ((((a.to_bits() >> 52) & 0x7FF) as i32) - 1023).max(min_exp) };
    // a = q * 2^(exp - mbits); q < 2^(mbits+1), and q < 2^mbits only in the subnormal range.
    let q = (a * 2f64.powi(f.mbits as i32 - exp)).round_ties_even();
    // The exponent field is exp + bias; for subnormals (exp == min_exp, field 1 minus the
    // implicit bit) this collapses to q, and a carry out of q bumps the exponent naturally.
    let bits = (i64::from(exp + f.bias) << f.mbits) + q as i64 - (1i64 << f.mbits);
    let bits = if bits > i64::from(f.max_bits) {
        if f.finite_only {
            f.max_bits
        } else {
            0x7C
        }
    } else {
        bits as u8
    };
    sign | bits
}

/// Writes `v` as element `i` of `buf` (ints saturate; floats round to nearest even).
pub fn write_elem(dt: DataType, buf: &mut [u8], i: usize, v: f64) {
    let s = dt.size();
    let out = &mut buf[i * s..(i + 1) * s];
    match dt {
        DataType::Int8 | DataType::Int32 | DataType::Int64 => out.copy_from_slice(&(v as i64).to_le_bytes()[..s]),
        DataType::Uint8 | DataType::Uint32 | DataType::Uint64 => out.copy_from_slice(&(v as u64).to_le_bytes()[..s]),
        DataType::Float16 => out.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DataType::Bfloat16 => out.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        DataType::Float32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::Float64 => out.copy_from_slice(&v.to_le_bytes()),
        DataType::Float8e4m3 => out[0] = f8_encode(v, E4M3),
        DataType::Float8e5m2 => out[0] = f8_encode(v, E5M2),
    }
}

/// Reads element `i` of `buf` as `f64` (exact for every value of every type but huge 64-bit ints).
pub fn read_elem(dt: DataType, buf: &[u8], i: usize) -> f64 {
    let s = dt.size();
    let b = &buf[i * s..(i + 1) * s];
    let mut w = [0u8; 8];
    w[..s].copy_from_slice(b);
    match dt {
        DataType::Int8 => f64::from(b[0] as i8),
        DataType::Uint8 => f64::from(b[0]),
        DataType::Int32 => f64::from(i32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        DataType::Uint32 => f64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        DataType::Int64 => i64::from_le_bytes(w) as f64,
        DataType::Uint64 => u64::from_le_bytes(w) as f64,
        DataType::Float16 => half::f16::from_le_bytes([w[0], w[1]]).to_f64(),
        DataType::Bfloat16 => half::bf16::from_le_bytes([w[0], w[1]]).to_f64(),
        DataType::Float32 => f64::from(f32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        DataType::Float64 => f64::from_le_bytes(w),
        DataType::Float8e4m3 => f8_decode(b[0], E4M3),
        DataType::Float8e5m2 => f8_decode(b[0], E5M2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_finite_encoding() {
        for f in [E4M3, E5M2] {
            for b in 0..=255u8 {
                let v = f8_decode(b, f);
                if v.is_finite() {
                    let back = f8_encode(v, f);
                    assert!(back == b || (v == 0.0 && back & 0x7F == 0), "{b:#x} -> {v} -> {back:#x}");
                }
            }
        }
        assert_eq!(f8_decode(0x7E, E4M3), 448.0);
        assert_eq!(f8_decode(0x7B, E5M2), 57344.0);
        assert_eq!(f8_decode(0x01, E4M3), 2f64.powi(-9));
        assert_eq!(f8_encode(1000.0, E4M3), 0x7E);
        assert_eq!(f8_encode(17.0, E4M3), f8_encode(16.0, E4M3)); // ties to even
        assert_eq!(f8_encode(-3.0, E5M2), 0x80 | f8_encode(3.0, E5M2));
    }

    #[test]
    fn every_type_round_trips_the_test_values() {
        for dt in DataType::ALL {
            let mut buf = vec![0u8; 8 * dt.size()];
            let vals: Vec<f64> = if is_signed(dt) {
                vec![-5.0, -2.0, -1.0, 0.0, 1.0, 3.0, 5.0, 2.5]
            } else {
                vec![0.0, 1.0, 3.0, 10.0, 7.0, 2.0, 5.0, 9.0]
            };
            for (i, &v) in vals.iter().enumerate() {
                write_elem(dt, &mut buf, i, v);
            }
            for (i, &v) in vals.iter().enumerate() {
                let want = if dt.is_float() { v } else { v.trunc() };
                assert_eq!(read_elem(dt, &buf, i), want, "{}", dt.name());
            }
        }
    }

    #[test]
    fn reductions_stay_in_range() {
        for dt in DataType::ALL {
            for op in ReduceOp::ALL {
                for n in [1, 2, 3, 8, 40] {
                    let c = Case::new(dt, Some(op), n, 7);
                    for i in 0..200 {
                        let e = c.reduced(i);
                        assert!(e.value.abs() <= limit(dt) as f64, "{} {} n={n}", dt.name(), op.name());
                        if !is_signed(dt) {
                            assert!(e.value >= 0.0);
                        }
                    }
                }
            }
        }
        let c = Case::new(DataType::Int32, Some(ReduceOp::Avg), 3, 1);
        assert!((0..100).all(|i| c.reduced(i).value == c.reduced(i).value.trunc()));
    }
}
