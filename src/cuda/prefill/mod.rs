//! Attention over the paged cache for any query length on the GPU (`cuda/prefill.cu`): chunked
//! prefill, the suffix after a prefix-cache hit, speculative verification and decode rows, in
//! one ragged batch, for every cache format pair: `int4-kc` keys too, their sealed blocks
//! decoded and a sequence's open last block read from its f16 window
//! ([`BlockLayout::sealed`](crate::layout::BlockLayout::sealed)).
//!
//! Semantics are those of [`cpu::prefill_attention`](crate::cpu::prefill_attention): sequence
//! `b` has `n_b = qo_indptr[b + 1] - qo_indptr[b]` new tokens, already appended, and a context
//! of `L_b >= n_b` tokens (the tables' length); its query token `i` sits at position
//! `L_b - n_b + i` and sees the positions before it and itself (causal), or only the last
//! `window_left + 1` of them with a sliding window. Queries and outputs are token-major
//! `[total_tokens, num_q_heads, head_dim]` views ([`TokenRows`]).
//!
//! An engine's step:
//! 1. [`PrefillPlan::new`] once for a [`PrefillCapacity`] (sequences, query heads, tokens per
//!    step, context), with its options (scale, window, soft cap); [`PrefillWorkspace::new`] once.
//! 2. Every step: append the new K/V ([`ops::append`](super::ops::append)), update and upload
//!    the [`DeviceBlockTables`] (lengths include the new tokens), put the step's `qo_indptr`
//!    on the device (the engine's own buffer; the host copy is checked against the tables),
//!    then [`PrefillPlan::prefill`]: host checks, then one launch (two with split-KV), no
//!    allocation, no host synchronization.
//!
//! Long contexts with few query rows (a short chunk after a long prefix) are cut into splits of
//! the keys that run side by side and are merged by a second kernel; [`merge_states`] is the
//! same merge for an engine's own partial attentions (cascade / shared-prefix attention).
//!
//! Long prompts and chunks over a quantized cache may run in two passes
//! ([`PrefillPlan::with_two_pass`]): the step's context decoded once into a 16-bit scratch
//! (`kvq_decode_context`), then the 16-bit kernel over it.

mod heuristic;

use super::decode::{DecodePlan, DecodeWorkspace, RawDecodeArgs, RowStrides};
use super::device::{DeviceCache, raw_layout};
use super::ops::{DeviceElement, Dtype, need_len, to_i32};
use super::tables::DeviceBlockTables;
use super::{Gpu, driver_err, launch, owned_ptr, sys};
use crate::error::{Error, Result, at_least_one, reserved};
use crate::format::KvFormat;
use crate::layout::{BlockLayout, CacheConfig};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// Query rows (new tokens × query heads of one KV head) one thread block serves.
pub const TILE_ROWS: usize = sys::KVQ_PREFILL_TILE_ROWS as usize;
/// KV tokens one step of the kernel takes; split lengths are multiples of it.
pub const TILE_TOKENS: usize = sys::KVQ_PREFILL_TILE_TOKENS as usize;
/// Longest split-KV fan-out of one launch.
pub const MAX_SPLITS: usize = sys::KVQ_PREFILL_MAX_SPLITS as usize;
/// Head dims with a prefill kernel.
pub const HEAD_DIMS: [usize; 7] = [64, 80, 96, 112, 128, 192, 256];
/// Token-splits the workspace holds by default (see [`PrefillPlan::with_split_budget`]).
pub const DEFAULT_SPLIT_BUDGET: usize = 2048;
/// [`TwoPass::new`]'s `min_rows`: a step's prefill sequences average at least this many query
/// rows (new tokens times the query heads of a KV head), so that the fused kernel would decode
/// each KV tile in about 16 thread blocks or more (narrow tiles; a third of that in triple
/// tiles). A prediction from the decode's share of the fused times (docs/PERFORMANCE.md,
/// sessions 48-49), not yet measured.
pub const TWO_PASS_MIN_ROWS: usize = 1024;

/// How a [`PrefillPlan`] may run a compute-bound step over a quantized cache in two passes
/// ([`PrefillPlan::with_two_pass`]): first the step's context is decoded once into a 16-bit
/// scratch cache that the [`PrefillWorkspace`] owns, then the 16-bit kernel attends over it. The
/// fused kernel instead decodes each KV tile in every thread block that reads it, which at a
/// long prompt or chunk is tens of times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TwoPass {
    /// Context tokens the scratch holds: a step takes two passes only when its prefill
    /// sequences' contexts, each rounded up to whole blocks, fit in these tokens' blocks. The
    /// workspace allocates `ceil(scratch_tokens / block_size)` blocks of 2 bytes an element.
    pub scratch_tokens: usize,
    /// Fewest query rows a step's prefill sequences average for it to take two passes (below
    /// that each KV tile is read by few thread blocks, and the scratch's bytes cost more than
    /// the decode they save).
    pub min_rows: usize,
}

impl TwoPass {
    /// A scratch of `scratch_tokens` context tokens, two passes from [`TWO_PASS_MIN_ROWS`]
    /// rows a sequence.
    pub fn new(scratch_tokens: usize) -> Self {
        TwoPass {
            scratch_tokens,
            min_rows: TWO_PASS_MIN_ROWS,
        }
    }
}

/// Whether this build has a prefill kernel for keys in `k`, values in `v` at `head_dim`, with
/// bf16 (`q_bf16`) or f16 queries. The queries' type is also the tensor cores' operand type, so
/// a bf16 side needs bf16 queries. `int4-kc` keys take every value format, at the head dims
/// that are multiples of 32.
pub fn kernel_available_for(k: KvFormat, v: KvFormat, head_dim: usize, q_bf16: bool) -> bool {
    let (Ok(d), Ok(q)) = (
        i32::try_from(head_dim),
        Ok::<i32, ()>(if q_bf16 { Dtype::Bf16 } else { Dtype::F16 }.raw()),
    ) else {
        return false;
    };
    launch::prefill_supported(k as i32, v as i32, d, q)
}

/// Where the rows of a token-major tensor live, in elements: element `d` of token `t` (counted
/// over the whole batch) and head `h` is at `t * token + h * head + d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenRows {
    /// Elements between consecutive tokens.
    pub token: usize,
    /// Elements between heads.
    pub head: usize,
}

impl TokenRows {
    /// `[tokens, heads, width]`, contiguous (`width` = head_dim, or 1 for `lse`).
    pub fn contiguous(heads: usize, width: usize) -> Self {
        TokenRows {
            token: heads * width,
            head: width,
        }
    }

