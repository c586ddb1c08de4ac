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
//! `int4-kc` keys (`block_size` G of 16, 32 or 64) fill the K part of a section differently:
//! it spans `G × 2 × head_dim` bytes and holds, while the block is not full, its tokens' f16
//! rows (the *window*, [`BlockLayout::k_window`]), and once the block's last token is appended
//! the block quantized in place (*sealed*): G rows of codes at `k_codes`, then at `k_meta` the
//! block's `s[head_dim]` and `z[head_dim]` (f16; `k_meta.row_bytes` is 0). A reader knows which
//! from the sequence's length: position `p` of a sequence of `len` tokens is sealed iff
//! `(p / G + 1) × G ≤ len` ([`BlockLayout::sealed`]).
//!
//! All multi-byte values are little-endian. Regions start on 16-byte boundaries so kernels can
//! use 16-byte vector loads; empty regions (the metadata of f16/bf16/FP8) take no bytes. FP8's
//! per-head f32 scales are not in the pool: they travel beside it as two `[num_kv_heads]` arrays.
//! A token's *slot* is `block * block_size + offset_in_block`.

use crate::error::{Error, Result, at_least_one};
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
    /// A configuration, validated for the formats and the CPU path, which take any block size
    /// and every head_dim the formats allow. The GPU kernels take fewer: block sizes that are
    /// multiples of 16, and the head dims `cuda::decode::kernel_available_for` and
    /// `cuda::prefill::kernel_available_for` accept (feature `cuda`); a GPU plan refuses the
    /// rest with an error. Check there before sizing a pool for the GPU.
    ///
    /// The arguments are the fields in order; a struct literal names them, which is safer where
    /// a swap of `head_dim` and `block_size` would still be a valid config (`8, 16, 128` with FP8
    /// formats is one), then [`validate`](Self::validate) checks it.
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

    /// Check every field (also for configs built as struct literals), and that the block layout
    /// it implies is addressable: each size product, `head_dim × bits`, each region's
    /// `row bytes × block_size` and the block's `head_stride × num_kv_heads`, must be at most
    /// `(isize::MAX - 64) / 4` ([`Error::Overflow`]), so that a head section's four regions and
    /// their padding add up without a check of their own. A pool of such blocks is checked
    /// against `isize::MAX` where it is sized ([`BlockLayout::try_pool_bytes`]).
    pub fn validate(&self) -> Result<()> {
        at_least_one(&[("num_kv_heads", self.num_kv_heads)])?;
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config {
                what: "block_size",
                value: self.block_size,
                expected: "1..=1024 tokens",
            });
        }
        if self.v_format.block_groups() {
            return Err(Error::Unsupported(format!(
                "{} is a key format: its groups run along tokens, for keys' outlier channels",
                self.v_format
            )));
        }
        self.k_format.check_block_size(self.block_size)?;
        self.k_format.check_head_dim(self.head_dim)?;
        self.v_format.check_head_dim(self.head_dim)?;
        BlockLayout::build(self, checked_mul).map(|_| ())
    }

    /// The byte layout of a block. For a config that fails [`validate`](Self::validate)
    /// (possible only for a struct literal) sizes saturate at `usize::MAX` instead of wrapping,
    /// so nothing built from them can address memory; use [`try_layout`](Self::try_layout) to
    /// get the error instead.
    pub fn layout(&self) -> BlockLayout {
        match self.try_layout() {
            Ok(l) => l,
            Err(_) => match BlockLayout::build(self, |a, b, _| {
                Ok::<_, std::convert::Infallible>(a.saturating_mul(b))
            }) {
                Ok(l) => l,
                Err(e) => match e {}, // saturating arithmetic cannot fail
            },
        }
    }

    /// The byte layout of a block, after [`validate`](Self::validate).
    pub fn try_layout(&self) -> Result<BlockLayout> {
        self.validate()?;
        BlockLayout::build(self, checked_mul)
    }
}

/// Largest region of a head section, in bytes: four of them (plus 16-byte padding each) still
/// add up to less than `isize::MAX`, so the sum needs no check of its own.
const MAX_REGION_BYTES: usize = (isize::MAX as usize - 64) / 4;

/// `a × b`, or [`Error::Overflow`] naming `what` when it exceeds `MAX_REGION_BYTES`.
fn checked_mul(a: usize, b: usize, what: &'static str) -> Result<usize> {
    a.checked_mul(b)
        .filter(|&p| p <= MAX_REGION_BYTES)
        .ok_or(Error::Overflow {
            what,
            lhs: a,
            rhs: b,
        })
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
    /// Byte offset of `token`'s row within the head section (saturating at `usize::MAX` for
    /// tokens past any block).
    pub const fn row(&self, token: usize) -> usize {
        self.offset
            .saturating_add(token.saturating_mul(self.row_bytes))
    }
}

