//! [`DeviceCache`]: one layer's quantized K/V pool in device memory, byte for byte the layout of
//! a [`HostCache`] (both follow [`BlockLayout`]), plus the per-KV-head scales (FP8 `s`, FP4 `g`)
//! and the device counters the append kernels report into.

use std::sync::Arc;

use super::{Gpu, driver_err, owned_ptr, sys};
use crate::cache::{HostCache, POISON, check_head_scales};
use crate::error::{Error, Result, at_least_one};
use crate::layout::{BlockLayout, CacheConfig};
use cudarc::driver::{CudaSlice, CudaView, DevicePtrMut};

/// Largest `head_dim` the CUDA kernels serve (a row's lanes fit in one thread block).
pub const MAX_GPU_HEAD_DIM: usize = 2048;

/// Most token slots one GPU pool may have (the kernels index slots with 31-bit integers).
pub const MAX_GPU_SLOTS: usize = (1 << 31) - 256;

/// What the append kernels counted since the last [`DeviceCache::take_counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AppendCounters {
    /// Non-finite inputs met (written as their sanitized values, FORMATS.md).
    pub non_finite: u64,
    /// Faults (an engine bug, reported by [`DeviceCache::check_appends`] as an error): tokens
    /// skipped because their slot was outside the pool, and decode / block-copy thread blocks
    /// that met a block id outside the pool or a context longer than its table row.
    pub out_of_range: u64,
    /// Finite inputs the appends saturated: past ±65504 (FORMATS.md's clamp), or on an FP8 /
    /// FP4 side past its KV head's scale times the largest code (448 for E4M3): the elements
    /// [`HostCache::write_strict`] refuses. A count that grows says the scales want
    /// calibrating ([`set_scales`](DeviceCache::set_scales)).
    pub saturated: u64,
}

/// Where a layer's pool lives: an allocation of its own, or a range of one allocation that
/// several layers share ([`DeviceCache::new_per_layer`]; the allocation is freed with its last
/// layer). Each layer alone reads and writes its range.
#[derive(Debug)]
enum PoolMemory {
    Own(CudaSlice<u8>),
    Shared {
        memory: Arc<CudaSlice<u8>>,
        offset: usize,
        len: usize,
    },
}

/// Alignment of each layer's range in a shared allocation (the kernels need 16 bytes).
const LAYER_ALIGN: usize = 256;

/// Quantized K/V storage of one layer in device memory.
#[derive(Debug)]
pub struct DeviceCache {
    gpu: Gpu,
    layout: BlockLayout,
    raw_layout: sys::kvq_layout,
    num_blocks: usize,
    pool: PoolMemory,
    k_scales: CudaSlice<f32>,
    v_scales: CudaSlice<f32>,
    host_k_scales: Vec<f32>,
    host_v_scales: Vec<f32>,
    counters: CudaSlice<u64>,
    /// Reused device memory for block-copy pairs (see `blocks.rs`).
    pub(crate) copy_staging: super::blocks::CopyStaging,
    /// Device addresses of pool, K scales, V scales and counters (see [`owned_ptr`]).
    ptrs: [cudarc::driver::sys::CUdeviceptr; 4],
}

/// The C view of a layout; [`Error::Unsupported`] when a field does not fit the ABI's int32.
pub(crate) fn raw_layout(l: &BlockLayout) -> Result<sys::kvq_layout> {
    let c = &l.config;
    let i = |what: &str, v: usize| -> Result<i32> {
        i32::try_from(v).map_err(|_| {
            Error::Unsupported(format!("{what} = {v} does not fit the CUDA layout's int32"))
        })
    };
    let i64_ = |what: &str, v: usize| -> Result<i64> {
        i64::try_from(v)
            .map_err(|_| Error::Unsupported(format!("{what} = {v} does not fit an int64")))
    };
    Ok(sys::kvq_layout {
        num_kv_heads: i("num_kv_heads", c.num_kv_heads)?,
        head_dim: i("head_dim", c.head_dim)?,
        block_size: i("block_size", c.block_size)?,
        k_format: c.k_format as i32,
        v_format: c.v_format as i32,
        k_codes_offset: i("k codes offset", l.k_codes.offset)?,
        k_codes_row: i("k codes row", l.k_codes.row_bytes)?,
        k_meta_offset: i("k meta offset", l.k_meta.offset)?,
        k_meta_row: i("k meta row", l.k_meta.row_bytes)?,
        v_codes_offset: i("v codes offset", l.v_codes.offset)?,
        v_codes_row: i("v codes row", l.v_codes.row_bytes)?,
        v_meta_offset: i("v meta offset", l.v_meta.offset)?,
        v_meta_row: i("v meta row", l.v_meta.row_bytes)?,
        head_stride: i64_("head_stride", l.head_stride)?,
        block_stride: i64_("block_stride", l.block_stride)?,
    })
}

