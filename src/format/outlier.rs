//! Outlier-aware sub-4-bit keys: per-token INT2 / INT3 rows with the top-k channels of each KV
//! head kept in f16. A CPU reference only (no cache format, no kernel): `kvq eval` dequantizes
//! keys through it and attends them densely to see what such a format would cost in accuracy.
//!
//! Keys carry a few outlier channels, the same ones in every token. A row quantized along
//! head_dim spends its code range on them; at 2 or 3 bits that leaves every other channel with
//! one or two levels. Here the `k` channels of a head with the largest magnitude over the
//! calibration tokens (root mean square, which counts a channel's offset and its spread alike
//! and is not moved by one spike) are stored as f16 and left out of the row's group; the other
//! `head_dim - k` channels form one group per (token, head).
//!
//! The group is **affine** (`s = f16((max - min) / (2^b - 1))`, `z = f16(min)`,
//! `q = clamp(rne((x - z) / s), 0, 2^b - 1)`, decoded `fma(q, s, z)`: INT4 V's math,
//! [`int4::quantize_affine_group`], at `b` bits), not symmetric: a symmetric code spends one of
//! its 2^b levels on a sign-balanced zero (INT2 keeps only −1, 0, 1: 1.58 bits of 2), and once
//! the outlier channels are out a row's extremes are rarely balanced around 0, so the zero point
//! pays for its f16 twice over at these widths.
//!
//! Storage per (token, head): `ceil((head_dim - k) × b / 8)` bytes of codes, an f16 `s` and
//! `z`, and `k` f16 channels ([`bytes_per_element`]). The `k` channel indices per head are
//! stored once per tensor and not counted.

use half::f16;

use super::int4;
use super::sanitize::sanitize;
use crate::error::{Error, Result};

/// The code widths this reference takes: INT2 and INT3, and INT4 (where it is `int4`'s affine
/// math over one row, a check of the generalization).
pub const BITS: [u32; 3] = [2, 3, 4];

/// Check a code width: one of [`BITS`] ([`Error::Config`]).
pub fn check_bits(bits: u32) -> Result<()> {
    if BITS.contains(&bits) {
        Ok(())
    } else {
        Err(Error::Config {
            what: "outlier-aware key code width (bits)",
            value: bits as usize,
            expected: "2, 3 or 4",
        })
    }
}

/// Check that `keep` f16 channels leave at least one of `head_dim` to quantize
/// ([`Error::Config`]).
pub fn check_keep(keep: usize, head_dim: usize) -> Result<()> {
    if keep < head_dim {
        Ok(())
    } else {
        Err(Error::Config {
            what: "f16 channels kept per head (--keep-channels)",
            value: keep,
            expected: "fewer than head_dim: at least one channel must be quantized",
        })
    }
}

/// Bytes per key element at `bits`, `keep` f16 channels and `head_dim` (`keep < head_dim`):
/// `(ceil((head_dim - keep) × bits / 8) + 4 + 2 × keep) / head_dim` (codes padded to a byte
/// per row, an f16 `s` and `z` per row, the kept channels in f16).
pub fn bytes_per_element(bits: u32, keep: usize, head_dim: usize) -> f64 {
    let codes = ((head_dim - keep) * bits as usize).div_ceil(8);
    (codes + 4 + 2 * keep) as f64 / head_dim as f64
}

/// Quantize one affine group at `bits` (2..=4): `s = f16((max - min) / (2^bits - 1))`,
/// `z = f16(min)`, `q = clamp(rne((x - z) / s), 0, 2^bits - 1)`. Writes codes to `codes` (the
/// first `min(x.len(), codes.len())` values) and returns `(s, z)`; an empty group gets 0 and 0.
/// At 4 bits it is exactly [`int4::quantize_affine_group`].
pub fn quantize_affine(x: &[f32], bits: u32, codes: &mut [u8]) -> (f16, f16) {
    let x = &x[..x.len().min(codes.len())];
    if x.is_empty() {
        return (f16::ZERO, f16::ZERO);
    }
    let top = ((1u32 << bits) - 1) as f32;
    let (mn, mx) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    // A zero extreme is +0.0, as in `int4::quantize_affine_group`.
    let (mn, mx) = (mn + 0.0, mx + 0.0);
    let s = f16::from_f32((mx - mn) / top);
    let z = f16::from_f32(mn);
    let (sf, zf) = (s.to_f32(), z.to_f32());
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if sf == 0.0 {
            0
        } else {
            ((v - zf) / sf).round_ties_even().clamp(0.0, top) as u8
        };
    }
    (s, z)
}

