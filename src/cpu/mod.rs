//! Reference attention on the CPU (decode, ragged prefill, merging partial states): the oracle
//! the GPU kernels are tested against.
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
//!
//! # Options, prefill and merging
//!
//! [`AttentionOptions`] adds what models beyond plain causal attention need, with the same
//! meaning in [`decode_attention`], [`attention_dense`] and [`prefill_attention`]:
//!
//! - a left window `w`: the query at position `p` sees `max(0, p - w)..=p` only;
//! - a logit soft cap `c`: `logit = c * tanh(logit / c)`, applied after `softmax_scale`;
//! - per-head sinks ([`HeadTerms`]): a learned logit `s[h]` that joins the softmax
//!   denominator with a zero value vector, `m = max(max_j logit_j, s[h])`,
//!   `out = Σ exp(logit_j - m) v_j / (Σ exp(logit_j - m) + exp(s[h] - m))`, and the lse includes
//!   it;
//! - per-head ALiBi slopes ([`HeadTerms`]): the logit of the query at position `p` for
//!   the key at position `j <= p` gains `m[h] * (j - p)` (at most 0), added after the soft cap;
//!   sinks are not biased. Slopes of 0 give exactly the unbiased result.
//!
//! [`prefill_attention`] takes a ragged batch (`qo_indptr`, any number of new tokens per
//! sequence, token-major `q`); [`merge_states`] combines two partial attentions of the same
//! queries over disjoint key sets, as split-KV kernels do.

pub mod e4m3_operands;
mod kernel;
mod merge;
mod prefill;

pub use merge::merge_states;
pub use prefill::prefill_attention;

use kernel::{Acc, GroupShape, KvRows, Scratch, attend_group};

use std::sync::Mutex;

use crate::cache::{BlockTables, HostCache};
use crate::error::{Error, Result, at_least_one};

/// Below this many (sequence, KV head, position) triples the reference runs on one thread.
const PARALLEL_MIN_POSITIONS: usize = 1 << 16;

/// Query geometry of one decode step; how logits are formed (the softmax scale among them) is
/// [`AttentionOptions`], beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Query heads (a multiple of the cache's `num_kv_heads`).
    pub num_q_heads: usize,
    /// New tokens per sequence being decoded (1 for plain decode, more for speculative
    /// verification or chunked prefill).
    pub q_len: usize,
}

impl DecodeShape {
    /// `num_q_heads` query heads, each with `q_len` new tokens per sequence.
    pub fn new(num_q_heads: usize, q_len: usize) -> Self {
        DecodeShape { num_q_heads, q_len }
    }
}

/// A softmax scale is positive and finite (a zero or negative one is a bug upstream, such as
/// `1 / head_dim` in integers); the CPU reference and both GPU plans check it here.
pub(crate) fn check_softmax_scale(scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "softmax_scale {scale} must be positive and finite"
        )))
    }
}

/// A logits soft cap is positive and finite (or absent); the CPU reference and both GPU plans
/// check it here.
pub(crate) fn check_soft_cap(cap: Option<f32>) -> Result<()> {
    match cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
        Some(c) => Err(Error::InvalidArgument(format!(
            "logits_soft_cap {c} must be positive and finite"
        ))),
        None => Ok(()),
    }
}

/// How logits become attention weights, beyond the plain causal softmax (see the
/// [module docs](self)). Per-head sinks and ALiBi slopes are [`HeadTerms`], beside these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Multiplier of `q · k` (usually `1 / sqrt(head_dim)`); positive and finite.
    pub softmax_scale: f32,
    /// Sliding window: the query at position `p` sees positions `max(0, p - w)..=p` (so `w = 0`
    /// is the query's own token only). `None`: all of `0..=p`.
    pub window_left: Option<usize>,
    /// Soft cap `c` (positive, finite): `logit = c * tanh(logit / c)` after the scale, as in
    /// Gemma 2. `None`: no cap.
    pub logits_soft_cap: Option<f32>,
}

impl AttentionOptions {
    /// Plain causal attention: `softmax_scale = 1 / sqrt(head_dim)`, no window, no cap.
    pub fn new(head_dim: usize) -> Self {
        AttentionOptions {
            softmax_scale: 1.0 / (head_dim as f32).sqrt(),
            window_left: None,
            logits_soft_cap: None,
        }
    }

    /// Check the options, and the per-head terms with them (one finite value per query head).
    fn check(&self, heads: HeadTerms<'_>, num_q_heads: usize) -> Result<()> {
        check_softmax_scale(self.softmax_scale)?;
        check_soft_cap(self.logits_soft_cap)?;
        check_per_head(
            heads.sinks,
            num_q_heads,
            "sinks (one per query head)",
            "sinks",
        )?;
        check_per_head(
            heads.alibi_slopes,
            num_q_heads,
            "alibi_slopes (one per query head)",
            "alibi_slopes",
        )
    }

