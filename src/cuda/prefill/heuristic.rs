//! How a prefill launch is cut: its key splits, and the tiles of a launch of wide tiles: wide
//! ([`WIDE_ROWS`] query rows a thread block) or triple ([`TRIPLE_ROWS`], three consumer
//! warpgroups where the warp-specialized kernel serves them), each by a model of the launch's
//! time over the step's own sequences.
//!
//! Splits: blocks run in waves of as many as fit the GPU at once, so a launch takes about its
//! waves times a block's steps (its split's keys, plus fixed costs); one split more shortens
//! every block but can add a wave. Splitting until there are blocks for every slot, rounded up,
//! added a wave of short blocks: extends of 16-64 tokens after 16k-64k took up to 1.6 times the
//! best split's time (session 37, H100).
//!
//! Tiles: a block's time is its steps of [`TILE_TOKENS`] keys plus one for its fixed costs,
//! times its rows, times a per-row cost of its width (triple tiles' decode and softmax serve 1.5
//! times the rows of a step). Blocks run one an SM, longest first (the kernel orders each head's
//! tiles so), so a launch takes about the longest SM's sum when they are dealt out longest
//! first. Causal tiles differ in length: the top of a prompt's triangle is short, so a grid's
//! last wave is partly filled by short tiles, which a count of whole waves cannot see (session
//! 37: it kept wide tiles for prompts of 768-1,536 tokens that triple tiles run 11-17 % faster).

use super::{TILE_ROWS, TILE_TOKENS};
use crate::format::KvFormat;

/// A split block's fixed costs (its Q tile, the pipeline's fill, its partial's store and share
/// of the merge), in steps: fitted on extends of 16 and 64 tokens after 16k-64k at B = 2-32
/// (H100, session 37: within 1 % of the best measured split's total time over 48 shapes).
const SPLIT_FIXED_STEPS: usize = 8;

/// Blocks of a launch that one SM runs at once: two narrow tiles of a quantized side (their
/// decode, not the memory, binds a block); one otherwise (16-bit sides' reads saturate the
/// memory at one block an SM; wide tiles).
pub(super) fn blocks_per_sm(quantized: bool, wide: bool) -> usize {
    if quantized && !wide { 2 } else { 1 }
}

/// Key splits of a launch of `ctas` blocks (tiles times KV heads) over contexts of up to
/// `max_len` tokens, `slots` of which run at once, at most `most`: the fewest whose blocks take
/// the least waves times steps.
pub(super) fn key_splits(ctas: usize, max_len: usize, slots: usize, most: usize) -> usize {
    let cost = |s: usize| {
        let steps = max_len.div_ceil(s).div_ceil(TILE_TOKENS) + SPLIT_FIXED_STEPS;
        (ctas.max(1) * s).div_ceil(slots.max(1)) * steps
    };
    (1..=most.max(1)).min_by_key(|&s| (cost(s), s)).unwrap_or(1)
}

/// Query rows of a wide tile.
pub(super) const WIDE_ROWS: usize = 2 * TILE_ROWS;
/// Query rows of a triple tile.
pub(super) const TRIPLE_ROWS: usize = 3 * TILE_ROWS;
/// Rows a copied run of keys starts at: a tile's first step starts at its first key rounded
/// down to this (the kernel's copies are runs of 16 tokens).
const RUN: usize = 16;
/// A block's fixed costs (its Q tile, the pipeline's fill, the epilogue), in steps.
const FIXED_STEPS: u64 = 1;
/// Above this many blocks an SM the longest-first deal is estimated (mean load plus the last
/// wave's share) instead of played out: on a scan of prompt and chunk shapes the estimate chose
/// as the deal did there but twice, each within 0.1 % (session 37).
const PLAYED_BLOCKS_PER_SM: usize = 4;
/// The most tiles (times splits) whose deal is played out, and SMs it is played on (stack
/// buffers; past them the estimate).
const MAX_PLAYED: usize = 1024;
const MAX_SMS: usize = 1024;

/// A triple tile's time a row against a wide tile's, by the sides' code width, fitted on 4k
/// prompts at B=1 and 4 and a 2k chunk after 30k (H100, session 37; on twelve more prompt and
/// chunk shapes the model then chose the faster width wherever the two differ by over 1 %):
/// 16-bit sides 0.855; decoded 8-bit codes 0.81 (their producers' decode serves 1.5 times the
/// rows a step); narrower codes 0.895.
pub(super) fn triple_row_cost(k: KvFormat, v: KvFormat) -> f64 {
    match (k.bits(), v.bits()) {
        (16, 16) => 0.855,
        (8, 8) => 0.81,
        _ => 0.895,
    }
}

