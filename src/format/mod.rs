//! Element formats of the KV cache: pure math, no memory layout beyond one token's row.
//!
//! A *row* is the `head_dim` values of one token for one KV head. Every format turns a row into
//! `code_bytes(head_dim)` bytes of codes plus `meta_bytes(head_dim)` bytes of per-group or per-row
//! metadata (f16 scales, and zeros for affine INT4; FP4's E4M3 block scales; INT8's f32 row
//! scale). FP8 and FP4 formats additionally take one f32 scale per KV head (or per tensor) that
//! lives outside the rows. The normative definition is FORMATS.md; the
//! CUDA kernels implement the same functions in `cuda/codec/` (one codec per format), bit for bit.
//! [`int4_kc`] is the exception: per-channel INT4 keys group along tokens, not within a row, so
//! it has no row codec; its module quantizes whole `[tokens, heads, head_dim]` tensors (the
//! dense file, and the CPU reference of what a cache's reader sees), and as a cache format
//! ([`KvFormat::Int4Kc`]) a block is quantized in place once it is full (`HostCache::write`).
//! [`outlier`] (INT2 / INT3 key rows with each head's top-k channels in f16) is a CPU reference
//! only, scored by `kvq eval`.

pub(crate) mod dense_format;
pub mod fp4;
pub mod fp8;
pub mod int4;
pub mod int4_kc;
pub mod int8;
pub(crate) mod kind;
pub mod outlier;
pub mod sanitize;
pub mod spec;

pub use fp8::Fp8Kind;
pub use kind::KvFormat;
pub use sanitize::{Element, sanitize};
pub use spec::{FormatSpec, HeadScale, SPECS};

use crate::error::{Error, Result, filled};
use half::{bf16, f16};
use std::fmt;

impl KvFormat {
    /// Every format, in discriminant order (the order of [`SPECS`]).
    pub const ALL: [KvFormat; spec::COUNT] = {
        let mut all = [KvFormat::F16; spec::COUNT];
        let mut i = 0;
        while i < spec::COUNT {
            all[i] = SPECS[i].format;
            i += 1;
        }
        all
    };

