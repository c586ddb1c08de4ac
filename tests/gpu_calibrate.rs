//! FP8 calibration on device tensors against the host's, bit for bit: clipping values (amax and
//! nearest-rank percentiles) and scales, for f32 / f16 / bf16 data with outlier channels and
//! non-finite values, several head counts and head dims, a view into a larger buffer, and the
//! errors of bad shapes. Without a GPU each test prints `SKIPPED: no GPU` and passes, unless
//! `KVQ_REQUIRE_GPU=1` (then it fails).
#![cfg(feature = "cuda")]

mod common;

use common::{Input, Rng};
use half::{bf16, f16};
use kvq::Error;
use kvq::calibrate::{self, ClipMethod};
use kvq::cuda::{Gpu, calibrate as device, require_gpu_or_skip};
use kvq::format::Fp8Kind;

/// `[tokens, heads, d]` values: normal, two outlier channels per head, a few NaN / ±Inf, and
/// ties (values repeated exactly), so a rank can land among equal values.
fn sample(rng: &mut Rng, tokens: usize, heads: usize, d: usize) -> Vec<f32> {
    (0..tokens * heads * d)
        .map(|i| {
            let c = i % d;
            let scale = if c == 5 || c == d - 1 { 60.0 } else { 1.0 };
            match rng.below(400) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3..=40 => 0.5, // ties
                _ => rng.normal() * scale,
            }
        })
        .collect()
}

fn check<T: Input>(gpu: &Gpu, x32: &[f32], heads: usize, d: usize, what: &str) {
    let x: Vec<T> = x32.iter().map(|&v| T::from_f32(v)).collect();
    let dev = gpu.stream().clone_htod(&x).unwrap();
    for method in [
        ClipMethod::Amax,
        ClipMethod::Percentile(100.0),
        ClipMethod::Percentile(99.9),
        ClipMethod::Percentile(99.0),
        ClipMethod::Percentile(50.0),
        ClipMethod::Percentile(1e-3),
    ] {
        let want = calibrate::head_clip(&x, heads, d, method).unwrap();
        let got = device::head_clip(gpu, &dev, heads, d, method).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{what} {method:?}");
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            let want = calibrate::fp8_head_scales(&x, heads, d, kind, method).unwrap();
            let got = device::fp8_head_scales(gpu, &dev, heads, d, kind, method).unwrap();
            assert_eq!(bits(&got), bits(&want), "{what} {method:?} {kind:?}");
        }
    }
}

#[test]
fn clipping_values_equal_the_hosts() {
    let Some(gpu) = require_gpu_or_skip("clipping_values_equal_the_hosts") else {
        return;
    };
    let mut rng = Rng(41);
    for (tokens, heads, d) in [
        (1, 1, 64),
        (37, 3, 64),
        (300, 8, 128),
        (1000, 2, 96),
        (5, 40, 256),
    ] {
        let x = sample(&mut rng, tokens, heads, d);
        let what = format!("{tokens} tokens, {heads} heads, d {d}");
        check::<f32>(&gpu, &x, heads, d, &format!("f32 {what}"));
        check::<f16>(&gpu, &x, heads, d, &format!("f16 {what}"));
        check::<bf16>(&gpu, &x, heads, d, &format!("bf16 {what}"));
    }
    // Many values per head: several thread blocks add to one histogram.
    let x = sample(&mut rng, 40_000, 2, 128);
    check::<f16>(&gpu, &x, 2, 128, "f16, 40k tokens");
}

#[test]
fn views_empty_data_and_bad_shapes() {
    let Some(gpu) = require_gpu_or_skip("views_empty_data_and_bad_shapes") else {
        return;
    };
    let mut rng = Rng(7);
    let (heads, d) = (4, 64);
    let x = sample(&mut rng, 50, heads, d);
    let s = gpu.stream();
    let all = s.clone_htod(&x).unwrap();
    // The second half of the tokens, as a view into the whole buffer.
    let half = 25 * heads * d;
    let view = all.slice(half..);
    let want = calibrate::head_clip(&x[half..], heads, d, ClipMethod::Percentile(99.0)).unwrap();
    let got = device::head_clip(&gpu, &view, heads, d, ClipMethod::Percentile(99.0)).unwrap();
    assert_eq!(got, want);
    // No tokens: zeros, as on the host.
    let empty = all.slice(0..0);
    assert_eq!(
        device::head_clip(&gpu, &empty, heads, d, ClipMethod::Amax).unwrap(),
        vec![0.0; heads]
    );
    assert!(matches!(
        device::head_clip(&gpu, &all.slice(1..), heads, d, ClipMethod::Amax),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        device::head_clip(&gpu, &all, 0, d, ClipMethod::Amax),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        device::head_clip(&gpu, &all, heads, d, ClipMethod::Percentile(0.0)),
        Err(Error::InvalidArgument(_))
    ));
}
