//! Safe launches of the append / gather / dense quantize kernels: every argument is validated
//! here, before any `unsafe`, and each function returns once the work is queued on the
//! [`Gpu`]'s stream (results are ordered by that stream; copies back to the host wait for it).
//!
//! The `*_raw` functions are the same launches for engines that own their device memory: they
//! take device pointers and a `CUstream`, check what can be checked on the host, and document
//! what the caller must guarantee.

use super::device::MAX_GPU_HEAD_DIM;
use super::{DeviceCache, Gpu, driver_err, launch, sys};
use crate::dense::{
    self, DenseFormat, Fp8ScaleChoice, QuantizedChannels, QuantizedTensor, StoredDtype,
    StoredTensor,
};
use crate::error::{Error, Result};
use crate::format::int4_kc::{KcShape, Mode};
use crate::format::{Element, HeadScale, KvFormat, int4};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use std::ffi::c_void;

/// Element type of a dense device tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// f32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl Dtype {
    /// The `KVQ_DTYPE_*` code of kvq.h, as the launchers' `int32_t dtype` parameters (and the
    /// argument structs of [`sys`]) take it.
    pub fn raw(self) -> i32 {
        (match self {
            Dtype::F32 => sys::KVQ_DTYPE_F32,
            Dtype::F16 => sys::KVQ_DTYPE_F16,
            Dtype::Bf16 => sys::KVQ_DTYPE_BF16,
        }) as i32
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

/// Element types the kernels read and write: f32, f16, bf16.
pub trait DeviceElement: DeviceRepr + Element + Default {
    /// The matching [`Dtype`].
    const DTYPE: Dtype;
}
impl DeviceElement for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl DeviceElement for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}
impl DeviceElement for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}

/// Integer types of a slot mapping: i32 or i64 (engines use either).
pub trait SlotIndex: DeviceRepr {
    /// Whether this is the 64-bit variant.
    const IS_I64: bool;
}
impl SlotIndex for i32 {
    const IS_I64: bool = false;
}
impl SlotIndex for i64 {
    const IS_I64: bool = true;
}

/// [`Error::Length`] unless a buffer holds at least `expected` elements.
pub(crate) fn need_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if actual < expected {
        return Err(Error::Length {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// `v` as the int32 a launcher takes, or Unsupported.
pub(crate) fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Unsupported(format!("{what} = {v} exceeds int32")))
}

fn to_i64(v: usize) -> i64 {
    // Every count here bounds a device allocation, which is far below i64::MAX.
    v as i64
}

// ---- append --------------------------------------------------------------------------------

/// Quantize `num_tokens` tokens of `k` and `v` (`[num_tokens, num_kv_heads, head_dim]`, row
/// major; longer buffers are fine, only the first rows are read) into the pool slots
/// `slots[..num_tokens]`. A negative slot skips its token (padding). A slot past the pool also
/// skips it and is reported by [`DeviceCache::check_appends`]; non-finite inputs are sanitized
/// and counted there too (FORMATS.md). Bytes equal [`HostCache::write`]'s bit for bit.
///
/// `slots`, `k` and `v` are any cudarc device buffers: a `CudaSlice`, or a `CudaView` into a
/// larger one (this step's part of a slot mapping, K and V of a QKV buffer laid out
/// `[Q | K | V]`); `k` and `v` must start 16-byte aligned. Rows interleaved per token (a fused
/// `[tokens, q + k + v heads, d]` projection) take [`append_strided`].
///
/// Enqueued on the cache's stream (that of the [`Gpu`] it was made with), like every other
/// operation on it.
///
/// `int4-kc` keys are written to their blocks' f16 windows, then every block whose last slot
/// this call wrote is sealed (quantized in place, [`HostCache::write`]'s bytes): a sequence's
/// tokens must come in order and the slots of one call must be distinct.
///
/// [`HostCache::write`]: crate::cache::HostCache::write
pub fn append<T: DeviceElement, S: SlotIndex>(
    cache: &mut DeviceCache,
    slots: &impl DevicePtr<S>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    num_tokens: usize,
) -> Result<()> {
    let row = cache.config().num_kv_heads * cache.config().head_dim;
    append_strided(cache, slots, k, row, v, row, num_tokens)
}

/// [`append`] for token rows `k_token_stride` / `v_token_stride` elements apart (a multiple of
/// 8, at least `num_kv_heads * head_dim`): K and V straight out of a fused QKV projection,
/// e.g. `qkv.slice(q_heads * d..)` with stride `(q_heads + 2 * kv_heads) * d`, no copy.
pub fn append_strided<T: DeviceElement, S: SlotIndex>(
    cache: &mut DeviceCache,
    slots: &impl DevicePtr<S>,
    k: &impl DevicePtr<T>,
    k_token_stride: usize,
    v: &impl DevicePtr<T>,
    v_token_stride: usize,
    num_tokens: usize,
) -> Result<()> {
    let c = *cache.config();
    let row = c.num_kv_heads * c.head_dim;
    need_len("slots", num_tokens, slots.len())?;
    if num_tokens == 0 {
        return Ok(());
    }
    // The last token's row ends at (num_tokens - 1) * stride + row; strides below a row are
    // refused by append_raw before anything is read.
    let extent = |stride: usize| {
        (num_tokens - 1)
            .checked_mul(stride)
            .and_then(|e| e.checked_add(row))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{num_tokens} tokens at stride {stride} overflow the element count"
                ))
            })
    };
    need_len(
        "k ([tokens, kv_heads, head_dim] at k_token_stride)",
        extent(k_token_stride)?,
        k.len(),
    )?;
    need_len(
        "v ([tokens, kv_heads, head_dim] at v_token_stride)",
        extent(v_token_stride)?,
        v.len(),
    )?;
    let gpu = cache.gpu().clone();
    gpu.bind()?;
    gpu.check_capture()?;
    let s = gpu.stream();
    let raw = cache.as_raw();
    let num_blocks = cache.num_blocks();
    let counters = cache.counters_ptr() as CUdeviceptr;
    let (slots_p, _g1) = slots.device_ptr(s);
    let (k_p, _g2) = k.device_ptr(s);
    let (v_p, _g3) = v.device_ptr(s);
    // SAFETY: the cache view and counters come from a live DeviceCache on this stream's device;
    // slots, k and v hold every element num_tokens rows at these strides address (checked
    // above); append_raw refuses strides below a row or not a multiple of 8, and k / v not
    // 16-byte aligned (a view may start anywhere); the guards order the caller's buffers with
    // this stream.
    unsafe {
        append_raw(
            &RawAppendArgs {
                cache: raw,
                num_blocks,
                slots: slots_p,
                slots_i64: S::IS_I64,
                num_tokens,
                k: k_p,
                v: v_p,
                dtype: T::DTYPE,
                k_token_stride,
                v_token_stride,
                counters,
            },
            s.cu_stream(),
        )
    }
}

