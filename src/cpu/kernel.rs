//! The one inner loop of the reference attention: causal softmax attention of a group of query
//! rows over the K/V rows of one KV head, whatever those rows are stored in. Decode, prefill and
//! the dense baseline all run it, so the options (window, soft cap, sinks, ALiBi) mean the same
//! in each.

use std::ops::{Add, Div, Mul, Sub};

use crate::error::{Error, Result, reserved};

/// Where the loop reads the K/V rows of one sequence from (a paged cache or dense slices).
pub(crate) trait KvRows {
    /// Write the key row at `pos` of `kv_head` into `out` (`head_dim` values).
    fn k(&self, pos: usize, kv_head: usize, out: &mut [f32]);
    /// Write the value row at `pos` of `kv_head` into `out` (`head_dim` values).
    fn v(&self, pos: usize, kv_head: usize, out: &mut [f32]);
}

/// The arithmetic type logits, softmax sums and outputs are accumulated in (f32 or f64).
pub(crate) trait Acc:
    Copy
    + Send
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    const ZERO: Self;
    const NEG_INFINITY: Self;
    fn of(x: f32) -> Self;
    /// A count of positions (ALiBi's distances), exact in f64.
    fn of_count(n: usize) -> Self;
    fn to_f32(self) -> f32;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    fn of(x: f32) -> Self {
        x
    }
    fn of_count(n: usize) -> Self {
        n as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    fn of(x: f32) -> Self {
        x as f64
    }
    fn of_count(n: usize) -> Self {
        n as f64
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
}

/// Buffers reused across calls so the loop allocates nothing per token.
pub(crate) struct Scratch<A> {
    q: Vec<A>,
    logits: Vec<A>,
    acc: Vec<A>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl<A: Acc> Scratch<A> {
    /// Buffers for groups of up to `rows` query rows of `head_dim` over up to `context_len`
    /// positions, reserved up front: [`attend_group`] never grows them, so the only place
    /// memory can run out is here, as an [`Error`].
    pub(crate) fn new(rows: usize, head_dim: usize, context_len: usize) -> Result<Self> {
        let logits = rows.checked_mul(context_len).ok_or(Error::Overflow {
            what: "attention logits (query rows × context_len)",
            lhs: rows,
            rhs: context_len,
        })?;
        let row_elems = rows.checked_mul(head_dim).ok_or(Error::Overflow {
            what: "attention accumulators (query rows × head_dim)",
            lhs: rows,
            rhs: head_dim,
        })?;
        Ok(Scratch {
            q: reserved(row_elems, "attention query scratch")?,
            logits: reserved(logits, "attention logits")?,
            acc: reserved(row_elems, "attention accumulators")?,
            k: reserved(head_dim, "attention key row")?,
            v: reserved(head_dim, "attention value row")?,
        })
    }
}

/// One call's geometry: `rows = group * q_len` query rows of `head_dim`, attending to a
/// context of `context_len` positions of which the last `q_len` are the queries' own tokens,
/// plus the options of [`AttentionOptions`](super::AttentionOptions) (all off for plain decode,
/// which then computes exactly what it did before they existed).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupShape<'a> {
    pub(crate) q_len: usize,
    pub(crate) head_dim: usize,
    pub(crate) context_len: usize,
    pub(crate) softmax_scale: f32,
    /// A row at position `p` sees `p - w ..= p` only (clamped at 0).
    pub(crate) window_left: Option<usize>,
    /// `logit = c * tanh(logit / c)` after the scale.
    pub(crate) soft_cap: Option<f32>,
    /// One sink logit per head of the group (`group` entries; row `r` uses `sinks[r / q_len]`):
    /// it joins the softmax denominator with a zero value vector.
    pub(crate) sinks: Option<&'a [f32]>,
    /// One ALiBi slope per head of the group (row `r` uses `alibi_slopes[r / q_len]`): the
    /// logit at `pos` of a row at position `p` gains `slope * (pos - p)`, after the cap.
    pub(crate) alibi_slopes: Option<&'a [f32]>,
}

/// Attend the query rows `q` (`[group, q_len, head_dim]`, the q heads sharing `kv_head`) to the
/// K/V rows of `kv_head`, writing `out` (same shape as `q`) and `lse` (`[group, q_len]`).
///
/// Query row `i` (within its head) sits at position `p = context_len - q_len + i` and sees
/// positions `max(0, p - w)..=p` (`w` the left window, none: from 0). Three passes: logits;
/// max and exp-sum per row (a sink, if any, joins both); weighted sum of V. Values are rounded
/// to f32 only when stored into `out` / `lse`. Each row's arithmetic depends on that row alone,
/// so a caller may split the rows of a sequence over several calls without changing a bit.
pub(crate) fn attend_group<A: Acc, R: KvRows>(
    rows: &R,
    kv_head: usize,
    g: &GroupShape<'_>,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    s: &mut Scratch<A>,
) {
    let (d, ctx) = (g.head_dim, g.context_len);
    let n_rows = q.len() / d;
    // Row r (head r / q_len, query r % q_len) sees positions first(r)..=last(r); with the
    // causal rule that includes its own position.
    let last = |r: usize| ctx - g.q_len + r % g.q_len;
    let first = |r: usize| g.window_left.map_or(0, |w| last(r).saturating_sub(w));
    let sees = |r: usize, pos: usize| first(r) <= pos && pos <= last(r);
    let slope = |r: usize| g.alibi_slopes.map(|s| A::of(s[r / g.q_len]));
    // Positions before every row's window are read by nobody: skip them.
    let start = (0..n_rows).map(first).min().unwrap_or(ctx);
    let scale = A::of(g.softmax_scale);
    let cap = g.soft_cap.map(A::of);

    s.q.clear();
    s.q.extend(q.iter().map(|&x| A::of(x)));
    s.logits.clear();
    s.logits.resize(n_rows * ctx, A::ZERO);
    s.k.resize(d, 0.0);
    s.v.resize(d, 0.0);

    for pos in start..ctx {
        rows.k(pos, kv_head, &mut s.k);
        for r in (0..n_rows).filter(|&r| sees(r, pos)) {
            let qr = &s.q[r * d..][..d];
            let dot = qr
                .iter()
                .zip(&s.k)
                .fold(A::ZERO, |acc, (&a, &b)| acc + a * A::of(b));
            let logit = scale * dot;
            let logit = match cap {
                Some(c) => c * (logit / c).tanh(),
                None => logit,
            };
            // ALiBi: pos <= last(r), so the bias is -slope times the distance.
            s.logits[r * ctx + pos] = match slope(r) {
                Some(m) => logit - m * A::of_count(last(r) - pos),
                None => logit,
            };
        }
    }

    // Softmax numerators in place of the logits; keep max and sum for the lse. The sink only
    // adds to the denominator: its value vector is zero.
    let mut stats = Vec::with_capacity(n_rows);
    for r in 0..n_rows {
        let l = &mut s.logits[r * ctx..][first(r)..=last(r)];
        let sink = g.sinks.map(|s| A::of(s[r / g.q_len]));
        let max =
            l.iter().copied().fold(
                sink.unwrap_or(A::NEG_INFINITY),
                |m, x| if x > m { x } else { m },
            );
        let mut sum = A::ZERO;
        for x in l.iter_mut() {
            *x = (*x - max).exp();
            sum = sum + *x;
        }
        if let Some(sink) = sink {
            sum = sum + (sink - max).exp();
        }
        stats.push((max, sum));
    }

    s.acc.clear();
    s.acc.resize(n_rows * d, A::ZERO);
    for pos in start..ctx {
        rows.v(pos, kv_head, &mut s.v);
        for r in (0..n_rows).filter(|&r| sees(r, pos)) {
            let w = s.logits[r * ctx + pos];
            for (a, &x) in s.acc[r * d..][..d].iter_mut().zip(&s.v) {
                *a = *a + w * A::of(x);
            }
        }
    }

    for (r, &(max, sum)) in stats.iter().enumerate() {
        let out = &mut out[r * d..][..d];
        // A zero sum means no term at all (any term, the max's, is exp(0) = 1): a row that sees
        // no key and has no sink. Its attention is empty: out 0, lse -inf, as merging expects.
        if sum == A::ZERO {
            out.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
            continue;
        }
        for (o, &a) in out.iter_mut().zip(&s.acc[r * d..][..d]) {
            *o = (a / sum).to_f32();
        }
        lse[r] = (max + sum.ln()).to_f32();
    }
}
