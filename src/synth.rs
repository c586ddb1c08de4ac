//! Deterministic synthetic activations for tests, benches and examples.
//!
//! Real keys carry a few channels whose magnitude is many times the rest (outlier channels);
//! they are what makes per-tensor quantization fail and grouped quantization necessary, so the
//! generator can plant them. Everything is seeded: a failure reproduces from its seed.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A seeded generator of synthetic K/V/Q data.
#[derive(Debug, Clone)]
pub struct Synth {
    rng: SmallRng,
}

impl Synth {
    /// A generator with a fixed seed.
    pub fn new(seed: u64) -> Self {
        Synth {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// `n` values uniform in `[lo, hi)`. Infinite bounds are taken as ±`f32::MAX`; an empty
    /// range (`lo >= hi`, or a NaN bound) gives `n` copies of `lo`; a range too wide for f32
    /// arithmetic (`hi - lo` infinite) is sampled as `lo + u × (hi - lo)` in f64.
    pub fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        let (lo, hi) = (lo.clamp(f32::MIN, f32::MAX), hi.clamp(f32::MIN, f32::MAX));
        if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
            return vec![lo; n];
        }
        if !(hi - lo).is_finite() {
            let (lo, hi) = (lo as f64, hi as f64);
            return (0..n)
                .map(|_| {
                    let u: f64 = self.rng.random_range(0.0..1.0);
                    // Below hi in f64; the cast can round up to hi only at f32's top.
                    (lo + u * (hi - lo)) as f32
                })
                .collect();
        }
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    /// `n` values from a normal distribution with mean 0 and standard deviation `std`
    /// (Box–Muller).
    ///
    /// # Panics
    ///
    /// Like `Vec`, when `n` values cannot be allocated.
    pub fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(n.saturating_add(1));
        while out.len() < n {
            let u1: f32 = self.rng.random_range(f32::EPSILON..1.0);
            let u2: f32 = self.rng.random_range(0.0..1.0);
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let t = std::f32::consts::TAU * u2;
            out.push(r * t.cos());
            out.push(r * t.sin());
        }
        out.truncate(n);
        out
    }

    /// Activations `[tokens, heads, head_dim]` with standard deviation 1, where
    /// `outlier_channels` channels of every head (the same ones for every token, as in real
    /// keys) are scaled by `outlier_scale`. Any size may be 0 (the result is then empty).
    ///
    /// # Panics
    ///
    /// Like `Vec`, when `tokens × heads × head_dim` values cannot be allocated (a product
    /// beyond `usize` counts as such).
    pub fn with_outlier_channels(
        &mut self,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        outlier_channels: usize,
        outlier_scale: f32,
    ) -> Vec<f32> {
        let channels: Vec<usize> = (0..outlier_channels.min(head_dim))
            .map(|_| self.rng.random_range(0..head_dim))
            .collect();
        let n = tokens.saturating_mul(heads).saturating_mul(head_dim);
        let mut x = self.normal(n, 1.0);
        if head_dim == 0 {
            return x;
        }
        for row in x.chunks_exact_mut(head_dim) {
            for &c in &channels {
                row[c] *= outlier_scale;
            }
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped() {
        let a = Synth::new(7).with_outlier_channels(4, 2, 64, 3, 20.0);
        let b = Synth::new(7).with_outlier_channels(4, 2, 64, 3, 20.0);
        assert_eq!(a, b);
        assert_eq!(a.len(), 4 * 2 * 64);
        let n = Synth::new(1).normal(10_000, 2.0);
        let var = n.iter().map(|x| x * x).sum::<f32>() / n.len() as f32;
        assert!((var - 4.0).abs() < 0.3, "variance {var}");
    }
}
