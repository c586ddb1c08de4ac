//! An independent, element-by-element recomputation of what `kvq::dense` (and so `kvq
//! quantize`) must write, straight from FORMATS.md with `kvq::format`'s scalar functions, plus
//! deterministic random data. Shared by tests/dense.rs and tests/cli.rs.

#![allow(dead_code)] // each test binary uses a different part

use half::f16;
use kvq::dense::DenseFormat;
use kvq::format::{Fp8Kind, int4, sanitize};

pub use crate::common::Rng;

/// Test values for quantizers.
pub trait Values {
    /// Uniform in [-1, 1), scaled by a magnitude spread over five decades, with an occasional
    /// outlier, so groups see very different ranges.
    fn value(&mut self) -> f32;
    /// `n` values.
    fn vec(&mut self, n: usize) -> Vec<f32>;
}

impl Values for Rng {
    fn value(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let decade = 10f32.powi((self.next_u64() % 5) as i32 - 2);
        let outlier = if self.next_u64() % 97 == 0 { 40.0 } else { 1.0 };
        u * decade * outlier
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

/// The bytes one format writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    pub codes: Vec<u8>,
    pub scales: Vec<u8>,
    pub zeros: Option<Vec<u8>>,
    /// FP4's global scales `g`, one f32 per head.
    pub global_scales: Option<Vec<u8>>,
}

/// E2M1 of `y`, transcribed from FORMATS.md's table: nearest grid value, ties to the even
/// mantissa, saturation above 5; a magnitude-0 result is +0.
pub fn spec_e2m1(y: f32) -> u8 {
    let a = y.abs();
    let bounds = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    // A tie on an even boundary index goes down (to the code with mantissa 0), on an odd one up.
    let m = bounds
        .iter()
        .enumerate()
        .filter(|&(i, &b)| if i % 2 == 0 { a > b } else { a >= b })
        .count() as u8;
    if y < 0.0 && m != 0 { m | 8 } else { m }
}

/// Value of an E2M1 code's low nibble, from its fields: exp 0 is `mant · 0.5`, else
/// `(1 + mant / 2) · 2^(exp - 1)`.
pub fn spec_e2m1_value(code: u8) -> f32 {
    let (exp, mant) = ((code >> 1) & 3, code & 1);
    let mag = if exp == 0 {
        mant as f32 * 0.5
    } else {
        (1.0 + mant as f32 / 2.0) * 2f32.powi(exp as i32 - 1)
    };
    if code & 8 != 0 { -mag } else { mag }
}

/// FP4's global scale of each head: `amax / 2688`, 1.0 when that is 0.
pub fn fp4_globals(clean: &[f32], heads: usize, d: usize) -> Vec<f32> {
    (0..heads)
        .map(|h| {
            let a = clean
                .chunks(d)
                .enumerate()
                .filter(|(r, _)| r % heads == h)
                .fold(0f32, |m, (_, row)| m.max(amax(row)));
            let g = a / 2688.0;
            if g == 0.0 { 1.0 } else { g }
        })
        .collect()
}

fn fp8_kind(format: DenseFormat) -> Fp8Kind {
    match format {
        DenseFormat::Fp8E4m3 => Fp8Kind::E4M3,
        DenseFormat::Fp8E5m2 => Fp8Kind::E5M2,
        _ => unreachable!("not fp8"),
    }
}

fn amax(vals: &[f32]) -> f32 {
    vals.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Two nibbles per byte, the even element low.
pub fn pack(nibbles: &[u8]) -> Vec<u8> {
    nibbles.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
}

/// FP8 scales: `fixed`, else per head (rows `r` with `r % heads == h`) or per tensor amax.
pub fn fp8_scales(
    format: DenseFormat,
    x: &[f32],
    heads: usize,
    d: usize,
    per_head: bool,
    fixed: Option<f32>,
) -> Vec<f32> {
    let kind = fp8_kind(format);
    let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
    if let Some(s) = fixed {
        return vec![s];
    }
    if !per_head {
        return vec![kind.scale_from_amax(amax(&clean))];
    }
    (0..heads)
        .map(|h| {
            let head: Vec<f32> = clean
                .chunks(d)
                .enumerate()
                .filter(|(r, _)| r % heads == h)
                .flat_map(|(_, row)| row.iter().copied())
                .collect();
            kind.scale_from_amax(amax(&head))
        })
        .collect()
}

/// What `format` must write for `x` (`[..., heads, d]`).
pub fn expected(
    format: DenseFormat,
    x: &[f32],
    heads: usize,
    d: usize,
    per_head: bool,
    fixed: Option<f32>,
) -> Expected {
    let clean: Vec<f32> = x.iter().map(|&v| sanitize(v).0).collect();
    match format {
        DenseFormat::Fp8E4m3 | DenseFormat::Fp8E5m2 => {
            let kind = fp8_kind(format);
            let scales = fp8_scales(format, x, heads, d, per_head, fixed);
            let codes = clean
                .iter()
                .enumerate()
                .map(|(i, &v)| kind.quantize(v, scales[(i / d) % heads % scales.len()]))
                .collect();
            Expected {
                codes,
                scales: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                zeros: None,
                global_scales: None,
            }
        }
        DenseFormat::Int4K32 => {
            let (mut nibbles, mut scales) = (Vec::new(), Vec::new());
            for g in clean.chunks(32) {
                let s = f16::from_f32(amax(g) / 7.0);
                scales.extend(s.to_le_bytes());
                for &v in g {
                    let q = if s.to_f32() == 0.0 {
                        0
                    } else {
                        (v / s.to_f32()).round_ties_even().clamp(-7.0, 7.0) as i8
                    };
                    nibbles.push(q as u8 & 0xF);
                }
            }
            Expected {
                codes: pack(&nibbles),
                scales,
                zeros: None,
                global_scales: None,
            }
        }
        DenseFormat::Int4V64 => {
            let (mut nibbles, mut scales, mut zeros) = (Vec::new(), Vec::new(), Vec::new());
            for g in clean.chunks(64) {
                let mn = g.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s = f16::from_f32((mx - mn) / 15.0);
                let z = f16::from_f32(mn);
                scales.extend(s.to_le_bytes());
                zeros.extend(z.to_le_bytes());
                for &v in g {
                    let q = if s.to_f32() == 0.0 {
                        0
                    } else {
                        ((v - z.to_f32()) / s.to_f32())
                            .round_ties_even()
                            .clamp(0.0, 15.0) as u8
                    };
                    nibbles.push(q);
                }
            }
            Expected {
                codes: pack(&nibbles),
                scales,
                zeros: Some(zeros),
                global_scales: None,
            }
        }
        DenseFormat::Int4Uniform => {
            let s = amax(&clean) / 7.0;
            let nibbles: Vec<u8> = clean
                .iter()
                .map(|&v| int4::quantize_uniform(v, s) as u8 & 0xF)
                .collect();
            Expected {
                codes: pack(&nibbles),
                scales: s.to_le_bytes().to_vec(),
                zeros: None,
                global_scales: None,
            }
        }
        DenseFormat::Int8Pth => {
            let (mut codes, mut scales) = (Vec::new(), Vec::new());
            for row in clean.chunks(d) {
                let s = amax(row) / 127.0;
                scales.extend(s.to_le_bytes());
                for &v in row {
                    let q = if s == 0.0 {
                        0
                    } else {
                        (v / s).round_ties_even().clamp(-127.0, 127.0) as i8
                    };
                    codes.push(q as u8);
                }
            }
            Expected {
                codes,
                scales,
                zeros: None,
                global_scales: None,
            }
        }
        DenseFormat::Fp4E2m1 => {
            let globals = fp4_globals(&clean, heads, d);
            let (mut nibbles, mut scales) = (Vec::new(), Vec::new());
            for (r, row) in clean.chunks(d).enumerate() {
                let g = globals[r % heads];
                for grp in row.chunks(16) {
                    let u = amax(grp) / 6.0 / g;
                    let sb = Fp8Kind::E4M3.encode(u);
                    scales.push(sb);
                    let dd = Fp8Kind::E4M3.decode(sb) * g;
                    for &v in grp {
                        nibbles.push(if dd == 0.0 { 0 } else { spec_e2m1(v / dd) });
                    }
                }
            }
            Expected {
                codes: pack(&nibbles),
                scales,
                zeros: None,
                global_scales: Some(globals.iter().flat_map(|g| g.to_le_bytes()).collect()),
            }
        }
    }
}

/// Decode stored bytes element by element (FORMATS.md "Decode" lines); `heads` and `d` locate
/// each element's per-head FP8 scale.
pub fn decode(format: DenseFormat, e: &Expected, heads: usize, d: usize) -> Vec<f32> {
    let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
    let f32_at = |b: &[u8], i: usize| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    let n = match format {
        DenseFormat::Fp8E4m3 | DenseFormat::Fp8E5m2 | DenseFormat::Int8Pth => e.codes.len(),
        _ => e.codes.len() * 2,
    };
    (0..n)
        .map(|i| match format {
            DenseFormat::Fp8E4m3 | DenseFormat::Fp8E5m2 => {
                let scales = e.scales.len() / 4;
                let s = f32_at(&e.scales, (i / d) % heads % scales);
                fp8_kind(format).dequantize(e.codes[i], s)
            }
            DenseFormat::Int4K32 => {
                int4::dequantize_sym(int4::signed_nibble(&e.codes, i), f16_at(&e.scales, i / 32))
            }
            DenseFormat::Int4V64 => int4::dequantize_affine(
                int4::nibble(&e.codes, i),
                f16_at(&e.scales, i / 64),
                f16_at(e.zeros.as_ref().unwrap(), i / 64),
            ),
            DenseFormat::Int4Uniform => {
                int4::dequantize_uniform(int4::signed_nibble(&e.codes, i), f32_at(&e.scales, 0))
            }
            DenseFormat::Int8Pth => e.codes[i] as i8 as f32 * f32_at(&e.scales, i / d),
            DenseFormat::Fp4E2m1 => {
                let g = f32_at(e.global_scales.as_ref().unwrap(), (i / d) % heads);
                let sb = Fp8Kind::E4M3.decode(e.scales[i / 16]);
                spec_e2m1_value(int4::nibble(&e.codes, i)) * sb * g
            }
        })
        .collect()
}
