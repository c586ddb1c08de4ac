//! How a decode launch is cut: the kernel's occupancy, a wave-aware rate model of an SM, and the
//! choice of warps per block, copy stages and split-KV splits that the model predicts fastest.

use super::{MAX_SPLITS, STAGES, WARPS};
use crate::cuda::launch;
use crate::error::{Error, Result};
use crate::format::KvFormat;
use crate::layout::BlockLayout;

/// Split lengths are multiples of this (the kernel's longest step).
pub(super) const SPLIT_MULTIPLE: usize = 32;

/// A split shorter than this costs more in setup and merge than it gains in parallelism.
const MIN_SPLIT_TOKENS: usize = 256;

/// Fixed cost of one thread block in the launch model, in tokens of a 16-bit cache (query
/// setup, pipeline fill, warp merge); fitted with the rate model (see `RateModel`).
const CTA_OVERHEAD_TOKENS: f64 = 512.0;

/// Cost of each split in the launch model, in tokens (of any cache): partial write and merge.
/// The v11 sweeps at B=1 L=4k (H200) ran faster with every split up to one block per SM, and
/// 8 tokens puts the model's pick within 0.2 % of the best launch on all 15 swept shapes (32,
/// from v3's ~0.44 us per split, under-split B=1 by 4-9 %; docs/PERFORMANCE.md v11). Not
/// weighted like the block overhead: weighted, it cut INT4 at B=1 L=4k to 5 splits, 21 %
/// slower than 11.
const SPLIT_COST_TOKENS: f64 = 8.0;

/// Tokens of a `k` / `v` cache that stream in the time of one token of a 16-bit cache: a
/// block's fixed cost takes about the same time whatever the format, so a narrower cache pays
/// it in more of its own tokens (INT4 K + V: ~3.6).
fn tokens_per_16bit_token(k: KvFormat, v: KvFormat) -> f64 {
    4.0 / (k.bytes_per_element() + v.bytes_per_element())
}

/// Split length for `num_splits` splits of `max_len` tokens (a multiple of [`SPLIT_MULTIPLE`]),
/// and the split count that length really gives.
pub(super) fn split_len(max_len: usize, num_splits: usize) -> (usize, usize) {
    let max_len = max_len.max(1);
    let split_tokens = max_len
        .div_ceil(num_splits.max(1))
        .next_multiple_of(SPLIT_MULTIPLE);
    (max_len.div_ceil(split_tokens), split_tokens)
}

/// How one launch is cut: warps per thread block, copy stages per warp, the blocks per SM that
/// fit with them, and the split-KV split count and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LaunchChoice {
    pub warps: usize,
    pub stages: usize,
    pub ctas: usize,
    pub splits: usize,
    pub split_tokens: usize,
}

/// Thread blocks per SM and bytes per stage of the decode kernel for `layout` with `warps`
/// warps per block of `stages` copy stages each (0 blocks: does not fit). The GPU's context
/// must be current.
pub(super) fn occupancy(
    layout: &BlockLayout,
    warps: usize,
    stages: usize,
) -> Result<(usize, usize)> {
    let c = &layout.config;
    launch::decode_occupancy(
        c.k_format as i32,
        c.v_format as i32,
        c.head_dim as i32,
        warps as i32,
        stages as i32,
    )
}

/// What an SM needs to run the decode at its full rate: enough copies in flight and enough
/// resident warps to hide the dependency chains of a step. Fitted to H200 sweeps of every
/// launch shape (`examples/decode_sweep.rs`, docs/PERFORMANCE.md v7 and v11): 16-bit caches
/// want about 128 KB in flight and 8 warps; FP8 and INT4 caches are bound by their warps'
/// latency long before their copies (INT4 ran the same at 61 KB as at 123 KB in flight) and
/// INT4 wants about 10 warps per SM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RateModel {
    /// Bytes of copies each block keeps in flight.
    inflight: usize,
    /// Warps per block.
    warps: usize,
    /// Bytes in flight per SM that reach the full rate.
    inflight_target: usize,
    /// Resident warps per SM that reach the full rate.
    full_rate_warps: usize,
}

impl RateModel {
    /// The model for caches in `k` / `v`, launched with `warps` warps per block of `stages`
    /// stages of `stage_bytes` each (one stage per warp is being computed, the rest in flight).
    fn new(k: KvFormat, v: KvFormat, warps: usize, stages: usize, stage_bytes: usize) -> Self {
        let narrowest = k.bits().min(v.bits());
        RateModel {
            inflight: warps * (stages - 1) * stage_bytes,
            warps,
            inflight_target: if narrowest >= 16 { 128 << 10 } else { 32 << 10 },
            full_rate_warps: if narrowest == 4 { 10 } else { 8 },
        }
    }

