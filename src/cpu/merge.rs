//! Merging partial attention states: the reduction of split-KV (and cascade) kernels, which
//! attend the same queries to disjoint parts of the keys and combine the parts by their lse.

use crate::error::{Error, Result, at_least_one, filled};

/// Merge two partial attentions of the same query rows over disjoint key sets into the
/// attention over their union.
///
/// Each part is `out` `[rows, head_dim]` (normalised) and `lse` `[rows]` (natural log, `-inf`
/// for a part that saw no key), `rows = a_lse.len()`. Per row, in f64: `m = max(la, lb)`,
/// `wa = exp(la - m)`, `wb = exp(lb - m)`, `out = (wa a + wb b) / (wa + wb)`,
/// `lse = m + ln(wa + wb)`; both `-inf` gives out 0 and lse `-inf`. Returns (out, lse).
///
/// Errors: [`Error::Config`] for `head_dim` 0, [`Error::Length`] for parts of other shapes,
/// [`Error::NonFinite`] for a non-finite `out` value or an lse that is NaN or `+inf`.
pub fn merge_states(
    a_out: &[f32],
    a_lse: &[f32],
    b_out: &[f32],
    b_lse: &[f32],
    head_dim: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    at_least_one(&[("head_dim", head_dim)])?;
    let rows = a_lse.len();
    if b_lse.len() != rows {
        return Err(Error::Length {
            what: "b_lse (rows, as a_lse)",
            expected: rows,
            actual: b_lse.len(),
        });
    }
    let n = rows.checked_mul(head_dim).ok_or(Error::Overflow {
        what: "merged output (rows × head_dim)",
        lhs: rows,
        rhs: head_dim,
    })?;
    for (what, x) in [
        ("a_out ([rows, head_dim])", a_out),
        ("b_out ([rows, head_dim])", b_out),
    ] {
        if x.len() != n {
            return Err(Error::Length {
                what,
                expected: n,
                actual: x.len(),
            });
        }
    }
    let bad = a_out.iter().chain(b_out).filter(|x| !x.is_finite()).count() as u64;
    if bad > 0 {
        return Err(Error::NonFinite {
            what: "merge_states out",
            count: bad,
        });
    }
    // -inf is an empty part; NaN and +inf are no state at all.
    let bad = a_lse
        .iter()
        .chain(b_lse)
        .filter(|x| x.is_nan() || **x == f32::INFINITY)
        .count() as u64;
    if bad > 0 {
        return Err(Error::NonFinite {
            what: "merge_states lse (NaN or +inf)",
            count: bad,
        });
    }

    let mut out = filled(n, 0f32, "merged output")?;
    let mut lse = filled(rows, f32::NEG_INFINITY, "merged lse")?;
    for (r, (&la, &lb)) in a_lse.iter().zip(b_lse).enumerate() {
        let (la, lb) = (la as f64, lb as f64);
        let m = la.max(lb);
        if m == f64::NEG_INFINITY {
            continue; // both empty: out 0, lse -inf as filled
        }
        let (wa, wb) = ((la - m).exp(), (lb - m).exp());
        let sum = wa + wb;
        let (a, b) = (
            &a_out[r * head_dim..][..head_dim],
            &b_out[r * head_dim..][..head_dim],
        );
        for ((o, &x), &y) in out[r * head_dim..][..head_dim].iter_mut().zip(a).zip(b) {
            *o = ((wa * x as f64 + wb * y as f64) / sum) as f32;
        }
        lse[r] = (m + sum.ln()) as f32;
    }
    Ok((out, lse))
}
