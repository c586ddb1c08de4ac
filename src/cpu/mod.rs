//! Reference decode attention on the CPU: the oracle the GPU kernels are tested against.
//!
//! # Semantics (the CUDA decode kernels implement the same)
//!
//! For each sequence `b` of a batch, query head `h` and query token `i < q_len`:
//!
//! - `context_lens[b]` (in [`BlockTables`]) counts every token of sequence `b`, *including* the
//!   `q_len` new tokens, which have already been appended to the cache. Query token `i` sits at
//!   position `p = context_len - q_len + i` and attends to positions `0..=p` (causal among the
//!   new tokens; with `q_len == 1` it sees the whole context).
//! - GQA: query head `h` reads KV head `h / (num_q_heads / num_kv_heads)`; `num_q_heads` must be
//!   a multiple of `num_kv_heads` (any group size, e.g. 6).
//! - `logit_j = softmax_scale * (q · k_j)` with `k_j` dequantized exactly
//!   ([`KvFormat::decode_row`](crate::KvFormat::decode_row)), then softmax with max subtraction:
//!   `w_j = exp(logit_j - max)`, `out = Σ w_j v_j / Σ w_j`, and the natural-log
//!   `lse = max + ln(Σ w_j)`.
//! - Everything after dequantization (products, sums, `exp`, `ln`) is done in the [`Accum`]
//!   type; results are rounded to f32 once.
//!
//! Work is split over (sequence, KV head) pairs, on several threads for large problems; each
//! pair is computed the same way on any thread, so results are bit-for-bit reproducible.
//!
//! Inputs are validated (shapes, lengths, block ids, `1 <= q_len <= context_len`, finite `q` and
//! `softmax_scale`); a non-finite result (e.g. from an absurd FP8 scale) is an
//! [`Error::NonFinite`] rather than a silently wrong answer.

mod kernel;

use kernel::{Acc, GroupShape, KvRows, Scratch, attend_group};

use std::sync::Mutex;

use crate::cache::{BlockTables, HostCache};
use crate::error::{Error, Result};

/// Below this many (sequence, KV head, position) triples the reference runs on one thread.
const PARALLEL_MIN_POSITIONS: usize = 1 << 16;

/// Query geometry of one decode step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeShape {
    /// Query heads (a multiple of the cache's `num_kv_heads`).
    pub num_q_heads: usize,
    /// New tokens per sequence being decoded (1 for plain decode, more for speculative
    /// verification or chunked prefill).
    pub q_len: usize,
    /// Multiplier of `q · k` (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
}

impl DecodeShape {
    /// A shape with the usual `softmax_scale = 1 / sqrt(head_dim)`.
    pub fn new(num_q_heads: usize, q_len: usize, head_dim: usize) -> Self {
        DecodeShape {
            num_q_heads,
            q_len,
            softmax_scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }
}

/// The arithmetic type of the reference's reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Accum {
    /// f32, like a GPU kernel would (reduction order still differs).
    F32,
    /// f64: the oracle setting, with rounding error far below any quantization error.
    #[default]
    F64,
}

/// Result of an attention call.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    /// `[batch, num_q_heads, q_len, head_dim]`.
    pub out: Vec<f32>,
    /// `[batch, num_q_heads, q_len]`, natural-log sum of the exponentiated logits.
    pub lse: Vec<f32>,
}

/// Dense, unquantized keys and values of one sequence for [`attention_dense`].
#[derive(Debug, Clone, Copy)]
pub struct DenseKv<'a> {
    /// Keys `[len, num_kv_heads, head_dim]`.
    pub k: &'a [f32],
    /// Values `[len, num_kv_heads, head_dim]`.
    pub v: &'a [f32],
    /// KV heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Rows of one sequence of a paged cache.
struct PagedRows<'a> {
    cache: &'a HostCache,
    table: &'a [i32],
    block_size: usize,
}

impl KvRows for PagedRows<'_> {
    fn k(&self, pos: usize, kv_head: usize, out: &mut [f32]) {
        let block = self.table[pos / self.block_size] as usize;
        self.cache
            .decode_k_at(block, pos % self.block_size, kv_head, out);
    }
    fn v(&self, pos: usize, kv_head: usize, out: &mut [f32]) {
        let block = self.table[pos / self.block_size] as usize;
        self.cache
            .decode_v_at(block, pos % self.block_size, kv_head, out);
    }
}

/// Rows of dense `[len, kv_heads, head_dim]` slices.
struct DenseRows<'a> {
    kv: DenseKv<'a>,
}

impl DenseRows<'_> {
    fn row<'s>(&self, x: &'s [f32], pos: usize, kv_head: usize) -> &'s [f32] {
        let d = self.kv.head_dim;
        &x[(pos * self.kv.num_kv_heads + kv_head) * d..][..d]
    }
}

impl KvRows for DenseRows<'_> {
    fn k(&self, pos: usize, kv_head: usize, out: &mut [f32]) {
        out.copy_from_slice(self.row(self.kv.k, pos, kv_head));
    }
    fn v(&self, pos: usize, kv_head: usize, out: &mut [f32]) {
        out.copy_from_slice(self.row(self.kv.v, pos, kv_head));
    }
}

