//! The dense-tensor API (`kvq::dense`): bytes against an element-by-element recomputation with
//! `kvq::format`, round trips, scale choices, non-finite inputs, and every rejected input.

use half::{bf16, f16};
use kvq::Error;
use kvq::dense::{
    DenseFormat, Fp8ScaleChoice, QuantizedTensor, StoredDtype, StoredTensor, dequantize, quantize,
};
use kvq::format::{Fp8Kind, int4, sanitize};

/// Deterministic pseudo-random numbers (splitmix64), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1), scaled by a per-call magnitude spread over several decades, with an
    /// occasional outlier so groups see very different ranges.
    fn value(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let decade = 10f32.powi((self.next_u64() % 5) as i32 - 2);
        let outlier = if self.next_u64() % 97 == 0 { 40.0 } else { 1.0 };
        u * decade * outlier
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

/// What one format writes, recomputed element by element from `kvq::format`'s scalar functions.
struct Expected {
    codes: Vec<u8>,
    scales: Vec<u8>,
    zeros: Option<Vec<u8>>,
}

fn expected(format: DenseFormat, x: &[f32], heads: usize, d: usize, per_head: bool) -> Expected {
    let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
    let amax = |vals: &[f32]| vals.iter().fold(0f32, |m, v| m.max(v.abs()));
    match format {
        DenseFormat::Fp8E4m3 | DenseFormat::Fp8E5m2 => {
            let kind = if format == DenseFormat::Fp8E4m3 {
                Fp8Kind::E4M3
            } else {
                Fp8Kind::E5M2
            };
            let scales: Vec<f32> = if per_head {
                (0..heads)
                    .map(|h| {
                        let head: Vec<f32> = clean
                            .chunks(d)
                            .enumerate()
                            .filter(|(r, _)| r % heads == h)
                            .flat_map(|(_, row)| row.iter().copied())
                            .collect();
                        kind.scale_from_amax(amax(&head))
                    })
                    .collect()
            } else {
                vec![kind.scale_from_amax(amax(&clean))]
            };
            let codes = clean
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let h = (i / d) % heads;
                    kind.quantize(v, scales[if per_head { h } else { 0 }])
                })
                .collect();
            Expected {
                codes,
                scales: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                zeros: None,
            }
        }
        DenseFormat::Int4K32 => {
            let mut nibbles = Vec::new();
            let mut scales = Vec::new();
            for g in clean.chunks(32) {
                let s = f16::from_f32(amax(g) / 7.0);
                scales.extend(s.to_le_bytes());
                for &v in g {
                    let q = if s.to_f32() == 0.0 {
                        0
                    } else {
                        (v / s.to_f32()).round_ties_even().clamp(-7.0, 7.0) as i8
                    };
                    nibbles.push(q as u8 & 0xF);
                }
            }
            Expected {
                codes: pack(&nibbles),
                scales,
                zeros: None,
            }
        }
        DenseFormat::Int4V64 => {
            let (mut nibbles, mut scales, mut zeros) = (Vec::new(), Vec::new(), Vec::new());
            for g in clean.chunks(64) {
                let mn = g.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s = f16::from_f32((mx - mn) / 15.0);
                let z = f16::from_f32(mn);
                scales.extend(s.to_le_bytes());
                zeros.extend(z.to_le_bytes());
                for &v in g {
                    let q = if s.to_f32() == 0.0 {
                        0
                    } else {
                        ((v - z.to_f32()) / s.to_f32())
                            .round_ties_even()
                            .clamp(0.0, 15.0) as u8
                    };
                    nibbles.push(q);
                }
            }
            Expected {
                codes: pack(&nibbles),
                scales,
                zeros: Some(zeros),
            }
        }
        DenseFormat::Int4Uniform => {
            let s = amax(&clean) / 7.0;
            let nibbles: Vec<u8> = clean
                .iter()
                .map(|&v| int4::quantize_uniform(v, s) as u8 & 0xF)
                .collect();
            Expected {
                codes: pack(&nibbles),
                scales: s.to_le_bytes().to_vec(),
                zeros: None,
            }
        }
    }
}

/// Two nibbles per byte, the even element low.
fn pack(nibbles: &[u8]) -> Vec<u8> {
    nibbles.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
}