/// Device pointers and shapes of one [`append_raw`] call.
#[derive(Debug, Clone, Copy)]
pub struct RawAppendArgs {
    /// The cache (pool, head scales, layout): [`DeviceCache::as_raw`] or built from a
    /// [`BlockLayout`](crate::BlockLayout).
    pub cache: sys::kvq_cache,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// `[num_tokens]` slots (`block * block_size + offset`), i64 when `slots_i64`, else i32.
    pub slots: CUdeviceptr,
    /// Whether `slots` holds i64.
    pub slots_i64: bool,
    /// Tokens to append.
    pub num_tokens: usize,
    /// Key rows of `dtype`, 16-byte aligned.
    pub k: CUdeviceptr,
    /// Value rows of `dtype`, 16-byte aligned.
    pub v: CUdeviceptr,
    /// Element type of `k` and `v`.
    pub dtype: Dtype,
    /// Elements between consecutive tokens' key rows: at least `num_kv_heads * head_dim`, a
    /// multiple of 8 (so K may be a view into a fused QKV buffer).
    pub k_token_stride: usize,
    /// The same for the value rows.
    pub v_token_stride: usize,
    /// Optional `[KVQ_NUM_COUNTERS]` u64 fault counters (0: none; see kvq.h).
    pub counters: CUdeviceptr,
}

/// [`append`] for memory the caller owns, on `stream`: strides, alignment and counts are
/// checked here, the pointers are the caller's word (see `# Safety`).
///
/// # Safety
/// - `args.cache` describes a live device pool of `args.num_blocks` blocks laid out by its
///   `layout`, and head scale arrays of `num_kv_heads` f32 where a side has them;
/// - `args.slots` points to `num_tokens` device integers of the type `slots_i64` says;
/// - `args.k` and `args.v` point to `num_tokens` rows of `dtype` at their token strides;
/// - all of it stays valid, and is not written by other work, until the launch on `stream` (a
///   stream of the context current on this thread) has finished.
pub unsafe fn append_raw(args: &RawAppendArgs, stream: CUstream) -> Result<()> {
    let &RawAppendArgs {
        ref cache,
        num_blocks,
        slots,
        slots_i64,
        num_tokens,
        k,
        v,
        dtype,
        k_token_stride,
        v_token_stride,
        counters,
    } = args;
    let l = &cache.layout;
    let row = (l.num_kv_heads.max(0) as usize) * (l.head_dim.max(0) as usize);
    for (what, stride) in [
        ("k_token_stride", k_token_stride),
        ("v_token_stride", v_token_stride),
    ] {
        if stride < row || stride % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} {stride} must be a multiple of 8 and at least num_kv_heads * head_dim = {row}"
            )));
        }
    }
    if k % 16 != 0 || v % 16 != 0 {
        return Err(Error::InvalidArgument(
            "k and v must be 16-byte aligned".into(),
        ));
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        launch::append(
            cache,
            to_i64(num_blocks),
            slots as *const c_void,
            slots_i64,
            to_i64(num_tokens),
            k as *const c_void,
            v as *const c_void,
            dtype.raw(),
            to_i64(k_token_stride),
            to_i64(v_token_stride),
            counters as *mut u64,
            stream,
        )
    }
}