    /// This format's row of the format table.
    pub const fn spec(self) -> &'static FormatSpec {
        &SPECS[self as usize]
    }

    /// Short name used by the CLI and in tables: `f16`, `bf16`, `fp8-e4m3`, `fp8-e5m2`,
    /// `int4-k32`, `int4-v64`, `int8-pth`, `fp4-e2m1`, `int4-kc`.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    /// Parse a [`name`](Self::name), in any case (`FP8-E4M3` is `fp8-e4m3`).
    pub fn from_name(name: &str) -> Result<Self> {
        SPECS
            .iter()
            .find(|s| s.name.eq_ignore_ascii_case(name))
            .map(|s| s.format)
            .ok_or_else(|| {
                let known: Vec<_> = SPECS.iter().map(|s| s.name).collect();
                Error::InvalidArgument(format!(
                    "unknown format '{name}' (known: {})",
                    known.join(", ")
                ))
            })
    }

    /// Bits per code.
    pub const fn bits(self) -> u32 {
        self.spec().bits
    }

    /// Group size along head_dim for grouped formats.
    pub const fn group_size(self) -> Option<usize> {
        self.spec().group
    }

    /// The FP8 encoding, for FP8 formats.
    pub const fn fp8_kind(self) -> Option<Fp8Kind> {
        match self.spec().head_scale {
            Some(HeadScale::Fp8(kind)) => Some(kind),
            _ => None,
        }
    }

    /// The f32 scale per KV head the format takes from outside the rows (FP8, FP4), if any.
    pub const fn head_scale(self) -> Option<HeadScale> {
        self.spec().head_scale
    }

    /// Whether the format takes an f32 scale per KV head from outside the rows (FP8, FP4).
    pub const fn has_head_scale(self) -> bool {
        self.head_scale().is_some()
    }

    /// `head_dim` must be a positive multiple of this: the group size for INT4, and one 16-byte
    /// vector of codes for the others.
    pub const fn head_dim_multiple(self) -> usize {
        self.spec().head_dim_multiple()
    }

    /// Whether the format's groups run along a cache block's tokens, one per channel
    /// (`int4-kc`): keys only, no row codec ([`check_row`](Self::check_row) refuses it), a
    /// block kept as f16 until full and then quantized in place.
    pub const fn block_groups(self) -> bool {
        self.spec().block_groups
    }

    /// Bytes of metadata per block and KV head that follow a sealed block's codes: `s[head_dim]`
    /// then `z[head_dim]`, f16, for `int4-kc`; 0 for the other formats.
    pub const fn block_meta_bytes(self, head_dim: usize) -> usize {
        if self.block_groups() {
            head_dim.saturating_mul(4)
        } else {
            0
        }
    }

    /// Check that a cache of this format may have blocks of `block_size` tokens: any size, but
    /// 16, 32 or 64 for `int4-kc` (its group is the block, [`Error::Config`]).
    pub fn check_block_size(self, block_size: usize) -> Result<()> {
        if self.block_groups() {
            int4_kc::check_group(block_size)?;
        }
        Ok(())
    }

    /// Check that `head_dim` suits this format.
    pub fn check_head_dim(self, head_dim: usize) -> Result<()> {
        let multiple = self.head_dim_multiple();
        if head_dim == 0 || head_dim % multiple != 0 {
            return Err(Error::HeadDim {
                head_dim,
                format: self,
                multiple,
            });
        }
        Ok(())
    }

    /// Bytes of codes in one row: `head_dim × bits / 8`, computed without overflowing (it
    /// saturates at `usize::MAX` for a `head_dim` no row can have; [`CacheConfig`] rejects
    /// those with [`Error::Overflow`]).
    ///
    /// [`CacheConfig`]: crate::CacheConfig
    pub const fn code_bytes(self, head_dim: usize) -> usize {
        let bits = self.bits() as usize;
        (head_dim / 8)
            .saturating_mul(bits)
            .saturating_add(head_dim % 8 * bits / 8)
    }

    /// Bytes of metadata in one row: per group (f16 scales; scale+zero pairs for affine INT4;
    /// E4M3 block scales for FP4) or per row (INT8's f32 scale).
    pub const fn meta_bytes(self, head_dim: usize) -> usize {
        let s = self.spec();
        match s.group {
            Some(g) => head_dim / g * s.meta_bytes_per_group,
            None => s.meta_bytes_per_row,
        }
    }

    /// Bytes per element including in-row metadata (not the per-head FP8 / FP4 scale), at
    /// head_dim 128 (a per-row scale's share depends on head_dim; the grouped formats' does not)
    /// and, for `int4-kc`, of a sealed block of 32 tokens (0.5 + 4 / G):
    /// [`bytes_per_element_at`](Self::bytes_per_element_at)`(128, 32)`.
    pub fn bytes_per_element(self) -> f64 {
        self.bytes_per_element_at(128, int4_kc::DENSE_GROUP)
    }

    /// Bytes per element of rows of `head_dim` elements, including in-row metadata (not the
    /// per-head FP8 / FP4 scale) and, for `int4-kc`, a sealed block's `s` and `z` shared by its
    /// `block_size` tokens.
    pub fn bytes_per_element_at(self, head_dim: usize, block_size: usize) -> f64 {
        let row = self.code_bytes(head_dim) + self.meta_bytes(head_dim);
        let block = self.block_meta_bytes(head_dim) as f64 / block_size as f64;
        (row as f64 + block) / head_dim as f64
    }

    /// Check the arguments of one row of `head_dim` elements: the format has a row codec (not
    /// `int4-kc`, [`Error::Unsupported`]), `head_dim` suits the format ([`Error::HeadDim`]),
    /// `codes` and `meta` hold [`code_bytes`](Self::code_bytes) and
    /// [`meta_bytes`](Self::meta_bytes) bytes ([`Error::Length`]), and for FP8 and FP4 the head
    /// scale is positive and finite ([`Error::Scale`]; other formats ignore it).
    pub fn check_row(
        self,
        head_dim: usize,
        codes_len: usize,
        meta_len: usize,
        head_scale: f32,
    ) -> Result<()> {
        if self.block_groups() {
            return Err(Error::Unsupported(format!(
                "{self} has no row codec: its groups run along a block's tokens (a cache \
                 quantizes a block once it is full; dense tensors: dense::quantize_int4_kc)"
            )));
        }
        self.check_head_dim(head_dim)?;
        for (what, expected, actual) in [
            (
                "row codes (code_bytes(head_dim))",
                self.code_bytes(head_dim),
                codes_len,
            ),
            (
                "row metadata (meta_bytes(head_dim))",
                self.meta_bytes(head_dim),
                meta_len,
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
        if self.has_head_scale() && !(head_scale.is_finite() && head_scale > 0.0) {
            return Err(Error::Scale {
                what: "head scale (FP8 s, FP4 g)",
                value: head_scale,
            });
        }
        Ok(())
    }

    /// Quantize one row (`head_dim = x.len()`). Inputs are sanitized first (FORMATS.md); the
    /// number of non-finite inputs is returned. `head_scale` is the FP8 scale or FP4's global
    /// scale `g` (ignored by other formats). `codes` must be `code_bytes(x.len())` long and `meta` `meta_bytes(x.len())`;
    /// every argument is checked first ([`check_row`](Self::check_row)) and on an error nothing
    /// is written.
    pub fn try_encode_row<T: Element>(
        self,
        x: &[T],
        head_scale: f32,
        codes: &mut [u8],
        meta: &mut [u8],
    ) -> Result<u64> {
        self.check_row(x.len(), codes.len(), meta.len(), head_scale)?;
        Ok(self.encode_checked(x, head_scale, codes, meta))
    }

    /// [`try_encode_row`](Self::try_encode_row) for arguments the caller has already checked
    /// (the row loops of the cache and of `dense`). Arguments it would reject write nothing and
    /// return 0; this never panics.
    pub fn encode_row<T: Element>(
        self,
        x: &[T],
        head_scale: f32,
        codes: &mut [u8],
        meta: &mut [u8],
    ) -> u64 {
        self.try_encode_row(x, head_scale, codes, meta).unwrap_or(0)
    }

    /// The encoder proper; the caller checked every argument.
    fn encode_checked<T: Element>(
        self,
        x: &[T],
        head_scale: f32,
        codes: &mut [u8],
        meta: &mut [u8],
    ) -> u64 {
        // Sanitize element by element (or one group at a time into a stack buffer) so that
        // the per-row append / quantize paths never allocate.
        let mut non_finite = 0u64;
        let mut clean = |v: T| {
            let (v, bad) = sanitize(v.to_f32());
            non_finite += bad as u64;
            v
        };
        match self {
            KvFormat::F16 => {
                for (c, &v) in codes.chunks_exact_mut(2).zip(x) {
                    c.copy_from_slice(&f16::from_f32(clean(v)).to_le_bytes());
                }
            }
            KvFormat::Bf16 => {
                for (c, &v) in codes.chunks_exact_mut(2).zip(x) {
                    c.copy_from_slice(&bf16::from_f32(clean(v)).to_le_bytes());
                }
            }
            KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2 => {
                let kind = self.fp8_kind().expect("fp8 format");
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = kind.quantize(clean(v), head_scale);
                }
            }
            KvFormat::Int4Sym32 => {
                let g = int4::SYM_GROUP;
                let mut vals = [0f32; int4::SYM_GROUP];
                let mut q = [0i8; int4::SYM_GROUP];
                for (i, group) in x.chunks_exact(g).enumerate() {
                    sanitize::sanitize_into(group, &mut vals, &mut non_finite);
                    let s = int4::quantize_sym_group(&vals, &mut q);
                    int4::pack_nibbles(
                        q.iter().map(|&c| c as u8),
                        &mut codes[i * g / 2..][..g / 2],
                    );
                    meta[i * 2..i * 2 + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
            KvFormat::Int4Affine64 => {
                let g = int4::AFFINE_GROUP;
                let mut vals = [0f32; int4::AFFINE_GROUP];
                let mut q = [0u8; int4::AFFINE_GROUP];
                for (i, group) in x.chunks_exact(g).enumerate() {
                    sanitize::sanitize_into(group, &mut vals, &mut non_finite);
                    let (s, z) = int4::quantize_affine_group(&vals, &mut q);
                    int4::pack_nibbles(q.iter().copied(), &mut codes[i * g / 2..][..g / 2]);
                    meta[i * 4..i * 4 + 2].copy_from_slice(&s.to_le_bytes());
                    meta[i * 4 + 2..i * 4 + 4].copy_from_slice(&z.to_le_bytes());
                }
            }
            KvFormat::Int8Pth => {
                // The row is one group of any length: two passes over the input (amax, counting
                // the non-finite inputs once; then the codes), sanitizing element by element.
                let mut amax = 0.0f32;
                for &v in x {
                    amax = amax.max(clean(v).abs());
                }
                let s = amax / 127.0;
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = int8::quantize(sanitize(v.to_f32()).0, s) as u8;
                }
                meta[..int8::ROW_META].copy_from_slice(&s.to_le_bytes());
            }
            KvFormat::Fp4E2m1 => {
                let g = fp4::GROUP;
                let mut vals = [0f32; fp4::GROUP];
                let mut q = [0u8; fp4::GROUP];
                for (i, group) in x.chunks_exact(g).enumerate() {
                    sanitize::sanitize_into(group, &mut vals, &mut non_finite);
                    meta[i] = fp4::quantize_group(&vals, head_scale, &mut q);
                    int4::pack_nibbles(q.iter().copied(), &mut codes[i * g / 2..][..g / 2]);
                }
            }
            // No row codec: check_row refused it.
            KvFormat::Int4Kc => {}
        }
        non_finite
    }

    /// Dequantize one row into `out` (`head_dim = out.len()` values), exactly as FORMATS.md
    /// defines. The arguments are checked as for [`try_encode_row`](Self::try_encode_row).
    pub fn try_decode_row(
        self,
        codes: &[u8],
        meta: &[u8],
        head_scale: f32,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_row(out.len(), codes.len(), meta.len(), head_scale)?;
        self.decode_checked(codes, meta, head_scale, out);
        Ok(())
    }

    /// [`try_decode_row`](Self::try_decode_row) for arguments the caller has already checked.
    /// Arguments it would reject fill `out` with NaN, so a misuse cannot pass for data; this
    /// never panics.
    pub fn decode_row(self, codes: &[u8], meta: &[u8], head_scale: f32, out: &mut [f32]) {
        if self.try_decode_row(codes, meta, head_scale, out).is_err() {
            out.fill(f32::NAN);
        }
    }

    /// The decoder proper; the caller checked every argument.
    fn decode_checked(self, codes: &[u8], meta: &[u8], head_scale: f32, out: &mut [f32]) {
        match self {
            KvFormat::F16 => {
                for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            KvFormat::Bf16 => {
                for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2 => {
                let kind = self.fp8_kind().expect("fp8 format");
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = kind.dequantize(c, head_scale);
                }
            }
            KvFormat::Int4Sym32 => {
                for (i, o) in out.iter_mut().enumerate() {
                    let g = i / int4::SYM_GROUP;
                    let s = f16::from_le_bytes([meta[g * 2], meta[g * 2 + 1]]);
                    *o = int4::dequantize_sym(int4::signed_nibble(codes, i), s);
                }
            }
            KvFormat::Int4Affine64 => {
                for (i, o) in out.iter_mut().enumerate() {
                    let g = i / int4::AFFINE_GROUP;
                    let s = f16::from_le_bytes([meta[g * 4], meta[g * 4 + 1]]);
                    let z = f16::from_le_bytes([meta[g * 4 + 2], meta[g * 4 + 3]]);
                    *o = int4::dequantize_affine(int4::nibble(codes, i), s, z);
                }
            }
            KvFormat::Int8Pth => {
                let s = int8::row_scale(meta);
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = int8::dequantize(c, s);
                }
            }
            KvFormat::Fp4E2m1 => {
                for (i, o) in out.iter_mut().enumerate() {
                    let sb = meta[i / fp4::GROUP];
                    *o = fp4::dequantize(int4::nibble(codes, i), sb, head_scale);
                }
            }
            // No row codec: check_row refused it.
            KvFormat::Int4Kc => out.fill(f32::NAN),
        }
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_name(s)
    }
}

/// Largest |x| over sanitized inputs: the amax FP8 scales are calibrated from.
pub fn sanitized_amax<T: Element>(x: &[T]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, v| m.max(sanitize(v.to_f32()).0.abs()))
}

/// [`sanitized_amax`] of each head of `x`, laid out `[tokens, heads, head_dim]` (row `r` of
/// `head_dim` values belongs to head `r % heads`): the amaxes per-head FP8 scales are calibrated
/// from. `x.len()` must be a multiple of `heads × head_dim`; `heads` and `head_dim` must be
/// positive unless `x` is empty (then every amax is 0).
pub fn head_amax<T: Element>(x: &[T], heads: usize, head_dim: usize) -> Result<Vec<f32>> {
    let row = heads.checked_mul(head_dim).ok_or(Error::Overflow {
        what: "head_amax token row (heads × head_dim)",
        lhs: heads,
        rhs: head_dim,
    })?;
    if row == 0 {
        if !x.is_empty() {
            return Err(Error::Config {
                what: if heads == 0 { "heads" } else { "head_dim" },
                value: 0,
                expected: "at least 1 for non-empty data",
            });
        }
    } else if x.len() % row != 0 {
        return Err(Error::Length {
            what: "head_amax data ([tokens, heads, head_dim])",
            expected: x.len().div_ceil(row) * row,
            actual: x.len(),
        });
    }
    let mut amax = filled(heads, 0.0f32, "head_amax output")?;
    if row == 0 {
        return Ok(amax);
    }
    for (r, row) in x.chunks_exact(head_dim).enumerate() {
        let a = &mut amax[r % heads];
        *a = a.max(sanitized_amax(row));
    }
    Ok(amax)
}

/// FP8 scale granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleGranularity {
    /// One scale for the whole tensor (all KV heads of a layer's K, or V).
    PerTensor,
    /// One scale per KV head.
    PerHead,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for f in KvFormat::ALL {
            assert_eq!(KvFormat::from_name(f.name()).unwrap(), f);
            assert_eq!(f.name().to_uppercase().parse::<KvFormat>().unwrap(), f);
        }
        assert!(KvFormat::from_name("int3").is_err());
        assert_eq!(
            "INT4-Uniform".parse::<crate::dense::DenseFormat>().unwrap(),
            crate::dense::DenseFormat::Int4Uniform
        );
    }

    #[test]
    fn bytes_per_element_match_spec() {
        assert_eq!(KvFormat::Int4Sym32.bytes_per_element(), 0.5625);
        assert_eq!(KvFormat::Int4Affine64.bytes_per_element(), 0.5625);
        assert_eq!(KvFormat::Fp8E4m3.bytes_per_element(), 1.0);
        assert_eq!(KvFormat::Bf16.bytes_per_element(), 2.0);
        assert_eq!(KvFormat::Int8Pth.bytes_per_element(), 1.03125);
        assert_eq!(KvFormat::Fp4E2m1.bytes_per_element(), 0.5625);
        assert_eq!(KvFormat::Int4Kc.bytes_per_element(), 0.625);
    }

    /// FORMATS.md's storage of each format, stated independently of the table the methods read.
    #[test]
    fn storage_matches_formats_md() {
        use Fp8Kind::{E4M3, E5M2};
        use HeadScale::{Fp4, Fp8};
        // (format, bits, group, head_dim multiple, row bytes at head_dim 128 (codes, meta) and
        // at 64, head scale)
        let expected = [
            (KvFormat::F16, 16, None, 8, (256, 0), (128, 0), None),
            (KvFormat::Bf16, 16, None, 8, (256, 0), (128, 0), None),
            (
                KvFormat::Fp8E4m3,
                8,
                None,
                16,
                (128, 0),
                (64, 0),
                Some(Fp8(E4M3)),
            ),
            (
                KvFormat::Fp8E5m2,
                8,
                None,
                16,
                (128, 0),
                (64, 0),
                Some(Fp8(E5M2)),
            ),
            (KvFormat::Int4Sym32, 4, Some(32), 32, (64, 8), (32, 4), None),
            (
                KvFormat::Int4Affine64,
                4,
                Some(64),
                64,
                (64, 8),
                (32, 4),
                None,
            ),
            // one f32 scale per row
            (KvFormat::Int8Pth, 8, None, 16, (128, 4), (64, 4), None),
            // an E4M3 byte per 16 elements; whole 16-byte code vectors ask for 32
            (
                KvFormat::Fp4E2m1,
                4,
                Some(16),
                32,
                (64, 8),
                (32, 4),
                Some(Fp4),
            ),
            // codes in their token's row; s and z per block and channel, not per row
            (KvFormat::Int4Kc, 4, None, 32, (64, 0), (32, 0), None),
        ];
        assert_eq!(expected.len(), KvFormat::ALL.len());
        for (f, bits, group, multiple, row, row64, head) in expected {
            assert_eq!(f.bits(), bits, "{f}");
            assert_eq!(f.group_size(), group, "{f}");
            assert_eq!(f.head_dim_multiple(), multiple, "{f}");
            assert_eq!((f.code_bytes(128), f.meta_bytes(128)), row, "{f}");
            assert_eq!((f.code_bytes(64), f.meta_bytes(64)), row64, "{f}");
            assert_eq!(f.head_scale(), head, "{f}");
            assert_eq!(
                f.fp8_kind(),
                head.and_then(|h| match h {
                    Fp8(k) => Some(k),
                    Fp4 => None,
                }),
                "{f}"
            );
            assert_eq!(f.has_head_scale(), head.is_some(), "{f}");
        }
    }

    #[test]
    fn row_round_trip_every_format() {
        let d = 128;
        let x: Vec<f32> = (0..d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for f in KvFormat::ALL.into_iter().filter(|f| !f.block_groups()) {
            let mut codes = vec![0u8; f.code_bytes(d)];
            let mut meta = vec![0u8; f.meta_bytes(d)];
            let s = f
                .head_scale()
                .map_or(1.0, |h| h.scale_from_amax(sanitized_amax(&x)));
            assert_eq!(f.encode_row(&x, s, &mut codes, &mut meta), 0);
            let mut out = vec![0f32; d];
            f.decode_row(&codes, &meta, s, &mut out);
            let err = x
                .iter()
                .zip(&out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            // FP4's top step is 2 · amax16 / 6 (amax ≈ 7.1 here); the others' far less.
            let bound = if f == KvFormat::Fp4E2m1 { 1.5 } else { 1.0 };
            assert!(err < bound, "{f}: max error {err}");
        }
    }

    /// Zero codes and metadata are zeros in every row format: the prefill kernel decodes the
    /// rows a step does not see from a row of zero bytes (cuda/prefill/layout.cuh, kZeroRow).
    #[test]
    fn zero_bytes_decode_to_zeros() {
        for d in [64, 128, 256] {
            for f in KvFormat::ALL.into_iter().filter(|f| !f.block_groups()) {
                let (codes, meta) = (vec![0u8; f.code_bytes(d)], vec![0u8; f.meta_bytes(d)]);
                let mut out = vec![f32::NAN; d];
                f.decode_row(&codes, &meta, 1.0, &mut out);
                assert!(
                    out.iter().all(|&v| v == 0.0),
                    "{f} at head_dim {d}: {out:?}"
                );
            }
        }
    }

    #[test]
    fn block_grouped_format_has_no_row_codec() {
        let f = KvFormat::Int4Kc;
        assert!(f.block_groups());
        assert_eq!(f.block_meta_bytes(128), 512);
        let (mut codes, mut meta) = (vec![0u8; 64], vec![]);
        assert!(matches!(
            f.try_encode_row(&[1f32; 128], 1.0, &mut codes, &mut meta),
            Err(Error::Unsupported(_))
        ));
        let mut out = [0f32; 128];
        f.decode_row(&codes, &meta, 1.0, &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
        for bs in [16, 32, 64] {
            f.check_block_size(bs).unwrap();
        }
        assert!(f.check_block_size(8).is_err());
        assert!(KvFormat::Int4Sym32.check_block_size(8).is_ok());
    }
}
