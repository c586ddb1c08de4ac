//! The dense-tensor API (`kvq::dense`): bytes against an element-by-element recomputation with
//! `kvq::format`, round trips, scale choices, non-finite inputs, and every rejected input.

use half::{bf16, f16};
use kvq::Error;
use kvq::dense::{
    DenseFormat, Fp8ScaleChoice, QuantizedTensor, StoredDtype, StoredTensor, dequantize, quantize,
    quantize_fp8_with_scales,
};
use kvq::format::Fp8Kind;

mod common;
mod quant_ref;
use quant_ref::{Expected, Rng, Values, decode, expected};

fn check_bytes(q: &QuantizedTensor, e: &Expected, what: &str) {
    assert_eq!(q.codes().data(), &e.codes[..], "{what}: codes");
    assert_eq!(q.scales().data(), &e.scales[..], "{what}: scales");
    assert_eq!(
        q.zeros().map(|z| z.data().to_vec()),
        e.zeros.clone(),
        "{what}: zeros"
    );
    assert_eq!(
        q.global_scales().map(|g| g.data().to_vec()),
        e.global_scales.clone(),
        "{what}: global scales"
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
                check_bytes(&q, &expected(format, &x, heads, d, per_head, None), &what);
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
    let i8 = q(DenseFormat::Int8Pth, Fp8ScaleChoice::default());
    assert_eq!(i8.codes().shape(), &[4, 6, 64]);
    assert_eq!(
        (i8.scales().dtype(), i8.scales().shape()),
        (StoredDtype::F32, &[4, 6, 1][..])
    );
    assert!(i8.zeros().is_none() && i8.global_scales().is_none());
    assert_eq!(i8.stored_bytes(), 4 * 6 * (64 + 4));
    let f4 = q(DenseFormat::Fp4E2m1, Fp8ScaleChoice::default());
    assert_eq!(f4.codes().shape(), &[4, 6, 32]);
    assert_eq!(
        (f4.scales().dtype(), f4.scales().shape()),
        (StoredDtype::U8, &[4, 6, 4][..])
    );
    let g = f4.global_scales().unwrap();
    assert_eq!((g.dtype(), g.shape()), (StoredDtype::F32, &[6][..]));
    assert!(f4.zeros().is_none());
    // 0.5 + 1/16 bytes per element, plus 4 per head.
    assert_eq!(f4.stored_bytes(), 4 * 6 * 64 * 9 / 16 + 6 * 4);
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
        for choice in [Fp8ScaleChoice::PerTensorAmax, Fp8ScaleChoice::PerHeadAmax] {
            let Ok(q) = quantize(format, &x, &shape, choice) else {
                continue; // per-head is FP8 only
            };
            let stored = Expected {
                codes: q.codes().data().to_vec(),
                scales: q.scales().data().to_vec(),
                zeros: q.zeros().map(|z| z.data().to_vec()),
                global_scales: q.global_scales().map(|g| g.data().to_vec()),
            };
            let want = decode(format, &stored, 3, 64);
            let got = dequantize(&q);
            assert_eq!(got.len(), x.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{format} {choice:?} element {i}");
            }
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
    assert_eq!(f32s(ph.scales()), vec![1.0 / 448.0, 100.0 / 448.0]);
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

/// The values of an F32 stored part.
fn f32s(t: &StoredTensor) -> Vec<f32> {
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn given_fp8_scales_quantize_like_the_same_chosen_ones() {
    // Two heads of 64, amax 1 and 100: the per-head amax scales given back give the same bytes,
    // one scale for both heads the bytes of that fixed scale, and a smaller scale saturates.
    let x: Vec<f32> = (0..128)
        .map(|i| {
            if i < 64 {
                (i as f32 - 32.0) / 32.0
            } else {
                (i as f32 - 64.0) * 100.0 / 63.0
            }
        })
        .collect();
    let shape = [2, 64];
    for format in [DenseFormat::Fp8E4m3, DenseFormat::Fp8E5m2] {
        let ph = quantize(format, &x, &shape, Fp8ScaleChoice::PerHeadAmax).unwrap();
        let s = f32s(ph.scales());
        assert_eq!(
            quantize_fp8_with_scales(format, &x, &shape, &s).unwrap(),
            ph
        );
        let fixed = quantize(format, &x, &shape, Fp8ScaleChoice::Fixed(0.25)).unwrap();
        assert_eq!(
            quantize_fp8_with_scales(format, &x, &shape, &[0.25]).unwrap(),
            fixed
        );
    }
    let tight =
        quantize_fp8_with_scales(DenseFormat::Fp8E4m3, &x, &shape, &[1.0 / 448.0, 0.1]).unwrap();
    assert_eq!(
        *dequantize(&tight).last().unwrap(),
        44.8,
        "448 x 0.1: saturated"
    );

    let bad = |format, scales: &[f32]| quantize_fp8_with_scales(format, &x, &shape, scales);
    assert!(matches!(
        bad(DenseFormat::Fp8E4m3, &[1.0, 1.0, 1.0]),
        Err(Error::Length {
            expected: 2,
            actual: 3,
            ..
        })
    ));
    assert!(matches!(
        bad(DenseFormat::Fp8E4m3, &[]),
        Err(Error::Length { .. })
    ));
    for s in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MAX] {
        assert!(matches!(
            bad(DenseFormat::Fp8E4m3, &[1.0, s]),
            Err(Error::Scale { .. })
        ));
    }
    assert!(matches!(
        bad(DenseFormat::Int4K32, &[1.0]),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        bad(DenseFormat::Fp4E2m1, &[1.0, 1.0]),
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
    let (c, s, _, _) = parts(DenseFormat::Int4K32);
    let c16 = t(StoredDtype::F16, &[2, 2, 16], c.data().to_vec()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4K32, c16, s.clone(), None, None).is_err());
    // Scales of the wrong shape.
    let s_bad = t(StoredDtype::F16, &[2, 2, 1], s.data()[..8].to_vec()).unwrap();
    assert!(
        QuantizedTensor::from_parts(DenseFormat::Int4K32, c.clone(), s_bad, None, None).is_err()
    );
    // Codes whose head_dim the format cannot use (int4-k32 codes read as int4-v64: 64 → ok,
    // but scales then have the wrong group count).
    assert!(
        QuantizedTensor::from_parts(DenseFormat::Int4V64, c.clone(), s.clone(), None, None)
            .is_err()
    );
    // Zeros where none belong.
    assert!(
        QuantizedTensor::from_parts(
            DenseFormat::Int4K32,
            c.clone(),
            s.clone(),
            Some(s.clone()),
            None
        )
        .is_err()
    );
    // A NaN group scale.
    let mut nan = s.data().to_vec();
    nan[..2].copy_from_slice(&f16::NAN.to_le_bytes());
    let nan = t(StoredDtype::F16, s.shape(), nan).unwrap();
    assert!(matches!(
        QuantizedTensor::from_parts(DenseFormat::Int4K32, c, nan, None, None),
        Err(Error::Scale { .. })
    ));

    // int4-v64 needs its zeros, and finite ones.
    let (c, s, z, _) = parts(DenseFormat::Int4V64);
    assert!(
        QuantizedTensor::from_parts(DenseFormat::Int4V64, c.clone(), s.clone(), None, None)
            .is_err()
    );
    let z = z.unwrap();
    let inf = t(
        StoredDtype::F16,
        z.shape(),
        [f16::INFINITY.to_le_bytes(); 4].concat(),
    )
    .unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Int4V64, c, s, Some(inf), None).is_err());

    // FP8 scales: [1] or [heads] only, and positive.
    let (c, _, _, _) = parts(DenseFormat::Fp8E4m3);
    let three = t(StoredDtype::F32, &[3], [1f32.to_le_bytes(); 3].concat()).unwrap();
    assert!(
        QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c.clone(), three, None, None).is_err()
    );
    let two = t(StoredDtype::F32, &[2], [1f32.to_le_bytes(); 2].concat()).unwrap();
    assert!(QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c.clone(), two, None, None).is_ok());
    let zero = t(StoredDtype::F32, &[1], 0f32.to_le_bytes().to_vec()).unwrap();
    assert!(matches!(
        QuantizedTensor::from_parts(DenseFormat::Fp8E4m3, c, zero, None, None),
        Err(Error::Scale { .. })
    ));

    // int8-pth: F32 row scales, non-negative and finite (0 is an all-zero row).
    let (c, s, _, _) = parts(DenseFormat::Int8Pth);
    let i8 = |v: f32| t(StoredDtype::F32, s.shape(), [v.to_le_bytes(); 4].concat()).unwrap();
    let from = |sc| QuantizedTensor::from_parts(DenseFormat::Int8Pth, c.clone(), sc, None, None);
    assert!(from(s.clone()).is_ok());
    assert!(from(i8(0.0)).is_ok());
    for bad in [-1.0, f32::NAN, f32::INFINITY, f32::MAX] {
        assert!(matches!(from(i8(bad)), Err(Error::Scale { .. })), "{bad}");
    }
    let global = Some(i8(1.0));
    assert!(QuantizedTensor::from_parts(DenseFormat::Int8Pth, c.clone(), s, None, global).is_err());

    // fp4-e2m1: U8 block scales of 0x00..=0x7e, F32 global scales [heads], positive.
    let (c, s, _, g) = parts(DenseFormat::Fp4E2m1);
    let g = g.unwrap();
    let fp4 = |s, g| QuantizedTensor::from_parts(DenseFormat::Fp4E2m1, c.clone(), s, None, g);
    assert!(fp4(s.clone(), Some(g.clone())).is_ok());
    assert!(fp4(s.clone(), None).is_err());
    for bad_sb in [0x7Fu8, 0x80, 0xFE] {
        let mut b = s.data().to_vec();
        b[1] = bad_sb;
        let sb = t(StoredDtype::U8, s.shape(), b).unwrap();
        assert!(fp4(sb, Some(g.clone())).is_err(), "{bad_sb:#x}");
    }
    for bad_g in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MAX] {
        let gs = t(StoredDtype::F32, &[2], [bad_g.to_le_bytes(); 2].concat()).unwrap();
        assert!(
            matches!(fp4(s.clone(), Some(gs)), Err(Error::Scale { .. })),
            "{bad_g}"
        );
    }
    let one = t(StoredDtype::F32, &[1], 1f32.to_le_bytes().to_vec()).unwrap();
    assert!(fp4(s, Some(one)).is_err()); // one per head
}

#[test]
fn empty_tensors_are_fine() {
    for format in DenseFormat::ALL {
        let q = quantize::<f32>(format, &[], &[0, 4, 64], Fp8ScaleChoice::default()).unwrap();
        assert!(q.codes().data().is_empty());
        assert!(dequantize(&q).is_empty());
    }
}
