use super::*;
use proptest::prelude::*;

fn bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn roundtrip(enc: Encoding, x: &[f32]) -> Vec<f32> {
    let mut wire = vec![0u8; enc.size(x.len())];
    enc.encode(&bytes(x), &mut wire);
    let mut out = vec![0u8; 4 * x.len()];
    enc.decode(&wire, &mut out);
    floats(&out)
}

/// Largest finite magnitude of the block of `x` that holds element `i`.
fn block_max(x: &[f32], i: usize) -> f64 {
    let b = i / BLOCK * BLOCK;
    x[b..(b + BLOCK).min(x.len())].iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(f64::from(v.abs())))
}

/// The documented per-element bound of one quantisation (docs/COMPRESSION.md).
fn bound(enc: Encoding, x: f32, m: f64) -> f64 {
    let a = f64::from(x.abs());
    match enc {
        Encoding::Exact => 0.0,
        Encoding::Bf16 => a * 2f64.powi(-8) + 2f64.powi(-134),
        Encoding::Fp8 => a * 2f64.powi(-4) + m * 2f64.powi(-18) + 2f64.powi(-140),
        Encoding::Int8 => m / 252.0 * (1.0 + 2f64.powi(-13)) + 2f64.powi(-140),
    }
}

fn check_bound(enc: Encoding, x: &[f32]) {
    let y = roundtrip(enc, x);
    for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
        if !a.is_finite() {
            assert!(a.is_nan() && b.is_nan() || a == b, "{enc:?}: element {i}: {a} came back as {b}");
            continue;
        }
        assert!(b.is_finite(), "{enc:?}: finite {a} came back as {b}");
        let err = (f64::from(b) - f64::from(a)).abs();
        let lim = bound(enc, a, block_max(x, i));
        assert!(err <= lim, "{enc:?}: element {i}: {a} -> {b}, error {err:e} > {lim:e}");
    }
}

#[test]
fn sizes() {
    assert_eq!(Encoding::Exact.size(3), 12);
    assert_eq!(Encoding::Bf16.size(3), 6);
    assert_eq!(Encoding::Fp8.size(0), 0);
    assert_eq!(Encoding::Fp8.size(1), 5);
    assert_eq!(Encoding::Int8.size(256), 260);
    assert_eq!(Encoding::Int8.size(257), 265);
    for e in Encoding::ALL {
        assert_eq!(Encoding::parse(e.name()), Some(e));
    }
    assert_eq!(Encoding::parse("BF16"), Some(Encoding::Bf16));
    assert_eq!(Encoding::parse("fp16"), None);
}

#[test]
fn bf16_rounds_to_nearest_even() {
    // Halfway between 1 and 1 + 2^-7: to the even 1; just above: up; 1 + 3·2^-8: up to the even.
    let one = 1.0f32;
    assert_eq!(bf16_to_f32(f32_to_bf16(one + 2f32.powi(-8))), one);
    assert_eq!(bf16_to_f32(f32_to_bf16(f32::from_bits((one + 2f32.powi(-8)).to_bits() + 1))), one + 2f32.powi(-7));
    assert_eq!(bf16_to_f32(f32_to_bf16(one + 3.0 * 2f32.powi(-8))), one + 2f32.powi(-6));
    assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
    assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xFF80);
    assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    // A NaN whose payload is only in the low bits stays NaN (plain rounding would make it inf).
    assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x7F80_0001))).is_nan());
    assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0xFF80_0001))).is_nan());
    // Finite values saturate instead of rounding to infinity.
    assert_eq!(f32_to_bf16(f32::MAX), 0x7F7F);
    assert_eq!(f32_to_bf16(-f32::MAX), 0xFF7F);
    assert_eq!(f32_to_bf16(-0.0), 0x8000);
}

#[test]
fn fp8_codes_match_the_saturating_e4m3_conversion() {
    // Below the scaled maximum, the codec's e4m3 rounding is the library's (CUDA's) one.
    let mut v = 0f32;
    let mut bits = 0u32;
    while v <= FP8_QMAX {
        for s in [v, -v] {
            assert_eq!(e4m3_code(s), crate::reduce::fp8::f32_to_e4m3(s), "{s}");
        }
        bits += 0x1001;
        v = f32::from_bits(bits);
    }
    for c in 0..=255u8 {
        let v = e4m3_value(c);
        if v.is_finite() && v.abs() <= FP8_QMAX {
            assert_eq!(v, crate::reduce::fp8::e4m3_to_f32(c));
        }
    }
}