/// Byte offsets and strides of a block, derived from a [`CacheConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// The configuration this layout was computed from.
    pub config: CacheConfig,
    /// Key codes.
    pub k_codes: Region,
    /// Key metadata (INT4 scales; `int4-kc`: the sealed block's `s` and `z`, row_bytes 0).
    pub k_meta: Region,
    /// `int4-kc` only: the f16 rows of a block that is not sealed yet, over the K part (offset
    /// `k_codes.offset`, `2 × head_dim` bytes a row); absent (row_bytes 0) otherwise.
    pub k_window: Region,
    /// Value codes.
    pub v_codes: Region,
    /// Value metadata (INT4 scales / zeros).
    pub v_meta: Region,
    /// Bytes of one head section (a multiple of 16).
    pub head_stride: usize,
    /// Bytes of one block: `head_stride * num_kv_heads`.
    pub block_stride: usize,
}

/// Round up to a multiple of 16 bytes (saturating: only an unvalidated config gets near it).
const fn align16(n: usize) -> usize {
    n.div_ceil(16).saturating_mul(16)
}

impl BlockLayout {
    /// The layout of `c`, with every size product formed by `mul` (checked, or saturating for
    /// [`CacheConfig::layout`] of an invalid config). Sums cannot overflow: `mul` keeps each
    /// region below `MAX_REGION_BYTES` or saturates, and saturating adds are used throughout.
    fn build<E>(
        c: &CacheConfig,
        mul: impl Fn(usize, usize, &'static str) -> Result<usize, E>,
    ) -> Result<Self, E> {
        let (d, bs) = (c.head_dim, c.block_size);
        let row_bytes = |f: KvFormat| -> Result<usize, E> {
            // code_bytes saturates; the product names the overflow instead.
            mul(d, f.bits() as usize, "row code bits (head_dim × bits)")?;
            Ok(f.code_bytes(d))
        };
        let rows = [
            row_bytes(c.k_format)?,
            c.k_format.meta_bytes(d),
            row_bytes(c.v_format)?,
            c.v_format.meta_bytes(d),
        ];
        let mut at = 0usize;
        let mut regions = [Region::default(); 4];
        let mut k_window = Region::default();
        for (i, (r, row_bytes)) in regions.iter_mut().zip(rows).enumerate() {
            *r = Region {
                offset: at,
                row_bytes,
            };
            let bytes = mul(row_bytes, bs, "region bytes (row bytes × block_size)")?;
            at = at.saturating_add(align16(bytes));
            if i == 1 && c.k_format.block_groups() {
                // The sealed block's s and z follow its codes (whole 16-byte units: head_dim is
                // a multiple of 32), and the f16 window spans the K part, which it outgrows.
                let window = mul(
                    mul(d, 2, "int4-kc window row (2 × head_dim)")?,
                    bs,
                    "region bytes (row bytes × block_size)",
                )?;
                k_window = Region {
                    offset: 0,
                    row_bytes: d.saturating_mul(2),
                };
                at = at
                    .saturating_add(align16(c.k_format.block_meta_bytes(d)))
                    .max(align16(window));
            }
        }
        let [k_codes, k_meta, v_codes, v_meta] = regions;
        let head_stride = at;
        let block_stride = mul(
            head_stride,
            c.num_kv_heads,
            "block bytes (head_stride × num_kv_heads)",
        )?;
        Ok(BlockLayout {
            config: *c,
            k_codes,
            k_meta,
            k_window,
            v_codes,
            v_meta,
            head_stride,
            block_stride,
        })
    }

    /// Whether position `pos` of a sequence of `len` tokens lies in a sealed `int4-kc` block
    /// (its block full: `(pos / block_size + 1) × block_size ≤ len`); always true for the
    /// other key formats, whose rows are quantized as they are appended.
    pub const fn sealed(&self, pos: usize, len: usize) -> bool {
        let bs = self.config.block_size;
        !self.config.k_format.block_groups()
            || (bs > 0 && (pos / bs).saturating_add(1).saturating_mul(bs) <= len)
    }

    /// Byte offset in the pool of the head section of (`block`, `kv_head`). Saturates at
    /// `usize::MAX` for positions no pool can hold (a pool's own blocks never get there).
    pub const fn head_section(&self, block: usize, kv_head: usize) -> usize {
        block
            .saturating_mul(self.block_stride)
            .saturating_add(kv_head.saturating_mul(self.head_stride))
    }

    /// Pool bytes for `num_blocks` blocks (saturating at `usize::MAX`; see
    /// [`try_pool_bytes`](Self::try_pool_bytes)).
    pub const fn pool_bytes(&self, num_blocks: usize) -> usize {
        self.block_stride.saturating_mul(num_blocks)
    }

    /// Pool bytes for `num_blocks` blocks, or [`Error::Overflow`] beyond `isize::MAX`.
    pub fn try_pool_bytes(&self, num_blocks: usize) -> Result<usize> {
        self.block_stride
            .checked_mul(num_blocks)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(Error::Overflow {
                what: "pool bytes (block_stride × num_blocks)",
                lhs: self.block_stride,
                rhs: num_blocks,
            })
    }

    /// Split a slot into (block, offset in block). For a layout whose `block_size` is 0 (an
    /// unvalidated config) every slot maps to block `usize::MAX`, which no pool holds.
    pub const fn split_slot(&self, slot: usize) -> (usize, usize) {
        match (
            slot.checked_div(self.config.block_size),
            slot.checked_rem(self.config.block_size),
        ) {
            (Some(block), Some(off)) => (block, off),
            _ => (usize::MAX, 0),
        }
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
            for v in KvFormat::ALL.into_iter().filter(|v| !v.block_groups()) {
                for bs in [1, 3, 16, 32, 64] {
                    if k.check_block_size(bs).is_err() {
                        continue;
                    }
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
    fn size_products_that_overflow_are_errors() {
        use KvFormat::*;
        let err = |h, d, bs, k, v| CacheConfig::new(h, d, bs, k, v).unwrap_err();
        let huge_d = usize::MAX / 64 * 64; // a multiple of every group and vector width
        assert!(matches!(
            err(1, huge_d, 16, F16, F16),
            Error::Overflow { what, .. } if what.starts_with("row code bits")
        ));
        assert!(matches!(
            err(1, 1 << 58, 1024, Int4Sym32, Int4Sym32),
            Error::Overflow { what, .. } if what.starts_with("region bytes")
        ));
        assert!(matches!(
            err(usize::MAX, 128, 16, Fp8E4m3, Fp8E4m3),
            Error::Overflow { what, .. } if what.starts_with("block bytes")
        ));
        // An unvalidated literal still gets a layout, saturated rather than wrapped.
        let c = CacheConfig {
            num_kv_heads: usize::MAX,
            head_dim: huge_d,
            block_size: 16,
            k_format: F16,
            v_format: Int4Affine64,
        };
        let l = c.layout();
        assert_eq!(l.block_stride, usize::MAX);
        assert_eq!(l.head_section(3, 3), usize::MAX);
        assert!(c.try_layout().is_err());
        assert!(l.try_pool_bytes(2).is_err());
        let l = CacheConfig { block_size: 0, ..c }.layout();
        assert_eq!(l.split_slot(5), (usize::MAX, 0));
    }

    #[test]
    fn int4_kc_keys_seal_in_their_window() {
        let c = CacheConfig::new(2, 128, 32, KvFormat::Int4Kc, KvFormat::Int4Affine64).unwrap();
        let l = c.layout();
        let row = |offset, row_bytes| Region { offset, row_bytes };
        assert_eq!(l.k_window, row(0, 256));
        assert_eq!(l.k_codes, row(0, 64));
        assert_eq!(l.k_meta, row(32 * 64, 0));
        // the sealed block (codes, then s and z) lies inside the window, V after it
        assert!(l.k_meta.offset + 4 * 128 <= 32 * 256);
        assert_eq!(l.v_codes, row(32 * 256, 64));
        assert_eq!(l.head_stride, 32 * 256 + 32 * 64 + 32 * 8);
        assert!(l.sealed(31, 32) && !l.sealed(32, 63) && l.sealed(32, 64) && !l.sealed(0, 31));
        let k32 = CacheConfig::new(2, 128, 32, KvFormat::Int4Sym32, KvFormat::F16).unwrap();
        assert!(k32.layout().sealed(5, 6));
        assert_eq!(k32.layout().k_window, Region::default());
        assert!(matches!(
            CacheConfig::new(2, 128, 32, KvFormat::F16, KvFormat::Int4Kc),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            CacheConfig::new(2, 128, 8, KvFormat::Int4Kc, KvFormat::F16),
            Err(Error::Config { what, .. }) if what.starts_with("int4-kc group")
        ));
        assert!(CacheConfig::new(2, 48, 16, KvFormat::Int4Kc, KvFormat::F16).is_err());
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
