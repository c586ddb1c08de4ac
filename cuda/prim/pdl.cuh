// prim/pdl.cuh: programmatic dependent launch (sm_90). A kernel lets the next kernel of its
// stream (launched with programmatic stream serialization) start launching before it ends; that
// kernel waits for it before reading what it wrote. Both are no-ops before sm_90.
#pragma once

namespace kvq {

/// The stream's next kernel may begin launching once every block of this grid has called this
/// (or exited); its blocks take SMs as this grid's blocks leave them.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Wait until the grids this one depends on have completed and their writes are visible
/// (returns at once in a kernel launched without programmatic stream serialization).
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace kvq
