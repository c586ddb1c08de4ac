//! Bit-exactness of the element formats against FORMATS.md: every FP8 code, every FP8 rounding
//! boundary, a cross-check with the `float8` crate (a port of CUDA's `cuda_fp8.hpp` conversions
//! with `__NV_SATFINITE`), INT4 groups against a literal transcription of the spec, edge groups,
//! round-trip error bounds, and f16/bf16 pass-through.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use kvq::KvFormat;
use kvq::format::{Fp8Kind, int4, sanitize, sanitized_amax};
use proptest::prelude::*;

// ---------------------------------------------------------------- FP8 decode

/// Value of an FP8 code computed from its fields, independently of the crate:
/// `(-1)^s * 2^(e - bias) * (1 + m / 2^mbits)`, or `2^(1 - bias) * m / 2^mbits` when `e == 0`.
fn fp8_value(code: u8, ebits: u32, mbits: u32) -> f64 {
    let bias = (1i32 << (ebits - 1)) - 1;
    let e = ((code >> mbits) & ((1 << ebits) - 1) as u8) as i32;
    let m = (code & ((1 << mbits) - 1) as u8) as f64 / (1u32 << mbits) as f64;
    let mag = if e == 0 {
        2f64.powi(1 - bias) * m
    } else {
        2f64.powi(e - bias) * (1.0 + m)
    };
    if code & 0x80 != 0 { -mag } else { mag }
}

