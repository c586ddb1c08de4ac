//! The rules of a list of block copies, shared by [`HostCache::apply_copies`] and the device's
//! `DeviceCache::copy_blocks`, so that both accept the same lists and leave the same bytes.
//!
//! A list applies in order, as if each copy ran after the one before: `src == dst` is a no-op,
//! a block copied to and later copied from passes on the bytes it just received (a chain), and
//! of two copies into one block the later wins. Every id must be a block of the pool
//! ([`Error::BlockIndex`], checked before anything is copied). The device runs a list as
//! [`waves`]: runs of copies with no block both read and written, or written twice, which
//! give the same bytes in parallel as in order.
//!
//! [`HostCache::apply_copies`]: super::HostCache::apply_copies

use std::collections::HashSet;
use std::ops::Range;

use super::allocator::CopyBlock;
use crate::error::{Error, Result};

/// Every id of `copies` against a pool of `num_blocks` blocks.
pub(crate) fn check_copies(copies: &[CopyBlock], num_blocks: usize) -> Result<()> {
    for c in copies {
        for block in [c.src, c.dst] {
            if block >= num_blocks {
                return Err(Error::BlockIndex { block, num_blocks });
            }
        }
    }
    Ok(())
}

/// Split `copies` (no `src == dst` pair: drop those first, they are no-ops) into consecutive
/// ranges that may each run in parallel: within a range no block is written twice, and none
/// is both a source and a destination. Running the ranges in order then gives the bytes of
/// applying the list in order. A list an allocator reserved gives one range.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn waves(copies: &[CopyBlock]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut srcs, mut dsts) = (HashSet::new(), HashSet::new());
    let mut start = 0;
    for (i, c) in copies.iter().enumerate() {
        let conflict = dsts.contains(&c.src) || dsts.contains(&c.dst) || srcs.contains(&c.dst);
        if conflict {
            out.push(start..i);
            start = i;
            srcs.clear();
            dsts.clear();
        }
        srcs.insert(c.src);
        dsts.insert(c.dst);
    }
    if start < copies.len() {
        out.push(start..copies.len());
    }
    out
}

/// Most layers one all-layer call serves (the kernels' grid y).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_LAYERS: usize = 65535;

/// The `(block_stride, num_blocks)` every layer shares, from each layer's own, so that one
/// launch can address every pool alike: [`Error::LayerMismatch`] naming the first layer that
/// differs from layer 0, [`Error::Config`] past [`MAX_LAYERS`], `None` for no layer.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn shared_shape(
    layers: impl IntoIterator<Item = (usize, usize)>,
) -> Result<Option<(usize, usize)>> {
    let mut first = None;
    let mut count = 0;
    for (layer, (stride, blocks)) in layers.into_iter().enumerate() {
        count += 1;
        let Some((s0, b0)) = first else {
            first = Some((stride, blocks));
            continue;
        };
        for (what, expected, actual) in [("block_stride", s0, stride), ("num_blocks", b0, blocks)] {
            if actual != expected {
                return Err(Error::LayerMismatch {
                    layer,
                    what,
                    expected: format!("{expected} (layer 0's)"),
                    actual: actual.to_string(),
                });
            }
        }
    }
    if count > MAX_LAYERS {
        return Err(Error::Config {
            what: "layers in one all-layer call",
            value: count,
            expected: "at most 65535",
        });
    }
    Ok(first)
}

/// One pair as the kernels read it, two int32 (`src`, then `dst`) in one u64, so that pairs
/// and pool addresses go to the device in one upload. Ids are checked blocks (below 2³¹).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn pack_pair(c: CopyBlock) -> u64 {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&(c.src as i32).to_ne_bytes());
    b[4..].copy_from_slice(&(c.dst as i32).to_ne_bytes());
    u64::from_ne_bytes(b)
}