    /// The same rows as a decode step's [`RowStrides`], `q_len` new tokens per sequence: one
    /// description of an engine's `[tokens, heads, d]` tensor (or view) serves both plans.
    pub fn with_q_len(self, q_len: usize) -> RowStrides {
        RowStrides {
            seq: q_len * self.token,
            token: self.token,
            head: self.head,
        }
    }

    /// One past the last element of `tokens × heads` rows of `width`; None on overflow.
    fn extent(&self, tokens: usize, heads: usize, width: usize) -> Option<usize> {
        if tokens == 0 {
            return Some(0);
        }
        (tokens - 1)
            .checked_mul(self.token)?
            .checked_add((heads - 1).checked_mul(self.head)?)?
            .checked_add(width)
    }

    /// Whether distinct rows never share an element.
    fn disjoint(&self, tokens: usize, heads: usize, width: usize) -> bool {
        let mut dims = [(self.token, tokens), (self.head, heads)];
        dims.sort();
        let mut span = width;
        for (stride, n) in dims {
            if n <= 1 {
                continue;
            }
            if stride < span {
                return false;
            }
            span = match stride.checked_mul(n - 1).and_then(|x| x.checked_add(span)) {
                Some(s) => s,
                None => return false,
            };
        }
        true
    }

    fn raw(&self) -> Result<(i64, i64)> {
        let i = |v: usize| {
            i64::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("row stride {v} exceeds int64")))
        };
        Ok((i(self.token)?, i(self.head)?))
    }
}

/// The tensors of one step for [`PrefillPlan::prefill`]. `Q`, `O` are any cudarc device buffers
/// (a `CudaSlice`, or a view into a larger one).
pub struct PrefillStep<'a, Q, O> {
    /// `[batch + 1]` offsets of each sequence's new tokens, on the host: checked against the
    /// tables (and used to cut the launch); it must equal `qo_indptr_dev` ([`QoIndptr`] holds
    /// both: `qo.host()`, `qo.device()`).
    pub qo_indptr: &'a [u32],
    /// The same offsets on the device (i32), as the kernel reads them: a `CudaSlice` or a view.
    pub qo_indptr_dev: &'a dyn DevicePtr<i32>,
    /// Queries (f16 or bf16), rows at `q_rows`: strides multiples of 8, the buffer 16-byte
    /// aligned (cudarc's allocations are).
    pub q: &'a Q,
    /// Where the query rows are.
    pub q_rows: TokenRows,
    /// Output (f16, bf16 or f32), rows at `out_rows` (must not overlap).
    pub out: &'a mut O,
    /// Where the output rows go.
    pub out_rows: TokenRows,
    /// Optional f32 log-sum-exps (natural log, sink included) and where they go (width 1): a
    /// `CudaSlice` or a view into a larger buffer. Trait objects here and below, so that `None`
    /// needs no type annotation.
    pub lse: Option<(&'a mut dyn DevicePtrMut<f32>, TokenRows)>,
    /// Optional per-query-head sink logits `[num_q_heads]` (gpt-oss): each joins its head's
    /// softmax denominator, with a zero value.
    pub sinks: Option<&'a dyn DevicePtr<f32>>,
    /// Optional per-query-head ALiBi slopes `[num_q_heads]`, finite (not checked on the host,
    /// which does not read device memory): the logit of token `i` of sequence `b` (position
    /// `p = L_b - n_b + i`) of head `h` for the key at position `j <= p` gains
    /// `slopes[h] * (j - p)`, after the soft cap; sinks are not biased. Routed decode rows
    /// ([`with_decode_rows`](PrefillPlan::with_decode_rows)) take them too.
    pub alibi_slopes: Option<&'a dyn DevicePtr<f32>>,
}

/// A prefill step's `qo_indptr` held once: the host offsets and their device copy, set
/// together, so that [`PrefillStep`]'s two fields (`qo.host()`, `qo.device()`) cannot disagree.
/// [`set`](Self::set) checks the offsets and copies them on the handle's stream (the plan's),
/// from pageable memory: CUDA may hold the host while it stages those few bytes (its
/// documentation lets a pageable copy be synchronous), and such a copy cannot be captured (a
/// captured prefill keeps its own device buffer, filled outside the graph, as before).
#[derive(Debug)]
pub struct QoIndptr {
    gpu: Gpu,
    host: Vec<u32>,
    /// Running sums being built by `set_counts`.
    scratch: Vec<u32>,
    dev: CudaSlice<i32>,
}

impl QoIndptr {
    /// Room for steps of up to `max_batch` sequences (`max_batch + 1` offsets), on `gpu`'s
    /// stream; it holds `[0]` (no sequence) until set.
    pub fn new(gpu: &Gpu, max_batch: usize) -> Result<Self> {
        at_least_one(&[("max_batch", max_batch)])?;
        let n = max_batch
            .checked_add(1)
            .filter(|&n| n <= i32::MAX as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("max_batch {max_batch} is too large")))?;
        gpu.bind()?;
        let dev = gpu
            .stream()
            .alloc_zeros::<i32>(n)
            .map_err(driver_err("allocating qo_indptr"))?;
        let mut host = reserved(n, "qo_indptr")?;
        host.push(0);
        Ok(QoIndptr {
            gpu: gpu.clone(),
            host,
            scratch: reserved(n, "qo_indptr")?,
            dev,
        })
    }

    /// The step's offsets: `[batch + 1]`, from 0, non-decreasing, each at most `i32::MAX`,
    /// `batch` at most the capacity. Checked, then copied to the device on the stream; on an
    /// error nothing changes.
    pub fn set(&mut self, offsets: &[u32]) -> Result<()> {
        check_qo_offsets(offsets, self.dev.len())?;
        // Checked to be at most i32::MAX: the same bits as the i32 the kernel reads.
        let as_i32: &[i32] = bytemuck::cast_slice(offsets);
        self.gpu
            .stream()
            .memcpy_htod(as_i32, &mut self.dev)
            .map_err(driver_err("uploading qo_indptr"))?;
        self.host.clear();
        self.host.extend_from_slice(offsets);
        Ok(())
    }

    /// [`set`](Self::set) from each sequence's number of new tokens (their running sums).
    pub fn set_counts(&mut self, new_tokens: &[usize]) -> Result<()> {
        let mut offsets = std::mem::take(&mut self.scratch);
        offsets.clear();
        offsets.push(0);
        let mut sum = 0usize;
        for &n in new_tokens {
            // Saturated sums stay non-decreasing, and `set` refuses any past i32.
            sum = sum.saturating_add(n);
            offsets.push(u32::try_from(sum).unwrap_or(u32::MAX));
        }
        let r = self.set(&offsets);
        self.scratch = offsets;
        r
    }

    /// The offsets last set, on the host (`PrefillStep::qo_indptr`).
    pub fn host(&self) -> &[u32] {
        &self.host
    }

    /// Their device copy (`PrefillStep::qo_indptr_dev`; longer than the offsets, which is
    /// allowed).
    pub fn device(&self) -> &CudaSlice<i32> {
        &self.dev
    }
}

