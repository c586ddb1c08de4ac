//! How a decode launch is cut: the kernel's occupancy, a wave-aware rate model of an SM, and the
//! choice of warps per block, copy stages and split-KV splits that the model predicts fastest.

use super::{MAX_SPLITS, STAGES, WARPS};
use crate::cuda::DeviceProps;
use crate::cuda::launch::{self, DecodeOccupancy};
use crate::error::{Error, Result};
use crate::format::KvFormat;
use crate::layout::BlockLayout;

/// Split lengths are multiples of this (the kernel's longest step).
pub(super) const SPLIT_MULTIPLE: usize = 32;

/// A split shorter than this costs more in setup and merge than it gains in parallelism.
const MIN_SPLIT_TOKENS: usize = 256;

/// Fixed time of one wave of blocks on an SM, in tokens of a 16-bit cache on the reference
/// device (see [`Machine`]): query setup, the pipeline's fill from cold HBM, the warp merge.
/// Blocks resident together pay it once, side by side, so it does not grow with the blocks per
/// SM; what it penalizes is waves (one 12-warp block per SM pays it once per block where three
/// 4-warp blocks share it). Fitted with the rest of the model (see `RateModel`).
const WAVE_OVERHEAD_TOKENS: f64 = 3072.0;

/// Peak bytes per SM cycle of the device the model's constants were fitted on, an H200: HBM3e
/// at 3,201 MHz over 6,144 bits (4.92 TB/s) for 132 SMs at 1,980 MHz, as its driver reports
/// them, in the order of [`DeviceProps::memory_bytes_per_sm_cycle`]'s arithmetic, so that the
/// H200's feed is exactly 1 and its launches are those the model was fitted to pick.
const REFERENCE_BYTES_PER_SM_CYCLE: f64 =
    2.0 * 3_201_000.0 * 1e3 * 6144.0 / 8.0 / (132.0 * 1_980_000.0 * 1e3);

/// The device as the launch model sees it: its SM count, and `feed`, the bytes its memory
/// delivers per SM cycle at peak over the reference H200's (H100 SXM: 0.68). Two terms of the
/// model scale with `feed`, both fitted on sweeps of the H200 and the H100 (docs/PERFORMANCE.md,
/// "Session 24"): the fixed cost of a wave, a time, counts more tokens where
/// tokens arrive faster; and the warps an instruction-bound format (INT4, FP4) needs to keep
/// up grow with the bytes each SM gets per cycle (the H100 runs INT4 at full rate with 8, the
/// H200 needs 12). Latency-bound needs (copies in flight, 16-bit and FP8 warps) stayed put.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Machine {
    pub sms: usize,
    pub feed: f64,
}

impl Machine {
    /// The model's view of the device `props` describes (the reference feed when the driver
    /// reports no clocks).
    pub fn of(props: &DeviceProps) -> Machine {
        Machine {
            sms: props.sm_count as usize,
            feed: props
                .memory_bytes_per_sm_cycle()
                .map_or(1.0, |b| (b / REFERENCE_BYTES_PER_SM_CYCLE).clamp(0.25, 4.0)),
        }
    }

    /// The reference device with `sms` SMs.
    #[cfg(test)]
    fn reference(sms: usize) -> Machine {
        Machine { sms, feed: 1.0 }
    }
}

/// Cost of each split in the launch model, in tokens (of any cache): partial write and merge.
const SPLIT_COST_TOKENS: f64 = 8.0;

/// Launches whose modelled time is within this factor of the best count as equal; among them
/// the plan takes the fewest splits, then warps, then stages.
const TOLERANCE: f64 = 1.01;

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

