//! Tests of the byte-slice reduction API against independent references: integers through
//! `i128` with explicit wrapping, floats through `f64` arithmetic rounded once with `from_f64`.

use super::*;

/// Deterministic pseudo-random numbers (Knuth's MMIX LCG, high bits).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 16
    }

    /// `n` elements of `dtype`: for floats, alternately raw bit patterns (NaN, inf, subnormals
    /// included) and moderate values rounded into the type; for integers, raw bytes.
    fn elems(&mut self, dtype: DataType, n: usize) -> Vec<u8> {
        let size = dtype.size();
        let mut out = vec![0u8; n * size];
        for (i, e) in out.chunks_exact_mut(size).enumerate() {
            if dtype.is_float() && i % 2 == 1 {
                let v = (self.next() % 20_001) as f64 / 100.0 - 100.0;
                from_f64(dtype, &[v], e);
            } else {
                for b in e.iter_mut() {
                    *b = self.next() as u8;
                }
            }
        }
        out
    }
}

const LENS: [usize; 5] = [0, 1, 7, 64, 1003];

/// Runs `f` with the kernels the CPU selects (AVX2 + F16C on most x86-64), then, on x86-64,
/// again with the portable kernels forced.
fn on_all_paths(f: impl Fn()) {
    f();
    #[cfg(target_arch = "x86_64")]
    {
        use super::kernels::x86::PORTABLE_ONLY;
        PORTABLE_ONLY.with(|p| p.set(true));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&f));
        PORTABLE_ONLY.with(|p| p.set(false));
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }
}

fn int_signed(dtype: DataType) -> Option<bool> {
    match dtype {
        DataType::Int8 | DataType::Int32 | DataType::Int64 => Some(true),
        DataType::Uint8 | DataType::Uint32 | DataType::Uint64 => Some(false),
        _ => None,
    }
}

fn to_i128(dtype: DataType, e: &[u8], signed: bool) -> i128 {
    let fill = if signed && e.last().is_some_and(|b| b & 0x80 != 0) { 0xFF } else { 0 };
    let mut le = [fill; 16];
    le[..e.len()].copy_from_slice(e);
    debug_assert_eq!(e.len(), dtype.size());
    i128::from_le_bytes(le)
}

fn op_i128(op: ReduceOp, a: i128, b: i128) -> i128 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
        ReduceOp::Prod => a.wrapping_mul(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

fn op_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Max => {
            if b > a || a.is_nan() {
                b
            } else {
                a
            }
        }
        ReduceOp::Min => {
            if b < a || a.is_nan() {
                b
            } else {
                a
            }
        }
    }
}

/// Elementwise reference: `f` on each element pair, integers in `i128` (then truncated to the
/// width), floats in `f64` (then rounded once).
fn reference(
    dtype: DataType,
    a: &[u8],
    b: &[u8],
    fi: impl Fn(i128, i128) -> i128,
    ff: impl Fn(f64, f64) -> f64,
) -> Vec<u8> {
    let size = dtype.size();
    match int_signed(dtype) {
        Some(signed) => a
            .chunks_exact(size)
            .zip(b.chunks_exact(size))
            .flat_map(|(x, y)| {
                let r = fi(to_i128(dtype, x, signed), to_i128(dtype, y, signed));
                r.to_le_bytes()[..size].to_vec()
            })
            .collect(),
        None => {
            let vals: Vec<f64> = to_f64(dtype, a).into_iter().zip(to_f64(dtype, b)).map(|(x, y)| ff(x, y)).collect();
            let mut out = vec![0u8; a.len()];
            from_f64(dtype, &vals, &mut out);
            out
        }
    }
}

fn reference_op(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    reference(dtype, a, b, |x, y| op_i128(op, x, y), |x, y| op_f64(op, x, y))
}

/// Bitwise equality per element, except that any two NaNs match.
fn assert_same(dtype: DataType, got: &[u8], want: &[u8], what: &str) {
    assert_same_op(dtype, None, got, want, what)
}

