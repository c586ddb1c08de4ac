//! The format enum alone, apart from what its methods need (the spec table, errors), so that the
//! crate's error type can name a format without importing the formats' code.

/// A cache element format, usable for keys or values. Its identity and storage (names, bits,
/// groups, metadata, head scale) are its row of [`SPECS`](super::SPECS); the discriminant is the
/// row's index and the `kvq_format` id of `cuda/kvq.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum KvFormat {
    /// `f16`: IEEE binary16, stored as is.
    F16 = 0,
    /// `bf16`: bfloat16, stored as is.
    Bf16 = 1,
    /// `fp8-e4m3`: FP8 E4M3 with an f32 scale per KV head (or one per tensor).
    Fp8E4m3 = 2,
    /// `fp8-e5m2`: FP8 E5M2 with an f32 scale per KV head (or one per tensor).
    Fp8E5m2 = 3,
    /// `int4-k32`: INT4, symmetric, groups of 32 along head_dim, f16 scale per group (the key
    /// format).
    Int4Sym32 = 4,
    /// `int4-v64`: INT4, affine, groups of 64 along head_dim, f16 scale + f16 zero per group (the
    /// value format).
    Int4Affine64 = 5,
    /// `int8-pth`: INT8, symmetric, one f32 scale per row (token and KV head).
    Int8Pth = 6,
    /// `fp4-e2m1`: FP4 E2M1, an E4M3 block scale per 16 elements, an f32 global scale per KV
    /// head.
    Fp4E2m1 = 7,
    /// `int4-kc`, keys only: INT4 per channel over a block's tokens (KIVI-style, affine, f16 `s`
    /// and `z` per (block, KV head, channel)); block sizes 16, 32, 64. A block keeps its tokens
    /// as f16 until it is full, then is quantized in place ([`block_groups`](Self::block_groups)).
    Int4Kc = 8,
}
