//! GPU path (feature `cuda`): device cache, append / dequantize / fused decode kernels.
//!
//! - [`Gpu`]: one device, its context and the stream every kvq launch goes to.
//! - [`DeviceCache`]: one layer's pool in device memory, the same bytes as a
//!   [`HostCache`](crate::cache::HostCache).
//! - [`ops`]: safe launches (validate, then call the C ABI in [`sys`]), plus `unsafe`
//!   raw-pointer entry points for engines that own their memory.
//!
//! The CUDA driver is loaded at run time: a binary built with `cuda` starts on a machine without
//! a GPU or driver, [`is_available`] says `false` and [`Gpu::new`] returns [`Error::NoDevice`].

#[cfg(feature = "bench")]
pub mod bench;
pub mod decode;
pub mod device;
pub mod ops;
pub mod sys;

pub use device::{AppendCounters, DeviceCache};

/// The cudarc kvq is built on. Name cudarc's types (`CudaSlice`, `CudaStream`, ...) through
/// `kvq::cuda::cudarc` and they are always the ones kvq's API takes, whatever cudarc version
/// the engine itself depends on.
pub use cudarc;

use crate::error::{Error, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream, DriverError};
use std::sync::Arc;

/// Targets the kernels were compiled for (`KVQ_CUDA_ARCHS`), e.g. `sm_80,sm_89,sm_90a,compute_90`.
pub const ARCHS_BUILT: &str = env!("KVQ_CUDA_ARCHS_BUILT");

/// Properties of a device, read once when a [`Gpu`] is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProps {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Number of streaming multiprocessors.
    pub sm_count: u32,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (u32, u32),
    /// L2 cache size in bytes.
    pub l2_bytes: usize,
    /// Global memory in bytes.
    pub total_memory: usize,
}

/// One GPU: a retained primary context and the stream kvq's launches and copies are ordered on.
/// Cheap to clone (shared handles).
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    props: DeviceProps,
}

/// A cudarc driver error as [`Error::Cuda`], naming what failed.
/// Device address of a buffer the crate owns and uses only on the stream it was allocated on,
/// taken once. Launches through such addresses skip cudarc's per-use event bookkeeping (an
/// event wait and an event record per buffer and call), which orders nothing on one stream.
pub(crate) fn owned_ptr<T>(buf: &cudarc::driver::CudaSlice<T>) -> cudarc::driver::sys::CUdeviceptr {
    use cudarc::driver::DevicePtr;
    let (p, _guard) = buf.device_ptr(buf.stream());
    p
}

pub(crate) fn driver_err(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Map a `kvq_status` returned by launcher `what` to a result.
pub(crate) fn check_status(status: std::ffi::c_int, what: &str) -> Result<()> {
    match status {
        sys::KVQ_OK => Ok(()),
        sys::KVQ_ERR_INVALID => Err(Error::Cuda(format!(
            "{what}: the launcher rejected its arguments (kvq bug: ops.rs should have caught this)"
        ))),
        sys::KVQ_ERR_UNSUPPORTED => Err(Error::Unsupported(format!(
            "{what}: no kernel for this combination in this build"
        ))),
        sys::KVQ_ERR_LAUNCH => {
            // SAFETY: kvq_last_error returns a static NUL-terminated string.
            let msg = unsafe { std::ffi::CStr::from_ptr(sys::kvq_last_error()) };
            Err(Error::Cuda(format!(
                "{what}: kernel launch failed: {}",
                msg.to_string_lossy()
            )))
        }
        other => Err(Error::Cuda(format!("{what}: unknown status {other}"))),
    }
}

/// Number of CUDA devices, or why there is none. Never panics: the driver library is probed
/// before cudarc touches it (cudarc panics when libcuda is absent).
fn device_count() -> std::result::Result<usize, String> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) was not found".into());
    }
    // A missing symbol in an old driver panics inside cudarc; report it instead.
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(n as usize),
        Ok(Ok(_)) => Err("the CUDA driver reports no device".into()),
        Ok(Err(e)) => Err(format!("the CUDA driver failed to initialise: {e}")),
        Err(_) => Err("the CUDA driver library is unusable (missing symbols?)".into()),
    }
}

/// Whether a CUDA driver and at least one device are present. Never panics.
pub fn is_available() -> bool {
    device_count().is_ok()
}

impl Gpu {
    /// Open device `ordinal`: retain its primary context and create a stream.
    /// [`Error::NoDevice`] when there is no driver or no such device.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let count = device_count().map_err(Error::NoDevice)?;
        if ordinal >= count {
            return Err(Error::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("opening the CUDA context"))?;
        let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
        let attr = |a: CUdevice_attribute| -> Result<i32> {
            ctx.attribute(a)
                .map_err(driver_err("reading a device attribute"))
        };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let props = DeviceProps {
            ordinal,
            name: ctx.name().map_err(driver_err("reading the device name"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            compute_capability: (major as u32, minor as u32),
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            total_memory: ctx
                .total_mem()
                .map_err(driver_err("reading total memory"))?,
        };
        Ok(Gpu { ctx, stream, props })
    }

    /// The device's properties.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every kvq launch and copy of this `Gpu` is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The raw stream, for the C launchers (`void *stream`).
    pub(crate) fn raw_stream(&self) -> *mut std::ffi::c_void {
        self.stream.cu_stream().cast()
    }

    /// Make this device's context current on the calling thread (the CUDA runtime, which the
    /// launchers use, picks up the current context).
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("binding the CUDA context"))
    }

    /// Wait until all work queued on [`stream`](Self::stream) has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronizing the stream"))
    }

    /// One line describing the device, for `kvq info`.
    pub fn summary(&self) -> String {
        let p = &self.props;
        format!(
            "GPU {}: {}, sm_{}{}, {} SMs, {} MiB L2, {:.1} GiB",
            p.ordinal,
            p.name,
            p.compute_capability.0,
            p.compute_capability.1,
            p.sm_count,
            p.l2_bytes >> 20,
            p.total_memory as f64 / (1u64 << 30) as f64
        )
    }
}

/// Lines for `kvq info`: the kernels' build targets and one line per device (or why there is
/// none). Never panics.
pub fn device_summary() -> Vec<String> {
    let mut lines = vec![format!("kernels built for: {ARCHS_BUILT}")];
    match device_count() {
        Err(why) => lines.push(format!("no CUDA device: {why}")),
        Ok(n) => {
            for i in 0..n {
                lines.push(match Gpu::new(i) {
                    Ok(g) => g.summary(),
                    Err(e) => format!("GPU {i}: {e}"),
                });
            }
        }
    }
    lines
}

/// For GPU tests: device 0, or `None` after printing `SKIPPED: no GPU` when there is none.
/// With `KVQ_REQUIRE_GPU=1` a missing GPU panics instead, so it cannot pass silently where a
/// GPU is expected.
pub fn require_gpu_or_skip(test_name: &str) -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var("KVQ_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test_name}: KVQ_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: no GPU ({test_name}: {e})");
            None
        }
    }
}