/// Offsets a launch (or a [`QoIndptr`] of `room` entries) takes: 1 to `room` of them, from 0,
/// non-decreasing, at most `i32::MAX`.
fn check_qo_offsets(offsets: &[u32], room: usize) -> Result<()> {
    if offsets.is_empty() || offsets.len() > room {
        return Err(Error::InvalidArgument(format!(
            "qo_indptr: {} offsets where 1..={room} fit (batch + 1, batch up to the capacity)",
            offsets.len()
        )));
    }
    if offsets[0] != 0 {
        return Err(Error::InvalidArgument(format!(
            "qo_indptr[0] must be 0, got {}",
            offsets[0]
        )));
    }
    if let Some(b) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidArgument(format!(
            "qo_indptr decreases at {b}: {} then {}",
            offsets[b],
            offsets[b + 1]
        )));
    }
    let last = offsets[offsets.len() - 1];
    if last > i32::MAX as u32 {
        return Err(Error::InvalidArgument(format!(
            "qo_indptr ends at {last}, past i32"
        )));
    }
    Ok(())
}

/// The most a [`PrefillPlan`] serves in one step: named, so that no two of these sizes can be
/// swapped unseen at the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillCapacity {
    /// Most sequences per step.
    pub max_batch: usize,
    /// Query heads (a multiple of the cache's KV heads).
    pub num_q_heads: usize,
    /// Most new tokens per step, all sequences together.
    pub max_tokens: usize,
    /// Longest context, new tokens included.
    pub max_context_len: usize,
}

/// How prefill launches for one cache layout and capacity are made.
#[derive(Debug, Clone)]
pub struct PrefillPlan {
    gpu: Gpu,
    layout: BlockLayout,
    cap: PrefillCapacity,
    softmax_scale: f32,
    window_left: Option<usize>,
    soft_cap: Option<f32>,
    split_budget: usize,
    forced_splits: Option<usize>,
    graph_grid: bool,
    /// E4M3 operands for fp8-e4m3 caches (`with_e4m3_operands`).
    e4m3_operands: bool,
    /// The decode plan a step's leading decode rows are routed to (`with_decode_rows`).
    decode_rows: Option<DecodePlan>,
    /// Compute-bound steps decode their context once, then attend in 16 bits (`with_two_pass`).
    two_pass: Option<TwoPass>,
}

