//! Deterministic synthetic activations for tests, benches and examples.
//!
//! Real keys carry a few channels whose magnitude is many times the rest (outlier channels);
//! they are what makes per-tensor quantization fail and grouped quantization necessary, so the
//! generator can plant them. Everything is seeded: a failure reproduces from its seed.
//!
//! The generator is SplitMix64, written out here so that synthetic data costs the library no
//! dependency; its stream for a seed is fixed, so a seed names the same data in every build.

/// A seeded generator of synthetic K/V/Q data.
#[derive(Debug, Clone)]
pub struct Synth {
    state: u64,
}

impl Synth {
    /// A generator with a fixed seed.
    pub fn new(seed: u64) -> Self {
        Synth { state: seed }
    }

    /// The next 64 random bits (SplitMix64).
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 24 bits, so every value is exact in f32.
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in `0..n` (`n > 0`), by the high half of a 64x64-bit product; the bias, below
    /// `n / 2^64`, is far under anything a test could see.
    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
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
                    let u = self.unit() as f64;
                    // Below hi in f64; the cast can round up to hi only at f32's top.
                    (lo + u * (hi - lo)) as f32
                })
                .collect();
        }
        (0..n)
            .map(|_| {
                loop {
                    // `lo + (hi - lo) * u` can round up to `hi`; draw again then.
                    let x = lo + (hi - lo) * self.unit();
                    if x < hi {
                        break x;
                    }
                }
            })
            .collect()
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
            // In (0, 1], so the logarithm is finite.
            let u1 = 1.0 - self.unit();
            let u2 = self.unit();
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let t = std::f32::consts::TAU * u2;
            out.push(r * t.cos());
            out.push(r * t.sin());
        }
        out.truncate(n);
        out
    }

    /// Put `items` in a random order (Fisher–Yates), e.g. to scatter a sequence's blocks over
    /// a pool as a long-running allocator would.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }

    /// Activations `[tokens, heads, head_dim]` with standard deviation 1, where
    /// `outlier_channels` distinct channels of every head (the same ones for every token, as in
    /// real keys; at most `head_dim` of them) are scaled by `outlier_scale`. Any size may be 0
    /// (the result is then empty).
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
        let channels = self.outlier_channels(outlier_channels, head_dim);
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

    /// The outlier channels of [`with_outlier_channels`](Self::with_outlier_channels): its
    /// first draws, a channel drawn again drawn anew (a repeat would scale one channel twice).
    fn outlier_channels(&mut self, count: usize, head_dim: usize) -> Vec<usize> {
        let mut channels = Vec::with_capacity(count.min(head_dim));
        while channels.len() < count.min(head_dim) {
            let c = self.below(head_dim);
            if !channels.contains(&c) {
                channels.push(c);
            }
        }
        channels
    }

    /// [`with_outlier_channels`](Self::with_outlier_channels) whose outlier channels also
    /// carry a mean: each (head, outlier channel) gets `±offset` (in units of the base standard
    /// deviation, 1) added to every token, its sign drawn per head and channel. Real outlier
    /// channels are mostly such an offset, which a group along tokens absorbs in its zero
    /// point. The signs are drawn after the values, and only when `offset != 0`, so an offset
    /// of 0 gives exactly `with_outlier_channels`'s data for the same seed.
    ///
    /// # Panics
    ///
    /// As [`with_outlier_channels`](Self::with_outlier_channels).
    pub fn with_offset_outlier_channels(
        &mut self,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        outlier_channels: usize,
        outlier_scale: f32,
        offset: f32,
    ) -> Vec<f32> {
        // The channels are the first draws of `with_outlier_channels`: seen on a copy.
        let channels = self.clone().outlier_channels(outlier_channels, head_dim);
        let mut x =
            self.with_outlier_channels(tokens, heads, head_dim, outlier_channels, outlier_scale);
        if offset == 0.0 || head_dim == 0 || heads == 0 {
            return x;
        }
        let means: Vec<f32> = (0..heads * channels.len())
            .map(|_| {
                if self.next_u64() >> 63 == 0 {
                    offset
                } else {
                    -offset
                }
            })
            .collect();
        for row in x.chunks_exact_mut(heads * head_dim) {
            for (h, head) in row.chunks_exact_mut(head_dim).enumerate() {
                for (&c, &m) in channels.iter().zip(&means[h * channels.len()..]) {
                    head[c] += m;
                }
            }
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outlier_channels_are_distinct() {
        // Every channel an outlier: each scaled once, none twice (|x| of a normal stays far
        // below 20 standard deviations).
        for seed in 0..50 {
            let x = Synth::new(seed).with_outlier_channels(3, 2, 16, 16, 1e3);
            assert!(x.iter().all(|v| v.abs() < 2e4), "seed {seed}");
            let mut s = Synth::new(seed);
            let mut c = s.outlier_channels(16, 16);
            c.sort_unstable();
            assert_eq!(c, (0..16).collect::<Vec<_>>());
        }
    }

    #[test]
    fn deterministic_and_shaped() {
        let a = Synth::new(7).with_outlier_channels(4, 2, 64, 3, 20.0);
        let b = Synth::new(7).with_outlier_channels(4, 2, 64, 3, 20.0);
        assert_eq!(a, b);
        assert_ne!(a, Synth::new(8).with_outlier_channels(4, 2, 64, 3, 20.0));
        assert_eq!(a.len(), 4 * 2 * 64);
        // An offset of 0 is the plain generator; an offset moves only the outlier channels.
        let z = Synth::new(7).with_offset_outlier_channels(4, 2, 64, 3, 20.0, 0.0);
        assert_eq!(a, z);
        let o = Synth::new(7).with_offset_outlier_channels(4, 2, 64, 3, 20.0, 10.0);
        let moved: Vec<usize> = (0..a.len()).filter(|&i| a[i] != o[i]).collect();
        assert!(!moved.is_empty() && moved.len() <= 4 * 2 * 3);
        for &i in &moved {
            assert!(((o[i] - a[i]).abs() - 10.0).abs() < 1e-3, "{i}");
            // The same channel and head move alike in every token.
            assert!(
                ((o[i] - a[i]) - (o[i % 128] - a[i % 128])).abs() < 1e-3,
                "{i}"
            );
        }
        let n = Synth::new(1).normal(10_000, 2.0);
        let mean = n.iter().sum::<f32>() / n.len() as f32;
        let var = n.iter().map(|x| x * x).sum::<f32>() / n.len() as f32;
        assert!(mean.abs() < 0.1, "mean {mean}");
        assert!((var - 4.0).abs() < 0.3, "variance {var}");
    }

    #[test]
    fn uniform_stays_in_range_and_covers_it() {
        let u = Synth::new(3).uniform(10_000, -1.0, 1.0);
        assert!(u.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = u.iter().sum::<f32>() / u.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!(u.iter().any(|&x| x < -0.99) && u.iter().any(|&x| x > 0.99));
    }

    #[test]
    fn shuffle_is_a_seeded_permutation() {
        let mut a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        Synth::new(5).shuffle(&mut a);
        Synth::new(5).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..1000).collect::<Vec<_>>());
        b.sort_unstable();
        assert_eq!(b, (0..1000).collect::<Vec<_>>());
    }
}
