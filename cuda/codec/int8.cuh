// codec/int8.cuh: FORMATS.md "INT8 per token-head (`int8-pth`)": one two's-complement byte per
// element, one f32 scale s = amax / 127 per row (the row's metadata, little-endian).
#pragma once

#include <stdint.h>

#include "codec/format.cuh"
#include "prim/warp.cuh"

namespace kvq {

template <> struct Codec<kInt8Pth> {
  static constexpr int kBits = 8;
  static constexpr int kGroup = 0;      // the row is the group: its scale is row metadata
  static constexpr int kGroupMeta = 0;
  static constexpr int kRowMeta = 4;    // f32 scale per row
  static constexpr int kEpt = 16;       // one 16-byte vector of codes a thread
  // Served by the paged row kernels and prefill; not by the dense kernels (their scale arrays
  // are f16 per group) nor by the decode kernel (no fragment kind with a per-row scale).
  static constexpr bool kDense = false;
  static constexpr bool kHeadScale = false;
  static constexpr bool kPackedExtremes = false;
  // The scale's amax runs over the whole row: its lanes reduce (row_extremes), which needs a
  // row's lanes inside one warp: head_dim / kEpt must divide 32 (format_info's row_lanes).
  static constexpr bool kRowGroup = true;
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");

  // ---- row role ----

  static __device__ __forceinline__ Extremes extremes(const float (&v)[kEpt]) {
    return abs_max_extremes(v);
  }
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) { return own; }

  // The row's amax from each lane's own, the row being `lanes` consecutive lanes (a power of
  // two dividing 32, rows aligned to it). Every lane of the warp must call it.
  static __device__ __forceinline__ Extremes row_extremes(const Extremes &own, int lanes) {
    float hi = own.hi;
    for (int off = 1; off < lanes; off <<= 1) hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    return {0.0f, hi};
  }

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &,
                                                const Extremes &row, int chunk, const RowRef &r,
                                                bool active) {
    const float s = __fdiv_rn(row.hi, 127.0f);
    uint4 raw;
    uint8_t *b = reinterpret_cast<uint8_t *>(&raw);
#pragma unroll
    for (int i = 0; i < kEpt; ++i) {
      int q = 0;
      if (s != 0.0f) q = (int)fminf(fmaxf(rintf(__fdiv_rn(v(i), s)), -127.0f), 127.0f);
      b[i] = (uint8_t)(q & 0xFF);
    }
    if (active) {
      reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
      if (chunk == 0) *reinterpret_cast<float *>(r.scales) = s;
    }
  }

  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const int8_t *b = reinterpret_cast<const int8_t *>(&raw);
    const float s = *reinterpret_cast<const float *>(r.scales);
#pragma unroll
    for (int i = 0; i < kEpt; ++i) v[i] = __fmul_rn((float)b[i], s);
  }

  // ---- attention kernels: prefill decodes rows (decode, exact f32) into its operands; the
  // decode kernel has no per-row-scale fragment kind (kFusedDecode) ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = false;
  static constexpr bool kFusedDecode = false;
  static constexpr bool kBf16Operands = false;
};

}  // namespace kvq