/// Outlier-aware keys of `heads` KV heads of `head_dim`: the code width and, per head, the
/// channels kept in f16.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutlierKeys {
    bits: u32,
    heads: usize,
    head_dim: usize,
    keep: usize,
    /// `[heads, keep]`, ascending within a head.
    channels: Vec<usize>,
}

impl OutlierKeys {
    /// Choose, per head, the `keep` channels of largest root mean square over `calib`
    /// (`[tokens, heads, head_dim]`, sanitized as quantizing does; ties go to the lower
    /// channel). `calib` may hold no token: the channels are then `0..keep`.
    pub fn calibrate(
        calib: &[f32],
        heads: usize,
        head_dim: usize,
        bits: u32,
        keep: usize,
    ) -> Result<Self> {
        check_bits(bits)?;
        check_keep(keep, head_dim)?;
        let row = heads * head_dim;
        if row == 0 || calib.len() % row != 0 {
            return Err(Error::Length {
                what: "outlier-aware key calibration tokens (a multiple of heads × head_dim)",
                expected: calib.len().next_multiple_of(row.max(1)),
                actual: calib.len(),
            });
        }
        let mut power = vec![0f64; row];
        for token in calib.chunks_exact(row) {
            for (p, &x) in power.iter_mut().zip(token) {
                let x = sanitize(x).0 as f64;
                *p += x * x;
            }
        }
        let mut channels = Vec::with_capacity(heads * keep);
        for head in power.chunks_exact(head_dim) {
            let mut order: Vec<usize> = (0..head_dim).collect();
            // Stable: equal power keeps the lower channel first.
            order.sort_by(|&a, &b| head[b].total_cmp(&head[a]));
            let mut top = order[..keep].to_vec();
            top.sort_unstable();
            channels.extend(top);
        }
        Ok(OutlierKeys {
            bits,
            heads,
            head_dim,
            keep,
            channels,
        })
    }

    /// The f16 channels of `head`, ascending.
    pub fn channels(&self, head: usize) -> &[usize] {
        &self.channels[head * self.keep..][..self.keep]
    }

    /// Bytes per element ([`bytes_per_element`]).
    pub fn bytes_per_element(&self) -> f64 {
        bytes_per_element(self.bits, self.keep, self.head_dim)
    }

