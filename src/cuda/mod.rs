//! GPU path (feature `cuda`): device cache, append / dequantize / fused decode kernels.
//!
//! - [`Gpu`]: one device, its context and the stream every kvq launch goes to.
//! - [`DeviceCache`](device::DeviceCache): one layer's pool in device memory, the same bytes as a
//!   [`HostCache`](crate::cache::HostCache).
//! - [`ops`]: safe launches (validate, then call the C ABI in [`sys`]), plus `unsafe`
//!   raw-pointer entry points for engines that own their memory.
//!
//! The CUDA driver is loaded at run time: a binary built with `cuda` starts on a machine without
//! a GPU or driver, [`is_available`] says `false` and [`Gpu::new`] returns [`Error::NoDevice`].

pub mod bench;
mod blocks;
pub mod decode;
pub mod device;
pub(crate) mod launch;
pub mod ops;
pub mod probe;
pub mod sys;
mod tables;

pub use blocks::SwapSpace;
pub use cudarc;
pub use decode::{DecodePlan, DecodeStep, DecodeWorkspace, RowStrides};
pub use device::{AppendCounters, DeviceCache};
pub use tables::DeviceBlockTables;

use crate::error::{Error, Result};
use cudarc::driver::sys::{CUcontext, CUdevice, CUdevice_attribute, CUstream};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
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