// ---- gather ----------------------------------------------------------------------------

/// Dequantize the first `len` tokens of the sequence whose blocks are `block_table` into dense
/// `[len, num_kv_heads, head_dim]` keys and values of `T`: the f32 values of
/// [`HostCache::gather`](crate::cache::HostCache::gather), rounded to `T`. Runs on the cache's
/// stream. With `int4-kc` keys `len` must be the sequence's whole length (it says which blocks
/// are sealed).
pub fn gather_dequantize<T: DeviceElement>(
    cache: &DeviceCache,
    block_table: &[i32],
    len: usize,
) -> Result<(CudaSlice<T>, CudaSlice<T>)> {
    let gpu = cache.gpu();
    let c = cache.config();
    let used = len.div_ceil(c.block_size);
    crate::cache::check_row(block_table, None, len, c.block_size, cache.num_blocks())?;
    let n = len * c.num_kv_heads * c.head_dim;
    gpu.bind()?;
    let s = gpu.stream();
    if len == 0 {
        let empty = || {
            s.null::<T>()
                .map_err(driver_err("allocating an empty output"))
        };
        return Ok((empty()?, empty()?));
    }
    // SAFETY: every element is written by the launch below before it can be read.
    let mut k_out = unsafe { s.alloc::<T>(n) }.map_err(driver_err("allocating k_out"))?;
    // SAFETY: as k_out.
    let mut v_out = unsafe { s.alloc::<T>(n) }.map_err(driver_err("allocating v_out"))?;
    let table = s
        .clone_htod(&block_table[..used])
        .map_err(driver_err("uploading the block table"))?;
    let raw = cache.as_raw();
    {
        let (t_p, _g1) = table.device_ptr(s);
        let (k_p, _g2) = k_out.device_ptr_mut(s);
        let (v_p, _g3) = v_out.device_ptr_mut(s);
        // SAFETY: the table holds `used` validated block ids; outputs hold n elements.
        unsafe {
            gather_dequantize_raw(
                &raw,
                cache.num_blocks(),
                t_p,
                len,
                T::DTYPE,
                k_p,
                v_p,
                0,
                s.cu_stream(),
            )?;
        }
    }
    Ok((k_out, v_out))
}

/// [`gather_dequantize`] for memory the caller owns: the block table is a device array and is
/// not validated on the host; an entry outside `[0, num_blocks)` yields zeros for its tokens and
/// adds them to `counters[KVQ_COUNTER_OUT_OF_RANGE]` (when `counters` is not 0). `k_out` or
/// `v_out` may be 0 to skip that side.
///
/// # Safety
/// - `cache` describes a live device pool of `num_blocks` blocks (see [`append_raw`]);
/// - `block_table` points to `ceil(num_tokens / block_size)` device i32;
/// - `k_out` / `v_out` are 16-byte aligned device buffers of `num_tokens * num_kv_heads *
///   head_dim` elements of `out_dtype`, not used by other work until the launch on `stream`
///   has finished.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gather_dequantize_raw(
    cache: &sys::kvq_cache,
    num_blocks: usize,
    block_table: CUdeviceptr,
    num_tokens: usize,
    out_dtype: Dtype,
    k_out: CUdeviceptr,
    v_out: CUdeviceptr,
    counters: CUdeviceptr,
    stream: CUstream,
) -> Result<()> {
    if k_out % 16 != 0 || v_out % 16 != 0 {
        return Err(Error::InvalidArgument(
            "k_out and v_out must be 16-byte aligned".into(),
        ));
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        launch::gather_dequantize(
            cache,
            to_i64(num_blocks),
            block_table as *const i32,
            to_i64(num_tokens),
            out_dtype.raw(),
            k_out as *mut c_void,
            v_out as *mut c_void,
            counters as *mut u64,
            stream,
        )
    }
}

// ---- dense quantize / dequantize ------------------------------------------------------------

/// A dense tensor quantized on the device: the parts of a [`QuantizedTensor`] (same layout,
/// same bytes) in device memory.
#[derive(Debug)]
pub struct DeviceQuantized {
    format: DenseFormat,
    shape: Vec<usize>,
    /// Packed codes, `[..., code bytes per row]`.
    codes: CudaSlice<u8>,
    /// The f32 scales outside the rows (`[1]` or `[heads]`): FP8's and uniform INT4's (the
    /// `scales` part), FP4's `g` (the `global_scales` part, `[heads]`).
    head_scales: Option<CudaSlice<f32>>,
    /// Each row's scales, as the bytes of the `scales` part ([`DenseFormat::row_scales`]): INT4's
    /// f16 per group, FP4's E4M3 byte per group, INT8's f32.
    row_scales: Option<CudaSlice<u8>>,
    /// Affine INT4: f16 zeros, as bytes, shaped like `row_scales`.
    group_zeros: Option<CudaSlice<u8>>,
    /// `[non_finite, unused]`, filled by the quantize launch.
    counters: Option<CudaSlice<u64>>,
}

