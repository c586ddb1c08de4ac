//! The normalized Walsh–Hadamard rotation of `kvq eval --hadamard`.
//!
//! Keys carry a few outlier channels; a grouped INT4 key format spends a whole group's range on
//! them. Rotating every key row and every query row by the same orthogonal matrix `H` leaves
//! the attention logits as they were (`(H q) · (H k) = q · k` for `HᵀH = I`) and spreads each
//! outlier over all channels, so the groups of the rotated keys have smaller extremes for the
//! same energy (QuaRot, SpinQuant). `H` here is the Walsh–Hadamard matrix of order `head_dim`
//! (a power of two) scaled by `1 / sqrt(head_dim)`: symmetric and orthogonal, so it is its own
//! inverse, and applied in `O(d log d)` by the butterfly. Values are not rotated: the output is
//! attention over the same values, so it is compared with the reference unchanged.

/// Whether rows of `head_dim` elements can be rotated (a power of two).
pub fn supports(head_dim: usize) -> bool {
    head_dim.is_power_of_two()
}

/// Rotate each row of `head_dim` elements of `x` by the normalized Walsh–Hadamard matrix, in
/// place (`head_dim` a power of two, `x.len()` a multiple of it: the caller checks). Applying it
/// twice gives the rows back, up to rounding.
pub fn hadamard_rows(x: &mut [f32], head_dim: usize) {
    let norm = 1.0 / (head_dim as f64).sqrt();
    let mut row = vec![0f64; head_dim];
    for chunk in x.chunks_exact_mut(head_dim) {
        // In f64: the rotation's own rounding stays far below any format's error.
        row.iter_mut()
            .zip(&*chunk)
            .for_each(|(r, &v)| *r = v as f64);
        let mut h = 1;
        while h < head_dim {
            for block in row.chunks_exact_mut(2 * h) {
                let (lo, hi) = block.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        chunk
            .iter_mut()
            .zip(&row)
            .for_each(|(c, &r)| *c = (r * norm) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq::synth::Synth;

    #[test]
    fn rotation_is_orthogonal_and_its_own_inverse() {
        for d in [1, 2, 64, 128] {
            let mut s = Synth::new(d as u64);
            let (q, k) = (
                s.normal(3 * d, 1.0),
                s.with_outlier_channels(3, 1, d, 2, 20.0),
            );
            let (mut qr, mut kr) = (q.clone(), k.clone());
            hadamard_rows(&mut qr, d);
            hadamard_rows(&mut kr, d);
            for ((a, b), (ar, br)) in q
                .chunks(d)
                .zip(k.chunks(d))
                .zip(qr.chunks(d).zip(kr.chunks(d)))
            {
                let dot = |x: &[f32], y: &[f32]| -> f64 {
                    x.iter().zip(y).map(|(&u, &v)| u as f64 * v as f64).sum()
                };
                let (plain, rotated) = (dot(a, b), dot(ar, br));
                assert!(
                    (plain - rotated).abs() <= 1e-5 * (1.0 + plain.abs()),
                    "d {d}"
                );
                assert!((dot(b, b) - dot(br, br)).abs() <= 1e-5 * dot(b, b), "d {d}");
            }
            hadamard_rows(&mut kr, d);
            for (x, y) in k.iter().zip(&kr) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "d {d}: {x} {y}");
            }
        }
        // One outlier channel spreads evenly over every channel.
        let mut e = vec![0f32; 64];
        e[5] = 8.0;
        hadamard_rows(&mut e, 64);
        assert!(e.iter().all(|v| v.abs() == 1.0), "{e:?}");
        assert!(supports(64) && supports(128) && !supports(96) && !supports(0));
    }
}
