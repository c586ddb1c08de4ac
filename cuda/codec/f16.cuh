// codec/f16.cuh: the 16-bit formats (f16, bf16): sanitized inputs stored as they round, no
// metadata.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/convert.cuh"

namespace kvq {

template <int F> struct Float16Codec : UngroupedRows<8, 16> {
  static_assert(F == kF16 || F == kBf16, "16-bit formats only");
  static constexpr bool kDense = false;
  static constexpr bool kHeadScale = false;  // none

  // ---- row role ----

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &, const Extremes &,
                                                int chunk, const RowRef &r, bool active) {
    uint4 raw;
    uint32_t *w = reinterpret_cast<uint32_t *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = F == kF16 ? half_bits(v(2 * i)) : bf16_bits(v(2 * i));
      const uint32_t hi = F == kF16 ? half_bits(v(2 * i + 1)) : bf16_bits(v(2 * i + 1));
      w[i] = lo | (hi << 16);
    }
    if (active) reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
  }

  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = w[i] & 0xFFFF, hi = w[i] >> 16;
      v[2 * i] = F == kF16 ? half_from_bits(lo) : bf16_from_bits(lo);
      v[2 * i + 1] = F == kF16 ? half_from_bits(hi) : bf16_from_bits(hi);
    }
  }

  // ---- decode-kernel fragment roles (decode/frag.cuh): codes are the MMA operands ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt =
      F == kF16 ? kvq_decode::Fmt::F16 : kvq_decode::Fmt::BF16;
  static constexpr bool kBf16Operands = F == kBf16;
  static constexpr bool kGroupFrags = false;

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds.
  static __device__ __forceinline__ int k_pair_elem(int p, int e) { return 2 * p + e; }

  /// K role: code word `w` is one fragment register.
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint32_t (&out)[1]) { out[0] = w; }

  /// V role: interleave word `a` of one token's codes (the lower k index) and word `b` of the
  /// next token's into two B-fragment registers, register c holding column c of both.
  static __device__ __forceinline__ void v_unpack(uint32_t a, uint32_t b, uint32_t (&out)[2]) {
    out[0] = prmt(a, b, 0x5410);
    out[1] = prmt(a, b, 0x7632);
  }
};

template <> struct Codec<kF16> : Float16Codec<kF16> {};
template <> struct Codec<kBf16> : Float16Codec<kBf16> {};

}  // namespace kvq