/// One GPU: a context and the stream kvq's launches and copies made through this handle are
/// queued on — kvq's own ([`Gpu::new`]) or the engine's ([`Gpu::from_stream`],
/// [`Gpu::from_raw`]). Cheap to clone (shared handles). Objects made from handles of different
/// streams (a cache, a plan, block tables) can be used together: kvq orders their streams with
/// events (see [`Gpu::wait_for`]).
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    props: Arc<DeviceProps>,
    /// Recorded on `stream` when another stream must wait for it (see [`Gpu::wait_for`]).
    order_event: Arc<CudaEvent>,
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
    /// Open device `ordinal`: retain its primary context and create a stream of kvq's own.
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
        Self::from_stream(stream)
    }

    /// Every kvq launch and copy made through this handle goes to `stream`, an engine's own
    /// cudarc stream (candle's, for instance), so kvq's work is ordered with the engine's
    /// without any synchronization.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Gpu> {
        let ctx = stream.context().clone();
        let attr = |a: CUdevice_attribute| -> Result<i32> {
            ctx.attribute(a)
                .map_err(driver_err("reading a device attribute"))
        };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let props = DeviceProps {
            ordinal: ctx.ordinal(),
            name: ctx.name().map_err(driver_err("reading the device name"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            compute_capability: (major as u32, minor as u32),
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            total_memory: ctx
                .total_mem()
                .map_err(driver_err("reading total memory"))?,
        };
        let order_event = ctx
            .new_event(None)
            .map_err(driver_err("creating an ordering event"))?;
        Ok(Gpu {
            ctx,
            stream,
            props: Arc::new(props),
            order_event: Arc::new(order_event),
        })
    }

    /// A handle on a context and stream the engine owns (from the CUDA runtime, another
    /// library or its own driver calls). kvq never destroys either: the engine keeps both alive
    /// while this handle or anything made with it is in use. The primary context of a device
    /// is shared with cudarc's own handle of it; any other context is wrapped and never
    /// released.
    ///
    /// # Safety
    /// `context` is a live CUDA context and `stream` a live stream of it (or null, the
    /// context's legacy default stream).
    pub unsafe fn from_raw(context: CUcontext, stream: CUstream) -> Result<Gpu> {
        device_count().map_err(Error::NoDevice)?;
        if context.is_null() {
            return Err(Error::InvalidArgument(
                "Gpu::from_raw: the context is null".into(),
            ));
        }
        let mut device: CUdevice = 0;
        // SAFETY: the caller promises a live context; binding it and asking its device reads
        // nothing else.
        unsafe {
            cudarc::driver::result::ctx::set_current(context)
                .map_err(driver_err("binding the engine's context"))?;
            cudarc::driver::sys::cuCtxGetDevice(&mut device)
                .result()
                .map_err(driver_err("reading the context's device"))?;
        }
        let ordinal = usize::try_from(device)
            .map_err(|_| Error::Cuda(format!("the context's device id {device} is negative")))?;
        let primary = CudaContext::new(ordinal).map_err(driver_err("opening the CUDA context"))?;
        let ctx = if primary.cu_ctx() == context {
            primary
        } else {
            drop(primary);
            // SAFETY: a live context of `device` (the caller's promise).
            let ctx = unsafe { CudaContext::from_raw_context(ordinal, device, context) }
                .map_err(driver_err("wrapping the engine's context"))?;
            // cudarc destroys a wrapped context when its last handle goes; the engine owns this
            // one, so one handle is leaked on purpose and the context outlives kvq's use.
            std::mem::forget(ctx.clone());
            ctx
        };
        // SAFETY: a live stream of that context (the caller's promise); cudarc never destroys
        // a borrowed stream.
        let stream = unsafe { ctx.wrap_borrowed_stream(stream) };
        Self::from_stream(stream)
    }

    /// Whether `other` queues its work on the same stream (work of one stream needs no
    /// ordering between objects).
    pub fn same_stream(&self, other: &Gpu) -> bool {
        self.stream.cu_stream() == other.stream.cu_stream()
    }

    /// Make this handle's stream wait for all work queued on `other`'s stream so far (an event
    /// recorded there, waited for here). Nothing happens when both are the same stream.
    pub fn wait_for(&self, other: &Gpu) -> Result<()> {
        if self.same_stream(other) {
            return Ok(());
        }
        if self.ctx.cu_ctx() != other.ctx.cu_ctx() {
            return Err(Error::InvalidArgument(format!(
                "objects of GPU {} and GPU {} cannot be used in one operation",
                self.props.ordinal, other.props.ordinal
            )));
        }
        other
            .order_event
            .record(&other.stream)
            .map_err(driver_err("recording an ordering event"))?;
        self.stream
            .wait(&other.order_event)
            .map_err(driver_err("waiting for another stream"))
    }

    /// [`Error::InvalidArgument`] instead of a broken capture when this stream is capturing a
    /// CUDA graph while cudarc tracks buffer events on the context: cudarc then makes the
    /// stream wait on events recorded before the capture, which invalidates it. Engines that
    /// capture turn tracking off (`unsafe { ctx.disable_event_tracking() }`, before allocating
    /// the buffers they capture) and order their streams themselves; kvq's own objects never
    /// need it.
    pub(crate) fn check_capture(&self) -> Result<()> {
        if !self.ctx.is_managing_stream_synchronization() {
            return Ok(());
        }
        let status = self
            .stream
            .capture_status()
            .map_err(driver_err("reading the stream's capture status"))?;
        if status == cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        Err(Error::InvalidArgument(
            "CUDA graph capture on a context with cudarc's event tracking on (cudarc would wait \
             on events recorded outside the capture and break it): call \
             `unsafe { gpu.context().disable_event_tracking() }` before allocating the buffers \
             you capture"
                .into(),
        ))
    }

    /// Run `launch` on this handle's stream, ordered after the work queued so far on the
    /// streams of `others`, and make those streams wait for it in turn (so that neither reads
    /// what the other has not finished writing). Objects of one stream cost nothing; objects of
    /// several streams cost two event records and waits per other stream, and cannot be
    /// captured in a CUDA graph (an event from outside the capture).
    pub(crate) fn ordered<R>(
        &self,
        others: &[&Gpu],
        launch: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let mut distinct: Vec<&Gpu> = Vec::new();
        for g in others {
            if !self.same_stream(g) && !distinct.iter().any(|d| d.same_stream(g)) {
                distinct.push(g);
            }
        }
        for g in &distinct {
            self.wait_for(g)?;
        }
        let r = launch()?;
        for g in &distinct {
            g.wait_for(self)?;
        }
        Ok(r)
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
