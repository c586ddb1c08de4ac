//! Per-channel INT4 keys, `int4-kc` (FORMATS.md, "INT4 keys per channel"): KIVI-style affine
//! INT4 whose groups run along tokens, G consecutive tokens of one (KV head, channel).
//!
//! Keys carry outlier channels: a few channels whose magnitude is many times the rest, the same
//! ones in every token. A group along head_dim (`int4-k32`) that holds one spends its whole code
//! range on it and rounds every other element of the row to ~0; a group along tokens holds one
//! channel only, so an outlier channel gets its own range and the others keep theirs.
//!
//! The element math is INT4 V's ([`int4::quantize_affine_group`], [`int4::dequantize_affine`]:
//! the same f16 rounding of `s` and `z`, the same code rounding and clamping) applied to a
//! channel's G values; inputs are sanitized and counted with [`sanitize_into`]. A code stays in
//! its token's row, packed two per byte along head_dim as INT4 is ([`int4::nibble`]).
//!
//! This is not a cache format yet (no [`KvFormat`](super::KvFormat) variant): a block is only
//! quantized once it is full, which the paged cache and the GPU kernels do not do today. This
//! module is the CPU reference for both of its forms, told apart by [`Mode`]: the dense file's
//! (the last, partial group quantized over its tokens) and the values a reader of the paged
//! cache sees (inputs rounded to f16 first, a partial tail kept as f16).

use half::f16;

use super::int4;
use super::sanitize::{Element, sanitize_into};
use crate::error::{Error, Result, filled};

/// The group sizes (tokens per group, the block size of a paged cache) FORMATS.md allows.
pub const GROUPS: [usize; 3] = [16, 32, 64];

/// The group size of the dense file (`kvq quantize --format int4-kc`).
pub const DENSE_GROUP: usize = 32;

/// Name of the format in the CLI, tables and dense files.
pub const NAME: &str = "int4-kc";

/// Which of FORMATS.md's two forms a tensor takes; they differ in the inputs the groups see and
/// in the tokens that do not fill a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The dense file: groups quantize the sanitized inputs as given; when the token count is
    /// not a multiple of G, the last group holds the remaining tokens and is quantized over
    /// only those. Nothing is kept as f16.
    Dense,
    /// What a reader of a paged cache of block size G sees: every sanitized input is rounded to
    /// f16 first (a cache keeps an unfilled block's tokens as `f16(x)`), each full group is
    /// quantized from those f16 values, and the tokens of a final group that never fills stay
    /// f16 (decoded as `f32(f16(x))`).
    Paged,
}

/// The geometry of a key tensor `[tokens, heads, head_dim]` and its group size G.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KcShape {
    tokens: usize,
    heads: usize,
    head_dim: usize,
    group: usize,
}

impl KcShape {
    /// A checked shape: `group` is one of [`GROUPS`], `head_dim` positive and even (two codes
    /// per byte), and `tokens × heads × head_dim` fits in memory ([`Error::Overflow`]).
    /// `tokens` or `heads` may be 0 (an empty tensor).
    pub fn new(tokens: usize, heads: usize, head_dim: usize, group: usize) -> Result<Self> {
        check_group(group)?;
        check_head_dim(head_dim)?;
        let row = heads.checked_mul(head_dim).ok_or(Error::Overflow {
            what: "int4-kc token row (heads × head_dim)",
            lhs: heads,
            rhs: head_dim,
        })?;
        // f32 inputs are 4 bytes an element: their count must be addressable.
        tokens
            .checked_mul(row)
            .filter(|&n| n <= isize::MAX as usize / 4)
            .ok_or(Error::Overflow {
                what: "int4-kc tensor (tokens × heads × head_dim)",
                lhs: tokens,
                rhs: row,
            })?;
        Ok(KcShape {
            tokens,
            heads,
            head_dim,
            group,
        })
    }

    /// Tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// KV heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Elements per token and head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Tokens per group (G).
    pub fn group(&self) -> usize {
        self.group
    }

    /// Elements of the tensor.
    pub fn elements(&self) -> usize {
        self.tokens * self.heads * self.head_dim
    }

