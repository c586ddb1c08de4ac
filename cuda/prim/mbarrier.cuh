// prim/mbarrier.cuh: shared-memory barriers (mbarrier, sm_90) that hand pipeline stages between
// warps without a block-wide barrier, and the register hand-over of warp-specialized blocks.
#pragma once

#include <stdint.h>

#include "prim/cp_async.cuh"

namespace kvq {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

/// Initialize a barrier whose phase completes after `count` arrivals; the block must then
/// synchronize (fence_mbarrier_init and a barrier) before any thread uses it.
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/// One arrival (release: this thread's earlier writes are visible to the waiters) on the barrier
/// at shared address `bar` (a loop keeps its barriers' addresses: converting a pointer costs
/// instructions every time).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) { mbar_arrive(smem_u32(bar)); }

/// One arrival that also raises the bytes the current phase waits for (bulk copies complete
/// them as transactions).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

/// Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this
/// CTA's shared memory as one bulk copy (cp.async.bulk, async proxy), counted on `bar` as
/// transaction bytes when it lands.
__device__ __forceinline__ void bulk_to_shared(void *dst, const void *src, uint32_t bytes,
                                               uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

/// Whether the phase of parity `parity` has completed (acquire), after the hardware's own
/// bounded wait.
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, unsigned parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/// Wait (acquire) until the phase of parity `parity` has completed: mbar_try_wait in a loop of
/// PTX (as a C++ loop around it, ptxas kept more registers live across it and spilled).
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "KVQ_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra KVQ_MBAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
  mbar_wait(smem_u32(bar), parity);
}

#endif  // __CUDA_ARCH__ >= 900

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/// Give up registers (a producer warpgroup) or take them (consumers): every warp of the
/// warpgroup executes it with the same count, a multiple of 8 in 24..256.
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif

}  // namespace kvq
