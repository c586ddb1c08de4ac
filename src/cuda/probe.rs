//! Streaming-read probes (`cuda/bandwidth.cu`): several ways to read a buffer once, so that
//! [`bench::read_ceiling`](super::bench::read_ceiling) can take the fastest as the device's read
//! ceiling. Each variant adds the 32-bit words it read into a checksum sink; on a buffer from
//! [`stream_fill`] the sum is known in advance ([`fill_word_sum`]), which proves that a variant
//! read every byte exactly once.

use super::ops::need_len;
use super::{Gpu, launch, sys};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// `u32` words a checksum sink must hold.
pub const SINK_WORDS: usize = sys::KVQ_STREAM_SINK_WORDS;

/// Names of the read variants, in launcher order (the index is what [`stream_read_variant`]
/// takes), e.g. `nc-x16-t256-k3-tiles`.
pub fn variant_names() -> Vec<&'static str> {
    (0..launch::stream_read_variants())
        .map(launch::stream_read_variant_name)
        .collect()
}

fn check_buffer(what: &'static str, bytes: usize, len: usize) -> Result<()> {
    need_len(what, bytes, len)?;
    if bytes == 0 || bytes % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {bytes} bytes is not a positive multiple of 16"
        )));
    }
    Ok(())
}

/// Enqueue one read of the first `bytes` of `src` with variant `variant`, adding the sum
/// (mod 2^32) of its 32-bit words into the words of `sink`. [`Error::Unsupported`] when the
/// variant cannot run on this device with this build (bulk copies need sm_90+).
pub fn stream_read_variant(
    gpu: &Gpu,
    variant: usize,
    src: &CudaSlice<u8>,
    bytes: usize,
    sink: &mut CudaSlice<u32>,
) -> Result<()> {
    check_buffer("stream_read_variant source", bytes, src.len())?;
    need_len("stream_read_variant sink", SINK_WORDS, sink.len())?;
    if variant >= launch::stream_read_variants() {
        return Err(Error::InvalidArgument(format!("no read variant {variant}")));
    }
    gpu.bind()?;
    let s = gpu.stream();
    let (src_p, _g1) = src.device_ptr(s);
    let (sink_p, _g2) = sink.device_ptr_mut(s);
    // SAFETY: src holds `bytes` bytes and sink SINK_WORDS words (checked); cudaMalloc'd memory
    // is 256-byte aligned.
    unsafe {
        launch::stream_read_variant(
            variant,
            src_p as *const c_void,
            bytes as i64,
            sink_p as *mut u32,
            s.cu_stream(),
        )
    }
}

/// Enqueue a fill of the first `bytes` of `dst`: 32-bit word i becomes
/// `seed + i * KVQ_STREAM_FILL_STEP` (mod 2^32), varied non-zero data with a known sum.
pub fn stream_fill(gpu: &Gpu, dst: &mut CudaSlice<u8>, bytes: usize, seed: u32) -> Result<()> {
    check_buffer("stream_fill destination", bytes, dst.len())?;
    gpu.bind()?;
    let s = gpu.stream();
    let (p, _g) = dst.device_ptr_mut(s);
    // SAFETY: dst holds `bytes` bytes (checked) and is 256-byte aligned.
    unsafe { launch::stream_fill(p as *mut c_void, bytes as i64, seed, s.cu_stream()) }
}

/// Stream-read `bytes` of `src` once with the default variant (what the benches' L2 flush
/// uses). `sink` must hold at least [`SINK_WORDS`] f32. Enqueued on `gpu`'s stream.
pub fn stream_read(
    gpu: &Gpu,
    src: &CudaSlice<u8>,
    bytes: usize,
    sink: &mut CudaSlice<f32>,
) -> Result<()> {
    check_buffer("stream_read source", bytes, src.len())?;
    need_len("stream_read sink", SINK_WORDS, sink.len())?;
    gpu.bind()?;
    let s = gpu.stream();
    let (src_p, _g1) = src.device_ptr(s);
    let (sink_p, _g2) = sink.device_ptr_mut(s);
    // SAFETY: src holds `bytes` bytes (checked), sink SINK_WORDS floats; cudaMalloc'd memory is
    // 256-byte aligned.
    unsafe {
        launch::stream_read(
            src_p as *const c_void,
            bytes as i64,
            sink_p as *mut f32,
            s.cu_stream(),
        )
    }
}

/// Sum (mod 2^32) of the 32-bit words of `bytes` filled by [`stream_fill`] with `seed`: the
/// checksum a correct read of them leaves in a zeroed sink.
pub fn fill_word_sum(bytes: usize, seed: u32) -> u32 {
    // sum_{i<n} (seed + i * step) = n * seed + step * n (n - 1) / 2, all mod 2^32.
    let n = (bytes / 4) as u64;
    let tri = if n % 2 == 0 {
        (n / 2).wrapping_mul(n.wrapping_sub(1))
    } else {
        n.wrapping_mul((n - 1) / 2)
    };
    (n.wrapping_mul(seed as u64) as u32)
        .wrapping_add((tri as u32).wrapping_mul(sys::KVQ_STREAM_FILL_STEP))
}

/// Sum (mod 2^32) of a sink's words.
pub fn sink_sum(words: &[u32]) -> u32 {
    words.iter().fold(0u32, |a, &w| a.wrapping_add(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_word_sum_matches_a_direct_sum() {
        for (bytes, seed) in [
            (16usize, 0u32),
            (16, 7),
            (64, 0xDEAD_BEEF),
            (4096, 1),
            (1 << 20, 99),
        ] {
            let direct = (0..bytes / 4).fold(0u32, |a, i| {
                a.wrapping_add(
                    seed.wrapping_add((i as u32).wrapping_mul(sys::KVQ_STREAM_FILL_STEP)),
                )
            });
            assert_eq!(
                fill_word_sum(bytes, seed),
                direct,
                "{bytes} bytes, seed {seed}"
            );
        }
    }

    #[test]
    fn fill_word_sum_of_large_buffers_wraps_like_the_gpu() {
        // 4 GiB: n = 2^30 words, so n * seed and the triangle number overflow u32.
        let n: u128 = 1 << 30;
        let seed = 0x1234_5678u128;
        let exact = n * seed + sys::KVQ_STREAM_FILL_STEP as u128 * (n * (n - 1) / 2);
        assert_eq!(
            fill_word_sum(4 << 30, 0x1234_5678) as u128,
            exact % (1 << 32)
        );
    }
}
