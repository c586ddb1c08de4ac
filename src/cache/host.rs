//! [`HostCache`]: the quantized KV storage of one layer in host memory, laid out exactly as on
//! the device ([`BlockLayout`]), so it can be uploaded as is and read back byte for byte.

use super::allocator::CopyBlock;
use super::copies::check_copies;
use super::tables::check_row;
use crate::error::{Error, Result, filled};
use crate::format::int4;
use crate::format::int4_kc::{self, KcShape, Mode};
use crate::format::sanitize::F16_MAX;
use crate::format::{Element, HeadScale, KvFormat, ScaleGranularity, head_amax};
use crate::layout::{BlockLayout, CacheConfig, Region};
use half::f16;

/// Byte a new pool is filled with, so that tests can tell unwritten slots from written ones.
/// As f16/bf16 it is a finite negative number, as FP8 a finite negative code, as INT4 codes
/// 5 and -6 (0xA5 nibbles), so reading poison never produces NaN by itself.
pub const POISON: u8 = 0xA5;

/// Which half of a head section a row belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    K,
    V,
}

/// Quantized K/V storage of one layer: a pool of `num_blocks` blocks plus the per-KV-head scales
/// of FP8 (`s`) and FP4 (`g`) (1.0 until set; ignored by the other formats).
///
/// Set those scales ([`set_scales`](Self::set_scales), or
/// [`calibrate_fp8_scales`](Self::calibrate_fp8_scales), which sets FP4's `g` too) before the
/// first write: under 1.0 an FP8 side saturates at its largest finite value (448 for E4M3)
/// and FP4 at 2688, as FORMATS.md's encoders do, without an error.
#[derive(Debug, Clone)]
pub struct HostCache {
    layout: BlockLayout,
    num_blocks: usize,
    pool: Vec<u8>,
    k_scales: Vec<f32>,
    v_scales: Vec<f32>,
}

/// Check head scales for `config`'s sides as [`HostCache::set_scales`] takes them: per side
/// `num_kv_heads` values, positive and finite, or none (`&[]`) for a side whose format has no
/// head scale. Returns, per side (K, V), whether values were given.
pub(crate) fn check_head_scales(config: &CacheConfig, k: &[f32], v: &[f32]) -> Result<[bool; 2]> {
    let heads = config.num_kv_heads;
    let mut given = [false; 2];
    for (i, (what, format, s)) in [
        ("k_scales", config.k_format, k),
        ("v_scales", config.v_format, v),
    ]
    .into_iter()
    .enumerate()
    {
        if s.is_empty() && format.head_scale().is_none() {
            continue;
        }
        if s.len() != heads {
            return Err(Error::Length {
                what,
                expected: heads,
                actual: s.len(),
            });
        }
        if let Some(&bad) = s.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
            return Err(Error::Scale { what, value: bad });
        }
        given[i] = true;
    }
    Ok(given)
}

impl HostCache {
    /// An all-[`POISON`] pool of `num_blocks` blocks for `config`. Errors: an invalid config
    /// (including layouts whose sizes overflow), `num_blocks` outside `1..=i32::MAX`, slots
    /// (`num_blocks × block_size`) or pool bytes beyond what can be addressed
    /// ([`Error::Overflow`]), and a pool the system cannot allocate ([`Error::Alloc`]).
    pub fn new(config: CacheConfig, num_blocks: usize) -> Result<Self> {
        let layout = config.try_layout()?;
        if num_blocks == 0 || num_blocks > i32::MAX as usize {
            return Err(Error::Config {
                what: "num_blocks",
                value: num_blocks,
                expected: "1..=i32::MAX",
            });
        }
        if num_blocks.checked_mul(config.block_size).is_none() {
            return Err(Error::Overflow {
                what: "slots (num_blocks × block_size)",
                lhs: num_blocks,
                rhs: config.block_size,
            });
        }
        let bytes = layout.try_pool_bytes(num_blocks)?;
        Ok(HostCache {
            layout,
            num_blocks,
            pool: filled(bytes, POISON, "cache pool")?,
            k_scales: filled(config.num_kv_heads, 1.0, "FP8 key scales")?,
            v_scales: filled(config.num_kv_heads, 1.0, "FP8 value scales")?,
        })
    }

