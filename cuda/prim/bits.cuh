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

/// Byte i of `w` as an f16 pair of exact integers 1024 + (n ^ flip): its low nibble n in the low
/// half, its high nibble in the high half (`w4` is w >> 4, shared by a word's four bytes; flip is
/// 0, or 8 to turn a two's-complement nibble into an offset one). One PRMT and one LOP3.
template <int I, uint32_t FLIP>
__device__ __forceinline__ uint32_t nibble_pair_f16(uint32_t w, uint32_t w4) {
  static_assert(I >= 0 && I < 4 && FLIP < 16, "a byte of the word, a nibble's flip");
  // Bytes 0, 1: byte I of w; bytes 2, 3: byte I of w4 (the high nibble low).
  const uint32_t t = prmt(w, w4, I | (I << 4) | ((I + 4) << 8) | ((I + 4) << 12));
  return and_xor<0x000F000Fu>(t, 0x64006400u | (FLIP * 0x00010001u));
}

/// Byte I of `lo` and of `hi` as an f16 pair of subnormals n * 2^-24 (exact: a subnormal's bits
/// are its integer), `lo`'s low. The bytes must be below 0x80: the zero high bytes are the sign of
/// a byte replicated (PRMT's sign mode). `lo` and `hi` are a word's low and high nibbles as bytes
/// (x & 0x0F0F0F0F and (x >> 4) & 0x0F0F0F0F, each optionally flipped), so that byte I's pair is
/// element 2 I and 2 I + 1. One PRMT.
template <int I>
__device__ __forceinline__ uint32_t nibble_pair_subnormal(uint32_t lo, uint32_t hi) {
  static_assert(I >= 0 && I < 4, "a byte of the word");
  constexpr uint32_t kSel = I | ((8 | I) << 4) | ((4 + I) << 8) | ((12 + I) << 12);
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "n"(kSel));
  return d;
}

/// The largest |s| whose s * 2^9 is a finite f16 (65504 / 512): the INT4 codecs' operand decode
/// takes the subnormal pairs above for scales up to it, as n * 2^-9 (times 2^15, exact) times
/// s * 2^9 (exact).
constexpr float kSubnormalScaleMax = 127.9375f;

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ __half2 bits_h2(uint32_t u) {
  return *reinterpret_cast<__half2 *>(&u);
}

/// Call unpack(bits) with bits(v) giving an f16 pair's bits: as they are where `in_range` (no
/// value unpack makes can pass +-65504), else clamped to +-65504.
template <class Unpack>
__device__ __forceinline__ void unpack_f16_clamped_unless(bool in_range, Unpack &&unpack) {
  if (in_range) {
    unpack([](__half2 v) { return h2_bits(v); });
  } else {
    const __half2 lim = __float2half2_rn(65504.0f);
    unpack([&](__half2 v) { return h2_bits(__hmin2(__hmax2(v, __hneg2(lim)), lim)); });
  }
}

}  // namespace kvq