#[test]
fn e4m3_every_code_decodes() {
    let k = Fp8Kind::E4M3;
    for code in 0..=255u8 {
        let ours = k.decode(code);
        let theirs = F8E4M3::from_bits(code).to_f32();
        if code & 0x7F == 0x7F {
            assert!(ours.is_nan() && theirs.is_nan(), "{code:#04x} is NaN");
            continue;
        }
        let want = fp8_value(code, 4, 3);
        assert_eq!(ours as f64, want, "code {code:#04x}");
        assert_eq!(
            ours.to_bits(),
            theirs.to_bits(),
            "code {code:#04x} vs float8"
        );
        assert!(ours.is_finite());
    }
    assert_eq!(k.decode(0x7E), 448.0);
    assert_eq!(k.decode(0xFE), -448.0);
    assert_eq!(k.decode(0x38), 1.0);
    assert_eq!(k.decode(0x08), 2f32.powi(-6)); // smallest normal
    assert_eq!(k.decode(0x07), 7.0 * 2f32.powi(-9)); // largest subnormal
    assert_eq!(k.decode(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(k.decode(0x80).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn e5m2_every_code_decodes() {
    let k = Fp8Kind::E5M2;
    for code in 0..=255u8 {
        let ours = k.decode(code);
        let theirs = F8E5M2::from_bits(code).to_f32();
        match code & 0x7F {
            0x7C => {
                assert_eq!(
                    ours,
                    if code & 0x80 != 0 {
                        f32::NEG_INFINITY
                    } else {
                        f32::INFINITY
                    }
                );
                assert_eq!(ours, theirs);
            }
            0x7D..=0x7F => assert!(ours.is_nan() && theirs.is_nan(), "{code:#04x} is NaN"),
            _ => {
                assert_eq!(ours as f64, fp8_value(code, 5, 2), "code {code:#04x}");
                assert_eq!(
                    ours.to_bits(),
                    theirs.to_bits(),
                    "code {code:#04x} vs float8"
                );
            }
        }
    }
    assert_eq!(k.decode(0x7B), 57344.0);
    assert_eq!(k.decode(0x3C), 1.0);
    assert_eq!(k.decode(0x04), 2f32.powi(-14));
    assert_eq!(k.decode(0x01), 2f32.powi(-16));
}

// ---------------------------------------------------------------- FP8 encode

fn float8_encode(kind: Fp8Kind, x: f32) -> u8 {
    match kind {
        Fp8Kind::E4M3 => F8E4M3::from_f32(x).to_bits(),
        Fp8Kind::E5M2 => F8E5M2::from_f32(x).to_bits(),
    }
}

fn next_up(x: f32) -> f32 {
    debug_assert!(x >= 0.0);
    f32::from_bits(x.to_bits() + 1)
}

fn next_down(x: f32) -> f32 {
    debug_assert!(x > 0.0);
    f32::from_bits(x.to_bits() - 1)
}

/// Between every two adjacent finite codes: the lower code up to the midpoint, ties to the even
/// code, the upper code after; mirrored for negatives; checked against float8 too.
#[test]
fn encode_rounds_to_nearest_even_at_every_boundary() {
    for (kind, max_code) in [(Fp8Kind::E4M3, 0x7Eu8), (Fp8Kind::E5M2, 0x7B)] {
        let check = |x: f32, want: u8| {
            for (x, want) in [(x, want), (-x, want | 0x80)] {
                assert_eq!(kind.encode(x), want, "{kind:?} encode({x:e})");
                assert_eq!(float8_encode(kind, x), want, "{kind:?} float8({x:e})");
            }
        };
        for c in 0..max_code {
            let (a, b) = (kind.decode(c), kind.decode(c + 1));
            let mid = (a + b) / 2.0; // exact: one more bit than the codes
            assert_eq!(mid as f64, (a as f64 + b as f64) / 2.0);
            check(a, c);
            check(b, c + 1);
            check(mid, if c % 2 == 0 { c } else { c + 1 });
            check(next_up(mid), c + 1);
            if mid > 0.0 {
                check(next_down(mid), c);
            }
        }
        // Saturation: everything beyond max finite, even past the would-be next code.
        let max = kind.max_finite();
        let step = max - kind.decode(max_code - 1);
        for x in [
            max,
            next_up(max),
            max + step / 2.0,
            next_up(max + step / 2.0),
            max + step,
            1e30,
            f32::MAX,
            f32::INFINITY,
        ] {
            check(x, max_code);
        }
        // Below half the smallest subnormal: zero.
        check(f32::from_bits(1), 0);
        check(kind.decode(1) / 2.0, 0);
        check(next_up(kind.decode(1) / 2.0), 1);
    }
    // The E4M3 boundaries of the spec: 448 is max, 464 ties down to it, 480 saturates.
    let k = Fp8Kind::E4M3;
    assert_eq!(
        [k.encode(448.0), k.encode(464.0), k.encode(480.0)],
        [0x7E; 3]
    );
    assert_eq!(k.encode(next_down(464.0)), 0x7E);
    assert_eq!(k.encode(416.0), 0x7D);
    assert_eq!(k.encode(432.0), 0x7E); // tie between 0x7D (416) and 0x7E (448): even
    assert_eq!(k.encode(f32::NAN), 0x7F);
}

/// Every `STEP`-th f32 bit pattern (all exponents, many mantissas), both signs, against float8.
#[test]
fn encode_matches_float8_on_a_sweep() {
    const STEP: u32 = 97;
    for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
        let mut bits = 0u32;
        while let Some(next) = bits.checked_add(STEP) {
            let x = f32::from_bits(bits);
            if !x.is_nan() {
                assert_eq!(
                    kind.encode(x),
                    float8_encode(kind, x),
                    "{kind:?} {x:e} ({bits:#010x})"
                );
            }
            bits = next;
        }
    }
}

/// All 2^32 f32 values (about a minute in release): `cargo test --test format_exact -- --ignored`.
#[test]
#[ignore]
fn encode_matches_float8_exhaustively() {
    for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
        for bits in 0..=u32::MAX {
            let x = f32::from_bits(bits);
            if !x.is_nan() {
                assert_eq!(kind.encode(x), float8_encode(kind, x), "{kind:?} {x:e}");
            }
        }
    }
}

proptest! {
    /// Scaled quantization is `encode(x / s)` and decodes to `decode(code) * s`.
    #[test]
    fn scaled_fp8_matches_float8(x in -70000f32..70000.0, log_s in -20f32..10.0) {
        let s = log_s.exp2();
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            let (v, _) = sanitize(x);
            let code = kind.quantize(v, s);
            prop_assert_eq!(code, float8_encode(kind, v / s));
            prop_assert_eq!(kind.dequantize(code, s), kind.decode(code) * s);
        }
    }
}

#[test]
fn fp8_rows_sanitize_and_count_non_finite() {
    for format in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
        let kind = format.fp8_kind().unwrap();
        let mut x = vec![1.5f32; 16];
        x[0] = f32::NAN;
        x[1] = f32::INFINITY;
        x[2] = f32::NEG_INFINITY;
        x[3] = 1e9; // finite: clamped, not counted
        let s = kind.scale_from_amax(sanitized_amax(&x));
        assert_eq!(s, 65504.0 / kind.max_finite());
        let mut codes = [0u8; 16];
        assert_eq!(format.encode_row(&x, s, &mut codes, &mut []), 3);
        assert_eq!(codes[0], 0x00); // NaN -> 0
        assert_eq!(codes[1], kind.encode(65504.0 / s));
        assert_eq!(codes[2], kind.encode(-65504.0 / s));
        assert_eq!(codes[3], codes[1]);
        let mut out = [0f32; 16];
        format.decode_row(&codes, &[], s, &mut out);
        assert!(out.iter().all(|v| v.is_finite()));
        assert!((out[1] - 65504.0).abs() <= 65504.0 * 0.07);
    }
    assert_eq!(Fp8Kind::E4M3.scale_from_amax(0.0), 1.0);
    assert_eq!(Fp8Kind::E4M3.scale_from_amax(896.0), 2.0);
    assert_eq!(Fp8Kind::E5M2.scale_from_amax(57344.0), 1.0);
}

// ---------------------------------------------------------------- INT4

/// Symmetric INT4 of one group of 32, transcribed from FORMATS.md: f16 scale and the codes.
fn spec_sym(x: &[f32]) -> (f16, Vec<i8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = f16::from_f32(amax / 7.0);
    let sf = s.to_f32();
    let q = x
        .iter()
        .map(|&v| {
            if sf == 0.0 {
                0
            } else {
                (v / sf).round_ties_even().clamp(-7.0, 7.0) as i8
            }
        })
        .collect();
    (s, q)
}

