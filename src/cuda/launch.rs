//! The result layer: every call into `cuda/kvq.h`, with its status mapped to an [`Error`], in
//! one place. Above it, [`ops`](super::ops), [`decode`](super::decode) and
//! [`DeviceCache`](super::DeviceCache) validate their arguments and then call these; below it,
//! [`sys`] is the bare C ABI. Nothing here validates beyond what the launchers do themselves
//! (kvq.h: "a last line of defence"), so every function is `unsafe` with the header's contract.

use super::sys;
use crate::error::{Error, Result};
use std::ffi::c_void;

/// A raw stream for the launchers (`void *stream`).
pub(crate) type Stream = cudarc::driver::sys::CUstream;

/// Map a `kvq_status` returned by launcher `what` to a result; a failed launch keeps the
/// runtime's `cudaError_t` ([`Error::Launch`]).
pub(crate) fn check_status(status: std::ffi::c_int, what: &'static str) -> Result<()> {
    match status {
        sys::KVQ_OK => Ok(()),
        sys::KVQ_ERR_INVALID => Err(Error::Cuda(format!(
            "{what}: the launcher rejected its arguments (kvq bug: the Rust checks should have \
             caught this)"
        ))),
        sys::KVQ_ERR_UNSUPPORTED => Err(Error::Unsupported(format!(
            "{what}: no kernel for this combination in this build"
        ))),
        sys::KVQ_ERR_LAUNCH => {
            // SAFETY: both read this thread's last launch error; kvq_last_error returns a
            // static NUL-terminated string.
            let (code, msg) = unsafe {
                (
                    sys::kvq_last_error_code(),
                    std::ffi::CStr::from_ptr(sys::kvq_last_error()),
                )
            };
            Err(Error::Launch {
                what,
                code,
                message: msg.to_string_lossy().into_owned(),
            })
        }
        other => Err(Error::Cuda(format!("{what}: unknown status {other}"))),
    }
}

/// `kvq_append`.
///
/// # Safety
/// kvq.h's contract for `kvq_append`: a live pool of `num_blocks` blocks described by `cache`,
/// `num_tokens` slots and rows at the given strides, all on `stream`'s device.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn append(
    cache: &sys::kvq_cache,
    num_blocks: i64,
    slots: *const c_void,
    slots_i64: bool,
    num_tokens: i64,
    k: *const c_void,
    v: *const c_void,
    dtype: i32,
    k_token_stride: i64,
    v_token_stride: i64,
    counters: *mut u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_append(
            cache,
            num_blocks,
            slots,
            slots_i64 as i32,
            num_tokens,
            k,
            v,
            dtype,
            k_token_stride,
            v_token_stride,
            counters,
            stream.cast(),
        )
    };
    check_status(status, "kvq_append")
}

/// `kvq_gather_dequantize`.
///
/// # Safety
/// kvq.h's contract for `kvq_gather_dequantize`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gather_dequantize(
    cache: &sys::kvq_cache,
    num_blocks: i64,
    block_table: *const i32,
    num_tokens: i64,
    out_dtype: i32,
    k_out: *mut c_void,
    v_out: *mut c_void,
    counters: *mut u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_gather_dequantize(
            cache,
            num_blocks,
            block_table,
            num_tokens,
            out_dtype,
            k_out,
            v_out,
            counters,
            stream.cast(),
        )
    };
    check_status(status, "kvq_gather_dequantize")
}

/// `kvq_decode_context`.
///
/// # Safety
/// kvq.h's contract for `kvq_decode_context`: `block_tables` holds `batch * max_blocks`
/// device int32 of the cache's pool, `context_lens` `batch` device int32, `dst` a live 16-bit
/// pool of `dst_blocks` blocks apart from the cache's, `dst_tables` `batch * dst_max_blocks`
/// device int32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn decode_context(
    cache: &sys::kvq_cache,
    num_blocks: i64,
    block_tables: *const i32,
    max_blocks: i32,
    context_lens: *const i32,
    batch: i32,
    max_context_len: i32,
    dst: &sys::kvq_cache,
    dst_blocks: i64,
    dst_tables: *mut i32,
    dst_max_blocks: i32,
    counters: *mut u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_decode_context(
            cache,
            num_blocks,
            block_tables,
            max_blocks,
            context_lens,
            batch,
            max_context_len,
            dst,
            dst_blocks,
            dst_tables,
            dst_max_blocks,
            counters,
            stream.cast(),
        )
    };
    check_status(status, "kvq_decode_context")
}

