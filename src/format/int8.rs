//! INT8 per token-head element math (FORMATS.md, "INT8 per token-head (`int8-pth`)"): one
//! symmetric f32 scale for the whole row, one two's-complement byte per element.

/// Metadata bytes of one row: the f32 scale `s`, little-endian.
pub const ROW_META: usize = 4;

/// Largest code magnitude written (−127..=127; 0x80 is never written).
const MAX_CODE: f32 = 127.0;

/// Largest magnitude a byte decodes to per unit of scale: 0x80, never written, decodes as
/// −128 · s, so a stored scale must keep `128 × s` finite.
pub const MAX_DECODED: f32 = 128.0;

/// Quantize one row of sanitized values: `s = amax / 127`, `q = clamp(rne(x / s), -127, 127)`
/// (every code 0 when `s == 0`). Writes one byte per element to `codes` (the first
/// `min(x.len(), codes.len())` elements) and returns `s`.
pub fn quantize_row(x: &[f32], codes: &mut [u8]) -> f32 {
    let x = &x[..x.len().min(codes.len())];
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = amax / MAX_CODE;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = quantize(v, s) as u8;
    }
    s
}

/// The code of one sanitized value under scale `s`: `clamp(rne(x / s), -127, 127)`, 0 when
/// `s == 0`. A negative value that rounds to zero is +0 (0x00): `-0.0 as i8` is 0.
#[inline]
pub fn quantize(x: f32, s: f32) -> i8 {
    if s == 0.0 {
        0
    } else {
        (x / s).round_ties_even().clamp(-MAX_CODE, MAX_CODE) as i8
    }
}

/// Decode a code: `f32(q) * s`.
#[inline]
pub fn dequantize(q: u8, s: f32) -> f32 {
    q as i8 as f32 * s
}

/// The scale stored in a row's metadata (its first 4 bytes, little-endian; 0 for a shorter
/// slice, which a checked row never is).
#[inline]
pub fn row_scale(meta: &[u8]) -> f32 {
    meta.first_chunk::<ROW_META>()
        .map_or(0.0, |b| f32::from_le_bytes(*b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_row_and_extremes() {
        let mut c = [9u8; 16];
        assert_eq!(quantize_row(&[0.0; 16], &mut c), 0.0);
        assert!(c.iter().all(|&q| q == 0));
        let mut x = [0.0f32; 16];
        x[0] = -127.0;
        x[1] = 63.5; // 63.5 / 1 = 63.5 → 64 (even)
        x[2] = -0.4; // rounds to -0 → 0x00
        assert_eq!(quantize_row(&x, &mut c), 1.0);
        assert_eq!(&c[..3], &[0x81, 64, 0]);
        assert_eq!(dequantize(0x81, 1.0), -127.0);
        assert_eq!(dequantize(0x80, 0.5), -64.0);
    }
}
