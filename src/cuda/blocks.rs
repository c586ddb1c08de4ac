//! Whole-block operations on a [`DeviceCache`]: copies inside the pool (the copy-on-write
//! copies [`BlockAllocator::reserve`] asks for after a fork) and swapping blocks out to pinned
//! host memory and back (preemption). A block is every byte of one block id: codes and metadata
//! of every KV head, K and V; FP8 per-head scales belong to the whole cache and stay put.
//!
//! [`BlockAllocator::reserve`]: crate::cache::BlockAllocator::reserve

use super::{DeviceCache, Gpu, driver_err, launch};
use crate::cache::{
    CopyBlock, MAX_LAYERS, check_copies, copy_waves, layer_slot, pack_pair, shared_shape,
};
use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use std::borrow::{Borrow, BorrowMut};

/// Pairs one copy launch takes at most (its grid's last dimension).
const PAIRS_PER_LAUNCH: usize = 65535;

/// Device staging for a block-copy call, grown on demand (so steady-state copies allocate no
/// device memory): every layer's pool address, then its counters' address, then the pairs
/// ([`pack_pair`]), uploaded together in one copy.
#[derive(Debug, Default)]
pub(crate) struct CopyStaging {
    dev: Option<CudaSlice<u64>>,
    host: Vec<u64>,
}

impl CopyStaging {
    /// Upload `host` on `gpu`'s stream (the one the buffer was allocated on: every caller's
    /// caches share it) and return its device address.
    fn upload(&mut self, gpu: &Gpu) -> Result<CUdeviceptr> {
        let s = gpu.stream();
        let need = self.host.len();
        if self.dev.as_ref().is_none_or(|p| p.len() < need) {
            // SAFETY: written by the copy right below before any kernel reads it.
            let buf = unsafe { s.alloc::<u64>(need.next_power_of_two()) }
                .map_err(driver_err("allocating block-copy pairs"))?;
            self.dev = Some(buf);
        }
        let dev = self.dev.as_ref().expect("allocated above");
        let ptr = super::owned_ptr(dev);
        // A pageable source: the driver stages it before returning, and the copy is ordered
        // after any earlier kernel still reading the buffer (same stream).
        // SAFETY: the buffer holds at least `need` u64.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &self.host, s.cu_stream()) }
            .map_err(driver_err("uploading block-copy pairs"))?;
        Ok(ptr)
    }
}

fn check_block(what: &str, block: usize, num_blocks: usize) -> Result<()> {
    if block >= num_blocks {
        return Err(Error::InvalidArgument(format!(
            "{what}: block {block} is outside the pool of {num_blocks} blocks"
        )));
    }
    Ok(())
}

/// The `(block_stride, num_blocks)` that `caches` share, checked for one launch over all of
/// them: same shape ([`shared_shape`]) and same stream ([`Error::LayerMismatch`]), since one
/// launch is ordered on one stream only. `None` for no cache.
fn check_layers(caches: &[&DeviceCache]) -> Result<Option<(usize, usize)>> {
    let shape = shared_shape(
        caches
            .iter()
            .map(|c| (c.layout().block_stride, c.num_blocks())),
    )?;
    let stream = |c: &DeviceCache| format!("{:?}", c.gpu().stream().cu_stream());
    if let Some((first, rest)) = caches.split_first() {
        if let Some(i) = rest.iter().position(|c| !c.gpu().same_stream(first.gpu())) {
            return Err(Error::LayerMismatch {
                layer: i + 1,
                what: "stream",
                expected: format!("{} (layer 0's)", stream(first)),
                actual: stream(rest[i]),
            });
        }
    }
    Ok(shape)
}

