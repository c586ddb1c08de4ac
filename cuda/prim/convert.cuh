// prim/convert.cuh: exact conversions between f32 and the 16-bit element types, and their bits.
// Every narrowing is an explicit round-to-nearest-even intrinsic, whatever flags the including
// file is compiled with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kvq.h"

namespace kvq {

// Exact widening of the accepted input element types.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round-to-nearest-even narrowing to an output element type.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ uint16_t half_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float half_from_bits(uint16_t b) {
  return __half2float(__ushort_as_half(b));
}
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float bf16_from_bits(uint16_t b) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}

// Element i of an output of run-time type `dtype` (KVQ_DTYPE_BF16, _F16, else f32) set to x,
// rounded to nearest even.
__device__ __forceinline__ void store_out(void *p, int64_t i, float x, int32_t dtype) {
  if (dtype == KVQ_DTYPE_BF16)
    reinterpret_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(x);
  else if (dtype == KVQ_DTYPE_F16)
    reinterpret_cast<__half *>(p)[i] = __float2half_rn(x);
  else
    reinterpret_cast<float *>(p)[i] = x;
}

/// Elements i and i + 1 set to x and y as store_out does; as one store of the pair where
/// `paired` (i even and the output aligned to 8 bytes), else one by one.
__device__ __forceinline__ void store_out2(void *p, int64_t i, float x, float y, int32_t dtype,
                                          bool paired) {
  if (!paired) {
    store_out(p, i, x, dtype);
    store_out(p, i + 1, y, dtype);
  } else if (dtype == KVQ_DTYPE_BF16) {
    reinterpret_cast<__nv_bfloat162 *>(p)[i / 2] =
        __halves2bfloat162(__float2bfloat16_rn(x), __float2bfloat16_rn(y));
  } else if (dtype == KVQ_DTYPE_F16) {
    reinterpret_cast<__half2 *>(p)[i / 2] = __halves2half2(__float2half_rn(x), __float2half_rn(y));
  } else {
    reinterpret_cast<float2 *>(p)[i / 2] = make_float2(x, y);
  }
}

}  // namespace kvq
