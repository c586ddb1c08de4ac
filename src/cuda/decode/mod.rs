//! Fused paged decode attention on the GPU (`cuda/decode.cu`): one kernel reads each KV byte of a
//! sequence once per KV-head group, dequantizes FP8 / INT4 codes straight into tensor-core
//! fragments (no dequantized copy of the cache ever reaches global memory) and runs an online
//! softmax; long contexts are cut into splits that run side by side, and the last block of a
//! sequence to finish merges them, in the same launch (flash-decoding).
//!
//! Semantics are those of [`cpu::decode_attention`](crate::cpu::decode_attention): context
//! lengths include the `q_len` new tokens, query token `i` of a sequence of length `len` sits at
//! position `len - q_len + i` and sees positions `0..=that` (causal among the new tokens), query
//! head `h` reads KV head `h / (num_q_heads / num_kv_heads)` (grouped-query attention), logits
//! are `softmax_scale * q · k` and `lse` is the natural log of the softmax denominator.
//!
//! An engine's step loop:
//! 1. [`DecodePlan::new`] once, for a [`DecodeCapacity`]: the most sequences, query heads, new
//!    tokens per sequence and context length any step will have. It fixes everything that does
//!    not depend on the step's data (launch shapes per batch size, workspace size).
//! 2. [`DecodeWorkspace::new`] once per plan (split partials live there).
//! 3. [`DeviceBlockTables::with_capacity`] once; every step, change the rows that changed and
//!    [`upload`](DeviceBlockTables::upload) (one asynchronous copy from pinned memory).
//! 4. [`DecodePlan::decode`] (contiguous `[batch, heads, q_len, head_dim]`) or
//!    [`DecodePlan::decode_step`] (strided views, any output type) every step: host checks,
//!    then one launch; no allocation and no host synchronization, so it can be captured in a
//!    CUDA graph. The batch is the tables' current [`batch`](DeviceBlockTables::batch): a graph
//!    captured at the capacity serves any smaller batch when the extra rows are padding
//!    (length 0: zeros out, `lse = -inf`, nothing read).
//!
//! On Hopper the kernel is launched early (programmatic dependent launch): its blocks are
//! placed while the stream's previous kernel finishes and wait for it before their first read,
//! so the launches of an engine's layers overlap their ends (`KVQ_DECODE_PDL=0` turns it off).
//! A kernel of the engine's own that is launched early after it must wait likewise
//! (`cudaGridDependencySynchronize`) before reading its output; kernels launched the usual way
//! need nothing.
//!
//! Engines that own their device memory use [`DecodePlan::decode_raw`] with the same checks.

mod heuristic;
mod workspace;

pub use workspace::DecodeWorkspace;

use super::device::{DeviceCache, raw_layout};
use super::launch::DecodeOccupancy;
use super::ops::{DeviceElement, Dtype, need_len, to_i32};
#[doc(no_inline)]
pub use super::tables::{DeviceBlockTables, TablesCapacity};
use super::{Gpu, launch, sys};
use crate::error::{Error, Result, at_least_one};
use crate::format::KvFormat;
use crate::layout::BlockLayout;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use heuristic::{LaunchChoice, Machine, choose_launch, occupancy, split_len, split_range};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Tokens per copy chunk of the kernel (one page segment): `block_size` must be a multiple of it.
pub const STEP_TOKENS: usize = sys::KVQ_DECODE_CHUNK_TOKENS as usize;

/// Head dimensions the kernels are built for (INT4 keys and FP4 need a multiple of 32, INT4
/// values of 64: [`kernel_available_for`] says which pair has which).
pub const HEAD_DIMS: [usize; 7] = [64, 80, 96, 112, 128, 192, 256];

/// Most splits one launch may use (`KVQ_DECODE_MAX_SPLITS`).
pub const MAX_SPLITS: usize = sys::KVQ_DECODE_MAX_SPLITS as usize;

/// Query rows (query heads of one KV head x q_len) one thread block serves; a KV head with more
/// rows is served by several blocks, each reading its bytes.
pub const TILE_ROWS: usize = sys::KVQ_DECODE_TILE_ROWS as usize;

const WARPS_MULTIPLE: usize = sys::KVQ_DECODE_WARPS_MULTIPLE as usize;
const NUM_WARP_COUNTS: usize = sys::KVQ_DECODE_MAX_WARPS as usize / WARPS_MULTIPLE;

/// Warps per thread block the kernel may be launched with (`warps` of [`DecodePlan`]): the
/// multiples of `KVQ_DECODE_WARPS_MULTIPLE` up to `KVQ_DECODE_MAX_WARPS`. A plan uses those
/// whose registers and shared memory fit the device.
pub const WARPS: [usize; NUM_WARP_COUNTS] = {
    let mut w = [0; NUM_WARP_COUNTS];
    let mut i = 0;
    while i < NUM_WARP_COUNTS {
        w[i] = (i + 1) * WARPS_MULTIPLE;
        i += 1;
    }
    w
};

/// Copy stages per warp a plan may use.
pub const STAGES: std::ops::RangeInclusive<usize> =
    sys::KVQ_DECODE_MIN_STAGES as usize..=sys::KVQ_DECODE_MAX_STAGES as usize;

/// Query element types of the decode kernels: f16 and bf16 (outputs may also be f32).
pub trait DecodeElement: DeviceElement {}
impl DecodeElement for half::f16 {}
impl DecodeElement for half::bf16 {}

/// Whether this build has a decode kernel for keys in `k` and values in `v` at some head_dim:
/// f16, bf16, fp8-e4m3 and int4 (keys `int4-k32`, values `int4-v64`) mixed freely, or
/// fp8-e5m2 for both.
pub fn kernel_available(k: KvFormat, v: KvFormat) -> bool {
    HEAD_DIMS.iter().any(|&d| kernel_available_for(k, v, d))
}