/// Apply one copy list to every layer's cache (an engine's one cache per layer), as
/// [`DeviceCache::copy_blocks`] does to one, but with one launch per wave for all layers
/// instead of one per layer and wave. The caches must share `block_stride`, `num_blocks` and
/// the stream ([`Error::LayerMismatch`] otherwise; at most 65535 of them); ids are checked
/// before anything is enqueued. No caches is a no-op. The device staging lives in the first
/// cache, so steady-state calls allocate no device memory.
///
/// Takes `&mut [DeviceCache]` or `&mut [&mut DeviceCache]` alike.
pub fn copy_blocks_all<C: BorrowMut<DeviceCache>>(
    caches: &mut [C],
    copies: &[CopyBlock],
) -> Result<()> {
    let Some(first) = caches.first_mut() else {
        return Ok(());
    };
    let mut staging = std::mem::take(&mut first.borrow_mut().copy_staging);
    let refs: Vec<&DeviceCache> = caches.iter().map(|c| c.borrow()).collect();
    let r = copy_layers(&refs, copies, &mut staging);
    drop(refs);
    if let Some(first) = caches.first_mut() {
        first.borrow_mut().copy_staging = staging;
    }
    r
}

/// Copy `copies` (already in order, any ids) in every cache of `caches`, staging through
/// `staging`: the one-layer launcher for one cache, the all-layer one for more.
fn copy_layers(
    caches: &[&DeviceCache],
    copies: &[CopyBlock],
    staging: &mut CopyStaging,
) -> Result<()> {
    let Some((stride, n)) = check_layers(caches)? else {
        return Ok(());
    };
    check_copies(copies, n)?;
    let copies: Vec<CopyBlock> = copies.iter().copied().filter(|c| c.src != c.dst).collect();
    if copies.is_empty() {
        return Ok(());
    }
    let layers = caches.len();
    if let Some(l) = caches
        .iter()
        .position(|c| c.as_raw().pool as usize % 16 != 0)
    {
        return Err(Error::InvalidArgument(format!(
            "layer {l}'s pool is not 16-byte aligned (the copy kernels need it)"
        )));
    }
    let gpu = caches[0].gpu().clone();
    gpu.bind()?;
    let s = gpu.stream().cu_stream();
    staging.host.clear();
    staging
        .host
        .extend(caches.iter().map(|c| c.as_raw().pool as u64));
    staging.host.extend(caches.iter().map(|c| c.counters_raw()));
    staging.host.extend(copies.iter().map(|&c| pack_pair(c)));
    let base = staging.upload(&gpu)?;
    let word = size_of::<u64>() as CUdeviceptr;
    let counters = base + layers as CUdeviceptr * word;
    let pairs = base + 2 * layers as CUdeviceptr * word;
    for wave in copy_waves(&copies) {
        for at in wave.clone().step_by(PAIRS_PER_LAUNCH) {
            let len = PAIRS_PER_LAUNCH.min(wave.end - at);
            let first = (pairs + at as CUdeviceptr * word) as *const i32;
            // SAFETY: `first` points at 2 * len validated ids in the staging buffer, uploaded
            // above on this stream; every pool (and counter array) is a live cache's, of `n`
            // blocks of `stride` bytes, all on this stream (checked); within a wave
            // destinations are distinct and not sources.
            unsafe {
                if layers == 1 {
                    launch::copy_blocks(
                        &caches[0].as_raw(),
                        n as i64,
                        first,
                        len as i64,
                        caches[0].counters_ptr(),
                        s,
                    )?;
                } else {
                    launch::copy_blocks_layers(
                        base as *const *mut u8,
                        counters as *const *mut u64,
                        layers.min(MAX_LAYERS) as i32,
                        stride as i64,
                        n as i64,
                        first,
                        len as i64,
                        s,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// One block's move between a cache's pool and a [`SwapSpace`]: out of block `block` into slot
/// `slot` ([`DeviceCache::swap_out`]), or back from slot `slot` into block `block`
/// ([`DeviceCache::swap_in`]). Named, so that a list handed back for the swap-in cannot read
/// the other way round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SwapMove {
    /// A block of the cache's pool.
    pub block: usize,
    /// A slot of the swap space.
    pub slot: usize,
}

/// [`DeviceCache::swap_out`] for every layer's cache with one list: for each move, block
/// `block` of layer `l` goes to slot `slot * layers + l` of `space`, so an all-layer slot holds
/// one block of every layer (a space of `slots * layers` slots holds `slots` of them).
/// The caches must share `block_stride`, `num_blocks` and the stream ([`Error::LayerMismatch`]);
/// everything is checked before anything is enqueued, and the space's ordering event is waited
/// for and recorded once for all layers, not per layer. The copies themselves stay one
/// `cuMemcpyAsync` per block and layer: they run on the copy engines, not in a kernel.
pub fn swap_out_all<C: Borrow<DeviceCache>>(
    caches: &[C],
    moves: &[SwapMove],
    space: &mut SwapSpace,
) -> Result<()> {
    let refs: Vec<&DeviceCache> = caches.iter().map(|c| c.borrow()).collect();
    swap_layers(&refs, moves, space, Swap::Out)
}

/// [`DeviceCache::swap_in`] for every layer's cache with one list: the inverse of
/// [`swap_out_all`] (slot `slot * layers + l` goes back to block `block` of layer `l`).
pub fn swap_in_all<C: BorrowMut<DeviceCache>>(
    caches: &mut [C],
    moves: &[SwapMove],
    space: &mut SwapSpace,
) -> Result<()> {
    let refs: Vec<&DeviceCache> = caches.iter().map(|c| c.borrow()).collect();
    swap_layers(&refs, moves, space, Swap::In)
}

impl DeviceCache {
    /// Copy every byte of block `src` to block `dst` for each pair, on the cache's stream: the
    /// copy-on-write copies of a [`Reservation`], applied before writing its tokens (every
    /// layer's cache applies the same list: [`copy_blocks_all`] does all layers in one launch),
    /// or any list. The list applies in order, by the
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
        let mut staging = std::mem::take(&mut self.copy_staging);
        let r = copy_layers(&[&*self], copies, &mut staging);
        self.copy_staging = staging;
        r
    }

    /// Copy each move's block to its slot of `space`, asynchronously on the cache's stream: the
    /// blocks of a preempted sequence. The blocks may be reused as soon as this returns (later
    /// work on the stream runs after the copies).
    pub fn swap_out(&self, moves: &[SwapMove], space: &mut SwapSpace) -> Result<()> {
        swap_layers(&[self], moves, space, Swap::Out)
    }

    /// Copy each move's slot of `space` back into its block, asynchronously on the cache's
    /// stream, after any swap-out into those slots queued earlier.
    pub fn swap_in(&mut self, moves: &[SwapMove], space: &mut SwapSpace) -> Result<()> {
        swap_layers(&[&*self], moves, space, Swap::In)
    }

    /// Device address of block `block` (checked by the caller).
    fn block_ptr(&self, block: usize) -> CUdeviceptr {
        self.as_raw().pool as CUdeviceptr + (block * self.layout().block_stride) as CUdeviceptr
    }
}

/// One swap of `moves` for every cache of `caches` (layer `l` uses space slot
/// [`layer_slot`]`(slot, l, layers)`: `slot` itself for one cache): everything checked first,
/// then one async copy per block and layer, ordered after the space's last copies on another
/// stream.
fn swap_layers(
    caches: &[&DeviceCache],
    moves: &[SwapMove],
    space: &mut SwapSpace,
    dir: Swap,
) -> Result<()> {
    if check_layers(caches)?.is_none() {
        return Ok(());
    }
    let layers = caches.len();
    for (l, c) in caches.iter().enumerate() {
        space.check(
            c,
            moves
                .iter()
                .map(|m| (m.block, layer_slot(m.slot, l, layers))),
        )?;
    }
    let gpu = caches[0].gpu().clone();
    gpu.bind()?;
    let stream = gpu.stream().cu_stream();
    gpu.wait_for(&space.gpu)?;
    let bytes = space.block_bytes;
    let host = space
        .buf
        .as_mut_slice()
        .map_err(driver_err("mapping swap space"))?;
    for (l, cache) in caches.iter().enumerate() {
        for &SwapMove { block, slot } in moves {
            let slot = layer_slot(slot, l, layers);
            let dev = cache.block_ptr(block);
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
    }
    space.record(&gpu)
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
/// its own slots, or let [`swap_out_all`] lay them out).
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
