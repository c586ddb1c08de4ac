//! candle integration (feature `candle`): kvq's quantize-on-append, fused decode and prefill as
//! operations on candle [`Tensor`]s of a CUDA [`Device`]. candle-core 0.11 is built on the cudarc kvq uses,
//! so both share the device's context and stream: kvq's launches are queued on the stream
//! candle's own kernels use, in order with them, with no synchronization.
//!
//! ```ignore
//! let gpu = kvq::candle::gpu(&device)?;                  // candle's stream
//! let mut cache = DeviceCache::new(&gpu, config, num_blocks)?;
//! let cap = DecodeCapacity { max_batch, num_q_heads: heads, max_q_len: 1, max_context_len };
//! let plan = DecodePlan::new(&gpu, cache.layout(), cap)?;
//! // per step and layer, k / v / q from candle's projections ([tokens, heads, head_dim]):
//! kvq::candle::append(&mut cache, &slots, &k, &v)?;
//! let out = kvq::candle::decode(&plan, &mut ws, &cache, &tables, &q, 1, DType::F32)?;
//! // a prefill step: qo (a QoIndptr) set from each sequence's new tokens, once per step
//! let out = kvq::candle::prefill(&prefill_plan, &mut pws, &cache, &tables, &qo, &q, DType::F32)?;
//! ```
//!
//! What each call costs: [`append`] launches one kernel and allocates nothing; [`decode`] and
//! [`prefill`] launch theirs and allocate their output through candle (uninitialized, no
//! memset), like any candle op; none of them waits for the GPU. The tables, the step's
//! `QoIndptr` and the slot tensor are the engine's, filled once per step for every layer
//! (README, "Using the GPU path"). Not here: CUDA-graph capture (each call allocates its
//! output), `lse`, sinks and ALiBi slopes, and writing into an existing output. For those, call
//! [`DecodePlan::decode_step`] / [`PrefillPlan::prefill`] with buffers of your own (a
//! `CudaView` into a candle tensor's storage serves as `q`): the ops here are thin wrappers of
//! them, with the same checks and errors, which survive the trip through candle
//! ([`Error`] is recovered from candle's error when a kvq check fails).

use crate::cuda::decode::{DecodeElement, DecodeStep, RowStrides};
use crate::cuda::ops::{self, DeviceElement};
use crate::cuda::prefill::{PrefillPlan, PrefillStep, PrefillWorkspace, QoIndptr, TokenRows};
use crate::cuda::{DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, Gpu};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaError};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Storage, Tensor,
};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use std::cell::RefCell;

/// The kvq handle of a candle CUDA device: its context and the stream candle queues on.
pub fn gpu(device: &Device) -> Result<Gpu> {
    match device {
        Device::Cuda(d) => Gpu::from_stream(d.cuda_stream()),
        other => Err(Error::InvalidArgument(format!(
            "kvq runs on CUDA devices, not {other:?}"
        ))),
    }
}

/// Rows of a `[tokens, heads, width]` tensor view: the token and head strides (elements) and the
/// offset of its first element; the last axis must be contiguous.
fn rows_of(
    what: &str,
    layout: &Layout,
    heads: usize,
    width: usize,
) -> Result<(usize, usize, usize)> {
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 3 || dims[1] != heads || dims[2] != width {
        return Err(Error::InvalidArgument(format!(
            "{what}: shape {dims:?}, expected [tokens, {heads}, {width}]"
        )));
    }
    if stride[2] != 1 && width > 1 {
        return Err(Error::InvalidArgument(format!(
            "{what}: the last axis must be contiguous (strides {stride:?})"
        )));
    }
    Ok((stride[0], stride[1], layout.start_offset()))
}

fn cuda_storage<'a>(what: &str, storage: &'a Storage) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => Err(Error::InvalidArgument(format!(
            "{what} is not on a CUDA device"
        ))),
    }
}

/// A candle error as kvq's: a CUDA driver failure (an allocation out of memory, a launch) stays
/// [`Error::Driver`], so that [`Error::is_out_of_memory`] holds; anything else is an
/// [`Error::InvalidArgument`] with candle's message.
fn candle_err(e: candle_core::Error) -> Error {
    fn driver(e: &candle_core::Error) -> Option<cudarc::driver::DriverError> {
        match e {
            candle_core::Error::Cuda(b) => match b.downcast_ref::<CudaError>()? {
                CudaError::Cuda(d) => Some(*d),
                _ => None,
            },
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. } => driver(inner),
            _ => None,
        }
    }
    match driver(&e) {
        Some(d) => Error::from(d),
        None => Error::InvalidArgument(format!("candle: {e}")),
    }
}

/// The kvq error a custom op failed with: candle keeps only an error's text, so the op keeps
/// the error itself, and the caller gets it back whole (a driver failure stays one).
#[derive(Default)]
struct Failure(RefCell<Option<Error>>);