    /// Tokens that are quantized in `mode`: all of them in the dense file, the full groups'
    /// in the paged form.
    pub fn quantized_tokens(&self, mode: Mode) -> usize {
        match mode {
            Mode::Dense => self.tokens,
            Mode::Paged => self.tokens / self.group * self.group,
        }
    }

    /// Groups per (head, channel) in `mode`: `ceil(tokens / G)` in the dense file, the full
    /// groups in the paged form.
    pub fn groups(&self, mode: Mode) -> usize {
        self.quantized_tokens(mode).div_ceil(self.group)
    }

    /// Elements of one group's metadata plane (`[heads, head_dim]`: an `s` or a `z` per
    /// channel).
    fn plane(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Check a group size: one of [`GROUPS`] ([`Error::Config`]).
pub fn check_group(group: usize) -> Result<()> {
    if GROUPS.contains(&group) {
        Ok(())
    } else {
        Err(Error::Config {
            what: "int4-kc group size (tokens per group)",
            value: group,
            expected: "16, 32 or 64",
        })
    }
}

/// Check a head_dim: positive and even, as two codes share a byte ([`Error::Config`]).
pub fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(Error::Config {
            what: "head_dim",
            value: head_dim,
            expected: "a positive even number for int4-kc",
        });
    }
    Ok(())
}

/// Bytes per element at group size `group`: half a byte of code plus an f16 `s` and an f16 `z`
/// per G tokens (0.5 + 4 / G; the f16 tail of the paged form is not counted).
pub fn bytes_per_element(group: usize) -> f64 {
    0.5 + 4.0 / group as f64
}

/// Keys quantized per channel, in one of the two [`Mode`]s.
#[derive(Debug, Clone, PartialEq)]
pub struct Int4KcTensor {
    shape: KcShape,
    mode: Mode,
    /// `[quantized tokens, heads, head_dim / 2]`: each token's row packed as INT4.
    codes: Vec<u8>,
    /// `[groups, heads, head_dim]`: `s` of group k, head h, channel j at `[k, h, j]`.
    scales: Vec<f16>,
    /// `[groups, heads, head_dim]`: `z`, laid out as `scales`.
    zeros: Vec<f16>,
    /// Paged form only: `[tokens mod G, heads, head_dim]`, the unfilled group's `f16(x)`.
    tail: Vec<f16>,
    non_finite: u64,
}

/// Quantize keys `x` (`[tokens, heads, head_dim]` row-major, `shape`) per channel in `mode`.
///
/// Inputs are sanitized (NaN → 0, clamp to ±65504) and the non-finite ones counted
/// ([`Int4KcTensor::non_finite`]). Errors: `x.len()` not `shape.elements()`
/// ([`Error::Length`]), and [`Error::Alloc`] when the buffers cannot be allocated.
pub fn quantize<T: Element>(x: &[T], shape: KcShape, mode: Mode) -> Result<Int4KcTensor> {
    if x.len() != shape.elements() {
        return Err(Error::Length {
            what: "int4-kc keys ([tokens, heads, head_dim])",
            expected: shape.elements(),
            actual: x.len(),
        });
    }
    let mut clean = filled(x.len(), 0f32, "int4-kc sanitized keys")?;
    let mut non_finite = 0u64;
    sanitize_into(x, &mut clean, &mut non_finite);
    if mode == Mode::Paged {
        // The cache keeps (and later quantizes) the f16 of each sanitized value.
        clean
            .iter_mut()
            .for_each(|v| *v = f16::from_f32(*v).to_f32());
    }
    let (plane, g) = (shape.plane(), shape.group);
    let quantized = shape.quantized_tokens(mode);
    let groups = shape.groups(mode);
    let mut codes = filled(quantized * plane / 2, 0u8, "int4-kc codes")?;
    let mut scales = filled(groups * plane, f16::ZERO, "int4-kc scales")?;
    let mut zeros = filled(groups * plane, f16::ZERO, "int4-kc zeros")?;
    let mut vals = [0f32; 64];
    let mut q = [0u8; 64];
    for k in 0..groups {
        let t0 = k * g;
        let n = g.min(quantized - t0);
        // One (head, channel) of the plane at a time: its n values, a stride of `plane` apart.
        for c in 0..plane {
            for (i, v) in vals[..n].iter_mut().enumerate() {
                *v = clean[(t0 + i) * plane + c];
            }
            let (s, z) = int4::quantize_affine_group(&vals[..n], &mut q[..n]);
            scales[k * plane + c] = s;
            zeros[k * plane + c] = z;
            // Element c of token t's [heads, head_dim] row is nibble c of its packed row
            // (head_dim is even, so a head's row starts on a byte).
            let shift = (c % 2) * 4;
            for (i, &code) in q[..n].iter().enumerate() {
                codes[((t0 + i) * plane + c) / 2] |= code << shift;
            }
        }
    }
    let tail = clean[quantized * plane..]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    Ok(Int4KcTensor {
        shape,
        mode,
        codes,
        scales,
        zeros,
        tail,
        non_finite,
    })
}

