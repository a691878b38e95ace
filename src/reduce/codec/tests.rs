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

/// The per-element definition of each encoding, written independently of the kernels: a
/// branch per element for the non-finite values, the block max as an `f32` fold.
fn reference_encode(enc: Encoding, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    match enc {
        Encoding::Exact => out = bytes(x),
        Encoding::Bf16 => x.iter().for_each(|v| out.extend(f32_to_bf16(*v).to_le_bytes())),
        Encoding::Fp8 | Encoding::Int8 => {
            let fp8 = enc == Encoding::Fp8;
            let (qmax, nan, pinf, ninf) =
                if fp8 { (FP8_QMAX, 0x7F, 0x7E, 0xFE) } else { (INT8_QMAX, 0x80, 0x7F, 0x81) };
            for block in x.chunks(BLOCK) {
                let m = block.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
                let (scale, pre, inv) = scaling(m, qmax);
                out.extend(scale.to_le_bytes());
                for &v in block {
                    out.push(if v.is_nan() {
                        nan
                    } else if v == f32::INFINITY {
                        pinf
                    } else if v == f32::NEG_INFINITY {
                        ninf
                    } else if fp8 {
                        e4m3_code((v * pre) * inv)
                    } else {
                        rne_byte(((v * pre) * inv).clamp(-INT8_QMAX, INT8_QMAX))
                    });
                }
            }
        }
    }
    out
}

/// The per-element definition of decoding (bits of each `f32`).
fn reference_decode(enc: Encoding, wire: &[u8], n: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(n);
    match enc {
        Encoding::Exact => out.extend(floats(wire).iter().map(|v| v.to_bits())),
        Encoding::Bf16 => {
            out.extend(wire.chunks_exact(2).map(|h| bf16_to_f32(u16::from_le_bytes([h[0], h[1]])).to_bits()))
        }
        Encoding::Fp8 | Encoding::Int8 => {
            for b in wire.chunks(4 + BLOCK) {
                let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                for &c in &b[4..] {
                    let v = match (enc, c) {
                        (Encoding::Fp8, 0x7F | 0xFF) | (Encoding::Int8, 0x80) => f32::NAN,
                        (Encoding::Fp8, 0x7E) | (Encoding::Int8, 0x7F) => f32::INFINITY,
                        (Encoding::Fp8, 0xFE) | (Encoding::Int8, 0x81) => f32::NEG_INFINITY,
                        (Encoding::Fp8, _) => e4m3_value(c) * scale,
                        _ => f32::from(c as i8) * scale,
                    };
                    out.push(v.to_bits());
                }
            }
        }
    }
    out
}

type EncodeFn = fn(Encoding, &[u8], &mut [u8]);
type DecodeFn = fn(Encoding, &[u8], &mut [u8], bool);

/// Every instantiation of the kernels this CPU runs: the public entry points (dispatch), the
/// baseline one and, on x86-64 with AVX2, the AVX2 one.
fn instantiations() -> Vec<(&'static str, EncodeFn, DecodeFn)> {
    let mut v: Vec<(&'static str, EncodeFn, DecodeFn)> = vec![
        ("public", |e, s, d| e.encode(s, d), |e, s, d, add| if add { e.decode_add(s, d) } else { e.decode(s, d) }),
        ("baseline", dispatch::encode_base, dispatch::decode_base),
    ];
    #[cfg(target_arch = "x86_64")]
    if dispatch::avx2::usable() {
        // SAFETY (both closures): only reached after the CPU reported AVX2.
        #[allow(unsafe_code)]
        v.push((
            "avx2",
            |e, s, d| unsafe { dispatch::avx2::encode(e, s, d) },
            |e, s, d, add| unsafe { dispatch::avx2::decode(e, s, d, add) },
        ));
    }
    v
}

/// Every instantiation encodes `x` to the reference's bytes and decodes (and decode-adds) them
/// to the reference's bits.
fn check_identical(x: &[f32]) {
    let acc0: Vec<f32> = (0..x.len()).map(|i| (i as f32 - 7.5) * 0.25).collect();
    for enc in Encoding::ALL {
        let want = reference_encode(enc, x);
        let want_dec = reference_decode(enc, &want, x.len());
        let want_add: Vec<u32> = want_dec.iter().zip(&acc0).map(|(v, a)| (a + f32::from_bits(*v)).to_bits()).collect();
        for (name, encode, decode) in instantiations() {
            let mut wire = vec![0u8; enc.size(x.len())];
            encode(enc, &bytes(x), &mut wire);
            assert!(wire == want, "{name} {enc:?}: encoding differs from the reference (n = {})", x.len());
            let mut out = vec![0u8; 4 * x.len()];
            decode(enc, &want, &mut out, false);
            let got: Vec<u32> = floats(&out).iter().map(|v| v.to_bits()).collect();
            assert!(got == want_dec, "{name} {enc:?}: decoding differs from the reference");
            let mut acc = bytes(&acc0);
            decode(enc, &want, &mut acc, true);
            let got: Vec<u32> = floats(&acc).iter().map(|v| v.to_bits()).collect();
            assert!(got == want_add, "{name} {enc:?}: decode-add differs from the reference");
        }
    }
}

#[test]
fn kernels_match_the_reference_on_special_blocks() {
    let sub: Vec<f32> =
        (0..700u32).map(|i| f32::from_bits(i * 977 % 0x0080_0000) * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
    let mut mixed: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.77).sin() * 2f32.powi(i % 40 - 20)).collect();
    for (j, v) in [(0, f32::NAN), (17, f32::INFINITY), (255, f32::NEG_INFINITY), (256, -0.0), (999, f32::NAN)] {
        mixed[j] = v;
    }
    let all_bad = vec![f32::NAN; 300];
    let extremes = [f32::MAX, -f32::MAX, f32::MIN_POSITIVE, -1e-45, 0.0, -0.0, 1.0, f32::MAX / 3.0];
    for x in [&[][..], &[0.0; 513][..], &sub, &mixed, &all_bad, &extremes] {
        check_identical(x);
    }
    // Every code of the block formats decodes as the reference says, for scales of every kind.
    for scale in [0.0, 1.0, -0.0, 1e-45, 3.5e-40, 2.5e30, f32::MAX] {
        for enc in [Encoding::Fp8, Encoding::Int8] {
            let mut wire = scale.to_le_bytes().to_vec();
            wire.extend(0..=255u8);
            let want = reference_decode(enc, &wire, 256);
            for (name, _, decode) in instantiations() {
                let mut out = vec![0u8; 4 * 256];
                decode(enc, &wire, &mut out, false);
                let got: Vec<u32> = floats(&out).iter().map(|v| v.to_bits()).collect();
                assert!(got == want, "{name} {enc:?} scale {scale}: a code decodes differently");
            }
        }
    }
}

proptest! {
    #[test]
    fn kernels_match_the_reference_on_random_bits(bits in prop::collection::vec(any::<u32>(), 0..1100)) {
        check_identical(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>());
    }

    #[test]
    fn kernels_match_the_reference_on_wide_ranges(x in wide()) {
        check_identical(&x);
    }
}