impl Failure {
    /// Keep `e`; its text for candle.
    fn keep(&self, e: Error) -> candle_core::Error {
        let text = candle_core::Error::Msg(e.to_string());
        *self.0.borrow_mut() = Some(e);
        text
    }

    /// The error an op's call returned, as kvq's: the one the op kept, else candle's own.
    fn of(&self, e: candle_core::Error) -> Error {
        self.0.take().unwrap_or_else(|| candle_err(e))
    }
}

/// A view of `storage` from element `offset` on, as `T` (its dtype must be `T`'s).
fn view<'a, T: CudaDType>(s: &'a CudaStorage, offset: usize) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>().map_err(candle_err)?;
    if offset > slice.len() {
        return Err(Error::InvalidArgument(format!(
            "a tensor view starts at {offset}, past its storage of {}",
            slice.len()
        )));
    }
    Ok(slice.slice(offset..))
}

/// Quantize the tokens of `k` and `v` (`[tokens, kv_heads, head_dim]`, f32 / f16 / bf16, both
/// of one type; token rows may be strided, e.g. views of a fused QKV projection) into the pool
/// slots `slots` (`[tokens]`, i64 or i32; negative skips the token) of `cache`, on the cache's
/// stream (make the cache with [`gpu`] of the tensors' device to queue it in order with
/// candle's work).
pub fn append(cache: &mut DeviceCache, slots: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let c = *cache.config();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (ss, sl) = slots.storage_and_layout();
    let (kt, kh, k0) = rows_of("k", kl, c.num_kv_heads, c.head_dim)?;
    let (vt, vh, v0) = rows_of("v", vl, c.num_kv_heads, c.head_dim)?;
    if kh != c.head_dim || vh != c.head_dim {
        return Err(Error::InvalidArgument(
            "k and v: heads of one token must be adjacent ([tokens, kv_heads, head_dim] rows)"
                .into(),
        ));
    }
    let n = kl.dims()[0];
    if vl.dims()[0] != n || sl.dims() != [n] || (sl.stride() != [1] && n > 1) {
        return Err(Error::InvalidArgument(format!(
            "append: {n} tokens of k, {} of v, slots of shape {:?} (one contiguous slot per \
             token expected)",
            vl.dims()[0],
            sl.dims()
        )));
    }
    if k.dtype() != v.dtype() {
        return Err(Error::InvalidArgument(format!(
            "append: k is {:?}, v is {:?}",
            k.dtype(),
            v.dtype()
        )));
    }
    let (ks, vs, ss) = (
        cuda_storage("k", &ks)?,
        cuda_storage("v", &vs)?,
        cuda_storage("slots", &ss)?,
    );
    match k.dtype() {
        DType::F32 => append_as::<f32>(cache, [ks, vs, ss], [k0, v0], slots, n, [kt, vt]),
        DType::F16 => append_as::<half::f16>(cache, [ks, vs, ss], [k0, v0], slots, n, [kt, vt]),
        DType::BF16 => append_as::<half::bf16>(cache, [ks, vs, ss], [k0, v0], slots, n, [kt, vt]),
        other => Err(Error::Unsupported(format!(
            "append of {other:?} K/V (f32, f16 or bf16)"
        ))),
    }
}

/// [`append`] once k and v are known to be `T`: takes the device pointers of k, v and the
/// slots and launches while their cudarc guards are alive, so that the reads are recorded
/// after the kernel is queued (a later writer on another stream waits for them).
fn append_as<T: CudaDType + DeviceElement>(
    cache: &mut DeviceCache,
    [ks, vs, ss]: [&CudaStorage; 3],
    [k0, v0]: [usize; 2],
    slots: &Tensor,
    n: usize,
    [kt, vt]: [usize; 2],
) -> Result<()> {
    let gpu = cache.gpu().clone();
    let s = gpu.stream();
    let (kv, vv) = (view::<T>(ks, k0)?, view::<T>(vs, v0)?);
    let (kp, _k_guard) = kv.device_ptr(s);
    let (vp, _v_guard) = vv.device_ptr(s);
    let slot0 = slots.layout().start_offset();
    let launch = |sp, i64_slots| {
        // The tensors' last element each (offset included) lies inside their storage, which
        // candle guarantees for a valid layout; the kernel reads rows [0, n) at these strides.
        gpu.bind()?;
        // SAFETY: k, v and slots are live candle storages on this context, ordered with the
        // cache's stream by their guards (alive until this returns; candle's own stream when
        // the cache was made from its device); rows at token strides kt / vt hold kv_heads *
        // head_dim elements each (checked shape, contiguous heads); the cache view is a live
        // DeviceCache.
        unsafe {
            ops::append_raw(
                &ops::RawAppendArgs {
                    cache: cache.as_raw(),
                    num_blocks: cache.num_blocks(),
                    slots: sp,
                    slots_i64: i64_slots,
                    num_tokens: n,
                    k: kp,
                    v: vp,
                    dtype: T::DTYPE,
                    k_token_stride: kt,
                    v_token_stride: vt,
                    counters: cache.counters_raw(),
                },
                s.cu_stream(),
            )
        }
    };
    match slots.dtype() {
        DType::I64 => {
            let sv = view::<i64>(ss, slot0)?;
            let (sp, _s_guard) = sv.device_ptr(s);
            launch(sp, true)
        }
        DType::I32 => {
            let sv = view::<i32>(ss, slot0)?;
            let (sp, _s_guard) = sv.device_ptr(s);
            launch(sp, false)
        }
        other => Err(Error::Unsupported(format!("{other:?} slots (i64 or i32)"))),
    }
}

