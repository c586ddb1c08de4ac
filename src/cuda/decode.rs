//! Fused paged decode attention on the GPU (`cuda/decode.cu`): one kernel reads each KV byte of a
//! sequence once per KV-head group, dequantizes FP8 / INT4 codes straight into tensor-core
//! fragments (no dequantized copy of the cache ever reaches global memory) and runs an online
//! softmax; long contexts are cut into splits that run side by side, and the last block of a
//! sequence to finish merges them, in the same launch (flash-decoding).
//!
//! Semantics are those of [`cpu::decode_attention`](crate::cpu::decode_attention): `q`, `out`
//! are `[batch, num_q_heads, q_len, head_dim]`, `lse` is `[batch, num_q_heads, q_len]` (natural
//! log), context lengths include the `q_len` new tokens, queries are causal among themselves.
//!
//! Use:
//! 1. [`DecodePlan::new`] once per (cache layout, batch shape, longest context): it picks the
//!    split count and the launch shape (warps per block, copy stages) from the batch shape, the
//!    GPU's SM count and the kernel's occupancy.
//! 2. [`DecodeWorkspace::new`] once per plan (split partials live there).
//! 3. [`DeviceBlockTables::new`] / [`update`](DeviceBlockTables::update) whenever the tables
//!    change (validated on the host, then copied).
//! 4. [`DecodePlan::decode`] every step: checks shapes, then enqueues; no allocation and no host
//!    synchronization, so it can be captured in a CUDA graph.
//!
//! Engines that own their device memory use [`DecodePlan::decode_raw`] instead.

use super::device::{DeviceCache, raw_layout};
use super::ops::{DeviceElement, Dtype, need_len, to_i32};
use super::{Gpu, check_status, driver_err, owned_ptr, sys};
use crate::cache::BlockTables;
use crate::error::{Error, Result};
use crate::format::KvFormat;
use crate::layout::BlockLayout;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// Tokens per copy chunk of the kernel (one page segment): `block_size` must be a multiple of it.
pub const STEP_TOKENS: usize = 16;

/// Split lengths are multiples of this (the kernel's longest step).
const SPLIT_MULTIPLE: usize = 32;

/// Head dimensions the kernels are built for.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Most splits one launch may use (`KVQ_DECODE_MAX_SPLITS`).
pub const MAX_SPLITS: usize = sys::KVQ_DECODE_MAX_SPLITS as usize;

/// Query rows (query heads of one KV head x q_len) one thread block serves; a KV head with more
/// rows is served by several blocks, each reading its bytes.
pub const TILE_ROWS: usize = sys::KVQ_DECODE_TILE_ROWS as usize;

/// A split shorter than this costs more in setup and merge than it gains in parallelism.
const MIN_SPLIT_TOKENS: usize = 256;

/// Fixed cost of one thread block in the launch model, in tokens of streaming (query setup,
/// pipeline fill, warp merge); fitted with the rate model (see `RateModel`).
const CTA_OVERHEAD_TOKENS: usize = 512;

/// Cost of each split in the launch model, in tokens of streaming: partial write and merge,
/// measured on an H200 at ~0.44 us per split (docs/PERFORMANCE.md, v3).
const SPLIT_COST_TOKENS: usize = 32;

/// Warps per thread block the kernel is launched with (`warps` of [`DecodePlan`]).
pub const WARPS: [usize; 2] = [4, 8];

/// Copy stages per warp a plan may use (`kMinStages..=kMaxStages` in the kernel).
pub const STAGES: std::ops::RangeInclusive<usize> = 2..=8;

/// Query / output element types of the decode kernels: f16 and bf16.
pub trait DecodeElement: DeviceElement {}
impl DecodeElement for half::f16 {}
impl DecodeElement for half::bf16 {}

/// Whether this build has a decode kernel for keys in `k` and values in `v`: f16, bf16,
/// fp8-e4m3 and int4 (keys `int4-k32`, values `int4-v64`) mixed freely, or fp8-e5m2 for both.
pub fn kernel_available(k: KvFormat, v: KvFormat) -> bool {
    use KvFormat::*;
    matches!(
        (k, v),
        (Fp8E5m2, Fp8E5m2)
            | (
                F16 | Bf16 | Fp8E4m3 | Int4Sym32,
                F16 | Bf16 | Fp8E4m3 | Int4Affine64
            )
    )
}

/// Split length for `num_splits` splits of `max_len` tokens (a multiple of [`SPLIT_MULTIPLE`]),
/// and the split count that length really gives.
fn split_len(max_len: usize, num_splits: usize) -> (usize, usize) {
    let max_len = max_len.max(1);
    let split_tokens = max_len
        .div_ceil(num_splits.max(1))
        .next_multiple_of(SPLIT_MULTIPLE);
    (max_len.div_ceil(split_tokens), split_tokens)
}

/// How decode launches for one cache layout and batch shape are cut; computed once, reused for
/// every step whose sequences are at most [`max_context_len`](Self::max_context_len) long.
#[derive(Debug, Clone)]
pub struct DecodePlan {
    gpu: Gpu,
    layout: BlockLayout,
    batch: usize,
    num_q_heads: usize,
    q_len: usize,
    max_context_len: usize,
    softmax_scale: f32,
    num_splits: usize,
    split_tokens: usize,
    warps: usize,
    stages: usize,
    ctas_per_sm: usize,
}