/// Slot of a swap space that layer `layer` of `layers` uses for all-layer slot `slot`: slot
/// `s` holds every layer's copy of one block, in space slots `s * layers ..`. Saturates, so
/// an overflow reads as a slot past any space.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn layer_slot(slot: usize, layer: usize, layers: usize) -> usize {
    slot.saturating_mul(layers).saturating_add(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Apply `copies` to one byte per block, in order.
    fn in_order(pool: &mut [u8], copies: &[CopyBlock]) {
        for c in copies {
            pool[c.dst] = pool[c.src];
        }
    }

    /// Apply each wave as a parallel kernel would: every source read before any write.
    fn by_waves(pool: &mut [u8], copies: &[CopyBlock]) {
        let copies: Vec<CopyBlock> = copies.iter().copied().filter(|c| c.src != c.dst).collect();
        for w in waves(&copies) {
            let read: Vec<u8> = copies[w.clone()].iter().map(|c| pool[c.src]).collect();
            for (c, b) in copies[w].iter().zip(read) {
                pool[c.dst] = b;
            }
        }
    }

    #[test]
    fn waves_give_the_in_order_bytes() {
        // Every list of up to 4 copies over a pool of 4 blocks.
        let pairs: Vec<CopyBlock> = (0..16)
            .map(|i| CopyBlock {
                src: i / 4,
                dst: i % 4,
            })
            .collect();
        let mut lists: Vec<Vec<CopyBlock>> = vec![vec![]];
        for _ in 0..4 {
            let longer: Vec<Vec<CopyBlock>> = lists
                .iter()
                .filter(|l| l.len() == lists.last().unwrap().len())
                .flat_map(|l| pairs.iter().map(move |&p| [&l[..], &[p]].concat()))
                .collect();
            lists.extend(longer);
        }
        assert_eq!(lists.len(), 1 + 16 + 256 + 4096 + 65536);
        for l in &lists {
            let (mut a, mut b) = ([10u8, 11, 12, 13], [10u8, 11, 12, 13]);
            in_order(&mut a, l);
            by_waves(&mut b, l);
            assert_eq!(a, b, "{l:?}");
        }
    }

    #[test]
    fn independent_copies_are_one_wave_and_chains_split() {
        let c = |src, dst| CopyBlock { src, dst };
        assert_eq!(waves(&[c(0, 4), c(1, 5), c(2, 6)]), vec![0..3]);
        assert_eq!(waves(&[c(0, 1), c(1, 2), c(2, 3)]), vec![0..1, 1..2, 2..3]);
        assert_eq!(waves(&[c(0, 1), c(2, 1)]), vec![0..1, 1..2]);
        assert_eq!(waves(&[c(0, 1), c(1, 0)]), vec![0..1, 1..2]);
        assert_eq!(waves(&[c(0, 1), c(0, 2)]), vec![0..2]);
        assert!(waves(&[]).is_empty());
        assert_eq!(waves(&[c(0, 1), c(0, 1)]), vec![0..1, 1..2]);
        assert_eq!(
            check_copies(&[c(0, 1), c(1, 7)], 7),
            Err(Error::BlockIndex {
                block: 7,
                num_blocks: 7
            })
        );
    }

    #[test]
    fn all_layer_calls_need_one_shape() {
        assert_eq!(shared_shape([]), Ok(None));
        assert_eq!(shared_shape([(4096, 8); 3]), Ok(Some((4096, 8))));
        assert_eq!(
            shared_shape([(4096, 8), (4096, 8), (2048, 8)]),
            Err(Error::LayerMismatch {
                layer: 2,
                what: "block_stride",
                expected: "4096 (layer 0's)".into(),
                actual: "2048".into(),
            })
        );
        assert!(matches!(
            shared_shape([(4096, 8), (4096, 9)]),
            Err(Error::LayerMismatch {
                layer: 1,
                what: "num_blocks",
                ..
            })
        ));
        assert!(matches!(
            shared_shape(std::iter::repeat_n((16, 1), MAX_LAYERS + 1)),
            Err(Error::Config { value: 65536, .. })
        ));
        assert_eq!(
            shared_shape(std::iter::repeat_n((16, 1), MAX_LAYERS)),
            Ok(Some((16, 1)))
        );
    }

    #[test]
    fn pairs_pack_as_two_int32() {
        let p = pack_pair(CopyBlock {
            src: 7,
            dst: 0x7fff_fffe,
        });
        let b = p.to_ne_bytes();
        assert_eq!(i32::from_ne_bytes(b[..4].try_into().unwrap()), 7);
        assert_eq!(i32::from_ne_bytes(b[4..].try_into().unwrap()), 0x7fff_fffe);
    }

    #[test]
    fn all_layer_slots_are_slot_major() {
        assert_eq!(layer_slot(0, 0, 3), 0);
        assert_eq!(layer_slot(2, 1, 3), 7);
        assert_eq!(layer_slot(5, 0, 1), 5);
        assert_eq!(layer_slot(usize::MAX / 2, 1, 3), usize::MAX);
    }
}