/// Affine INT4 of one group of 64, transcribed from FORMATS.md: f16 scale, f16 zero, codes.
fn spec_affine(x: &[f32]) -> (f16, f16, Vec<u8>) {
    let mn = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let s = f16::from_f32((mx - mn) / 15.0);
    let z = f16::from_f32(mn);
    let (sf, zf) = (s.to_f32(), z.to_f32());
    let q = x
        .iter()
        .map(|&v| {
            if sf == 0.0 {
                0
            } else {
                ((v - zf) / sf).round_ties_even().clamp(0.0, 15.0) as u8
            }
        })
        .collect();
    (s, z, q)
}

/// Encode a K row (head_dim = x.len()) and return (codes, per-group f16 scales).
fn encode_k(x: &[f32]) -> (Vec<i8>, Vec<f16>, u64) {
    let f = KvFormat::Int4Sym32;
    let mut codes = vec![0u8; f.code_bytes(x.len())];
    let mut meta = vec![0u8; f.meta_bytes(x.len())];
    let nf = f.encode_row(x, 1.0, &mut codes, &mut meta);
    let q = (0..x.len())
        .map(|i| int4::signed_nibble(&codes, i))
        .collect();
    let s = meta
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]))
        .collect();
    (q, s, nf)
}

/// Encode a V row and return (codes, per-group (scale, zero)).
fn encode_v(x: &[f32]) -> (Vec<u8>, Vec<(f16, f16)>, u64) {
    let f = KvFormat::Int4Affine64;
    let mut codes = vec![0u8; f.code_bytes(x.len())];
    let mut meta = vec![0u8; f.meta_bytes(x.len())];
    let nf = f.encode_row(x, 1.0, &mut codes, &mut meta);
    let q = (0..x.len()).map(|i| int4::nibble(&codes, i)).collect();
    let sz = meta
        .chunks_exact(4)
        .map(|b| {
            (
                f16::from_le_bytes([b[0], b[1]]),
                f16::from_le_bytes([b[2], b[3]]),
            )
        })
        .collect();
    (q, sz, nf)
}

fn decode(format: KvFormat, x: &[f32]) -> Vec<f32> {
    let mut codes = vec![0u8; format.code_bytes(x.len())];
    let mut meta = vec![0u8; format.meta_bytes(x.len())];
    format.encode_row(x, 1.0, &mut codes, &mut meta);
    let mut out = vec![0f32; x.len()];
    format.decode_row(&codes, &meta, 1.0, &mut out);
    out
}

#[test]
fn int4_packing_is_low_nibble_first() {
    // Group amax 7 -> scale exactly 1: the codes are the values.
    let mut x = vec![0f32; 32];
    x[..6].copy_from_slice(&[7.0, -7.0, 1.0, -1.0, 3.0, 0.0]);
    let f = KvFormat::Int4Sym32;
    let (mut codes, mut meta) = ([0u8; 16], [0u8; 2]);
    f.encode_row(&x, 1.0, &mut codes, &mut meta);
    assert_eq!(&codes[..3], &[0x97, 0xF1, 0x03]);
    assert_eq!(meta, f16::from_f32(1.0).to_le_bytes());
    // 0x8 (-8) is never written: it is outside -7..=7.
    let (q, _, _) = encode_k(&[-100.0; 32]);
    assert!(q.iter().all(|&c| c == -7));
}

