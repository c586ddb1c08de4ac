//! [`DeviceBlockTables`]: the block tables and context lengths a decode reads, in device memory,
//! sized once for a capacity (most sequences, most blocks per sequence) and updated in place
//! every step: rows change on the host (checked against the pool as they change), then one
//! asynchronous copy from pinned memory moves the lengths and the changed block-table entries,
//! and one small kernel puts the entries in place. No allocation and no host synchronization
//! per step, and the device addresses never change, so a decode captured in a CUDA graph reads
//! the current tables on every replay.

use super::{DeviceCache, Gpu, driver_err, launch};
use crate::cache::{BlockTables, check_row};
use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

/// Changed block-table entries one upload sends as (index, value) pairs at most; more go as
/// one span of the table.
const MAX_PAIRS: usize = 4096;

/// One pinned host buffer the uploads copy from, and the event of its last copy.
#[derive(Debug)]
struct Staging {
    buf: PinnedHostSlice<i32>,
    /// Recorded after the last copy out of `buf` (None before the first).
    done: Option<CudaEvent>,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned memory is freed right after: a copy still reading it must finish first.
        if let Some(e) = &self.done {
            let _ = e.synchronize();
        }
    }
}

/// Block tables and context lengths of up to `capacity` sequences in device memory, checked on
/// the host against one pool before each upload: what [`DecodePlan::decode`] reads.
///
/// Row `b` holds sequence `b`'s blocks in position order and its length in tokens (new tokens
/// included). A row of length 0 is padding: a decode writes zeros (and `lse = -inf`) for its
/// queries and reads nothing of the cache for it. [`batch`](Self::batch) rows take part in a
/// decode; rows past it are ignored.
///
/// Per step an engine changes rows ([`set_row`](Self::set_row), [`push_block`](Self::push_block),
/// [`set_len`](Self::set_len), [`clear_row`](Self::clear_row), [`set_batch`](Self::set_batch))
/// and calls [`upload`](Self::upload) once: it copies the changed span of the host mirror into
/// one of two pinned buffers and from there to the device, asynchronously on the tables' stream.
/// Call it outside a CUDA graph capture (it is host work); the graph's decode then reads the
/// uploaded tables at their fixed addresses. A decode refuses tables with changes not uploaded.
///
/// [`DecodePlan::decode`]: super::decode::DecodePlan::decode
#[derive(Debug)]
pub struct DeviceBlockTables {
    gpu: Gpu,
    /// `[capacity]` context lengths, `[2 * MAX_PAIRS]` changed entries (index, value), then
    /// `[capacity, max_blocks]` block ids; held for its memory, used through `dev_ptr` (see
    /// [`owned_ptr`](super::owned_ptr)).
    _dev: CudaSlice<i32>,
    dev_ptr: CUdeviceptr,
    /// The same layout on the host (the pairs area unused): the truth the device follows.
    host: Vec<i32>,
    staging: [Staging; 2],
    next_staging: usize,
    /// Whether the lengths changed since the last upload.
    lens_dirty: bool,
    /// Block-table entries (indices into `host`) changed since the last upload, each once.
    pending: Vec<u32>,
    /// `marked[i - table_start]`: entry i is in `pending`.
    marked: Vec<bool>,
    capacity: usize,
    max_blocks: usize,
    block_size: usize,
    num_blocks: usize,
    batch: usize,
    /// Blocks set in each row (entries past them are -1).
    held: Vec<usize>,
    /// Longest and shortest non-zero context among the first `batch` rows, as uploaded.
    max_len: usize,
    min_nonzero_len: usize,
}

impl DeviceBlockTables {
    /// Empty tables (every row length 0, batch 0) for up to `capacity` sequences of up to
    /// `max_blocks` blocks each, over the pool of `cache`, on the cache's stream.
    pub fn with_capacity(cache: &DeviceCache, capacity: usize, max_blocks: usize) -> Result<Self> {
        Self::with_capacity_on(cache.gpu(), cache, capacity, max_blocks)
    }