/// Thread blocks per SM and bytes per stage of the decode kernel for `layout` with `warps`
/// warps per block of `stages` copy stages each (0 blocks: does not fit). The GPU's context
/// must be current.
fn occupancy(layout: &BlockLayout, warps: usize, stages: usize) -> Result<(usize, usize)> {
    let c = &layout.config;
    let (mut ctas, mut stage_bytes) = (0i32, 0i32);
    // SAFETY: plain host call; writes two ints.
    let status = unsafe {
        sys::kvq_decode_occupancy(
            c.k_format as i32,
            c.v_format as i32,
            c.head_dim as i32,
            warps as i32,
            stages as i32,
            &mut ctas,
            &mut stage_bytes,
        )
    };
    check_status(status, "kvq_decode_occupancy")?;
    Ok((ctas.max(0) as usize, stage_bytes.max(0) as usize))
}

/// How one launch is cut: warps per thread block, copy stages per warp, the blocks per SM that
/// fit with them, and the split-KV split count and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LaunchChoice {
    warps: usize,
    stages: usize,
    ctas: usize,
    splits: usize,
    split_tokens: usize,
}

/// What an SM needs to run the decode at its full rate: enough copies in flight and enough
/// resident warps to hide the dependency chains of a step. Fitted to an H200 sweep of every
/// launch shape (`examples/decode_sweep.rs`, docs/PERFORMANCE.md): 16-bit caches want about
/// 128 KB in flight and 8 warps; FP8 and INT4 caches are bound by their warps' latency long
/// before their copies (INT4 ran the same at 61 KB as at 123 KB in flight, 12 % faster at 12
/// warps per SM than at 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RateModel {
    /// Bytes of copies each block keeps in flight.
    inflight: usize,
    /// Warps per block.
    warps: usize,
    /// Bytes in flight per SM that reach the full rate.
    inflight_target: usize,
    /// Resident warps per SM that reach the full rate.
    full_rate_warps: usize,
}

impl RateModel {
    /// The model for caches in `k` / `v`, launched with `warps` warps per block of `stages`
    /// stages of `stage_bytes` each (one stage per warp is being computed, the rest in flight).
    fn new(k: KvFormat, v: KvFormat, warps: usize, stages: usize, stage_bytes: usize) -> Self {
        let narrowest = k.bits().min(v.bits());
        RateModel {
            inflight: warps * (stages - 1) * stage_bytes,
            warps,
            inflight_target: if narrowest >= 16 { 128 << 10 } else { 32 << 10 },
            full_rate_warps: if narrowest == 4 { 12 } else { 8 },
        }
    }

    /// Fraction of the full rate of an SM with `k` blocks resident.
    fn rate(&self, k: usize) -> f64 {
        let copies = (k * self.inflight) as f64 / self.inflight_target as f64;
        let warps = (k * self.warps) as f64 / self.full_rate_warps as f64;
        copies.min(warps).min(1.0)
    }
}

/// Time, in units of one block's run at the full rate of an SM, for `blocks` equal blocks on
/// `sms` SMs holding `ctas` blocks each. Blocks run in waves, and an SM slows down below what
/// its resident blocks need (`model`), which is what makes a thin last wave slow (H200: B=64
/// fp8 at 3 blocks per SM, 1.3 waves, 74 % of the ceiling against 87 % at 2 blocks per SM,
/// 1.9 waves).
fn wave_time(blocks: usize, sms: usize, ctas: usize, model: RateModel) -> f64 {
    let slots = ctas * sms;
    let (full, rest) = (blocks / slots, blocks % slots);
    let mut t = full as f64 * ctas as f64 / model.rate(ctas);
    if rest > 0 {
        let k = rest.div_ceil(sms);
        t += k as f64 / model.rate(k);
    }
    t
}