/// As [`assert_same`]; for float `Max`/`Min` also `+0 == -0` (C `fmax` may return either).
fn assert_same_op(dtype: DataType, op: Option<ReduceOp>, got: &[u8], want: &[u8], what: &str) {
    let zeros = dtype.is_float() && matches!(op, Some(ReduceOp::Max | ReduceOp::Min));
    assert_eq!(got.len(), want.len(), "{what}: length");
    let size = dtype.size();
    let (g, w) = (to_f64(dtype, got), to_f64(dtype, want));
    for (i, (ge, we)) in got.chunks_exact(size).zip(want.chunks_exact(size)).enumerate() {
        let both_nan = dtype.is_float() && g[i].is_nan() && w[i].is_nan();
        let both_zero = zeros && g[i] == 0.0 && w[i] == 0.0;
        assert!(
            ge == we || both_nan || both_zero,
            "{what}: {dtype:?} element {i}: got {ge:02x?} ({}), want {we:02x?} ({})",
            g[i],
            w[i]
        );
    }
}

#[test]
fn every_type_and_op_matches_reference() {
    on_all_paths(|| {
        let mut rng = Lcg(1);
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                for n in LENS {
                    let (a, b) = (rng.elems(dtype, n), rng.elems(dtype, n));
                    let want = reference_op(dtype, op, &a, &b);
                    let what = format!("{dtype:?} {op:?} n={n}");

                    let mut acc = a.clone();
                    reduce_into(dtype, op, &mut acc, &b);
                    assert_same_op(dtype, Some(op), &acc, &want, &format!("reduce_into {what}"));

                    let mut dst = vec![0xA5u8; a.len()];
                    reduce_to(dtype, op, &mut dst, &a, &b);
                    assert_same_op(dtype, Some(op), &dst, &want, &format!("reduce_to {what}"));
                }
            }
        }
    });
}

/// `len` bytes starting `off` bytes into a `u64`-aligned allocation.
fn placed(data: &[u8], backing: &mut Vec<u64>, off: usize) -> std::ops::Range<usize> {
    backing.clear();
    backing.resize((data.len() + off) / 8 + 1, 0);
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(backing.as_mut_slice());
    bytes[off..off + data.len()].copy_from_slice(data);
    off..off + data.len()
}

#[test]
fn unaligned_slices_match_aligned() {
    on_all_paths(|| {
        let mut rng = Lcg(2);
        let (mut m1, mut m2, mut m3) = (Vec::new(), Vec::new(), Vec::new());
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                let n = 1003;
                let (a, b) = (rng.elems(dtype, n), rng.elems(dtype, n));
                let mut want = a.clone();
                reduce_into(dtype, op, &mut want, &b);
                for (oa, ob, od) in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (3, 5, 0), (2, 2, 7), (0, 0, 1), (4, 0, 6)] {
                    let what = format!("{dtype:?} {op:?} offsets {oa},{ob},{od}");
                    let ra = placed(&a, &mut m1, oa);
                    let rb = placed(&b, &mut m2, ob);
                    let acc = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut m1)[ra];
                    let src = &bytemuck::cast_slice::<u64, u8>(&m2)[rb.clone()];
                    reduce_into(dtype, op, acc, src);
                    assert_same_op(dtype, Some(op), acc, &want, &format!("reduce_into {what}"));

                    let ra = placed(&a, &mut m1, oa);
                    let rd = placed(&vec![0; a.len()], &mut m3, od);
                    let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut m3)[rd];
                    let (a_in, b_in) = (bytemuck::cast_slice::<u64, u8>(&m1), bytemuck::cast_slice::<u64, u8>(&m2));
                    reduce_to(dtype, op, dst, &a_in[ra], &b_in[rb]);
                    assert_same_op(dtype, Some(op), dst, &want, &format!("reduce_to {what}"));
                }
            }
        }
    });
}

#[test]
fn float_max_min_with_nan() {
    on_all_paths(|| {
        for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
            let enc = |v: &[f64]| {
                let mut out = vec![0u8; v.len() * dtype.size()];
                from_f64(dtype, v, &mut out);
                out
            };
            let nan = f64::NAN;
            let a = enc(&[nan, 1.0, nan, -2.0, 0.0, -0.0]);
            let b = enc(&[1.0, nan, nan, 3.0, -0.0, 0.0]);
            let check = |op, want: &[f64]| {
                let mut acc = a.clone();
                reduce_into(dtype, op, &mut acc, &b);
                let got = to_f64(dtype, &acc);
                for (g, w) in got.iter().zip(want) {
                    let ok = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()) || (*g == 0.0 && *w == 0.0);
                    assert!(ok, "{dtype:?} {op:?}: {got:?} vs {want:?}");
                }
            };
            // fmax/fmin: a NaN operand yields the other one; +0 vs -0 may give either.
            check(ReduceOp::Max, &[1.0, 1.0, nan, 3.0, 0.0, -0.0]);
            check(ReduceOp::Min, &[1.0, 1.0, nan, -2.0, 0.0, -0.0]);
        }
    });
}