fn check_bytes(q: &QuantizedTensor, e: &Expected, what: &str) {
    assert_eq!(q.codes().data(), &e.codes[..], "{what}: codes");
    assert_eq!(q.scales().data(), &e.scales[..], "{what}: scales");
    assert_eq!(
        q.zeros().map(|z| z.data().to_vec()),
        e.zeros.clone(),
        "{what}: zeros"
    );
}

#[test]
fn bytes_match_elementwise_recomputation() {
    let mut rng = Rng(0x5eed_0001);
    for format in DenseFormat::ALL {
        for shape in [
            vec![128],
            vec![3, 4, 64],
            vec![7, 2, 128],
            vec![2, 3, 1, 192],
        ] {
            let n: usize = shape.iter().product();
            let x = rng.vec(n);
            let heads = if shape.len() >= 2 {
                shape[shape.len() - 2]
            } else {
                1
            };
            let d = *shape.last().unwrap();
            let per_head_choices: &[bool] = if format.fp8_kind().is_some() {
                &[false, true]
            } else {
                &[false]
            };
            for &per_head in per_head_choices {
                let choice = if per_head {
                    Fp8ScaleChoice::PerHeadAmax
                } else {
                    Fp8ScaleChoice::PerTensorAmax
                };
                let q = quantize(format, &x, &shape, choice).unwrap();
                let what = format!("{format} {shape:?} per_head={per_head}");
                check_bytes(&q, &expected(format, &x, heads, d, per_head), &what);
                assert_eq!(q.shape(), &shape[..]);
                assert_eq!(q.non_finite(), 0);
            }
        }
    }
}

#[test]
fn stored_shapes_follow_the_file_layout() {
    let x = vec![0.5f32; 4 * 6 * 64];
    let shape = [4, 6, 64];
    let q = |f, c| quantize(f, &x, &shape, c).unwrap();
    let fp8 = q(DenseFormat::Fp8E4m3, Fp8ScaleChoice::PerTensorAmax);
    assert_eq!(fp8.codes().shape(), &[4, 6, 64]);
    assert_eq!(
        (fp8.scales().dtype(), fp8.scales().shape()),
        (StoredDtype::F32, &[1][..])
    );
    let fp8h = q(DenseFormat::Fp8E5m2, Fp8ScaleChoice::PerHeadAmax);
    assert_eq!(fp8h.scales().shape(), &[6]);
    let k = q(DenseFormat::Int4K32, Fp8ScaleChoice::default());
    assert_eq!(k.codes().shape(), &[4, 6, 32]);
    assert_eq!(
        (k.scales().dtype(), k.scales().shape()),
        (StoredDtype::F16, &[4, 6, 2][..])
    );
    assert!(k.zeros().is_none());
    let v = q(DenseFormat::Int4V64, Fp8ScaleChoice::default());
    assert_eq!(v.scales().shape(), &[4, 6, 1]);
    assert_eq!(v.zeros().unwrap().shape(), &[4, 6, 1]);
    let u = q(DenseFormat::Int4Uniform, Fp8ScaleChoice::default());
    assert_eq!(u.codes().shape(), &[4, 6, 32]);
    assert_eq!(u.scales().shape(), &[1]);
    // 0.5 + 2/32 bytes per element for grouped INT4 K.
    assert_eq!(k.stored_bytes(), 4 * 6 * 64 * 9 / 16);
}

#[test]
fn half_precision_inputs_quantize_like_their_f32_values() {
    let mut rng = Rng(7);
    let x = rng.vec(2 * 4 * 64);
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh32: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    let xb32: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    for format in DenseFormat::ALL {
        let c = Fp8ScaleChoice::default();
        let shape = [2, 4, 64];
        assert_eq!(
            quantize(format, &xh, &shape, c).unwrap(),
            quantize(format, &xh32, &shape, c).unwrap()
        );
        assert_eq!(
            quantize(format, &xb, &shape, c).unwrap(),
            quantize(format, &xb32, &shape, c).unwrap()
        );
    }
}

