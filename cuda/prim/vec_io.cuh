// prim/vec_io.cuh: vector loads and stores: 8 elements of global memory as f32 (the append and
// dense kernels), and 2..16 bytes of shared memory as 32-bit words (the decode kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "prim/convert.cuh"

namespace kvq {

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

// ---- shared-memory loads as 32-bit words ---------------------------------------------------

/// Load BYTES (16, 8, 12, 4 or 2) from shared memory aligned to the widest of those that
/// divides BYTES, as 32-bit words (2 bytes: the low half of one word).
template <int BYTES>
__device__ __forceinline__ void lds(const uint8_t *p, uint32_t (&w)[BYTES >= 4 ? BYTES / 4 : 1]) {
  if constexpr (BYTES == 16) {
    const uint4 v = *reinterpret_cast<const uint4 *>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = *reinterpret_cast<const uint2 *>(p);
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (BYTES == 2) {
    w[0] = *reinterpret_cast<const uint16_t *>(p);
  } else {
    static_assert(BYTES % 4 == 0, "load width");
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) w[i] = reinterpret_cast<const uint32_t *>(p)[i];
  }
}

/// Load a metadata row of BYTES (a multiple of 2) as 32-bit words, element i of the row in bits
/// 16 (i % 2) of word i / 2: word loads when BYTES is a multiple of 4 (rows aligned to 4), else
/// 2-byte loads (rows of 6 bytes: INT4 keys at head_dim 96).
template <int BYTES>
__device__ __forceinline__ void lds_meta(const uint8_t *p, uint32_t (&w)[(BYTES + 3) / 4]) {
  if constexpr (BYTES % 4 == 0) {
    lds<BYTES>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < BYTES / 2; ++i)
      w[i / 2] |= (uint32_t)reinterpret_cast<const uint16_t *>(p)[i] << (16 * (i % 2));
  }
}

/// Start fetching the 128-byte line holding `p` into this SM's L1 (a hint: nothing waits for it,
/// and it cannot fault on a valid address).
__device__ __forceinline__ void prefetch_l1(const void *p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/// Start fetching the 128-byte line holding `p` into L2 (a hint, as prefetch_l1).
__device__ __forceinline__ void prefetch_l2(const void *p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

}  // namespace kvq