impl PrefillPlan {
    /// A plan for up to `cap.max_batch` sequences with up to `cap.max_tokens` new tokens in all
    /// per step, `cap.num_q_heads` query heads and contexts of up to `cap.max_context_len`
    /// tokens, over caches of `layout`, with `softmax_scale = 1 / sqrt(head_dim)`, no window
    /// and no cap.
    ///
    /// Errors: [`Error::Unsupported`] for a layout without a kernel (head_dim, format pair,
    /// block size not a multiple of 16); [`Error::Config`] for a zero size (as
    /// [`DecodePlan::new`]); [`Error::InvalidArgument`] for heads that are not a multiple of
    /// the KV heads.
    pub fn new(gpu: &Gpu, layout: &BlockLayout, cap: PrefillCapacity) -> Result<Self> {
        let PrefillCapacity {
            max_batch,
            num_q_heads,
            max_tokens,
            max_context_len,
        } = cap;
        let c = &layout.config;
        c.validate()?;
        at_least_one(&[
            ("max_batch", max_batch),
            ("num_q_heads", num_q_heads),
            ("max_tokens", max_tokens),
            ("max_context_len", max_context_len),
        ])?;
        if num_q_heads % c.num_kv_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "{num_q_heads} query heads are not a multiple of {} KV heads",
                c.num_kv_heads
            )));
        }
        if c.block_size % 16 != 0 {
            return Err(Error::Unsupported(format!(
                "GPU prefill with blocks of {} tokens (a multiple of 16 is needed)",
                c.block_size
            )));
        }
        if !HEAD_DIMS.contains(&c.head_dim)
            || !(kernel_available_for(c.k_format, c.v_format, c.head_dim, true)
                || kernel_available_for(c.k_format, c.v_format, c.head_dim, false))
        {
            return Err(Error::Unsupported(format!(
                "GPU prefill of {} keys with {} values at head_dim {}",
                c.k_format, c.v_format, c.head_dim
            )));
        }
        to_i32("max_tokens", max_tokens)?;
        to_i32("max_batch", max_batch)?;
        Ok(PrefillPlan {
            gpu: gpu.clone(),
            layout: *layout,
            cap,
            softmax_scale: 1.0 / (c.head_dim as f32).sqrt(),
            window_left: None,
            soft_cap: None,
            split_budget: DEFAULT_SPLIT_BUDGET,
            forced_splits: None,
            graph_grid: false,
            e4m3_operands: false,
            decode_rows: None,
            two_pass: None,
        })
    }

    /// Logits are `softmax_scale * q · k` (positive and finite).
    pub fn with_softmax_scale(mut self, softmax_scale: f32) -> Result<Self> {
        crate::cpu::check_softmax_scale(softmax_scale)?;
        self.softmax_scale = softmax_scale;
        if let Some(d) = self.decode_rows.take() {
            self.decode_rows = Some(d.with_softmax_scale(softmax_scale)?);
        }
        Ok(self)
    }

    /// Route each step's decode rows to the decode kernel: the leading run of sequences with
    /// the same number of new tokens, 1 up to `decode`'s `q_len` (decodes, or speculative
    /// verification of a few draft tokens; engines batch these first), goes to `decode`'s
    /// kernel, the rest to the prefill kernel, in two launches on the stream of one call, with
    /// the same tables. The decode kernel reads a quantized cache at its full bandwidth, where
    /// the prefill kernel pads a few-token row to its 64-row tile. Both kernels apply this
    /// plan's window, soft cap and the step's sinks and ALiBi slopes. Rows are served by the prefill kernel
    /// alone under [`with_graph_grid`](Self::with_graph_grid) (the cut is made on the host per
    /// step).
    ///
    /// `decode` must be for this plan's GPU, layout and query heads, with at least this plan's
    /// batch and context capacity; it takes this plan's softmax scale, window and cap. Errors:
    /// [`Error::InvalidArgument`] otherwise.
    pub fn with_decode_rows(mut self, decode: DecodePlan) -> Result<Self> {
        let why = if decode.gpu().context() != self.gpu.context() {
            Some("another GPU")
        } else if decode.layout() != &self.layout {
            Some("another layout")
        } else if decode.num_q_heads() != self.cap.num_q_heads {
            Some("another number of query heads")
        } else if decode.capacity().max_batch < self.cap.max_batch {
            Some("a smaller batch")
        } else if decode.capacity().max_context_len < self.cap.max_context_len {
            Some("a shorter max_context_len")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::InvalidArgument(format!(
                "the decode plan for routed rows is for {why} than the prefill plan"
            )));
        }
        self.decode_rows = Some(
            decode
                .with_softmax_scale(self.softmax_scale)?
                .with_window_left(self.window_left)?
                .with_logits_soft_cap(self.soft_cap)?,
        );
        Ok(self)
    }

    /// A sliding window: a query at position `p` sees positions `p - w ..= p` (None: all).
    pub fn with_window_left(mut self, window_left: Option<usize>) -> Result<Self> {
        if let Some(w) = window_left {
            to_i32("window_left", w)?;
        }
        self.window_left = window_left;
        if let Some(d) = self.decode_rows.take() {
            self.decode_rows = Some(d.with_window_left(window_left)?);
        }
        Ok(self)
    }

    /// Logit soft-capping (Gemma 2): `cap * tanh(logit / cap)` (None: off).
    pub fn with_logits_soft_cap(mut self, cap: Option<f32>) -> Result<Self> {
        crate::cpu::check_soft_cap(cap)?;
        self.soft_cap = cap;
        if let Some(d) = self.decode_rows.take() {
            self.decode_rows = Some(d.with_logits_soft_cap(cap)?);
        }
        Ok(self)
    }

    /// How many (token, split) partial rows the workspace holds: a step splits its keys only
    /// when its tokens times the splits fit (0: never split).
    pub fn with_split_budget(mut self, token_splits: usize) -> Self {
        self.split_budget = token_splits;
        self
    }

    /// Force the number of key splits (clamped to what the workspace and [`MAX_SPLITS`] allow;
    /// None: the plan's choice).
    pub fn with_num_splits(mut self, splits: Option<usize>) -> Self {
        self.forced_splits = splits;
        self
    }

    /// Size every launch's grid by the capacity instead of the step (and never split), so
    /// that one launch captured in a CUDA graph serves every later step.
    pub fn with_graph_grid(mut self, on: bool) -> Self {
        self.graph_grid = on;
        self
    }

    /// Let an fp8-e4m3 cache's codes feed FP8 tensor cores as stored (opt-in; off by default):
    /// each query row is rounded to E4M3 under its own scale (its amax / 448) and each
    /// probability `p` to the E4M3 of `p * 2^8`, as FP8 MMAs need. That adds 5-15 % to the FP8
    /// cache's own attention error (docs/ACCURACY.md, "E4M3 operands"); what it saves in time:
    /// docs/PERFORMANCE.md. It applies where both sides are fp8-e4m3 and the
    /// warp-specialized kernel runs (sm_90a, head_dim 128); elsewhere, and for rows routed to
    /// the decode kernel, the operands stay decoded.
    pub fn with_e4m3_operands(mut self, on: bool) -> Self {
        self.e4m3_operands = on;
        self
    }

    /// Run compute-bound steps over a quantized cache in two passes (off by default; see
    /// [`TwoPass`]). A step takes them when a side of the cache is quantized, its prefill
    /// sequences average at least `min_rows` query rows and their contexts fit the scratch, and
    /// there is no sliding window, no graph grid ([`with_graph_grid`](Self::with_graph_grid))
    /// and no E4M3 operands ([`with_e4m3_operands`](Self::with_e4m3_operands)); other steps,
    /// and rows routed to the decode kernel, stay fused. The scratch holds each value decoded
    /// to the queries' type (f16 or bf16), the operands the fused kernel forms from the same
    /// codes up to that rounding, so the results agree with the fused path's to within it
    /// (docs/ACCURACY.md). The workspace made from this plan holds the scratch: 2 bytes an
    /// element of `scratch_tokens` tokens, all KV heads, keys and values, one buffer for every
    /// layer. [`PrefillWorkspace::two_pass_last_step`] tells which path a step took.
    ///
    /// Errors: [`Error::Config`] for a scratch of no tokens; [`Error::Unsupported`] or
    /// [`Error::Overflow`] for one whose block ids or bytes are not addressable.
    pub fn with_two_pass(mut self, two_pass: Option<TwoPass>) -> Result<Self> {
        if let Some(t) = two_pass {
            at_least_one(&[("scratch_tokens", t.scratch_tokens)])?;
            let blocks = t.scratch_tokens.div_ceil(self.layout.config.block_size);
            to_i32("scratch blocks", blocks)?;
            self.scratch_layout(Dtype::F16)?.try_pool_bytes(blocks)?;
        }
        self.two_pass = two_pass;
        Ok(self)
    }

    /// The two-pass setting ([`with_two_pass`](Self::with_two_pass)).
    pub fn two_pass(&self) -> Option<TwoPass> {
        self.two_pass
    }

    /// The layout of the two-pass scratch for queries of `q`: both sides in
    /// [`scratch_format`]`(q)`, the cache's heads, head_dim and block size.
    fn scratch_layout(&self, q: Dtype) -> Result<BlockLayout> {
        CacheConfig {
            k_format: scratch_format(q),
            v_format: scratch_format(q),
            ..self.layout.config
        }
        .try_layout()
    }

    /// Blocks of the two-pass scratch, and the stride of its tables (blocks of the longest
    /// context).
    fn scratch_blocks(&self) -> Option<(usize, usize)> {
        let bs = self.layout.config.block_size;
        self.two_pass.map(|t| {
            (
                t.scratch_tokens.div_ceil(bs),
                self.cap.max_context_len.div_ceil(bs),
            )
        })
    }

    /// Whether a step whose prefill sequences (those past the routed decode rows) have `rows`
    /// query rows in all, `seqs` of them with contexts of `blocks` blocks in all, takes two
    /// passes with queries of `q`.
    fn takes_two_pass(&self, q: Dtype, rows: usize, seqs: usize, blocks: usize) -> bool {
        let c = &self.layout.config;
        let Some(t) = self.two_pass else {
            return false;
        };
        let both_e4m3 = c.k_format == KvFormat::Fp8E4m3 && c.v_format == KvFormat::Fp8E4m3;
        let quantized = c.k_format.bits() < 16 || c.v_format.bits() < 16;
        quantized
            && seqs > 0
            && !self.graph_grid
            && self.window_left.is_none()
            && !(self.e4m3_operands && both_e4m3)
            && rows >= t.min_rows.saturating_mul(seqs)
            && self
                .scratch_blocks()
                .is_some_and(|(have, _)| blocks <= have)
            && {
                let f = scratch_format(q);
                kernel_available_for(f, f, c.head_dim, q == Dtype::Bf16)
            }
    }

    /// Whether the plan asks for E4M3 operands ([`with_e4m3_operands`](Self::with_e4m3_operands)).
    pub fn e4m3_operands(&self) -> bool {
        self.e4m3_operands
    }

    /// The plan's GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The layout the plan serves.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// The softmax scale.
    pub fn softmax_scale(&self) -> f32 {
        self.softmax_scale
    }

    /// The capacity the plan was made for.
    pub fn capacity(&self) -> PrefillCapacity {
        self.cap
    }

    /// Query heads.
    pub fn num_q_heads(&self) -> usize {
        self.cap.num_q_heads
    }

    /// (partial outputs, partial lse) f32 elements of the workspace.
    pub fn workspace_elems(&self) -> (usize, usize) {
        let rows = self.split_budget * self.cap.num_q_heads;
        (rows * self.layout.config.head_dim, rows)
    }

    /// Key splits for a step of `total` tokens whose tiles give `ctas` thread blocks (`wide`
    /// tiles or narrow ones) and whose longest context is `max_len`, over a `quantized` cache or
    /// a 16-bit one: at least 256 keys a split, within the workspace, as many as
    /// [`heuristic::key_splits`] finds fastest.
    fn splits_for(
        &self,
        total: usize,
        ctas: usize,
        max_len: usize,
        wide: bool,
        quantized: bool,
    ) -> usize {
        if self.graph_grid || total == 0 || self.split_budget < total {
            return 1;
        }
        let fit = (self.split_budget / total).min(MAX_SPLITS);
        if let Some(s) = self.forced_splits {
            return s.clamp(1, fit.max(1));
        }
        let per_sm = heuristic::blocks_per_sm(quantized, wide);
        let slots = per_sm * self.gpu.props().sm_count as usize;
        heuristic::key_splits(ctas, max_len, slots, (max_len / 256).min(fit).max(1))
    }

    /// One step (see the module docs). `tables.batch()` sequences; row `b`'s length counts its
    /// `qo_indptr[b + 1] - qo_indptr[b]` new tokens.
    pub fn prefill<Q, QB, O, OB>(
        &self,
        ws: &mut PrefillWorkspace,
        cache: &DeviceCache,
        tables: &DeviceBlockTables,
        step: PrefillStep<'_, QB, OB>,
    ) -> Result<()>
    where
        Q: DeviceElement,
        O: DeviceElement,
        QB: DevicePtr<Q>,
        OB: DevicePtrMut<O>,
    {
        let c = &self.layout.config;
        tables.check_for(&self.layout, cache)?;
        if Q::DTYPE == Dtype::F32 {
            return Err(Error::Unsupported(
                "GPU prefill with f32 queries (use f16 or bf16)".into(),
            ));
        }
        if !kernel_available_for(c.k_format, c.v_format, c.head_dim, Q::DTYPE == Dtype::Bf16) {
            return Err(Error::Unsupported(format!(
                "GPU prefill of {} keys with {} values and {:?} queries (a bf16 side needs \
                 bf16 queries)",
                c.k_format,
                c.v_format,
                Q::DTYPE
            )));
        }
        let batch = tables.batch();
        ws.two_pass_last = false;
        if batch == 0 {
            return Ok(());
        }
        if batch > self.cap.max_batch {
            return Err(Error::InvalidArgument(format!(
                "a batch of {batch} exceeds the plan's capacity of {}",
                self.cap.max_batch
            )));
        }
        let qo = step.qo_indptr;
        need_len("qo_indptr (batch + 1 offsets)", batch + 1, qo.len())?;
        need_len(
            "qo_indptr_dev (batch + 1 offsets)",
            batch + 1,
            step.qo_indptr_dev.len(),
        )?;
        check_qo_offsets(&qo[..=batch], batch + 1)?;
        let (heads, d) = (self.cap.num_q_heads, c.head_dim);
        let group = heads / c.num_kv_heads;
        // Decode rows routed to the decode kernel: the leading sequences with the first one's
        // number of new tokens, n_0 in 1..=the decode plan's q_len.
        let route = match (&self.decode_rows, &ws.decode) {
            (Some(plan), Some(dws)) if !self.graph_grid => Some((plan, dws.device_ptrs())),
            _ => None,
        };
        let lead_len = qo[1].wrapping_sub(qo[0]) as usize;
        let lead = match route {
            Some((plan, _)) if (1..=plan.capacity().max_q_len).contains(&lead_len) => qo
                .windows(2)
                .take_while(|w| w[1].checked_sub(w[0]) == Some(lead_len as u32))
                .count(),
            _ => 0,
        };
        // Tiles of the kernel's narrow and wide rows (wide_tiles in cuda/prefill.cu); the
        // prefill sequences with new tokens, and the blocks of every prefill sequence's context
        // (what a two-pass step decodes).
        let (mut tiles, mut wide_tiles, mut max_len) = (0usize, 0usize, 0usize);
        let (mut prefill_seqs, mut ctx_blocks) = (0usize, 0usize);
        for b in 0..batch {
            let n = (qo[b + 1] - qo[b]) as usize;
            let len = tables.context_len(b).unwrap_or(0);
            if n > len {
                return Err(Error::InvalidArgument(format!(
                    "sequence {b} has {n} new tokens but a context of {len} (append them first)"
                )));
            }
            if len > self.cap.max_context_len {
                return Err(Error::InvalidArgument(format!(
                    "a context of {len} tokens exceeds the plan's max_context_len {}",
                    self.cap.max_context_len
                )));
            }
            if b >= lead {
                ctx_blocks += len.div_ceil(c.block_size);
            }
            if n > 0 && b >= lead {
                tiles += (n * group).div_ceil(TILE_ROWS);
                wide_tiles += (n * group).div_ceil(heuristic::WIDE_ROWS);
                max_len = max_len.max(len);
                prefill_seqs += 1;
            }
        }
        let total = qo[batch] as usize;
        if total > self.cap.max_tokens {
            return Err(Error::InvalidArgument(format!(
                "a step of {total} tokens exceeds the plan's capacity of {}",
                self.cap.max_tokens
            )));
        }
        if step.q_rows.token % 8 != 0 || step.q_rows.head % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "q: strides {:?} must be multiples of 8 elements",
                step.q_rows
            )));
        }
        let need = |what: &'static str, rows: &TokenRows, width: usize, len: usize| {
            let extent = rows.extent(total, heads, width).ok_or_else(|| {
                Error::InvalidArgument(format!("{what}: strides {rows:?} overflow"))
            })?;
            need_len(what, extent, len)
        };
        need("q (rows at q_rows)", &step.q_rows, d, step.q.len())?;
        need("out (rows at out_rows)", &step.out_rows, d, step.out.len())?;
        if !step.out_rows.disjoint(total, heads, d) {
            return Err(Error::InvalidArgument(format!(
                "out: rows at {:?} overlap",
                step.out_rows
            )));
        }
        if let Some((l, rows)) = &step.lse {
            need("lse (rows at lse_rows)", rows, 1, l.len())?;
            if !rows.disjoint(total, heads, 1) {
                return Err(Error::InvalidArgument(format!(
                    "lse: rows at {rows:?} overlap"
                )));
            }
        }
        if let Some(s) = step.sinks {
            need_len("sinks ([num_q_heads])", heads, s.len())?;
        }
        if let Some(m) = step.alibi_slopes {
            need_len("alibi_slopes ([num_q_heads])", heads, m.len())?;
        }
        ws.check(self)?;
        if let (Some((plan, _)), Some(dws)) = (route, &ws.decode) {
            dws.check(plan)?;
        }
        for g in [cache.gpu(), tables.gpu(), ws.gpu()] {
            if g.context() != self.gpu.context() {
                return Err(Error::InvalidArgument(format!(
                    "the plan is for GPU {}, an argument lives on GPU {}",
                    self.gpu.props().ordinal,
                    g.props().ordinal
                )));
            }
        }
        if total == 0 {
            return Ok(());
        }
        let prefill_rows = (total - qo[lead] as usize) * group;
        let two_pass = self.takes_two_pass(Q::DTYPE, prefill_rows, prefill_seqs, ctx_blocks);
        // Where the scratch is and its raw layout, in a two-pass step.
        let scratch_raw = match (two_pass, &ws.scratch) {
            (true, Some(sc)) => Some((sc.at, raw_layout(&self.scratch_layout(Q::DTYPE)?)?)),
            _ => None,
        };
        // The formats the attention launch reads: the scratch's in a two-pass step.
        let (k_format, v_format) = match scratch_raw {
            Some(_) => (scratch_format(Q::DTYPE), scratch_format(Q::DTYPE)),
            None => (c.k_format, c.v_format),
        };
        let quantized = k_format.bits() < 16 || v_format.bits() < 16;
        // Wide tiles where the sequences average at least their rows, as the launcher decides.
        let wide = total * group >= heuristic::WIDE_ROWS * (batch - lead);
        let ctas = if wide { wide_tiles } else { tiles } * c.num_kv_heads;
        let splits = self.splits_for(total, ctas, max_len, wide, quantized);
        let split_tokens = max_len.div_ceil(splits).div_ceil(TILE_TOKENS).max(1) * TILE_TOKENS;
        // A wide launch's tile width from the step's sequences; the graph's grid, sized by the
        // capacity, leaves it to the launcher.
        let wide_tile_rows = if self.graph_grid || !wide {
            0
        } else {
            let seqs = (lead..batch).map(|b| {
                let n = (qo[b + 1] - qo[b]) as usize;
                (n, tables.context_len(b).unwrap_or(0))
            });
            let grid = heuristic::Grid {
                group,
                kv_heads: c.num_kv_heads,
                splits,
                split_tokens,
                window_left: self.window_left,
                sms: self.gpu.props().sm_count as usize,
            };
            if heuristic::prefer_triple(seqs, &grid, k_format, v_format) {
                heuristic::TRIPLE_ROWS
            } else {
                heuristic::WIDE_ROWS
            }
        };
        let launch_tokens = if self.graph_grid {
            self.cap.max_tokens
        } else {
            total
        };
        let layout = raw_layout(&self.layout)?;
        self.gpu.bind()?;
        self.gpu.check_capture()?;
        launch::prefill_prepare(
            scratch_raw.as_ref().map_or(&layout, |(_, l)| l),
            Q::DTYPE.raw(),
        )?;
        ws.two_pass_last = scratch_raw.is_some();
        let s = self.gpu.stream();
        let (ctx_lens, block_tables) = tables.device_ptrs();
        let PrefillStep {
            qo_indptr_dev,
            q,
            q_rows,
            out,
            out_rows,
            lse,
            sinks,
            alibi_slopes,
            ..
        } = step;
        self.gpu
            .ordered(&[cache.gpu(), tables.gpu(), ws.gpu()], || {
                let (q_p, _g1) = q.device_ptr(s);
                if q_p % 16 != 0 {
                    return Err(Error::InvalidArgument(
                        "q: the buffer must be 16-byte aligned".into(),
                    ));
                }
                let (o_p, _g2) = out.device_ptr_mut(s);
                let (qo_p, _g3) = qo_indptr_dev.device_ptr(s);
                let (lse_p, lse_rows, _g4) = match lse {
                    Some((l, rows)) => {
                        let (p, g) = l.device_ptr_mut(s);
                        (p, rows, Some(g))
                    }
                    None => (0, TokenRows::contiguous(heads, 1), None),
                };
                let (sink_p, _g5) = super::optional_ptr(sinks, s);
                let (slopes_p, _g6) = super::optional_ptr(alibi_slopes, s);
                if let Some((plan, dws)) = route.filter(|_| lead > 0) {
                    // Token i of sequence b < lead is token b * lead_len + i of the views.
                    let rows = |r: TokenRows| RowStrides {
                        seq: lead_len * r.token,
                        token: r.token,
                        head: r.head,
                    };
                    let args = RawDecodeArgs {
                        cache: cache.as_raw(),
                        num_blocks: cache.num_blocks(),
                        batch: lead,
                        q_len: lead_len,
                        q: q_p,
                        q_dtype: Q::DTYPE,
                        q_rows: rows(q_rows),
                        out: o_p,
                        out_dtype: O::DTYPE,
                        out_rows: rows(out_rows),
                        lse: lse_p,
                        lse_rows: rows(lse_rows),
                        block_tables,
                        max_blocks: tables.max_blocks(),
                        context_lens: ctx_lens,
                        workspace_o: dws[0],
                        workspace_lse: dws[1],
                        workspace_counters: dws[2],
                        counters: cache.counters_ptr() as CUdeviceptr,
                        sinks: sink_p,
                        alibi_slopes: slopes_p,
                    };
                    // SAFETY: rows 0..lead of the checked tables (each context holds its
                    // lead_len new tokens and fits both plans: with_decode_rows), q / out / lse
                    // rows of their tokens (checked above for every token), the decode plan's
                    // own workspace (checked), all on this stream.
                    unsafe { plan.decode_raw(&args, s.cu_stream()) }?;
                }
                if lead == batch || tiles == 0 {
                    return Ok(());
                }
                let (q_tok, q_head) = q_rows.raw()?;
                let (o_tok, o_head) = out_rows.raw()?;
                let (l_tok, l_head) = lse_rows.raw()?;
                // The prefill kernel serves sequences lead..batch: their rows of the tables and
                // of qo_indptr (whose offsets still count tokens from the batch's first).
                let i32_at = |p: CUdeviceptr, i: usize| (p + 4 * i as CUdeviceptr) as *const i32;
                let num_blocks = i64::try_from(cache.num_blocks())
                    .map_err(|_| Error::InvalidArgument("num_blocks exceeds int64".into()))?;
                let (tables_p, ctx_p) = (
                    i32_at(block_tables, lead * tables.max_blocks()),
                    i32_at(ctx_lens, lead),
                );
                // A two-pass step decodes the prefill sequences' contexts into the scratch
                // first, then attends over it with its renumbered tables.
                let (attend_cache, attend_blocks, attend_tables, attend_max_blocks) =
                    match &scratch_raw {
                        Some((at, l)) => {
                            let dst = sys::kvq_cache {
                                pool: at.pool as *mut u8,
                                k_scales: std::ptr::null(),
                                v_scales: std::ptr::null(),
                                layout: *l,
                            };
                            // SAFETY: the tables' rows lead..batch of the checked pool, their
                            // lengths (each within max_len, the prefill sequences' longest);
                            // the workspace's scratch of `at.blocks` blocks and a table of
                            // `max_batch` rows of `at.stride` (checked against the plan), on
                            // this stream; the step's blocks fit it (takes_two_pass).
                            unsafe {
                                launch::decode_context(
                                    &cache.as_raw(),
                                    num_blocks,
                                    tables_p,
                                    to_i32("max_blocks", tables.max_blocks())?,
                                    ctx_p,
                                    to_i32("batch", batch - lead)?,
                                    to_i32("max_context_len", max_len)?,
                                    &dst,
                                    at.blocks as i64,
                                    at.tables as *mut i32,
                                    to_i32("scratch table stride", at.stride)?,
                                    cache.counters_ptr(),
                                    s.cu_stream(),
                                )
                            }?;
                            (dst, at.blocks as i64, at.tables as *const i32, at.stride)
                        }
                        None => (cache.as_raw(), num_blocks, tables_p, tables.max_blocks()),
                    };
                let a = sys::kvq_prefill_args {
                    cache: attend_cache,
                    num_blocks: attend_blocks,
                    q: q_p as *const c_void,
                    out: o_p as *mut c_void,
                    lse: lse_p as *mut f32,
                    q_token_stride: q_tok,
                    q_head_stride: q_head,
                    out_token_stride: o_tok,
                    out_head_stride: o_head,
                    lse_token_stride: l_tok,
                    lse_head_stride: l_head,
                    qo_indptr: i32_at(qo_p, lead),
                    block_tables: attend_tables,
                    context_lens: ctx_p,
                    sinks: sink_p as *const f32,
                    ws_o: ws.ptrs[0] as *mut f32,
                    ws_lse: ws.ptrs[1] as *mut f32,
                    counters: cache.counters_ptr(),
                    q_dtype: Q::DTYPE.raw(),
                    out_dtype: O::DTYPE.raw(),
                    batch: to_i32("batch", batch - lead)?,
                    num_q_heads: to_i32("num_q_heads", heads)?,
                    max_blocks: to_i32("max_blocks", attend_max_blocks)?,
                    max_tokens: to_i32("max_tokens", launch_tokens)?,
                    num_splits: splits as i32,
                    split_tokens: to_i32("split_tokens", split_tokens)?,
                    window_left: match self.window_left {
                        Some(w) => to_i32("window_left", w)?,
                        None => -1,
                    },
                    softmax_scale: self.softmax_scale,
                    logits_soft_cap: self.soft_cap.unwrap_or(0.0),
                    alibi_slopes: slopes_p as *const f32,
                    e4m3_operands: i32::from(self.e4m3_operands && scratch_raw.is_none()),
                    wide_tile_rows: wide_tile_rows as i32,
                };
                // SAFETY: the cache comes from a live DeviceCache of this plan's layout (or is
                // the workspace's scratch, which the launch above filled and whose tables it
                // wrote for every block of these lengths); the tables were checked against its
                // pool, cover `batch` rows and their (uploaded) lengths
                // hold each sequence's new tokens; q / out / lse / sinks / slopes hold every row
                // (head) their strides address for `total` tokens (checked above), and the device
                // qo_indptr is the caller's copy of the checked host one (the kernel clamps it
                // otherwise); with splits, `total * splits` rows fit the workspace (splits_for);
                // all of it lives on this context, ordered with this stream.
                unsafe { launch::prefill_attention(&a, s.cu_stream()) }
            })
    }
}

