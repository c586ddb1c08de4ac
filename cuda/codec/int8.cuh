// codec/int8.cuh: FORMATS.md "INT8 per token-head (`int8-pth`)": one two's-complement byte per
// element, one f32 scale s = amax / 127 per row (the row's metadata, little-endian).
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/warp.cuh"

namespace kvq {

template <> struct Codec<kInt8Pth> {
  static constexpr int kBits = 8;
  static constexpr int kGroup = 0;      // the row is the group: its scale is row metadata
  static constexpr int kGroupMeta = 0;
  static constexpr int kRowMeta = 4;    // f32 scale per row
  static constexpr int kEpt = 16;       // one 16-byte vector of codes a thread
  // Served by the paged row kernels, the dense kernels (an f32 scale per row), prefill and the
  // decode kernel.
  static constexpr bool kDense = true;
  static constexpr bool kHeadScale = false;
  static constexpr bool kPackedExtremes = false;
  // The scale's amax runs over the whole row: its lanes reduce (row_extremes where a row's lanes
  // divide a warp; the row kernels reduce other rows through shared memory, append.cu).
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

  // ---- decode-kernel fragment roles (decode/frag.cuh): codes become f16, exactly; the row's
  // scale multiplies the scores of its token (K) or rides on P (V: kRowScale) ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::I8;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = false;
  static constexpr bool kRowScale = true;

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds.
  static __device__ __forceinline__ int k_pair_elem(int p, int e) { return 2 * p + e; }

  /// Bytes (x.b[i], x.b[j]) of a word of biased codes (code ^ 0x80 = code + 128) as f16x2:
  /// placed under the exponent of 1024 they read 1152 + code, exact, and 1152 comes off.
  static __device__ __forceinline__ uint32_t biased_pair(uint32_t x, uint32_t sel) {
    const __half2 v = bits_h2(prmt(x, 0x64646464u, sel));
    return h2_bits(__hsub2(v, bits_h2(0x64806480u)));
  }

  /// K role: code word `w` (4 codes) → two fragment registers, elements (0, 1) and (2, 3).
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint32_t (&out)[2]) {
    const uint32_t x = w ^ 0x80808080u;
    out[0] = biased_pair(x, 0x4140);
    out[1] = biased_pair(x, 0x4342);
  }

  /// V role: interleave word `a` of one token's codes (the lower k index) and word `b` of the
  /// next token's into four B-fragment registers, register c holding column c of both.
  static __device__ __forceinline__ void v_unpack(uint32_t a, uint32_t b, uint32_t (&out)[4]) {
    const uint32_t lo = prmt(a, b, 0x5140) ^ 0x80808080u, hi = prmt(a, b, 0x7362) ^ 0x80808080u;
    out[0] = biased_pair(lo, 0x4140);
    out[1] = biased_pair(lo, 0x4342);
    out[2] = biased_pair(hi, 0x4140);
    out[3] = biased_pair(hi, 0x4342);
  }
};

}  // namespace kvq