/// Warps, stages and split count together, given `occ(warps, stages) -> (blocks per SM, bytes
/// per stage)` and `base` blocks per split (batch x KV heads x query tiles) on `sms` SMs, for
/// contexts up to `max_len` tokens of caches in `formats` (K, V). Model: [`wave_time`] x
/// (tokens per split + a fixed cost per block) + a cost per split; among the launches within
/// 2 % of the best, the fewest splits, then the fewest stages, then the fewest warps. Splits
/// are no shorter than [`MIN_SPLIT_TOKENS`] (or one split), at most [`MAX_SPLITS`]. An error
/// only if nothing fits.
fn choose_launch(
    base: usize,
    sms: usize,
    max_len: usize,
    (k, v): (KvFormat, KvFormat),
    mut occ: impl FnMut(usize, usize) -> Result<(usize, usize)>,
) -> Result<LaunchChoice> {
    let most = max_len.div_ceil(MIN_SPLIT_TOKENS).clamp(1, MAX_SPLITS);
    let mut cands = Vec::new(); // (cost, splits, stages, warps, ctas)
    for warps in WARPS {
        for stages in STAGES {
            let (ctas, stage_bytes) = occ(warps, stages)?;
            if ctas == 0 {
                continue;
            }
            let model = RateModel::new(k, v, warps, stages, stage_bytes);
            for splits in 1..=most {
                let (n, len) = split_len(max_len, splits);
                let waves = wave_time(base * n, sms, ctas, model);
                let cost =
                    waves * (len + CTA_OVERHEAD_TOKENS) as f64 + (n * SPLIT_COST_TOKENS) as f64;
                cands.push((cost, n, stages, warps, ctas));
            }
        }
    }
    let best = cands.iter().map(|c| c.0).fold(f64::INFINITY, f64::min);
    let &(_, n, stages, warps, ctas) = cands
        .iter()
        .filter(|c| c.0 <= best * 1.02)
        .min_by_key(|c| (c.1, c.2, c.3))
        .ok_or_else(|| {
            Error::Unsupported("GPU decode: no stage count fits this device's shared memory".into())
        })?;
    let (splits, split_tokens) = split_len(max_len, n);
    Ok(LaunchChoice {
        warps,
        stages,
        ctas,
        splits,
        split_tokens,
    })
}