/// Rows, heads and head_dim of a dense shape `[..., heads, head_dim]` (src/dense.rs rules).
struct DenseGeometry {
    rows: usize,
    heads: usize,
    head_dim: usize,
}

impl DenseGeometry {
    fn of(format: DenseFormat, shape: &[usize]) -> Result<Self> {
        let Some((&head_dim, prefix)) = shape.split_last() else {
            return Err(Error::InvalidArgument(
                "a tensor to quantize needs at least one axis (head_dim)".into(),
            ));
        };
        format.check_head_dim(head_dim)?;
        if format.kv_format().is_some() && head_dim > MAX_GPU_HEAD_DIM {
            return Err(Error::Unsupported(format!(
                "head_dim {head_dim} on the GPU (at most {MAX_GPU_HEAD_DIM})"
            )));
        }
        let rows = prefix
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|r| r.checked_mul(head_dim).is_some())
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} is too large")))?;
        let heads = prefix.last().copied().unwrap_or(1);
        if heads == 0 {
            // The launchers take at least one head (rows cycle through them).
            return Err(Error::Unsupported(format!(
                "shape {shape:?} on the GPU: its head axis is empty"
            )));
        }
        to_i32("heads", heads)?;
        to_i32("head_dim", head_dim)?;
        Ok(DenseGeometry {
            rows,
            heads,
            head_dim,
        })
    }

    fn elements(&self) -> usize {
        self.rows * self.head_dim
    }

    /// Elements per row of the `scales` part when it holds row scales (and of the zeros), and
    /// their dtype; `None` for head scales (FP8, `int4-uniform`).
    fn row_scales(&self, format: DenseFormat) -> Option<(StoredDtype, usize)> {
        format.row_scales(self.head_dim)
    }

    /// Bytes of the row scales (or of the zeros) of the whole tensor.
    fn row_scale_bytes(&self, format: DenseFormat) -> usize {
        self.row_scales(format)
            .map_or(0, |(dtype, per_row)| self.rows * per_row * dtype.size())
    }
}

fn format_id(format: DenseFormat) -> i32 {
    match format.kv_format() {
        Some(kv) => kv as i32,
        None => sys::KVQ_DENSE_INT4_UNIFORM,
    }
}

/// Whether the tensor's f32 scales per head (or tensor) live outside the rows: FP8's `s`, FP4's
/// `g` (stored as the global scales) and `int4-uniform`'s one scale.
fn has_head_scales(format: DenseFormat) -> bool {
    format.head_scale().is_some() || format.kv_format().is_none()
}

fn head_scale_count(format: DenseFormat, g: &DenseGeometry, choice: Fp8ScaleChoice) -> usize {
    match (format.head_scale(), choice) {
        (Some(HeadScale::Fp4), _) | (Some(HeadScale::Fp8(_)), Fp8ScaleChoice::PerHeadAmax) => {
            g.heads
        }
        _ => 1,
    }
}

/// The head (or tensor) scale calibrated from no data (an amax of 0): 1 for FP8 and FP4, and
/// `int4-uniform`'s rule.
fn scale_of_no_data(format: DenseFormat) -> f32 {
    format
        .head_scale()
        .map_or_else(|| int4::uniform_scale(0.0), |h| h.scale_from_amax(0.0))
}

/// Device bytes for `bytes` bytes; at least one, since an empty allocation is refused.
fn alloc_bytes(gpu: &Gpu, bytes: usize, what: &'static str) -> Result<CudaSlice<u8>> {
    // SAFETY: every caller writes the bytes (a launch, or an upload) before they are read.
    unsafe { gpu.stream().alloc::<u8>(bytes.max(1)) }.map_err(driver_err(what))
}

/// The non-finite inputs a quantize launch counted (waits for it); 0 without counters (an
/// upload).
fn non_finite_count(counters: Option<&CudaSlice<u64>>) -> Result<u64> {
    match counters {
        None => Ok(0),
        Some(c) => {
            let v = c
                .stream()
                .clone_dtoh(c)
                .map_err(driver_err("reading counters"))?;
            Ok(v[sys::KVQ_COUNTER_NON_FINITE])
        }
    }
}

/// `data` uploaded (one zero byte for an empty part, since an empty allocation is refused).
fn upload_bytes(gpu: &Gpu, data: &[u8], what: &'static str) -> Result<CudaSlice<u8>> {
    let data = if data.is_empty() { &[0u8][..] } else { data };
    gpu.stream().clone_htod(data).map_err(driver_err(what))
}

