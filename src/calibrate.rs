//! FP8 scale calibration: the per-KV-head scales of one layer's keys or values, computed from
//! sample activations on the host.
//!
//! An FP8 cache takes one f32 scale per KV head, set before any token is written
//! ([`HostCache::set_scales`](crate::cache::HostCache::set_scales), `DeviceCache::set_scales`).
//! A server fixes them offline, from a dump of K and V over calibration prompts, and then meets
//! tokens it has not seen: values beyond a head's `scale × max_finite` saturate. This module
//! turns such a dump, one layer's K (or V) laid out `[tokens, kv_heads, head_dim]` in f32, f16
//! or bf16, into those scales; call it per layer and per side (or [`layer_scales`] for both).
//!
//! A head's scale is `c / max_finite` for a *clipping value* `c` chosen by a [`ClipMethod`],
//! with FORMATS.md's rule for the quotient ([`Fp8Kind::scale_from_amax`]: 1.0 when it is 0):
//!
//! - [`ClipMethod::Amax`]: `c` is the largest |x| of the head's sanitized values (NaN counts as
//!   0, ±Inf as ±65504): FORMATS.md's calibration, what `kvq quantize --per-head` and
//!   [`HostCache::calibrate_fp8_scales`](crate::cache::HostCache::calibrate_fp8_scales) do.
//!   Nothing in the sample saturates; one outlier sets the scale of the whole head.
//! - [`ClipMethod::Percentile`]`(p)`: `c` is the nearest-rank `p`-th percentile of the same
//!   |x| values (every token and channel of the head): the `r`-th smallest of the `n` values,
//!   `r = ⌈p · n / 100⌉` clamped to `1..=n`. `p` is in (0, 100]; 100 is the amax. The largest
//!   values of the sample then saturate, in exchange for room below: FP8's relative precision
//!   is the same over its whole normal range, so clipping helps only values that an amax scale
//!   would push into the subnormals (below about `amax / 2^15` for E4M3). `kvq eval --scales` measures
//!   whether it pays on a given model.

use crate::error::{Error, Result, at_least_one, reserved};
use crate::format::{Element, Fp8Kind, head_amax, sanitize};

/// How the clipping value of a head (the |x| its scale maps to FP8's largest finite value) is
/// chosen from the head's sample values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClipMethod {
    /// The largest |x| (FORMATS.md's calibration).
    Amax,
    /// The nearest-rank percentile `p` of |x|, `0 < p <= 100` (module docs).
    Percentile(f64),
}

impl ClipMethod {
    /// The method, if its percentile is in (0, 100]; else [`Error::InvalidArgument`].
    pub fn check(self) -> Result<Self> {
        match self {
            ClipMethod::Percentile(p) if !(p > 0.0 && p <= 100.0) => Err(Error::InvalidArgument(
                format!("percentile {p} is not in (0, 100]"),
            )),
            m => Ok(m),
        }
    }

    /// The 1-based rank among `n` values of the value this method clips at, when it is not the
    /// largest (a percentile below 100 of `n > 0` values); `None` for the amax.
    pub(crate) fn below_max_rank(self, n: usize) -> Option<usize> {
        match self {
            ClipMethod::Percentile(p) if p < 100.0 && n > 0 => Some(nearest_rank(p, n)),
            _ => None,
        }
    }
}

/// The FP8 scales of one layer, one per KV head: for
/// [`HostCache::set_scales`](crate::cache::HostCache::set_scales)`(&s.k, &s.v)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerScales {
    /// Key scales.
    pub k: Vec<f32>,
    /// Value scales.
    pub v: Vec<f32>,
}

