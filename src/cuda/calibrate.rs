//! FP8 calibration on device tensors: [`crate::calibrate`]'s clipping values and scales,
//! computed where an engine's activations already are (a K or V projection's output over
//! calibration prompts), equal to the host's bit for bit.
//!
//! The clipping value of a head is the `r`-th smallest of its sanitized |x| values (`r` the
//! count for [`ClipMethod::Amax`], the nearest rank for a percentile); the device finds it
//! exactly, by a radix selection over the values' f32 bits (`cuda/calibrate.cu`). The result
//! comes back to the host, so these calls wait for the GPU's stream: calibration runs once,
//! before serving, not per step.

use super::ops::DeviceElement;
use super::{Gpu, driver_err, launch};
use crate::calibrate::ClipMethod;
use crate::error::{Error, Result};
use crate::format::Fp8Kind;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// The clipping value of each head of `x` (`[tokens, kv_heads, head_dim]` on the device, any
/// number of tokens, 0 included: then every value is 0) under `method`: what
/// [`crate::calibrate::head_clip`] returns for the same values. `x` is a `CudaSlice` or a
/// `CudaView` into a larger buffer, read on `gpu`'s stream; the call waits for that stream.
///
/// Errors: `kv_heads` or `head_dim` of 0 ([`Error::Config`]), `x.len()` not a multiple of
/// `kv_heads × head_dim` ([`Error::Length`]), a percentile outside (0, 100]
/// ([`Error::InvalidArgument`]), more than 65535 heads or `i32` head_dim ([`Error::Config`]),
/// and the driver's errors.
pub fn head_clip<T: DeviceElement>(
    gpu: &Gpu,
    x: &impl DevicePtr<T>,
    kv_heads: usize,
    head_dim: usize,
    method: ClipMethod,
) -> Result<Vec<f32>> {
    for (what, value, max) in [
        ("kv_heads", kv_heads, 65535),
        ("head_dim", head_dim, i32::MAX as usize),
    ] {
        if value == 0 || value > max {
            return Err(Error::Config {
                what,
                value,
                expected: "at least 1 (at most 65535 heads, i32::MAX elements a head)",
            });
        }
    }
    let method = method.check()?;
    let row = kv_heads.checked_mul(head_dim).ok_or(Error::Overflow {
        what: "calibration token row (kv_heads × head_dim)",
        lhs: kv_heads,
        rhs: head_dim,
    })?;
    let tokens = x.len() / row;
    if tokens * row != x.len() {
        return Err(Error::Length {
            what: "calibration data ([tokens, kv_heads, head_dim])",
            expected: x.len().div_ceil(row) * row,
            actual: x.len(),
        });
    }
    if tokens == 0 {
        return Ok(vec![0.0; kv_heads]);
    }
    // The amax is the largest value: the rank of the count.
    let n = tokens * head_dim;
    let rank = method.below_max_rank(n).unwrap_or(n);
    gpu.bind()?;
    let s = gpu.stream();
    let mut clip = s
        .alloc_zeros::<f32>(kv_heads)
        .map_err(driver_err("allocating clipping values"))?;
    let bytes = launch::head_clip_scratch_bytes(kv_heads as i32);
    let mut scratch = s
        .alloc_zeros::<u64>(bytes.div_ceil(8))
        .map_err(driver_err("allocating calibration scratch"))?;
    {
        let (x_p, _g1) = x.device_ptr(s);
        let (c_p, _g2) = clip.device_ptr_mut(s);
        let (s_p, _g3) = scratch.device_ptr_mut(s);
        // SAFETY: x holds tokens × kv_heads × head_dim elements of T (checked above), clip
        // kv_heads f32, scratch the bytes kvq_head_clip_scratch_bytes asks for, 8-aligned;
        // rank lies in 1..=n.
        unsafe {
            launch::head_clip(
                x_p as *const c_void,
                T::DTYPE.raw(),
                (tokens * kv_heads) as i64,
                kv_heads as i32,
                head_dim as i32,
                rank as i64,
                c_p as *mut f32,
                s_p as *mut c_void,
                s.cu_stream(),
            )?;
        }
    }
    s.clone_dtoh(&clip)
        .map_err(driver_err("reading clipping values back"))
}

/// The FP8 `kind` scale of each head of `x` on the device: [`head_clip`] divided by
/// `kind.max_finite()`, 1.0 where that is 0 ([`crate::calibrate::fp8_head_scales`]'s values,
/// for `DeviceCache::set_scales`). Errors as for [`head_clip`].
pub fn fp8_head_scales<T: DeviceElement>(
    gpu: &Gpu,
    x: &impl DevicePtr<T>,
    kv_heads: usize,
    head_dim: usize,
    kind: Fp8Kind,
    method: ClipMethod,
) -> Result<Vec<f32>> {
    let clip = head_clip(gpu, x, kv_heads, head_dim, method)?;
    Ok(clip.into_iter().map(|c| kind.scale_from_amax(c)).collect())
}