impl DecodePlan {
    /// A plan for `batch` sequences of `num_q_heads` query heads and `q_len` new tokens each,
    /// no longer than `max_context_len` tokens (new tokens included), over caches of `layout`,
    /// with `softmax_scale = 1 / sqrt(head_dim)` (see [`with_softmax_scale`](Self::with_softmax_scale)).
    ///
    /// Errors: [`Error::Unsupported`] for a format pair without a kernel
    /// ([`kernel_available`]), a head_dim outside [`HEAD_DIMS`] or a block size that is not a
    /// multiple of [`STEP_TOKENS`]; [`Error::InvalidArgument`] / [`Error::Config`] for shapes
    /// that make no sense (zero sizes, heads not a multiple of the KV heads,
    /// `max_context_len < q_len`).
    pub fn new(
        gpu: &Gpu,
        layout: &BlockLayout,
        batch: usize,
        num_q_heads: usize,
        q_len: usize,
        max_context_len: usize,
    ) -> Result<Self> {
        let c = &layout.config;
        c.validate()?;
        if !kernel_available(c.k_format, c.v_format) {
            return Err(Error::Unsupported(format!(
                "GPU decode of {} keys with {} values",
                c.k_format, c.v_format
            )));
        }
        if !HEAD_DIMS.contains(&c.head_dim) {
            return Err(Error::Unsupported(format!(
                "GPU decode with head_dim {} (kernels exist for {HEAD_DIMS:?})",
                c.head_dim
            )));
        }
        if c.block_size % STEP_TOKENS != 0 {
            return Err(Error::Unsupported(format!(
                "GPU decode with block_size {} (a multiple of {STEP_TOKENS} is needed)",
                c.block_size
            )));
        }
        for (what, value) in [
            ("batch", batch),
            ("num_q_heads", num_q_heads),
            ("q_len", q_len),
        ] {
            if value == 0 {
                return Err(Error::Config {
                    what,
                    value,
                    expected: "at least 1",
                });
            }
        }
        if num_q_heads % c.num_kv_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "num_q_heads {num_q_heads} must be a multiple of num_kv_heads {}",
                c.num_kv_heads
            )));
        }
        if max_context_len < q_len {
            return Err(Error::InvalidArgument(format!(
                "max_context_len {max_context_len} is shorter than q_len {q_len} \
                 (context lengths include the new tokens)"
            )));
        }
        let m_tiles = (num_q_heads / c.num_kv_heads * q_len).div_ceil(TILE_ROWS);
        if c.num_kv_heads * m_tiles > 65535 || batch > 65535 {
            return Err(Error::Unsupported(format!(
                "GPU decode grid: batch {batch} and num_kv_heads x query tiles {} must each be \
                 at most 65535",
                c.num_kv_heads * m_tiles
            )));
        }
        // Sizes that reach the kernels as int32.
        to_i32("max_context_len", max_context_len)?;
        to_i32("batch * num_q_heads * q_len", batch * num_q_heads * q_len)?;

        gpu.bind()?;
        let sms = gpu.props().sm_count as usize;
        let base = batch * c.num_kv_heads * m_tiles;
        let formats = (c.k_format, c.v_format);
        let choice = choose_launch(base, sms, max_context_len, formats, |w, n| {
            occupancy(layout, w, n)
        })?;
        Ok(DecodePlan {
            gpu: gpu.clone(),
            layout: *layout,
            batch,
            num_q_heads,
            q_len,
            max_context_len,
            softmax_scale: 1.0 / (c.head_dim as f32).sqrt(),
            num_splits: choice.splits,
            split_tokens: choice.split_tokens,
            warps: choice.warps,
            stages: choice.stages,
            ctas_per_sm: choice.ctas,
        })
    }

    /// The same plan with another multiplier of `q · k` (finite).
    pub fn with_softmax_scale(mut self, softmax_scale: f32) -> Result<Self> {
        if !softmax_scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "softmax_scale {softmax_scale} must be finite"
            )));
        }
        self.softmax_scale = softmax_scale;
        Ok(self)
    }

    /// The same plan with a split count of your choice (clamped to what `max_context_len`
    /// allows: splits of at least 32 tokens, at most [`MAX_SPLITS`]), for tests and tuning.
    pub fn with_num_splits(mut self, num_splits: usize) -> Self {
        let most = self
            .max_context_len
            .div_ceil(SPLIT_MULTIPLE)
            .clamp(1, MAX_SPLITS);
        (self.num_splits, self.split_tokens) =
            split_len(self.max_context_len, num_splits.clamp(1, most));
        self
    }

    /// The same plan with `warps` warps per thread block (in [`WARPS`]) and `stages` copy stages
    /// per warp (in [`STAGES`]; more stages keep more bytes in flight but fit fewer blocks per
    /// SM), for tuning; the split count is kept. [`Error::Unsupported`] if they do not fit.
    pub fn with_launch(mut self, warps: usize, stages: usize) -> Result<Self> {
        if !WARPS.contains(&warps) {
            return Err(Error::Config {
                what: "warps",
                value: warps,
                expected: "4 or 8 warps per thread block",
            });
        }
        if !STAGES.contains(&stages) {
            return Err(Error::Config {
                what: "stages",
                value: stages,
                expected: "2..=8 copy stages per warp",
            });
        }
        self.gpu.bind()?;
        let (ctas, _) = occupancy(&self.layout, warps, stages)?;
        if ctas == 0 {
            return Err(Error::Unsupported(format!(
                "GPU decode with {warps} warps of {stages} stages: does not fit in shared memory"
            )));
        }
        self.warps = warps;
        self.stages = stages;
        self.ctas_per_sm = ctas;
        Ok(self)
    }

    /// Warps per thread block.
    pub fn warps(&self) -> usize {
        self.warps
    }
    /// Copy stages per warp.
    pub fn stages(&self) -> usize {
        self.stages
    }
    /// Thread blocks of this plan's kernel that fit on one SM.
    pub fn ctas_per_sm(&self) -> usize {
        self.ctas_per_sm
    }

    /// Layout of the caches this plan serves.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// Sequences per launch.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Query heads.
    pub fn num_q_heads(&self) -> usize {
        self.num_q_heads
    }
    /// New tokens per sequence.
    pub fn q_len(&self) -> usize {
        self.q_len
    }
    /// Longest context (tokens, new ones included) a launch may see.
    pub fn max_context_len(&self) -> usize {
        self.max_context_len
    }
    /// Multiplier of `q · k`.
    pub fn softmax_scale(&self) -> f32 {
        self.softmax_scale
    }
    /// Splits the longest context is cut into (1: no merge pass).
    pub fn num_splits(&self) -> usize {
        self.num_splits
    }
    /// Tokens per split (a multiple of 32).
    pub fn split_tokens(&self) -> usize {
        self.split_tokens
    }

    /// Elements of `q` and `out`: `batch * num_q_heads * q_len * head_dim`.
    pub fn q_elems(&self) -> usize {
        self.lse_elems() * self.layout.config.head_dim
    }
    /// Entries of `lse`: `batch * num_q_heads * q_len`.
    pub fn lse_elems(&self) -> usize {
        self.batch * self.num_q_heads * self.q_len
    }
    /// Workspace sizes: f32 partial outputs, f32 partial log-sum-exps, u32 counters (all 0
    /// when the plan has one split). The counters must be zero before the first launch.
    pub fn workspace_elems(&self) -> (usize, usize, usize) {
        if self.num_splits <= 1 {
            return (0, 0, 0);
        }
        let lse = self.lse_elems() * self.num_splits;
        let c = &self.layout.config;
        let tiles = (self.num_q_heads / c.num_kv_heads * self.q_len).div_ceil(TILE_ROWS);
        (lse * c.head_dim, lse, self.batch * c.num_kv_heads * tiles)
    }

    fn check_tables(&self, t: &DeviceBlockTables) -> Result<()> {
        if t.batch != self.batch {
            return Err(Error::Length {
                what: "block tables (one row per sequence of the plan's batch)",
                expected: self.batch,
                actual: t.batch,
            });
        }
        if t.max_len > self.max_context_len {
            return Err(Error::InvalidArgument(format!(
                "a context of {} tokens exceeds the plan's max_context_len {}",
                t.max_len, self.max_context_len
            )));
        }
        if t.min_len < self.q_len {
            return Err(Error::InvalidArgument(format!(
                "a context of {} tokens is shorter than q_len {} (the new tokens must already \
                 be in the cache)",
                t.min_len, self.q_len
            )));
        }
        Ok(())
    }

    fn check_q_dtype(&self, q: Dtype) -> Result<()> {
        if self.layout.config.k_format == KvFormat::Bf16 && q != Dtype::Bf16 {
            return Err(Error::Unsupported(format!(
                "GPU decode of a bf16 key cache with {q:?} queries (use bf16 queries)"
            )));
        }
        Ok(())
    }

    fn raw_args(&self) -> sys::kvq_decode_args {
        sys::kvq_decode_args {
            cache: sys::kvq_cache {
                pool: std::ptr::null_mut(),
                k_scales: std::ptr::null(),
                v_scales: std::ptr::null(),
                layout: sys::kvq_layout::default(),
            },
            num_blocks: 0,
            q: std::ptr::null(),
            out: std::ptr::null_mut(),
            lse: std::ptr::null_mut(),
            block_tables: std::ptr::null(),
            context_lens: std::ptr::null(),
            ws_o: std::ptr::null_mut(),
            ws_lse: std::ptr::null_mut(),
            ws_counters: std::ptr::null_mut(),
            q_dtype: 0,
            batch: self.batch as i32,
            num_q_heads: self.num_q_heads as i32,
            q_len: self.q_len as i32,
            max_blocks: 0,
            num_splits: self.num_splits as i32,
            split_tokens: self.split_tokens as i32,
            warps: self.warps as i32,
            stages: self.stages as i32,
            softmax_scale: self.softmax_scale,
        }
    }

    /// One decode step: attention of `q` over `cache` for the sequences of `tables`, written to
    /// `out` and, if given, the natural-log softmax denominators to `lse`. Enqueued on the
    /// cache's stream; returns at once. Every argument is checked against the plan first:
    /// same GPU and layout, `q` / `out` of at least [`q_elems`](Self::q_elems) elements, `lse`
    /// of [`lse_elems`](Self::lse_elems), tables of the plan's batch with contexts in
    /// `q_len..=max_context_len`, a workspace made for this plan.
    pub fn decode<T: DecodeElement>(
        &self,
        ws: &mut DecodeWorkspace,
        cache: &DeviceCache,
        tables: &DeviceBlockTables,
        q: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        if self.gpu.context() != cache.gpu().context() {
            return Err(Error::InvalidArgument(format!(
                "the cache lives on GPU {}, the plan was made for GPU {}",
                cache.gpu().props().ordinal,
                self.gpu.props().ordinal
            )));
        }
        if cache.layout() != &self.layout {
            return Err(Error::InvalidArgument(
                "the cache's layout differs from the one the plan was made for".into(),
            ));
        }
        self.check_q_dtype(T::DTYPE)?;
        self.check_tables(tables)?;
        if tables.num_blocks != cache.num_blocks() {
            return Err(Error::InvalidArgument(format!(
                "the block tables were checked against a pool of {} blocks, the cache has {}",
                tables.num_blocks,
                cache.num_blocks()
            )));
        }
        ws.check(self)?;
        need_len(
            "q ([batch, num_q_heads, q_len, head_dim])",
            self.q_elems(),
            q.len(),
        )?;
        need_len(
            "out ([batch, num_q_heads, q_len, head_dim])",
            self.q_elems(),
            out.len(),
        )?;
        if let Some(l) = &lse {
            need_len(
                "lse ([batch, num_q_heads, q_len])",
                self.lse_elems(),
                l.len(),
            )?;
        }
        self.gpu.bind()?;
        let s = cache.gpu().stream();
        let mut a = self.raw_args();
        a.cache = cache.as_raw();
        a.num_blocks = cache.num_blocks() as i64;
        a.q_dtype = T::DTYPE.raw();
        a.max_blocks = tables.max_blocks as i32;
        let (q_p, _g1) = q.device_ptr(s);
        let (o_p, _g2) = out.device_ptr_mut(s);
        // The cache's, tables' and workspace's own buffers go by their fixed addresses (they
        // live on this stream); only the caller's q / out / lse take cudarc's guards.
        let [t_p, c_p] = tables.ptrs;
        let [wo_p, wl_p, wc_p] = ws.ptrs;
        let mut lse_guard = lse.map(|l| l.device_ptr_mut(s));
        a.q = q_p as *const c_void;
        a.out = o_p as *mut c_void;
        a.block_tables = t_p as *const i32;
        a.context_lens = c_p as *const i32;
        a.ws_o = wo_p as *mut f32;
        a.ws_lse = wl_p as *mut f32;
        a.ws_counters = wc_p as *mut u32;
        a.lse = lse_guard
            .as_mut()
            .map_or(std::ptr::null_mut(), |(p, _)| *p as *mut f32);
        // SAFETY: every buffer was checked above to hold what the plan's shape needs; the tables
        // were validated against this cache on upload (DeviceBlockTables) and their lengths
        // against the plan; all memory lives on this stream's device.
        let status = unsafe { sys::kvq_decode_attention(&a, s.cu_stream().cast()) };
        check_status(status, "kvq_decode_attention")
    }

    /// [`decode`](Self::decode) for memory the caller owns. Host-checkable arguments are
    /// checked (layout against the plan, q dtype, non-null pointers, 16-byte alignment of
    /// `q` / `out`); the rest is the caller's promise.
    ///
    /// # Safety
    /// - `args.cache` describes a live device pool of `args.num_blocks` blocks with this plan's
    ///   layout (e.g. [`DeviceCache::as_raw`]);
    /// - `q` and `out` hold [`q_elems`](Self::q_elems) elements of `q_dtype`, `lse` (if not 0)
    ///   [`lse_elems`](Self::lse_elems) f32; `workspace_o` / `workspace_lse` /
    ///   `workspace_counters` hold [`workspace_elems`](Self::workspace_elems) elements (unused
    ///   when the plan has one split), the counters zero before the first launch;
    /// - `block_tables` holds `batch * max_blocks` i32 and `context_lens` `batch` i32, with
    ///   every `context_lens[b]` in `q_len..=min(max_context_len, max_blocks * block_size)` and
    ///   the first `ceil(context_lens[b] / block_size)` entries of row `b` block ids below
    ///   `num_blocks` (breaking this cannot make the kernel read or write out of bounds, but
    ///   the output is then unspecified);
    /// - nothing else writes `out`, `lse` or the workspace until the launch on `stream` ends.
    pub unsafe fn decode_raw(&self, args: &RawDecodeArgs, stream: CUstream) -> Result<()> {
        if args.cache.layout != raw_layout(&self.layout)? {
            return Err(Error::InvalidArgument(
                "the cache's layout differs from the one the plan was made for".into(),
            ));
        }
        self.check_q_dtype(args.q_dtype)?;
        if args.q_dtype == Dtype::F32 {
            return Err(Error::Unsupported("GPU decode with f32 queries".into()));
        }
        if args.cache.pool.is_null()
            || args.q == 0
            || args.out == 0
            || args.block_tables == 0
            || args.context_lens == 0
            || (self.num_splits > 1
                && (args.workspace_o == 0
                    || args.workspace_lse == 0
                    || args.workspace_counters == 0))
        {
            return Err(Error::InvalidArgument(
                "decode_raw: a required device pointer is null".into(),
            ));
        }
        if args.q % 16 != 0 || args.out % 16 != 0 {
            return Err(Error::InvalidArgument(
                "decode_raw: q and out must be 16-byte aligned".into(),
            ));
        }
        if args.max_blocks == 0 || args.num_blocks == 0 {
            return Err(Error::InvalidArgument(
                "decode_raw: max_blocks and num_blocks must be at least 1".into(),
            ));
        }
        let mut a = self.raw_args();
        a.cache = args.cache;
        a.num_blocks = i64::try_from(args.num_blocks)
            .map_err(|_| Error::InvalidArgument("num_blocks exceeds int64".into()))?;
        a.q = args.q as *const c_void;
        a.out = args.out as *mut c_void;
        a.lse = args.lse as *mut f32;
        a.block_tables = args.block_tables as *const i32;
        a.context_lens = args.context_lens as *const i32;
        a.ws_o = args.workspace_o as *mut f32;
        a.ws_lse = args.workspace_lse as *mut f32;
        a.ws_counters = args.workspace_counters as *mut u32;
        a.q_dtype = args.q_dtype.raw();
        a.max_blocks = to_i32("max_blocks", args.max_blocks)?;
        // SAFETY: forwarded from the caller's contract; shapes come from the plan.
        let status = unsafe { sys::kvq_decode_attention(&a, stream.cast()) };
        check_status(status, "kvq_decode_attention")
    }
}