/// Split-KV partial outputs and log-sum-exps of a [`PrefillPlan`], and its two-pass scratch
/// (one step at a time).
#[derive(Debug)]
pub struct PrefillWorkspace {
    gpu: Gpu,
    _buffers: (CudaSlice<f32>, CudaSlice<f32>),
    ptrs: [CUdeviceptr; 2],
    elems: (usize, usize),
    /// The workspace of the plan's routed decode rows (`with_decode_rows`).
    decode: Option<DecodeWorkspace>,
    /// The 16-bit cache a two-pass step decodes its context into (`with_two_pass`).
    scratch: Option<Scratch>,
    /// Whether the last step took two passes.
    two_pass_last: bool,
}

/// The format of the two-pass scratch for queries of `q`: the tensor cores' operand type.
fn scratch_format(q: Dtype) -> KvFormat {
    if q == Dtype::Bf16 {
        KvFormat::Bf16
    } else {
        KvFormat::F16
    }
}

/// The two-pass scratch: a pool of 16-bit blocks and its tables, `max_batch` rows of `stride`.
#[derive(Debug)]
struct Scratch {
    pool: CudaSlice<u8>,
    _tables: CudaSlice<i32>,
    at: ScratchAt,
}

/// Where the scratch lives and its sizes.
#[derive(Debug, Clone, Copy)]
struct ScratchAt {
    pool: CUdeviceptr,
    tables: CUdeviceptr,
    blocks: usize,
    stride: usize,
    rows: usize,
}

