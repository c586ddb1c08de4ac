//! Grouped INT4 element math (FORMATS.md, "INT4 K", "INT4 V", "Uniform INT4", "Packing").
//!
//! The functions here take one group of already sanitized f32 values and produce codes plus
//! metadata; packing two codes per byte is [`pack_nibbles`]'s job.

use half::f16;

/// Group size of symmetric INT4 (keys).
pub const SYM_GROUP: usize = 32;
/// Group size of affine INT4 (values).
pub const AFFINE_GROUP: usize = 64;

/// Quantize one symmetric group: `s = f16(amax / 7)`, `q = clamp(rne(x / s), -7, 7)`.
/// Writes signed codes (−7..=7) to `codes` and returns the f16 scale. The group is the first
/// `min(x.len(), codes.len())` values (the two are the same length in every caller).
pub fn quantize_sym_group(x: &[f32], codes: &mut [i8]) -> f16 {
    let x = &x[..x.len().min(codes.len())];
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = f16::from_f32(amax / 7.0);
    let sf = s.to_f32();
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if sf == 0.0 {
            0
        } else {
            (v / sf).round_ties_even().clamp(-7.0, 7.0) as i8
        };
    }
    s
}

/// Decode a symmetric code: `f32(q) * f32(s)`.
#[inline]
pub fn dequantize_sym(q: i8, s: f16) -> f32 {
    q as f32 * s.to_f32()
}

/// Quantize one affine group: `s = f16((max - min) / 15)`, `z = f16(min)`,
/// `q = clamp(rne((x - z) / s), 0, 15)`. Writes codes 0..=15 and returns `(scale, zero)`.
/// The group is the first `min(x.len(), codes.len())` values, as for [`quantize_sym_group`];
/// an empty group gets scale 0 and zero 0.
pub fn quantize_affine_group(x: &[f32], codes: &mut [u8]) -> (f16, f16) {
    let x = &x[..x.len().min(codes.len())];
    if x.is_empty() {
        return (f16::ZERO, f16::ZERO);
    }
    let (mn, mx) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    // f32::min / max leave the sign of a zero result unspecified (it changes with how the fold
    // is compiled); FORMATS.md fixes a zero extreme to +0.0 (`-0.0 + 0.0 == +0.0`).
    let (mn, mx) = (mn + 0.0, mx + 0.0);
    let s = f16::from_f32((mx - mn) / 15.0);
    let z = f16::from_f32(mn);
    let (sf, zf) = (s.to_f32(), z.to_f32());
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if sf == 0.0 {
            0
        } else {
            ((v - zf) / sf).round_ties_even().clamp(0.0, 15.0) as u8
        };
    }
    (s, z)
}

/// Decode an affine code: `fma(f32(q), f32(s), f32(z))`, one rounding.
#[inline]
pub fn dequantize_affine(q: u8, s: f16, z: f16) -> f32 {
    (q as f32).mul_add(s.to_f32(), z.to_f32())
}

/// Scale of uniform per-tensor INT4: `amax / 7` in f32 (0 when all inputs are 0).
pub fn uniform_scale(amax: f32) -> f32 {
    amax / 7.0
}

/// Quantize one value with a uniform f32 scale (codes as for symmetric INT4).
#[inline]
pub fn quantize_uniform(x: f32, s: f32) -> i8 {
    if s == 0.0 {
        0
    } else {
        (x / s).round_ties_even().clamp(-7.0, 7.0) as i8
    }
}

/// Decode a uniform code: `f32(q) * s`.
#[inline]
pub fn dequantize_uniform(q: i8, s: f32) -> f32 {
    q as f32 * s
}

/// Pack 4-bit codes two per byte: element `2i` in bits 0–3, `2i + 1` in bits 4–7.
/// Signed codes are stored as two's-complement nibbles (`q & 0xF`).
pub fn pack_nibbles(codes: impl IntoIterator<Item = u8>, out: &mut [u8]) {
    let mut it = codes.into_iter();
    for byte in out.iter_mut() {
        let lo = it.next().unwrap_or(0) & 0xF;
        let hi = it.next().unwrap_or(0) & 0xF;
        *byte = lo | (hi << 4);
    }
}

/// Unsigned nibble `i` of a packed buffer. A buffer reads as if zero-padded: an `i` past its
/// end gives 0, as [`pack_nibbles`] pads a short code sequence (check lengths with
/// [`KvFormat::check_row`](crate::KvFormat::check_row) where that matters).
#[inline]
pub fn nibble(packed: &[u8], i: usize) -> u8 {
    packed.get(i / 2).map_or(0, |b| (b >> ((i & 1) * 4)) & 0xF)
}

/// Signed (two's-complement) nibble `i` of a packed buffer.
#[inline]
pub fn signed_nibble(packed: &[u8], i: usize) -> i8 {
    ((nibble(packed, i) << 4) as i8) >> 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_constant_groups() {
        let mut c = [0i8; 32];
        assert_eq!(quantize_sym_group(&[0.0; 32], &mut c), f16::ZERO);
        assert!(c.iter().all(|&q| q == 0));
        let mut u = [9u8; 64];
        let (s, z) = quantize_affine_group(&[3.25; 64], &mut u);
        assert_eq!((s, z), (f16::ZERO, f16::from_f32(3.25)));
        assert!(u.iter().all(|&q| q == 0));
        assert_eq!(dequantize_affine(0, s, z), 3.25);
    }

    #[test]
    fn packing_is_low_nibble_first() {
        let mut out = [0u8; 2];
        pack_nibbles([1u8, 2, (-7i8) as u8, 7], &mut out);
        assert_eq!(out, [0x21, 0x79]);
        assert_eq!(signed_nibble(&out, 2), -7);
        assert_eq!(nibble(&out, 1), 2);
    }
}