/// Whether this build has a decode kernel for keys in `k` and values in `v` at `head_dim`
/// (the kernels' own dispatch answers: `kvq_decode_supported` in kvq.h).
pub fn kernel_available_for(k: KvFormat, v: KvFormat, head_dim: usize) -> bool {
    i32::try_from(head_dim).is_ok_and(|d| launch::decode_supported(k as i32, v as i32, d))
}

/// Where the rows of a query-shaped tensor (`q`, `out`, or `lse` with a width of 1) live, in
/// elements: element `d` of query token `i` of head `h` of sequence `b` is at
/// `b * seq + i * token + h * head + d`. The head dimension is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowStrides {
    /// Elements between sequences.
    pub seq: usize,
    /// Elements between consecutive new tokens of one sequence.
    pub token: usize,
    /// Elements between query heads.
    pub head: usize,
}

impl RowStrides {
    /// `[batch, heads, q_len, width]`, contiguous (`width` = head_dim, or 1 for `lse`).
    pub fn batch_head_token(heads: usize, q_len: usize, width: usize) -> Self {
        RowStrides {
            seq: heads * q_len * width,
            token: width,
            head: q_len * width,
        }
    }

    /// `[tokens, heads, width]` with `q_len` tokens per sequence, contiguous: the layout of
    /// engines that flatten the batch into tokens. A view with other strides (into a fused QKV
    /// projection, for instance) is [`TokenRows`](crate::cuda::TokenRows)`{ token, head
    /// }.with_q_len(q_len)`.
    pub fn token_major(heads: usize, q_len: usize, width: usize) -> Self {
        crate::cuda::TokenRows::contiguous(heads, width).with_q_len(q_len)
    }

    /// `[tokens, heads, width]` with `token_stride` elements between tokens and `head_stride`
    /// between heads.
    #[deprecated(
        since = "0.1.0",
        note = "use `TokenRows { token, head }.with_q_len(q_len)`, whose strides are named"
    )]
    pub fn token_major_strided(token_stride: usize, head_stride: usize, q_len: usize) -> Self {
        crate::cuda::TokenRows {
            token: token_stride,
            head: head_stride,
        }
        .with_q_len(q_len)
    }

    fn raw(&self) -> Result<sys::kvq_rows> {
        let i = |v: usize| {
            i64::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("row stride {v} exceeds int64")))
        };
        Ok(sys::kvq_rows {
            seq: i(self.seq)?,
            token: i(self.token)?,
            head: i(self.head)?,
        })
    }

    /// Elements a buffer must hold for `batch x heads x q_len` rows of `width` at these
    /// strides (one past the last element addressed); None on overflow.
    fn extent(&self, batch: usize, heads: usize, q_len: usize, width: usize) -> Option<usize> {
        let last = |n: usize, stride: usize| (n - 1).checked_mul(stride);
        last(batch, self.seq)?
            .checked_add(last(q_len, self.token)?)?
            .checked_add(last(heads, self.head)?)?
            .checked_add(width)
    }

    /// Whether distinct rows never share an element (needed for outputs): sorted by stride,
    /// each stride must step over everything the smaller ones span.
    fn rows_disjoint(&self, batch: usize, heads: usize, q_len: usize, width: usize) -> bool {
        let mut dims = [(self.seq, batch), (self.token, q_len), (self.head, heads)];
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
}

/// The tensors of one decode step for [`DecodePlan::decode_step`]. `Q`, `O` are any cudarc
/// device buffers (a `CudaSlice`, or a `CudaView` / `CudaViewMut` into a larger one).
pub struct DecodeStep<'a, Q, O> {
    /// New tokens per sequence, at most the plan's `max_q_len` ([`DecodePlan::capacity`]).
    pub q_len: usize,
    /// Queries (f16 or bf16), rows at `q_rows`.
    pub q: &'a Q,
    /// Where the query rows are.
    pub q_rows: RowStrides,
    /// Output (f16, bf16 or f32, independent of `q`'s type), rows at `out_rows`.
    pub out: &'a mut O,
    /// Where the output rows go (must not overlap).
    pub out_rows: RowStrides,
    /// Optional f32 log-sum-exps (natural log) and where they go (width 1): a `CudaSlice` or a
    /// `CudaViewMut` into a larger buffer. A trait object rather than a third type parameter,
    /// so that `lse: None` needs no type annotation.
    pub lse: Option<(&'a mut dyn DevicePtrMut<f32>, RowStrides)>,
    /// Optional per-head sinks (`[num_q_heads]` f32 logits that join every row's softmax
    /// denominator, unscaled and uncapped; gpt-oss).
    pub sinks: Option<&'a dyn DevicePtr<f32>>,
    /// Optional per-head ALiBi slopes (`[num_q_heads]` f32, finite: not checked on the host,
    /// which does not read device memory): the logit of a query at position `p` of head `h` for
    /// the key at position `j <= p` gains `slopes[h] * (j - p)`, after the soft cap; sinks are
    /// not biased. Every step then takes the kernel's masked path.
    pub alibi_slopes: Option<&'a dyn DevicePtr<f32>>,
}

/// The most a [`DecodePlan`] serves in one step: named, so that no two of these sizes can be
/// swapped unseen at the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCapacity {
    /// Most sequences per step.
    pub max_batch: usize,
    /// Query heads (a multiple of the cache's KV heads).
    pub num_q_heads: usize,
    /// Most new tokens per sequence (1 for plain decode; a few for speculative verification).
    pub max_q_len: usize,
    /// Longest context, new tokens included.
    pub max_context_len: usize,
}

/// A launch shape forced by [`DecodePlan::with_launch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForcedLaunch {
    warps: usize,
    stages: usize,
}

