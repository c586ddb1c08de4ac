//! Block allocator: which pool blocks each sequence owns. Pure bookkeeping, no storage, so one
//! allocator can serve the caches of every layer of a model.
//!
//! Blocks are reference counted. [`BlockAllocator::fork`] gives a child sequence the parent's
//! blocks; the first `reserve` that would write into a shared, partially filled last block
//! gets a private copy instead (copy-on-write) and reports the copy as a [`CopyBlock`] the caller
//! applies to its storage before writing the new tokens.

use std::collections::HashMap;
use std::fmt;

use super::tables::BlockTables;
use crate::error::{Error, Result};
use crate::layout::{CacheConfig, MAX_BLOCK_SIZE};

/// Identifies a sequence inside one [`BlockAllocator`]. Ids are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Copy every byte of block `src` to block `dst` (all KV heads, K and V), in every layer's
/// storage, before writing the tokens of the [`Reservation`] that asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyBlock {
    /// Block to copy from (still owned by the other sequences that share it).
    pub src: usize,
    /// Freshly allocated block that replaces `src` in the reserving sequence.
    pub dst: usize,
}

/// What [`BlockAllocator::reserve`] hands back: where the new tokens go, and the copies that
/// must be applied first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reservation {
    /// One slot (`block * block_size + offset_in_block`) per new token, in token order.
    pub slots: Vec<usize>,
    /// Copy-on-write block copies, to apply (in order) before writing to `slots`.
    pub copies: Vec<CopyBlock>,
}

impl Reservation {
    /// Appends `slots` to an engine's slot mapping in the integer type its device calls take
    /// (i32 or i64), so a step reuses one buffer instead of collecting a new one per
    /// sequence. A slot that does not fit `S` is [`Error::Unsupported`], never a wrapped
    /// (another token's) slot; `out` is then left as it was.
    pub fn extend_slots<S: TryFrom<usize>>(&self, out: &mut Vec<S>) -> Result<()> {
        let start = out.len();
        out.try_reserve(self.slots.len())
            .map_err(|_| Error::Alloc {
                what: "slot mapping",
                bytes: self.slots.len().saturating_mul(size_of::<S>()),
            })?;
        for &slot in &self.slots {
            match S::try_from(slot) {
                Ok(s) => out.push(s),
                Err(_) => {
                    out.truncate(start);
                    return Err(slot_too_large::<S>(slot));
                }
            }
        }
        Ok(())
    }

    /// Writes `slots` to the front of `out` (a pinned staging buffer, a row of a larger
    /// mapping) in the integer type the device takes; checked as
    /// [`extend_slots`](Self::extend_slots). [`Error::Length`] when `out` is shorter than
    /// `slots`. On an error, elements of `out` before the failing slot may already be written.
    pub fn write_slots<S: TryFrom<usize>>(&self, out: &mut [S]) -> Result<()> {
        if out.len() < self.slots.len() {
            return Err(Error::Length {
                what: "slot mapping",
                expected: self.slots.len(),
                actual: out.len(),
            });
        }
        for (o, &slot) in out.iter_mut().zip(&self.slots) {
            *o = S::try_from(slot).map_err(|_| slot_too_large::<S>(slot))?;
        }
        Ok(())
    }
}

/// The error for a slot that the device's slot type cannot hold.
fn slot_too_large<S>(slot: usize) -> Error {
    Error::Unsupported(format!(
        "slot {slot} does not fit a {} slot mapping (use i64 slots)",
        std::any::type_name::<S>()
    ))
}

/// The blocks of one sequence, in position order, and its length in tokens.
#[derive(Debug, Clone, Default)]
struct Sequence {
    /// Block ids as i32, the element type of a device block table.
    blocks: Vec<i32>,
    len: usize,
}

/// Hands out fixed-size blocks of a pool to sequences and tracks who shares what.
///
/// Allocation order: freed blocks are reused most-recently-freed first; when none is waiting,
/// the lowest block never handed out goes next (block 0 first). Bookkeeping grows with the
/// blocks handed out, not with the pool, so a pool of `i32::MAX` blocks costs nothing up front.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    /// References held on each block handed out so far (`0..ref_counts.len()`); 0 means free.
    /// Blocks from `ref_counts.len()` on were never handed out and are free.
    ref_counts: Vec<u32>,
    /// Blocks handed out and released since, reused from the end.
    free: Vec<usize>,
    sequences: HashMap<u64, Sequence>,
    next_id: u64,
}

impl BlockAllocator {
    /// An allocator over the `num_blocks` blocks of caches of `config`, all free: its block size
    /// is the caches', which nothing downstream could check (slots and tables counted in
    /// another block size address other tokens of the pool, silently). Errors as
    /// [`new`](Self::new).
    pub fn for_config(config: &CacheConfig, num_blocks: usize) -> Result<Self> {
        Self::new(num_blocks, config.block_size)
    }

