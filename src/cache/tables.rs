//! Block tables: the per-sequence lists of pool blocks that attention kernels read.

use crate::error::{Error, Result, at_least_one, filled};
use crate::layout::MAX_BLOCK_SIZE;

/// Block tables of a batch of sequences, laid out as the kernels take them.
///
/// - `data` is row-major `[batch, max_blocks]`: row `b` lists, in position order, the pool
///   blocks holding sequence `b`'s tokens; token `p` lives in block `data[b * max_blocks + p /
///   block_size]` at offset `p % block_size`.
/// - Only the first `ceil(context_lens[b] / block_size)` entries of a row are meaningful;
///   the rest are [`BlockTables::UNUSED`] (-1) when built by the allocator, and kernels never
///   read them.
/// - `context_lens[b]` is sequence `b`'s length in tokens, including any new tokens that were
///   just appended and are being decoded. Nothing in the cache records which slots were
///   written, so a length beyond the tokens appended is read as it stands: the pool's poison
///   bytes where nothing was written (host and device pools alike), or a freed block's stale
///   tokens. Take lengths and rows from the
///   [`BlockAllocator`](crate::cache::BlockAllocator) that reserved the slots
///   (`block_tables`, or `block_table` and `len` per row).
/// - `max_blocks >= 1`, so the table is never an empty array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTables {
    /// `[batch, max_blocks]` block ids.
    pub data: Vec<i32>,
    /// Row stride of `data`.
    pub max_blocks: usize,
    /// `[batch]` sequence lengths in tokens.
    pub context_lens: Vec<i32>,
}

impl BlockTables {
    /// Filler for the entries past a sequence's last block.
    pub const UNUSED: i32 = -1;

    /// Tables from one block list and one length per sequence (rows are padded with
    /// [`UNUSED`](Self::UNUSED)). Each list must hold at least `ceil(len / block_size)`
    /// entries; that is checked when the tables are used against a cache.
    pub fn from_rows(rows: &[&[i32]], context_lens: &[usize]) -> Result<Self> {
        if rows.len() != context_lens.len() {
            return Err(Error::Length {
                what: "context_lens (one per block-table row)",
                expected: rows.len(),
                actual: context_lens.len(),
            });
        }
        let max_blocks = rows.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
        let entries = rows.len().checked_mul(max_blocks).ok_or(Error::Overflow {
            what: "block table entries (batch × max_blocks)",
            lhs: rows.len(),
            rhs: max_blocks,
        })?;
        let mut data = filled(entries, Self::UNUSED, "block table")?;
        for (dst, src) in data.chunks_exact_mut(max_blocks).zip(rows) {
            dst[..src.len()].copy_from_slice(src);
        }
        let context_lens = context_lens
            .iter()
            .map(|&l| {
                i32::try_from(l).map_err(|_| {
                    Error::InvalidArgument(format!("context length {l} does not fit in i32"))
                })
            })
            .collect::<Result<_>>()?;
        Ok(BlockTables {
            data,
            max_blocks,
            context_lens,
        })
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.context_lens.len()
    }

    /// Row `b` of `data` (all `max_blocks` entries), or [`Error::Index`] for a `b` past the
    /// batch ([`Error::Length`] when `data` is shorter than `[batch, max_blocks]`).
    pub fn try_row(&self, b: usize) -> Result<&[i32]> {
        if b >= self.batch() {
            return Err(Error::Index {
                what: "block table row",
                index: b,
                len: self.batch(),
            });
        }
        let start = b.saturating_mul(self.max_blocks);
        self.data
            .get(start..)
            .and_then(|rest| rest.get(..self.max_blocks))
            .ok_or(Error::Length {
                what: "block table data ([batch, max_blocks])",
                expected: self.batch().saturating_mul(self.max_blocks),
                actual: self.data.len(),
            })
    }

    /// Row `b` of `data` (all `max_blocks` entries); empty for a row the tables do not have
    /// ([`try_row`](Self::try_row) says why).
    pub fn row(&self, b: usize) -> &[i32] {
        self.try_row(b).unwrap_or(&[])
    }