/// Quantize a dense device tensor of `shape` (`[..., heads, head_dim]`, row major) exactly as
/// [`crate::dense::quantize`] does on the host; scales from data (FP8's from amax, FP4's global
/// scales, `int4-uniform`'s) are computed on the device.
pub fn quantize_dense<T: DeviceElement>(
    gpu: &Gpu,
    format: DenseFormat,
    data: &CudaSlice<T>,
    shape: &[usize],
    scale: Fp8ScaleChoice,
) -> Result<DeviceQuantized> {
    let g = DenseGeometry::of(format, shape)?;
    if data.len() != g.elements() {
        return Err(Error::Length {
            what: "tensor data",
            expected: g.elements(),
            actual: data.len(),
        });
    }
    if format.fp8_kind().is_none() && scale != Fp8ScaleChoice::PerTensorAmax {
        return Err(Error::Unsupported(format!(
            "{format} derives its scales from the data; a {scale:?} scale applies only to FP8"
        )));
    }
    if let (Fp8ScaleChoice::Fixed(s), Some(kind)) = (scale, format.fp8_kind()) {
        // The host rule (crate::dense): a stored scale keeps the largest code finite, so the
        // tensor reads back.
        if !(s.is_finite() && s > 0.0 && (kind.max_finite() * s).is_finite()) {
            return Err(Error::Scale {
                what: "fixed FP8 scale (max_finite × scale must be finite too)",
                value: s,
            });
        }
    }
    gpu.bind()?;
    let s = gpu.stream();
    let fmt = format_id(format);
    let stream = s.cu_stream();
    let code_bytes = format.code_bytes(g.head_dim);
    let mut codes = alloc_bytes(gpu, g.rows * code_bytes, "allocating codes")?;
    let mut counters = s
        .alloc_zeros::<u64>(sys::KVQ_NUM_COUNTERS)
        .map_err(driver_err("allocating counters"))?;
    let n_scales = head_scale_count(format, &g, scale);
    let mut head_scales = None;
    if has_head_scales(format) {
        let mut hs = match scale {
            Fp8ScaleChoice::Fixed(v) => s.clone_htod(&[v]),
            // No rows (which the launchers refuse): the scales of an amax of 0.
            _ if g.rows == 0 => s.clone_htod(&vec![scale_of_no_data(format); n_scales]),
            _ => s.alloc_zeros::<f32>(n_scales),
        }
        .map_err(driver_err("allocating scales"))?;
        if !matches!(scale, Fp8ScaleChoice::Fixed(_)) && g.rows > 0 {
            let mut scratch = s
                .alloc_zeros::<u32>(n_scales)
                .map_err(driver_err("allocating scratch"))?;
            let (x_p, _g1) = data.device_ptr(s);
            let (hs_p, _g2) = hs.device_ptr_mut(s);
            let (sc_p, _g3) = scratch.device_ptr_mut(s);
            // SAFETY: x holds rows * head_dim elements; scales and scratch n_scales each.
            unsafe {
                launch::dense_scales(
                    fmt,
                    x_p as *const c_void,
                    T::DTYPE.raw(),
                    to_i64(g.rows),
                    g.heads as i32,
                    g.head_dim as i32,
                    n_scales > 1,
                    hs_p as *mut f32,
                    sc_p as *mut u32,
                    stream,
                )?;
            }
        }
        head_scales = Some(hs);
    }
    let row_bytes = g.row_scale_bytes(format);
    let mut row_scales = g
        .row_scales(format)
        .map(|_| alloc_bytes(gpu, row_bytes, "allocating scales"))
        .transpose()?;
    let mut group_zeros = format
        .has_zeros()
        .then(|| alloc_bytes(gpu, row_bytes, "allocating zeros"))
        .transpose()?;
    if g.rows > 0 {
        let (x_p, _g1) = data.device_ptr(s);
        let hs = head_scales.as_ref().map(|h| h.device_ptr(s));
        let (c_p, _g2) = codes.device_ptr_mut(s);
        let rs = row_scales.as_mut().map(|h| h.device_ptr_mut(s));
        let gz = group_zeros.as_mut().map(|h| h.device_ptr_mut(s));
        let (n_p, _g3) = counters.device_ptr_mut(s);
        // SAFETY: every buffer was sized from the validated geometry above; head scales hold
        // n_scales f32 (1 or heads).
        unsafe {
            launch::quantize_dense(
                fmt,
                x_p as *const c_void,
                T::DTYPE.raw(),
                to_i64(g.rows),
                g.heads as i32,
                g.head_dim as i32,
                hs.as_ref().map_or(0, |p| p.0) as *const f32,
                n_scales as i32,
                c_p as *mut u8,
                rs.as_ref().map_or(0, |p| p.0) as *mut c_void,
                gz.as_ref().map_or(0, |p| p.0) as *mut u16,
                n_p as *mut u64,
                stream,
            )?;
        }
    }
    Ok(DeviceQuantized {
        format,
        shape: shape.to_vec(),
        codes,
        head_scales,
        row_scales,
        group_zeros,
        counters: Some(counters),
    })
}