#[test]
fn dequantize_decodes_every_element_per_spec() {
    let mut rng = Rng(99);
    let shape = [5, 3, 64];
    let x = rng.vec(shape.iter().product());
    for format in DenseFormat::ALL {
        let q = quantize(format, &x, &shape, Fp8ScaleChoice::default()).unwrap();
        let y = dequantize(&q);
        assert_eq!(y.len(), x.len());
        let codes = q.codes().data();
        let f16s =
            |t: &StoredTensor, i: usize| f16::from_le_bytes([t.data()[2 * i], t.data()[2 * i + 1]]);
        let f32_scale = || f32::from_le_bytes(q.scales().data()[..4].try_into().unwrap());
        for (i, &v) in y.iter().enumerate() {
            let want = match format {
                DenseFormat::Fp8E4m3 => Fp8Kind::E4M3.dequantize(codes[i], f32_scale()),
                DenseFormat::Fp8E5m2 => Fp8Kind::E5M2.dequantize(codes[i], f32_scale()),
                DenseFormat::Int4K32 => {
                    int4::dequantize_sym(int4::signed_nibble(codes, i), f16s(q.scales(), i / 32))
                }
                DenseFormat::Int4V64 => int4::dequantize_affine(
                    int4::nibble(codes, i),
                    f16s(q.scales(), i / 64),
                    f16s(q.zeros().unwrap(), i / 64),
                ),
                DenseFormat::Int4Uniform => {
                    int4::dequantize_uniform(int4::signed_nibble(codes, i), f32_scale())
                }
            };
            assert_eq!(v.to_bits(), want.to_bits(), "{format} element {i}");
        }
    }
}

#[test]
fn grouped_int4_beats_uniform_on_outliers() {
    let mut rng = Rng(3);
    let shape = [64, 4, 64];
    let mut x: Vec<f32> = (0..shape.iter().product())
        .map(|_| rng.value() * 0.1)
        .collect();
    for row in x.chunks_mut(64) {
        row[5] = 30.0; // an outlier channel, as real keys have
    }
    let err = |f| {
        let y = dequantize(&quantize(f, &x, &shape, Fp8ScaleChoice::default()).unwrap());
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        (num / den).sqrt()
    };
    assert!(err(DenseFormat::Int4K32) < err(DenseFormat::Int4Uniform));
    assert!(err(DenseFormat::Fp8E4m3) < 0.05);
}

#[test]
fn non_finite_inputs_are_sanitized_and_counted() {
    let mut x = vec![0.25f32; 2 * 64];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[70] = f32::NEG_INFINITY;
    x[71] = 1e9; // finite: clamped, not counted
    for format in DenseFormat::ALL {
        let q = quantize(format, &x, &[2, 64], Fp8ScaleChoice::default()).unwrap();
        assert_eq!(q.non_finite(), 3, "{format}");
        let y = dequantize(&q);
        assert!(y.iter().all(|v| v.is_finite()), "{format}");
    }
}

#[test]
fn fixed_and_per_head_scales() {
    let x: Vec<f32> = (0..2 * 64)
        .map(|i| if i < 64 { 1.0 } else { 100.0 })
        .collect();
    let q = quantize(
        DenseFormat::Fp8E4m3,
        &x,
        &[2, 64],
        Fp8ScaleChoice::Fixed(0.5),
    )
    .unwrap();
    assert_eq!(q.scales().data(), &0.5f32.to_le_bytes());
    assert_eq!(q.codes().data()[0], Fp8Kind::E4M3.encode(2.0));
    let ph = quantize(
        DenseFormat::Fp8E4m3,
        &x,
        &[2, 64],
        Fp8ScaleChoice::PerHeadAmax,
    )
    .unwrap();
    let s: Vec<f32> = ph
        .scales()
        .data()
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(s, vec![1.0 / 448.0, 100.0 / 448.0]);
    assert_eq!(dequantize(&ph), x);
    // An all-zero tensor gets scale 1 (FORMATS.md).
    let z = quantize(
        DenseFormat::Fp8E5m2,
        &[0f32; 16],
        &[16],
        Fp8ScaleChoice::default(),
    )
    .unwrap();
    assert_eq!(z.scales().data(), &1f32.to_le_bytes());
}

