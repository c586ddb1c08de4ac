//! [`PagedKvCache`]: a model's whole host KV cache, one allocator plus one [`HostCache`] per
//! layer, so appending a token applies copy-on-write to every layer at once.

use super::allocator::{BlockAllocator, SeqId};
use super::host::HostCache;
use super::tables::BlockTables;
use crate::error::{Error, Result, at_least_one, reserved};
use crate::format::Element;
use crate::layout::CacheConfig;

/// Every layer's KV cache of a model, sharing one block allocator.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    allocator: BlockAllocator,
    /// What every layer was built with: layers are checked against it, not against each other,
    /// so a layer 0 swapped through `layers_mut` cannot redefine the rule.
    config: CacheConfig,
    layers: Vec<HostCache>,
}

impl PagedKvCache {
    /// `num_layers` caches of `num_blocks` blocks each, all with `config`.
    pub fn new(config: CacheConfig, num_layers: usize, num_blocks: usize) -> Result<Self> {
        at_least_one(&[("num_layers", num_layers)])?;
        let allocator = BlockAllocator::new(num_blocks, config.block_size)?;
        // All layers' pools together must be addressable too (each is checked on its own).
        let layer_bytes = config.try_layout()?.try_pool_bytes(num_blocks)?;
        layer_bytes
            .checked_mul(num_layers)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(Error::Overflow {
                what: "pool bytes of every layer (layer pool bytes × num_layers)",
                lhs: layer_bytes,
                rhs: num_layers,
            })?;
        let mut layers = reserved(num_layers, "layer list")?;
        for _ in 0..num_layers {
            layers.push(HostCache::new(config, num_blocks)?);
        }
        Ok(PagedKvCache {
            allocator,
            config,
            layers,
        })
    }