/// How decode launches for one cache layout and capacity are cut: made once, used for every
/// step whose batch, `q_len` and contexts fit the capacity. Cloning one is cheap (its launch
/// table is shared; it holds no device memory), so a plan can both serve decode steps and be
/// handed to [`PrefillPlan::with_decode_rows`](crate::cuda::PrefillPlan::with_decode_rows).
#[derive(Debug, Clone)]
pub struct DecodePlan {
    gpu: Gpu,
    layout: BlockLayout,
    cap: DecodeCapacity,
    softmax_scale: f32,
    /// Sliding window: a query at position `p` sees `p - w ..= p` (None: all).
    window_left: Option<usize>,
    /// Logits soft cap (positive, finite; None: none).
    soft_cap: Option<f32>,
    /// (warps, stages, occupancy) of every launch shape that fits.
    shapes: Arc<Vec<(usize, usize, DecodeOccupancy)>>,
    forced_splits: Option<usize>,
    forced_launch: Option<ForcedLaunch>,
    /// Split partial rows (sequence x split x query row) the workspace holds.
    ws_rows: usize,
    /// Launch choice per (batch - 1) * q_len capacity + (q_len - 1), made on first use.
    choices: Arc<Vec<OnceLock<LaunchChoice>>>,
}

impl DecodePlan {
    /// A plan for up to `cap.max_batch` sequences of `cap.num_q_heads` query heads and up to
    /// `cap.max_q_len` new tokens each, no longer than `cap.max_context_len` tokens (new tokens
    /// included), over caches of `layout`, with `softmax_scale = 1 / sqrt(head_dim)` (see
    /// [`with_softmax_scale`](Self::with_softmax_scale)).
    ///
    /// Errors: [`Error::Unsupported`] for a format pair without a kernel
    /// ([`kernel_available`]), a head_dim outside [`HEAD_DIMS`] or a block size that is not a
    /// multiple of [`STEP_TOKENS`]; [`Error::InvalidArgument`] / [`Error::Config`] for shapes
    /// that make no sense (zero sizes, heads not a multiple of the KV heads,
    /// `max_context_len < max_q_len`).
    pub fn new(gpu: &Gpu, layout: &BlockLayout, cap: DecodeCapacity) -> Result<Self> {
        let DecodeCapacity {
            max_batch,
            num_q_heads,
            max_q_len,
            max_context_len,
        } = cap;
        let c = &layout.config;
        c.validate()?;
        if !kernel_available(c.k_format, c.v_format) {
            return Err(Error::Unsupported(format!(
                "GPU decode of {} keys with {} values",
                c.k_format, c.v_format
            )));
        }
        if !kernel_available_for(c.k_format, c.v_format, c.head_dim) {
            return Err(Error::Unsupported(format!(
                "GPU decode of {} keys with {} values at head_dim {} (kernels exist for head \
                 dims {HEAD_DIMS:?} that are multiples of 32 with INT4 keys or FP4, of 64 with \
                 INT4 values)",
                c.k_format, c.v_format, c.head_dim
            )));
        }
        if c.block_size % STEP_TOKENS != 0 {
            return Err(Error::Unsupported(format!(
                "GPU decode with block_size {} (a multiple of {STEP_TOKENS} is needed)",
                c.block_size
            )));
        }
        at_least_one(&[
            ("max_batch", max_batch),
            ("num_q_heads", num_q_heads),
            ("max_q_len", max_q_len),
        ])?;
        if num_q_heads % c.num_kv_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "num_q_heads {num_q_heads} must be a multiple of num_kv_heads {}",
                c.num_kv_heads
            )));
        }
        if max_context_len < max_q_len {
            return Err(Error::InvalidArgument(format!(
                "max_context_len {max_context_len} is shorter than max_q_len {max_q_len} \
                 (context lengths include the new tokens)"
            )));
        }
        let m_tiles = (num_q_heads / c.num_kv_heads * max_q_len).div_ceil(TILE_ROWS);
        if c.num_kv_heads * m_tiles > 65535 || max_batch > 65535 {
            return Err(Error::Unsupported(format!(
                "GPU decode grid: batch {max_batch} and num_kv_heads x query tiles {} must each \
                 be at most 65535",
                c.num_kv_heads * m_tiles
            )));
        }
        // Sizes that reach the kernels as int32.
        to_i32("max_context_len", max_context_len)?;
        let rows = max_batch
            .checked_mul(num_q_heads)
            .and_then(|n| n.checked_mul(max_q_len))
            .ok_or_else(|| Error::InvalidArgument("batch x heads x q_len overflows".into()))?;
        to_i32("max_batch * num_q_heads * max_q_len", rows)?;

        gpu.bind()?;
        let mut shapes = Vec::new();
        for warps in WARPS {
            for stages in STAGES {
                let o = occupancy(layout, warps, stages)?;
                if o.ctas > 0 {
                    shapes.push((warps, stages, o));
                }
            }
        }
        if shapes.is_empty() {
            return Err(Error::Unsupported(
                "GPU decode: no launch shape fits this device's shared memory".into(),
            ));
        }
        let mut plan = DecodePlan {
            gpu: gpu.clone(),
            layout: *layout,
            cap,
            softmax_scale: 1.0 / (c.head_dim as f32).sqrt(),
            window_left: None,
            soft_cap: None,
            shapes: Arc::new(shapes),
            forced_splits: None,
            forced_launch: None,
            ws_rows: 0,
            choices: Arc::new(Vec::new()),
        };
        plan.size_workspace()?;
        Ok(plan)
    }

    /// Size the workspace for the largest split partials any batch up to the capacity chooses
    /// (checked at every power of two and the capacity itself, at the largest q_len; any other
    /// batch is then held to what that allows), and reset the choice memo.
    fn size_workspace(&mut self) -> Result<()> {
        let rows_per_seq = self.cap.num_q_heads * self.cap.max_q_len;
        let mut most = 0;
        let mut b = 1;
        loop {
            let c = self.choose(b, self.cap.max_q_len, MAX_SPLITS)?;
            most = most.max(b * c.splits * rows_per_seq);
            if b == self.cap.max_batch {
                break;
            }
            b = (b * 2).min(self.cap.max_batch);
        }
        self.ws_rows = most;
        let n = self.cap.max_batch * self.cap.max_q_len;
        let choices: Vec<OnceLock<LaunchChoice>> = (0..n).map(|_| OnceLock::new()).collect();
        // The capacity's own choice (the last one made above), so the accessors never fail.
        let at_cap = self.choose(self.cap.max_batch, self.cap.max_q_len, MAX_SPLITS)?;
        let _ = choices[n - 1].set(at_cap);
        self.choices = Arc::new(choices);
        Ok(())
    }

    /// The launch for `batch` sequences of `q_len` new tokens, with at most `split_cap`
    /// splits (before any forced count).
    fn choose(&self, batch: usize, q_len: usize, split_cap: usize) -> Result<LaunchChoice> {
        let c = &self.layout.config;
        let m_tiles = (self.cap.num_q_heads / c.num_kv_heads * q_len).div_ceil(TILE_ROWS);
        let base = batch * c.num_kv_heads * m_tiles;
        let max_len = self.cap.max_context_len;
        let splits = match self.forced_splits {
            Some(n) => n..=n,
            None => split_range(max_len, split_cap),
        };
        let forced = self.forced_launch;
        let shapes = &self.shapes;
        let mut choice = choose_launch(
            base,
            Machine::of(self.gpu.props()),
            max_len,
            splits,
            (c.k_format, c.v_format),
            |w, n| {
                let allowed = forced.is_none_or(|f| f.warps == w && f.stages == n);
                Ok(shapes
                    .iter()
                    .find(|s| allowed && s.0 == w && s.1 == n)
                    .map_or(DecodeOccupancy::NONE, |s| s.2))
            },
        )?;
        if let Some(n) = self.forced_splits {
            (choice.splits, choice.split_tokens) = split_len(max_len, n);
        }
        Ok(choice)
    }

    /// The launch of a step of `batch` sequences and `q_len` new tokens (both within the
    /// capacity), memoized.
    fn choice_for(&self, batch: usize, q_len: usize) -> Result<LaunchChoice> {
        let slot = &self.choices[(batch - 1) * self.cap.max_q_len + (q_len - 1)];
        if let Some(c) = slot.get() {
            return Ok(*c);
        }
        let cap = self.ws_rows / (batch * self.cap.num_q_heads * q_len);
        let c = self.choose(batch, q_len, cap)?;
        Ok(*slot.get_or_init(|| c))
    }

    /// The same plan with another multiplier of `q · k` (positive and finite).
    pub fn with_softmax_scale(mut self, softmax_scale: f32) -> Result<Self> {
        crate::cpu::check_softmax_scale(softmax_scale)?;
        self.softmax_scale = softmax_scale;
        Ok(self)
    }

    /// The same plan with a sliding window: the query at position `p` sees positions
    /// `max(0, p - w) ..= p` (`w = 0`: its own token only; None: all of `0..=p`). Tokens before
    /// every row's window are not read.
    pub fn with_window_left(mut self, window_left: Option<usize>) -> Result<Self> {
        if let Some(w) = window_left {
            to_i32("window_left", w)?;
        }
        self.window_left = window_left;
        Ok(self)
    }

    /// The same plan with a logits soft cap `c` (positive, finite): `logit = c * tanh(logit /
    /// c)` after the scale, as in Gemma 2 (None: no cap).
    pub fn with_logits_soft_cap(mut self, cap: Option<f32>) -> Result<Self> {
        crate::cpu::check_soft_cap(cap)?;
        self.soft_cap = cap;
        Ok(self)
    }

    /// The sliding window ([`with_window_left`](Self::with_window_left)).
    pub fn window_left(&self) -> Option<usize> {
        self.window_left
    }

    /// The logits soft cap ([`with_logits_soft_cap`](Self::with_logits_soft_cap)).
    pub fn logits_soft_cap(&self) -> Option<f32> {
        self.soft_cap
    }

    /// The same plan with a split count of your choice for every step (clamped to what
    /// `max_context_len` allows: splits of at least 32 tokens, at most [`MAX_SPLITS`]), for
    /// tests and tuning. Make the workspace after this.
    pub fn with_num_splits(mut self, num_splits: usize) -> Self {
        let most = self
            .cap
            .max_context_len
            .div_ceil(heuristic::SPLIT_MULTIPLE)
            .clamp(1, MAX_SPLITS);
        self.forced_splits = Some(split_len(self.cap.max_context_len, num_splits.clamp(1, most)).0);
        // Infallible here: the shapes were found when the plan was made.
        let _ = self.size_workspace();
        self
    }

    /// The same plan with `warps` warps per thread block (in [`WARPS`]) and `stages` copy stages
    /// per warp (in [`STAGES`]; more stages keep more bytes in flight but fit fewer blocks per
    /// SM) for every step, for tuning. [`Error::Unsupported`] if they do not fit. Make the
    /// workspace after this.
    pub fn with_launch(mut self, warps: usize, stages: usize) -> Result<Self> {
        if !WARPS.contains(&warps) {
            return Err(Error::Config {
                what: "warps",
                value: warps,
                expected: "4, 8, 12 or 16 warps per thread block",
            });
        }
        if !STAGES.contains(&stages) {
            return Err(Error::Config {
                what: "stages",
                value: stages,
                expected: "2..=8 copy stages per warp",
            });
        }
        if !self.shapes.iter().any(|s| s.0 == warps && s.1 == stages) {
            return Err(Error::Unsupported(format!(
                "GPU decode with {warps} warps of {stages} stages: does not fit in shared memory"
            )));
        }
        self.forced_launch = Some(ForcedLaunch { warps, stages });
        self.size_workspace()?;
        Ok(self)
    }

    /// The launch at the capacity (most sequences, most new tokens).
    fn at_capacity(&self) -> LaunchChoice {
        // Set by size_workspace whenever the plan changes.
        *self.choices[self.choices.len() - 1]
            .get()
            .expect("size_workspace sets the capacity's choice")
    }

    /// Warps per thread block at the capacity.
    pub fn warps(&self) -> usize {
        self.at_capacity().warps
    }
    /// Copy stages per warp at the capacity.
    pub fn stages(&self) -> usize {
        self.at_capacity().stages
    }
    /// Thread blocks of the capacity's kernel that fit on one SM.
    pub fn ctas_per_sm(&self) -> usize {
        self.at_capacity().ctas
    }
    /// Bytes of shared memory one copy stage of one warp takes at the capacity's launch (the
    /// launch model's bytes in flight are warps x (stages - 1) x this), for tuning.
    pub fn stage_bytes(&self) -> usize {
        let c = self.at_capacity();
        self.shapes
            .iter()
            .find(|s| s.0 == c.warps && s.1 == c.stages)
            .map_or(0, |s| s.2.stage_bytes)
    }
    /// Splits the longest context is cut into at the capacity (1: no merge pass).
    pub fn num_splits(&self) -> usize {
        self.at_capacity().splits
    }
    /// Tokens per split at the capacity (a multiple of 32).
    pub fn split_tokens(&self) -> usize {
        self.at_capacity().split_tokens
    }
    /// Splits a step of `batch` sequences and `q_len` new tokens is cut into (None outside the
    /// capacity).
    pub fn num_splits_for(&self, batch: usize, q_len: usize) -> Option<usize> {
        self.fits(batch, q_len)
            .then(|| self.choice_for(batch, q_len).ok().map(|c| c.splits))
            .flatten()
    }

    fn fits(&self, batch: usize, q_len: usize) -> bool {
        (1..=self.cap.max_batch).contains(&batch) && (1..=self.cap.max_q_len).contains(&q_len)
    }

    /// The handle whose stream the plan's launches go to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    /// Layout of the caches this plan serves.
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// The capacity the plan was made for.
    pub fn capacity(&self) -> DecodeCapacity {
        self.cap
    }
    /// Query heads.
    pub fn num_q_heads(&self) -> usize {
        self.cap.num_q_heads
    }
    /// Multiplier of `q · k`.
    pub fn softmax_scale(&self) -> f32 {
        self.softmax_scale
    }

    /// Elements of a contiguous `q` / `out` at the capacity:
    /// `batch * num_q_heads * q_len * head_dim`.
    pub fn q_elems(&self) -> usize {
        self.lse_elems() * self.layout.config.head_dim
    }
    /// Entries of a contiguous `lse` at the capacity: `batch * num_q_heads * q_len`.
    pub fn lse_elems(&self) -> usize {
        self.cap.max_batch * self.cap.num_q_heads * self.cap.max_q_len
    }
    /// Workspace sizes: f32 partial outputs, f32 partial log-sum-exps, u32 counters (the
    /// counters must be zero before the first launch; each launch leaves them zero).
    pub fn workspace_elems(&self) -> (usize, usize, usize) {
        let c = &self.layout.config;
        let tiles =
            (self.cap.num_q_heads / c.num_kv_heads * self.cap.max_q_len).div_ceil(TILE_ROWS);
        (
            self.ws_rows * c.head_dim,
            self.ws_rows,
            self.cap.max_batch * c.num_kv_heads * tiles,
        )
    }

    fn check_q_dtype(&self, q: Dtype) -> Result<()> {
        if q == Dtype::F32 {
            return Err(Error::Unsupported(
                "GPU decode with f32 queries (use f16 or bf16)".into(),
            ));
        }
        if self.layout.config.k_format == KvFormat::Bf16 && q != Dtype::Bf16 {
            return Err(Error::Unsupported(format!(
                "GPU decode of a bf16 key cache with {q:?} queries (use bf16 queries)"
            )));
        }
        Ok(())
    }

    /// One decode step of one new token per sequence, over contiguous `[batch, num_q_heads,
    /// head_dim]` queries and outputs of one type, `batch` the tables' current batch; `lse` (if
    /// given) `[batch, num_q_heads]`. See [`decode_step`](Self::decode_step).
    ///
    /// For plans of `max_q_len` 1 only ([`Error::InvalidArgument`] otherwise): with room for
    /// more tokens, which `q_len` a step has is the caller's to say, in
    /// [`DecodeStep::q_len`](DecodeStep) of [`decode_step`](Self::decode_step).
    pub fn decode<T: DecodeElement>(
        &self,
        ws: &mut DecodeWorkspace,
        cache: &DeviceCache,
        tables: &DeviceBlockTables,
        q: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        if self.cap.max_q_len != 1 {
            return Err(Error::InvalidArgument(format!(
                "DecodePlan::decode serves one token per sequence; this plan has max_q_len {} \
                 (use decode_step, whose DecodeStep names the step's q_len)",
                self.cap.max_q_len
            )));
        }
        let (h, n, d) = (self.cap.num_q_heads, 1, self.layout.config.head_dim);
        let rows = RowStrides::batch_head_token(h, n, d);
        self.decode_step(
            ws,
            cache,
            tables,
            DecodeStep {
                q_len: n,
                q,
                q_rows: rows,
                out,
                out_rows: rows,
                lse: lse.map(|l| {
                    let l: &mut dyn DevicePtrMut<f32> = l;
                    (l, RowStrides::batch_head_token(h, n, 1))
                }),
                sinks: None,
                alibi_slopes: None,
            },
        )
    }

    /// One decode step: attention of `step.q` over `cache` for the first
    /// [`batch`](DeviceBlockTables::batch) sequences of `tables`, written to `step.out` (and the
    /// log-sum-exps to `step.lse`). Enqueued on the plan's stream ([`gpu`](Self::gpu)); objects
    /// made on other streams are ordered with it by events (not capturable in a graph then: use
    /// one stream for that). Returns at once.
    ///
    /// Checked first: one device; the cache's layout is the plan's; the tables were checked
    /// against this cache's pool and uploaded; batch and `q_len` within the capacity; every
    /// context 0 (padding) or in `q_len..=max_context_len`; the workspace made for this plan;
    /// `q` (f16 / bf16; bf16 for a bf16 key cache), `out` (f16 / bf16 / f32) and `lse` hold
    /// every row their strides address, and output rows do not overlap.
    pub fn decode_step<Q, QB, O, OB>(
        &self,
        ws: &mut DecodeWorkspace,
        cache: &DeviceCache,
        tables: &DeviceBlockTables,
        step: DecodeStep<'_, QB, OB>,
    ) -> Result<()>
    where
        Q: DecodeElement,
        O: DeviceElement,
        QB: DevicePtr<Q>,
        OB: DevicePtrMut<O>,
    {
        let c = &self.layout.config;
        tables.check_for(&self.layout, cache)?;
        let batch = tables.batch();
        if batch == 0 {
            return Ok(());
        }
        let q_len = step.q_len;
        let (heads, d) = (self.cap.num_q_heads, c.head_dim);
        let need = |what: &'static str, rows: &RowStrides, width: usize, len: usize| {
            let extent = rows.extent(batch, heads, q_len, width).ok_or_else(|| {
                Error::InvalidArgument(format!("{what}: strides {rows:?} overflow"))
            })?;
            need_len(what, extent, len)
        };
        need("q (rows at q_rows)", &step.q_rows, d, step.q.len())?;
        need("out (rows at out_rows)", &step.out_rows, d, step.out.len())?;
        if !step.out_rows.rows_disjoint(batch, heads, q_len, d) {
            return Err(Error::InvalidArgument(format!(
                "out: rows at {:?} overlap",
                step.out_rows
            )));
        }
        if let Some((l, rows)) = &step.lse {
            need("lse (rows at lse_rows)", rows, 1, l.len())?;
            if !rows.rows_disjoint(batch, heads, q_len, 1) {
                return Err(Error::InvalidArgument(format!(
                    "lse: rows at {rows:?} overlap"
                )));
            }
        }
        ws.check(self)?;
        for g in [cache.gpu(), tables.gpu(), ws.gpu()] {
            if g.context() != self.gpu.context() {
                return Err(Error::InvalidArgument(format!(
                    "the plan is for GPU {}, an argument lives on GPU {}",
                    self.gpu.props().ordinal,
                    g.props().ordinal
                )));
            }
        }
        let launch_gpu = &self.gpu;
        launch_gpu.bind()?;
        launch_gpu.check_capture()?;
        let s = launch_gpu.stream();
        let (ctx_lens, block_tables) = tables.device_ptrs();
        if let Some(sk) = step.sinks {
            need_len("sinks ([num_q_heads])", heads, sk.len())?;
        }
        if let Some(m) = step.alibi_slopes {
            need_len("alibi_slopes ([num_q_heads])", heads, m.len())?;
        }
        let DecodeStep {
            q,
            out,
            lse,
            q_rows,
            out_rows,
            sinks,
            alibi_slopes,
            ..
        } = step;
        launch_gpu.ordered(&[cache.gpu(), tables.gpu(), ws.gpu()], || {
            let (q_p, _g1) = q.device_ptr(s);
            let (o_p, _g2) = out.device_ptr_mut(s);
            let (lse_p, lse_rows, _g3) = match lse {
                Some((l, rows)) => {
                    let (p, g) = l.device_ptr_mut(s);
                    (p, rows, Some(g))
                }
                None => (0, RowStrides::batch_head_token(heads, q_len, 1), None),
            };
            let (sinks_p, _g4) = super::optional_ptr(sinks, s);
            let (slopes_p, _g5) = super::optional_ptr(alibi_slopes, s);
            let args = RawDecodeArgs {
                cache: cache.as_raw(),
                num_blocks: cache.num_blocks(),
                batch,
                q_len,
                q: q_p,
                q_dtype: Q::DTYPE,
                q_rows,
                out: o_p,
                out_dtype: O::DTYPE,
                out_rows,
                lse: lse_p,
                lse_rows,
                block_tables,
                max_blocks: tables.max_blocks(),
                context_lens: ctx_lens,
                workspace_o: ws.ptrs[0],
                workspace_lse: ws.ptrs[1],
                workspace_counters: ws.ptrs[2],
                counters: cache.counters_ptr() as CUdeviceptr,
                sinks: sinks_p,
                alibi_slopes: slopes_p,
            };
            // SAFETY: the cache view comes from a live DeviceCache of this plan's layout; the
            // tables were checked against its pool and cover `batch` rows of `max_blocks`, their
            // lengths (as uploaded) within the plan and q_len; q / out / lse hold every row
            // their strides address (checked above); the workspace is this plan's; all of it
            // lives on this context, ordered with this stream.
            unsafe { self.launch(&args, s.cu_stream(), tables) }
        })
    }

    /// Checks every host-checkable argument of a launch, then launches (the one path to the
    /// kernel, for [`decode_step`](Self::decode_step) and [`decode_raw`](Self::decode_raw)).
    ///
    /// # Safety
    /// As [`decode_raw`](Self::decode_raw).
    unsafe fn launch(
        &self,
        args: &RawDecodeArgs,
        stream: CUstream,
        tables: &DeviceBlockTables,
    ) -> Result<()> {
        let q_len = args.q_len;
        if tables.max_context_len() > self.cap.max_context_len {
            return Err(Error::InvalidArgument(format!(
                "a context of {} tokens exceeds the plan's max_context_len {}",
                tables.max_context_len(),
                self.cap.max_context_len
            )));
        }
        let shortest = tables.min_context_len();
        if shortest != 0 && shortest < q_len {
            return Err(Error::InvalidArgument(format!(
                "a context of {shortest} tokens is shorter than q_len {q_len} (the new tokens \
                 must already be in the cache; padding rows have length 0)"
            )));
        }
        // SAFETY: forwarded.
        unsafe { self.launch_unchecked_tables(args, stream) }
    }

    /// [`launch`](Self::launch) without the tables' host-side facts (for raw device tables).
    ///
    /// # Safety
    /// As [`decode_raw`](Self::decode_raw).
    unsafe fn launch_unchecked_tables(&self, args: &RawDecodeArgs, stream: CUstream) -> Result<()> {
        if args.cache.layout != raw_layout(&self.layout)? {
            return Err(Error::InvalidArgument(
                "the cache's layout differs from the one the plan was made for".into(),
            ));
        }
        if !self.fits(args.batch, args.q_len) {
            return Err(Error::InvalidArgument(format!(
                "a step of batch {} and q_len {} exceeds the plan's capacity of {} x {}",
                args.batch, args.q_len, self.cap.max_batch, self.cap.max_q_len
            )));
        }
        self.check_q_dtype(args.q_dtype)?;
        if args.cache.pool.is_null()
            || args.q == 0
            || args.out == 0
            || args.block_tables == 0
            || args.context_lens == 0
            || args.workspace_o == 0
            || args.workspace_lse == 0
            || args.workspace_counters == 0
        {
            return Err(Error::InvalidArgument(
                "decode: a required device pointer is null".into(),
            ));
        }
        if args.max_blocks == 0 || args.num_blocks == 0 {
            return Err(Error::InvalidArgument(
                "decode: max_blocks and num_blocks must be at least 1".into(),
            ));
        }
        let choice = self.choice_for(args.batch, args.q_len)?;
        let a = sys::kvq_decode_args {
            cache: args.cache,
            num_blocks: i64::try_from(args.num_blocks)
                .map_err(|_| Error::InvalidArgument("num_blocks exceeds int64".into()))?,
            q: args.q as *const c_void,
            out: args.out as *mut c_void,
            lse: args.lse as *mut f32,
            q_rows: args.q_rows.raw()?,
            out_rows: args.out_rows.raw()?,
            lse_rows: args.lse_rows.raw()?,
            block_tables: args.block_tables as *const i32,
            context_lens: args.context_lens as *const i32,
            ws_o: args.workspace_o as *mut f32,
            ws_lse: args.workspace_lse as *mut f32,
            ws_counters: args.workspace_counters as *mut u32,
            counters: args.counters as *mut u64,
            q_dtype: args.q_dtype.raw(),
            out_dtype: args.out_dtype.raw(),
            batch: to_i32("batch", args.batch)?,
            num_q_heads: to_i32("num_q_heads", self.cap.num_q_heads)?,
            q_len: to_i32("q_len", args.q_len)?,
            max_blocks: to_i32("max_blocks", args.max_blocks)?,
            num_splits: choice.splits as i32,
            split_tokens: choice.split_tokens as i32,
            warps: choice.warps as i32,
            stages: choice.stages as i32,
            softmax_scale: self.softmax_scale,
            sinks: args.sinks as *const f32,
            window_left: match self.window_left {
                Some(w) => to_i32("window_left", w)?,
                None => -1,
            },
            logits_soft_cap: self.soft_cap.unwrap_or(0.0),
            alibi_slopes: args.alibi_slopes as *const f32,
        };
        // SAFETY: forwarded from the caller's contract; shapes come from the plan.
        unsafe { launch::decode_attention(&a, stream) }
    }

    /// [`decode_step`](Self::decode_step) for memory the caller owns (device pointers, its own
    /// block tables and lengths). Host-checkable arguments are checked (layout, capacity, q
    /// and out types, non-null pointers); the rest is the caller's promise.
    ///
    /// # Safety
    /// - `args.cache` describes a live device pool of `args.num_blocks` blocks with this plan's
    ///   layout (e.g. [`DeviceCache::as_raw`]);
    /// - `q`, `out` and `lse` (if not 0) hold every row their strides address for `batch`
    ///   sequences of `num_q_heads` heads and `q_len` tokens; output rows do not overlap;
    ///   the workspace pointers hold [`workspace_elems`](Self::workspace_elems) elements, the
    ///   counters zero before the first launch; `sinks` and `alibi_slopes` (if not 0) hold
    ///   `num_q_heads` f32, the slopes finite;
    /// - `block_tables` holds `batch * max_blocks` i32 and `context_lens` `batch` i32, with
    ///   every `context_lens[b]` 0 or in `q_len..=min(max_context_len, max_blocks *
    ///   block_size)` and the first `ceil(context_lens[b] / block_size)` entries of row `b`
    ///   block ids below `num_blocks` (breaking this cannot make the kernel read or write out
    ///   of the pool, but the output is then unspecified and the fault is counted in
    ///   `counters`);
    /// - nothing else writes `out`, `lse` or the workspace until the launch on `stream` ends.
    pub unsafe fn decode_raw(&self, args: &RawDecodeArgs, stream: CUstream) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.launch_unchecked_tables(args, stream) }
    }
}

