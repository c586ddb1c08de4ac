//! Prefill: attention of a ragged batch (any number of new tokens per sequence, token-major
//! queries, as an engine's prefill step holds them) over the paged cache, with the same inner
//! loop as decode.

use super::kernel::{Acc, GroupShape, Scratch, attend_group};
use super::{
    Accum, AttentionOptions, AttentionOutput, HeadTerms, PagedRows, check_heads, check_output,
    check_q_values, execute, threads,
};
use crate::cache::{BlockTables, HostCache};
use crate::error::{Error, Result, reserved};

/// Logits (query rows × context positions) one work item may hold. A long prompt is cut into
/// chunks of query tokens that fit, so a 100k-token prompt does not need 100k² logits; every
/// row is computed on its own, so the cut changes no bit of the result.
const CHUNK_LOGITS: usize = 1 << 22;

/// Reference attention of a ragged batch over a paged [`HostCache`]: the oracle of the prefill
/// kernel (semantics and options in the [module docs](super)).
///
/// - `qo_indptr` (`batch + 1` non-decreasing entries from 0, `batch = tables.batch()`):
///   sequence `b` has `n_b = qo_indptr[b + 1] - qo_indptr[b]` new tokens (0: no rows, its
///   table is not read), already appended to the cache, so `n_b <= context_lens[b] = L_b`.
///   Its token `i` sits at position `L_b - n_b + i`: a whole prompt when `n_b = L_b`, a chunk
///   after a cached prefix when less.
/// - `q` is token-major `[total_tokens, num_q_heads, head_dim]`, `total_tokens =
///   qo_indptr[batch]`; the output is `out` `[total_tokens, num_q_heads, head_dim]` and `lse`
///   `[total_tokens, num_q_heads]`: token-major like `q`, unlike decode's `[batch, heads,
///   q_len]`.
/// - `heads`: sinks, one finite logit per query head, and ALiBi slopes, one finite slope per
///   query head, or none of either: the logit of token `i` (position `p`) for the key at
///   position `j` gains `slope * (j - p)`, after the soft cap.
///
/// With one token per sequence the result is bit for bit that of [`decode_attention`]
/// (`q_len = 1`, the same scale). Errors as decode's, plus [`Error::Length`] for `qo_indptr`,
/// `sinks` or `alibi_slopes` of the wrong length, [`Error::NonFinite`] for a non-finite sink
/// or slope and [`Error::InvalidArgument`] for a `qo_indptr` that does not start at 0,
/// decreases, or gives a sequence more tokens than its context, and for a soft cap that is not
/// positive and finite.
///
/// [`decode_attention`]: super::decode_attention
#[allow(clippy::too_many_arguments)] // the kernel's arguments, one for one
pub fn prefill_attention(
    cache: &HostCache,
    tables: &BlockTables,
    qo_indptr: &[u32],
    q: &[f32],
    num_q_heads: usize,
    opts: &AttentionOptions,
    heads: HeadTerms<'_>,
    accum: Accum,
) -> Result<AttentionOutput> {
    let c = cache.config();
    tables.validate(cache.num_blocks(), c.block_size)?;
    check_heads(num_q_heads, c.num_kv_heads)?;
    opts.check(heads, num_q_heads)?;
    let spans = check_indptr(qo_indptr, &tables.context_lens)?;
    let total = qo_indptr.last().map_or(0, |&t| t as usize);
    let mut expected = total;
    for (what, n) in [
        ("q elements (total_tokens × num_q_heads)", num_q_heads),
        (
            "q elements (total_tokens·num_q_heads × head_dim)",
            c.head_dim,
        ),
    ] {
        expected = expected.checked_mul(n).ok_or(Error::Overflow {
            what,
            lhs: expected,
            rhs: n,
        })?;
    }
    check_q_values(q, expected, "q ([total_tokens, num_q_heads, head_dim])")?;
    let p = Prefill {
        cache,
        tables,
        spans: &spans,
        q,
        num_q_heads,
        opts,
        heads,
        chunk_logits: CHUNK_LOGITS,
    };
    match accum {
        Accum::F32 => p.run::<f32>(),
        Accum::F64 => p.run::<f64>(),
    }
}

/// One sequence's rows: its first token in `q`, its new tokens, its context length.
#[derive(Debug, Clone, Copy)]
struct Span {
    token0: usize,
    tokens: usize,
    context_len: usize,
}

/// Check `qo_indptr` against the (validated, non-negative) context lengths.
fn check_indptr(qo_indptr: &[u32], context_lens: &[i32]) -> Result<Vec<Span>> {
    let batch = context_lens.len();
    if qo_indptr.len() != batch + 1 {
        return Err(Error::Length {
            what: "qo_indptr (batch + 1 entries)",
            expected: batch + 1,
            actual: qo_indptr.len(),
        });
    }
    if qo_indptr[0] != 0 {
        return Err(Error::InvalidArgument(format!(
            "qo_indptr[0] = {} must be 0",
            qo_indptr[0]
        )));
    }
    let mut spans = Vec::with_capacity(batch);
    for (b, (w, &len)) in qo_indptr.windows(2).zip(context_lens).enumerate() {
        let (lo, hi) = (w[0], w[1]);
        if hi < lo {
            return Err(Error::InvalidArgument(format!(
                "qo_indptr decreases: qo_indptr[{}] = {hi} < qo_indptr[{b}] = {lo}",
                b + 1
            )));
        }
        let tokens = (hi - lo) as usize;
        let context_len = len as usize;
        if tokens > context_len {
            return Err(Error::InvalidArgument(format!(
                "sequence {b}: context length {context_len} is shorter than its {tokens} new \
                 tokens (they must already be in the cache)"
            )));
        }
        spans.push(Span {
            token0: lo as usize,
            tokens,
            context_len,
        });
    }
    Ok(spans)
}