/// Device pointers of one [`DecodePlan::decode_raw`] call (0 for an absent optional one).
#[derive(Debug, Clone, Copy)]
pub struct RawDecodeArgs {
    /// The cache (pool, FP8 scales, layout).
    pub cache: sys::kvq_cache,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// `[batch, num_q_heads, q_len, head_dim]` queries of `q_dtype`.
    pub q: CUdeviceptr,
    /// Element type of `q` and `out` (f16 or bf16).
    pub q_dtype: Dtype,
    /// Output, same shape and type as `q`.
    pub out: CUdeviceptr,
    /// Optional `[batch, num_q_heads, q_len]` f32 log-sum-exp output (0: none).
    pub lse: CUdeviceptr,
    /// `[batch, max_blocks]` i32 block tables.
    pub block_tables: CUdeviceptr,
    /// Row stride of `block_tables`.
    pub max_blocks: usize,
    /// `[batch]` i32 context lengths (new tokens included).
    pub context_lens: CUdeviceptr,
    /// Split partial outputs, [`DecodePlan::workspace_elems`]`.0` f32 (0 with one split).
    pub workspace_o: CUdeviceptr,
    /// Split partial log-sum-exps, [`DecodePlan::workspace_elems`]`.1` f32 (0 with one split).
    pub workspace_lse: CUdeviceptr,
    /// Split counters, [`DecodePlan::workspace_elems`]`.2` u32, zero before the first launch
    /// (each launch leaves them zero; 0 with one split).
    pub workspace_counters: CUdeviceptr,
}