    /// Fraction of the full rate of an SM with `k` blocks resident.
    fn rate(&self, k: usize) -> f64 {
        let copies = (k * self.inflight) as f64 / self.inflight_target as f64;
        let warps = (k * self.warps) as f64 / self.full_rate_warps as f64;
        copies.min(warps).min(1.0)
    }
}

/// Time, in units of one block's run at the full rate of an SM, for `blocks` equal blocks on
/// `sms` SMs holding `ctas` blocks each. Blocks run in waves, and an SM slows down below what
/// its resident blocks need (`model`), which is what makes a thin last wave slow (H200: B=64
/// fp8 at 3 blocks per SM, 1.3 waves, 74 % of the ceiling against 87 % at 2 blocks per SM,
/// 1.9 waves).
fn wave_time(blocks: usize, sms: usize, ctas: usize, model: RateModel) -> f64 {
    let slots = ctas * sms;
    let (full, rest) = (blocks / slots, blocks % slots);
    let mut t = full as f64 * ctas as f64 / model.rate(ctas);
    if rest > 0 {
        let k = rest.div_ceil(sms);
        t += k as f64 / model.rate(k);
    }
    t
}

/// The split counts a launch over contexts of up to `max_len` tokens may use: splits no shorter
/// than [`MIN_SPLIT_TOKENS`] (or one), at most [`MAX_SPLITS`] and at most `cap` (what a
/// workspace holds).
pub(super) fn split_range(max_len: usize, cap: usize) -> std::ops::RangeInclusive<usize> {
    1..=max_len
        .div_ceil(MIN_SPLIT_TOKENS)
        .clamp(1, MAX_SPLITS.min(cap.max(1)))
}