impl DeviceCache {
    /// An all-[`POISON`] pool of `num_blocks` blocks for `config` on `gpu`, head scales 1.0,
    /// exactly what [`HostCache::new`] builds on the host.
    pub fn new(gpu: &Gpu, config: CacheConfig, num_blocks: usize) -> Result<Self> {
        let (layout, bytes) = pool_bytes(config, num_blocks)?;
        let pool = poisoned(gpu, bytes, "allocating the pool")?;
        Self::with_pool(gpu, layout, num_blocks, PoolMemory::Own(pool))
    }

    /// `num_layers` caches as [`new`](Self::new) builds them (the arguments in the order of
    /// [`PagedKvCache::new`](crate::cache::PagedKvCache::new)), whose pools are ranges of one
    /// device allocation (each 256-byte aligned): one `cuMemAlloc` for a model's whole KV cache,
    /// as engines that size it once at start-up ask. Each cache is used and dropped on its own;
    /// the allocation is freed when the last of them is. Errors: [`Error::Config`] for no
    /// layers or pools too large together, and as [`new`](Self::new).
    pub fn new_per_layer(
        gpu: &Gpu,
        config: CacheConfig,
        num_layers: usize,
        num_blocks: usize,
    ) -> Result<Vec<Self>> {
        at_least_one(&[("num_layers", num_layers)])?;
        let (layout, bytes) = pool_bytes(config, num_blocks)?;
        let stride = bytes.next_multiple_of(LAYER_ALIGN);
        let total = stride
            .checked_mul(num_layers)
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or(Error::Config {
                what: "num_layers",
                value: num_layers,
                expected: "pools whose total size fits in memory",
            })?;
        let memory = Arc::new(poisoned(gpu, total, "allocating the layers' pools")?);
        (0..num_layers)
            .map(|l| {
                let pool = PoolMemory::Shared {
                    memory: memory.clone(),
                    offset: l * stride,
                    len: bytes,
                };
                Self::with_pool(gpu, layout, num_blocks, pool)
            })
            .collect()
    }

    /// The cache around `pool` (POISON-filled, `layout.block_stride * num_blocks` bytes): head
    /// scales 1.0, counters zero.
    fn with_pool(
        gpu: &Gpu,
        layout: BlockLayout,
        num_blocks: usize,
        pool: PoolMemory,
    ) -> Result<Self> {
        let config = layout.config;
        let raw_layout = raw_layout(&layout)?;
        let s = gpu.stream();
        let ones = vec![1.0f32; config.num_kv_heads];
        let k_scales = s
            .clone_htod(&ones)
            .map_err(driver_err("uploading scales"))?;
        let v_scales = s
            .clone_htod(&ones)
            .map_err(driver_err("uploading scales"))?;
        let counters = s
            .alloc_zeros::<u64>(sys::KVQ_NUM_COUNTERS)
            .map_err(driver_err("allocating counters"))?;
        let pool_ptr = match &pool {
            PoolMemory::Own(p) => owned_ptr(p),
            PoolMemory::Shared { memory, offset, .. } => owned_ptr(memory) + *offset as u64,
        };
        let ptrs = [
            pool_ptr,
            owned_ptr(&k_scales),
            owned_ptr(&v_scales),
            owned_ptr(&counters),
        ];
        Ok(DeviceCache {
            gpu: gpu.clone(),
            layout,
            raw_layout,
            num_blocks,
            pool,
            k_scales,
            v_scales,
            host_k_scales: ones.clone(),
            host_v_scales: ones,
            counters,
            copy_staging: Default::default(),
            ptrs,
        })
    }

    /// A device copy of `host`: pool bytes and head scales.
    pub fn from_host(gpu: &Gpu, host: &HostCache) -> Result<Self> {
        let mut d = DeviceCache::new(gpu, *host.config(), host.num_blocks())?;
        d.upload(host)?;
        Ok(d)
    }