    /// The configuration every layer has.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The shared allocator.
    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }

    /// Every layer's storage.
    pub fn layers(&self) -> &[HostCache] {
        &self.layers
    }

    /// Every layer's storage, writable (e.g. to set FP8 scales per layer). A layer replaced
    /// through it must keep the configuration ([`config`](Self::config)) and block count:
    /// [`append`](Self::append) refuses layers that differ ([`Error::LayerMismatch`]) before
    /// anything changes.
    pub fn layers_mut(&mut self) -> &mut [HostCache] {
        &mut self.layers
    }

    /// Start an empty sequence.
    pub fn create_sequence(&mut self) -> SeqId {
        self.allocator.create_sequence()
    }

    /// A sequence sharing `seq`'s tokens (copy-on-write).
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        self.allocator.fork(seq)
    }

    /// Release `seq`.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.allocator.free(seq)
    }

    /// Shorten `seq` to `new_len` tokens (speculative decoding's rollback; see
    /// [`BlockAllocator::truncate`]). Storage is not touched: the dropped tokens' slots are
    /// overwritten by the next append, and shared blocks are copied first.
    ///
    /// With `int4-kc` keys a sealed block has no f16 rows left to reopen: truncating into one
    /// (below the last multiple of `block_size` at or under the current length) is
    /// [`Error::Unsupported`] and changes nothing.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        let c = self.config;
        let len = self.allocator.len(seq)?;
        // The new last token's block is sealed: its f16 rows are gone.
        if c.k_format.block_groups() && c.layout().sealed(new_len, len) {
            return Err(Error::Unsupported(format!(
                "truncating {len} tokens to {new_len} would reopen a sealed {} block",
                c.k_format
            )));
        }
        self.allocator.truncate(seq, new_len)
    }

    /// Tokens in `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        self.allocator.len(seq)
    }

    /// Block tables of `seqs` (the same for every layer).
    pub fn block_tables(&self, seqs: &[SeqId]) -> Result<BlockTables> {
        self.allocator.block_tables(seqs)
    }

    /// Append tokens to `seq`: `k[layer]` and `v[layer]` are `[n, num_kv_heads, head_dim]` for
    /// the same `n` in every layer. Reserves slots, applies copy-on-write copies to every layer,
    /// then quantizes. Returns the non-finite input count over all layers. Shapes are checked
    /// before anything changes.
    pub fn append<T: Element>(&mut self, seq: SeqId, k: &[&[T]], v: &[&[T]]) -> Result<u64> {
        let layers = self.layers.len();
        for (what, x) in [("k layers", k.len()), ("v layers", v.len())] {
            if x != layers {
                return Err(Error::Length {
                    what,
                    expected: layers,
                    actual: x,
                });
            }
        }
        self.check_layers()?;
        let c = self.config;
        // Fits: the validated layout holds num_kv_heads × head_dim codes per token.
        let row = c.num_kv_heads * c.head_dim;
        if let Some(x) = k.iter().chain(v).find(|x| x.len() % row != 0) {
            return Err(Error::InvalidArgument(format!(
                "per-layer k/v hold [n, num_kv_heads, head_dim] = [n, {}, {}]: {} elements are \
                 not a whole number of tokens of {row}",
                c.num_kv_heads,
                c.head_dim,
                x.len()
            )));
        }
        let n = k.first().map_or(0, |x| x.len() / row);
        for x in k.iter().chain(v) {
            if x.len() != n * row {
                return Err(Error::Length {
                    what: "per-layer k/v ([n, kv_heads, head_dim], same n in every layer)",
                    expected: n * row,
                    actual: x.len(),
                });
            }
        }
        let r = self.allocator.reserve(seq, n)?;
        let mut non_finite = 0;
        for ((cache, k), v) in self.layers.iter_mut().zip(k).zip(v) {
            cache.apply_copies(&r.copies)?;
            non_finite += cache.write(&r.slots, k, v)?;
        }
        Ok(non_finite)
    }

    /// Every layer against the cache's configuration and the allocator's block count: a layer
    /// of another block size would take the allocator's slots for other positions.
    fn check_layers(&self) -> Result<()> {
        let blocks = self.allocator.num_blocks();
        for (layer, l) in self.layers.iter().enumerate() {
            let mismatch = |what, expected: String, actual: String| Error::LayerMismatch {
                layer,
                what,
                expected,
                actual,
            };
            if l.num_blocks() != blocks {
                let (e, a) = (blocks.to_string(), l.num_blocks().to_string());
                return Err(mismatch("num_blocks", e, a));
            }
            if *l.config() != self.config {
                let (e, a) = (format!("{:?}", self.config), format!("{:?}", l.config()));
                return Err(mismatch("config", e, a));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvFormat;

    #[test]
    fn append_names_the_token_size_a_partial_token_misses() {
        let c = CacheConfig::new(2, 64, 4, KvFormat::F16, KvFormat::F16).unwrap();
        let mut p = PagedKvCache::new(c, 1, 8).unwrap();
        let s = p.create_sequence();
        let x = [1.0f32; 5];
        let err = p.append(s, &[&x[..]], &[&x[..]]).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(
            text.contains("[n, 2, 64]") && text.contains("5 elements"),
            "{text}"
        );
        assert!(text.contains("whole number of tokens of 128"), "{text}");
        assert_eq!(p.len(s).unwrap(), 0);
    }

    #[test]
    fn append_refuses_a_layer_of_another_block_size() {
        let c = CacheConfig::new(1, 64, 4, KvFormat::F16, KvFormat::F16).unwrap();
        let mut p = PagedKvCache::new(c, 2, 8).unwrap();
        let s = p.create_sequence();
        let x = vec![1.0f32; 3 * 64];
        p.append(s, &[&x[..], &x[..]], &[&x[..], &x[..]]).unwrap();
        // Every layer swapped to blocks of 8: layer 0 agrees with the others, not with the
        // allocator's blocks of 4.
        let c8 = CacheConfig { block_size: 8, ..c };
        for l in p.layers_mut() {
            *l = HostCache::new(c8, 8).unwrap();
        }
        let before: Vec<Vec<u8>> = p.layers().iter().map(|l| l.pool().to_vec()).collect();
        let err = p.append(s, &[&x[..64], &x[..64]], &[&x[..64], &x[..64]]);
        assert!(
            matches!(
                err,
                Err(Error::LayerMismatch {
                    layer: 0,
                    what: "config",
                    ..
                })
            ),
            "{err:?}"
        );
        assert_eq!(p.len(s).unwrap(), 3, "nothing reserved");
        let after: Vec<Vec<u8>> = p.layers().iter().map(|l| l.pool().to_vec()).collect();
        assert_eq!(before, after, "nothing written");
        // A layer of another block count.
        p.layers_mut()[0] = HostCache::new(c, 9).unwrap();
        p.layers_mut()[1] = HostCache::new(c, 8).unwrap();
        let err = p.append(s, &[&x[..64], &x[..64]], &[&x[..64], &x[..64]]);
        assert!(matches!(
            err,
            Err(Error::LayerMismatch {
                layer: 0,
                what: "num_blocks",
                ..
            })
        ));
        p.layers_mut()[0] = HostCache::new(c, 8).unwrap();
        p.append(s, &[&x[..64], &x[..64]], &[&x[..64], &x[..64]])
            .unwrap();
    }

    #[test]
    fn truncate_rolls_back_draft_tokens() {
        let c = CacheConfig::new(1, 64, 4, KvFormat::F16, KvFormat::F16).unwrap();
        let mut p = PagedKvCache::new(c, 1, 5).unwrap();
        let s = p.create_sequence();
        let accepted = vec![1.0f32; 5 * 64];
        let draft = vec![2.0f32; 4 * 64];
        p.append(s, &[&accepted[..]], &[&accepted[..]]).unwrap();
        let fork = p.fork(s).unwrap();
        p.append(s, &[&draft[..]], &[&draft[..]]).unwrap();
        assert_eq!(p.allocator().num_free_blocks(), 1);
        // Two drafts rejected: tokens 7, 8 and their block go.
        p.truncate(s, 7).unwrap();
        assert_eq!(p.allocator().num_free_blocks(), 2);
        let fixed = vec![3.0f32; 2 * 64];
        p.append(s, &[&fixed[..]], &[&fixed[..]]).unwrap();
        let t = p.block_tables(&[s, fork]).unwrap();
        let (mut k, mut v) = (vec![0f32; 9 * 64], vec![0f32; 9 * 64]);
        p.layers()[0].gather(t.row(0), 9, &mut k, &mut v).unwrap();
        let want: Vec<f32> = [&accepted[..], &draft[..2 * 64], &fixed[..]].concat();
        assert_eq!(k, want);
        // The fork still reads its own five tokens.
        let (mut k, mut v) = (vec![0f32; 5 * 64], vec![0f32; 5 * 64]);
        p.layers()[0].gather(t.row(1), 5, &mut k, &mut v).unwrap();
        assert_eq!(v, accepted);
    }
}