/// `kvq_copy_blocks`.
///
/// # Safety
/// kvq.h's contract for `kvq_copy_blocks`: `pairs` holds `2 * num_pairs` device int32, no
/// destination repeated or also a source.
pub(crate) unsafe fn copy_blocks(
    cache: &sys::kvq_cache,
    num_blocks: i64,
    pairs: *const i32,
    num_pairs: i64,
    counters: *mut u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_copy_blocks(cache, num_blocks, pairs, num_pairs, counters, stream.cast())
    };
    check_status(status, "kvq_copy_blocks")
}

/// `kvq_copy_blocks_layers`.
///
/// # Safety
/// kvq.h's contract for `kvq_copy_blocks_layers`: `pools` and `counters` hold `num_layers`
/// device addresses of live pools of `num_blocks` blocks (and their counters), `pairs` holds
/// `2 * num_pairs` device int32, no destination repeated or also a source.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn copy_blocks_layers(
    pools: *const *mut u8,
    counters: *const *mut u64,
    num_layers: i32,
    block_stride: i64,
    num_blocks: i64,
    pairs: *const i32,
    num_pairs: i64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_copy_blocks_layers(
            pools,
            counters,
            num_layers,
            block_stride,
            num_blocks,
            pairs,
            num_pairs,
            stream.cast(),
        )
    };
    check_status(status, "kvq_copy_blocks_layers")
}

/// `kvq_tables_update`.
///
/// # Safety
/// kvq.h's contract: `src` (a device address of mapped pinned host memory) holds `num_lens +
/// 2 * num_pairs` int32 naming distinct entries of `table_dst`; `lens_dst` holds `num_lens`;
/// `blocks_finished` is a device uint32 left zero by the previous launch; `done` is a device
/// address of mapped pinned host memory.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tables_update(
    src: *const i32,
    num_lens: i32,
    lens_dst: *mut i32,
    table_dst: *mut i32,
    num_pairs: i64,
    blocks_finished: *mut u32,
    done: *mut u32,
    generation: u32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_tables_update(
            src,
            num_lens,
            lens_dst,
            table_dst,
            num_pairs,
            blocks_finished,
            done,
            generation,
            stream.cast(),
        )
    };
    check_status(status, "kvq_tables_update")
}

/// `kvq_dense_scales`.
///
/// # Safety
/// kvq.h's contract for `kvq_dense_scales`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dense_scales(
    format: i32,
    x: *const c_void,
    dtype: i32,
    rows: i64,
    heads: i32,
    head_dim: i32,
    per_head: bool,
    scales_out: *mut f32,
    amax_scratch: *mut u32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_dense_scales(
            format,
            x,
            dtype,
            rows,
            heads,
            head_dim,
            per_head as i32,
            scales_out,
            amax_scratch,
            stream.cast(),
        )
    };
    check_status(status, "kvq_dense_scales")
}

/// `kvq_head_clip_scratch_bytes`: device scratch bytes of [`head_clip`] for `heads` heads.
pub(crate) fn head_clip_scratch_bytes(heads: i32) -> usize {
    // SAFETY: a pure function of its argument.
    unsafe { sys::kvq_head_clip_scratch_bytes(heads) }.max(0) as usize
}

/// `kvq_head_clip`.
///
/// # Safety
/// kvq.h's contract for `kvq_head_clip`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn head_clip(
    x: *const c_void,
    dtype: i32,
    rows: i64,
    heads: i32,
    head_dim: i32,
    rank: i64,
    clip_out: *mut f32,
    scratch: *mut c_void,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_head_clip(
            x,
            dtype,
            rows,
            heads,
            head_dim,
            rank,
            clip_out,
            scratch,
            stream.cast(),
        )
    };
    check_status(status, "kvq_head_clip")
}

