//! [`PagedKvCache`]: a model's whole host KV cache, one allocator plus one [`HostCache`] per
//! layer, so appending a token applies copy-on-write to every layer at once.

use super::allocator::{BlockAllocator, SeqId};
use super::host::HostCache;
use super::tables::BlockTables;
use crate::error::{Error, Result, reserved};
use crate::format::Element;
use crate::layout::CacheConfig;

/// Every layer's KV cache of a model, sharing one block allocator.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    allocator: BlockAllocator,
    layers: Vec<HostCache>,
}

impl PagedKvCache {
    /// `num_layers` caches of `num_blocks` blocks each, all with `config`.
    pub fn new(config: CacheConfig, num_layers: usize, num_blocks: usize) -> Result<Self> {
        if num_layers == 0 {
            return Err(Error::Config {
                what: "num_layers",
                value: 0,
                expected: "at least 1",
            });
        }
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
        Ok(PagedKvCache { allocator, layers })
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
    /// through it must keep the configuration and block count: [`append`](Self::append)
    /// refuses layers that differ.
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
        let c = *self.layers[0].config();
        if let Some((i, l)) = self
            .layers
            .iter()
            .enumerate()
            .find(|(_, l)| *l.config() != c || l.num_blocks() != self.allocator.num_blocks())
        {
            return Err(Error::InvalidArgument(format!(
                "layer {i} ({} blocks, {:?}) differs from the allocator's {} blocks of \
                 layer 0's {c:?}",
                l.num_blocks(),
                l.config(),
                self.allocator.num_blocks()
            )));
        }
        // Fits: the validated layout holds num_kv_heads × head_dim codes per token.
        let row = c.num_kv_heads * c.head_dim;
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
}
