//! Whole-block operations on a [`DeviceCache`]: copies inside the pool (the copy-on-write
//! copies [`BlockAllocator::reserve`] asks for after a fork) and swapping blocks out to pinned
//! host memory and back (preemption). A block is every byte of one block id: codes and metadata
//! of every KV head, K and V; FP8 per-head scales belong to the whole cache and stay put.
//!
//! [`BlockAllocator::reserve`]: crate::cache::BlockAllocator::reserve

use super::{DeviceCache, Gpu, driver_err, launch};
use crate::cache::{CopyBlock, check_copies, copy_waves};
use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

/// Pairs one copy launch takes at most (its grid's second dimension).
const PAIRS_PER_LAUNCH: usize = 65535;

/// Device staging for block-copy pairs, grown on demand (so steady-state copies allocate
/// nothing).
#[derive(Debug, Default)]
pub(crate) struct CopyStaging {
    pairs: Option<CudaSlice<i32>>,
    host: Vec<i32>,
}

fn check_block(what: &str, block: usize, num_blocks: usize) -> Result<()> {
    if block >= num_blocks {
        return Err(Error::InvalidArgument(format!(
            "{what}: block {block} is outside the pool of {num_blocks} blocks"
        )));
    }
    Ok(())
}

impl DeviceCache {
    /// Copy every byte of block `src` to block `dst` for each pair, on the cache's stream: the
    /// copy-on-write copies of a [`Reservation`], applied before writing its tokens (every
    /// layer's cache applies the same list), or any list. The list applies in order, by the
    /// rules [`HostCache::apply_copies`] follows, so the two leave the same bytes: `src == dst`
    /// is a no-op, a chain (`a → b`, then `b → c`) passes `a`'s bytes on, the later of two
    /// copies into one block wins, and every id must be a block of the pool
    /// ([`Error::BlockIndex`], checked before anything is enqueued). Independent copies run in
    /// one launch; each copy that depends on an earlier one of the list starts another (a
    /// reservation's list has none).
    ///
    /// [`Reservation`]: crate::cache::Reservation
    /// [`HostCache::apply_copies`]: crate::cache::HostCache::apply_copies
    pub fn copy_blocks(&mut self, copies: &[CopyBlock]) -> Result<()> {
        let n = self.num_blocks();
        check_copies(copies, n)?;
        let copies: Vec<CopyBlock> = copies.iter().copied().filter(|c| c.src != c.dst).collect();
        if copies.is_empty() {
            return Ok(());
        }
        let gpu = self.gpu().clone();
        gpu.bind()?;
        let s = gpu.stream();
        let staging = &mut self.copy_staging;
        staging.host.clear();
        for c in &copies {
            staging.host.extend([c.src as i32, c.dst as i32]);
        }
        let need = staging.host.len();
        if staging.pairs.as_ref().is_none_or(|p| p.len() < need) {
            // SAFETY: written by the copy right below before the kernel reads it.
            let buf = unsafe { s.alloc::<i32>(need.next_power_of_two()) }
                .map_err(driver_err("allocating block-copy pairs"))?;
            staging.pairs = Some(buf);
        }
        let pairs = staging.pairs.as_mut().expect("allocated above");
        let pairs_ptr = super::owned_ptr(pairs);
        // A pageable source: the driver stages it before returning, and the copy is ordered
        // after any earlier kernel still reading `pairs` (same stream).
        // SAFETY: `pairs` holds at least `need` i32.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(pairs_ptr, &staging.host, s.cu_stream())
        }
        .map_err(driver_err("uploading block-copy pairs"))?;
        let raw = self.as_raw();
        for wave in copy_waves(&copies) {
            for at in wave.clone().step_by(PAIRS_PER_LAUNCH) {
                let len = PAIRS_PER_LAUNCH.min(wave.end - at);
                let first = pairs_ptr + (at * 2 * size_of::<i32>()) as CUdeviceptr;
                // SAFETY: `first` points at 2 * len validated ids inside `pairs`; the pool is
                // this cache's; within a wave destinations are distinct and not sources.
                unsafe {
                    launch::copy_blocks(
                        &raw,
                        n as i64,
                        first as *const i32,
                        len as i64,
                        self.counters_ptr(),
                        s.cu_stream(),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Copy blocks to slots of `space` (pairs `(block, slot)`), asynchronously on the cache's
    /// stream: the blocks of a preempted sequence. The blocks may be reused as soon as this
    /// returns (later work on the stream runs after the copies).
    pub fn swap_out(&self, moves: &[(usize, usize)], space: &mut SwapSpace) -> Result<()> {
        self.swap(moves.iter().copied(), space, Swap::Out)
    }

    /// Copy slots of `space` back into blocks (pairs `(slot, block)`), asynchronously on the
    /// cache's stream, after any swap-out into those slots queued earlier.
    pub fn swap_in(&mut self, moves: &[(usize, usize)], space: &mut SwapSpace) -> Result<()> {
        self.swap(moves.iter().map(|&(s, b)| (b, s)), space, Swap::In)
    }

    /// One swap: `(block, slot)` pairs, checked first, then one async copy each, ordered after
    /// the space's last copies on another stream.
    fn swap(
        &self,
        moves: impl Iterator<Item = (usize, usize)> + Clone,
        space: &mut SwapSpace,
        dir: Swap,
    ) -> Result<()> {
        space.check(self, moves.clone())?;
        let gpu = self.gpu().clone();
        gpu.bind()?;
        let stream = gpu.stream().cu_stream();
        gpu.wait_for(&space.gpu)?;
        let bytes = space.block_bytes;
        let host = space
            .buf
            .as_mut_slice()
            .map_err(driver_err("mapping swap space"))?;
        for (block, slot) in moves {
            let dev = self.block_ptr(block);
            let host = &mut host[slot * bytes..(slot + 1) * bytes];
            // SAFETY: `dev` is `bytes` bytes of a live pool block (checked); `host` is pinned
            // memory that stays alive until `done` (recorded below) completes.
            let copied = unsafe {
                match dir {
                    Swap::Out => cudarc::driver::result::memcpy_dtoh_async(host, dev, stream),
                    Swap::In => cudarc::driver::result::memcpy_htod_async(dev, host, stream),
                }
            };
            copied.map_err(driver_err("swapping a block"))?;
        }
        space.record(&gpu)
    }

    /// Device address of block `block` (checked by the caller).
    fn block_ptr(&self, block: usize) -> CUdeviceptr {
        self.as_raw().pool as CUdeviceptr + (block * self.layout().block_stride) as CUdeviceptr
    }
}

/// Which way a swap copies.
#[derive(Debug, Clone, Copy)]
enum Swap {
    /// Device blocks to host slots.
    Out,
    /// Host slots to device blocks.
    In,
}

/// Pinned host memory holding swapped-out blocks of caches of one layout: `slots` blocks of
/// `block_stride` bytes each. One space can serve the caches of every layer (give each layer
/// its own slots).
#[derive(Debug)]
pub struct SwapSpace {
    gpu: Gpu,
    buf: PinnedHostSlice<u8>,
    block_bytes: usize,
    slots: usize,
    /// Recorded after the last copy in or out (None before the first).
    done: Option<CudaEvent>,
}

impl SwapSpace {
    /// Room for `slots` blocks of `cache`'s layout, in pinned host memory.
    pub fn new(cache: &DeviceCache, slots: usize) -> Result<Self> {
        let block_bytes = cache.layout().block_stride;
        let total = slots
            .checked_mul(block_bytes)
            .filter(|&b| b > 0 && b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a swap space of {slots} blocks of {block_bytes} bytes"
                ))
            })?;
        let gpu = cache.gpu().clone();
        // SAFETY: any byte value is a valid u8; a slot swapped in before anything was swapped
        // out to it gives the block unspecified (but initialized-as-bytes) contents.
        let buf = unsafe { gpu.context().alloc_pinned::<u8>(total) }
            .map_err(driver_err("allocating pinned swap space"))?;
        Ok(SwapSpace {
            gpu,
            buf,
            block_bytes,
            slots,
            done: None,
        })
    }

    /// Blocks it holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Wait until every copy into or out of this space has finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.done {
            Some(e) => e
                .synchronize()
                .map_err(driver_err("waiting for swap copies")),
            None => Ok(()),
        }
    }

    fn check(
        &self,
        cache: &DeviceCache,
        pairs: impl Iterator<Item = (usize, usize)>,
    ) -> Result<()> {
        if cache.layout().block_stride != self.block_bytes {
            return Err(Error::InvalidArgument(format!(
                "a swap space of {}-byte blocks for a cache of {}-byte blocks",
                self.block_bytes,
                cache.layout().block_stride
            )));
        }
        if cache.gpu().context() != self.gpu.context() {
            return Err(Error::InvalidArgument(
                "the swap space belongs to another GPU".into(),
            ));
        }
        for (block, slot) in pairs {
            check_block("swapped block", block, cache.num_blocks())?;
            if slot >= self.slots {
                return Err(Error::InvalidArgument(format!(
                    "swap slot {slot} is outside the space's {} slots",
                    self.slots
                )));
            }
        }
        Ok(())
    }

    fn record(&mut self, gpu: &Gpu) -> Result<()> {
        let e = match self.done.take() {
            Some(e) => e,
            None => gpu
                .context()
                .new_event(None)
                .map_err(driver_err("creating a swap event"))?,
        };
        e.record(gpu.stream())
            .map_err(driver_err("recording a swap event"))?;
        self.done = Some(e);
        self.gpu = gpu.clone();
        Ok(())
    }
}

impl Drop for SwapSpace {
    fn drop(&mut self) {
        // The pinned memory is freed right after: copies still using it must finish first.
        let _ = self.synchronize();
    }
}