/// `kvq_quantize_dense`.
///
/// # Safety
/// kvq.h's contract for `kvq_quantize_dense`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn quantize_dense(
    format: i32,
    x: *const c_void,
    dtype: i32,
    rows: i64,
    heads: i32,
    head_dim: i32,
    head_scales: *const f32,
    num_head_scales: i32,
    codes: *mut u8,
    scales: *mut c_void,
    group_zeros: *mut u16,
    counters: *mut u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_quantize_dense(
            format,
            x,
            dtype,
            rows,
            heads,
            head_dim,
            head_scales,
            num_head_scales,
            codes,
            scales,
            group_zeros,
            counters,
            stream.cast(),
        )
    };
    check_status(status, "kvq_quantize_dense")
}

/// `kvq_dequantize_dense`.
///
/// # Safety
/// kvq.h's contract for `kvq_dequantize_dense`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dequantize_dense(
    format: i32,
    codes: *const u8,
    head_scales: *const f32,
    num_head_scales: i32,
    scales: *const c_void,
    group_zeros: *const u16,
    rows: i64,
    heads: i32,
    head_dim: i32,
    out_dtype: i32,
    out: *mut c_void,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_dequantize_dense(
            format,
            codes,
            head_scales,
            num_head_scales,
            scales,
            group_zeros,
            rows,
            heads,
            head_dim,
            out_dtype,
            out,
            stream.cast(),
        )
    };
    check_status(status, "kvq_dequantize_dense")
}

/// `kvq_decode_attention`.
///
/// # Safety
/// kvq.h's contract for `kvq_decode_attention`.
pub(crate) unsafe fn decode_attention(args: &sys::kvq_decode_args, stream: Stream) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { sys::kvq_decode_attention(args, stream.cast()) };
    check_status(status, "kvq_decode_attention")
}

/// `kvq_decode_supported`: whether this build has a decode kernel for the pair at `head_dim`.
pub(crate) fn decode_supported(k_format: i32, v_format: i32, head_dim: i32) -> bool {
    // SAFETY: a pure host function of three ints.
    unsafe { sys::kvq_decode_supported(k_format, v_format, head_dim) == 1 }
}

/// What `kvq_decode_occupancy` reports of one launch shape of a decode kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodeOccupancy {
    /// Thread blocks that fit on one SM (0: none).
    pub ctas: usize,
    /// Bytes of one copy stage of one warp.
    pub stage_bytes: usize,
    /// Tokens a warp takes per step.
    pub step_tokens: usize,
}

impl DecodeOccupancy {
    /// A launch shape that does not fit.
    pub const NONE: DecodeOccupancy = DecodeOccupancy {
        ctas: 0,
        stage_bytes: 0,
        step_tokens: 1,
    };
}

/// `kvq_decode_occupancy` for a format pair (kvq_format ids), head_dim, warps per block and
/// stages. The device's context must be current on this thread (it raises the kernel's
/// shared-memory limit there).
pub(crate) fn decode_occupancy(
    k_format: i32,
    v_format: i32,
    head_dim: i32,
    warps: i32,
    stages: i32,
) -> Result<DecodeOccupancy> {
    let (mut ctas, mut stage_bytes, mut step_tokens) = (0i32, 0i32, 0i32);
    // SAFETY: a host call that writes three ints.
    let status = unsafe {
        sys::kvq_decode_occupancy(
            k_format,
            v_format,
            head_dim,
            warps,
            stages,
            &mut ctas,
            &mut stage_bytes,
            &mut step_tokens,
        )
    };
    check_status(status, "kvq_decode_occupancy")?;
    Ok(DecodeOccupancy {
        ctas: ctas.max(0) as usize,
        stage_bytes: stage_bytes.max(0) as usize,
        step_tokens: step_tokens.max(1) as usize,
    })
}

#[cfg(feature = "bench")]
/// `kvq_stream_read`.
///
/// # Safety
/// kvq.h's contract for `kvq_stream_read`: `bytes` readable at `src`, 4096 f32 at `sink`.
pub(crate) unsafe fn stream_read(
    src: *const c_void,
    bytes: i64,
    sink: *mut f32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { sys::kvq_stream_read(src, bytes, sink, stream.cast()) };
    check_status(status, "kvq_stream_read")
}