    /// Overwrite this cache with `host`'s pool bytes and head scales (same configuration and
    /// block count), e.g. to restore a saved cache into a layer of
    /// [`new_per_layer`](Self::new_per_layer).
    pub fn upload(&mut self, host: &HostCache) -> Result<()> {
        if host.config() != self.config() || host.num_blocks() != self.num_blocks {
            return Err(Error::InvalidArgument(format!(
                "a host cache of {} blocks of {:?} into a device cache of {} blocks of {:?}",
                host.num_blocks(),
                host.config(),
                self.num_blocks,
                self.config()
            )));
        }
        self.gpu.bind()?;
        let s = self.gpu.stream();
        let src = host.pool();
        // SAFETY: ptrs[0] is this cache's pool, `src.len()` bytes (same layout and block count),
        // written by no one else (a shared allocation gives each layer its own range); the copy
        // is queued on the pool's stream, and returns once the pageable `src` is staged.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.ptrs[0], src, s.cu_stream()) }
            .map_err(driver_err("uploading the pool"))?;
        self.set_scales(host.k_scales(), host.v_scales())
    }
}

/// The layout of a pool of `num_blocks` blocks of `config` on the GPU and its size in bytes.
fn pool_bytes(config: CacheConfig, num_blocks: usize) -> Result<(BlockLayout, usize)> {
    config.validate()?;
    if config.head_dim > MAX_GPU_HEAD_DIM {
        return Err(Error::Unsupported(format!(
            "head_dim {} on the GPU (at most {MAX_GPU_HEAD_DIM})",
            config.head_dim
        )));
    }
    if num_blocks == 0 || num_blocks > i32::MAX as usize {
        return Err(Error::Config {
            what: "num_blocks",
            value: num_blocks,
            expected: "1..=i32::MAX",
        });
    }
    // The kernels count slots (and rows) in 31 bits.
    let slots = num_blocks.saturating_mul(config.block_size);
    if slots > MAX_GPU_SLOTS {
        return Err(Error::Unsupported(format!(
            "{slots} slots in one GPU pool (at most {MAX_GPU_SLOTS})"
        )));
    }
    let layout = config.layout();
    let bytes = layout
        .block_stride
        .checked_mul(num_blocks)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Error::Config {
            what: "num_blocks",
            value: num_blocks,
            expected: "a pool size that fits in memory",
        })?;
    Ok((layout, bytes))
}

/// `bytes` of device memory on `gpu`'s stream, filled with [`POISON`].
fn poisoned(gpu: &Gpu, bytes: usize, what: &'static str) -> Result<CudaSlice<u8>> {
    gpu.bind()?;
    let s = gpu.stream();
    // SAFETY: filled with POISON right below, before anything can read it.
    let mut pool = unsafe { s.alloc::<u8>(bytes) }.map_err(driver_err(what))?;
    {
        let (ptr, _guard) = pool.device_ptr_mut(s);
        // SAFETY: `ptr` is a live allocation of `bytes` bytes on this stream.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, POISON, bytes, s.cu_stream()) }
            .map_err(driver_err("filling the pool"))?;
    }
    Ok(pool)
}

impl DeviceCache {
    /// Copy the cache back to the host (waits for queued work): for tests and inspection.
    pub fn to_host(&self) -> Result<HostCache> {
        let mut h = HostCache::new(*self.config(), self.num_blocks)?;
        self.gpu
            .stream()
            .memcpy_dtoh(&self.pool(), h.pool_mut())
            .map_err(driver_err("downloading the pool"))?;
        self.gpu.synchronize()?;
        h.set_scales(&self.host_k_scales, &self.host_v_scales)?;
        Ok(h)
    }

    /// Set the head scales (FP8 `s`, FP4 `g`; `num_kv_heads` each, positive and finite), as
    /// [`HostCache::set_scales`]. Rows already written keep the codes they were quantized with.
    /// A side whose format has no head scale (16-bit, INT4, INT8) may take `&[]` (its scales
    /// stay 1.0), or `num_kv_heads` values, checked and then unused.
    pub fn set_scales(&mut self, k: &[f32], v: &[f32]) -> Result<()> {
        let [set_k, set_v] = check_head_scales(self.config(), k, v)?;
        let s = self.gpu.stream();
        if set_k {
            s.memcpy_htod(k, &mut self.k_scales)
                .map_err(driver_err("uploading k scales"))?;
            self.host_k_scales.copy_from_slice(k);
        }
        if set_v {
            s.memcpy_htod(v, &mut self.v_scales)
                .map_err(driver_err("uploading v scales"))?;
            self.host_v_scales.copy_from_slice(v);
        }
        Ok(())
    }

