//! Per-channel INT4 keys (`int4-kc`) against FORMATS.md transcribed independently: the bytes of
//! both forms (dense file, paged cache) for random shapes and group sizes, and the round-trip
//! error bound of affine INT4 along tokens.

use half::f16;
use kvq::format::int4_kc::{self, GROUPS, KcShape, Mode};
use kvq::format::sanitize;
use proptest::prelude::*;

/// One group of one channel, transcribed from FORMATS.md: (s, z, codes).
fn spec_group(x: &[f32]) -> (f16, f16, Vec<u8>) {
    let mut mn = f32::INFINITY;
    let mut mx = f32::NEG_INFINITY;
    for &v in x {
        if v < mn {
            mn = v;
        }
        if v > mx {
            mx = v;
        }
    }
    // "a zero extreme is +0.0"
    if mn == 0.0 {
        mn = 0.0;
    }
    if mx == 0.0 {
        mx = 0.0;
    }
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

/// Keys `[tokens, heads, head_dim]` with a random scale and offset per channel, and sometimes a
/// non-finite value.
fn keys() -> impl Strategy<Value = (usize, usize, usize, usize, Vec<f32>)> {
    (
        0usize..3,
        1usize..80,
        1usize..3,
        1usize..5,
        -20i32..12,
        prop_oneof![3 => Just(0f32), 1 => -500f32..500.0],
        any::<u64>(),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(gi, t, h, half_d, e, offset, seed, poison)| {
            let d = 2 * half_d;
            let mut state = seed;
            let mut next = || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            };
            let m = 2f32.powi(e);
            // Channel c of every head is `offset + x · m · 30^(c mod 3 == 0)`: an outlier channel.
            let mut x: Vec<f32> = (0..t * h * d)
                .map(|i| {
                    let c = i % d;
                    let boost = if c % 3 == 0 { 30.0 } else { 1.0 };
                    offset + next() * m * boost
                })
                .collect();
            if poison {
                let i = (seed as usize) % x.len();
                x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i % 3];
            }
            (GROUPS[gi], t, h, d, x)
        })
}

const EPS: f64 = 1.0 / (1u64 << 24) as f64;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Both forms byte for byte against the transcription; the paged form is the dense form
    /// of the f16 values over the full groups, and f16 for the rest.
    #[test]
    fn matches_formats_md((g, t, h, d, x) in keys()) {
        let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
        let bad = x.iter().filter(|v| !v.is_finite()).count() as u64;
        let shape = KcShape::new(t, h, d, g).unwrap();
        for mode in [Mode::Dense, Mode::Paged] {
            let q = int4_kc::quantize(&x, shape, mode).unwrap();
            prop_assert_eq!(q.non_finite(), bad);
            let inputs: Vec<f32> = match mode {
                Mode::Dense => clean.clone(),
                Mode::Paged => clean.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            };
            let quantized = match mode {
                Mode::Dense => t,
                Mode::Paged => t / g * g,
            };
            let plane = h * d;
            prop_assert_eq!(q.codes().len(), quantized * plane / 2);
            prop_assert_eq!(q.scales().len(), quantized.div_ceil(g) * plane);
            for k in 0..quantized.div_ceil(g) {
                let tokens = k * g..quantized.min(k * g + g);
                for c in 0..plane {
                    let col: Vec<f32> = tokens.clone().map(|tt| inputs[tt * plane + c]).collect();
                    let (s, z, codes) = spec_group(&col);
                    prop_assert_eq!(q.scales()[k * plane + c].to_bits(), s.to_bits());
                    prop_assert_eq!(q.zeros()[k * plane + c].to_bits(), z.to_bits());
                    for (tt, &code) in tokens.clone().zip(&codes) {
                        let i = tt * plane + c;
                        let nibble = (q.codes()[i / 2] >> ((i % 2) * 4)) & 0xF;
                        prop_assert_eq!(nibble, code);
                    }
                }
            }
            let out = q.dequantize().unwrap();
            for (i, &o) in out.iter().enumerate().skip(quantized * plane) {
                prop_assert_eq!(o.to_bits(), f16::from_f32(clean[i]).to_f32().to_bits());
            }
            prop_assert!(out.iter().all(|v| v.is_finite()));
        }
    }

    /// Round trip (dense form): an element whose `(x - z) / s` is in [-0.5, 15.5] is within
    /// `s / 2` plus the roundings of the division and of the fma; one outside is clamped, which
    /// only happens when the f16 rounding of `z` or `s` moved the grid past the group's range.
    #[test]
    fn round_trip_bound((g, t, h, d, x) in keys()) {
        let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
        let shape = KcShape::new(t, h, d, g).unwrap();
        let q = int4_kc::quantize(&x, shape, Mode::Dense).unwrap();
        let out = q.dequantize().unwrap();
        let plane = h * d;
        for (i, (&xi, &oi)) in clean.iter().zip(&out).enumerate() {
            let (tt, c) = (i / plane, i % plane);
            let m = tt / g * plane + c;
            let (sf, zf) = (q.scales()[m].to_f32(), q.zeros()[m].to_f32());
            if sf == 0.0 {
                prop_assert_eq!(oi, zf);
                continue;
            }
            let r = (xi - zf) / sf;
            let (sf, zf, oi) = (sf as f64, zf as f64, oi as f64);
            let err = (xi as f64 - oi).abs();
            if (-0.5..=15.5).contains(&r) {
                let bound = 0.5 * sf
                    + (xi as f64 - zf).abs() * (2.0 * EPS + EPS * EPS)
                    + oi.abs() * EPS * (1.0 + EPS);
                prop_assert!(err <= bound, "x {} -> {} err {} > {}", xi, oi, err, bound);
            } else {
                // Clamped: by at most the f16 rounding of z (half an ulp of |mn|) and of s
                // (15 × half an ulp of s), relative or, for f16 subnormals, 2^-25 each.
                let slack = 0.5 * sf + (zf.abs() + 15.0 * sf) / 1024.0 + 16.0 * 2f64.powi(-25);
                prop_assert!(err <= slack, "clamped x {} -> {} err {}", xi, oi, err);
            }
        }
    }
}