/// One decode step as a candle op: attention of `q` (`[tokens, heads, head_dim]`, f16 or bf16,
/// `tokens = batch * q_len` in sequence order, token and head strides free) over `cache` for the
/// first [`batch`](DeviceBlockTables::batch) rows of `tables`, returned as a new
/// `[tokens, heads, head_dim]` tensor of `out_dtype` (f16, bf16 or f32). See
/// [`DecodePlan::decode_step`] for the checks and semantics.
pub fn decode(
    plan: &DecodePlan,
    ws: &mut DecodeWorkspace,
    cache: &DeviceCache,
    tables: &DeviceBlockTables,
    q: &Tensor,
    q_len: usize,
    out_dtype: DType,
) -> Result<Tensor> {
    let op = DecodeOp {
        plan,
        ws: RefCell::new(ws),
        cache,
        tables,
        q_len,
        out_dtype,
        failure: Failure::default(),
    };
    q.apply_op1_no_bwd(&op).map_err(|e| op.failure.of(e))
}

/// [`decode`] as a [`CustomOp1`] (the query is its input).
struct DecodeOp<'a> {
    plan: &'a DecodePlan,
    ws: RefCell<&'a mut DecodeWorkspace>,
    cache: &'a DeviceCache,
    tables: &'a DeviceBlockTables,
    q_len: usize,
    out_dtype: DType,
    failure: Failure,
}

impl DecodeOp<'_> {
    fn run<Q: DecodeElement + CudaDType, O: DeviceElement + CudaDType>(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let heads = self.plan.num_q_heads();
        let d = self.plan.layout().config.head_dim;
        let (qt, qh, q0) = rows_of("q", layout, heads, d)?;
        let tokens = layout.dims()[0];
        if self.q_len == 0 || tokens != self.tables.batch() * self.q_len {
            return Err(Error::InvalidArgument(format!(
                "q has {tokens} tokens, the step has {} sequences of q_len {}",
                self.tables.batch(),
                self.q_len
            )));
        }
        let q = view::<Q>(storage, q0)?;
        let device: &CudaDevice = storage.device();
        // SAFETY: uninitialized device memory of O (plain numbers): the decode kernel writes
        // every element of the step's rows (rows of empty sequences as zeros) before any read,
        // and an error below drops it unread. No memset per step.
        let mut out: CudaSlice<O> =
            unsafe { device.alloc::<O>(tokens * heads * d) }.map_err(candle_err)?;
        let q_rows = RowStrides {
            seq: self.q_len * qt,
            token: qt,
            head: qh,
        };
        let out_rows = RowStrides::token_major(heads, self.q_len, d);
        let mut ws = self.ws.borrow_mut();
        self.plan.decode_step(
            &mut ws,
            self.cache,
            self.tables,
            DecodeStep {
                q_len: self.q_len,
                q: &q,
                q_rows,
                out: &mut out,
                out_rows,
                lse: None,
                sinks: None,
                alibi_slopes: None,
            },
        )?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, device.clone()),
            Shape::from((tokens, heads, d)),
        ))
    }
}

impl CustomOp1 for DecodeOp<'_> {
    fn name(&self) -> &'static str {
        "kvq-decode"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "kvq-decode runs on CUDA devices (the CPU reference is kvq::cpu::decode_attention)"
        )
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        use half::{bf16, f16};
        let r = match (storage.dtype(), self.out_dtype) {
            (DType::F16, DType::F16) => self.run::<f16, f16>(storage, layout),
            (DType::F16, DType::BF16) => self.run::<f16, bf16>(storage, layout),
            (DType::F16, DType::F32) => self.run::<f16, f32>(storage, layout),
            (DType::BF16, DType::F16) => self.run::<bf16, f16>(storage, layout),
            (DType::BF16, DType::BF16) => self.run::<bf16, bf16>(storage, layout),
            (DType::BF16, DType::F32) => self.run::<bf16, f32>(storage, layout),
            (q, o) => Err(Error::Unsupported(format!(
                "kvq decode of {q:?} queries into {o:?} (q: f16 / bf16, out: f16 / bf16 / f32)"
            ))),
        };
        r.map_err(|e| self.failure.keep(e))
    }
}