/// What the model reads of a launch besides its sequences.
#[derive(Clone, Copy, Debug)]
pub(super) struct Grid {
    /// Query heads per KV head: a token's rows.
    pub group: usize,
    /// KV heads: the blocks of a tile.
    pub kv_heads: usize,
    /// Key splits and their length (tokens; splits * split_tokens covers every context).
    pub splits: usize,
    pub split_tokens: usize,
    /// The sliding window's left extent, if any.
    pub window_left: Option<usize>,
    /// Streaming multiprocessors (one block each).
    pub sms: usize,
}

/// Steps of the block of tile rows [r0, r1) of a sequence of `n` new tokens over a context of
/// `len`, in split `s`: the steps of its keys [lo, hi) that the split holds, from lo rounded
/// down to a run.
fn block_steps(g: &Grid, n: usize, len: usize, r0: usize, r1: usize, s: usize) -> u64 {
    let first = len - n + r0 / g.group;
    let last = len - n + (r1 - 1) / g.group;
    let lo = g.window_left.map_or(0, |w| first.saturating_sub(w));
    let (lo, hi) = (
        lo.max(s * g.split_tokens),
        (last + 1).min((s + 1) * g.split_tokens),
    );
    if hi <= lo {
        return 0;
    }
    (hi - lo / RUN * RUN).div_ceil(TILE_TOKENS) as u64
}

/// The launch's time with tiles of `rows` rows, in block steps of one row (see the module
/// docs; the per-row cost not applied).
fn launch_time(seqs: impl Iterator<Item = (usize, usize)>, rows: usize, g: &Grid) -> f64 {
    let (mut count, mut sum, mut max, mut min) = (0usize, 0u64, 0u64, u64::MAX);
    let mut played = [0u64; MAX_PLAYED];
    for (n, len) in seqs {
        let len = len.max(n);
        let seq_rows = n * g.group;
        for r0 in (0..seq_rows).step_by(rows) {
            for s in 0..g.splits {
                let w = block_steps(g, n, len, r0, (r0 + rows).min(seq_rows), s) + FIXED_STEPS;
                if count < MAX_PLAYED {
                    played[count] = w;
                }
                count += 1;
                sum += w;
                max = max.max(w);
                min = min.min(w);
            }
        }
    }
    let blocks = count * g.kv_heads;
    if blocks == 0 || g.sms == 0 {
        return 0.0;
    }
    let per_row = rows as f64;
    if count <= MAX_PLAYED && g.sms <= MAX_SMS && blocks <= PLAYED_BLOCKS_PER_SM * g.sms {
        let played = &mut played[..count];
        played.sort_unstable_by(|a, b| b.cmp(a));
        return longest_first(played, g.kv_heads, g.sms) as f64 * per_row;
    }
    // Mean load, plus the last partial wave, whose blocks are the shortest.
    let waves = blocks as f64 / g.sms as f64;
    let tail = waves.fract();
    let mean = (sum * g.kv_heads as u64) as f64 / g.sms as f64;
    let est = mean
        + if tail > 0.0 {
            min as f64 * (1.0 - tail)
        } else {
            0.0
        };
    est.max(max as f64) * per_row
}

/// The longest SM's load when blocks of the given lengths (longest first, each `copies` times)
/// are dealt out, each to the SM with the least load so far.
fn longest_first(lengths: &[u64], copies: usize, sms: usize) -> u64 {
    let mut loads = [0u64; MAX_SMS];
    let loads = &mut loads[..sms.min(MAX_SMS)];
    // A min-heap: the least load at 0; a block adds to it and sinks it to its place.
    for &w in lengths {
        for _ in 0..copies {
            loads[0] += w;
            let mut i = 0;
            loop {
                let (l, r) = (2 * i + 1, 2 * i + 2);
                let mut least = i;
                if l < loads.len() && loads[l] < loads[least] {
                    least = l;
                }
                if r < loads.len() && loads[r] < loads[least] {
                    least = r;
                }
                if least == i {
                    break;
                }
                loads.swap(i, least);
                i = least;
            }
        }
    }
    loads.iter().copied().max().unwrap_or(0)
}

