// prim/mma.cuh: warp-level tensor-core operations (sm_80+): mma.sync m16n8k16, ldmatrix (plain
// and transposed), movmatrix, and the packing of f32 pairs into their 16-bit operands.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "prim/bits.cuh"

namespace kvq {

/// Two f32 → one packed register of the mma operand type (low half = `lo`).
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return h2_bits(v);
  }
}

/// d += a * b, m16n8k16, f32 accumulate; `a` holds the four A registers.
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint4 &a, uint32_t b0,
                                         uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  }
}

/// The transpose of an 8x8 matrix of 16-bit elements held as an mma C fragment (lane g*4 + t
/// holds row g, columns 2t and 2t+1), in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

/// Four 8x8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the row
/// addresses (16 bytes each) of matrix i; lane g*4 + t gets word t of row g of matrix i in d[i].
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

/// ldmatrix_x4 with each matrix transposed: lane g*4 + t gets elements (2t, g) and (2t + 1, g)
/// of matrix i in d[i] (rows given by lanes 8i..8i+7 as before).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

/// Two 8x8 matrices (lanes 0..15 give the row addresses), as ldmatrix_x4's first two.
__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t (&d)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(d[0]), "=r"(d[1])
               : "r"(addr));
}

}  // namespace kvq