/// The clipping value of each head of `x` (`[tokens, kv_heads, head_dim]`, any number of
/// tokens, 0 included: then every value is 0) under `method`.
///
/// Errors: `kv_heads` or `head_dim` of 0 ([`Error::Config`]), `x.len()` not a multiple of
/// `kv_heads × head_dim` ([`Error::Length`]), a percentile outside (0, 100]
/// ([`Error::InvalidArgument`]), no memory for a head's values ([`Error::Alloc`]).
pub fn head_clip<T: Element>(
    x: &[T],
    kv_heads: usize,
    head_dim: usize,
    method: ClipMethod,
) -> Result<Vec<f32>> {
    at_least_one(&[("kv_heads", kv_heads), ("head_dim", head_dim)])?;
    // Checks the length too, and is the answer for the amax (and the 100th percentile).
    let amax = head_amax(x, kv_heads, head_dim)?;
    let n = x.len() / kv_heads;
    let Some(rank) = method.check()?.below_max_rank(n) else {
        return Ok(amax);
    };
    let mut values = reserved(n, "calibration values of one head")?;
    (0..kv_heads)
        .map(|head| {
            values.clear();
            for row in x.chunks_exact(head_dim).skip(head).step_by(kv_heads) {
                values.extend(row.iter().map(|v| sanitize(v.to_f32()).0.abs()));
            }
            let (_, &mut c, _) = values.select_nth_unstable_by(rank - 1, f32::total_cmp);
            Ok(c)
        })
        .collect()
}

/// The FP8 `kind` scale of each head of `x` (`[tokens, kv_heads, head_dim]`): the clipping
/// value of `method` divided by `kind.max_finite()`, 1.0 where that is 0. Errors as for
/// [`head_clip`].
pub fn fp8_head_scales<T: Element>(
    x: &[T],
    kv_heads: usize,
    head_dim: usize,
    kind: Fp8Kind,
    method: ClipMethod,
) -> Result<Vec<f32>> {
    let clip = head_clip(x, kv_heads, head_dim, method)?;
    Ok(clip.into_iter().map(|c| kind.scale_from_amax(c)).collect())
}

/// [`fp8_head_scales`] of one layer's keys and values (each `[tokens, kv_heads, head_dim]`;
/// their token counts may differ).
pub fn layer_scales<T: Element>(
    k: &[T],
    v: &[T],
    kv_heads: usize,
    head_dim: usize,
    kind: Fp8Kind,
    method: ClipMethod,
) -> Result<LayerScales> {
    Ok(LayerScales {
        k: fp8_head_scales(k, kv_heads, head_dim, kind, method)?,
        v: fp8_head_scales(v, kv_heads, head_dim, kind, method)?,
    })
}

