//! [`DecodeWorkspace`]: device memory for the split-KV partial results of a [`DecodePlan`],
//! sized once for the plan's capacity and reused by every launch (one launch at a time).

use super::DecodePlan;
use crate::cuda::{Gpu, driver_err, owned_ptr};
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUdeviceptr;

/// Partial outputs, log-sum-exps and merge counters of split launches, for every batch and
/// `q_len` a plan serves.
#[derive(Debug)]
pub struct DecodeWorkspace {
    gpu: Gpu,
    /// Partial outputs, partial log-sum-exps, split counters: held for their memory, used by
    /// the kernel through `ptrs` (see [`owned_ptr`]).
    _buffers: (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u32>),
    pub(super) ptrs: [CUdeviceptr; 3],
    pub(super) elems: (usize, usize, usize),
}

impl DecodeWorkspace {
    /// Allocate the workspace of `plan` on its GPU and stream. One workspace serves every
    /// layer's launches of the plan in turn on that stream (in a captured graph too), not two
    /// launches at once.
    pub fn new(plan: &DecodePlan) -> Result<Self> {
        let elems = plan.workspace_elems();
        let gpu = plan.gpu().clone();
        gpu.bind()?;
        let s = gpu.stream();
        // SAFETY: the kernel writes every partial it later reads (the merge reads only splits
        // of the same launch); the counters start zeroed and each launch leaves them zero.
        let o = unsafe { s.alloc::<f32>(elems.0.max(1)) }
            .map_err(driver_err("allocating the decode workspace"))?;
        // SAFETY: as above.
        let lse = unsafe { s.alloc::<f32>(elems.1.max(1)) }
            .map_err(driver_err("allocating the decode workspace"))?;
        let counters = s
            .alloc_zeros::<u32>(elems.2.max(1))
            .map_err(driver_err("allocating the decode workspace"))?;
        let ptrs = [owned_ptr(&o), owned_ptr(&lse), owned_ptr(&counters)];
        Ok(DecodeWorkspace {
            gpu,
            _buffers: (o, lse, counters),
            ptrs,
            elems,
        })
    }

    /// The handle whose stream the workspace was made on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Elements of each part: f32 partial outputs, f32 log-sum-exps, u32 counters.
    pub fn elems(&self) -> (usize, usize, usize) {
        self.elems
    }

    /// Device addresses of the partial outputs, partial lse and split counters.
    pub(crate) fn device_ptrs(&self) -> [CUdeviceptr; 3] {
        self.ptrs
    }

    pub(crate) fn check(&self, plan: &DecodePlan) -> Result<()> {
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