#[test]
fn bad_inputs_are_typed_errors() {
    let x = vec![1f32; 96];
    let c = Fp8ScaleChoice::default();
    assert!(matches!(
        quantize(DenseFormat::Int4V64, &x, &[96], c),
        Err(Error::HeadDim { head_dim: 96, .. })
    ));
    assert!(matches!(
        quantize(DenseFormat::Int4K32, &x, &[2, 48], c),
        Err(Error::HeadDim { head_dim: 48, .. })
    ));
    assert!(matches!(
        quantize(DenseFormat::Int4Uniform, &x, &[32, 3], c),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        quantize(DenseFormat::Int4K32, &x, &[2, 32], c),
        Err(Error::Length {
            expected: 64,
            actual: 96,
            ..
        })
    ));
    assert!(matches!(
        quantize(DenseFormat::Fp8E4m3, &x, &[], c),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        quantize(DenseFormat::Fp8E4m3, &x, &[usize::MAX, 2, 16], c),
        Err(Error::InvalidArgument(_))
    ));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            quantize(
                DenseFormat::Fp8E4m3,
                &x,
                &[6, 16],
                Fp8ScaleChoice::Fixed(bad)
            ),
            Err(Error::Scale { .. })
        ));
    }
    assert!(matches!(
        quantize(
            DenseFormat::Int4K32,
            &x,
            &[3, 32],
            Fp8ScaleChoice::PerHeadAmax
        ),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        quantize(
            DenseFormat::Int4Uniform,
            &x,
            &[3, 32],
            Fp8ScaleChoice::Fixed(1.0)
        ),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn from_parts_rejects_inconsistent_parts() {
    let x: Vec<f32> = (0..4 * 64).map(|i| i as f32 / 10.0 - 12.0).collect();
    let shape = [2, 2, 64];
    let parts = |f| {
        quantize(f, &x, &shape, Fp8ScaleChoice::default())
            .unwrap()
            .into_parts()
    };
    let t = |dtype, shape: &[usize], data: Vec<u8>| StoredTensor::new(dtype, shape.to_vec(), data);

    // StoredTensor itself checks bytes against the shape.
    assert!(matches!(
        t(StoredDtype::F16, &[3], vec![0; 5]),
        Err(Error::Length { .. })
    ));

    // Codes of the wrong dtype.
    let (c, s, _) = parts(DenseFormat::Int4K32);
    let c16 = t(StoredDtype::F16, &[2, 2, 16], c.data().to_vec()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4K32, c16, s.clone(), None).is_err());
    // Scales of the wrong shape.
    let s_bad = t(StoredDtype::F16, &[2, 2, 1], s.data()[..8].to_vec()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4K32, c.clone(), s_bad, None).is_err());
    // Codes whose head_dim the format cannot use (int4-k32 codes read as int4-v64: 64 → ok,
    // but scales then have the wrong group count).
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4V64, c.clone(), s.clone(), None).is_err());
    // Zeros where none belong.
    assert!(
        QuantizedTensor::from_parts(DenseFormat::Int4K32, c.clone(), s.clone(), Some(s.clone()))
            .is_err()
    );
    // A NaN group scale.
    let mut nan = s.data().to_vec();
    nan[..2].copy_from_slice(&f16::NAN.to_le_bytes());
    let nan = t(StoredDtype::F16, s.shape(), nan).unwrap();
    assert!(matches!(
        QuantizedTensor::from_parts(DenseFormat::Int4K32, c, nan, None),
        Err(Error::Scale { .. })
    ));

    // int4-v64 needs its zeros, and finite ones.
    let (c, s, z) = parts(DenseFormat::Int4V64);
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4V64, c.clone(), s.clone(), None).is_err());
    let z = z.unwrap();
    let inf = t(
        StoredDtype::F16,
        z.shape(),
        [f16::INFINITY.to_le_bytes(); 4].concat(),
    )
    .unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4V64, c, s, Some(inf)).is_err());

    // FP8 scales: [1] or [heads] only, and positive.
    let (c, _, _) = parts(DenseFormat::Fp8E4m3);
    let three = t(StoredDtype::F32, &[3], [1f32.to_le_bytes(); 3].concat()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c.clone(), three, None).is_err());
    let two = t(StoredDtype::F32, &[2], [1f32.to_le_bytes(); 2].concat()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c.clone(), two, None).is_ok());
    let zero = t(StoredDtype::F32, &[1], 0f32.to_le_bytes().to_vec()).unwrap();
    assert!(matches!(
        QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c, zero, None),
        Err(Error::Scale { .. })
    ));
}

#[test]
fn empty_tensors_are_fine() {
    for format in DenseFormat::ALL {
        let q = quantize::<f32>(format, &[], &[0, 4, 64], Fp8ScaleChoice::default()).unwrap();
        assert!(q.codes().data().is_empty());
        assert!(dequantize(&q).is_empty());
    }
}