/// Reference decode attention of a batch over a paged [`HostCache`] (semantics in the
/// [module docs](self)).
///
/// `q` is `[batch, num_q_heads, q_len, head_dim]` with `batch = tables.batch()`; every
/// sequence's new tokens must already be in the cache.
pub fn decode_attention(
    cache: &HostCache,
    tables: &BlockTables,
    q: &[f32],
    shape: &DecodeShape,
    accum: Accum,
) -> Result<AttentionOutput> {
    let c = cache.config();
    tables.validate(cache.num_blocks(), c.block_size)?;
    let lens: Vec<usize> = tables.context_lens.iter().map(|&l| l as usize).collect();
    check_query(q, shape, c.num_kv_heads, c.head_dim, &lens)?;
    let sources = (0..tables.batch()).map(|b| PagedRows {
        cache,
        table: tables.row(b),
        block_size: c.block_size,
    });
    run(sources, &lens, c.num_kv_heads, c.head_dim, q, shape, accum)
}

/// Reference attention of one sequence over dense, unquantized K/V (no cache): the "vs f32"
/// baseline for error measurements. Same semantics as [`decode_attention`] with
/// `context_len = kv.k.len() / (num_kv_heads * head_dim)`; `q` is `[num_q_heads, q_len,
/// head_dim]` and the output has batch 1.
pub fn attention_dense(
    q: &[f32],
    kv: DenseKv<'_>,
    shape: &DecodeShape,
    accum: Accum,
) -> Result<AttentionOutput> {
    for (what, value) in [("num_kv_heads", kv.num_kv_heads), ("head_dim", kv.head_dim)] {
        if value == 0 {
            return Err(Error::Config {
                what,
                value,
                expected: "at least 1",
            });
        }
    }
    let row = kv
        .num_kv_heads
        .checked_mul(kv.head_dim)
        .ok_or(Error::Overflow {
            what: "dense k/v token row (num_kv_heads × head_dim)",
            lhs: kv.num_kv_heads,
            rhs: kv.head_dim,
        })?;
    if kv.k.len() % row != 0 {
        return Err(Error::Length {
            what: "dense k ([len, kv_heads, head_dim])",
            expected: kv.k.len().div_ceil(row) * row,
            actual: kv.k.len(),
        });
    }
    if kv.v.len() != kv.k.len() {
        return Err(Error::Length {
            what: "dense v (same shape as k)",
            expected: kv.k.len(),
            actual: kv.v.len(),
        });
    }
    let len = kv.k.len() / row;
    check_query(q, shape, kv.num_kv_heads, kv.head_dim, &[len])?;
    let source = DenseRows { kv };
    run(
        std::iter::once(source),
        &[len],
        kv.num_kv_heads,
        kv.head_dim,
        q,
        shape,
        accum,
    )
}

/// Validate the query side against the KV side: head counts, `1 <= q_len <= len`, q's length
/// and finiteness, and the softmax scale.
fn check_query(
    q: &[f32],
    shape: &DecodeShape,
    num_kv_heads: usize,
    head_dim: usize,
    context_lens: &[usize],
) -> Result<()> {
    if shape.num_q_heads == 0 || shape.num_q_heads % num_kv_heads != 0 {
        return Err(Error::InvalidArgument(format!(
            "num_q_heads {} must be a positive multiple of num_kv_heads {num_kv_heads}",
            shape.num_q_heads
        )));
    }
    if shape.q_len == 0 {
        return Err(Error::Config {
            what: "q_len",
            value: 0,
            expected: "at least 1",
        });
    }
    if !shape.softmax_scale.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "softmax_scale {} must be finite",
            shape.softmax_scale
        )));
    }
    if let Some((b, &len)) = context_lens
        .iter()
        .enumerate()
        .find(|&(_, &l)| l < shape.q_len)
    {
        return Err(Error::InvalidArgument(format!(
            "sequence {b}: context length {len} is shorter than q_len {} \
             (the new tokens must already be in the cache)",
            shape.q_len
        )));
    }
    let mut expected = context_lens.len();
    for (what, n) in [
        ("q elements (batch × num_q_heads)", shape.num_q_heads),
        ("q elements (batch·num_q_heads × q_len)", shape.q_len),
        ("q elements (batch·num_q_heads·q_len × head_dim)", head_dim),
    ] {
        expected = expected.checked_mul(n).ok_or(Error::Overflow {
            what,
            lhs: expected,
            rhs: n,
        })?;
    }
    if q.len() != expected {
        return Err(Error::Length {
            what: "q ([batch, num_q_heads, q_len, head_dim])",
            expected,
            actual: q.len(),
        });
    }
    let bad = q.iter().filter(|x| !x.is_finite()).count() as u64;
    if bad > 0 {
        return Err(Error::NonFinite {
            what: "q",
            count: bad,
        });
    }
    Ok(())
}