    /// Shorten row `b`'s sequence to `new_len` tokens in place, as
    /// [`BlockAllocator::truncate`](crate::cache::BlockAllocator::truncate) does to the
    /// sequence (speculative decoding's rollback), so a step's tables need no rebuild: the
    /// length becomes `new_len` and entries past `ceil(new_len / block_size)` become
    /// [`UNUSED`](Self::UNUSED). A `new_len` above the row's length is an
    /// [`Error::InvalidArgument`]; on any error nothing changes.
    pub fn truncate_row(&mut self, b: usize, new_len: usize, block_size: usize) -> Result<()> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config {
                what: "block_size",
                value: block_size,
                expected: "1..=1024 tokens",
            });
        }
        self.try_row(b)?;
        let len = self.context_lens[b];
        if usize::try_from(len).ok().is_none_or(|l| new_len > l) {
            return Err(Error::InvalidArgument(format!(
                "block table row {b} of length {len} cannot be truncated to {new_len}"
            )));
        }
        let keep = new_len.div_ceil(block_size).min(self.max_blocks);
        let start = b * self.max_blocks; // in range: try_row checked the row
        self.data[start + keep..start + self.max_blocks].fill(Self::UNUSED);
        // Fits: new_len is at most the row's i32 length.
        self.context_lens[b] = new_len as i32;
        Ok(())
    }

    /// Longest context in the batch (0 for an empty batch or negative lengths).
    pub fn max_context_len(&self) -> usize {
        self.context_lens
            .iter()
            .map(|&l| l.max(0) as usize)
            .max()
            .unwrap_or(0)
    }

    /// Check the tables against a pool of `num_blocks` blocks of `block_size` tokens: shape,
    /// non-negative lengths that fit in `max_blocks` rows, and every entry a kernel will read
    /// (`< ceil(len / block_size)` in its row) a valid block id.
    pub fn validate(&self, num_blocks: usize, block_size: usize) -> Result<()> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config {
                what: "block_size",
                value: block_size,
                expected: "1..=1024 tokens",
            });
        }
        at_least_one(&[("max_blocks", self.max_blocks)])?;
        let expected = self
            .batch()
            .checked_mul(self.max_blocks)
            .ok_or(Error::Overflow {
                what: "block table entries (batch × max_blocks)",
                lhs: self.batch(),
                rhs: self.max_blocks,
            })?;
        if self.data.len() != expected {
            return Err(Error::Length {
                what: "block table data ([batch, max_blocks])",
                expected,
                actual: self.data.len(),
            });
        }
        for (b, &len) in self.context_lens.iter().enumerate() {
            let len = usize::try_from(len).map_err(|_| {
                Error::InvalidArgument(format!("context_lens[{b}] = {len} is negative"))
            })?;
            let used = len.div_ceil(block_size);
            if used > self.max_blocks {
                return Err(Error::InvalidArgument(format!(
                    "context_lens[{b}] = {len} needs {used} blocks of {block_size}, \
                     but rows hold max_blocks = {}",
                    self.max_blocks
                )));
            }
            check_row(self.try_row(b)?, Some(b), len, block_size, num_blocks)?;
        }
        Ok(())
    }
}

/// Check one block-table row for a sequence of `len` tokens against a pool of `num_blocks`
/// blocks of `block_size` tokens: the row holds at least `ceil(len / block_size)` entries
/// ([`Error::Length`]) and each of those is a block id ([`Error::InvalidArgument`]) below
/// `num_blocks` ([`Error::BlockIndex`]). `row_index` names the row in messages when the row
/// is part of a batch.
pub(crate) fn check_row(
    row: &[i32],
    row_index: Option<usize>,
    len: usize,
    block_size: usize,
    num_blocks: usize,
) -> Result<()> {
    at_least_one(&[("block_size", block_size)])?;
    let used = len.div_ceil(block_size);
    if row.len() < used {
        return Err(Error::Length {
            what: "block table entries (ceil(len / block_size))",
            expected: used,
            actual: row.len(),
        });
    }
    for (i, &e) in row[..used].iter().enumerate() {
        let block = usize::try_from(e).map_err(|_| {
            let row = row_index.map(|b| format!("row {b} ")).unwrap_or_default();
            Error::InvalidArgument(format!(
                "block table {row}entry {i} = {e}: a used entry must be a block id"
            ))
        })?;
        if block >= num_blocks {
            return Err(Error::BlockIndex { block, num_blocks });
        }
    }
    Ok(())
}