#[test]
fn int4_edge_groups() {
    // All zero: scale 0, codes 0, decodes to 0.
    let (q, s, nf) = encode_k(&[0.0; 64]);
    assert_eq!((q, s, nf), (vec![0; 64], vec![f16::ZERO; 2], 0));
    let (q, sz, _) = encode_v(&[0.0; 64]);
    assert_eq!((q, sz), (vec![0; 64], vec![(f16::ZERO, f16::ZERO)]));
    assert_eq!(decode(KvFormat::Int4Affine64, &[0.0; 64]), vec![0.0; 64]);

    // Constant groups: K codes all ±7; V has scale 0 and decodes to f16(c) exactly.
    for c in [3.0f32, -3.0, 1e-3, 1000.1] {
        let (q, s, _) = encode_k(&[c; 32]);
        assert_eq!(s[0], f16::from_f32(c.abs() / 7.0));
        let want = if c > 0.0 { 7 } else { -7 };
        assert!(q.iter().all(|&v| v == want), "{c}: {q:?}");
        let (q, sz, _) = encode_v(&[c; 64]);
        assert_eq!(sz[0], (f16::ZERO, f16::from_f32(c)));
        assert!(q.iter().all(|&v| v == 0));
        let out = decode(KvFormat::Int4Affine64, &[c; 64]);
        assert!(out.iter().all(|&v| v == f16::from_f32(c).to_f32()));
    }

    // One outlier: the others of its group collapse to 0, other groups keep their precision.
    let mut x = vec![0.01f32; 64];
    x[7] = 100.0;
    let out = decode(KvFormat::Int4Sym32, &x);
    let s = f16::from_f32(100.0 / 7.0).to_f32();
    assert_eq!(out[7], 7.0 * s);
    assert!(
        out[..32]
            .iter()
            .enumerate()
            .all(|(i, &v)| i == 7 || v == 0.0)
    );
    assert!(out[32..].iter().all(|&v| (v - 0.01).abs() <= 0.01 / 14.0));

    // ±65504 (the sanitized range's ends): K scale f16(65504 / 7) = 9360, codes ±7.
    let mut x = vec![0f32; 64];
    x[0] = 65504.0;
    x[1] = -65504.0;
    let (q, s, _) = encode_k(&x);
    assert_eq!(s[0].to_f32(), 9360.0);
    assert_eq!((q[0], q[1]), (7, -7));
    assert_eq!(decode(KvFormat::Int4Sym32, &x)[..2], [65520.0, -65520.0]);
    // V: scale f16(131008 / 15) = 8736, zero -65504, codes 15 and 0.
    let (q, sz, _) = encode_v(&x);
    assert_eq!((sz[0].0.to_f32(), sz[0].1.to_f32()), (8736.0, -65504.0));
    assert_eq!((q[0], q[1]), (15, 0));
    assert_eq!(decode(KvFormat::Int4Affine64, &x)[..2], [65536.0, -65504.0]);

    // NaN -> 0 and ±Inf -> ±65504, counted; huge finite values are clamped, not counted.
    let mut y = x.clone();
    y[0] = f32::INFINITY;
    y[1] = f32::NEG_INFINITY;
    y[2] = f32::NAN;
    let (qy, sy, nf) = encode_k(&y);
    assert_eq!(nf, 3);
    assert_eq!((qy.clone(), sy), {
        let (q, s, _) = encode_k(&x);
        (q, s)
    });
    assert_eq!(qy[2], 0);
    assert_eq!(encode_v(&y).2, 3);
    assert_eq!(encode_v(&y).0, encode_v(&x).0);
    let mut z = x.clone();
    z[0] = 1e9;
    z[1] = -3e38;
    assert_eq!(encode_k(&z).2, 0);
    assert_eq!(encode_k(&z).0, encode_k(&x).0);
}

/// Strategy for one row of `n` values: random magnitudes over 2^-30..2^15 (f16-subnormal and
/// zero scales included), an optional common offset (affine zero-point stress), and sometimes
/// a constant row.
fn row(n: usize) -> impl Strategy<Value = Vec<f32>> {
    (
        -30i32..15,
        prop_oneof![3 => Just(0f32), 1 => -2000f32..2000.0],
        prop::collection::vec(-1f32..1.0, n),
        prop::bool::weighted(0.05),
    )
        .prop_map(|(e, offset, v, constant)| {
            let m = 2f32.powi(e);
            v.iter()
                .map(|&u| {
                    let x = if constant { v[0] } else { u };
                    sanitize(offset + x * m).0
                })
                .collect()
        })
}