    /// The configuration this cache was built for.
    pub fn config(&self) -> &CacheConfig {
        &self.layout.config
    }

    /// Byte layout of a block.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Token slots in the pool (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.config.block_size
    }

    /// The raw pool, `layout().pool_bytes(num_blocks())` bytes.
    pub fn pool(&self) -> &[u8] {
        &self.pool
    }

    /// The raw pool, writable (e.g. to copy a device pool back).
    pub fn pool_mut(&mut self) -> &mut [u8] {
        &mut self.pool
    }

    /// Key head scales (FP8 `s`, FP4 `g`), one per KV head.
    pub fn k_scales(&self) -> &[f32] {
        &self.k_scales
    }

    /// Value head scales (FP8 `s`, FP4 `g`), one per KV head.
    pub fn v_scales(&self) -> &[f32] {
        &self.v_scales
    }

    /// Set the head scales of FP8 and FP4 sides (`num_kv_heads` each, positive and finite). Rows
    /// already written keep the codes they were quantized with, so set scales before writing. A
    /// side whose format has no head scale (16-bit, INT4, INT8) may take `&[]` and keeps its
    /// scales (1.0), or `num_kv_heads` values, checked and then unused: `set_scales(&k, &[])`
    /// for FP8 keys over INT4 values.
    pub fn set_scales(&mut self, k: &[f32], v: &[f32]) -> Result<()> {
        let [set_k, set_v] = check_head_scales(&self.layout.config, k, v)?;
        if set_k {
            self.k_scales.copy_from_slice(k);
        }
        if set_v {
            self.v_scales.copy_from_slice(v);
        }
        Ok(())
    }

    /// Set the head scales from sample data `k`, `v` laid out `[tokens, num_kv_heads, head_dim]`,
    /// over the sanitized samples (FORMATS.md): an FP8 side gets `s = amax / max_finite` per
    /// tensor or per KV head as `granularity` says; an FP4 side its global scales
    /// `g = amax / 2688` per KV head whatever `granularity` says (FORMATS.md defines `g` per
    /// head); both 1.0 when amax is 0. A side without a head scale keeps 1.0. (The name is
    /// FP8's, the first format with a head scale; FP4's are set here too.)
    pub fn calibrate_fp8_scales<T: Element>(
        &mut self,
        k: &[T],
        v: &[T],
        granularity: ScaleGranularity,
    ) -> Result<()> {
        let c = self.layout.config;
        let row = c.num_kv_heads * c.head_dim;
        let mut scales = [vec![1.0f32; c.num_kv_heads], vec![1.0f32; c.num_kv_heads]];
        for ((what, x, format), out) in [("k samples", k, c.k_format), ("v samples", v, c.v_format)]
            .into_iter()
            .zip(&mut scales)
        {
            if x.len() % row != 0 {
                return Err(Error::Length {
                    what,
                    expected: x.len().div_ceil(row) * row,
                    actual: x.len(),
                });
            }
            let Some(head_scale) = format.head_scale() else {
                continue;
            };
            let mut amax = head_amax(x, c.num_kv_heads, c.head_dim)?;
            if granularity == ScaleGranularity::PerTensor && head_scale != HeadScale::Fp4 {
                let all = amax.iter().copied().fold(0.0, f32::max);
                amax.fill(all);
            }
            for (s, a) in out.iter_mut().zip(amax) {
                *s = head_scale.scale_from_amax(a);
            }
        }
        let [ks, vs] = scales;
        self.set_scales(&ks, &vs)
    }

    /// Check that `slot` is in the pool and split it into (block, offset in block).
    fn check_slot(&self, slot: usize) -> Result<(usize, usize)> {
        let (block, off) = self.layout.split_slot(slot);
        if block >= self.num_blocks {
            return Err(Error::BlockIndex {
                block,
                num_blocks: self.num_blocks,
            });
        }
        Ok((block, off))
    }

    fn check_head(&self, head: usize) -> Result<()> {
        let heads = self.layout.config.num_kv_heads;
        if head >= heads {
            return Err(Error::InvalidArgument(format!(
                "kv head {head} is out of range for {heads} kv heads"
            )));
        }
        Ok(())
    }

    /// Elements of `tokens` dense `[tokens, num_kv_heads, head_dim]` rows, checked.
    fn elements(&self, what: &'static str, tokens: usize) -> Result<usize> {
        // num_kv_heads × head_dim fits: the validated layout holds that many codes per token.
        let row = self.layout.config.num_kv_heads * self.layout.config.head_dim;
        tokens.checked_mul(row).ok_or(Error::Overflow {
            what,
            lhs: tokens,
            rhs: row,
        })
    }

    fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
        if expected != actual {
            return Err(Error::Length {
                what,
                expected,
                actual,
            });
        }
        Ok(())
    }

    fn side(&self, side: Side) -> (KvFormat, Region, Region, &[f32]) {
        let (l, c) = (&self.layout, &self.layout.config);
        match side {
            Side::K => (c.k_format, l.k_codes, l.k_meta, &self.k_scales),
            Side::V => (c.v_format, l.v_codes, l.v_meta, &self.v_scales),
        }
    }

    /// Quantize `[tokens, num_kv_heads, head_dim]` keys and values into `slots` (one per
    /// token), row by row with [`KvFormat::encode_row`]. Returns the number of non-finite
    /// inputs met (they are sanitized, FORMATS.md). Everything is validated before any byte is
    /// written; a slot outside the pool is [`Error::BlockIndex`]. If a slot repeats, the last
    /// token written to it wins.
    ///
    /// `int4-kc` keys go to their block's f16 window; once every row is written, each block
    /// whose last slot this call wrote is sealed (quantized in place from its window), so a
    /// sequence's tokens must be appended in order, its block's last one last.
    pub fn write<T: Element>(&mut self, slots: &[usize], k: &[T], v: &[T]) -> Result<u64> {
        self.check_write(slots, k, v)?;
        let c = self.layout.config;
        let (heads, d) = (c.num_kv_heads, c.head_dim);
        let mut non_finite = 0;
        for (t, &slot) in slots.iter().enumerate() {
            let (block, off) = self.layout.split_slot(slot);
            for (side, x) in [(Side::K, k), (Side::V, v)] {
                for h in 0..heads {
                    let row = &x[(t * heads + h) * d..][..d];
                    non_finite += self.encode_row(side, block, off, h, row)?;
                }
            }
        }
        if c.k_format.block_groups() {
            for &slot in slots {
                let (block, off) = self.layout.split_slot(slot);
                if off + 1 == c.block_size {
                    for h in 0..heads {
                        self.seal(block, h)?;
                    }
                }
            }
        }
        Ok(non_finite)
    }

    /// Quantize the `int4-kc` keys of (`block`, `head`) in place from their f16 window: codes
    /// over the window's first rows, then `s` and `z` (FORMATS.md, "INT4 keys per channel").
    fn seal(&mut self, block: usize, head: usize) -> Result<()> {
        let l = self.layout;
        let (bs, d) = (l.config.block_size, l.config.head_dim);
        let section = l.head_section(block, head);
        let window: Vec<f16> = self.pool[section + l.k_window.offset..][..bs * 2 * d]
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        let q = int4_kc::quantize(&window, KcShape::new(bs, 1, d, bs)?, Mode::Paged)?;
        let codes = &mut self.pool[section + l.k_codes.offset..][..bs * d / 2];
        codes.copy_from_slice(q.codes());
        let meta = &mut self.pool[section + l.k_meta.offset..][..4 * d];
        for (m, v) in meta
            .chunks_exact_mut(2)
            .zip(q.scales().iter().chain(q.zeros()))
        {
            m.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// Like [`write`](Self::write), but an input the cache would not hold as given is an error
    /// and then nothing is written: non-finite values ([`Error::NonFinite`]), and finite ones
    /// past f16's range or past an FP8 / FP4 side's head scale times its largest code, which
    /// `write` saturates ([`Error::Saturated`]: the scales want calibrating, e.g.
    /// [`calibrate_fp8_scales`](Self::calibrate_fp8_scales)).
    pub fn write_strict<T: Element>(&mut self, slots: &[usize], k: &[T], v: &[T]) -> Result<()> {
        self.check_write(slots, k, v)?;
        let count = k
            .iter()
            .chain(v)
            .filter(|x| !x.to_f32().is_finite())
            .count() as u64;
        if count > 0 {
            return Err(Error::NonFinite {
                what: "kv cache write",
                count,
            });
        }
        let d = self.layout.config.head_dim;
        let mut saturated = 0u64;
        for (side, x) in [(Side::K, k), (Side::V, v)] {
            let (format, _, _, scales) = self.side(side);
            let head_scale = format.head_scale();
            // Row r of [tokens, heads, d] belongs to head r % heads.
            for (row, head) in x.chunks_exact(d).zip(scales.iter().cycle()) {
                let limit = head_scale.map_or(F16_MAX, |h| (h.max_value() * head).min(F16_MAX));
                saturated += row.iter().filter(|e| e.to_f32().abs() > limit).count() as u64;
            }
        }
        if saturated > 0 {
            return Err(Error::Saturated {
                what: "kv cache write",
                count: saturated,
            });
        }
        self.write(slots, k, v).map(|_| ())
    }

    fn check_write<T>(&self, slots: &[usize], k: &[T], v: &[T]) -> Result<()> {
        let expected = self.elements("k/v elements (tokens × kv_heads·head_dim)", slots.len())?;
        Self::check_len("k ([tokens, kv_heads, head_dim])", expected, k.len())?;
        Self::check_len("v ([tokens, kv_heads, head_dim])", expected, v.len())?;
        for &s in slots {
            self.check_slot(s)?;
        }
        Ok(())
    }

    /// Quantize one row into (block, off, head); returns its non-finite count. The position
    /// must be in the pool (checked by the caller); the row itself is checked by the format.
    fn encode_row<T: Element>(
        &mut self,
        side: Side,
        block: usize,
        off: usize,
        head: usize,
        x: &[T],
    ) -> Result<u64> {
        let (format, codes_r, meta_r, scales) = self.side(side);
        let section = self.layout.head_section(block, head);
        if side == Side::K && format.block_groups() {
            // The window row: the f16 of the sanitized inputs.
            let window = &mut self.pool[section + self.layout.k_window.row(off)..];
            return KvFormat::F16.try_encode_row(x, 1.0, &mut window[..2 * x.len()], &mut []);
        }
        let scale = scales[head];
        let codes_at = section + codes_r.row(off);
        let meta_at = section + meta_r.row(off);
        // Metadata regions follow their codes region, so one split gives both rows.
        let (lo, hi) = self.pool.split_at_mut(meta_at);
        let codes = &mut lo[codes_at..][..codes_r.row_bytes];
        let meta = &mut hi[..meta_r.row_bytes];
        format.try_encode_row(x, scale, codes, meta)
    }

    /// Dequantize the key row of (block, off, head) into `out` (`head_dim` values); `sealed`
    /// says whether an `int4-kc` block is sealed ([`BlockLayout::sealed`]; other formats ignore
    /// it). Unchecked (an out-of-range index panics): for the attention reference's inner loop,
    /// whose inputs were validated once up front.
    pub(crate) fn decode_k_at(
        &self,
        block: usize,
        off: usize,
        head: usize,
        sealed: bool,
        out: &mut [f32],
    ) {
        let l = &self.layout;
        if !l.config.k_format.block_groups() {
            return self.decode_at(Side::K, block, off, head, out);
        }
        let section = l.head_section(block, head);
        if !sealed {
            let row = &self.pool[section + l.k_window.row(off)..][..l.k_window.row_bytes];
            return KvFormat::F16.decode_row(row, &[], 1.0, out);
        }
        let d = l.config.head_dim;
        let codes = &self.pool[section + l.k_codes.row(off)..][..d / 2];
        let meta = &self.pool[section + l.k_meta.offset..][..4 * d];
        let f16_at = |i: usize| f16::from_le_bytes([meta[2 * i], meta[2 * i + 1]]);
        for (j, o) in out.iter_mut().enumerate() {
            *o = int4::dequantize_affine(int4::nibble(codes, j), f16_at(j), f16_at(d + j));
        }
    }

    /// The value-row counterpart of [`decode_k_at`](Self::decode_k_at).
    pub(crate) fn decode_v_at(&self, block: usize, off: usize, head: usize, out: &mut [f32]) {
        self.decode_at(Side::V, block, off, head, out);
    }

    fn decode_at(&self, side: Side, block: usize, off: usize, head: usize, out: &mut [f32]) {
        let (format, codes_r, meta_r, scales) = self.side(side);
        let section = self.layout.head_section(block, head);
        let codes = &self.pool[section + codes_r.row(off)..][..codes_r.row_bytes];
        let meta = &self.pool[section + meta_r.row(off)..][..meta_r.row_bytes];
        format.decode_row(codes, meta, scales[head], out);
    }

    fn read(&self, side: Side, slot: usize, head: usize, out: &mut [f32]) -> Result<()> {
        if side == Side::K && self.layout.config.k_format.block_groups() {
            return Err(Error::Unsupported(format!(
                "a slot of {} keys is f16 or quantized as its sequence's length says: read \
                 them with gather",
                self.layout.config.k_format
            )));
        }
        let (block, off) = self.check_slot(slot)?;
        self.check_head(head)?;
        Self::check_len("row (head_dim)", self.layout.config.head_dim, out.len())?;
        self.decode_at(side, block, off, head, out);
        check_finite("cache row read back", out)
    }

    /// Dequantize the key row of (`slot`, `head`) into `out` (`head_dim` values), exactly.
    /// Not for `int4-kc` keys ([`Error::Unsupported`]): whether their block is sealed depends
    /// on the sequence's length, which [`gather`](Self::gather) takes.
    /// A row that decodes to a non-finite value (bytes written through
    /// [`pool_mut`](Self::pool_mut), or FP8 scales so large that `max_finite × scale`
    /// overflows) is an [`Error::NonFinite`], with `out` already written.
    pub fn read_k(&self, slot: usize, head: usize, out: &mut [f32]) -> Result<()> {
        self.read(Side::K, slot, head, out)
    }

    /// Dequantize the value row of (`slot`, `head`) into `out` (`head_dim` values), exactly;
    /// errors as for [`read_k`](Self::read_k).
    pub fn read_v(&self, slot: usize, head: usize, out: &mut [f32]) -> Result<()> {
        self.read(Side::V, slot, head, out)
    }

    /// Copy block `src` over block `dst`, every head, K and V (a no-op when equal).
    pub fn copy_block(&mut self, src: usize, dst: usize) -> Result<()> {
        for block in [src, dst] {
            if block >= self.num_blocks {
                return Err(Error::BlockIndex {
                    block,
                    num_blocks: self.num_blocks,
                });
            }
        }
        let n = self.layout.block_stride;
        self.pool.copy_within(src * n..(src + 1) * n, dst * n);
        Ok(())
    }

    /// Apply block copies (a reservation's copy-on-write copies, or any list), in order: the
    /// rules `DeviceCache::copy_blocks` follows too. `src == dst` is a no-op, a chain
    /// (`a → b`, then `b → c`) passes `a`'s bytes on, and the later of two copies into one
    /// block wins. Every id is checked first ([`Error::BlockIndex`]); then nothing is copied.
    pub fn apply_copies(&mut self, copies: &[CopyBlock]) -> Result<()> {
        check_copies(copies, self.num_blocks)?;
        for c in copies {
            self.copy_block(c.src, c.dst)?;
        }
        Ok(())
    }

    /// Dequantize the first `len` tokens of the sequence whose blocks are `block_table` into
    /// dense `[len, num_kv_heads, head_dim]` keys and values. Non-finite values read back are
    /// an error, as for [`read_k`](Self::read_k). With `int4-kc` keys `len` must be the
    /// sequence's whole length: it says which blocks are sealed ([`BlockLayout::sealed`]).
    pub fn gather(
        &self,
        block_table: &[i32],
        len: usize,
        out_k: &mut [f32],
        out_v: &mut [f32],
    ) -> Result<()> {
        let c = &self.layout.config;
        let (heads, d, bs) = (c.num_kv_heads, c.head_dim, c.block_size);
        let expected = self.elements("gathered elements (len × kv_heads·head_dim)", len)?;
        Self::check_len("out_k ([len, kv_heads, head_dim])", expected, out_k.len())?;
        Self::check_len("out_v ([len, kv_heads, head_dim])", expected, out_v.len())?;
        check_row(block_table, None, len, bs, self.num_blocks)?;
        for p in 0..len {
            let block = block_table[p / bs] as usize;
            let sealed = self.layout.sealed(p, len);
            for h in 0..heads {
                let at = (p * heads + h) * d;
                self.decode_k_at(block, p % bs, h, sealed, &mut out_k[at..at + d]);
                self.decode_v_at(block, p % bs, h, &mut out_v[at..at + d]);
            }
        }
        check_finite("gathered k", out_k)?;
        check_finite("gathered v", out_v)
    }
}

/// A cache never holds a non-finite value (FORMATS.md), so one read back means corrupt bytes
/// or an overflowing FP8 scale: an error rather than data.
fn check_finite(what: &'static str, x: &[f32]) -> Result<()> {
    let count = x.iter().filter(|v| !v.is_finite()).count() as u64;
    if count > 0 {
        return Err(Error::NonFinite { what, count });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_and_poison() {
        let c = CacheConfig::new(2, 64, 4, KvFormat::F16, KvFormat::Int4Affine64).unwrap();
        let mut cache = HostCache::new(c, 3).unwrap();
        assert!(cache.pool().iter().all(|&b| b == POISON));
        let k: Vec<f32> = (0..2 * 64).map(|i| i as f32 * 0.25).collect();
        let v: Vec<f32> = (0..2 * 64).map(|i| -(i as f32)).collect();
        assert_eq!(cache.write(&[9], &k, &v).unwrap(), 0);
        let mut row = vec![0f32; 64];
        cache.read_k(9, 1, &mut row).unwrap();
        assert_eq!(row, k[64..]);
        assert!(matches!(
            cache.write(&[12], &k, &v),
            Err(Error::BlockIndex { block: 3, .. })
        ));
        assert!(matches!(
            cache.read_v(0, 2, &mut row),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn strict_write_rejects_non_finite_and_writes_nothing() {
        let c = CacheConfig::new(1, 16, 4, KvFormat::Fp8E4m3, KvFormat::Fp8E4m3).unwrap();
        let mut cache = HostCache::new(c, 1).unwrap();
        let mut k = vec![1.0f32; 16];
        k[3] = f32::NAN;
        let v = vec![1.0f32; 16];
        assert_eq!(
            cache.write_strict(&[0], &k, &v),
            Err(Error::NonFinite {
                what: "kv cache write",
                count: 1
            })
        );
        assert!(cache.pool().iter().all(|&b| b == POISON));
        assert_eq!(cache.write(&[0], &k, &v).unwrap(), 1);
    }

    #[test]
    fn strict_write_rejects_what_would_saturate() {
        // FP8 keys at their default scale 1.0 hold up to 448; INT4 values up to f16's range.
        let c = CacheConfig::new(2, 64, 4, KvFormat::Fp8E4m3, KvFormat::Int4Affine64).unwrap();
        let mut cache = HostCache::new(c, 1).unwrap();
        let (mut k, mut v) = (vec![1.0f32; 128], vec![1.0f32; 128]);
        k[70] = 1000.0; // head 1
        v[3] = 7e4;
        assert_eq!(
            cache.write_strict(&[0], &k, &v),
            Err(Error::Saturated {
                what: "kv cache write",
                count: 2
            })
        );
        assert!(cache.pool().iter().all(|&b| b == POISON));
        // Head 1's scale raised past 1000 / 448: only the value is left.
        cache.set_scales(&[1.0, 4.0], &[1.0, 1.0]).unwrap();
        assert!(matches!(
            cache.write_strict(&[0], &k, &v),
            Err(Error::Saturated { count: 1, .. })
        ));
        v[3] = 6e4;
        cache.write_strict(&[0], &k, &v).unwrap();
        // Plain writes saturate instead.
        k[70] = 1e6;
        assert_eq!(cache.write(&[0], &k, &v).unwrap(), 0);
    }
}