#[test]
fn integer_semantics() {
    let mut v = Vec::new();
    for x in [i32::MAX, -7, 100_000, i32::MIN] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    let mut w = Vec::new();
    for x in [1i32, 3, 100_000, -1] {
        w.extend_from_slice(&x.to_le_bytes());
    }
    let mut acc = v.clone();
    reduce_into(DataType::Int32, ReduceOp::Sum, &mut acc, &w);
    assert_eq!(to_f64(DataType::Int32, &acc), [f64::from(i32::MIN), -4.0, 200_000.0, f64::from(i32::MAX)]);
    let mut acc = v.clone();
    reduce_into(DataType::Int32, ReduceOp::Prod, &mut acc, &w);
    assert_eq!(
        to_f64(DataType::Int32, &acc),
        [f64::from(i32::MAX), -21.0, f64::from(1_410_065_408i32), f64::from(i32::MIN)]
    );
    let mut acc = vec![200u8, 3];
    reduce_into(DataType::Uint8, ReduceOp::Sum, &mut acc, &[100, 255]);
    assert_eq!(acc, [44, 2]);
}

#[test]
fn divide_integers_truncates_toward_zero() {
    let mut buf: Vec<u8> = [-7i32, 7, -1, i32::MIN, 5].iter().flat_map(|x| x.to_le_bytes()).collect();
    divide(DataType::Int32, &mut buf, 2);
    assert_eq!(to_f64(DataType::Int32, &buf), [-3.0, 3.0, 0.0, -1_073_741_824.0, 2.0]);
    let mut buf = vec![0x80u8, 0x7F, 0xF9]; // -128, 127, -7
    divide(DataType::Int8, &mut buf, 3);
    assert_eq!(buf, [(-42i8) as u8, 42, (-2i8) as u8]);
    let mut buf = vec![0x80u8, 0xFF];
    divide(DataType::Int8, &mut buf, 1000);
    assert_eq!(buf, [0, 0]);
    let mut buf = vec![255u8, 7];
    divide(DataType::Uint8, &mut buf, 2);
    assert_eq!(buf, [127, 3]);
    let mut buf = i64::MIN.to_le_bytes().to_vec();
    divide(DataType::Int64, &mut buf, usize::MAX);
    assert_eq!(buf, 0i64.to_le_bytes());
    let mut buf = u64::MAX.to_le_bytes().to_vec();
    divide(DataType::Uint64, &mut buf, 3);
    assert_eq!(buf, (u64::MAX / 3).to_le_bytes());

    // Random data against i128 truncating division, every integer type and several counts.
    let mut rng = Lcg(3);
    for dtype in DataType::ALL.into_iter().filter(|d| !d.is_float()) {
        for n in [1usize, 2, 3, 7, 8, 1000] {
            let a = rng.elems(dtype, 1003);
            let want = reference(dtype, &a, &a, |x, _| x / n as i128, |_, _| 0.0);
            let mut buf = a.clone();
            divide(dtype, &mut buf, n);
            assert_same(dtype, &buf, &want, &format!("divide {dtype:?} by {n}"));
        }
    }
}

#[test]
fn divide_floats_rounds_once() {
    on_all_paths(|| {
        let mut rng = Lcg(4);
        for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
            for n in [2usize, 3, 7, 10] {
                let a = rng.elems(dtype, 1003);
                // f64 division of a narrow value then one rounding equals f32 division then rounding.
                let want = reference(dtype, &a, &a, |_, _| 0, |x, _| x / n as f64);
                let mut buf = a.clone();
                divide(dtype, &mut buf, n);
                assert_same(dtype, &buf, &want, &format!("divide {dtype:?} by {n}"));
            }
        }
        let mut buf = 1.0f32.to_le_bytes().to_vec();
        divide(DataType::Float32, &mut buf, 3);
        assert_eq!(buf, (1.0f32 / 3.0).to_le_bytes());
    });
}