/// Dequantize to a dense device tensor of `T` with [`DeviceQuantized::shape`]: the f32 values of
/// [`crate::dense::dequantize`], rounded to `T`.
pub fn dequantize_dense<T: DeviceElement>(gpu: &Gpu, q: &DeviceQuantized) -> Result<CudaSlice<T>> {
    let g = DenseGeometry::of(q.format, &q.shape)?;
    gpu.bind()?;
    let s = gpu.stream();
    if g.elements() == 0 {
        return s
            .null::<T>()
            .map_err(driver_err("allocating an empty output"));
    }
    // SAFETY: every element is written by the launch below.
    let mut out = unsafe { s.alloc::<T>(g.elements()) }.map_err(driver_err("allocating output"))?;
    {
        let (c_p, _g1) = q.codes.device_ptr(s);
        let hs = q.head_scales.as_ref().map(|h| h.device_ptr(s));
        let rs = q.row_scales.as_ref().map(|h| h.device_ptr(s));
        let gz = q.group_zeros.as_ref().map(|h| h.device_ptr(s));
        let (o_p, _g2) = out.device_ptr_mut(s);
        // SAFETY: a DeviceQuantized's parts always match its format and shape.
        unsafe {
            launch::dequantize_dense(
                format_id(q.format),
                c_p as *const u8,
                hs.as_ref().map_or(0, |p| p.0) as *const f32,
                q.head_scales.as_ref().map_or(0, |h| h.len()) as i32,
                rs.as_ref().map_or(0, |p| p.0) as *const c_void,
                gz.as_ref().map_or(0, |p| p.0) as *const u16,
                to_i64(g.rows),
                g.heads as i32,
                g.head_dim as i32,
                T::DTYPE.raw(),
                o_p as *mut c_void,
                s.cu_stream(),
            )?;
        }
    }
    Ok(out)
}