/// Device memory for the partial results of a split plan, sized by [`DecodePlan`]; reusable for
/// every launch of that plan (one launch at a time).
#[derive(Debug)]
pub struct DecodeWorkspace {
    /// Partial outputs, partial log-sum-exps, split counters: held for their memory, used by
    /// the kernel through `ptrs` (see [`owned_ptr`]).
    _buffers: (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u32>),
    ptrs: [CUdeviceptr; 3],
    elems: (usize, usize, usize),
}

impl DecodeWorkspace {
    /// Allocate the workspace of `plan` on its GPU (one element when the plan needs none).
    pub fn new(plan: &DecodePlan) -> Result<Self> {
        let elems = plan.workspace_elems();
        plan.gpu.bind()?;
        let s = plan.gpu.stream();
        // SAFETY: the kernel writes every partial it later reads (the merge reads only splits
        // of the same launch); the counters start zeroed.
        let o = unsafe { s.alloc::<f32>(elems.0.max(1)) }
            .map_err(driver_err("allocating the decode workspace"))?;
        let lse = unsafe { s.alloc::<f32>(elems.1.max(1)) }
            .map_err(driver_err("allocating the decode workspace"))?;
        let counters = s
            .alloc_zeros::<u32>(elems.2.max(1))
            .map_err(driver_err("allocating the decode workspace"))?;
        let ptrs = [owned_ptr(&o), owned_ptr(&lse), owned_ptr(&counters)];
        Ok(DecodeWorkspace {
            _buffers: (o, lse, counters),
            ptrs,
            elems,
        })
    }