/// Whether a wide launch over these sequences ((new tokens, context) each) runs faster on
/// triple tiles, by the model of the module docs.
pub(super) fn prefer_triple(
    seqs: impl Iterator<Item = (usize, usize)> + Clone,
    g: &Grid,
    k: KvFormat,
    v: KvFormat,
) -> bool {
    let wide = launch_time(seqs.clone(), WIDE_ROWS, g);
    let triple = launch_time(seqs, TRIPLE_ROWS, g) * triple_row_cost(k, v);
    triple > 0.0 && triple < wide
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: Grid = Grid {
        group: 4,
        kv_heads: 8,
        splits: 1,
        split_tokens: 1 << 20,
        window_left: None,
        sms: 132,
    };
    const BF16: (KvFormat, KvFormat) = (KvFormat::Bf16, KvFormat::Bf16);
    const FP8: (KvFormat, KvFormat) = (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3);
    const INT4: (KvFormat, KvFormat) = (KvFormat::Int4Sym32, KvFormat::Int4Affine64);

    fn triple(seqs: &[(usize, usize)], (k, v): (KvFormat, KvFormat)) -> bool {
        prefer_triple(seqs.iter().copied(), &H100, k, v)
    }

    /// The choices session 37 measured on an H100 (Llama-3-8B heads), where triple and wide
    /// tiles differ by more than 1 %: `(new, context, batch)`, then triple faster for bf16,
    /// decoded fp8-e4m3, int4-k32 / v64.
    #[test]
    fn picks_what_the_h100_measured() {
        let measured = [
            ((1536, 1536, 1), [true, true, true]),
            ((1536, 32768, 1), [true, true, true]),
            ((768, 768, 2), [true, true, true]),
            ((2048, 2048, 1), [true, true, false]),
            ((2048, 2048, 2), [true, true, true]),
            ((3072, 3072, 1), [true, true, true]),
            ((4096, 4096, 1), [true, true, true]),
            ((4096, 4096, 4), [true, true, true]),
            ((4096, 5120, 1), [true, true, true]),
            ((6144, 6144, 1), [true, true, true]),
            ((8192, 8192, 1), [true, true, true]),
            ((1024, 1024, 4), [true, true, true]),
            ((1024, 4096, 1), [false, false, false]),
            ((2048, 32768, 1), [true, true, false]),
        ];
        for ((n, len, b), want) in measured {
            let seqs = vec![(n, len); b];
            for (fmt, want) in [BF16, FP8, INT4].into_iter().zip(want) {
                assert_eq!(
                    triple(&seqs, fmt),
                    want,
                    "{n} after {} x{b}, {fmt:?}",
                    len - n
                );
            }
        }
    }

    /// The splits picked for shapes session 37 timed at every split on an H100 (132 SMs;
    /// Llama-3-8B heads, 8 KV heads): `(new tokens, context, batch)`, then for 16-bit and for
    /// quantized sides. Each was the fastest measured but two within 4 % of it (16-bit at B=20
    /// and 24, whose fastest were 3 and 4 splits).
    #[test]
    fn splits_near_the_h100_fastest() {
        let measured = [
            ((16, 16384, 4), [4, 8]),
            ((16, 16384, 8), [2, 4]),
            ((16, 16384, 16), [1, 2]),
            ((16, 16384, 20), [4, 3]),
            ((16, 16384, 24), [2, 4]),
            ((16, 16384, 32), [1, 1]),
            ((16, 32768, 8), [2, 4]),
            ((16, 65536, 2), [8, 16]),
            ((16, 131072, 1), [16, 33]),
            ((64, 16384, 2), [4, 4]),
            ((64, 16384, 4), [2, 2]),
            ((64, 16384, 6), [4, 4]),
        ];
        for ((n, len, b), want) in measured {
            let rows = n * H100.group;
            let wide = rows >= WIDE_ROWS;
            let tiles = rows.div_ceil(if wide { WIDE_ROWS } else { TILE_ROWS });
            let most = (len / 256).min(2048 / (n * b)).min(64);
            for (quantized, want) in [false, true].into_iter().zip(want) {
                let slots = blocks_per_sm(quantized, wide) * H100.sms;
                let got = key_splits(tiles * b * H100.kv_heads, len, slots, most);
                assert_eq!(
                    got,
                    want,
                    "{n} after {} x{b}, quantized {quantized}",
                    len - n
                );
            }
        }
    }

    #[test]
    fn even_blocks_take_whole_waves() {
        // 300 blocks of 5 steps on 132 SMs: three waves.
        assert_eq!(longest_first(&[5; 30], 10, 132), 15);
        // Longest first: 7 + 1 beside 4 + 4.
        assert_eq!(longest_first(&[7, 4, 4, 1], 1, 2), 8);
    }

    #[test]
    fn blocks_count_their_split_and_window() {
        let g = Grid {
            splits: 4,
            split_tokens: 1024,
            window_left: Some(100),
            ..H100
        };
        // Rows 0..64 of 16 new tokens after 4080: positions 4080..4096, keys 3980..4096 (from
        // 3968, a run): 2 steps, all in split 3.
        assert_eq!(block_steps(&g, 16, 4096, 0, 64, 3), 2);
        assert_eq!(block_steps(&g, 16, 4096, 0, 64, 2), 0);
        let g = Grid {
            window_left: None,
            ..g
        };
        assert_eq!(block_steps(&g, 16, 4096, 0, 64, 2), 16);
        // An empty step: no blocks, no preference.
        assert!(!triple(&[], BF16));
    }
}