impl DeviceQuantized {
    /// Upload a host [`QuantizedTensor`] (for dequantizing it on the device).
    pub fn from_host(gpu: &Gpu, q: &QuantizedTensor) -> Result<Self> {
        let format = q.format();
        let g = DenseGeometry::of(format, q.shape())?;
        gpu.bind()?;
        let s = gpu.stream();
        let floats = |t: &StoredTensor| -> Vec<f32> {
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        // The scales outside the rows: FP4's are its global scales, FP8's and uniform INT4's
        // the scales part; a format with row scales keeps them in its scales part.
        let head_part = match (format.head_scale(), g.row_scales(format)) {
            (Some(HeadScale::Fp4), _) => q.global_scales(),
            (_, None) => Some(q.scales()),
            (_, Some(_)) => None,
        };
        let head_scales = head_part
            .map(|t| {
                s.clone_htod(&floats(t))
                    .map_err(driver_err("uploading head scales"))
            })
            .transpose()?;
        let row_scales = g
            .row_scales(format)
            .map(|_| upload_bytes(gpu, q.scales().data(), "uploading scales"))
            .transpose()?;
        let group_zeros = q
            .zeros()
            .map(|z| upload_bytes(gpu, z.data(), "uploading zeros"))
            .transpose()?;
        Ok(DeviceQuantized {
            format,
            shape: q.shape().to_vec(),
            codes: upload_bytes(gpu, q.codes().data(), "uploading codes")?,
            head_scales,
            row_scales,
            group_zeros,
            counters: None,
        })
    }

    /// The format.
    pub fn format(&self) -> DenseFormat {
        self.format
    }

    /// Shape of the original tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Non-finite inputs met while quantizing (waits for the launch); 0 for an upload.
    pub fn non_finite(&self) -> Result<u64> {
        non_finite_count(self.counters.as_ref())
    }

    /// Copy back as a host [`QuantizedTensor`] (waits for the launch). Its `non_finite()` is 0
    /// (the type keeps that count private); read [`non_finite`](Self::non_finite) instead.
    pub fn to_host(&self) -> Result<QuantizedTensor> {
        let s = self.codes.stream();
        let g = DenseGeometry::of(self.format, &self.shape)?;
        let prefix = &self.shape[..self.shape.len() - 1];
        let with_last = |last: usize| prefix.iter().copied().chain([last]).collect::<Vec<_>>();
        let code_bytes = self.format.code_bytes(g.head_dim);
        let mut codes = s
            .clone_dtoh(&self.codes)
            .map_err(driver_err("reading codes"))?;
        codes.truncate(g.rows * code_bytes);
        let codes = StoredTensor::new(StoredDtype::U8, with_last(code_bytes), codes)?;
        let head_scales = self
            .head_scales
            .as_ref()
            .map(|h| -> Result<StoredTensor> {
                let v = s.clone_dtoh(h).map_err(driver_err("reading head scales"))?;
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                StoredTensor::new(StoredDtype::F32, vec![v.len()], bytes)
            })
            .transpose()?;
        // Row scales and zeros: the part's bytes, `[..., per_row]`.
        let row_part = |part: &Option<CudaSlice<u8>>| -> Result<Option<StoredTensor>> {
            let (Some(bytes), Some((dtype, per_row))) = (part, g.row_scales(self.format)) else {
                return Ok(None);
            };
            let mut v = s.clone_dtoh(bytes).map_err(driver_err("reading scales"))?;
            v.truncate(g.row_scale_bytes(self.format));
            StoredTensor::new(dtype, with_last(per_row), v).map(Some)
        };
        let row_scales = row_part(&self.row_scales)?;
        let zeros = row_part(&self.group_zeros)?;
        // FP4's head scales are its global scales; FP8's and uniform INT4's its scales.
        let (scales, global_scales) = match (row_scales, head_scales) {
            (Some(rows), global) => (rows, global),
            (None, Some(head)) => (head, None),
            (None, None) => {
                return Err(Error::InvalidArgument(format!(
                    "{} tensor without scales",
                    self.format
                )));
            }
        };
        QuantizedTensor::from_parts(self.format, codes, scales, zeros, global_scales)
    }
}

// ---- dense int4-kc ----------------------------------------------------------------------------

/// A dense tensor in per-channel INT4 keys (`int4-kc`, FORMATS.md's dense file) on the device:
/// the parts of a [`QuantizedChannels`] (same layout, same bytes) in device memory.
#[derive(Debug)]
pub struct DeviceQuantizedChannels {
    shape: Vec<usize>,
    kc: KcShape,
    /// Packed codes, `[..., head_dim / 2]`.
    codes: CudaSlice<u8>,
    /// f16 `s` as bytes, `[ceil(T / 32), heads, head_dim]`.
    scales: CudaSlice<u8>,
    /// f16 `z` as bytes, shaped like `scales`.
    zeros: CudaSlice<u8>,
    /// `[non_finite, unused]`, filled by the quantize launch.
    counters: Option<CudaSlice<u64>>,
}

/// Element pairs (code bytes) a dense `int4-kc` tensor may have on the GPU, whose kernels count
/// them in 32 bits (kvq.h, `kvq_quantize_dense`).
const KC_MAX_PAIRS: usize = (1 << 31) - 512;

/// The `[T, heads, head_dim]` reading of `shape` as [`dense::quantize_int4_kc`] takes it (its
/// typed errors: no axes, an odd or zero head_dim, a size past memory), within what the kernels
/// take.
fn kc_geometry(shape: &[usize]) -> Result<KcShape> {
    let kc = dense::kc_shape(shape)?;
    if kc.elements() / 2 > KC_MAX_PAIRS {
        return Err(Error::Unsupported(format!(
            "an int4-kc tensor of shape {shape:?} on the GPU (at most {KC_MAX_PAIRS} element pairs)"
        )));
    }
    to_i32("heads", kc.heads())?;
    to_i32("head_dim", kc.head_dim())?;
    Ok(kc)
}

/// Bytes of the scales (and of the zeros) of a dense `int4-kc` tensor: an f16 per group, head and
/// channel.
fn kc_meta_bytes(kc: &KcShape) -> usize {
    kc.groups(Mode::Dense) * kc.heads() * kc.head_dim() * 2
}

/// Quantize a dense device tensor of `shape` (`[..., heads, head_dim]`, row major, head_dim
/// even) to `int4-kc` exactly as [`dense::quantize_int4_kc`] does on the host: the tensor read
/// as `[T, heads, head_dim]`, each (head, channel) in groups of 32 tokens, a last group of
/// `T mod 32` tokens quantized over those. Inputs are sanitized and counted
/// ([`DeviceQuantizedChannels::non_finite`]).
///
/// Errors, before any launch: the host's for the shape ([`Error::Config`] for an odd head_dim,
/// [`Error::InvalidArgument`] for no axes, [`Error::Overflow`]), [`Error::Length`] when `data`
/// does not hold the shape's elements, [`Error::Unsupported`] past 2^31 - 512 element pairs.
pub fn quantize_int4_kc<T: DeviceElement>(
    gpu: &Gpu,
    data: &CudaSlice<T>,
    shape: &[usize],
) -> Result<DeviceQuantizedChannels> {
    let kc = kc_geometry(shape)?;
    if data.len() != kc.elements() {
        return Err(Error::Length {
            what: "tensor data",
            expected: kc.elements(),
            actual: data.len(),
        });
    }
    gpu.bind()?;
    let s = gpu.stream();
    let mut codes = alloc_bytes(gpu, kc.elements() / 2, "allocating codes")?;
    let mut scales = alloc_bytes(gpu, kc_meta_bytes(&kc), "allocating scales")?;
    let mut zeros = alloc_bytes(gpu, kc_meta_bytes(&kc), "allocating zeros")?;
    let mut counters = s
        .alloc_zeros::<u64>(sys::KVQ_NUM_COUNTERS)
        .map_err(driver_err("allocating counters"))?;
    // An empty tensor (no tokens, no heads) has nothing to launch: its parts are empty.
    if kc.elements() > 0 {
        let (x_p, _g1) = data.device_ptr(s);
        let (c_p, _g2) = codes.device_ptr_mut(s);
        let (s_p, _g3) = scales.device_ptr_mut(s);
        let (z_p, _g4) = zeros.device_ptr_mut(s);
        let (n_p, _g5) = counters.device_ptr_mut(s);
        // SAFETY: x holds T * heads * head_dim elements (checked above); codes, scales and
        // zeros were sized from the same validated shape (fresh allocations: 16-byte aligned).
        unsafe {
            launch::quantize_dense(
                KvFormat::Int4Kc as i32,
                x_p as *const c_void,
                T::DTYPE.raw(),
                to_i64(kc.tokens() * kc.heads()),
                kc.heads() as i32,
                kc.head_dim() as i32,
                std::ptr::null(),
                0,
                c_p as *mut u8,
                s_p as *mut c_void,
                z_p as *mut u16,
                n_p as *mut u64,
                s.cu_stream(),
            )?;
        }
    }
    Ok(DeviceQuantizedChannels {
        shape: shape.to_vec(),
        kc,
        codes,
        scales,
        zeros,
        counters: Some(counters),
    })
}

/// Dequantize to a dense device tensor of `T` with [`DeviceQuantizedChannels::shape`]: the f32
/// values of [`QuantizedChannels::dequantize`], rounded to `T`.
pub fn dequantize_int4_kc<T: DeviceElement>(
    gpu: &Gpu,
    q: &DeviceQuantizedChannels,
) -> Result<CudaSlice<T>> {
    let kc = q.kc;
    gpu.bind()?;
    let s = gpu.stream();
    if kc.elements() == 0 {
        return s
            .null::<T>()
            .map_err(driver_err("allocating an empty output"));
    }
    // SAFETY: every element is written by the launch below.
    let mut out =
        unsafe { s.alloc::<T>(kc.elements()) }.map_err(driver_err("allocating output"))?;
    {
        let (c_p, _g1) = q.codes.device_ptr(s);
        let (s_p, _g2) = q.scales.device_ptr(s);
        let (z_p, _g3) = q.zeros.device_ptr(s);
        let (o_p, _g4) = out.device_ptr_mut(s);
        // SAFETY: a DeviceQuantizedChannels' parts always match its shape (kc_geometry checked
        // it when it was made).
        unsafe {
            launch::dequantize_dense(
                KvFormat::Int4Kc as i32,
                c_p as *const u8,
                std::ptr::null(),
                0,
                s_p as *const c_void,
                z_p as *const u16,
                to_i64(kc.tokens() * kc.heads()),
                kc.heads() as i32,
                kc.head_dim() as i32,
                T::DTYPE.raw(),
                o_p as *mut c_void,
                s.cu_stream(),
            )?;
        }
    }
    Ok(out)
}

impl DeviceQuantizedChannels {
    /// Upload a host [`QuantizedChannels`] (for dequantizing it on the device).
    pub fn from_host(gpu: &Gpu, q: &QuantizedChannels) -> Result<Self> {
        let kc = kc_geometry(q.shape())?;
        gpu.bind()?;
        let t = q.tensor();
        let halves =
            |v: &[half::f16]| -> Vec<u8> { v.iter().flat_map(|h| h.to_le_bytes()).collect() };
        Ok(DeviceQuantizedChannels {
            shape: q.shape().to_vec(),
            kc,
            codes: upload_bytes(gpu, t.codes(), "uploading codes")?,
            scales: upload_bytes(gpu, &halves(t.scales()), "uploading scales")?,
            zeros: upload_bytes(gpu, &halves(t.zeros()), "uploading zeros")?,
            counters: None,
        })
    }