const EPS: f64 = 1.0 / (1u64 << 24) as f64; // unit roundoff of f32

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Encoded bytes equal the literal spec, group by group (K: head_dim 128, 4 groups).
    #[test]
    fn int4_k_matches_spec(x in row(128)) {
        let (q, s, nf) = encode_k(&x);
        prop_assert_eq!(nf, 0);
        for (g, group) in x.chunks_exact(32).enumerate() {
            let (ss, qq) = spec_sym(group);
            prop_assert_eq!(s[g].to_bits(), ss.to_bits());
            prop_assert_eq!(&q[g * 32..][..32], &qq[..]);
        }
    }

    #[test]
    fn int4_v_matches_spec(x in row(128)) {
        let (q, sz, nf) = encode_v(&x);
        prop_assert_eq!(nf, 0);
        for (g, group) in x.chunks_exact(64).enumerate() {
            let (ss, zz, qq) = spec_affine(group);
            prop_assert_eq!((sz[g].0.to_bits(), sz[g].1.to_bits()), (ss.to_bits(), zz.to_bits()));
            prop_assert_eq!(&q[g * 64..][..64], &qq[..]);
        }
    }

    /// K round trip. With `sf = f32(s)` and `t = fl(x / sf)`, an element is *in range* when
    /// `|t| <= 7.5`; then `|x - q sf| <= sf/2 + |x| u` (u = 2^-24: the division's rounding;
    /// `q * sf` is exact, 3 x 11 significant bits). Out of range only happens when `s` is an
    /// f16 subnormal that rounded down (or zero), and then the code is ±7 (or 0).
    #[test]
    fn int4_k_round_trip_bound(x in row(64)) {
        let (q, s, _) = encode_k(&x);
        let out = decode(KvFormat::Int4Sym32, &x);
        for (i, (&xi, &oi)) in x.iter().zip(&out).enumerate() {
            let sf = s[i / 32].to_f32();
            let err = (xi as f64 - oi as f64).abs();
            if sf == 0.0 {
                prop_assert_eq!(oi, 0.0);
                prop_assert!(err <= 2f64.powi(-25) * 7.0, "zero scale with |x| = {}", xi);
                continue;
            }
            let t = xi / sf;
            if t.abs() <= 7.5 {
                let bound = 0.5 * sf as f64 + xi.abs() as f64 * EPS;
                prop_assert!(err <= bound, "x {} -> {} err {} > {}", xi, oi, err, bound);
            } else {
                prop_assert!(sf < 2f32.powi(-14), "normal scale {} clamped x {}", sf, xi);
                prop_assert_eq!(q[i].abs(), 7);
            }
        }
    }

    /// V round trip. With `t = fl(fl(x - zf) / sf)`, an element is in range when
    /// `-0.5 <= t <= 15.5`; then
    /// `|x - deq| <= sf/2 + |x - zf| (2u + u²) + |deq| u (1 + u)`
    /// (the subtraction and division roundings scaled back by sf, plus the fma's one rounding).
    /// Out of range only happens when rounding z or s to f16 moved the grid off the data:
    /// `zf - mn > sf/2` (below) or `mx - zf > 15.5 sf` (above); then the code is 0 or 15.
    #[test]
    fn int4_v_round_trip_bound(x in row(128)) {
        let (q, sz, _) = encode_v(&x);
        let out = decode(KvFormat::Int4Affine64, &x);
        for (g, group) in x.chunks_exact(64).enumerate() {
            let (s, z) = sz[g];
            let (sf, zf) = (s.to_f32(), z.to_f32());
            let mn = group.iter().fold(f32::INFINITY, |m, &v| m.min(v)) as f64;
            let mx = group.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            for (j, &xi) in group.iter().enumerate() {
                let i = g * 64 + j;
                let (oi, err) = (out[i] as f64, (xi as f64 - out[i] as f64).abs());
                if sf == 0.0 {
                    // The range is below f16 resolution: every element decodes to the zero.
                    prop_assert_eq!(out[i], zf);
                    continue;
                }
                let t = (xi - zf) / sf;
                let (sf, zf) = (sf as f64, zf as f64);
                if (-0.5..=15.5).contains(&t) {
                    let bound = 0.5 * sf
                        + (xi as f64 - zf).abs() * (2.0 * EPS + EPS * EPS)
                        + oi.abs() * EPS * (1.0 + EPS);
                    prop_assert!(err <= bound, "x {} -> {} err {} > {}", xi, oi, err, bound);
                } else if t < -0.5 {
                    prop_assert!(zf - mn > 0.5 * sf * (1.0 - 1e-6), "zf {} mn {} sf {}", zf, mn, sf);
                    prop_assert_eq!(q[i], 0);
                } else {
                    prop_assert!(mx - zf > 15.5 * sf * (1.0 - 1e-6), "zf {} mx {} sf {}", zf, mx, sf);
                    prop_assert_eq!(q[i], 15);
                }
            }
        }
    }
}

#[test]
fn uniform_int4_baseline() {
    let s = int4::uniform_scale(14.0);
    assert_eq!(s, 2.0);
    assert_eq!(int4::quantize_uniform(5.0, s), 2); // 2.5 -> 2 (even)
    assert_eq!(int4::quantize_uniform(-100.0, s), -7);
    assert_eq!(int4::dequantize_uniform(-7, s), -14.0);
    assert_eq!(int4::quantize_uniform(3.0, 0.0), 0);
}

// ---------------------------------------------------------------- f16 / bf16

#[test]
fn f16_and_bf16_pass_through() {
    // Inputs already in the cache's type are stored bit for bit.
    let h: Vec<f16> = (0..64u16)
        .map(|i| f16::from_bits(i * 997 % 0x7C00))
        .collect();
    let mut codes = vec![0u8; 128];
    assert_eq!(KvFormat::F16.encode_row(&h, 1.0, &mut codes, &mut []), 0);
    let want: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(codes, want);
    let mut out = vec![0f32; 64];
    KvFormat::F16.decode_row(&codes, &[], 1.0, &mut out);
    assert!(out.iter().zip(&h).all(|(&o, v)| o == v.to_f32()));

    let b: Vec<bf16> = (0..64u16)
        .map(|i| bf16::from_bits(i * 1013 % 0x4780)) // finite, below 65504
        .collect();
    KvFormat::Bf16.encode_row(&b, 1.0, &mut codes, &mut []);
    let want: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(codes, want);

    // f32 inputs round to nearest even; NaN -> 0 and ±Inf -> ±65504 first.
    let x: Vec<f32> = (0..64)
        .map(|i| match i {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => 1e6,
            _ => (i as f32 * 0.123_456_7).sin() * 1000.0,
        })
        .collect();
    for format in [KvFormat::F16, KvFormat::Bf16] {
        assert_eq!(format.encode_row(&x, 1.0, &mut codes, &mut []), 3);
        format.decode_row(&codes, &[], 1.0, &mut out);
        for (i, (&xi, &oi)) in x.iter().zip(&out).enumerate() {
            let v = sanitize(xi).0;
            let want = match format {
                KvFormat::F16 => f16::from_f32(v).to_f32(),
                _ => bf16::from_f32(v).to_f32(),
            };
            assert_eq!(oi.to_bits(), want.to_bits(), "{format} element {i}");
        }
        assert_eq!(out[0], 0.0);
    }
    // bf16 cannot hold 65504: the sanitized maximum rounds to 65536 (finite).
    assert_eq!(out[1], 65536.0);
    // f16 inputs into a bf16 cache go through f32 and round once.
    KvFormat::Bf16.encode_row(&h, 1.0, &mut codes, &mut []);
    KvFormat::Bf16.decode_row(&codes, &[], 1.0, &mut out);
    assert!(
        out.iter()
            .zip(&h)
            .all(|(&o, v)| o == bf16::from_f32(v.to_f32()).to_f32())
    );
}

