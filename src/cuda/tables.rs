//! [`DeviceBlockTables`]: the block tables and context lengths a decode reads, in device memory,
//! sized once for a capacity (most sequences, most blocks per sequence) and updated in place
//! every step: rows change on the host (checked against the pool as they change), the lengths
//! and the changed block-table entries go into pinned host memory the GPU reads directly, and
//! one small kernel puts them in place. One launch, no copy, no allocation and no host
//! synchronization per step; the device addresses never change, so a decode captured in a CUDA
//! graph reads the current tables on every replay.

use super::{DecodeCapacity, DeviceCache, Gpu, PrefillCapacity, driver_err, launch};
use crate::cache::{BlockTables, check_row};
use crate::error::{Error, Result};
use crate::layout::BlockLayout;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// What [`DeviceBlockTables`] are sized for: rows, and the longest context in tokens (new
/// tokens included), as a plan's capacity states them (`From` a [`DecodeCapacity`] or a
/// [`PrefillCapacity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TablesCapacity {
    /// Most sequences (rows) per step.
    pub max_batch: usize,
    /// Longest context, in tokens.
    pub max_context_len: usize,
}

impl TablesCapacity {
    /// The capacity that holds both `self` and `other` (each field's larger).
    pub fn covering(self, other: TablesCapacity) -> TablesCapacity {
        TablesCapacity {
            max_batch: self.max_batch.max(other.max_batch),
            max_context_len: self.max_context_len.max(other.max_context_len),
        }
    }
}

impl From<DecodeCapacity> for TablesCapacity {
    fn from(c: DecodeCapacity) -> Self {
        TablesCapacity {
            max_batch: c.max_batch,
            max_context_len: c.max_context_len,
        }
    }
}

impl From<PrefillCapacity> for TablesCapacity {
    fn from(c: PrefillCapacity) -> Self {
        TablesCapacity {
            max_batch: c.max_batch,
            max_context_len: c.max_context_len,
        }
    }
}

/// Changed block-table entries one upload sends as (index, value) pairs at most; more go as
/// one copy of the span they cover.
const MAX_PAIRS: usize = 4096;

/// Pinned host memory mapped into the device, allocated whole: `len` elements, with their host
/// and device addresses.
#[derive(Debug)]
struct Mapped<T> {
    /// Held for its memory (freed on drop), used through `host` and `dev`.
    _buf: PinnedHostSlice<T>,
    host: *mut T,
    dev: CUdeviceptr,
}

// SAFETY: the pointers address `buf`, owned here; the host side is written only through
// `&mut DeviceBlockTables` and read by the device only between a launch and its `done` word.
unsafe impl<T> Send for Mapped<T> {}
// SAFETY: as above; `&Mapped` gives no access to the memory.
unsafe impl<T> Sync for Mapped<T> {}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Mapped<T> {
    fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        // SAFETY: every element is written before the device reads it (the update kernel
        // reads only what the host wrote for that launch; `done` words start at zero below).
        let mut buf = unsafe {
            gpu.context()
                .alloc_pinned_with_flags::<T>(len, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(driver_err(
            "allocating mapped pinned memory for block tables",
        ))?;
        let host = buf
            .as_mut_ptr()
            .map_err(driver_err("mapping pinned memory"))?;
        // SAFETY: `host` starts `len` elements of owned pinned memory; zero is valid for T.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let mut dev: CUdeviceptr = 0;
        // SAFETY: `host` is a mapped pinned allocation of this context.
        unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0)
                .result()
                .map_err(driver_err("mapping pinned memory into the device"))?;
        }
        Ok(Mapped {
            _buf: buf,
            host,
            dev,
        })
    }
}

/// The two halves of the upload path: lengths + pairs for the kernel to read, twice (the host
/// fills one while the device may still read the other), and the words the kernel sets to a
/// launch's generation once it has read its buffer.
#[derive(Debug)]
struct Staging {
    stream: Arc<CudaStream>,
    bufs: [Mapped<i32>; 2],
    done: Mapped<u32>,
    /// Generation of the last launch that read buffer i (0: none yet).
    issued: [u32; 2],
    next_gen: u32,
    next: usize,
    /// Uploads so far, and how many of them waited for the device.
    uploads: u64,
    waits: u64,
}

