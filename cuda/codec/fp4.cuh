// codec/fp4.cuh: FORMATS.md "FP4 E2M1 (`fp4-e2m1`)": E2M1 codes two per byte (element 2i in the
// low nibble), an E4M3 block scale byte per 16 elements (the row's metadata), and an f32 global
// scale g per KV head outside the rows (as FP8's head scale).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "codec/format.cuh"
#include "prim/bits.cuh"

namespace kvq {

// The largest E2M1 value under the largest E4M3 block scale, 448 * 6: the global scale's
// calibration maps amax to it.
constexpr float kFp4GlobalMax = 2688.0f;

// E2M1 of y (never NaN): nearest grid value, ties to the even mantissa, saturating at 6; a
// result of magnitude 0 is +0 (0x0, never 0x8).
__device__ __forceinline__ uint32_t e2m1_encode(float y) {
  const float a = fabsf(y);
  const uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                     (a >= 3.5f) + (a > 5.0f);
  return (y < 0.0f && m != 0u) ? (m | 8u) : m;
}

// Value of an E2M1 code (low 4 bits) as f16 bits: exact.
__device__ __forceinline__ uint32_t e2m1_half_bits(uint32_t c) {
  // High bytes of the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as f16 (the low bytes are 0).
  constexpr uint64_t kHigh = 0x464442403E3C3800ull;
  const uint32_t mag = (uint32_t)(kHigh >> (8u * (c & 7u))) & 0xFFu;
  return (mag << 8) | ((c & 8u) << 12);
}

// Value of an E2M1 code as f32: exact.
__device__ __forceinline__ float e2m1_value(uint32_t c) {
  return __half2float(__ushort_as_half((unsigned short)e2m1_half_bits(c)));
}

// Value of an E4M3 byte as f32: exact.
__device__ __forceinline__ float e4m3_value(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

template <> struct Codec<kFp4E2m1> {
  static constexpr int kBits = 4;
  static constexpr int kGroup = 16;
  static constexpr int kGroupMeta = 1;  // an E4M3 byte
  static constexpr int kRowMeta = 0;
  static constexpr int kEpt = 32;       // two whole groups a thread: no reduction across lanes
  static constexpr int kGroups = kEpt / kGroup;
  // Served by the paged row kernels and prefill; not by the dense kernels (their scale arrays
  // are f16 per group) nor by the decode kernel (no fragment kind for E4M3-scaled groups).
  static constexpr bool kDense = false;
  static constexpr bool kHeadScale = true;  // g, per KV head
  static constexpr bool kPackedExtremes = false;
  static constexpr bool kRowGroup = false;
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");

  // ---- row role: each thread's groups are its own, so no extremes travel ----

  static __device__ __forceinline__ Extremes extremes(const float (&)[kEpt]) {
    return {0.0f, 0.0f};
  }
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) { return own; }

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &,
                                                const Extremes &, int chunk, const RowRef &r,
                                                bool active) {
    const float g = active ? r.head_scale : 1.0f;  // idle lanes: any valid scale
    uint4 raw = make_uint4(0, 0, 0, 0);
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    uint8_t sb[kGroups];
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) amax = fmaxf(amax, fabsf(v(k * kGroup + i)));
      const float u = __fdiv_rn(__fdiv_rn(amax, 6.0f), g);
      sb[k] = (uint8_t)__nv_cvt_float_to_fp8(u, __NV_SATFINITE, __NV_E4M3);
      const float d = __fmul_rn(e4m3_value(sb[k]), g);
      if (d != 0.0f) {
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          const int e = k * kGroup + i;
          w[e / 8] |= e2m1_encode(__fdiv_rn(v(e), d)) << (4 * (e % 8));
        }
      }
    }
    if (active) {
      reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
      uint8_t *meta = reinterpret_cast<uint8_t *>(r.scales);
#pragma unroll
      for (int k = 0; k < kGroups; ++k) meta[chunk * kGroups + k] = sb[k];
    }
  }

  // (value(c) * value(sb)) * g, in this order; RowRef::head_scale is g (1 where the kernel
  // applies g elsewhere).
  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw);
    const uint8_t *meta = reinterpret_cast<const uint8_t *>(r.scales);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const float sb = e4m3_value(meta[chunk * kGroups + k]);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const int e = k * kGroup + i;
        const float c = e2m1_value((w[e / 8] >> (4 * (e % 8))) & 0xFu);
        v[e] = __fmul_rn(__fmul_rn(c, sb), r.head_scale);
      }
    }
  }

  /// The chunk's values without g as f16 pairs (element 2i low in h[i]): value(c) * value(sb)
  /// is exact in f16 (2 and 4 significant bits, 2^-10..2688). For operand tiles (prefill,
  /// which applies g to S and O as FP8's scale).
  static __device__ __forceinline__ void decode_f16(const RowRef &r, int chunk,
                                                    uint32_t (&h)[kEpt / 2]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw);
    const uint8_t *meta = reinterpret_cast<const uint8_t *>(r.scales);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const __half s = __half(__nv_cvt_fp8_to_halfraw(meta[chunk * kGroups + k], __NV_E4M3));
      const __half2 s2 = __half2half2(s);
#pragma unroll
      for (int i = 0; i < kGroup / 2; ++i) {
        const int e = k * kGroup + 2 * i;
        const uint32_t b = (w[e / 8] >> (4 * (e % 8))) & 0xFFu;
        const uint32_t x = e2m1_half_bits(b & 0xFu) | (e2m1_half_bits(b >> 4) << 16);
        h[e / 2] = h2_bits(__hmul2(bits_h2(x), s2));
      }
    }
  }

  // Calibration of the dense path's global scale: amax / 2688, 1 when that is 0.
  static __device__ __forceinline__ float scale_from_amax(float amax) {
    const float g = __fdiv_rn(amax, kFp4GlobalMax);
    return g == 0.0f ? 1.0f : g;
  }

  // ---- attention kernels: prefill decodes rows into its operands (g on S and O); the decode
  // kernel has no fragment kind for E4M3-scaled groups (kFusedDecode) ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = false;
  static constexpr bool kFusedDecode = false;
  static constexpr bool kBf16Operands = false;
};

}  // namespace kvq