impl Int4KcTensor {
    /// Reassemble a tensor from its parts (e.g. read back from a file), checking their lengths
    /// against `shape` and `mode` ([`Error::Length`]) and their values as FORMATS.md asks of a
    /// reader: every `s` is 0 or positive and finite, every `z` and every f16 tail value finite
    /// ([`Error::Scale`], [`Error::InvalidArgument`]). A scale of -0.0 decodes as 0 does and is
    /// accepted, as the other INT4 readers accept it.
    pub fn from_parts(
        shape: KcShape,
        mode: Mode,
        codes: Vec<u8>,
        scales: Vec<f16>,
        zeros: Vec<f16>,
        tail: Vec<f16>,
    ) -> Result<Self> {
        let plane = shape.plane();
        let quantized = shape.quantized_tokens(mode);
        let meta = shape.groups(mode) * plane;
        for (what, expected, actual) in [
            ("int4-kc codes", quantized * plane / 2, codes.len()),
            ("int4-kc scales", meta, scales.len()),
            ("int4-kc zeros", meta, zeros.len()),
            (
                "int4-kc f16 tail",
                (shape.tokens - quantized) * plane,
                tail.len(),
            ),
        ] {
            if expected != actual {
                return Err(Error::Length {
                    what,
                    expected,
                    actual,
                });
            }
        }
        if let Some(s) = scales
            .iter()
            .map(|s| s.to_f32())
            .find(|&s| !(s == 0.0 || (s > 0.0 && s.is_finite())))
        {
            return Err(Error::Scale {
                what: "stored int4-kc scale (0, or positive and finite)",
                value: s,
            });
        }
        for (what, values) in [("zero", &zeros), ("f16 tail value", &tail)] {
            if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
                return Err(Error::InvalidArgument(format!(
                    "stored int4-kc {what} {bad} is not finite"
                )));
            }
        }
        Ok(Int4KcTensor {
            shape,
            mode,
            codes,
            scales,
            zeros,
            tail,
            non_finite: 0,
        })
    }

    /// Dequantize into `[tokens, heads, head_dim]` f32 values: `fma(q, s, z)` for a quantized
    /// token, `f32(f16(x))` for a token of the paged form's unfilled group.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let shape = self.shape;
        let plane = shape.plane();
        let mut out = filled(shape.elements(), 0f32, "int4-kc dequantized keys")?;
        let quantized = shape.quantized_tokens(self.mode) * plane;
        let (head, tail) = out.split_at_mut(quantized);
        for (i, o) in head.iter_mut().enumerate() {
            let (t, c) = (i / plane, i % plane);
            let m = t / shape.group * plane + c;
            *o = int4::dequantize_affine(
                int4::nibble(&self.codes, i),
                self.scales[m],
                self.zeros[m],
            );
        }
        for (o, v) in tail.iter_mut().zip(&self.tail) {
            *o = v.to_f32();
        }
        Ok(out)
    }

    /// The geometry.
    pub fn shape(&self) -> KcShape {
        self.shape
    }

    /// The form.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Packed codes, `[quantized tokens, heads, head_dim / 2]`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// Scales `s`, `[groups, heads, head_dim]`.
    pub fn scales(&self) -> &[f16] {
        &self.scales
    }

    /// Zeros `z`, `[groups, heads, head_dim]`.
    pub fn zeros(&self) -> &[f16] {
        &self.zeros
    }

    /// The paged form's unfilled group, `[tokens mod G, heads, head_dim]` as f16 (empty in the
    /// dense form, or when the tokens fill their groups).
    pub fn tail(&self) -> &[f16] {
        &self.tail
    }

    /// Non-finite inputs met while quantizing (stored as their sanitized values); 0 for a
    /// tensor built with [`from_parts`](Self::from_parts).
    pub fn non_finite(&self) -> u64 {
        self.non_finite
    }

    /// Bytes of codes, scales, zeros and f16 tail together.
    pub fn stored_bytes(&self) -> usize {
        self.codes.len() + 2 * (self.scales.len() + self.zeros.len() + self.tail.len())
    }

    /// Split into `(codes, scales, zeros, tail)`.
    pub fn into_parts(self) -> (Vec<u8>, Vec<f16>, Vec<f16>, Vec<f16>) {
        (self.codes, self.scales, self.zeros, self.tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tokens, one head, head_dim 2, by hand. Channel 0 holds 0.0 and 1.5: mn 0, mx 1.5,
    /// s = f16(0.1) = 0.0999755859375, z = 0; codes rne(0 / s) = 0 and rne(1.5 / s) =
    /// rne(15.0037) = 15. Channel 1 holds -1.0 and -1.0: s = 0, z = -1, codes 0.
    #[test]
    fn hand_computed_group() {
        let x = [0.0f32, -1.0, 1.5, -1.0];
        let shape = KcShape::new(2, 1, 2, 16).unwrap();
        let t = quantize(&x, shape, Mode::Dense).unwrap();
        let s0 = f16::from_f32(0.1);
        assert_eq!(s0.to_f32(), 1638.0 / 16384.0); // 0.0999755859375
        assert_eq!(t.scales(), [s0, f16::ZERO]);
        assert_eq!(t.zeros(), [f16::ZERO, f16::from_f32(-1.0)]);
        // Token 0: codes (0, 0); token 1: (15, 0), low nibble first.
        assert_eq!(t.codes(), [0x00, 0x0F]);
        let out = t.dequantize().unwrap();
        assert_eq!(out, [0.0, -1.0, 15.0 * 1638.0 / 16384.0, -1.0]);
        assert_eq!(t.non_finite(), 0);
    }

    /// Groups run along tokens; a zero extreme is +0.0, and the tail group of the dense form is
    /// quantized over its own tokens only.
    #[test]
    fn groups_run_along_tokens_with_a_partial_last_group() {
        // 17 tokens, 1 head, head_dim 2, G 16: channel 0 is t, channel 1 is -0.0 then 100.
        let x: Vec<f32> = (0..17)
            .flat_map(|t| [t as f32, if t < 16 { -0.0 } else { 100.0 }])
            .collect();
        let shape = KcShape::new(17, 1, 2, 16).unwrap();
        let t = quantize(&x, shape, Mode::Dense).unwrap();
        // Group 0, channel 0: 0..=15, s = 1, z = 0, codes t; channel 1: all -0.0 → s 0, z +0.
        assert_eq!(t.scales()[0], f16::ONE);
        assert_eq!(t.zeros()[0].to_bits(), 0);
        assert_eq!(t.scales()[1], f16::ZERO);
        assert_eq!(t.zeros()[1].to_bits(), 0, "a zero extreme is +0.0");
        // Group 1 is token 16 alone: s 0, z the value itself.
        assert_eq!(t.scales()[2..], [f16::ZERO, f16::ZERO]);
        assert_eq!(t.zeros()[2..], [f16::from_f32(16.0), f16::from_f32(100.0)]);
        assert_eq!(
            t.dequantize().unwrap(),
            x.iter().map(|v| v + 0.0).collect::<Vec<_>>()
        );
        assert!(t.tail().is_empty());
        assert_eq!(t.codes().len(), 17);
        assert_eq!(t.codes()[5], 5);
    }

    /// The paged form rounds to f16 first and keeps the unfilled group as f16.
    #[test]
    fn paged_form_keeps_the_tail_f16() {
        let x: Vec<f32> = (0..20 * 2)
            .map(|i| (i as f32 * 0.37).sin() + 1e-4)
            .collect();
        let shape = KcShape::new(20, 1, 2, 16).unwrap();
        let t = quantize(&x, shape, Mode::Paged).unwrap();
        assert_eq!(
            (t.codes().len(), t.scales().len(), t.tail().len()),
            (16, 2, 8)
        );
        let out = t.dequantize().unwrap();
        for (o, v) in out[32..].iter().zip(&x[32..]) {
            assert_eq!(*o, f16::from_f32(*v).to_f32());
        }
        // The full group is the dense form applied to the f16 values.
        let rounded: Vec<f16> = x[..32].iter().map(|&v| f16::from_f32(v)).collect();
        let dense = quantize(&rounded, KcShape::new(16, 1, 2, 16).unwrap(), Mode::Dense).unwrap();
        assert_eq!(dense.dequantize().unwrap(), out[..32]);
        assert_eq!((dense.scales(), dense.zeros()), (t.scales(), t.zeros()));
    }

    #[test]
    fn sanitizes_and_counts_non_finite_inputs() {
        let mut x = vec![0.5f32; 16 * 2];
        x[0] = f32::NAN;
        x[3] = f32::NEG_INFINITY;
        x[5] = 1e9; // finite: clamped, not counted
        let t = quantize(&x, KcShape::new(16, 1, 2, 16).unwrap(), Mode::Dense).unwrap();
        assert_eq!(t.non_finite(), 2);
        let out = t.dequantize().unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        assert_eq!(t.zeros()[1], f16::from_f32(-65504.0));
        assert_eq!(out[3], -65504.0);
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        for g in [0, 8, 24, 128] {
            assert!(
                matches!(KcShape::new(4, 1, 2, g), Err(Error::Config { value, .. }) if value == g)
            );
        }
        for d in [0, 3] {
            assert!(matches!(
                KcShape::new(4, 1, d, 32),
                Err(Error::Config { .. })
            ));
        }
        assert!(matches!(
            KcShape::new(usize::MAX, 2, 2, 32),
            Err(Error::Overflow { .. })
        ));
        let shape = KcShape::new(4, 1, 2, 32).unwrap();
        assert!(matches!(
            quantize(&[0f32; 7], shape, Mode::Dense),
            Err(Error::Length { .. })
        ));
        let t = quantize(&[1f32; 8], shape, Mode::Dense).unwrap();
        let (c, s, z, tail) = t.clone().into_parts();
        assert_eq!(
            Int4KcTensor::from_parts(
                shape,
                Mode::Dense,
                c.clone(),
                s.clone(),
                z.clone(),
                tail.clone()
            )
            .unwrap()
            .dequantize(),
            t.dequantize()
        );
        let mut neg = s.clone();
        neg[0] = f16::from_f32(-1.0);
        assert!(matches!(
            Int4KcTensor::from_parts(shape, Mode::Dense, c.clone(), neg, z.clone(), tail.clone()),
            Err(Error::Scale { .. })
        ));
        let mut inf = z.clone();
        inf[1] = f16::INFINITY;
        assert!(
            Int4KcTensor::from_parts(shape, Mode::Dense, c.clone(), s.clone(), inf, tail.clone())
                .is_err()
        );
        assert!(matches!(
            Int4KcTensor::from_parts(shape, Mode::Paged, c, s, z, tail),
            Err(Error::Length { .. })
        ));
        // Empty tensors are fine.
        let empty = KcShape::new(0, 3, 4, 64).unwrap();
        assert!(
            quantize::<f32>(&[], empty, Mode::Paged)
                .unwrap()
                .dequantize()
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn bytes_per_element_match_formats_md() {
        assert_eq!(bytes_per_element(32), 0.625);
        assert_eq!(bytes_per_element(16), 0.75);
        assert_eq!(bytes_per_element(64), 0.5625);
    }
}