    /// The GPU this cache lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.layout.config
    }

    /// Byte layout of a block.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Token slots in the pool (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.config.block_size
    }

    /// Key head scales (FP8 `s`, FP4 `g`), one per KV head (host copy).
    pub fn k_scales(&self) -> &[f32] {
        &self.host_k_scales
    }

    /// Value head scales (FP8 `s`, FP4 `g`), one per KV head (host copy).
    pub fn v_scales(&self) -> &[f32] {
        &self.host_v_scales
    }

    /// The pool in device memory (its range of a shared allocation for
    /// [`new_per_layer`](Self::new_per_layer)' caches).
    pub fn pool(&self) -> CudaView<'_, u8> {
        match &self.pool {
            PoolMemory::Own(p) => p.as_view(),
            PoolMemory::Shared {
                memory,
                offset,
                len,
            } => memory.slice(*offset..*offset + *len),
        }
    }

    /// The C view of this cache for the launchers in [`sys`].
    ///
    /// The pointers stay valid while `self` lives and is not mutably borrowed elsewhere; work
    /// using them must be queued on [`Gpu::stream`] of [`gpu`](Self::gpu) (or be ordered after
    /// it), which is what orders it after earlier appends.
    pub fn as_raw(&self) -> sys::kvq_cache {
        sys::kvq_cache {
            pool: self.ptrs[0] as *mut u8,
            k_scales: self.ptrs[1] as *const f32,
            v_scales: self.ptrs[2] as *const f32,
            layout: self.raw_layout,
        }
    }

    /// Device pointer of the counters array (`KVQ_NUM_COUNTERS` u64), for the launchers (the
    /// kernels add to it atomically; the host reads it in [`take_counters`](Self::take_counters)).
    pub(crate) fn counters_ptr(&self) -> *mut u64 {
        self.ptrs[3] as *mut u64
    }

    /// Device address of the cache's fault counters (`KVQ_NUM_COUNTERS` u64, see kvq.h), for
    /// raw launches ([`RawDecodeArgs::counters`](super::decode::RawDecodeArgs::counters),
    /// [`ops::append_raw`](super::ops::append_raw)) whose faults
    /// [`check_appends`](Self::check_appends) should report.
    pub fn counters_raw(&self) -> cudarc::driver::sys::CUdeviceptr {
        self.ptrs[3]
    }

    /// Read and reset the append counters (waits for queued work).
    pub fn take_counters(&mut self) -> Result<AppendCounters> {
        let s = self.gpu.stream().clone();
        let c = s
            .clone_dtoh(&self.counters)
            .map_err(driver_err("reading counters"))?;
        s.memset_zeros(&mut self.counters)
            .map_err(driver_err("resetting counters"))?;
        Ok(AppendCounters {
            non_finite: c[sys::KVQ_COUNTER_NON_FINITE],
            out_of_range: c[sys::KVQ_COUNTER_OUT_OF_RANGE],
            saturated: c[sys::KVQ_COUNTER_SATURATED],
        })
    }

    /// Read and reset the counters; an error if any appended token had a slot outside the
    /// pool (it was skipped), or a decode or block copy met a block id outside the pool or a
    /// context longer than its table row (those blocks were not read). Returns the number of
    /// non-finite inputs met; the saturated ones, reset here too, are
    /// [`take_counters`](Self::take_counters)' to read.
    pub fn check_appends(&mut self) -> Result<u64> {
        let c = self.take_counters()?;
        if c.out_of_range > 0 {
            return Err(Error::InvalidArgument(format!(
                "{} fault(s) since the last check: appended tokens with a slot outside the pool \
                 of {} slots (skipped), or decode / block-copy thread blocks that met a block id \
                 outside the pool of {} blocks or a context longer than its table row (not read)",
                c.out_of_range,
                self.num_slots(),
                self.num_blocks
            )));
        }
        Ok(c.non_finite)
    }
}