/// Warps, stages and split count together, given `occ(warps, stages) -> (blocks per SM, bytes
/// per stage)` and `base` blocks per split (batch x KV heads x query tiles) on `sms` SMs, for
/// contexts up to `max_len` tokens of caches in `formats` (K, V). Model: [`wave_time`] x
/// (tokens per split + a fixed cost per block) + a cost per split; among the launches within
/// 2 % of the best, the fewest splits, then the fewest warps per block (more, smaller blocks
/// per SM hide each other's fixed costs), then the fewest stages. Split counts come from
/// `splits` (see [`split_range`]). An error only if nothing fits.
pub(super) fn choose_launch(
    base: usize,
    sms: usize,
    max_len: usize,
    splits: std::ops::RangeInclusive<usize>,
    (k, v): (KvFormat, KvFormat),
    mut occ: impl FnMut(usize, usize) -> Result<(usize, usize)>,
) -> Result<LaunchChoice> {
    let mut cands = Vec::new(); // (cost, splits, stages, warps, ctas)
    let weight = tokens_per_16bit_token(k, v);
    for warps in WARPS {
        for stages in STAGES {
            let (ctas, stage_bytes) = occ(warps, stages)?;
            if ctas == 0 {
                continue;
            }
            let model = RateModel::new(k, v, warps, stages, stage_bytes);
            for splits in splits.clone() {
                let (n, len) = split_len(max_len, splits);
                let waves = wave_time(base * n, sms, ctas, model);
                let cost = waves * (len as f64 + CTA_OVERHEAD_TOKENS * weight)
                    + n as f64 * SPLIT_COST_TOKENS;
                cands.push((cost, n, stages, warps, ctas));
            }
        }
    }
    let best = cands.iter().map(|c| c.0).fold(f64::INFINITY, f64::min);
    let &(_, n, stages, warps, ctas) = cands
        .iter()
        .filter(|c| c.0 <= best * 1.02)
        .min_by_key(|c| (c.1, c.3, c.2))
        .ok_or_else(|| {
            Error::Unsupported("GPU decode: no stage count fits this device's shared memory".into())
        })?;
    let (splits, split_tokens) = split_len(max_len, n);
    Ok(LaunchChoice {
        warps,
        stages,
        ctas,
        splits,
        split_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared-memory model shaped like the kernel's: `stage` bytes per stage and warp, 227 KB
    /// per SM, at most `max_ctas` blocks per SM by registers.
    fn occ_model(
        stage: usize,
        max_ctas: usize,
    ) -> impl FnMut(usize, usize) -> Result<(usize, usize)> {
        move |warps, stages| {
            let bytes = warps * stages * stage + 8192;
            Ok((((227 << 10) / bytes).min(max_ctas * 4 / warps), stage))
        }
    }

    #[test]
    fn launch_choice() {
        use KvFormat::*;
        // Bytes per stage at head_dim 128 (decode/plan.cuh's Cfg::STAGE): 16 tokens of 16-bit
        // K rows padded to 288 bytes and V rows of 256; FP8 rows unpadded; 32 INT4 tokens.
        let bf16 = ((Bf16, Bf16), 8704);
        let fp8 = ((Fp8E4m3, Fp8E4m3), 4096);
        let int4 = ((Int4Sym32, Int4Affine64), 4608);
        // (warps, stages, blocks per SM, splits, split length); `regs`: 4-warp blocks per SM
        // that registers allow.
        let pick = |base, len, (formats, stage), regs| {
            let c = choose_launch(
                base,
                132,
                len,
                split_range(len, MAX_SPLITS),
                formats,
                occ_model(stage, regs),
            )
            .unwrap();
            (c.warps, c.stages, c.ctas, c.splits, c.split_tokens)
        };
        // Many blocks of a 16-bit cache: 2 blocks of 4 warps x 3 stages (143 KB in flight).
        assert_eq!(pick(512, 16384, bf16, 3), (4, 3, 2, 1, 16384));
        // FP8 and INT4: as many resident warps as fit, few stages, no split.
        assert_eq!(pick(512, 16384, fp8, 4), (4, 2, 4, 1, 16384));
        assert_eq!(pick(1024, 8192, int4, 3), (4, 2, 3, 1, 8192));
        // One sequence of 32k (8 blocks per split): every SM gets one block of 8 warps.
        for (cache, regs) in [(bf16, 3), (int4, 3)] {
            let (w, _, _, n, len) = pick(8, 32768, cache, regs);
            assert!(
                w == 8 && (14..=16).contains(&n) && n * len >= 32768,
                "{n} x {len}"
            );
            assert_eq!(len % SPLIT_MULTIPLE, 0);
        }
        // INT4 at 16 x 4k (128 blocks per split): its fixed costs are ~3.6x as many of its own
        // tokens, so one long split per (sequence, KV head) in blocks of 8 warps beats three
        // short ones; at 64 x 4k, one split in two blocks of 4 warps per SM beats 8-warp
        // blocks (H200 sweeps, docs/PERFORMANCE.md v11).
        assert_eq!(pick(128, 4096, int4, 3), (8, 2, 1, 1, 4096));
        let (w, _, ctas, n, _) = pick(512, 4096, int4, 3);
        assert_eq!((w, ctas, n), (4, 2, 1));
        // Short contexts are never cut below MIN_SPLIT_TOKENS.
        let (.., n, len) = pick(1, 300, bf16, 3);
        assert!(n <= 2 && n * len >= 300);
        // Every choice covers the context with at most MAX_SPLITS splits.
        for (base, len) in [(1, 1), (1, 1 << 20), (3, 777), (4096, 5), (140, 16384)] {
            let (.., n, l) = pick(base, len, int4, 3);
            assert!((1..=MAX_SPLITS).contains(&n) && n * l >= len && l % SPLIT_MULTIPLE == 0);
        }
        // A workspace cap bounds the splits.
        let c = choose_launch(
            8,
            132,
            32768,
            split_range(32768, 3),
            int4.0,
            occ_model(int4.1, 3),
        )
        .unwrap();
        assert!(c.splits <= 3 && c.splits * c.split_tokens >= 32768);
        // Huge stages: whatever fits.
        let (_, _, ctas, ..) = pick(8, 32768, (int4.0, 25_000), 2);
        assert!(ctas >= 1);
        // Nothing fits: an error, not a panic.
        assert!(
            choose_launch(
                128,
                132,
                4096,
                split_range(4096, MAX_SPLITS),
                bf16.0,
                occ_model(200_000, 2)
            )
            .is_err()
        );
    }

    #[test]
    fn waves() {
        let m = |inflight, warps| RateModel {
            inflight,
            warps,
            inflight_target: 128 << 10,
            full_rate_warps: 8,
        };
        // Full waves at full rate cost their block count per SM; a thin last wave costs more.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 4)), 2.0);
        assert!(wave_time(396 + 132, 132, 3, m(43 << 10, 4)) > 4.0);
        // Too few warps slow an SM down as too few copies do.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 2)), 4.0);
    }
}
