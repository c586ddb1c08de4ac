//! FP4 E2M1 element math (FORMATS.md, "FP4 E2M1 (`fp4-e2m1`)"), NVFP4-style: 4-bit E2M1 codes,
//! an E4M3 block scale per 16 elements, and an f32 global scale `g` per KV head that lives
//! outside the rows (as FP8's head scale does).

use super::fp8::Fp8Kind;

/// Elements per group (one E4M3 block scale each).
pub const GROUP: usize = 16;

/// Largest E2M1 magnitude.
const E2M1_MAX: f32 = 6.0;

/// What the global scale's calibration maps amax to: the largest E2M1 value under the largest
/// E4M3 block scale, 448 · 6.
pub const GLOBAL_MAX: f32 = 2688.0;

/// Block-scale bytes a reader accepts: 0x00..=0x7E (0x7F is NaN, 0x80 and above carry a sign).
pub const MAX_BLOCK_SCALE: u8 = 0x7E;

/// Magnitudes of the codes `0..8`; bit 3 of a code negates.
const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Encode an f32 (never NaN here) as E2M1: round to nearest on the grid, ties to the even
/// mantissa, saturating at 6. A value that rounds to magnitude 0 is +0 (code 0x0, never 0x8).
pub fn e2m1(y: f32) -> u8 {
    let a = y.abs();
    // Decision boundaries (midpoints) and which side a tie goes to (the even mantissa).
    let m = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if y < 0.0 && m != 0 { m | 8 } else { m }
}

/// Value of an E2M1 code (its low 4 bits): exact; 0x8 is −0.0.
#[inline]
pub fn e2m1_value(code: u8) -> f32 {
    let v = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 { -v } else { v }
}

/// The global scale from calibration data: `g = amax / 2688`, or 1.0 when that quotient is 0
/// (amax 0, or so small that the division underflows). `amax` is sanitized first, like every
/// quantizer input, and its sign ignored; the result is always positive and finite.
pub fn global_scale_from_amax(amax: f32) -> f32 {
    let amax = super::sanitize(amax).0.abs();
    let g = amax / GLOBAL_MAX;
    if g == 0.0 { 1.0 } else { g }
}

/// The E4M3 block scale of a group with largest magnitude `amax16` under global scale `g`:
/// `E4M3((amax16 / 6) / g)`, two divisions in that order.
pub fn block_scale(amax16: f32, g: f32) -> u8 {
    Fp8Kind::E4M3.encode(amax16 / E2M1_MAX / g)
}

/// Quantize one group of sanitized values under global scale `g` (positive and finite): writes
/// its E2M1 codes, one per element, to `codes` (the first `min(x.len(), codes.len())`
/// elements) and returns the block-scale byte `sb`.
pub fn quantize_group(x: &[f32], g: f32, codes: &mut [u8]) -> u8 {
    let x = &x[..x.len().min(codes.len())];
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let sb = block_scale(amax, g);
    let d = Fp8Kind::E4M3.decode(sb) * g;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if d == 0.0 { 0 } else { e2m1(v / d) };
    }
    sb
}

/// Decode a code under block scale `sb` and global scale `g`: `(value(c) · value(sb)) · g`, two
/// multiplications in that order (the first exact), not `value(c) · d`.
#[inline]
pub fn dequantize(code: u8, sb: u8, g: f32) -> f32 {
    e2m1_value(code) * Fp8Kind::E4M3.decode(sb) * g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_but_negative_zero() {
        for c in 0..16u8 {
            let want = if c == 8 { 0 } else { c };
            assert_eq!(e2m1(e2m1_value(c)), want, "code {c:#x}");
        }
        assert_eq!(e2m1_value(8).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn global_scale_is_always_valid() {
        for amax in [0.0, -0.0, f32::from_bits(1), f32::NAN] {
            assert_eq!(global_scale_from_amax(amax), 1.0);
        }
        assert_eq!(global_scale_from_amax(2688.0), 1.0);
        assert_eq!(global_scale_from_amax(f32::INFINITY), 65504.0 / 2688.0);
    }
}