    /// [`with_capacity`](Self::with_capacity) with uploads on `gpu`'s stream (a stream of the
    /// cache's device).
    pub fn with_capacity_on(
        gpu: &Gpu,
        cache: &DeviceCache,
        capacity: usize,
        max_blocks: usize,
    ) -> Result<Self> {
        for (what, value) in [("capacity", capacity), ("max_blocks", max_blocks)] {
            if value == 0 || value > i32::MAX as usize {
                return Err(Error::Config {
                    what,
                    value,
                    expected: "1..=i32::MAX",
                });
            }
        }
        if gpu.context() != cache.gpu().context() {
            return Err(Error::InvalidArgument(format!(
                "block tables on GPU {} for a cache on GPU {}",
                gpu.props().ordinal,
                cache.gpu().props().ordinal
            )));
        }
        let total = capacity
            .checked_mul(max_blocks)
            .and_then(|n| n.checked_add(capacity + 2 * MAX_PAIRS))
            .filter(|&n| n <= i32::MAX as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "block tables of {capacity} rows x {max_blocks} blocks are too large"
                ))
            })?;
        let block_size = cache.config().block_size;
        if max_blocks.saturating_mul(block_size) > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "{max_blocks} blocks of {block_size} tokens exceed an i32 context length"
            )));
        }
        gpu.bind()?;
        let s = gpu.stream();
        let mut host = vec![BlockTables::UNUSED; total];
        host[..capacity].fill(0);
        let table_entries = capacity * max_blocks;
        let dev = s
            .clone_htod(&host)
            .map_err(driver_err("uploading block tables"))?;
        let dev_ptr = super::owned_ptr(&dev);
        let pinned = || -> Result<Staging> {
            // SAFETY: written (the copied span) before every copy out of it.
            let buf = unsafe { gpu.context().alloc_pinned::<i32>(total) }
                .map_err(driver_err("allocating pinned staging for block tables"))?;
            Ok(Staging { buf, done: None })
        };
        Ok(DeviceBlockTables {
            gpu: gpu.clone(),
            _dev: dev,
            dev_ptr,
            host,
            staging: [pinned()?, pinned()?],
            next_staging: 0,
            lens_dirty: false,
            pending: Vec::with_capacity(MAX_PAIRS),
            marked: vec![false; table_entries],
            capacity,
            max_blocks,
            block_size,
            num_blocks: cache.num_blocks(),
            batch: 0,
            held: vec![0; capacity],
            max_len: 0,
            min_nonzero_len: 0,
        })
    }

    /// Tables of `tables`' batch and `max_blocks` (the capacity), checked against `cache`
    /// ([`BlockTables::validate`]) and uploaded.
    pub fn new(cache: &DeviceCache, tables: &BlockTables) -> Result<Self> {
        let mut t = Self::with_capacity(cache, tables.batch().max(1), tables.max_blocks)?;
        t.update(tables)?;
        Ok(t)
    }

    /// Replace every row with `tables` (batch and `max_blocks` at most the capacity; checked
    /// against the pool) and upload.
    pub fn update(&mut self, tables: &BlockTables) -> Result<()> {
        if tables.batch() > self.capacity || tables.max_blocks > self.max_blocks {
            return Err(Error::InvalidArgument(format!(
                "tables of batch {} and max_blocks {} exceed the capacity of {} rows x {} blocks",
                tables.batch(),
                tables.max_blocks,
                self.capacity,
                self.max_blocks
            )));
        }
        tables.validate(self.num_blocks, self.block_size)?;
        for b in 0..tables.batch() {
            let len = tables.context_lens[b] as usize;
            self.write_row(b, &tables.row(b)[..len.div_ceil(self.block_size)], len);
        }
        for b in tables.batch()..self.batch {
            self.write_row(b, &[], 0);
        }
        self.batch = tables.batch();
        self.upload()
    }

    /// Rows that take part in a decode (at most the capacity).
    pub fn set_batch(&mut self, batch: usize) -> Result<()> {
        if batch > self.capacity {
            return Err(Error::InvalidArgument(format!(
                "batch {batch} exceeds the tables' capacity of {} rows",
                self.capacity
            )));
        }
        self.batch = batch;
        self.refresh_lengths();
        Ok(())
    }

    fn check_index(&self, row: usize) -> Result<()> {
        if row >= self.capacity {
            return Err(Error::InvalidArgument(format!(
                "row {row} is outside the tables' {} rows",
                self.capacity
            )));
        }
        Ok(())
    }

    fn check_len(&self, row: usize, len: usize, blocks: usize) -> Result<()> {
        if len.div_ceil(self.block_size) > blocks {
            return Err(Error::InvalidArgument(format!(
                "row {row}: {len} tokens need {} blocks of {}, the row holds {blocks}",
                len.div_ceil(self.block_size),
                self.block_size
            )));
        }
        Ok(())
    }

    /// Sequence `row`: its blocks in position order (at most `max_blocks`, each a block of the
    /// pool) and its length in tokens (at most `blocks.len() * block_size`).
    pub fn set_row(&mut self, row: usize, blocks: &[i32], len: usize) -> Result<()> {
        self.check_index(row)?;
        if blocks.len() > self.max_blocks {
            return Err(Error::Length {
                what: "block table row (at most max_blocks entries)",
                expected: self.max_blocks,
                actual: blocks.len(),
            });
        }
        check_row(
            blocks,
            Some(row),
            blocks.len() * self.block_size,
            self.block_size,
            self.num_blocks,
        )?;
        self.check_len(row, len, blocks.len())?;
        self.write_row(row, blocks, len);
        Ok(())
    }

    /// Append one block to row `row` (a sequence that grew past its last block).
    pub fn push_block(&mut self, row: usize, block: i32) -> Result<()> {
        self.check_index(row)?;
        let at = self.held[row];
        if at >= self.max_blocks {
            return Err(Error::InvalidArgument(format!(
                "row {row} already holds max_blocks = {} blocks",
                self.max_blocks
            )));
        }
        check_row(&[block], Some(row), 1, 1, self.num_blocks)?;
        let i = self.table_start() + row * self.max_blocks + at;
        self.set_entry(i, block);
        self.held[row] = at + 1;
        Ok(())
    }

    /// Row `row`'s length in tokens (new ones included; at most what its blocks hold).
    pub fn set_len(&mut self, row: usize, len: usize) -> Result<()> {
        self.check_index(row)?;
        self.check_len(row, len, self.held[row])?;
        self.host[row] = len as i32;
        self.lens_dirty = true;
        Ok(())
    }

    /// Make row `row` padding: no blocks, length 0.
    pub fn clear_row(&mut self, row: usize) -> Result<()> {
        self.check_index(row)?;
        self.write_row(row, &[], 0);
        Ok(())
    }

    /// Index in `host` (and on the device) of the first block-table entry.
    fn table_start(&self) -> usize {
        self.capacity + 2 * MAX_PAIRS
    }

    /// Set block-table entry `i` (an index into `host`) and mark it for upload if it changed.
    fn set_entry(&mut self, i: usize, value: i32) {
        if self.host[i] == value {
            return;
        }
        self.host[i] = value;
        let m = &mut self.marked[i - self.capacity - 2 * MAX_PAIRS];
        if !*m {
            *m = true;
            self.pending.push(i as u32);
        }
    }

    /// Write a checked row into the host mirror and mark what changed for upload.
    fn write_row(&mut self, row: usize, blocks: &[i32], len: usize) {
        let start = self.table_start() + row * self.max_blocks;
        let old = self.held[row];
        for (k, &b) in blocks.iter().enumerate() {
            self.set_entry(start + k, b);
        }
        for k in blocks.len()..old {
            self.set_entry(start + k, BlockTables::UNUSED);
        }
        self.held[row] = blocks.len();
        self.host[row] = len as i32;
        self.lens_dirty = true;
    }

    /// Send what changed since the last upload to the device, asynchronously on the tables'
    /// stream: one copy of the lengths and of the changed block-table entries as (index, value)
    /// pairs, and one small kernel that puts them in place (when more than 4096 entries
    /// changed, a second copy of the span they cover instead). Waits on the host only if the
    /// pinned buffer it writes was last copied from two uploads ago and that copy has not run
    /// yet.
    pub fn upload(&mut self) -> Result<()> {
        self.refresh_lengths();
        if !self.lens_dirty && self.pending.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream().clone();
        let cu = stream.cu_stream();
        let st = &mut self.staging[self.next_staging];
        self.next_staging ^= 1;
        if let Some(e) = &st.done {
            e.synchronize()
                .map_err(driver_err("waiting for an earlier table upload"))?;
        }
        let buf = st
            .buf
            .as_mut_slice()
            .map_err(driver_err("mapping pinned staging"))?;
        let cap = self.capacity;
        let table_start = cap + 2 * MAX_PAIRS;
        let pairs = if self.pending.len() <= MAX_PAIRS {
            self.pending.len()
        } else {
            0
        };
        // Lengths and pairs: one contiguous copy.
        buf[..cap].copy_from_slice(&self.host[..cap]);
        for (k, &i) in self.pending[..pairs].iter().enumerate() {
            buf[cap + 2 * k] = (i as usize - table_start) as i32;
            buf[cap + 2 * k + 1] = self.host[i as usize];
        }
        let head = cap + 2 * pairs;
        // SAFETY: `dev` holds `host.len()` i32 and `..head` lies inside it; the source is pinned
        // memory not written again before `done` (recorded below) completes.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.dev_ptr, &buf[..head], cu) }
            .map_err(driver_err("uploading block tables"))?;
        if pairs > 0 {
            // SAFETY: the pairs just copied name distinct entries of the table region.
            unsafe {
                launch::scatter_i32(
                    (self.dev_ptr + (table_start * 4) as CUdeviceptr) as *mut i32,
                    (self.dev_ptr + (cap * 4) as CUdeviceptr) as *const i32,
                    pairs as i64,
                    cu,
                )?;
            }
        } else if !self.pending.is_empty() {
            let lo = *self.pending.iter().min().expect("not empty") as usize;
            let hi = *self.pending.iter().max().expect("not empty") as usize + 1;
            buf[lo..hi].copy_from_slice(&self.host[lo..hi]);
            // SAFETY: as above, for the span lo..hi of the table region.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.dev_ptr + (lo * 4) as CUdeviceptr,
                    &buf[lo..hi],
                    cu,
                )
            }
            .map_err(driver_err("uploading block tables"))?;
        }
        let done = match st.done.take() {
            Some(e) => e,
            None => self
                .gpu
                .context()
                .new_event(None)
                .map_err(driver_err("creating an upload event"))?,
        };
        done.record(&stream)
            .map_err(driver_err("recording an upload event"))?;
        st.done = Some(done);
        for &i in &self.pending {
            self.marked[i as usize - table_start] = false;
        }
        self.pending.clear();
        self.lens_dirty = false;
        Ok(())
    }

    fn refresh_lengths(&mut self) {
        let lens = &self.host[..self.batch];
        self.max_len = lens.iter().map(|&l| l as usize).max().unwrap_or(0);
        self.min_nonzero_len = lens
            .iter()
            .map(|&l| l as usize)
            .filter(|&l| l > 0)
            .min()
            .unwrap_or(0);
    }

    /// Whether every change has been uploaded.
    pub fn is_uploaded(&self) -> bool {
        !self.lens_dirty && self.pending.is_empty()
    }

    /// The handle whose stream the uploads go to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    /// Rows that take part in a decode.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Most rows.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Row stride of the table (most blocks per sequence).
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    /// Blocks in the pool the rows were checked against.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Longest context of the first `batch` rows, as last uploaded.
    pub fn max_context_len(&self) -> usize {
        self.max_len
    }
    /// Shortest non-zero context of the first `batch` rows, as last uploaded (0: all padding).
    pub fn min_context_len(&self) -> usize {
        self.min_nonzero_len
    }
    /// Length of row `row` on the host (uploaded or not).
    pub fn len(&self, row: usize) -> Option<usize> {
        (row < self.capacity).then(|| self.host[row] as usize)
    }
    /// Blocks set in row `row` (None outside the capacity): where [`push_block`](Self::push_block)
    /// appends.
    pub fn row_blocks(&self, row: usize) -> Option<usize> {
        self.held.get(row).copied()
    }
    /// Whether no row takes part (`batch() == 0`).
    pub fn is_empty(&self) -> bool {
        self.batch == 0
    }

    /// Device addresses of the context lengths and of the block ids.
    pub(crate) fn device_ptrs(&self) -> (CUdeviceptr, CUdeviceptr) {
        (
            self.dev_ptr,
            self.dev_ptr + (self.table_start() * 4) as CUdeviceptr,
        )
    }
}