/// Device pointers and shapes of one [`DecodePlan::decode_raw`] call (0 for an absent optional
/// pointer).
#[derive(Debug, Clone, Copy)]
pub struct RawDecodeArgs {
    /// The cache (pool, head scales, layout).
    pub cache: sys::kvq_cache,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Sequences of this step (at most the plan's capacity).
    pub batch: usize,
    /// New tokens per sequence (at most the plan's capacity).
    pub q_len: usize,
    /// Queries of `q_dtype` (f16 / bf16).
    pub q: CUdeviceptr,
    /// Element type of `q`.
    pub q_dtype: Dtype,
    /// Where the query rows are.
    pub q_rows: RowStrides,
    /// Output of `out_dtype` (f16 / bf16 / f32).
    pub out: CUdeviceptr,
    /// Element type of `out`.
    pub out_dtype: Dtype,
    /// Where the output rows go.
    pub out_rows: RowStrides,
    /// Optional f32 log-sum-exp output (0: none).
    pub lse: CUdeviceptr,
    /// Where the log-sum-exps go (width 1).
    pub lse_rows: RowStrides,
    /// `[batch, max_blocks]` i32 block tables.
    pub block_tables: CUdeviceptr,
    /// Row stride of `block_tables`.
    pub max_blocks: usize,
    /// `[batch]` i32 context lengths (new tokens included; 0: padding).
    pub context_lens: CUdeviceptr,
    /// Split partial outputs, [`DecodePlan::workspace_elems`]`.0` f32.
    pub workspace_o: CUdeviceptr,
    /// Split partial log-sum-exps, [`DecodePlan::workspace_elems`]`.1` f32.
    pub workspace_lse: CUdeviceptr,
    /// Split counters, [`DecodePlan::workspace_elems`]`.2` u32, zero before the first launch.
    pub workspace_counters: CUdeviceptr,
    /// Optional `[KVQ_NUM_COUNTERS]` u64 fault counters (0: none; see kvq.h).
    pub counters: CUdeviceptr,
    /// Optional `[num_q_heads]` f32 sinks (0: none).
    pub sinks: CUdeviceptr,
    /// Optional `[num_q_heads]` f32 ALiBi slopes, finite (0: none; see
    /// [`DecodeStep::alibi_slopes`]).
    pub alibi_slopes: CUdeviceptr,
}

// SAFETY: plain data: the pointers inside `cache` are device addresses the host never
// dereferences, as every other field's CUdeviceptr; launching with them takes
// `decode_raw`'s unsafe contract, whichever thread made them.
unsafe impl Send for RawDecodeArgs {}
// SAFETY: as for Send; nothing in it is mutated through a shared reference.
unsafe impl Sync for RawDecodeArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_with_kernels() {
        assert!(kernel_available(KvFormat::Int4Sym32, KvFormat::Fp8E4m3));
        assert!(kernel_available(KvFormat::Bf16, KvFormat::Int4Affine64));
        assert!(kernel_available(KvFormat::Fp8E5m2, KvFormat::Fp8E5m2));
        assert!(!kernel_available(KvFormat::Int4Affine64, KvFormat::F16));
        assert!(!kernel_available(KvFormat::Fp8E5m2, KvFormat::F16));
        // int4-kc: keys only, mixed with every value format but e5m2, head dims of whole
        // 32-element groups; prefill takes the value formats f16 keys take
        for v in KvFormat::ALL {
            assert_eq!(
                kernel_available(KvFormat::Int4Kc, v),
                !matches!(
                    v,
                    KvFormat::Fp8E5m2 | KvFormat::Int4Sym32 | KvFormat::Int4Kc
                ),
                "{v}"
            );
            assert!(!kernel_available(v, KvFormat::Int4Kc), "{v}");
            for d in HEAD_DIMS {
                assert_eq!(
                    kernel_available_for(KvFormat::Int4Kc, KvFormat::Bf16, d),
                    d % 32 == 0,
                    "{d}"
                );
            }
            assert_eq!(
                crate::cuda::prefill::kernel_available_for(KvFormat::Int4Kc, v, 128, true),
                crate::cuda::prefill::kernel_available_for(KvFormat::F16, v, 128, true),
                "{v}"
            );
        }
        use KvFormat::*;
        for d in HEAD_DIMS {
            assert!(kernel_available_for(F16, Fp8E4m3, d), "{d}");
            assert!(kernel_available_for(Fp8E5m2, Fp8E5m2, d), "{d}");
            assert_eq!(kernel_available_for(Int4Sym32, Bf16, d), d % 32 == 0, "{d}");
            assert_eq!(
                kernel_available_for(F16, Int4Affine64, d),
                d % 64 == 0,
                "{d}"
            );
        }
        for d in [0, 16, 32, 72, 144, 160, 512] {
            assert!(!kernel_available_for(F16, F16, d), "{d}");
        }
        // INT8 at every head dim, mixed; FP4 at multiples of 32, mixed.
        for d in HEAD_DIMS {
            assert!(kernel_available_for(Int8Pth, Int8Pth, d), "{d}");
            assert!(kernel_available_for(Bf16, Int8Pth, d), "{d}");
            assert_eq!(
                kernel_available_for(Fp4E2m1, Fp4E2m1, d),
                d % 32 == 0,
                "{d}"
            );
            assert_eq!(
                kernel_available_for(Int8Pth, Fp4E2m1, d),
                d % 32 == 0,
                "{d}"
            );
            assert_eq!(
                kernel_available_for(Fp4E2m1, Fp8E4m3, d),
                d % 32 == 0,
                "{d}"
            );
        }
        let pairs = KvFormat::ALL
            .iter()
            .flat_map(|&k| KvFormat::ALL.iter().map(move |&v| (k, v)))
            .filter(|&(k, v)| kernel_available(k, v))
            .count();
        assert_eq!(
            pairs, 43,
            "6 x 6 freely mixed formats + e5m2 + int4-kc keys with the 6 mixed value formats"
        );
    }