/// Run the inner loop for every (sequence, KV head) in the chosen accumulator type.
fn run<R: KvRows + Sync>(
    sources: impl Iterator<Item = R>,
    context_lens: &[usize],
    num_kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    shape: &DecodeShape,
    accum: Accum,
) -> Result<AttentionOutput> {
    match accum {
        Accum::F32 => run_in::<f32, R>(sources, context_lens, num_kv_heads, head_dim, q, shape),
        Accum::F64 => run_in::<f64, R>(sources, context_lens, num_kv_heads, head_dim, q, shape),
    }
}

fn run_in<A: Acc, R: KvRows + Sync>(
    sources: impl Iterator<Item = R>,
    context_lens: &[usize],
    num_kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    shape: &DecodeShape,
) -> Result<AttentionOutput> {
    let group = shape.num_q_heads / num_kv_heads;
    // Elements of q / out, and entries of lse, per KV-head group.
    let group_q = group * shape.q_len * head_dim;
    let group_lse = group * shape.q_len;
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; q.len() / head_dim];
    let sources: Vec<R> = sources.collect();
    let mut chunks = q
        .chunks_exact(group_q)
        .zip(out.chunks_exact_mut(group_q))
        .zip(lse.chunks_exact_mut(group_lse));
    // One work item per (sequence, KV head); each writes its own disjoint output chunks.
    let mut work = Vec::with_capacity(sources.len() * num_kv_heads);
    let mut total_positions = 0usize;
    for (rows, &context_len) in sources.iter().zip(context_lens) {
        let g = GroupShape {
            q_len: shape.q_len,
            head_dim,
            context_len,
            softmax_scale: shape.softmax_scale,
        };
        for kv_head in 0..num_kv_heads {
            let ((q, out), lse) = chunks.next().expect("q length checked");
            work.push((rows, kv_head, g, q, out, lse));
            total_positions += context_len;
        }
    }
    // Items are independent and each is computed the same way on any thread, so the result
    // does not depend on the thread count. Small problems stay on the calling thread.
    let threads = if total_positions < PARALLEL_MIN_POSITIONS {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(work.len())
            .max(1)
    };
    // Every thread's buffers are allocated here, at the largest size an item needs, so that
    // running out of memory is an error rather than an abort inside a worker.
    let max_context = context_lens.iter().copied().max().unwrap_or(0);
    let mut scratches = (0..threads)
        .map(|_| Scratch::<A>::new(group * shape.q_len, head_dim, max_context))
        .collect::<Result<Vec<_>>>()?;
    let queue = Mutex::new(work.into_iter());
    let worker = |scratch: &mut Scratch<A>| {
        loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some((rows, kv_head, g, q, out, lse)) = next else {
                break;
            };
            attend_group(rows, kv_head, &g, q, out, lse, scratch);
        }
    };
    match scratches.as_mut_slice() {
        [one] => worker(one),
        many => std::thread::scope(|s| {
            for scratch in many {
                s.spawn(|| worker(scratch));
            }
        }),
    }
    let bad = out.iter().chain(&lse).filter(|x| !x.is_finite()).count() as u64;
    if bad > 0 {
        return Err(Error::NonFinite {
            what: "attention output (overflow in dequantized K/V or logits)",
            count: bad,
        });
    }
    Ok(AttentionOutput { out, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheConfig, KvFormat};

    #[test]
    fn single_token_attends_to_itself() {
        let c = CacheConfig::new(1, 16, 4, KvFormat::F16, KvFormat::F16).unwrap();
        let mut cache = HostCache::new(c, 2).unwrap();
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        cache.write(&[4], &[0.5f32; 16], &v).unwrap(); // block 1, offset 0
        let tables = BlockTables::from_rows(&[&[1]], &[1]).unwrap();
        let shape = DecodeShape::new(2, 1, 16);
        let r = decode_attention(&cache, &tables, &[1.0; 32], &shape, Accum::F64).unwrap();
        assert_eq!(r.out[..16], v[..]);
        assert_eq!(r.out[16..], v[..]);
        assert!((r.lse[0] - 2.0).abs() < 1e-6); // one logit: 16 * 0.5 / 4
    }

    #[test]
    fn dense_matches_uniform_average() {
        // Equal logits: the output is the mean of the visible values; q_len 2 is causal.
        let k = vec![0.0f32; 3 * 8];
        let v: Vec<f32> = (0..3 * 8).map(|i| (i / 8) as f32).collect();
        let kv = DenseKv {
            k: &k,
            v: &v,
            num_kv_heads: 1,
            head_dim: 8,
        };
        let shape = DecodeShape::new(1, 2, 8);
        let r = attention_dense(&[0.5; 16], kv, &shape, Accum::F32).unwrap();
        assert!(r.out[..8].iter().all(|&x| (x - 0.5).abs() < 1e-6));
        assert!(r.out[8..].iter().all(|&x| (x - 1.0).abs() < 1e-6));
        assert!((r.lse[1] - 3f32.ln()).abs() < 1e-6);
    }
}