#[cfg(feature = "bench")]
/// `kvq_stream_read_variants`: how many read variants the probe has.
pub(crate) fn stream_read_variants() -> usize {
    // SAFETY: a query of a static table.
    unsafe { sys::kvq_stream_read_variants() }.max(0) as usize
}

#[cfg(feature = "bench")]
/// `kvq_stream_read_variant_name` of variant `i` (below [`stream_read_variants`]).
pub(crate) fn stream_read_variant_name(i: usize) -> &'static str {
    if i >= stream_read_variants() {
        return "?";
    }
    // SAFETY: i is in range, so the launcher returns a static NUL-terminated string.
    let name = unsafe { std::ffi::CStr::from_ptr(sys::kvq_stream_read_variant_name(i as i32)) };
    name.to_str().unwrap_or("?")
}

#[cfg(feature = "bench")]
/// `kvq_stream_read_variant`.
///
/// # Safety
/// kvq.h's contract: `bytes` readable at `src` (16-byte aligned), `KVQ_STREAM_SINK_WORDS`
/// words at `sink`.
pub(crate) unsafe fn stream_read_variant(
    variant: usize,
    src: *const c_void,
    bytes: i64,
    sink: *mut u32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status =
        unsafe { sys::kvq_stream_read_variant(variant as i32, src, bytes, sink, stream.cast()) };
    check_status(status, "kvq_stream_read_variant")
}

#[cfg(feature = "bench")]
/// `kvq_stream_fill`.
///
/// # Safety
/// kvq.h's contract: `bytes` writable at `dst` (16-byte aligned).
pub(crate) unsafe fn stream_fill(
    dst: *mut c_void,
    bytes: i64,
    seed: u32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { sys::kvq_stream_fill(dst, bytes, seed, stream.cast()) };
    check_status(status, "kvq_stream_fill")
}

/// `kvq_prefill_supported`: whether this build has a prefill kernel for the pair at `head_dim`
/// with queries of `q_dtype`.
pub(crate) fn prefill_supported(k_format: i32, v_format: i32, head_dim: i32, q_dtype: i32) -> bool {
    // SAFETY: a pure host function of four ints.
    unsafe { sys::kvq_prefill_supported(k_format, v_format, head_dim, q_dtype) == 1 }
}

/// `kvq_prefill_prepare`: the dynamic shared memory of one thread block of the prefill kernel
/// for `layout` and `q_dtype`, the largest of its tile widths' (and the kernels' limits raised
/// to it on the current device).
pub(crate) fn prefill_prepare(layout: &sys::kvq_layout, q_dtype: i32) -> Result<usize> {
    let mut smem = 0i32;
    // SAFETY: a host call that reads the layout and writes one int.
    let status = unsafe { sys::kvq_prefill_prepare(layout, q_dtype, &mut smem) };
    check_status(status, "kvq_prefill_prepare")?;
    Ok(smem as usize)
}

/// `kvq_prefill_attention`.
///
/// # Safety
/// kvq.h's contract for `kvq_prefill_attention`.
pub(crate) unsafe fn prefill_attention(args: &sys::kvq_prefill_args, stream: Stream) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { sys::kvq_prefill_attention(args, stream.cast()) };
    check_status(status, "kvq_prefill_attention")
}

/// `kvq_merge_states`.
///
/// # Safety
/// kvq.h's contract for `kvq_merge_states`: `rows x head_dim` elements of `dtype` at `a`, `b`
/// and `out`, `rows` f32 at each lse pointer, all on `stream`'s device.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn merge_states(
    a: *const c_void,
    a_lse: *const f32,
    b: *const c_void,
    b_lse: *const f32,
    out: *mut c_void,
    out_lse: *mut f32,
    rows: i64,
    head_dim: i32,
    dtype: i32,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe {
        sys::kvq_merge_states(
            a,
            a_lse,
            b,
            b_lse,
            out,
            out_lse,
            rows,
            head_dim,
            dtype,
            stream.cast(),
        )
    };
    check_status(status, "kvq_merge_states")
}