#[test]
fn scale_all_types() {
    on_all_paths(|| {
        let mut rng = Lcg(5);
        for dtype in DataType::ALL {
            // Factors with short significands, so the f32 product is exact or rounds once.
            for factor in [0.5f64, 3.0, -1.25, 0.0, 2.9] {
                if dtype.is_float() && factor == 2.9 {
                    continue;
                }
                let a = rng.elems(dtype, 1003);
                let fi = match int_signed(dtype) {
                    Some(true) => factor as i64 as i128,
                    _ => factor as u64 as i128,
                };
                let ff = if dtype == DataType::Float64 { factor } else { f64::from(factor as f32) };
                let want = reference(dtype, &a, &a, |x, _| x.wrapping_mul(fi), |x, _| x * ff);
                let mut buf = a.clone();
                scale(dtype, &mut buf, factor);
                assert_same(dtype, &buf, &want, &format!("scale {dtype:?} by {factor}"));
            }
        }
        let mut buf = vec![100u8, 0x80];
        scale(DataType::Int8, &mut buf, 3.0);
        assert_eq!(buf, [44, 0x80]);
        let mut buf = vec![5u8];
        scale(DataType::Uint8, &mut buf, -1.0);
        assert_eq!(buf, [0]);
    });
}

#[test]
fn f64_conversions() {
    let vals = [0.0, 1.0, -2.5, 100.0, 448.0, 1e6, -1e6];
    for dtype in DataType::ALL {
        let mut out = vec![0u8; vals.len() * dtype.size()];
        from_f64(dtype, &vals, &mut out);
        let back = to_f64(dtype, &out);
        let want: Vec<f64> = match dtype {
            DataType::Int8 => vec![0.0, 1.0, -2.0, 100.0, 127.0, 127.0, -128.0],
            DataType::Uint8 => vec![0.0, 1.0, 0.0, 100.0, 255.0, 255.0, 0.0],
            DataType::Float16 => vec![0.0, 1.0, -2.5, 100.0, 448.0, f64::INFINITY, f64::NEG_INFINITY],
            DataType::Float8e4m3 => vec![0.0, 1.0, -2.5, 96.0, 448.0, 448.0, -448.0],
            DataType::Float8e5m2 => vec![0.0, 1.0, -2.5, 96.0, 448.0, 57344.0, -57344.0],
            DataType::Uint32 | DataType::Uint64 => vec![0.0, 1.0, 0.0, 100.0, 448.0, 1e6, 0.0],
            DataType::Int32 | DataType::Int64 => vec![0.0, 1.0, -2.0, 100.0, 448.0, 1e6, -1e6],
            DataType::Bfloat16 => vec![0.0, 1.0, -2.5, 100.0, 448.0, 999_424.0, -999_424.0],
            DataType::Float32 | DataType::Float64 => vals.to_vec(),
        };
        assert_eq!(back, want, "{dtype:?}");
    }
    let mut out = [0u8; 2];
    from_f64(DataType::Float16, &[f64::NAN], &mut out);
    assert!(to_f64(DataType::Float16, &out)[0].is_nan());
    assert!(to_f64(DataType::Float8e4m3, &[0x7F, 0xFF]).iter().all(|v| v.is_nan()));
    assert_eq!(to_f64(DataType::Int64, &[0xFF; 8]), [-1.0]);
    // A trailing partial element is ignored.
    assert_eq!(to_f64(DataType::Int32, &[1, 0, 0, 0, 9]), [1.0]);
}

#[test]
fn mismatched_lengths_never_index_out_of_bounds() {
    let run = || {
        let mut acc = vec![1u8; 10];
        reduce_into(DataType::Int32, ReduceOp::Sum, &mut acc, &[1u8; 7]);
        let mut other = vec![0u8; 11];
        reduce_to(DataType::Float32, ReduceOp::Max, &mut other[..3], &[0u8; 8], &[0u8; 9]);
        divide(DataType::Float64, &mut other, 3);
        scale(DataType::Float16, &mut other[..9], 2.0);
        from_f64(DataType::Float16, &[1.0, 2.0], &mut other[..3]);
        acc
    };
    if cfg!(debug_assertions) {
        assert!(std::panic::catch_unwind(run).is_err(), "debug builds assert on length mismatch");
    } else {
        // One whole common element (0x01010101 + 0x01010101); the rest of `acc` untouched.
        assert_eq!(run(), [2, 2, 2, 2, 1, 1, 1, 1, 1, 1]);
    }
}

