//! Paged cache: block allocator, block tables, and a host-side pool that quantizes on append.
//!
//! - [`BlockAllocator`] decides which pool blocks hold which sequence's tokens (bookkeeping only;
//!   one allocator serves every layer).
//! - [`BlockTables`] is that decision in the form kernels read.
//! - [`HostCache`] is one layer's storage in host memory, byte-identical to the device layout.
//! - [`PagedKvCache`] ties them together for a model: one allocator, one `HostCache` per layer.
//!
//! Block ids and slots are `usize` where the host indexes with them ([`CopyBlock`],
//! [`BlockAllocator::ref_count`], [`HostCache::copy_block`], [`Reservation::slots`]) and `i32`
//! where a kernel reads them (a table row, [`BlockAllocator::block_table`], the slot mapping an
//! engine uploads): the int32 tables engines already hold. A pool has at most `i32::MAX`
//! blocks, so every id converts both ways; a table's entries are checked against the pool
//! ([`BlockTables::validate`]) before anything indexes with them.

mod allocator;
mod copies;
mod host;
mod paged;
mod tables;

pub use allocator::{BlockAllocator, CopyBlock, Reservation, SeqId};
#[cfg(feature = "cuda")]
pub(crate) use host::check_head_scales;
pub use host::{HostCache, POISON};
pub use paged::PagedKvCache;
pub use tables::BlockTables;
// The device gather checks its block table on the host with the same rule.
#[cfg(feature = "cuda")]
pub(crate) use tables::check_row;
// The device's block copies follow the host's rules.
#[cfg(feature = "cuda")]
pub(crate) use copies::{
    MAX_LAYERS, check_copies, layer_slot, pack_pair, shared_shape, waves as copy_waves,
};
