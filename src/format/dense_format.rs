//! [`DenseFormat`]: the format of a dense tensor (`kvq quantize`, [`crate::dense`]), derived from
//! the format table: the quantized cache formats' dense forms, plus a per-tensor INT4 baseline.

use super::{Fp8Kind, HeadScale, KvFormat, SPECS};
use crate::error::{Error, Result};
use std::fmt;

/// A dense-tensor quantization format: the quantized cache formats plus a per-tensor INT4
/// baseline that exists only to show what grouping buys.
///
/// The format table ([`SPECS`]) is the source of truth: a dense format is the `dense` form of
/// a quantized cache format ([`kv_format`](Self::kv_format)), with its name, element math,
/// metadata and head_dim rule, or `int4-uniform`. The variants are spelled out (rather than
/// wrapping a `KvFormat`) so callers can match on them exhaustively; [`TryFrom<KvFormat>`] and
/// `kv_format` convert both ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenseFormat {
    /// [`KvFormat::Fp8E4m3`], with an f32 scale per tensor or per head.
    Fp8E4m3,
    /// [`KvFormat::Fp8E5m2`], with an f32 scale per tensor or per head.
    Fp8E5m2,
    /// [`KvFormat::Int4Sym32`]: symmetric INT4, groups of 32, f16 scale per group.
    Int4K32,
    /// [`KvFormat::Int4Affine64`]: affine INT4, groups of 64, f16 scale and zero per group.
    Int4V64,
    /// [`KvFormat::Int8Pth`]: symmetric INT8, an f32 scale per row.
    Int8Pth,
    /// [`KvFormat::Fp4E2m1`]: E2M1 codes, an E4M3 scale per 16 elements, an f32 global scale
    /// per head.
    Fp4E2m1,
    /// Symmetric INT4 with one f32 scale for the whole tensor (reference baseline only).
    Int4Uniform,
}

impl DenseFormat {
    /// Every format, in a fixed order: the quantized [`KvFormat`]s in their order, then
    /// `int4-uniform`.
    pub const ALL: [DenseFormat; DENSE_COUNT + 1] = {
        let mut all = [DenseFormat::Int4Uniform; DENSE_COUNT + 1];
        let (mut i, mut n) = (0, 0);
        while i < SPECS.len() {
            if let Some(d) = SPECS[i].dense {
                all[n] = d;
                n += 1;
            }
            i += 1;
        }
        all
    };

    /// Name of the one format that is not a cache format.
    const UNIFORM_NAME: &'static str = "int4-uniform";

    /// The cache format with the same element math, for all but `int4-uniform`.
    pub const fn kv_format(self) -> Option<KvFormat> {
        let mut i = 0;
        while i < SPECS.len() {
            if let Some(d) = SPECS[i].dense {
                if d as u8 == self as u8 {
                    return Some(SPECS[i].format);
                }
            }
            i += 1;
        }
        None
    }

    /// Name used by the CLI and in file metadata: the [`KvFormat::name`] of
    /// [`kv_format`](Self::kv_format) (`fp8-e4m3`, `fp8-e5m2`, `int4-k32`, `int4-v64`,
    /// `int8-pth`, `fp4-e2m1`), or `int4-uniform`.
    pub const fn name(self) -> &'static str {
        match self.kv_format() {
            Some(kv) => kv.name(),
            None => Self::UNIFORM_NAME,
        }
    }

    /// Parse a [`name`](Self::name) (the same as `str::parse`).
    pub fn from_name(name: &str) -> Result<Self> {
        name.parse()
    }

    /// The FP8 encoding, for FP8 formats.
    pub const fn fp8_kind(self) -> Option<Fp8Kind> {
        match self.kv_format() {
            Some(kv) => kv.fp8_kind(),
            None => None,
        }
    }

    /// The f32 scale per head (or tensor) outside the rows: FP8's `s`, FP4's `g`.
    pub const fn head_scale(self) -> Option<HeadScale> {
        match self.kv_format() {
            Some(kv) => kv.head_scale(),
            None => None,
        }
    }

    /// Bits per code.
    pub const fn bits(self) -> u32 {
        match self.kv_format() {
            Some(kv) => kv.bits(),
            None => 4,
        }
    }

    /// Check that `head_dim` (the last axis) suits this format: the cache formats' rule
    /// ([`KvFormat::check_head_dim`]), and a positive even number for `int4-uniform`.
    pub fn check_head_dim(self, head_dim: usize) -> Result<()> {
        match self.kv_format() {
            Some(kv) => kv.check_head_dim(head_dim),
            None if head_dim == 0 || head_dim % 2 != 0 => Err(Error::Config {
                what: "head_dim",
                value: head_dim,
                expected: "a positive even number for int4-uniform",
            }),
            None => Ok(()),
        }
    }

    /// Bytes of codes for one row of `head_dim` elements (saturating, as
    /// [`KvFormat::code_bytes`]).
    pub const fn code_bytes(self, head_dim: usize) -> usize {
        match self.kv_format() {
            Some(kv) => kv.code_bytes(head_dim),
            None => head_dim / 2,
        }
    }

    /// Whether the tensor stores a zero per group beside its scales (`int4-v64`).
    pub fn has_zeros(self) -> bool {
        self.kv_format().is_some_and(|kv| kv.spec().group_zeros())
    }

    fn unknown(name: &str) -> Error {
        let known: Vec<_> = Self::ALL.iter().map(|f| f.name()).collect();
        Error::InvalidArgument(format!(
            "unknown format '{name}' (known: {})",
            known.join(", ")
        ))
    }
}

/// Number of cache formats with a dense form.
const DENSE_COUNT: usize = {
    let (mut i, mut n) = (0, 0);
    while i < SPECS.len() {
        n += SPECS[i].dense.is_some() as usize;
        i += 1;
    }
    n
};

impl TryFrom<KvFormat> for DenseFormat {
    type Error = Error;
    /// The dense format of a quantized cache format; f16 and bf16 have none
    /// ([`Error::Unsupported`]).
    fn try_from(kv: KvFormat) -> Result<Self> {
        kv.spec().dense.ok_or_else(|| {
            Error::Unsupported(format!(
                "{kv} is stored as is: there is no dense quantized format for it"
            ))
        })
    }
}

impl fmt::Display for DenseFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DenseFormat {
    type Err = Error;
    /// `int4-uniform`, or a [`KvFormat`] name that has a dense format, in any case.
    fn from_str(name: &str) -> Result<Self> {
        if name.eq_ignore_ascii_case(Self::UNIFORM_NAME) {
            return Ok(DenseFormat::Int4Uniform);
        }
        name.parse::<KvFormat>()
            .ok()
            .and_then(|kv| Self::try_from(kv).ok())
            .ok_or_else(|| Self::unknown(name))
    }
}
