// prim/warp.cuh: reductions over the consecutive lanes of one group, and warp-aggregated counts.
#pragma once

#include <stdint.h>

namespace kvq {

constexpr unsigned kFullMask = 0xffffffffu;

// LANES is a power of two ≤ 32 and groups start at lanes that are multiples of LANES. Every lane
// of the warp must call these (full-mask shuffles); lanes with no data pass neutral values.

template <int LANES> __device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int k = 1; k < LANES; k <<= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, k));
  return v;
}

template <int LANES> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int k = 1; k < LANES; k <<= 1) v += __shfl_xor_sync(kFullMask, v, k);
  return v;
}

template <int LANES> __device__ __forceinline__ float group_min(float v) {
#pragma unroll
  for (int k = 1; k < LANES; k <<= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, k));
  return v;
}

// Add a per-thread count to a device counter with one atomic per warp. Counts are almost always
// zero, so a vote skips the reduction then.
__device__ __forceinline__ void warp_count(unsigned long long *counter, uint32_t n) {
  if (__any_sync(kFullMask, n != 0)) {
    const uint32_t total = __reduce_add_sync(kFullMask, n);
    if (counter != nullptr && (threadIdx.x & 31) == 0) atomicAdd(counter, total);
  }
}

}  // namespace kvq