    #[test]
    fn row_strides() {
        let c = RowStrides::batch_head_token(4, 3, 64);
        assert_eq!(c.extent(2, 4, 3, 64), Some(2 * 4 * 3 * 64));
        assert!(c.rows_disjoint(2, 4, 3, 64));
        let t = RowStrides::token_major(4, 3, 64);
        assert_eq!(t.extent(2, 4, 3, 64), Some(6 * 4 * 64));
        assert!(t.rows_disjoint(2, 4, 3, 64));
        // A view into a fused QKV buffer (q heads first, then k and v): rows 3x wider.
        let f = crate::cuda::TokenRows {
            token: 3 * 4 * 64,
            head: 64,
        }
        .with_q_len(1);
        assert_eq!(f.extent(5, 4, 1, 64), Some(4 * 3 * 4 * 64 + 4 * 64));
        assert!(f.rows_disjoint(5, 4, 1, 64));
        // Heads that overlap, tokens that overlap.
        assert!(
            !RowStrides {
                seq: 4096,
                token: 64,
                head: 32
            }
            .rows_disjoint(1, 4, 1, 64)
        );
        assert!(!RowStrides::token_major(4, 2, 64).rows_disjoint(1, 5, 2, 64));
        // Single rows are always fine; overflow is None.
        assert!(
            RowStrides {
                seq: 0,
                token: 0,
                head: 0
            }
            .rows_disjoint(1, 1, 1, 64)
        );
        assert_eq!(
            RowStrides {
                seq: usize::MAX,
                token: 1,
                head: 1
            }
            .extent(3, 1, 1, 1),
            None
        );
    }
}