#[test]
fn integer_division_by_the_rank_count_truncates_exactly() {
    // Against i128 division (truncation toward zero): every int8/uint8 value with every
    // count up to 600 and counts around the f64 path's limit, and int32/uint32 values at the
    // edges and next to multiples of the count (where a rounded quotient would cross an integer).
    fn check(dtype: DataType, vals: &[i128], counts: &[usize]) {
        let size = dtype.size();
        let signed = int_signed(dtype).expect("integer type");
        let mut buf = vec![0u8; vals.len() * size];
        for &n in counts {
            for (v, e) in vals.iter().zip(buf.chunks_exact_mut(size)) {
                e.copy_from_slice(&v.to_le_bytes()[..size]);
            }
            divide(dtype, &mut buf, n);
            for (v, e) in vals.iter().zip(buf.chunks_exact(size)) {
                assert_eq!(to_i128(dtype, e, signed), v / n as i128, "{dtype:?}: {v} / {n}");
            }
        }
    }
    let mut counts: Vec<usize> = (1..=600).collect();
    let limit = crate::reduce::kernels::F64_EXACT_DIVISOR;
    counts.extend([limit - 1, limit, limit + 1, 1 << 31, usize::MAX]);
    check(DataType::Int8, &(-128..=127).collect::<Vec<_>>(), &counts);
    check(DataType::Uint8, &(0..=255).collect::<Vec<_>>(), &counts);
    for (dtype, lo, hi) in
        [(DataType::Int32, i32::MIN as i128, i32::MAX as i128), (DataType::Uint32, 0, u32::MAX as i128)]
    {
        for n in counts.iter().copied().filter(|&n| n <= 600 || n.abs_diff(limit) <= 1) {
            let mut vals = vec![lo, lo + 1, hi - 1, hi, 0, 1];
            // Multiples of n and their neighbours, near the top of the range and near zero.
            for k in [hi / n as i128, hi / n as i128 - 1, 1, 2, 1000] {
                for v in [k * n as i128 - 1, k * n as i128, k * n as i128 + 1] {
                    if (lo..=hi).contains(&v) {
                        vals.push(v);
                        if lo < 0 && -v >= lo {
                            vals.push(-v);
                        }
                    }
                }
            }
            check(dtype, &vals, &[n]);
        }
    }
}

/// `fold` is the left fold in rank order: in the type's precision for f32/f64, in f32 with one
/// rounding for the narrow types; integers exact; `Avg` divides once.
#[test]
fn fold_is_the_left_fold_in_rank_order() {
    let parts = 5;
    let count = 1000;
    // Values over many magnitudes, so that a different order would round differently.
    let val = |k: usize, i: usize| {
        let e = ((i * 7 + k * 13) % 40) as i32 - 20;
        let s = if (i + k) % 3 == 0 { -1.0 } else { 1.0 };
        s * 1.37f64.powi(e) * (1.0 + (i % 11) as f64 / 17.0)
    };
    for dtype in [DataType::Float32, DataType::Float64, DataType::Float16, DataType::Bfloat16, DataType::Int32] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Prod] {
            let size = dtype.size();
            let vals: Vec<Vec<f64>> = (0..parts)
                .map(|k| {
                    (0..count).map(|i| if dtype.is_float() { val(k, i) } else { (val(k, i) * 8.0).round() }).collect()
                })
                .collect();
            let mut src = vec![0u8; parts * count * size];
            for (k, v) in vals.iter().enumerate() {
                from_f64(dtype, v, &mut src[k * count * size..(k + 1) * count * size]);
            }
            // The reference: decode the stored pieces, fold in the accumulation type.
            let stored: Vec<Vec<f64>> =
                (0..parts).map(|k| to_f64(dtype, &src[k * count * size..(k + 1) * count * size])).collect();
            let want: Vec<f64> = (0..count)
                .map(|i| {
                    let f = |a: f64, b: f64| match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + b,
                        ReduceOp::Prod => a * b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                    };
                    if dtype == DataType::Float64 {
                        let mut acc = stored[0][i];
                        (1..parts).for_each(|k| acc = f(acc, stored[k][i]));
                        if op == ReduceOp::Avg {
                            acc /= parts as f64;
                        }
                        acc
                    } else if dtype.is_float() {
                        let mut acc = stored[0][i] as f32;
                        (1..parts).for_each(|k| {
                            let b = stored[k][i] as f32;
                            acc = match op {
                                ReduceOp::Prod => acc * b,
                                ReduceOp::Max => acc.max(b),
                                ReduceOp::Min => acc.min(b),
                                _ => acc + b,
                            }
                        });
                        if op == ReduceOp::Avg {
                            acc /= parts as f32;
                        }
                        acc as f64
                    } else {
                        let mut acc = stored[0][i] as i32;
                        (1..parts).for_each(|k| {
                            let b = stored[k][i] as i32;
                            acc = match op {
                                ReduceOp::Prod => acc.wrapping_mul(b),
                                ReduceOp::Max => acc.max(b),
                                _ => acc.wrapping_add(b),
                            }
                        });
                        if op == ReduceOp::Avg {
                            acc /= parts as i32;
                        }
                        acc as f64
                    }
                })
                .collect();
            let mut want_bytes = vec![0u8; count * size];
            from_f64(dtype, &want, &mut want_bytes);
            // Unaligned too: the staging path must give the same bits.
            for shift in [0, 1] {
                let mut s2 = vec![0u8; src.len() + shift];
                s2[shift..].copy_from_slice(&src);
                let mut dst = vec![0u8; count * size + shift];
                fold(dtype, op, &mut dst[shift..], &s2[shift..], parts);
                assert!(dst[shift..] == want_bytes[..], "{dtype:?} {op:?} shift {shift}");
            }
        }
    }
}