    /// An allocator over `num_blocks` blocks of `block_size` tokens, all free. `block_size`
    /// must be the cache's ([`for_config`](Self::for_config) takes it from there).
    ///
    /// `num_blocks` must be in `1..=i32::MAX` (block tables are i32) and `block_size` in
    /// `1..=MAX_BLOCK_SIZE`.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || num_blocks > i32::MAX as usize {
            return Err(Error::Config {
                what: "num_blocks",
                value: num_blocks,
                expected: "1..=i32::MAX",
            });
        }
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config {
                what: "block_size",
                value: block_size,
                expected: "1..=1024 tokens",
            });
        }
        if num_blocks.checked_mul(block_size).is_none() {
            return Err(Error::Config {
                what: "num_blocks",
                value: num_blocks,
                expected: "num_blocks * block_size to fit in usize",
            });
        }
        Ok(BlockAllocator {
            block_size,
            num_blocks,
            ref_counts: Vec::new(),
            free: Vec::new(),
            sequences: HashMap::new(),
            next_id: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no sequence holds.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + (self.num_blocks - self.ref_counts.len())
    }

    /// Live sequences.
    pub fn num_sequences(&self) -> usize {
        self.sequences.len()
    }

    /// How many sequences hold `block` (0 when free).
    pub fn ref_count(&self, block: usize) -> Result<usize> {
        if block >= self.num_blocks {
            return Err(Error::BlockIndex {
                block,
                num_blocks: self.num_blocks,
            });
        }
        Ok(self.ref_counts.get(block).map_or(0, |&r| r as usize))
    }

    /// Start an empty sequence.
    pub fn create_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.sequences.insert(id, Sequence::default());
        SeqId(id)
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.sequences
            .get(&seq.0)
            .ok_or(Error::UnknownSequence(seq.0))
    }

    /// Tokens in `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// Whether `seq` holds no tokens.
    pub fn is_empty(&self, seq: SeqId) -> Result<bool> {
        Ok(self.len(seq)? == 0)
    }

    /// The blocks of `seq` in position order: exactly `ceil(len / block_size)` entries.
    pub fn block_table(&self, seq: SeqId) -> Result<&[i32]> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// Release `seq`; blocks no other sequence holds become free.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self
            .sequences
            .remove(&seq.0)
            .ok_or(Error::UnknownSequence(seq.0))?;
        for &b in s.blocks.iter().rev() {
            self.release(b as usize);
        }
        Ok(())
    }

    /// A new sequence with the same tokens as `seq`, sharing its blocks until either writes.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let child = self.seq(seq)?.clone();
        if let Some(&b) = child
            .blocks
            .iter()
            .find(|&&b| self.ref_counts[b as usize] == u32::MAX)
        {
            return Err(Error::InvalidArgument(format!(
                "block {b} is already shared by u32::MAX sequences; free some before forking"
            )));
        }
        for &b in &child.blocks {
            self.ref_counts[b as usize] += 1;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.sequences.insert(id, child);
        Ok(SeqId(id))
    }

    /// Grow `seq` by `n_new_tokens` and return their slots, allocating blocks as needed.
    ///
    /// If the sequence's last block is partially filled and shared with another sequence, it is
    /// replaced by a fresh private block and the reservation lists the [`CopyBlock`] to apply.
    /// All or nothing: on [`Error::OutOfBlocks`] the allocator is unchanged.
    pub fn reserve(&mut self, seq: SeqId, n_new_tokens: usize) -> Result<Reservation> {
        let mut r = Reservation::default();
        self.reserve_into(seq, n_new_tokens, &mut r)?;
        Ok(r)
    }

    /// [`reserve`](Self::reserve) into `out`, whose buffers are cleared and reused: a step
    /// loop that keeps one `Reservation` allocates nothing once they have grown (a new block
    /// every `block_size` tokens aside). On an error the allocator is unchanged and `out` empty.
    pub fn reserve_into(
        &mut self,
        seq: SeqId,
        n_new_tokens: usize,
        out: &mut Reservation,
    ) -> Result<()> {
        out.slots.clear();
        out.copies.clear();
        let bs = self.block_size;
        let s = self.seq(seq)?;
        let len = s.len;
        let new_len = len
            .checked_add(n_new_tokens)
            .filter(|&l| l <= i32::MAX as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "sequence {seq} of {len} tokens cannot grow by {n_new_tokens}: \
                     lengths must fit in i32"
                ))
            })?;
        if n_new_tokens == 0 {
            return Ok(());
        }
        let last_shared_partial =
            len % bs != 0 && self.ref_counts[*s.blocks.last().expect("len > 0") as usize] > 1;
        let needed = new_len.div_ceil(bs) - len.div_ceil(bs) + last_shared_partial as usize;
        let free = self.num_free_blocks();
        if needed > free {
            return Err(Error::OutOfBlocks {
                needed,
                free,
                total: self.num_blocks,
            });
        }
        // The buffers that grow with the request rather than the pool: reserve them before
        // anything changes, so running out of memory leaves the allocator as it was.
        let (slots, copies) = (&mut out.slots, &mut out.copies);
        let room = |what, elems: usize, bytes: usize| Error::Alloc {
            what,
            bytes: elems.saturating_mul(bytes),
        };
        slots
            .try_reserve(n_new_tokens)
            .map_err(|_| room("reservation slots", n_new_tokens, size_of::<usize>()))?;
        if last_shared_partial {
            copies
                .try_reserve(1)
                .map_err(|_| room("reservation copies", 1, size_of::<CopyBlock>()))?;
        }

        // Checked above: `needed` blocks are free, so every take succeeds.
        let mut fresh: Vec<i32> = (0..needed).filter_map(|_| self.take_free()).collect();
        let s = self.sequences.get_mut(&seq.0).expect("checked above");
        if last_shared_partial {
            let dst = fresh.remove(0);
            let last = s.blocks.last_mut().expect("len > 0");
            self.ref_counts[*last as usize] -= 1;
            copies.push(CopyBlock {
                src: *last as usize,
                dst: dst as usize,
            });
            *last = dst;
        }
        s.blocks.extend(fresh);
        s.len = new_len;
        slots.extend((len..new_len).map(|p| s.blocks[p / bs] as usize * bs + p % bs));
        Ok(())
    }

    /// Shorten `seq` to its first `new_len` tokens: speculative decoding's rollback of
    /// rejected draft tokens. Blocks past `ceil(new_len / block_size)` are released, freed
    /// when no other sequence holds them (reused as after [`free`](Self::free): the lowest
    /// position's block first); a kept last block that is now partial and shared is copied on the
    /// next [`reserve`](Self::reserve), so other holders keep their tokens. The rejected tokens'
    /// bytes stay in storage until overwritten; nothing reads past a sequence's length.
    /// `new_len` above the current length is an [`Error::InvalidArgument`] and changes nothing.
    ///
    /// The allocator knows no formats: with `int4-kc` keys, whose full blocks are quantized in
    /// place, `new_len` must not fall below the last multiple of `block_size` at or under the
    /// current length (`PagedKvCache::truncate` checks it; an engine driving the allocator
    /// itself must too).
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        let bs = self.block_size;
        let s = self
            .sequences
            .get_mut(&seq.0)
            .ok_or(Error::UnknownSequence(seq.0))?;
        if new_len > s.len {
            return Err(Error::InvalidArgument(format!(
                "sequence {seq} of {} tokens cannot be truncated to {new_len}: truncate only \
                 shortens",
                s.len
            )));
        }
        let dropped = s.blocks.split_off(new_len.div_ceil(bs));
        s.len = new_len;
        // Last block first, so the lowest dropped position's block is reused first.
        for &b in dropped.iter().rev() {
            self.release(b as usize);
        }
        Ok(())
    }

    /// Block tables of several sequences, one row each (see [`BlockTables`]).
    pub fn block_tables(&self, seqs: &[SeqId]) -> Result<BlockTables> {
        let rows = seqs
            .iter()
            .map(|&s| self.seq(s))
            .collect::<Result<Vec<_>>>()?;
        let blocks: Vec<&[i32]> = rows.iter().map(|s| s.blocks.as_slice()).collect();
        let lens: Vec<usize> = rows.iter().map(|s| s.len).collect();
        BlockTables::from_rows(&blocks, &lens)
    }

    /// A free block, now held once: the most recently freed one, else the lowest block never
    /// handed out. `None` when the pool is full.
    fn take_free(&mut self) -> Option<i32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None if self.ref_counts.len() < self.num_blocks => {
                self.ref_counts.push(0);
                self.ref_counts.len() - 1
            }
            None => return None,
        };
        self.ref_counts[b] = 1;
        // Block ids are below num_blocks <= i32::MAX (checked in `new`).
        Some(b as i32)
    }

    /// Drop one reference to `block`, freeing it at zero.
    fn release(&mut self, block: usize) {
        let r = &mut self.ref_counts[block];
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvFormat;

    #[test]
    fn for_config_takes_the_caches_block_size() {
        let config = CacheConfig::new(2, 64, 32, KvFormat::Fp8E4m3, KvFormat::Fp8E4m3).unwrap();
        let mut a = BlockAllocator::for_config(&config, 8).unwrap();
        let s = a.create_sequence();
        assert_eq!(a.reserve(s, 33).unwrap().slots[32], 32);
        assert_eq!(a.block_table(s).unwrap().len(), 2);
        assert!(BlockAllocator::for_config(&config, 0).is_err());
    }

    #[test]
    fn reserve_fork_cow_free() {
        let mut a = BlockAllocator::new(4, 4).unwrap();
        let s = a.create_sequence();
        let r = a.reserve(s, 5).unwrap();
        assert_eq!(r.slots, vec![0, 1, 2, 3, 4]);
        assert!(r.copies.is_empty());
        assert_eq!(a.block_table(s).unwrap(), &[0, 1]);
        let c = a.fork(s).unwrap();
        assert_eq!(a.ref_count(1).unwrap(), 2);
        // The child writes into the shared, partial block 1: it gets block 2, a copy.
        let r = a.reserve(c, 1).unwrap();
        assert_eq!(r.copies, vec![CopyBlock { src: 1, dst: 2 }]);
        assert_eq!(r.slots, vec![2 * 4 + 1]);
        assert_eq!(a.block_table(c).unwrap(), &[0, 2]);
        // The parent is now the only holder of block 1 and writes in place.
        let r = a.reserve(s, 1).unwrap();
        assert!(r.copies.is_empty());
        assert_eq!(r.slots, vec![5]);
        a.free(s).unwrap();
        assert_eq!(a.num_free_blocks(), 2);
        a.free(c).unwrap();
        assert_eq!(a.num_free_blocks(), 4);
        assert_eq!(a.free(c), Err(Error::UnknownSequence(c.0)));
    }

    #[test]
    fn truncate_frees_whole_blocks_and_respects_sharing() {
        let mut a = BlockAllocator::new(8, 4).unwrap();
        let s = a.create_sequence();
        a.reserve(s, 10).unwrap(); // blocks 0, 1, 2
        let c = a.fork(s).unwrap();
        // Dropping the draft tokens 6..10: block 2 stays with the child, block 1 is kept.
        a.truncate(s, 6).unwrap();
        assert_eq!(a.block_table(s).unwrap(), &[0, 1]);
        assert_eq!((a.ref_count(1).unwrap(), a.ref_count(2).unwrap()), (2, 1));
        // The kept, partial, shared block is copied before the parent writes into it.
        let r = a.reserve(s, 1).unwrap();
        assert_eq!(r.copies, vec![CopyBlock { src: 1, dst: 3 }]);
        assert_eq!(r.slots, vec![3 * 4 + 2]);
        // The child's last block is its own: truncating to 8 frees it.
        a.truncate(c, 8).unwrap();
        assert_eq!(a.ref_count(2).unwrap(), 0);
        assert_eq!(a.num_free_blocks(), 8 - 3); // 0 and 1 shared, 3 the parent's
        a.truncate(c, 0).unwrap();
        assert_eq!(a.block_table(c).unwrap(), &[] as &[i32]);
        assert!(matches!(a.truncate(c, 1), Err(Error::InvalidArgument(_))));
        assert_eq!(a.truncate(SeqId(99), 0), Err(Error::UnknownSequence(99)));
        a.free(s).unwrap();
        a.free(c).unwrap();
        assert_eq!(a.num_free_blocks(), 8);
    }

    #[test]
    fn out_of_blocks_changes_nothing() {
        let mut a = BlockAllocator::new(2, 4).unwrap();
        let s = a.create_sequence();
        a.reserve(s, 3).unwrap();
        let err = a.reserve(s, 6).unwrap_err();
        assert_eq!(
            err,
            Error::OutOfBlocks {
                needed: 2,
                free: 1,
                total: 2
            }
        );
        assert_eq!(a.len(s).unwrap(), 3);
        assert_eq!(a.num_free_blocks(), 1);
    }
    #[test]
    fn reserve_into_reuses_its_buffers() {
        let mut a = BlockAllocator::new(8, 4).unwrap();
        let s = a.create_sequence();
        let mut r = Reservation::default();
        a.reserve_into(s, 6, &mut r).unwrap();
        assert_eq!(r.slots.len(), 6);
        let (ptr, cap) = (r.slots.as_ptr(), r.slots.capacity());
        // A fork shares the partial last block: its next token copies it first.
        let f = a.fork(s).unwrap();
        let want = a.clone().reserve(f, 1).unwrap();
        a.reserve_into(f, 1, &mut r).unwrap();
        assert_eq!((r.slots.len(), r.copies.len()), (1, 1));
        assert_eq!(r, want);
        assert_eq!((r.slots.as_ptr(), r.slots.capacity()), (ptr, cap));
        // Nothing left over on an error.
        assert!(a.reserve_into(s, 1000, &mut r).is_err());
        assert!(r.slots.is_empty() && r.copies.is_empty());
        assert_eq!(a.len(s).unwrap(), 6);
    }
}