/// A validated prefill problem.
struct Prefill<'a> {
    cache: &'a HostCache,
    tables: &'a BlockTables,
    spans: &'a [Span],
    q: &'a [f32],
    num_q_heads: usize,
    opts: &'a AttentionOptions,
    heads: HeadTerms<'a>,
    /// [`CHUNK_LOGITS`], smaller in tests to cut short prompts too.
    chunk_logits: usize,
}

/// One work item: a chunk of consecutive query tokens of one sequence, for the q heads of one
/// KV head. `out` / `lse` hold, per token, that group's part of its output row.
struct Item<'a> {
    rows: PagedRows<'a>,
    kv_head: usize,
    g: GroupShape<'a>,
    token0: usize,
    out: Vec<&'a mut [f32]>,
    lse: Vec<&'a mut [f32]>,
}

/// A thread's buffers: the kernel's, and the item's rows gathered head-major as the kernel
/// takes them (`[group, tokens, head_dim]`).
struct Buffers<A> {
    scratch: Scratch<A>,
    q: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl Prefill<'_> {
    fn run<A: Acc>(&self) -> Result<AttentionOutput> {
        let c = self.cache.config();
        let (nq, nkv, d) = (self.num_q_heads, c.num_kv_heads, c.head_dim);
        let group = nq / nkv;
        let total = self.q.len() / d / nq;
        let max_context = self.spans.iter().map(|s| s.context_len).max().unwrap_or(0);
        // Query tokens per item: as many as keep the logits within the budget, at least one.
        let chunk = (self.chunk_logits / group.saturating_mul(max_context).max(1)).max(1);

        let mut out = vec![0f32; self.q.len()];
        let mut lse = vec![0f32; total * nq];
        // Each token's output row, cut into one part per KV head; items take them in order.
        let mut out_parts: Vec<Vec<&mut [f32]>> = (0..nkv).map(|_| Vec::new()).collect();
        let mut lse_parts: Vec<Vec<&mut [f32]>> = (0..nkv).map(|_| Vec::new()).collect();
        for (row, lse_row) in out.chunks_exact_mut(nq * d).zip(lse.chunks_exact_mut(nq)) {
            let parts = row.chunks_exact_mut(group * d);
            for ((o, l), (os, ls)) in parts
                .zip(lse_row.chunks_exact_mut(group))
                .zip(out_parts.iter_mut().zip(&mut lse_parts))
            {
                os.push(o);
                ls.push(l);
            }
        }
        let mut out_parts: Vec<_> = out_parts.into_iter().map(Vec::into_iter).collect();
        let mut lse_parts: Vec<_> = lse_parts.into_iter().map(Vec::into_iter).collect();

        // One item per (sequence, KV head, chunk of tokens), each owning its output parts.
        let mut work = Vec::new();
        let mut cost = 0usize;
        for (b, s) in self.spans.iter().enumerate() {
            for kv_head in 0..nkv {
                let heads = self.heads.of_group(kv_head, group);
                for i0 in (0..s.tokens).step_by(chunk) {
                    let n = chunk.min(s.tokens - i0);
                    // The chunk's tokens are the last n of a context ending at its last token.
                    let context_len = s.context_len - s.tokens + i0 + n;
                    work.push(Item {
                        rows: PagedRows {
                            cache: self.cache,
                            table: self.tables.row(b),
                            block_size: c.block_size,
                            len: s.context_len,
                        },
                        kv_head,
                        g: self.opts.group(n, d, context_len, heads),
                        token0: s.token0 + i0,
                        out: out_parts[kv_head].by_ref().take(n).collect(),
                        lse: lse_parts[kv_head].by_ref().take(n).collect(),
                    });
                    cost = cost.saturating_add(n.saturating_mul(context_len));
                }
            }
        }
        // Every part has been handed to an item; the (empty) iterators let go of `out`.
        drop((out_parts, lse_parts));

        // Every thread's buffers are allocated up front, at the largest size an item needs, so
        // that running out of memory is an error rather than an abort inside a worker.
        let rows = group * chunk.min(max_context.max(1));
        let mut buffers = (0..threads(cost, work.len()))
            .map(|_| {
                Ok(Buffers {
                    scratch: Scratch::<A>::new(rows, d, max_context)?,
                    q: reserved(rows * d, "prefill query rows")?,
                    out: reserved(rows * d, "prefill output rows")?,
                    lse: reserved(rows, "prefill lse rows")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        execute(work, &mut buffers, |item, buf| self.attend(item, buf));
        check_output(&out, &lse)?;
        Ok(AttentionOutput { out, lse })
    }

    /// Gather the item's queries head-major, run the kernel, scatter its rows back.
    fn attend<A: Acc>(&self, mut item: Item<'_>, buf: &mut Buffers<A>) {
        let d = item.g.head_dim;
        let n = item.out.len();
        let group = self.num_q_heads / self.cache.config().num_kv_heads;
        let head0 = item.kv_head * group;
        buf.q.clear();
        for h in head0..head0 + group {
            for t in item.token0..item.token0 + n {
                buf.q
                    .extend_from_slice(&self.q[(t * self.num_q_heads + h) * d..][..d]);
            }
        }
        buf.out.clear();
        buf.out.resize(group * n * d, 0.0);
        buf.lse.clear();
        buf.lse.resize(group * n, 0.0);
        attend_group(
            &item.rows,
            item.kv_head,
            &item.g,
            &buf.q,
            &mut buf.out,
            &mut buf.lse,
            &mut buf.scratch,
        );
        for (i, (out, lse)) in item.out.iter_mut().zip(&mut item.lse).enumerate() {
            for h in 0..group {
                out[h * d..][..d].copy_from_slice(&buf.out[(h * n + i) * d..][..d]);
                lse[h] = buf.lse[h * n + i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheConfig;
    use crate::KvFormat;
    use crate::cpu::{DecodeShape, decode_attention_with};
    use crate::synth::Synth;

    /// Cutting prompts into chunks and running on several threads change no bit: every token
    /// equals a decode step of that token alone over its prefix.
    #[test]
    fn chunks_and_threads_change_no_bit() {
        let (nq, d) = (4, 64);
        let c = CacheConfig::new(2, d, 16, KvFormat::Int4Sym32, KvFormat::Fp8E4m3).unwrap();
        let mut cache = HostCache::new(c, 20).unwrap();
        let mut rng = Synth::new(1);
        // Sequence 0: a 200-token prompt in blocks 0..13; sequence 1: 90 tokens in blocks
        // 13..19, of which the last 30 are new.
        for (slot0, len) in [(0, 200), (13 * 16, 90)] {
            let (k, v) = (rng.normal(len * 2 * d, 1.0), rng.normal(len * 2 * d, 1.0));
            let slots: Vec<usize> = (slot0..slot0 + len).collect();
            cache.write(&slots, &k, &v).unwrap();
        }
        let rows: [Vec<i32>; 2] = [(0..13).collect(), (13..19).collect()];
        let tables = BlockTables::from_rows(&[&rows[0], &rows[1]], &[200, 90]).unwrap();
        let qo = [0u32, 200, 230];
        let q = rng.normal(230 * nq * d, 1.0);
        let sinks = [0.5f32, -1.0, 0.0, 3.0];
        let slopes = [0.5f32, 0.25, 0.0625, 0.0078125];
        let plain = AttentionOptions::new(d);
        let windowed = AttentionOptions {
            window_left: Some(20),
            logits_soft_cap: Some(4.0),
            ..plain
        };
        for (opts, alibi) in [
            (plain, None),
            (windowed, None),
            (windowed, Some(&slopes[..])),
        ] {
            let spans = check_indptr(&qo, &tables.context_lens).unwrap();
            let run = |chunk_logits: usize, accum: Accum| {
                let p = Prefill {
                    cache: &cache,
                    tables: &tables,
                    spans: &spans,
                    q: &q,
                    num_q_heads: nq,
                    opts: &opts,
                    heads: HeadTerms {
                        sinks: Some(&sinks),
                        alibi_slopes: alibi,
                    },
                    chunk_logits,
                };
                match accum {
                    Accum::F32 => p.run::<f32>().unwrap(),
                    Accum::F64 => p.run::<f64>().unwrap(),
                }
            };
            for accum in [Accum::F32, Accum::F64] {
                // Whole prompts, one item per (sequence, KV head), enough work for threads.
                let whole = run(CHUNK_LOGITS, accum);
                assert_eq!(run(1, accum), whole); // one token per item
                assert_eq!(run(2 * 200 * 7, accum), whole); // 7 tokens per item
                let shape = DecodeShape::new(nq, 1);
                for (b, (t0, n, len)) in [(0, 200, 200), (200, 30, 90)].into_iter().enumerate() {
                    for i in 0..n {
                        let t = t0 + i;
                        let prefix =
                            BlockTables::from_rows(&[&rows[b]], &[len - n + i + 1]).unwrap();
                        let q_t = &q[t * nq * d..][..nq * d];
                        let one = decode_attention_with(
                            &cache,
                            &prefix,
                            q_t,
                            &shape,
                            &opts,
                            HeadTerms {
                                sinks: Some(&sinks),
                                alibi_slopes: alibi,
                            },
                            accum,
                        )
                        .unwrap();
                        assert_eq!(one.out, whole.out[t * nq * d..][..nq * d], "token {t}");
                        assert_eq!(one.lse, whole.lse[t * nq..][..nq], "token {t}");
                    }
                }
            }
        }
    }
}