/// `fold_ptrs` in place: `dst` may be any one of the pieces (the first, a later one, or none),
/// over several of its blocks, and the result is still the left fold in rank order of the
/// pieces as they were before the call.
#[test]
fn fold_in_place_is_the_left_fold_of_the_pieces_before_the_call() {
    let count = 5003; // f32: ~20 KiB, several blocks and a partial one
    let val = |k: usize, i: usize| {
        let e = ((i * 5 + k * 11) % 36) as i32 - 18;
        (if (i + k) % 3 == 0 { -1.0 } else { 1.0 }) * 1.41f64.powi(e) * (1.0 + (i % 13) as f64 / 19.0)
    };
    for parts in [2usize, 3, 4] {
        for own in [None, Some(0), Some(1), Some(parts - 1)] {
            for (dtype, op) in [
                (DataType::Float32, ReduceOp::Sum),
                (DataType::Float32, ReduceOp::Avg),
                (DataType::Float64, ReduceOp::Prod),
                (DataType::Int32, ReduceOp::Avg),
                (DataType::Uint8, ReduceOp::Max),
            ] {
                let size = dtype.size();
                let mut pieces: Vec<Vec<u8>> = (0..parts)
                    .map(|k| {
                        let v: Vec<f64> = (0..count)
                            .map(|i| if dtype.is_float() { val(k, i) } else { (val(k, i) * 9.0).round().abs() })
                            .collect();
                        let mut b = vec![0u8; count * size];
                        from_f64(dtype, &v, &mut b);
                        b
                    })
                    .collect();
                // The reference, element by element from the decoded pieces (f32 in f32).
                let dec: Vec<Vec<f64>> = pieces.iter().map(|p| to_f64(dtype, p)).collect();
                let want: Vec<f64> = (0..count)
                    .map(|i| match (dtype, op) {
                        (DataType::Float32, _) => {
                            let mut a = dec[0][i] as f32;
                            (1..parts).for_each(|k| a += dec[k][i] as f32);
                            if op == ReduceOp::Avg {
                                a /= parts as f32;
                            }
                            a as f64
                        }
                        (DataType::Float64, _) => (1..parts).fold(dec[0][i], |a, k| a * dec[k][i]),
                        (DataType::Int32, _) => {
                            let s: i64 = (0..parts).map(|k| dec[k][i] as i64).sum();
                            (s / parts as i64) as f64
                        }
                        _ => (0..parts).map(|k| dec[k][i]).fold(f64::MIN, f64::max),
                    })
                    .collect();
                let mut out = vec![0u8; count * size];
                let dst = match own {
                    Some(k) => pieces[k].as_mut_ptr(),
                    None => out.as_mut_ptr(),
                };
                let srcs: Vec<*const u8> = pieces.iter().map(|p| p.as_ptr()).collect();
                // SAFETY: every piece and `out` hold `count * size` bytes; `dst` is one of the
                // pieces or `out`, disjoint from the others.
                unsafe { fold_ptrs(dtype, op, dst, &srcs, count * size) };
                let got = to_f64(dtype, if let Some(k) = own { &pieces[k] } else { &out });
                let bad = (0..count).filter(|&i| got[i].to_bits() != want[i].to_bits()).count();
                assert_eq!(bad, 0, "{dtype:?} {op:?}, {parts} pieces, dst = piece {own:?}: {bad} elements differ");
            }
        }
    }
}