    fn check(&self, plan: &DecodePlan) -> Result<()> {
        let need = plan.workspace_elems();
        if self.elems.0 < need.0 || self.elems.1 < need.1 || self.elems.2 < need.2 {
            return Err(Error::Length {
                what: "decode workspace (f32 partial outputs; make it from this plan)",
                expected: need.0,
                actual: self.elems.0,
            });
        }
        Ok(())
    }
}

/// Block tables and context lengths in device memory, validated on the host against a cache
/// before each upload: what [`DecodePlan::decode`] reads.
#[derive(Debug)]
pub struct DeviceBlockTables {
    data: CudaSlice<i32>,
    context_lens: CudaSlice<i32>,
    /// Device addresses of `data` and `context_lens` (see [`owned_ptr`]).
    ptrs: [CUdeviceptr; 2],
    batch: usize,
    max_blocks: usize,
    num_blocks: usize,
    min_len: usize,
    max_len: usize,
}

impl DeviceBlockTables {
    /// Validate `tables` against `cache` ([`BlockTables::validate`]) and copy them to its GPU.
    pub fn new(cache: &DeviceCache, tables: &BlockTables) -> Result<Self> {
        Self::check(cache, tables)?;
        let gpu = cache.gpu();
        gpu.bind()?;
        let s = gpu.stream();
        let data = s
            .clone_htod(&tables.data)
            .map_err(driver_err("uploading block tables"))?;
        let context_lens = s
            .clone_htod(&tables.context_lens)
            .map_err(driver_err("uploading context lengths"))?;
        let ptrs = [owned_ptr(&data), owned_ptr(&context_lens)];
        Ok(DeviceBlockTables {
            data,
            context_lens,
            ptrs,
            batch: tables.batch(),
            max_blocks: tables.max_blocks,
            num_blocks: cache.num_blocks(),
            min_len: min_len(tables),
            max_len: tables.max_context_len(),
        })
    }

    /// Replace the contents with `tables` of the same batch and `max_blocks` (validated against
    /// `cache` first), without allocating.
    pub fn update(&mut self, cache: &DeviceCache, tables: &BlockTables) -> Result<()> {
        if tables.batch() != self.batch || tables.max_blocks != self.max_blocks {
            return Err(Error::InvalidArgument(format!(
                "update needs tables of batch {} and max_blocks {}, got {} and {}",
                self.batch,
                self.max_blocks,
                tables.batch(),
                tables.max_blocks
            )));
        }
        Self::check(cache, tables)?;
        let s = cache.gpu().stream();
        s.memcpy_htod(&tables.data, &mut self.data)
            .map_err(driver_err("uploading block tables"))?;
        s.memcpy_htod(&tables.context_lens, &mut self.context_lens)
            .map_err(driver_err("uploading context lengths"))?;
        self.num_blocks = cache.num_blocks();
        self.min_len = min_len(tables);
        self.max_len = tables.max_context_len();
        Ok(())
    }