impl Staging {
    /// Buffer `i` once no launch still reads it: a read of the word the kernel sets, rarely a
    /// wait (only when the device is two uploads behind).
    fn claim(&mut self, i: usize) -> Result<*mut i32> {
        let want = self.issued[i];
        // SAFETY: `done.host` holds two u32 the device writes with volatile stores.
        let seen = || unsafe { std::ptr::read_volatile(self.done.host.add(i)) };
        self.uploads += 1;
        if want != 0 && seen() != want {
            self.waits += 1;
            self.stream
                .synchronize()
                .map_err(driver_err("waiting for an earlier table upload"))?;
        }
        Ok(self.bufs[i].host)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned memory is freed right after: a launch still reading it must finish first.
        let _ = self.stream.synchronize();
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
/// and calls [`upload`](Self::upload) once: it writes the lengths and the changed entries into
/// pinned memory the device reads and launches one kernel that puts them in place,
/// asynchronously on the tables' stream.
/// Call it outside a CUDA graph capture (it is host work); the graph's decode then reads the
/// uploaded tables at their fixed addresses. A decode refuses tables with changes not uploaded.
///
/// [`DecodePlan::decode`]: super::decode::DecodePlan::decode
#[derive(Debug)]
pub struct DeviceBlockTables {
    gpu: Gpu,
    /// `[capacity]` context lengths, one word the update kernel counts its blocks in, then
    /// `[capacity, max_blocks]` block ids; held for its memory, used through `dev_ptr` (see
    /// [`owned_ptr`](super::owned_ptr)).
    _dev: CudaSlice<i32>,
    dev_ptr: CUdeviceptr,
    /// The same layout on the host (the counter word unused): the truth the device follows.
    host: Vec<i32>,
    staging: Staging,
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
    /// Empty tables (every row length 0, batch 0) for up to `cap.max_batch` sequences of up to
    /// `cap.max_context_len` tokens each (in blocks of the cache's size), over the pool of
    /// `cache`, on the cache's stream. A plan's capacity converts:
    /// `DeviceBlockTables::with_capacity(&cache, decode_capacity.into())`; a decode and a
    /// prefill plan sharing the tables take [`TablesCapacity::covering`] both. One set of tables
    /// serves every layer's cache of the same layout and block count (those of
    /// `DeviceCache::new_per_layer`, say): a launch checks only those and that the tables are
    /// uploaded.
    pub fn with_capacity(cache: &DeviceCache, cap: TablesCapacity) -> Result<Self> {
        Self::with_capacity_on(cache.gpu(), cache, cap)
    }

    /// [`with_capacity`](Self::with_capacity) with uploads on `gpu`'s stream (a stream of the
    /// cache's device).
    pub fn with_capacity_on(gpu: &Gpu, cache: &DeviceCache, cap: TablesCapacity) -> Result<Self> {
        for (what, value) in [
            ("max_batch", cap.max_batch),
            ("max_context_len", cap.max_context_len),
        ] {
            if value == 0 {
                return Err(Error::Config {
                    what,
                    value,
                    expected: "at least 1",
                });
            }
        }
        let max_blocks = cap.max_context_len.div_ceil(cache.config().block_size);
        Self::with_blocks_on(gpu, cache, cap.max_batch, max_blocks)
    }

    /// Empty tables of `capacity` rows of `max_blocks` blocks.
    fn with_blocks_on(
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
            .and_then(|n| n.checked_add(capacity + 1))
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
        host[..=capacity].fill(0); // lengths 0 and the update kernel's block counter
        let table_entries = capacity * max_blocks;
        let dev = s
            .clone_htod(&host)
            .map_err(driver_err("uploading block tables"))?;
        let dev_ptr = super::owned_ptr(&dev);
        let staging_len = capacity + 2 * MAX_PAIRS;
        let staging = Staging {
            stream: s.clone(),
            bufs: [
                Mapped::new(gpu, staging_len)?,
                Mapped::new(gpu, staging_len)?,
            ],
            done: Mapped::new(gpu, 2)?,
            issued: [0, 0],
            next_gen: 1,
            next: 0,
            uploads: 0,
            waits: 0,
        };
        Ok(DeviceBlockTables {
            gpu: gpu.clone(),
            _dev: dev,
            dev_ptr,
            host,
            staging,
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
        let mut t =
            Self::with_blocks_on(cache.gpu(), cache, tables.batch().max(1), tables.max_blocks)?;
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
    /// pool) and its length in tokens (at most `blocks.len() * block_size`). Cheap to repeat
    /// with the same blocks: only entries that change are uploaded.
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

    /// Replace entry `index` of row `row` (one of its blocks, or the next one, which appends):
    /// a block swapped for its copy-on-write copy, for instance.
    pub fn set_block(&mut self, row: usize, index: usize, block: i32) -> Result<()> {
        self.check_index(row)?;
        let held = self.held[row];
        if index >= held {
            return if index == held {
                self.push_block(row, block)
            } else {
                Err(Error::InvalidArgument(format!(
                    "row {row} holds {held} blocks; entry {index} is past its end"
                )))
            };
        }
        check_row(&[block], Some(row), 1, 1, self.num_blocks)?;
        let i = self.table_start() + row * self.max_blocks + index;
        self.set_entry(i, block);
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
        self.capacity + 1
    }

    /// Set block-table entry `i` (an index into `host`) and mark it for upload if it changed.
    fn set_entry(&mut self, i: usize, value: i32) {
        if self.host[i] == value {
            return;
        }
        self.host[i] = value;
        let m = &mut self.marked[i - self.capacity - 1];
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
    /// stream: the lengths and the changed block-table entries, as (index, value) pairs, go
    /// into mapped pinned memory, and one kernel reads them from there and puts them in place
    /// (when more than 4096 entries changed, the span they cover is copied instead). Waits on
    /// the host only if the device is two uploads behind.
    pub fn upload(&mut self) -> Result<()> {
        self.refresh_lengths();
        if !self.lens_dirty && self.pending.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let cu = self.gpu.stream().cu_stream();
        let cap = self.capacity;
        let table_start = self.table_start();
        let pairs = if self.pending.len() <= MAX_PAIRS {
            self.pending.len()
        } else {
            // Many changes (a whole new batch): the span they cover, from the host mirror. A
            // pageable source is staged by the driver before the call returns.
            let lo = *self.pending.iter().min().expect("not empty") as usize;
            let hi = *self.pending.iter().max().expect("not empty") as usize + 1;
            // SAFETY: `dev` holds `host.len()` i32 and lo..hi lies inside it.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.dev_ptr + (lo * 4) as CUdeviceptr,
                    &self.host[lo..hi],
                    cu,
                )
            }
            .map_err(driver_err("uploading block tables"))?;
            0
        };
        let st = &mut self.staging;
        let i = st.next;
        st.next ^= 1;
        let buf = st.claim(i)?;
        // SAFETY: `buf` holds capacity + 2 * MAX_PAIRS i32 that no launch reads now (claim).
        let buf = unsafe { std::slice::from_raw_parts_mut(buf, cap + 2 * MAX_PAIRS) };
        buf[..cap].copy_from_slice(&self.host[..cap]);
        for (k, &e) in self.pending[..pairs].iter().enumerate() {
            buf[cap + 2 * k] = (e as usize - table_start) as i32;
            buf[cap + 2 * k + 1] = self.host[e as usize];
        }
        let generation = st.next_gen;
        st.next_gen = st.next_gen.wrapping_add(1).max(1);
        st.issued[i] = generation;
        // SAFETY: the staging buffer (mapped) holds cap lengths and `pairs` pairs of distinct
        // table indices; the lengths, counter and table live in `dev` (layout above), the
        // counter left zero by every launch; `done` is mapped memory of two words.
        unsafe {
            launch::tables_update(
                st.bufs[i].dev as *const i32,
                cap as i32,
                self.dev_ptr as *mut i32,
                (self.dev_ptr + (table_start * 4) as CUdeviceptr) as *mut i32,
                pairs as i64,
                (self.dev_ptr + (cap * 4) as CUdeviceptr) as *mut u32,
                (st.done.dev + (i * 4) as CUdeviceptr) as *mut u32,
                generation,
                cu,
            )?;
        }
        for &e in &self.pending {
            self.marked[e as usize - table_start] = false;
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

    /// Uploads so far that sent something, and how many of them had to wait for the device to
    /// finish reading a pinned buffer (a device two uploads behind the host).
    pub fn upload_stats(&self) -> (u64, u64) {
        (self.staging.uploads, self.staging.waits)
    }

    /// Whether every change has been uploaded.
    pub fn is_uploaded(&self) -> bool {
        !self.lens_dirty && self.pending.is_empty()
    }

    /// What an attention launch over `cache` needs of these tables and of the cache: the
    /// layout the plan was made for, the pool the tables were checked against, and nothing
    /// left to upload.
    pub(crate) fn check_for(&self, layout: &BlockLayout, cache: &DeviceCache) -> Result<()> {
        if cache.layout() != layout {
            return Err(Error::InvalidArgument(
                "the cache's layout differs from the one the plan was made for".into(),
            ));
        }
        if self.num_blocks() != cache.num_blocks() {
            return Err(Error::InvalidArgument(format!(
                "the block tables were checked against a pool of {} blocks, the cache has {}",
                self.num_blocks(),
                cache.num_blocks()
            )));
        }
        if !self.is_uploaded() {
            return Err(Error::InvalidArgument(
                "the block tables changed since their last upload (call upload first)".into(),
            ));
        }
        Ok(())
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
    /// Context length of row `row` on the host (uploaded or not; None outside the capacity).
    pub fn context_len(&self, row: usize) -> Option<usize> {
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