    /// The kernel geometry of `group` heads × `q_len` rows over `context_len` positions;
    /// `heads` are the sinks and ALiBi slopes of the group's heads.
    fn group<'a>(
        &self,
        q_len: usize,
        head_dim: usize,
        context_len: usize,
        heads: HeadTerms<'a>,
    ) -> GroupShape<'a> {
        GroupShape {
            q_len,
            head_dim,
            context_len,
            softmax_scale: self.softmax_scale,
            window_left: self.window_left,
            soft_cap: self.logits_soft_cap,
            sinks: heads.sinks,
            alibi_slopes: heads.alibi_slopes,
        }
    }
}

/// A per-query-head argument (sinks, ALiBi slopes), if given: one finite value per head.
fn check_per_head(
    x: Option<&[f32]>,
    num_q_heads: usize,
    what_len: &'static str,
    what: &'static str,
) -> Result<()> {
    let Some(x) = x else {
        return Ok(());
    };
    if x.len() != num_q_heads {
        return Err(Error::Length {
            what: what_len,
            expected: num_q_heads,
            actual: x.len(),
        });
    }
    let bad = x.iter().filter(|v| !v.is_finite()).count() as u64;
    if bad > 0 {
        return Err(Error::NonFinite { what, count: bad });
    }
    Ok(())
}

/// The per-query-head terms of a call, each `num_q_heads` finite values or none (see the
/// [module docs](self)); [`HeadTerms::default()`] has neither. Named, so that the two slices
/// cannot be swapped unseen at the call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HeadTerms<'a> {
    /// A learned logit per query head that joins the softmax denominator with a zero value
    /// (gpt-oss).
    pub sinks: Option<&'a [f32]>,
    /// ALiBi slopes: the logit of the query at position `p` for the key at `j <= p` gains
    /// `slope * (j - p)`, after the soft cap.
    pub alibi_slopes: Option<&'a [f32]>,
}