    /// Shape of the original tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Non-finite inputs met while quantizing (waits for the launch); 0 for an upload.
    pub fn non_finite(&self) -> Result<u64> {
        non_finite_count(self.counters.as_ref())
    }

    /// Copy back as a host [`QuantizedChannels`] (waits for the launch). Its `non_finite()` is 0;
    /// read [`non_finite`](Self::non_finite) instead.
    pub fn to_host(&self) -> Result<QuantizedChannels> {
        let s = self.codes.stream();
        let kc = self.kc;
        let read = |part: &CudaSlice<u8>, len: usize, what: &'static str| -> Result<Vec<u8>> {
            // An empty part is a one-byte allocation nothing wrote: nothing to read.
            if len == 0 {
                return Ok(Vec::new());
            }
            let mut v = s.clone_dtoh(part).map_err(driver_err(what))?;
            v.truncate(len);
            Ok(v)
        };
        let mut codes_shape = self.shape.clone();
        if let Some(last) = codes_shape.last_mut() {
            *last /= 2;
        }
        let meta_shape = vec![kc.groups(Mode::Dense), kc.heads(), kc.head_dim()];
        let meta = kc_meta_bytes(&kc);
        let codes = StoredTensor::new(
            StoredDtype::U8,
            codes_shape,
            read(&self.codes, kc.elements() / 2, "reading codes")?,
        )?;
        let scales = StoredTensor::new(
            StoredDtype::F16,
            meta_shape.clone(),
            read(&self.scales, meta, "reading scales")?,
        )?;
        let zeros = StoredTensor::new(
            StoredDtype::F16,
            meta_shape,
            read(&self.zeros, meta, "reading zeros")?,
        )?;
        QuantizedChannels::from_parts(codes, scales, zeros)
    }
}