/// The decode kernel for `layout` with `warps` warps per block of `stages` copy stages each:
/// blocks per SM (0: does not fit), bytes per stage, tokens per warp step. The GPU's context
/// must be current.
pub(super) fn occupancy(
    layout: &BlockLayout,
    warps: usize,
    stages: usize,
) -> Result<DecodeOccupancy> {
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
/// resident warps to hide the dependency chains of a step. Fitted, with
/// [`WAVE_OVERHEAD_TOKENS`], [`SPLIT_COST_TOKENS`] and [`TOLERANCE`], to an H200 sweep of every
/// launch shape at every split count (`examples/decode_sweep.rs`, 36 shape x format groups,
/// docs/PERFORMANCE.md "Launch model, session 8"): 16-bit caches want about 64 KB in flight and
/// 6 warps; FP8 caches are bound by their warps' latency long before their copies (12 KB, 9
/// warps), INT4 even more so (24 KB, 12 warps on the H200, fewer where the memory feeds an SM
/// less per cycle: [`Machine`]). `scripts/launch_fit.py` holds the same model (keep them in
/// step) and refits it on sweeps.
#[derive(Debug, Clone, Copy, PartialEq)]
struct RateModel {
    /// Bytes of copies each block keeps in flight.
    inflight: usize,
    /// Warps per block.
    warps: usize,
    /// Bytes in flight per SM that reach the full rate.
    inflight_target: usize,
    /// Resident warps per SM that reach the full rate.
    full_rate_warps: f64,
}

impl RateModel {
    /// The model for caches in `k` / `v` on a device of memory feed `feed` ([`Machine`]),
    /// launched with `warps` warps per block of `stages` stages of `stage_bytes` each (one stage
    /// per warp is being computed, the rest in flight).
    fn new(
        (k, v): (KvFormat, KvFormat),
        feed: f64,
        warps: usize,
        stages: usize,
        stage_bytes: usize,
    ) -> Self {
        let narrowest = k.bits().min(v.bits());
        let (inflight_target, full_rate_warps) = match narrowest {
            16.. => (64 << 10, 6.0),
            8..=15 => (12 << 10, 9.0),
            _ => (24 << 10, 12.0 * feed),
        };
        RateModel {
            inflight: warps * (stages - 1) * stage_bytes,
            warps,
            inflight_target,
            full_rate_warps,
        }
    }

    /// Fraction of the full rate of an SM with `k` blocks resident.
    fn rate(&self, k: usize) -> f64 {
        let copies = (k * self.inflight) as f64 / self.inflight_target as f64;
        let warps = (k * self.warps) as f64 / self.full_rate_warps;
        copies.min(warps).min(1.0)
    }
}

/// Time, in tokens streamed at the full rate of an SM, for `blocks` equal blocks of `tokens`
/// tokens each on `sms` SMs holding `ctas` blocks each, with a fixed cost of `fixed` tokens per
/// wave. Blocks run in waves, and an SM slows down below what its resident blocks need
/// (`model`), which is what makes a thin last wave slow (H200: B=64 fp8 at 3 blocks per SM,
/// 1.3 waves, 74 % of the ceiling against 87 % at 2 blocks per SM, 1.9 waves).
fn wave_time(
    blocks: usize,
    sms: usize,
    ctas: usize,
    model: RateModel,
    tokens: f64,
    fixed: f64,
) -> f64 {
    let slots = ctas * sms;
    let (full, rest) = (blocks / slots, blocks % slots);
    let mut t = full as f64 * (ctas as f64 * tokens / model.rate(ctas) + fixed);
    if rest > 0 {
        let k = rest.div_ceil(sms);
        t += k as f64 * tokens / model.rate(k) + fixed;
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

/// Warps, stages and split count together, given `occ(warps, stages)` (the kernel's occupancy
/// for that shape) and `base` blocks per split (batch x KV heads x query tiles) on the device
/// `machine`, for contexts up to `max_len` tokens of caches in `formats` (K, V). Model:
/// [`wave_time`] of blocks that stream their split rounded up to whole rounds of their warps'
/// steps (a block ends with its last warp), plus a cost per split; among the launches within
/// [`TOLERANCE`] of the best, the fewest splits, then the fewest warps per block, then the
/// fewest stages. Split counts come from `splits` (see [`split_range`]). An error only if
/// nothing fits.
pub(super) fn choose_launch(
    base: usize,
    machine: Machine,
    max_len: usize,
    splits: std::ops::RangeInclusive<usize>,
    (k, v): (KvFormat, KvFormat),
    mut occ: impl FnMut(usize, usize) -> Result<DecodeOccupancy>,
) -> Result<LaunchChoice> {
    let mut cands = Vec::new(); // (cost, splits, stages, warps, ctas)
    let fixed = WAVE_OVERHEAD_TOKENS * machine.feed * tokens_per_16bit_token(k, v);
    for warps in WARPS {
        for stages in STAGES {
            let o = occ(warps, stages)?;
            if o.ctas == 0 {
                continue;
            }
            let model = RateModel::new((k, v), machine.feed, warps, stages, o.stage_bytes);
            let round = warps * o.step_tokens.max(1);
            for splits in splits.clone() {
                let (n, len) = split_len(max_len, splits);
                let tokens = len.next_multiple_of(round) as f64;
                let cost = wave_time(base * n, machine.sms, o.ctas, model, tokens, fixed)
                    + n as f64 * SPLIT_COST_TOKENS;
                cands.push((cost, n, stages, warps, o.ctas));
            }
        }
    }
    let best = cands.iter().map(|c| c.0).fold(f64::INFINITY, f64::min);
    let &(_, n, stages, warps, ctas) = cands
        .iter()
        .filter(|c| c.0 <= best * TOLERANCE)
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
    /// per SM, at most `max_ctas` 4-warp blocks per SM by registers, `step` tokens per warp step.
    fn occ_model(
        (stage, step): (usize, usize),
        max_ctas: usize,
    ) -> impl FnMut(usize, usize) -> Result<DecodeOccupancy> {
        move |warps, stages| {
            let bytes = warps * stages * stage + 8192;
            Ok(DecodeOccupancy {
                ctas: ((227 << 10) / bytes).min(max_ctas * 4 / warps),
                stage_bytes: stage,
                step_tokens: step,
            })
        }
    }

    #[test]
    fn launch_choice() {
        use KvFormat::*;
        // Bytes per stage and tokens per step at head_dim 128 (decode/plan.cuh's Cfg::STAGE,
        // STEP): 16 tokens of 16-bit K rows padded to 288 bytes and V rows of 256; FP8 rows
        // unpadded; 32 INT4 tokens.
        let bf16 = ((Bf16, Bf16), (8704, 16));
        let fp8 = ((Fp8E4m3, Fp8E4m3), (4096, 16));
        let int4 = ((Int4Sym32, Int4Affine64), (4608, 32));
        // (warps, stages, blocks per SM, splits, split length); `regs`: 4-warp blocks per SM
        // that registers allow (3 at head_dim 128, 4 with FP8).
        let pick = |base, len, (formats, stage), regs| {
            let c = choose_launch(
                base,
                Machine::reference(132),
                len,
                split_range(len, MAX_SPLITS),
                formats,
                occ_model(stage, regs),
            )
            .unwrap();
            (c.warps, c.stages, c.ctas, c.splits, c.split_tokens)
        };
        // What the H200 sweep found best (docs/PERFORMANCE.md, launch model of session 8).
        // Many blocks: 4-warp blocks, as many per SM as fit (16-bit caches: two, whole waves),
        // no split; compact caches with 2 stages.
        let (w, stages, ctas, n, _) = pick(512, 16384, bf16, 3);
        assert_eq!((w, ctas, n), (4, 2, 1));
        assert!(stages <= 3, "{stages} stages");
        assert_eq!(pick(512, 16384, fp8, 4), (4, 2, 4, 1, 16384));
        assert_eq!(pick(1024, 8192, int4, 3), (4, 2, 3, 1, 8192));
        // INT4 at 64 x 4k (512 blocks, 1.3 waves of 3 per SM): three 4-warp blocks per SM, not
        // one of 12 warps (4 waves, each paying the fixed costs alone: 10 % slower).
        assert_eq!(pick(512, 4096, int4, 3), (4, 2, 3, 1, 4096));
        // Fewer blocks than SMs: one block per SM with as many warps as the format wants
        // (INT4 and FP8 12 or more, 16-bit 8), not more splits of small blocks.
        assert_eq!(pick(128, 4096, int4, 3).0, 12);
        assert_eq!(pick(128, 4096, fp8, 4), (16, 2, 1, 1, 4096));
        assert_eq!(pick(128, 4096, bf16, 3).0, 8);
        // 8x22B per GPU (64 sequences x 1 KV head of 16k): two splits, 12-warp blocks.
        let (w, _, _, n, _) = pick(64, 16384, int4, 3);
        assert_eq!((w, n), (12, 2));
        // One sequence of 32k (8 blocks per split): every SM gets one block.
        for (cache, regs, warps) in [(bf16, 3, 8), (int4, 3, 12)] {
            let (w, _, _, n, len) = pick(8, 32768, cache, regs);
            assert!(
                w == warps && (14..=16).contains(&n) && n * len >= 32768,
                "{w} warps, {n} x {len}"
            );
            assert_eq!(len % SPLIT_MULTIPLE, 0);
        }
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
            Machine::reference(132),
            32768,
            split_range(32768, 3),
            int4.0,
            occ_model(int4.1, 3),
        )
        .unwrap();
        assert!(c.splits <= 3 && c.splits * c.split_tokens >= 32768);
        // Huge stages: whatever fits.
        let (_, _, ctas, ..) = pick(8, 32768, (int4.0, (25_000, 32)), 2);
        assert!(ctas >= 1);
        // Nothing fits: an error, not a panic.
        assert!(
            choose_launch(
                128,
                Machine::reference(132),
                4096,
                split_range(4096, MAX_SPLITS),
                bf16.0,
                occ_model((200_000, 16), 2)
            )
            .is_err()
        );
    }

    #[test]
    fn launch_choice_follows_the_memory_feed() {
        use KvFormat::*;
        let int4 = ((Int4Sym32, Int4Affine64), (4608, 32));
        let pick = |machine, base, len| {
            let c = choose_launch(
                base,
                machine,
                len,
                split_range(len, MAX_SPLITS),
                int4.0,
                occ_model(int4.1, 3),
            )
            .unwrap();
            (c.warps, c.stages, c.ctas, c.splits)
        };
        // What the H100 sweep found best (docs/PERFORMANCE.md, "Session 24"): at
        // 64 x 4k two 4-warp blocks of 4-5 stages per SM, where the H200 wants three of 2
        // stages; one 8-warp block per SM where blocks are few (the H200: 12 warps).
        let h100 = Machine {
            sms: 132,
            feed: 0.68,
        };
        let (w, stages, ctas, n) = pick(h100, 512, 4096);
        assert!(
            (w, ctas, n) == (4, 2, 1) && stages >= 4,
            "{w} {stages} {ctas} {n}"
        );
        assert_eq!(pick(Machine::reference(132), 512, 4096), (4, 2, 3, 1));
        assert_eq!(pick(h100, 128, 4096).0, 8);
        assert_eq!(pick(Machine::reference(132), 128, 4096).0, 12);
        // A device that reports no clocks is taken for the reference; real clocks give the
        // ratio of bytes per SM cycle.
        let mut props = DeviceProps {
            ordinal: 0,
            name: "H100".into(),
            sm_count: 132,
            compute_capability: (9, 0),
            l2_bytes: 50 << 20,
            total_memory: 80 << 30,
            sm_clock_khz: 0,
            memory_clock_khz: 0,
            memory_bus_bits: 0,
        };
        assert_eq!(Machine::of(&props), Machine::reference(132));
        (
            props.sm_clock_khz,
            props.memory_clock_khz,
            props.memory_bus_bits,
        ) = (1_980_000, 2_619_000, 5120);
        let feed = Machine::of(&props).feed;
        assert!((feed - 0.682).abs() < 0.005, "{feed}");
        // The H200's clocks give the reference exactly.
        (props.memory_clock_khz, props.memory_bus_bits) = (3_201_000, 6144);
        assert_eq!(Machine::of(&props), Machine::reference(132));
    }

    #[test]
    fn waves() {
        let m = |inflight, warps| RateModel {
            inflight,
            warps,
            inflight_target: 128 << 10,
            full_rate_warps: 8.0,
        };
        // Full waves at full rate cost their blocks' tokens per SM and one fixed cost each; a
        // thin last wave costs more.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 4), 100.0, 0.0), 200.0);
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 4), 100.0, 50.0), 250.0);
        assert!(wave_time(396 + 132, 132, 3, m(43 << 10, 4), 1.0, 0.0) > 4.0);
        // Too few warps slow an SM down as too few copies do.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 2), 1.0, 0.0), 4.0);
        // The fixed cost is paid per wave, not per block: one wave of three blocks pays it once,
        // three waves of one block three times.
        let three = wave_time(396, 132, 3, m(64 << 10, 4), 1.0, 10.0);
        let one = wave_time(396, 132, 1, m(192 << 10, 12), 1.0, 10.0);
        assert!(three < one, "{three} vs {one}");
    }
}