    fn check(cache: &DeviceCache, tables: &BlockTables) -> Result<()> {
        if tables.batch() == 0 {
            return Err(Error::Config {
                what: "batch",
                value: 0,
                expected: "at least 1",
            });
        }
        tables.validate(cache.num_blocks(), cache.config().block_size)?;
        to_i32("max_blocks", tables.max_blocks)?;
        Ok(())
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Row stride of the table.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    /// Longest context in tokens.
    pub fn max_context_len(&self) -> usize {
        self.max_len
    }
}

fn min_len(tables: &BlockTables) -> usize {
    tables
        .context_lens
        .iter()
        .map(|&l| l.max(0) as usize)
        .min()
        .unwrap_or(0)
}

/// Stream-read `bytes` of `src` once (the bandwidth probe of `cuda/bandwidth.cu`), for benches
/// that need the device's streaming-read ceiling measured in the same run. `sink` must hold at
/// least 4096 f32. Enqueued on `gpu`'s stream.
#[cfg(feature = "bench")]
pub fn stream_read(
    gpu: &Gpu,
    src: &CudaSlice<u8>,
    bytes: usize,
    sink: &mut CudaSlice<f32>,
) -> Result<()> {
    need_len("stream_read source", bytes, src.len())?;
    need_len("stream_read sink", 4096, sink.len())?;
    if bytes == 0 || bytes % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "stream_read: {bytes} bytes is not a positive multiple of 16"
        )));
    }
    gpu.bind()?;
    let s = gpu.stream();
    let (src_p, _g1) = src.device_ptr(s);
    let (sink_p, _g2) = sink.device_ptr_mut(s);
    // SAFETY: src holds `bytes` bytes (checked), sink 4096 floats; cudaMalloc'd memory is
    // 256-byte aligned.
    let status = unsafe {
        sys::kvq_stream_read(
            src_p as *const c_void,
            bytes as i64,
            sink_p as *mut f32,
            gpu.raw_stream(),
        )
    };
    check_status(status, "kvq_stream_read")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared-memory model shaped like the kernel's: `stage` bytes per stage and warp, 227 KB
    /// per SM, at most `max_ctas` blocks per SM by registers.
    fn occ_model(
        stage: usize,
        max_ctas: usize,
    ) -> impl FnMut(usize, usize) -> Result<(usize, usize)> {
        move |warps, stages| {
            let bytes = warps * stages * stage + 8192;
            Ok((((227 << 10) / bytes).min(max_ctas * 4 / warps), stage))
        }
    }

    #[test]
    fn launch_choice() {
        use KvFormat::*;
        let bf16 = ((Bf16, Bf16), 8960); // bytes per stage at head_dim 128: 16 tokens, padded
        let fp8 = ((Fp8E4m3, Fp8E4m3), 4608);
        let int4 = ((Int4Sym32, Int4Affine64), 5120); // 32 tokens
        // (warps, stages, blocks per SM, splits, split length); `regs`: 4-warp blocks per SM
        // that registers allow.
        let pick = |base, len, (formats, stage), regs| {
            let c = choose_launch(base, 132, len, formats, occ_model(stage, regs)).unwrap();
            (c.warps, c.stages, c.ctas, c.splits, c.split_tokens)
        };
        // Many blocks of a 16-bit cache: 2 blocks of 4 warps x 3 stages (143 KB in flight).
        assert_eq!(pick(512, 16384, bf16, 3), (4, 3, 2, 1, 16384));
        // FP8 and INT4: as many resident warps as fit, few stages, no split.
        assert_eq!(pick(512, 16384, fp8, 4), (4, 2, 4, 1, 16384));
        assert_eq!(pick(1024, 8192, int4, 3), (4, 2, 3, 1, 8192));
        // One sequence of 32k (8 blocks per split): every SM gets one block of 8 warps.
        for (cache, regs) in [(bf16, 3), (int4, 3)] {
            let (w, _, _, n, len) = pick(8, 32768, cache, regs);
            assert!(
                w == 8 && (14..=16).contains(&n) && n * len >= 32768,
                "{n} x {len}"
            );
            assert_eq!(len % SPLIT_MULTIPLE, 0);
        }
        // Short contexts are never cut below MIN_SPLIT_TOKENS.
        let (.., n, len) = pick(1, 300, bf16, 3);
        assert!(n <= 2 && n * len >= 300);
        // Every choice covers the context with at most MAX_SPLITS splits.
        for (base, len) in [(1, 1), (1, 1 << 20), (3, 777), (4096, 5), (140, 16384)] {
            let (.., n, l) = pick(base, len, int4, 3);
            assert!((1..=MAX_SPLITS).contains(&n) && n * l >= len && l % SPLIT_MULTIPLE == 0);
        }
        // Huge stages: whatever fits.
        let (_, _, ctas, ..) = pick(8, 32768, (int4.0, 25_000), 2);
        assert!(ctas >= 1);
        // Nothing fits: an error, not a panic.
        assert!(choose_launch(128, 132, 4096, bf16.0, occ_model(200_000, 2)).is_err());
    }

    #[test]
    fn waves() {
        let m = |inflight, warps| RateModel {
            inflight,
            warps,
            inflight_target: 128 << 10,
            full_rate_warps: 8,
        };
        // Full waves at full rate cost their block count per SM; a thin last wave costs more.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 4)), 2.0);
        assert!(wave_time(396 + 132, 132, 3, m(43 << 10, 4)) > 4.0);
        // Too few warps slow an SM down as too few copies do.
        assert_eq!(wave_time(264, 132, 2, m(64 << 10, 2)), 4.0);
    }

    #[test]
    fn formats_with_kernels() {
        assert!(kernel_available(KvFormat::Int4Sym32, KvFormat::Fp8E4m3));
        assert!(kernel_available(KvFormat::Bf16, KvFormat::Int4Affine64));
        assert!(kernel_available(KvFormat::Fp8E5m2, KvFormat::Fp8E5m2));
        assert!(!kernel_available(KvFormat::Int4Affine64, KvFormat::F16));
        assert!(!kernel_available(KvFormat::Fp8E5m2, KvFormat::F16));
    }
}
