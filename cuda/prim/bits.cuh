// prim/bits.cuh: register bit manipulation: byte permutes, three-input logic, f16x2 views.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace kvq {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

/// (x & M) ^ C in one LOP3.
template <uint32_t M>
__device__ __forceinline__ uint32_t and_xor(uint32_t x, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(x), "n"(M), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ __half2 bits_h2(uint32_t u) {
  return *reinterpret_cast<__half2 *>(&u);
}

}  // namespace kvq