impl Scratch {
    fn new(gpu: &Gpu, plan: &PrefillPlan) -> Result<Option<Self>> {
        let Some((blocks, stride)) = plan.scratch_blocks() else {
            return Ok(None);
        };
        let bytes = plan.scratch_layout(Dtype::F16)?.try_pool_bytes(blocks)?;
        let rows = plan.cap.max_batch;
        let s = gpu.stream();
        // SAFETY: a two-pass step writes every block and table entry its attention reads
        // (kvq_decode_context) before that launch, on this stream.
        let pool = unsafe { s.alloc::<u8>(bytes.max(16)) }
            .map_err(driver_err("allocating the two-pass scratch"))?;
        // SAFETY: as above.
        let tables = unsafe { s.alloc::<i32>((rows * stride).max(1)) }
            .map_err(driver_err("allocating the two-pass scratch tables"))?;
        let at = ScratchAt {
            pool: owned_ptr(&pool),
            tables: owned_ptr(&tables),
            blocks,
            stride,
            rows,
        };
        Ok(Some(Scratch {
            pool,
            _tables: tables,
            at,
        }))
    }
}

impl PrefillWorkspace {
    /// Allocate the workspace of `plan` on its GPU and stream, the routed decode rows' of
    /// [`with_decode_rows`](PrefillPlan::with_decode_rows) included. One workspace serves every
    /// layer's launches of the plan in turn on that stream, not two launches at once.
    pub fn new(plan: &PrefillPlan) -> Result<Self> {
        let elems = plan.workspace_elems();
        let gpu = plan.gpu().clone();
        gpu.bind()?;
        let s = gpu.stream();
        // SAFETY: the kernel writes every partial the merge of the same launch reads.
        let o = unsafe { s.alloc::<f32>(elems.0.max(1)) }
            .map_err(driver_err("allocating the prefill workspace"))?;
        // SAFETY: as above.
        let lse = unsafe { s.alloc::<f32>(elems.1.max(1)) }
            .map_err(driver_err("allocating the prefill workspace"))?;
        let ptrs = [owned_ptr(&o), owned_ptr(&lse)];
        let decode = plan
            .decode_rows
            .as_ref()
            .map(DecodeWorkspace::new)
            .transpose()?;
        let scratch = Scratch::new(&gpu, plan)?;
        Ok(PrefillWorkspace {
            gpu,
            _buffers: (o, lse),
            ptrs,
            elems,
            decode,
            scratch,
            two_pass_last: false,
        })
    }