#[test]
fn non_finite_elements_leave_their_block_alone() {
    for enc in Encoding::ALL {
        let base: Vec<f32> = (0..700).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        let clean = roundtrip(enc, &base);
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut x = base.clone();
            for j in [0, 3, 255, 256, 699] {
                x[j] = bad;
            }
            let y = roundtrip(enc, &x);
            for j in 0..x.len() {
                if x[j].is_finite() {
                    assert_eq!(y[j].to_bits(), clean[j].to_bits(), "{enc:?} {bad} element {j}");
                } else {
                    assert!(if bad.is_nan() { y[j].is_nan() } else { y[j] == bad }, "{enc:?} {bad} -> {}", y[j]);
                }
            }
        }
    }
}

#[test]
fn zeros_and_tiny_blocks() {
    for enc in Encoding::ALL {
        let z = roundtrip(enc, &[0.0; 300]);
        assert!(z.iter().all(|v| *v == 0.0), "{enc:?}");
        let with_inf = roundtrip(enc, &[0.0, f32::INFINITY, 0.0, f32::NAN, -0.0]);
        assert_eq!(with_inf[0], 0.0);
        assert_eq!(with_inf[1], f32::INFINITY);
        assert!(with_inf[3].is_nan());
        assert_eq!(with_inf[4], 0.0);
        // Subnormal and tiny blocks: no NaN, no infinity, within the bound.
        let tiny: Vec<f32> =
            (0..600).map(|i| f32::from_bits(1 + i * 3) * if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
        check_bound(enc, &tiny);
        let small: Vec<f32> = (0..600).map(|i| (i as f32 - 300.0) * 1e-39).collect();
        check_bound(enc, &small);
        // The largest finite values do not overflow.
        check_bound(enc, &[f32::MAX, -f32::MAX, 1.0, f32::MAX / 3.0]);
    }
}

#[test]
fn decode_add_is_decode_then_add_at_any_alignment() {
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.731).sin() * 10f32.powi(i % 7 - 3)).collect();
    for enc in Encoding::ALL {
        let mut wire = vec![0u8; enc.size(x.len()) + 1];
        let mut src = vec![0u8; 4 * x.len() + 3];
        src[3..].copy_from_slice(&bytes(&x));
        enc.encode(&src[3..], &mut wire[1..]);
        let y = roundtrip(enc, &x);
        let acc0: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let mut acc = vec![0u8; 4 * x.len() + 1];
        acc[1..].copy_from_slice(&bytes(&acc0));
        enc.decode_add(&wire[1..], &mut acc[1..]);
        let got = floats(&acc[1..]);
        for i in 0..x.len() {
            assert_eq!(got[i].to_bits(), (acc0[i] + y[i]).to_bits(), "{enc:?} {i}");
        }
    }
}

/// Values over a wide dynamic range: a magnitude per block, some zeros and sign changes.
fn wide() -> impl Strategy<Value = Vec<f32>> {
    (1usize..1100, any::<u64>()).prop_map(|(n, seed)| {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let scale = (0..n.div_ceil(BLOCK)).map(|_| 2f32.powi((next() % 200) as i32 - 100)).collect::<Vec<_>>();
        (0..n)
            .map(|i| {
                let r = next();
                if r % 17 == 0 {
                    0.0
                } else {
                    ((r >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
                        * scale[i / BLOCK]
                        * 2f32.powi((r % 9) as i32 - 4)
                }
            })
            .collect()
    })
}

proptest! {
    #[test]
    fn every_format_keeps_its_bound(x in wide()) {
        for enc in Encoding::ALL {
            check_bound(enc, &x);
        }
        prop_assert!(roundtrip(Encoding::Exact, &x).iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn arbitrary_bits_never_panic_or_invent_non_finite(bits in prop::collection::vec(any::<u32>(), 1..600)) {
        let x: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
        for enc in Encoding::ALL {
            check_bound(enc, &x);
        }
    }
}