    /// Quantize `x` (`[tokens, heads, head_dim]`) and decode it again: per (token, head) the
    /// kept channels become `f32(f16(x))`, the others one affine group of the row. Inputs are
    /// sanitized first (NaN → 0, clamped to ±65504).
    pub fn round_trip(&self, x: &[f32]) -> Result<Vec<f32>> {
        let row = self.heads * self.head_dim;
        if row == 0 || x.len() % row != 0 {
            return Err(Error::Length {
                what: "outlier-aware keys (a multiple of heads × head_dim)",
                expected: x.len().next_multiple_of(row.max(1)),
                actual: x.len(),
            });
        }
        let mut out = vec![0f32; x.len()];
        let n = self.head_dim - self.keep;
        let (mut group, mut codes) = (vec![0f32; n], vec![0u8; n]);
        for (i, (src, dst)) in x
            .chunks_exact(self.head_dim)
            .zip(out.chunks_exact_mut(self.head_dim))
            .enumerate()
        {
            let kept = self.channels(i % self.heads);
            let mut g = 0;
            for (c, &v) in src.iter().enumerate() {
                let v = sanitize(v).0;
                if kept.binary_search(&c).is_ok() {
                    dst[c] = f16::from_f32(v).to_f32();
                } else {
                    group[g] = v;
                    g += 1;
                }
            }
            let (s, z) = quantize_affine(&group, self.bits, &mut codes);
            let mut g = 0;
            for (c, d) in dst.iter_mut().enumerate() {
                if kept.binary_search(&c).is_err() {
                    *d = int4::dequantize_affine(codes[g], s, z);
                    g += 1;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Synth;

    #[test]
    fn four_bits_is_int4_affine() {
        let x = Synth::new(5).normal(200, 3.0);
        for g in [1, 7, 64, 200] {
            let (mut a, mut b) = (vec![0u8; g], vec![0u8; g]);
            assert_eq!(
                quantize_affine(&x[..g], 4, &mut a),
                int4::quantize_affine_group(&x[..g], &mut b)
            );
            assert_eq!(a, b);
        }
    }

    #[test]
    fn codes_span_the_range() {
        let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut c = vec![0u8; 8];
        let (s, z) = quantize_affine(&x, 3, &mut c);
        assert_eq!((s.to_f32(), z.to_f32()), (1.0, 0.0));
        assert_eq!(c, [0, 1, 2, 3, 4, 5, 6, 7]);
        let (s, _) = quantize_affine(&x, 2, &mut c);
        assert_eq!(s.to_f32(), f16::from_f32(7.0 / 3.0).to_f32());
        assert!(c.iter().all(|&q| q <= 3) && c[0] == 0 && c[7] == 3);
        // A constant group decodes exactly, with scale 0.
        let (s, z) = quantize_affine(&[2.5; 4], 2, &mut c[..4]);
        assert_eq!((s, z.to_f32(), &c[..4]), (f16::ZERO, 2.5, &[0u8; 4][..]));
        assert_eq!(quantize_affine(&[], 2, &mut []), (f16::ZERO, f16::ZERO));
    }

    #[test]
    fn bytes_per_element_counts_codes_metadata_and_channels() {
        // 124 × 3 bits = 46.5 → 47 bytes, + 4 + 8.
        assert_eq!(bytes_per_element(3, 4, 128), 59.0 / 128.0);
        assert_eq!(bytes_per_element(2, 4, 128), 43.0 / 128.0);
        assert_eq!(bytes_per_element(2, 4, 64), 27.0 / 64.0);
        assert_eq!(bytes_per_element(4, 0, 64), 36.0 / 64.0);
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(check_bits(1).is_err() && check_bits(5).is_err());
        assert!(check_keep(8, 8).is_err() && check_keep(7, 8).is_ok());
        assert!(OutlierKeys::calibrate(&[0.0; 16], 2, 8, 3, 8).is_err());
        assert!(OutlierKeys::calibrate(&[0.0; 15], 2, 8, 3, 2).is_err());
        let k = OutlierKeys::calibrate(&[0.0; 16], 2, 8, 3, 2).unwrap();
        assert!(k.round_trip(&[0.0; 17]).is_err());
    }

    /// The planted outlier channels are found per head, kept exactly as f16, and taking them
    /// out of the row's group lowers the error of every other channel.
    #[test]
    fn outlier_channels_are_kept_and_help() {
        let (t, h, d) = (64, 2, 32);
        let x = Synth::new(11).with_offset_outlier_channels(t, h, d, 2, 20.0, 10.0);
        // The planted channels: those that moved under the offset.
        let plain = Synth::new(11).with_outlier_channels(t, h, d, 2, 20.0);
        let mut planted: Vec<usize> = (0..d).filter(|&c| x[c] != plain[c]).collect();
        planted.dedup();
        let keys = OutlierKeys::calibrate(&x[..t / 2 * h * d], h, d, 2, planted.len()).unwrap();
        for head in 0..h {
            assert_eq!(keys.channels(head), &planted[..], "head {head}");
        }
        let kept = keys.round_trip(&x).unwrap();
        let none = OutlierKeys::calibrate(&x, h, d, 2, 0)
            .unwrap()
            .round_trip(&x)
            .unwrap();
        let err = |y: &[f32]| -> f64 {
            x.iter()
                .zip(y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        };
        for (i, (&a, &b)) in x.iter().zip(&kept).enumerate() {
            if planted.contains(&(i % d)) {
                assert_eq!(b, f16::from_f32(a).to_f32());
            }
        }
        assert!(
            err(&kept) < 0.25 * err(&none),
            "{} vs {}",
            err(&kept),
            err(&none)
        );
        // NaN is sanitized to 0 like everywhere else.
        let mut nan = x.clone();
        nan[0] = f32::NAN;
        assert!(keys.round_trip(&nan).unwrap().iter().all(|v| v.is_finite()));
    }
}