    /// Whether the last [`PrefillPlan::prefill`] with this workspace ran two passes
    /// ([`PrefillPlan::with_two_pass`]) for its prefill rows.
    pub fn two_pass_last_step(&self) -> bool {
        self.two_pass_last
    }

    /// Bytes of the two-pass scratch (0 without one).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.as_ref().map_or(0, |sc| sc.pool.len())
    }

    fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn check(&self, plan: &PrefillPlan) -> Result<()> {
        let want = plan.workspace_elems();
        let scratch_short = match (plan.scratch_blocks(), &self.scratch) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some((blocks, stride)), Some(sc)) => {
                sc.at.blocks < blocks || sc.at.stride != stride || sc.at.rows < plan.cap.max_batch
            }
        };
        if self.elems.0 < want.0
            || self.elems.1 < want.1
            || (plan.decode_rows.is_some() && self.decode.is_none())
            || scratch_short
        {
            return Err(Error::InvalidArgument(
                "the prefill workspace is smaller than the plan needs (make it from this plan)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Merge two partial attentions of the same `rows = a_lse.len()` rows over disjoint key sets
/// (`[rows, head_dim]` outputs normalized, natural-log `lse`, as kvq's kernels return them)
/// into `out` / `out_lse`: cascade attention over a shared prefix, or one long prefill cut in
/// two. Queued on `gpu`'s stream.
#[allow(clippy::too_many_arguments)]
pub fn merge_states<T: DeviceElement>(
    gpu: &Gpu,
    a: &CudaSlice<T>,
    a_lse: &CudaSlice<f32>,
    b: &CudaSlice<T>,
    b_lse: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    out_lse: &mut CudaSlice<f32>,
    head_dim: usize,
) -> Result<()> {
    let rows = a_lse.len();
    at_least_one(&[("head_dim", head_dim)])?;
    let elems = rows.checked_mul(head_dim).ok_or(Error::Overflow {
        what: "merge_states rows × head_dim",
        lhs: rows,
        rhs: head_dim,
    })?;
    need_len("merge_states b_lse", rows, b_lse.len())?;
    need_len("merge_states out_lse", rows, out_lse.len())?;
    need_len("merge_states a", elems, a.len())?;
    need_len("merge_states b", elems, b.len())?;
    need_len("merge_states out", elems, out.len())?;
    gpu.bind()?;
    let s = gpu.stream();
    let (ap, _g1) = a.device_ptr(s);
    let (al, _g2) = a_lse.device_ptr(s);
    let (bp, _g3) = b.device_ptr(s);
    let (bl, _g4) = b_lse.device_ptr(s);
    let (op, _g5) = out.device_ptr_mut(s);
    let (ol, _g6) = out_lse.device_ptr_mut(s);
    // SAFETY: every buffer holds `rows` rows (checked above) on this stream's context.
    unsafe {
        launch::merge_states(
            ap as *const c_void,
            al as *const f32,
            bp as *const c_void,
            bl as *const f32,
            op as *mut c_void,
            ol as *mut f32,
            i64::try_from(rows).map_err(|_| Error::InvalidArgument("rows exceed int64".into()))?,
            to_i32("head_dim", head_dim)?,
            T::DTYPE.raw(),
            s.cu_stream(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rows_as_decode_rows() {
        let (heads, d) = (32, 128);
        assert_eq!(
            TokenRows::contiguous(heads, d).with_q_len(2),
            RowStrides::token_major(heads, 2, d)
        );
        // A view into a fused QKV buffer: 48 heads' rows per token, q the first 32.
        let fused = TokenRows {
            token: 48 * d,
            head: d,
        };
        let rows = fused.with_q_len(3);
        assert_eq!((rows.seq, rows.token, rows.head), (3 * 48 * d, 48 * d, d));
    }

    #[test]
    fn qo_offsets() {
        assert!(check_qo_offsets(&[0], 1).is_ok());
        assert!(check_qo_offsets(&[0, 3, 3, 9], 4).is_ok());
        for (bad, room) in [
            (&[][..], 4),
            (&[0, 1, 2, 3, 4][..], 4),
            (&[1, 3][..], 4),
            (&[0, 3, 2][..], 4),
            (&[0, 1 << 31][..], 4),
        ] {
            assert!(
                matches!(check_qo_offsets(bad, room), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }
}
