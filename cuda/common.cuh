// common.cuh: kernel plumbing shared by the .cu files — vector loads and stores of 8 elements,
// warp reductions over the lanes of one quantization group, launcher status handling. No format
// math here (that is format.cuh).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "format.cuh"
#include "kvq.h"

namespace kvq {

// Elements one thread handles: 16 bytes of f16/bf16 input, one 16-byte load.
constexpr int kChunk = 8;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreadsPerBlock = 256;

// ---- 8-element vector I/O ----------------------------------------------------------------

// Load 8 consecutive elements as f32 (exact widening). `p` is 16-byte aligned. The input is
// read once, so the load is marked streaming (evict-first) to spare L2 for the cache pool.
__device__ __forceinline__ void load8(const __half *p, float (&v)[8]) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4 *>(p));
  const __half2 *h = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float (&v)[8]) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4 *>(p));
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float *p, float (&v)[8]) {
  const float4 a = __ldcs(reinterpret_cast<const float4 *>(p));
  const float4 b = __ldcs(reinterpret_cast<const float4 *>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// Widen 8 consecutive elements already in registers (16-byte aligned storage) to f32, exactly.
__device__ __forceinline__ void unpack8(const __half *p, float (&v)[8]) {
  const __half2 *h = reinterpret_cast<const __half2 *>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack8(const __nv_bfloat16 *p, float (&v)[8]) {
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack8(const float *p, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = p[i];
}

// Store 8 f32 values rounded (RNE) to the output type. `p` is 16-byte aligned.
__device__ __forceinline__ void store8(__half *p, const float (&v)[8]) {
  uint4 raw;
  uint32_t *w = reinterpret_cast<uint32_t *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)half_bits(v[2 * i]) | ((uint32_t)half_bits(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4 *>(p) = raw;
}
__device__ __forceinline__ void store8(__nv_bfloat16 *p, const float (&v)[8]) {
  uint4 raw;
  uint32_t *w = reinterpret_cast<uint32_t *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)bf16_bits(v[2 * i]) | ((uint32_t)bf16_bits(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4 *>(p) = raw;
}
__device__ __forceinline__ void store8(float *p, const float (&v)[8]) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---- reductions over the consecutive lanes of one group ------------------------------------
// LANES is a power of two ≤ 32 and groups start at lanes that are multiples of LANES. Every lane
// of the warp must call these (full-mask shuffles); lanes with no data pass neutral values.

template <int LANES> __device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int k = 1; k < LANES; k <<= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, k));
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

// ---- division by a launch-invariant divisor ---------------------------------------------------

// n / d for n < 2^31 and 1 <= d < 2^31 with one wide multiply instead of a division subroutine:
// m = ceil(2^(31 + l) / d) with l = ceil(log2 d) satisfies m * d - 2^(31 + l) < 2^l, which makes
// floor(n * m / 2^(31 + l)) == floor(n / d) for every 31-bit n (Granlund & Montgomery 1994).
struct FastDiv {
  uint32_t m, shift;

  FastDiv() = default;
  __host__ explicit FastDiv(uint32_t divisor) {
    uint32_t l = 0;
    while ((1ull << l) < divisor) ++l;
    m = (uint32_t)(((1ull << (31 + l)) + divisor - 1) / divisor);
    shift = 31 + l;
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (uint32_t)(((uint64_t)n * m) >> shift);
  }
};

// ---- launch helpers --------------------------------------------------------------------------

// Blocks of kThreadsPerBlock covering `threads` threads (a multiple of 32 is launched, so every
// warp is full and full-mask shuffles are valid).
inline unsigned blocks_for(int64_t threads) {
  return (unsigned)((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

// The message of the last failed launch on this host thread (kvq_last_error).
void set_last_error(cudaError_t e);

// Map the launch result to a kvq_status, remembering the CUDA error for kvq_last_error().
inline int launch_status() {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KVQ_OK;
  set_last_error(e);
  return KVQ_ERR_LAUNCH;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace kvq