// ---------------------------------------------------------------- INT8 per token-head

/// INT8 of one row, encoded through the cache format: (codes, f32 scale, non-finite count).
fn encode_int8(x: &[f32]) -> (Vec<u8>, f32, u64) {
    let f = KvFormat::Int8Pth;
    let (mut codes, mut meta) = (vec![0xEEu8; x.len()], [0xEEu8; 4]);
    let n = f.try_encode_row(x, 1.0, &mut codes, &mut meta).unwrap();
    (codes, f32::from_le_bytes(meta), n)
}

#[test]
fn int8_edge_rows() {
    // s = 127 / 127 = 1: codes are rne(x), ties to even, clamped; a negative that rounds to
    // zero is +0 (0x00), never 0x80.
    let mut x = vec![0f32; 16];
    x[..8].copy_from_slice(&[127.0, -63.5, 0.5, -0.5, 1.5, -127.0, 2.5, -0.0]);
    let (codes, s, n) = encode_int8(&x);
    assert_eq!((s, n), (1.0, 0));
    assert_eq!(
        &codes[..8],
        &[0x7F, 0xC0, 0x00, 0x00, 0x02, 0x81, 0x02, 0x00]
    );
    assert!(codes[8..].iter().all(|&c| c == 0));
    // Decode is f32(q) * s; 0x80 (never written) is -128 s.
    let mut out = vec![0f32; 16];
    let mut bytes = codes.clone();
    bytes[15] = 0x80;
    KvFormat::Int8Pth.decode_row(&bytes, &0.25f32.to_le_bytes(), 1.0, &mut out);
    assert_eq!(&out[..3], &[31.75, -16.0, 0.0]);
    assert_eq!(out[15], -32.0);

    // All zero: s = 0 and every code 0.
    let (codes, s, _) = encode_int8(&[0.0; 32]);
    assert_eq!(s.to_bits(), 0);
    assert!(codes.iter().all(|&c| c == 0));

    // amax ≤ 63 · 2^-149: amax / 127 underflows to 0, so every code is 0 ...
    let tiny = |m: u32| f32::from_bits(m); // m · 2^-149
    let mut x = vec![0f32; 16];
    x[3] = -tiny(63);
    let (codes, s, _) = encode_int8(&x);
    assert_eq!(s, 0.0);
    assert!(codes.iter().all(|&c| c == 0));
    // ... and 64 · 2^-149 gives s = 2^-149, the amax element's code 64 (x / s = 64, exact).
    x[3] = -tiny(64);
    let (codes, s, _) = encode_int8(&x);
    assert_eq!(s, tiny(1));
    assert_eq!(codes[3], (-64i8) as u8);

    // Non-finite inputs are sanitized (NaN → 0, ±Inf → ±65504) and counted; 1e9 is clamped
    // but finite.
    let mut x = vec![1.0f32; 16];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[2] = f32::NEG_INFINITY;
    x[3] = 1e9;
    let (codes, s, n) = encode_int8(&x);
    assert_eq!(n, 3);
    assert_eq!(s, 65504.0 / 127.0);
    assert_eq!(&codes[..5], &[0x00, 0x7F, 0x81, 0x7F, 0x00]); // 1 / 515.8 rounds to 0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// INT8 rows against a literal transcription of FORMATS.md.
    #[test]
    fn int8_matches_spec(x in row(64)) {
        let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
        let s = clean.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let want: Vec<u8> = clean
            .iter()
            .map(|&v| {
                if s == 0.0 {
                    0
                } else {
                    (v / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8
                }
            })
            .collect();
        let (codes, got_s, _) = encode_int8(&x);
        prop_assert_eq!(got_s.to_bits(), s.to_bits());
        prop_assert_eq!(&codes, &want);
        let out = decode(KvFormat::Int8Pth, &x);
        for (i, &o) in out.iter().enumerate() {
            prop_assert_eq!(o.to_bits(), (want[i] as i8 as f32 * s).to_bits());
        }
    }
}

// ---------------------------------------------------------------- FP4 E2M1

/// FP4 of one row under global scale `g`: (codes, block scales, non-finite count).
fn encode_fp4(x: &[f32], g: f32) -> (Vec<u8>, Vec<u8>, u64) {
    let f = KvFormat::Fp4E2m1;
    let (mut codes, mut meta) = (vec![0xEEu8; x.len() / 2], vec![0xEEu8; x.len() / 16]);
    let n = f.try_encode_row(x, g, &mut codes, &mut meta).unwrap();
    (codes, meta, n)
}

/// Codes of a packed FP4 row, element i at nibble i.
fn nibbles(codes: &[u8]) -> Vec<u8> {
    (0..codes.len() * 2)
        .map(|i| int4::nibble(codes, i))
        .collect()
}

#[test]
fn e2m1_table_and_ties() {
    use kvq::format::fp4::{e2m1, e2m1_value};
    // Every boundary: ties go to the even mantissa, one ulp either side to the neighbours.
    for (b, at, below, above) in [
        (0.25f32, 0, 0, 1),
        (0.75, 2, 1, 2),
        (1.25, 2, 2, 3),
        (1.75, 4, 3, 4),
        (2.5, 4, 4, 5),
        (3.5, 6, 5, 6),
        (5.0, 6, 6, 7),
    ] {
        assert_eq!(e2m1(b), at, "{b}");
        assert_eq!(e2m1(next_down(b)), below, "below {b}");
        assert_eq!(e2m1(next_up(b)), above, "above {b}");
        assert_eq!(e2m1(-b), if at == 0 { 0 } else { at | 8 }, "-{b}");
    }
    // Saturation, and magnitude-0 results as +0.
    for (y, code) in [
        (6.0f32, 7),
        (1e30, 7),
        (f32::INFINITY, 7),
        (-7.0, 0xF),
        (f32::NEG_INFINITY, 0xF),
        (0.0, 0),
        (-0.0, 0),
        (-0.25, 0),
        (-f32::from_bits(1), 0),
        (-0.2500001, 9),
    ] {
        assert_eq!(e2m1(y), code, "{y}");
    }
    let values = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for c in 0..16u8 {
        let want = if c & 8 != 0 {
            -values[c as usize & 7]
        } else {
            values[c as usize & 7]
        };
        assert_eq!(e2m1_value(c).to_bits(), want.to_bits(), "{c:#x}");
    }
    assert_eq!(e2m1_value(8).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn fp4_edge_groups() {
    let f = KvFormat::Fp4E2m1;
    // g = 1, amax16 = 6: t = 1, u = 1, sb = E4M3(1) = 0x38, d = 1: codes are e2m1(x).
    let mut x = vec![0f32; 32];
    x[..10].copy_from_slice(&[6.0, 3.0, -1.5, 0.5, 0.25, -0.25, 5.0, -5.0, 2.5, -0.1]);
    // Second group: g = 1, amax16 = 12: u = 2, sb = 0x40, d = 2.
    x[16..20].copy_from_slice(&[12.0, -7.0, 3.0, 1.0]);
    let (codes, sb, n) = encode_fp4(&x, 1.0);
    assert_eq!(n, 0);
    assert_eq!(sb, [0x38, 0x40]);
    let c = nibbles(&codes);
    assert_eq!(&c[..10], &[7, 5, 0xB, 1, 0, 0, 6, 0xE, 4, 0]);
    assert!(c[10..16].iter().all(|&q| q == 0));
    // 12 / 2 = 6 → 7; -7 / 2 = -3.5 → tie to 4 → 0xE; 3 / 2 = 1.5 → 3; 1 / 2 = 0.5 → 1.
    assert_eq!(&c[16..20], &[7, 0xE, 3, 1]);
    let mut out = vec![0f32; 32];
    f.decode_row(&codes, &sb, 1.0, &mut out);
    assert_eq!(&out[..4], &[6.0, 3.0, -1.5, 0.5]);
    assert_eq!(&out[16..20], &[12.0, -8.0, 3.0, 1.0]);
    assert_eq!(out[5].to_bits(), 0); // +0.0, not -0.0

    // g = 0.5 and amax16 = 12: u = 12 / 6 / 0.5 = 4, sb = E4M3(4) = 0x48, d = 2.
    let mut x = vec![0f32; 32];
    x[0] = 12.0;
    x[1] = -2.9;
    let (codes, sb, _) = encode_fp4(&x, 0.5);
    assert_eq!(sb[0], 0x48);
    assert_eq!(&nibbles(&codes)[..2], &[7, 0xB]); // -1.45 → 1.5

    // Block-scale underflow: u = 2^-10 is a tie to 0x00, so d = 0 and every code is 0; just
    // above it gives the smallest subnormal, 0x01.
    let mut x = vec![0f32; 32];
    x[0] = 6.0 * 2f32.powi(-10);
    x[1] = -x[0];
    let (codes, sb, _) = encode_fp4(&x, 1.0);
    assert_eq!(sb[0], 0x00);
    assert!(codes.iter().all(|&b| b == 0));
    x[0] = next_up(6.0 * 2f32.powi(-10));
    let (codes, sb, _) = encode_fp4(&x, 1.0);
    assert_eq!(sb[0], 0x01);
    // d = 2^-9: x / d is just above 3 (→ 3, code 5) and -3 (code 0xD).
    assert_eq!(&nibbles(&codes)[..2], &[5, 0xD]);

    // Block-scale saturation: u = 1000 → 0x7E (448), d = 448; everything saturates to ±6 d.
    let mut x = vec![0f32; 32];
    x[0] = 6000.0;
    x[1] = -2688.0;
    let (codes, sb, _) = encode_fp4(&x, 1.0);
    assert_eq!(sb[0], 0x7E);
    assert_eq!(&nibbles(&codes)[..2], &[7, 0xF]);
    f.decode_row(&codes, &sb, 1.0, &mut out);
    assert_eq!(&out[..2], &[2688.0, -2688.0]);

    // Non-finite inputs are sanitized and counted: ±65504 then set amax16.
    let mut x = vec![1.0f32; 32];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[17] = f32::NEG_INFINITY;
    let g = kvq::format::fp4::global_scale_from_amax(sanitized_amax(&x));
    assert_eq!(g, 65504.0 / 2688.0);
    let (codes, sb, n) = encode_fp4(&x, g);
    assert_eq!(n, 3);
    let c = nibbles(&codes);
    assert_eq!((c[0], c[1], c[17]), (0, 7, 0xF));
    f.decode_row(&codes, &sb, g, &mut out);
    assert!(out.iter().all(|v| v.is_finite()));
}

#[test]
fn fp4_decode_order_and_global_scale() {
    // Decode is (value(c) · value(sb)) · g, one rounding of the exact product, not
    // value(c) · (value(sb) · g): with c = 1.5 (0x3), sb = 1.625 (0x3D), g = 1 + 2^-23 the two
    // differ in the last bit.
    let g = f32::from_bits(0x3F80_0001);
    let mut codes = vec![0u8; 16];
    codes[0] = 0x03;
    let mut meta = [0u8; 2];
    meta[0] = 0x3D;
    let mut out = vec![0f32; 32];
    KvFormat::Fp4E2m1.decode_row(&codes, &meta, g, &mut out);
    assert_eq!(out[0].to_bits(), 0x401C_0001);
    assert_ne!(out[0], 1.5 * (1.625 * g));
    assert_eq!(out[1], 0.0);

    // g = amax / 2688, 1.0 when that underflows: 1344 · 2^-149 / 2688 is a tie to 0.
    use kvq::format::fp4::global_scale_from_amax;
    assert_eq!(global_scale_from_amax(2688.0), 1.0);
    assert_eq!(global_scale_from_amax(0.0), 1.0);
    assert_eq!(global_scale_from_amax(f32::from_bits(1344)), 1.0);
    assert_eq!(
        global_scale_from_amax(f32::from_bits(1345)),
        f32::from_bits(1)
    );
    // A head scale must be positive and finite.
    let mut c = vec![0u8; 16];
    let mut m = [0u8; 2];
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            KvFormat::Fp4E2m1.try_encode_row(&[0f32; 32], bad, &mut c, &mut m),
            Err(kvq::Error::Scale { .. })
        ));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// FP4 rows against a literal transcription of FORMATS.md, under the calibrated g and under
    /// any positive g.
    #[test]
    fn fp4_matches_spec(x in row(64), log_g in -30f32..10.0, calibrated in any::<bool>()) {
        let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
        let amax = clean.iter().fold(0f32, |m, v| m.max(v.abs()));
        let g = if calibrated {
            let g = amax / 2688.0;
            if g == 0.0 { 1.0 } else { g }
        } else {
            2f32.powf(log_g)
        };
        let (codes, sb, _) = encode_fp4(&x, g);
        let got = nibbles(&codes);
        let mut out = vec![0f32; 64];
        KvFormat::Fp4E2m1.decode_row(&codes, &sb, g, &mut out);
        for (k, grp) in clean.chunks(16).enumerate() {
            let a16 = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
            let want_sb = Fp8Kind::E4M3.encode(a16 / 6.0 / g);
            prop_assert_eq!(sb[k], want_sb);
            let d = Fp8Kind::E4M3.decode(want_sb) * g;
            for (i, &v) in grp.iter().enumerate() {
                let want = if d == 0.0 { 0 } else { spec_e2m1(v / d) };
                prop_assert_eq!(got[k * 16 + i], want);
                let value = spec_e2m1_value(want) * Fp8Kind::E4M3.decode(want_sb) * g;
                prop_assert_eq!(out[k * 16 + i].to_bits(), value.to_bits());
            }
        }
    }
}

/// E2M1 from FORMATS.md's table, independently of the crate: the count of boundaries `a` has
/// passed (a tie passes the boundaries whose upper neighbour has mantissa 0).
fn spec_e2m1(y: f32) -> u8 {
    let a = y.abs();
    let passes = [
        (0.25f32, false),
        (0.75, true),
        (1.25, false),
        (1.75, true),
        (2.5, false),
        (3.5, true),
        (5.0, false),
    ];
    let m = passes
        .iter()
        .filter(|&&(b, tie_up)| a > b || (tie_up && a == b))
        .count() as u8;
    if y < 0.0 && m != 0 { m | 8 } else { m }
}

/// E2M1 value from the fields: exp 0 subnormal (`mant · 0.5`), else `(1 + mant/2) · 2^(exp-1)`.
fn spec_e2m1_value(c: u8) -> f32 {
    let (e, m) = ((c >> 1) & 3, (c & 1) as f32);
    let mag = if e == 0 {
        m * 0.5
    } else {
        (1.0 + m / 2.0) * 2f32.powi(e as i32 - 1)
    };
    if c & 8 != 0 { -mag } else { mag }
}