/// Attention of a ragged batch of new tokens over the cache (chunked prefill, prefix hits; see
/// [`crate::cuda::prefill`]): `q` is `[total_tokens, num_q_heads, head_dim]` (f16 / bf16, token
/// rows may be strided), sequence `b`'s tokens are rows `qo[b]..qo[b + 1]` of the offsets
/// `qo` holds ([`QoIndptr::set`] or [`set_counts`](QoIndptr::set_counts) each step), already
/// appended to `cache`, whose `tables` lengths include them. Returns a new `[total_tokens,
/// num_q_heads, head_dim]` tensor of `out_dtype` (f16, bf16 or f32), computed on the plan's
/// stream.
pub fn prefill(
    plan: &PrefillPlan,
    ws: &mut PrefillWorkspace,
    cache: &DeviceCache,
    tables: &DeviceBlockTables,
    qo: &QoIndptr,
    q: &Tensor,
    out_dtype: DType,
) -> Result<Tensor> {
    let op = PrefillOp {
        plan,
        ws: RefCell::new(ws),
        cache,
        tables,
        qo_indptr: qo.host(),
        qo_indptr_dev: qo.device(),
        out_dtype,
        failure: Failure::default(),
    };
    q.apply_op1_no_bwd(&op).map_err(|e| op.failure.of(e))
}

/// [`prefill`] as a [`CustomOp1`] (the query is its input).
struct PrefillOp<'a> {
    plan: &'a PrefillPlan,
    ws: RefCell<&'a mut PrefillWorkspace>,
    cache: &'a DeviceCache,
    tables: &'a DeviceBlockTables,
    qo_indptr: &'a [u32],
    qo_indptr_dev: &'a CudaSlice<i32>,
    out_dtype: DType,
    failure: Failure,
}

impl PrefillOp<'_> {
    fn run<Q: DeviceElement + CudaDType, O: DeviceElement + CudaDType>(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let heads = self.plan.num_q_heads();
        let d = self.plan.layout().config.head_dim;
        let (qt, qh, q0) = rows_of("q", layout, heads, d)?;
        let tokens = layout.dims()[0];
        let total = self.qo_indptr.last().copied().unwrap_or(0) as usize;
        if tokens != total {
            return Err(Error::InvalidArgument(format!(
                "q has {tokens} tokens, qo_indptr counts {total}"
            )));
        }
        let q = view::<Q>(storage, q0)?;
        let device: &CudaDevice = storage.device();
        // SAFETY: uninitialized device memory of O (plain numbers): the prefill writes every
        // element of the step's rows before any read, and an error below drops it unread.
        let mut out: CudaSlice<O> =
            unsafe { device.alloc::<O>((tokens * heads * d).max(1)) }.map_err(candle_err)?;
        let mut ws = self.ws.borrow_mut();
        self.plan.prefill(
            &mut ws,
            self.cache,
            self.tables,
            PrefillStep {
                qo_indptr: self.qo_indptr,
                qo_indptr_dev: self.qo_indptr_dev,
                q: &q,
                q_rows: TokenRows {
                    token: qt,
                    head: qh,
                },
                out: &mut out,
                out_rows: TokenRows::contiguous(heads, d),
                lse: None,
                sinks: None,
                alibi_slopes: None,
            },
        )?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, device.clone()),
            Shape::from((tokens, heads, d)),
        ))
    }
}

impl CustomOp1 for PrefillOp<'_> {
    fn name(&self) -> &'static str {
        "kvq-prefill"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "kvq-prefill runs on CUDA devices (the CPU reference is kvq::cpu::prefill_attention)"
        )
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        use half::{bf16, f16};
        let r = match (storage.dtype(), self.out_dtype) {
            (DType::F16, DType::F16) => self.run::<f16, f16>(storage, layout),
            (DType::F16, DType::BF16) => self.run::<f16, bf16>(storage, layout),
            (DType::F16, DType::F32) => self.run::<f16, f32>(storage, layout),
            (DType::BF16, DType::F16) => self.run::<bf16, f16>(storage, layout),
            (DType::BF16, DType::BF16) => self.run::<bf16, bf16>(storage, layout),
            (DType::BF16, DType::F32) => self.run::<bf16, f32>(storage, layout),
            (q, o) => Err(Error::Unsupported(format!(
                "kvq prefill of {q:?} queries into {o:?} (q: f16 / bf16, out: f16 / bf16 / f32)"
            ))),
        };
        r.map_err(|e| self.failure.keep(e))
    }
}