impl<'a> HeadTerms<'a> {
    /// Those of the `group` query heads of `kv_head`.
    fn of_group(&self, kv_head: usize, group: usize) -> HeadTerms<'a> {
        let part = |x: Option<&'a [f32]>| x.map(|s| &s[kv_head * group..][..group]);
        HeadTerms {
            sinks: part(self.sinks),
            alibi_slopes: part(self.alibi_slopes),
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

/// Result of an attention call. Decode results are head-major per sequence (the order of the
/// decode kernels' `q`); [`prefill_attention`]'s are token-major (the order of its ragged `q`).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    /// Decode: `[batch, num_q_heads, q_len, head_dim]`; prefill: `[total_tokens, num_q_heads,
    /// head_dim]`.
    pub out: Vec<f32>,
    /// Decode: `[batch, num_q_heads, q_len]`; prefill: `[total_tokens, num_q_heads]`. The
    /// natural-log sum of the exponentiated logits (sinks included); `-inf` for a row that
    /// sees nothing.
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

/// Rows of one sequence of a paged cache, `len` tokens long (which of an `int4-kc` key
/// cache's blocks are sealed).
struct PagedRows<'a> {
    cache: &'a HostCache,
    table: &'a [i32],
    block_size: usize,
    len: usize,
}

impl KvRows for PagedRows<'_> {
    fn k(&self, pos: usize, kv_head: usize, out: &mut [f32]) {
        let block = self.table[pos / self.block_size] as usize;
        let sealed = self.cache.layout().sealed(pos, self.len);
        self.cache
            .decode_k_at(block, pos % self.block_size, kv_head, sealed, out);
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
/// sequence's new tokens must already be in the cache. `opts` holds the softmax scale
/// ([`AttentionOptions::new`] gives `1 / sqrt(head_dim)`), a window and a soft cap.
pub fn decode_attention(
    cache: &HostCache,
    tables: &BlockTables,
    q: &[f32],
    shape: &DecodeShape,
    opts: &AttentionOptions,
    accum: Accum,
) -> Result<AttentionOutput> {
    decode_attention_with(cache, tables, q, shape, opts, HeadTerms::default(), accum)
}

/// [`decode_attention`] with per-head sinks and ALiBi slopes (`heads`: `num_q_heads` finite
/// values each; see the [module docs](self)). With neither the result is bit for bit that of
/// [`decode_attention`].
///
/// Errors as [`decode_attention`]'s, plus [`Error::Length`] for sinks or slopes of the wrong
/// length and [`Error::NonFinite`] for a non-finite sink or slope.
pub fn decode_attention_with(
    cache: &HostCache,
    tables: &BlockTables,
    q: &[f32],
    shape: &DecodeShape,
    opts: &AttentionOptions,
    heads: HeadTerms<'_>,
    accum: Accum,
) -> Result<AttentionOutput> {
    let c = cache.config();
    tables.validate(cache.num_blocks(), c.block_size)?;
    let lens: Vec<usize> = tables.context_lens.iter().map(|&l| l as usize).collect();
    check_query(q, shape, c.num_kv_heads, c.head_dim, &lens)?;
    opts.check(heads, shape.num_q_heads)?;
    let sources = (0..tables.batch()).map(|b| PagedRows {
        cache,
        table: tables.row(b),
        block_size: c.block_size,
        len: lens[b],
    });
    let batch = Batch {
        context_lens: &lens,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        q,
        num_q_heads: shape.num_q_heads,
        q_len: shape.q_len,
        opts,
        heads,
    };
    run(sources, &batch, accum)
}

/// Reference attention of one sequence over dense, unquantized K/V (no cache): the "vs f32"
/// baseline for error measurements. Same semantics and options as [`decode_attention`] with
/// `context_len = kv.k.len() / (num_kv_heads * head_dim)`; `q` is `[num_q_heads, q_len,
/// head_dim]` and the output has batch 1.
pub fn attention_dense(
    q: &[f32],
    kv: DenseKv<'_>,
    shape: &DecodeShape,
    opts: &AttentionOptions,
    accum: Accum,
) -> Result<AttentionOutput> {
    at_least_one(&[("num_kv_heads", kv.num_kv_heads), ("head_dim", kv.head_dim)])?;
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
    opts.check(HeadTerms::default(), shape.num_q_heads)?;
    let source = DenseRows { kv };
    let batch = Batch {
        context_lens: &[len],
        num_kv_heads: kv.num_kv_heads,
        head_dim: kv.head_dim,
        q,
        num_q_heads: shape.num_q_heads,
        q_len: shape.q_len,
        opts,
        heads: HeadTerms::default(),
    };
    run(std::iter::once(source), &batch, accum)
}

/// Validate the query side against the KV side: head counts, `1 <= q_len <= len`, q's length
/// and finiteness.
fn check_query(
    q: &[f32],
    shape: &DecodeShape,
    num_kv_heads: usize,
    head_dim: usize,
    context_lens: &[usize],
) -> Result<()> {
    check_heads(shape.num_q_heads, num_kv_heads)?;
    at_least_one(&[("q_len", shape.q_len)])?;
    if let Some((b, &len)) = context_lens
        .iter()
        .enumerate()
        .find(|&(_, &l)| l < shape.q_len)
    {
        return Err(Error::InvalidArgument(format!(
            "sequence {b}: context length {len} is shorter than q_len {} \
             (the new tokens must already be in the cache; `DecodeShape::new` takes \
             num_q_heads, then q_len)",
            shape.q_len
        )));
    }
    // One sequence's elements first: the kernel splits q by them, so they must fit even for
    // an empty batch, whose total is 0 whatever the shape.
    let mut per_seq = 1usize;
    for (what, n) in [
        ("q elements (num_q_heads)", shape.num_q_heads),
        ("q elements (num_q_heads × q_len)", shape.q_len),
        ("q elements (num_q_heads·q_len × head_dim)", head_dim),
    ] {
        per_seq = per_seq.checked_mul(n).ok_or(Error::Overflow {
            what,
            lhs: per_seq,
            rhs: n,
        })?;
    }
    let expected = context_lens
        .len()
        .checked_mul(per_seq)
        .ok_or(Error::Overflow {
            what: "q elements (batch × num_q_heads·q_len·head_dim)",
            lhs: context_lens.len(),
            rhs: per_seq,
        })?;
    check_q_values(q, expected, "q ([batch, num_q_heads, q_len, head_dim])")
}

/// `q` holds `expected` elements (laid out as `layout` says), all finite.
pub(crate) fn check_q_values(q: &[f32], expected: usize, layout: &'static str) -> Result<()> {
    if q.len() != expected {
        return Err(Error::Length {
            what: layout,
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

/// A validated decode-shaped problem: `q` is `[batch, num_q_heads, q_len, head_dim]`, one
/// context length per sequence.
struct Batch<'a> {
    context_lens: &'a [usize],
    num_kv_heads: usize,
    head_dim: usize,
    q: &'a [f32],
    num_q_heads: usize,
    q_len: usize,
    opts: &'a AttentionOptions,
    heads: HeadTerms<'a>,
}

/// GQA: the query heads split evenly over the KV heads.
fn check_heads(num_q_heads: usize, num_kv_heads: usize) -> Result<()> {
    if num_q_heads == 0 || num_q_heads % num_kv_heads != 0 {
        return Err(Error::InvalidArgument(format!(
            "num_q_heads {num_q_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
        )));
    }
    Ok(())
}

/// Run the inner loop for every (sequence, KV head) in the chosen accumulator type.
fn run<R: KvRows + Sync>(
    sources: impl Iterator<Item = R>,
    batch: &Batch<'_>,
    accum: Accum,
) -> Result<AttentionOutput> {
    match accum {
        Accum::F32 => run_in::<f32, R>(sources, batch),
        Accum::F64 => run_in::<f64, R>(sources, batch),
    }
}

fn run_in<A: Acc, R: KvRows + Sync>(
    sources: impl Iterator<Item = R>,
    batch: &Batch<'_>,
) -> Result<AttentionOutput> {
    let &Batch {
        context_lens,
        num_kv_heads,
        head_dim,
        q,
        num_q_heads,
        q_len,
        opts,
        heads,
    } = batch;
    let group = num_q_heads / num_kv_heads;
    // Elements of q / out, and entries of lse, per KV-head group.
    let group_q = group * q_len * head_dim;
    let group_lse = group * q_len;
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
        for kv_head in 0..num_kv_heads {
            let g = opts.group(q_len, head_dim, context_len, heads.of_group(kv_head, group));
            let ((q, out), lse) = chunks.next().expect("q length checked");
            work.push((rows, kv_head, g, q, out, lse));
            total_positions += context_len;
        }
    }
    if work.is_empty() {
        // An empty batch: nothing to compute, and no scratch sized by its (unused) shape.
        return Ok(AttentionOutput { out, lse });
    }
    // Every thread's buffers are allocated here, at the largest size an item needs, so that
    // running out of memory is an error rather than an abort inside a worker.
    let max_context = context_lens.iter().copied().max().unwrap_or(0);
    let mut scratches = (0..threads(total_positions, work.len()))
        .map(|_| Scratch::<A>::new(group * q_len, head_dim, max_context))
        .collect::<Result<Vec<_>>>()?;
    execute(
        work,
        &mut scratches,
        |(rows, kv_head, g, q, out, lse), scratch| {
            attend_group(rows, kv_head, &g, q, out, lse, scratch);
        },
    );
    check_output(&out, &lse)?;
    Ok(AttentionOutput { out, lse })
}

/// Threads for `items` independent work items costing `positions` (sequence, KV head,
/// position) triples in all: one below [`PARALLEL_MIN_POSITIONS`], else one per core.
fn threads(positions: usize, items: usize) -> usize {
    if positions < PARALLEL_MIN_POSITIONS {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(items)
            .max(1)
    }
}

/// Run `f` on every item of `work`, one thread per scratch (the calling thread when there is
/// one). Items are independent and each is computed the same way on any thread, so the result
/// does not depend on the thread count.
fn execute<T: Send, S: Send>(work: Vec<T>, scratches: &mut [S], f: impl Fn(T, &mut S) + Sync) {
    let queue = Mutex::new(work.into_iter());
    let worker = |scratch: &mut S| {
        loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some(item) = next else {
                break;
            };
            f(item, scratch);
        }
    };
    match scratches {
        [one] => worker(one),
        many => std::thread::scope(|s| {
            for scratch in many {
                s.spawn(|| worker(scratch));
            }
        }),
    }
}

/// A non-finite result (overflow in dequantized K/V or in the logits) is an error. An lse of
/// `-inf` is not: it is a row that sees nothing, whose output is 0 (an overflow that produced
/// it would also have made the output NaN).
fn check_output(out: &[f32], lse: &[f32]) -> Result<()> {
    let bad = out.iter().filter(|x| !x.is_finite()).count()
        + lse
            .iter()
            .filter(|x| !x.is_finite() && **x != f32::NEG_INFINITY)
            .count();
    if bad > 0 {
        return Err(Error::NonFinite {
            what: "attention output (overflow in dequantized K/V or logits)",
            count: bad as u64,
        });
    }
    Ok(())
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
        let (shape, opts) = (DecodeShape::new(2, 1), AttentionOptions::new(16));
        let r = decode_attention(&cache, &tables, &[1.0; 32], &shape, &opts, Accum::F64).unwrap();
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
        let (shape, opts) = (DecodeShape::new(1, 2), AttentionOptions::new(8));
        let r = attention_dense(&[0.5; 16], kv, &shape, &opts, Accum::F32).unwrap();
        assert!(r.out[..8].iter().all(|&x| (x - 0.5).abs() < 1e-6));
        assert!(r.out[8..].iter().all(|&x| (x - 1.0).abs() < 1e-6));
        assert!((r.lse[1] - 3f32.ln()).abs() < 1e-6);
    }
}