/// The 1-based nearest rank of the `p`-th percentile of `n > 0` values, `⌈p · n / 100⌉` in
/// `1..=n`. A quotient within 1e-9 (relative) of an integer counts as that integer: decimal
/// percentiles such as 99.9 are not exact in binary, and must not move one rank up for it.
fn nearest_rank(p: f64, n: usize) -> usize {
    let exact = p * n as f64 / 100.0;
    let nearest = exact.round();
    let rank = if (exact - nearest).abs() <= 1e-9 * nearest.max(1.0) {
        nearest
    } else {
        exact.ceil()
    };
    (rank as usize).clamp(1, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::HostCache;
    use crate::format::ScaleGranularity;
    use crate::synth::Synth;
    use crate::{CacheConfig, KvFormat};
    use half::f16;

    const KINDS: [(Fp8Kind, KvFormat); 2] = [
        (Fp8Kind::E4M3, KvFormat::Fp8E4m3),
        (Fp8Kind::E5M2, KvFormat::Fp8E5m2),
    ];

    /// `[tokens, heads, head_dim]` keys with outlier channels, and a few non-finite values.
    fn sample(tokens: usize, heads: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut x = Synth::new(seed).with_outlier_channels(tokens, heads, d, 2, 12.0);
        if x.len() > 10 {
            x[3] = f32::NAN;
            x[7] = f32::NEG_INFINITY;
        }
        x
    }

    #[test]
    fn amax_matches_the_host_cache_calibration() {
        let (heads, d) = (3, 64);
        let (k, v) = (sample(37, heads, d, 1), sample(37, heads, d, 2));
        for (kind, format) in KINDS {
            let config = CacheConfig::new(heads, d, 16, format, format).unwrap();
            let mut cache = HostCache::new(config, 1).unwrap();
            cache
                .calibrate_fp8_scales(&k, &v, ScaleGranularity::PerHead)
                .unwrap();
            let s = layer_scales(&k, &v, heads, d, kind, ClipMethod::Amax).unwrap();
            assert_eq!(s.k, cache.k_scales(), "{kind:?}");
            assert_eq!(s.v, cache.v_scales(), "{kind:?}");
            // The scales are what HostCache takes.
            cache.set_scales(&s.k, &s.v).unwrap();
            // The 100th percentile is the amax.
            let p100 = layer_scales(&k, &v, heads, d, kind, ClipMethod::Percentile(100.0));
            assert_eq!(p100.unwrap(), s);
        }
    }

    #[test]
    fn percentile_is_the_nearest_rank_of_abs_values() {
        // Head 0 holds ±1..=1000 (signs alternating), head 1 the same times 10, one row each
        // of 10 tokens × 100 channels.
        let (tokens, d) = (10, 100);
        let mut x = vec![0f32; tokens * 2 * d];
        for i in 0..tokens * d {
            let (t, c) = (i / d, i % d);
            let value = (i + 1) as f32 * if i % 2 == 0 { 1.0 } else { -1.0 };
            x[(t * 2) * d + c] = value;
            x[(t * 2 + 1) * d + c] = value * 10.0;
        }
        for (p, expected) in [
            (99.9, 999.0),
            (50.0, 500.0),
            (0.1, 1.0),
            (0.05, 1.0),
            (33.3, 333.0),
            (99.95, 1000.0),
            (100.0, 1000.0),
        ] {
            let clip = head_clip(&x, 2, d, ClipMethod::Percentile(p)).unwrap();
            assert_eq!(clip, [expected, expected * 10.0], "p = {p}");
        }
        let s = fp8_head_scales(&x, 2, d, Fp8Kind::E4M3, ClipMethod::Percentile(99.9)).unwrap();
        assert_eq!(s, [999.0 / 448.0, 9990.0 / 448.0]);
        // f16 samples give the answer of their values in f32 (9990 is 9992 in f16).
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let clip = head_clip(&h, 2, d, ClipMethod::Percentile(99.9)).unwrap();
        assert_eq!(clip, [999.0, 9992.0]);
    }

    #[test]
    fn inputs_are_sanitized_and_empty_samples_give_scale_one() {
        // NaN counts as 0 and -Inf as 65504, as FORMATS.md sanitizes every input.
        let x = [f32::NAN, f32::NAN, f32::NAN, f32::NEG_INFINITY];
        for (p, expected) in [(50.0, 0.0), (75.0, 0.0), (100.0, 65504.0)] {
            assert_eq!(
                head_clip(&x, 1, 4, ClipMethod::Percentile(p)).unwrap(),
                [expected]
            );
        }
        let s = fp8_head_scales(&x, 1, 4, Fp8Kind::E4M3, ClipMethod::Percentile(50.0));
        assert_eq!(s.unwrap(), [1.0]);
        for method in [ClipMethod::Amax, ClipMethod::Percentile(99.9)] {
            let empty: [f32; 0] = [];
            let s = fp8_head_scales(&empty, 3, 64, Fp8Kind::E5M2, method).unwrap();
            assert_eq!(s, [1.0; 3]);
        }
    }

    #[test]
    fn bad_shapes_and_percentiles_are_typed_errors() {
        let x = vec![1f32; 2 * 64];
        for p in [0.0, -1.0, 100.5, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(
                    head_clip(&x, 2, 64, ClipMethod::Percentile(p)),
                    Err(Error::InvalidArgument(_))
                ),
                "p = {p}"
            );
        }
        assert!(matches!(
            head_clip(&x, 0, 64, ClipMethod::Amax),
            Err(Error::Config {
                what: "kv_heads",
                ..
            })
        ));
        assert!(matches!(
            head_clip(&x, 2, 0, ClipMethod::Amax),
            Err(Error::Config {
                what: "head_dim",
                ..
            })
        ));
        assert!(matches!(
            head_clip(&x[1..], 2, 64, ClipMethod::Percentile(50.0)),
            Err(Error::Length { .. })
        ));
        assert!(matches!(
            layer_scales(&x, &x[..64], 2, 64, Fp8Kind::E4M3, ClipMethod::Amax),
            Err(Error::Length { .. })
        ));
    }

    #[test]
    fn nearest_rank_is_exact_for_decimal_percentiles() {
        assert_eq!(nearest_rank(99.9, 1000), 999);
        assert_eq!(nearest_rank(99.9, 1001), 1000);
        assert_eq!(nearest_rank(0.001, 5), 1);
        assert_eq!(nearest_rank(100.0, 7), 7);
        assert_eq!(nearest_rank(50.0, 1), 1);
        assert_eq!(nearest_rank(70.0, 10), 7);
        assert_eq!(nearest_rank(29.0, 100), 29);
    }
}
