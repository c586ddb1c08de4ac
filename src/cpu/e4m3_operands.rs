//! The operands FP8 tensor cores take: what the prefill kernel's opt-in E4M3 operands
//! (`PrefillPlan::with_e4m3_operands`) round, and what `kvq eval`'s `(e4m3 MMAs)` rows model
//! (E4M3 codes; E2M1 codes are E4M3 values, their group scales applied to S and to P).
//!
//! FP8 MMAs take E4M3 (or E5M2) on both sides, so beside the cache's codes the query and the
//! probabilities become E4M3 too:
//! - each query row under its own scale `amax / 448` (FORMATS.md's E4M3 calibration; the
//!   kernel computes it per row once a launch, and rounds `q / scale` exactly as here);
//! - each probability `p = exp(s - max)` as the E4M3 of `p · 2^8`, which keeps the largest
//!   probabilities in E4M3's normal range and flushes those below `2^-18` to zero
//!   (FlashAttention-3's FP8 path offsets by the same 2^8). The kernel rounds against its
//!   running max; against the row's final max, as `kvq eval` does, is the pessimistic case (a
//!   running max is at most the final one, so its `p` sit higher in the range). (A kernel over
//!   FP4 values rounds `p` times the group scale instead: the same relative rounding.)
//!
//! The softmax's normalizer sums the unquantized `p`. Hopper's FP8 MMAs accumulate each
//! 32-element product sum with about 14 significant bits before adding it in f32 (reported for
//! H800 GEMMs), a relative error near 2^-14 that the E4M3 rounding of the query (2^-4 per
//! element) dwarfs.

use crate::format::{Fp8Kind, sanitized_amax};

/// The factor on a probability before its E4M3 rounding (FlashAttention-3's FP8 offset).
const P_OFFSET: f64 = 256.0;

/// `x` as its E4M3 code under `scale` decodes, in f32.
fn e4m3_round_trip(x: f32, scale: f32) -> f32 {
    Fp8Kind::E4M3.dequantize(Fp8Kind::E4M3.quantize(x, scale), scale)
}

/// Rows of `head_dim` values, each rounded to E4M3 under its own scale (`amax / 448`; 1 for a
/// row of zeros).
pub fn quantize_rows(q: &[f32], head_dim: usize) -> Vec<f32> {
    q.chunks_exact(head_dim)
        .flat_map(|row| {
            let scale = Fp8Kind::E4M3.scale_from_amax(sanitized_amax(row));
            row.iter().map(move |&x| e4m3_round_trip(x, scale))
        })
        .collect()
}

/// A probability `p` in [0, 1] as an FP8 MMA would take it: the E4M3 of `p · 2^8`, scaled back.
pub fn probability(p: f64) -> f64 {
    f64::from(e4m3_round_trip((p * P_OFFSET) as f32, 1.0)) / P_OFFSET
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_their_largest_value_and_e4m3_precision() {
        // 448 times the row scale is the amax itself; others round to 3 mantissa bits.
        let q = [3.0f32, -1.7, 0.01, 0.0, 100.0, 1.0, -1.0, 0.0];
        let r = quantize_rows(&q, 4);
        assert_eq!(r[0], 3.0);
        assert_eq!(r[4], 100.0);
        for (&x, &y) in q.iter().zip(&r) {
            assert!((x - y).abs() <= x.abs() / 16.0 + 1e-6, "{x} -> {y}");
        }
        assert_eq!(quantize_rows(&[0.0; 4], 4), vec![0.0; 4]);
    }

    #[test]
    fn probabilities_keep_one_and_flush_below_the_offset_range() {
        assert_eq!(probability(1.0), 1.0);
        assert_eq!(probability(0.0), 0.0);
        // E4M3's smallest subnormal is 2^-9, so p below about 2^-18 flushes to zero.
        assert_eq!(probability(2f64.powi(-19)), 0.0);
        assert_eq!(probability(2f64.powi(-17)), 2f64.powi(-17));
        let p = 0.3f64;
        assert!((probability(p) - p).abs() <= p / 16.0);
    }
}
