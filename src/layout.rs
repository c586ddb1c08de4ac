//! Where every code, scale and zero of a paged cache block lives. This is the contract between
//! host and device: the CPU cache, the CUDA kernels and any engine that owns its own memory all
//! address the pool through [`BlockLayout`].
//!
//! A pool is `num_blocks` equal blocks. A block holds `block_size` token slots for every KV head,
//! keys and values together; within a block, each KV head owns one contiguous *head section*, so
//! a decode thread block that serves one KV head streams one contiguous run of bytes per page:
//!
//! ```text
//! pool:    | block 0 | block 1 | ... | block N-1 |             block_stride bytes each
//! block:   | head 0 section | head 1 section | ... |          head_stride bytes each
//! section: | K codes | K meta | V codes | V meta |            each region 16-byte aligned
//!
//! K codes: block_size rows of k_format.code_bytes(head_dim)   (token-major)
//! K meta:  block_size rows of k_format.meta_bytes(head_dim)   (INT4: f16 scale per group)
//! V codes: block_size rows of v_format.code_bytes(head_dim)
//! V meta:  block_size rows of v_format.meta_bytes(head_dim)   (INT4 affine: f16 scale, f16 zero
//!                                                              per group, interleaved)
//! ```
//!
//! All multi-byte values are little-endian. Regions start on 16-byte boundaries so kernels can
//! use 16-byte vector loads; empty regions (the metadata of f16/bf16/FP8) take no bytes. FP8's
//! per-head f32 scales are not in the pool: they travel beside it as two `[num_kv_heads]` arrays.
//! A token's *slot* is `block * block_size + offset_in_block`.

use crate::error::{Error, Result};
use crate::format::KvFormat;

/// Largest supported `block_size`.
pub const MAX_BLOCK_SIZE: usize = 1024;

/// The shape of a cache: what a layout is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheConfig {
    /// Number of KV heads stored (per layer).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Token slots per block (page).
    pub block_size: usize,
    /// Format of the keys.
    pub k_format: KvFormat,
    /// Format of the values.
    pub v_format: KvFormat,
}

impl CacheConfig {
    /// A configuration, validated.
    pub fn new(
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        k_format: KvFormat,
        v_format: KvFormat,
    ) -> Result<Self> {
        let c = CacheConfig {
            num_kv_heads,
            head_dim,
            block_size,
            k_format,
            v_format,
        };
        c.validate()?;
        Ok(c)
    }

    /// Check every field (also for configs built as struct literals).
    pub fn validate(&self) -> Result<()> {
        if self.num_kv_heads == 0 {
            return Err(Error::Config {
                what: "num_kv_heads",
                value: 0,
                expected: "at least 1",
            });
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config {
                what: "block_size",
                value: self.block_size,
                expected: "1..=1024 tokens",
            });
        }
        self.k_format.check_head_dim(self.head_dim)?;
        self.v_format.check_head_dim(self.head_dim)?;
        Ok(())
    }

    /// The byte layout of a block.
    pub fn layout(&self) -> BlockLayout {
        BlockLayout::new(self)
    }
}

/// One region of a head section: `block_size` rows of `row_bytes` at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Region {
    /// Byte offset from the start of the head section (a multiple of 16).
    pub offset: usize,
    /// Bytes per token row (0 for an absent region).
    pub row_bytes: usize,
}

impl Region {
    /// Byte offset of `token`'s row within the head section.
    pub const fn row(&self, token: usize) -> usize {
        self.offset + token * self.row_bytes
    }
}

/// Byte offsets and strides of a block, derived from a [`CacheConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// The configuration this layout was computed from.
    pub config: CacheConfig,
    /// Key codes.
    pub k_codes: Region,
    /// Key metadata (INT4 scales).
    pub k_meta: Region,
    /// Value codes.
    pub v_codes: Region,
    /// Value metadata (INT4 scales / zeros).
    pub v_meta: Region,
    /// Bytes of one head section (a multiple of 16).
    pub head_stride: usize,
    /// Bytes of one block: `head_stride * num_kv_heads`.
    pub block_stride: usize,
}

/// Round up to a multiple of 16 bytes.
const fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

impl BlockLayout {
    fn new(c: &CacheConfig) -> Self {
        let (d, bs) = (c.head_dim, c.block_size);
        let mut at = 0usize;
        let mut region = |row_bytes: usize| {
            let r = Region {
                offset: at,
                row_bytes,
            };
            at += align16(row_bytes * bs);
            r
        };
        let k_codes = region(c.k_format.code_bytes(d));
        let k_meta = region(c.k_format.meta_bytes(d));
        let v_codes = region(c.v_format.code_bytes(d));
        let v_meta = region(c.v_format.meta_bytes(d));
        let head_stride = at;
        BlockLayout {
            config: *c,
            k_codes,
            k_meta,
            v_codes,
            v_meta,
            head_stride,
            block_stride: head_stride * c.num_kv_heads,
        }
    }

    /// Byte offset in the pool of the head section of (`block`, `kv_head`).
    pub const fn head_section(&self, block: usize, kv_head: usize) -> usize {
        block * self.block_stride + kv_head * self.head_stride
    }

    /// Pool bytes for `num_blocks` blocks.
    pub const fn pool_bytes(&self, num_blocks: usize) -> usize {
        self.block_stride * num_blocks
    }

    /// Split a slot into (block, offset in block).
    pub const fn split_slot(&self, slot: usize) -> (usize, usize) {
        (slot / self.config.block_size, slot % self.config.block_size)
    }

    /// Bytes the pool spends per token and KV head, K and V together, padding included.
    pub fn bytes_per_token_head(&self) -> f64 {
        self.head_stride as f64 / self.config.block_size as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_layout_d128_bs16() {
        let c = CacheConfig::new(8, 128, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
        let l = c.layout();
        assert_eq!(
            l.k_codes,
            Region {
                offset: 0,
                row_bytes: 64
            }
        );
        assert_eq!(
            l.k_meta,
            Region {
                offset: 1024,
                row_bytes: 8
            }
        );
        assert_eq!(
            l.v_codes,
            Region {
                offset: 1152,
                row_bytes: 64
            }
        );
        assert_eq!(
            l.v_meta,
            Region {
                offset: 2176,
                row_bytes: 8
            }
        );
        assert_eq!(l.head_stride, 2304);
        assert_eq!(l.block_stride, 2304 * 8);
        assert_eq!(l.bytes_per_token_head(), 144.0); // 2 * 128 * 0.5625
    }

    #[test]
    fn regions_are_aligned_and_disjoint() {
        for k in KvFormat::ALL {
            for v in KvFormat::ALL {
                for bs in [1, 3, 16, 32, 64] {
                    let c = CacheConfig::new(2, 64, bs, k, v).unwrap();
                    let l = c.layout();
                    let rs = [l.k_codes, l.k_meta, l.v_codes, l.v_meta];
                    for w in rs.windows(2) {
                        assert_eq!(w[0].offset % 16, 0);
                        assert!(w[0].offset + w[0].row_bytes * bs <= w[1].offset);
                    }
                    assert_eq!(l.head_stride % 16, 0);
                }
            }
        }
    }

    #[test]
    fn bad_configs_are_errors() {
        assert!(CacheConfig::new(0, 128, 16, KvFormat::F16, KvFormat::F16).is_err());
        assert!(CacheConfig::new(1, 128, 0, KvFormat::F16, KvFormat::F16).is_err());
        assert!(matches!(
            CacheConfig::new(1, 96, 16, KvFormat::F16, KvFormat::Int4Affine64),
            Err(Error::HeadDim { head_dim: 96, .. })
        ));
    }
}
