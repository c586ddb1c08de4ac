// codec/int4_affine.cuh: FORMATS.md "INT4 V": groups of 64 along head_dim, asymmetric (affine),
// an f16 scale and an f16 zero per group; unsigned nibbles, element 2i in the low nibble of
// byte i.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/convert.cuh"
#include "prim/packed.cuh"
#include "prim/warp.cuh"

namespace kvq {

// Affine group scale and zero from the group's min and max: f16((mx - mn) / 15), f16(mn).
__device__ __forceinline__ __half int4_affine_scale(float mn, float mx) {
  return __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), 15.0f));
}
__device__ __forceinline__ __half int4_affine_zero(float mn) { return __float2half_rn(mn); }

template <> struct Codec<kInt4Affine64> {
  static constexpr int kBits = 4;
  static constexpr int kGroup = 64;
  static constexpr int kGroupMeta = 4;  // f16 scale, f16 zero
  static constexpr int kEpt = 32;       // a group spans two lanes
  static constexpr bool kDense = true;
  static constexpr bool kHeadScale = false;
  static constexpr bool kPackedExtremes = true;
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");
  static constexpr int kLanes = kGroup / kEpt;  // lanes of one group

  // ---- row role ----

  static __device__ __forceinline__ Extremes extremes(const float (&v)[kEpt]) {
    Extremes ex = {0.0f, 0.0f};
    ex.lo = ex.hi = v[0];
#pragma unroll
    for (int i = 1; i < kEpt; ++i) {
      ex.lo = fminf(ex.lo, v[i]);
      ex.hi = fmaxf(ex.hi, v[i]);
    }
    return ex;
  }

  // The extremes of a whole group from each lane's own. Every lane of the warp must call it (the
  // group spans lanes: shuffles). A zero extreme is +0.0 (FORMATS.md), whichever zero the
  // reductions kept.
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) {
    return {__fadd_rn(group_min<kLanes>(own.lo), 0.0f),
            __fadd_rn(group_max<kLanes>(own.hi), 0.0f)};
  }

  // Extremes (as extremes) of a chunk of f16 / bf16 input, found on packed pairs (HMNMX2,
  // NaN-propagating), before sanitizing; returns false when the chunk holds a NaN or ±Inf. Exact:
  // the extremes of 16-bit values are 16-bit values.
  template <typename In>
  static __device__ __forceinline__ bool packed_extremes(const RawChunk<In, kEpt> &raw,
                                                         Extremes &ex) {
    using P = typename PairOf<In>::type;
    constexpr int kPairs = kEpt / 2;
    const uint32_t *w = reinterpret_cast<const uint32_t *>(raw.q);
    P a[kPairs], b[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) a[j] = b[j] = *reinterpret_cast<const P *>(w + j);
    const P mn = tree_reduce(a, [](P x, P y) { return __hmin2_nan(x, y); });
    const P mx = tree_reduce(b, [](P x, P y) { return __hmax2_nan(x, y); });
    const float n0 = __low2float(mn), n1 = __high2float(mn);
    const float x0 = __low2float(mx), x1 = __high2float(mx);
    ex.lo = fminf(n0, n1);
    ex.hi = fmaxf(x0, x1);
    return n0 >= -0x1.fffffep127f && n1 >= -0x1.fffffep127f && x0 <= 0x1.fffffep127f &&
           x1 <= 0x1.fffffep127f;
  }

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &own,
                                                const Extremes &group, int chunk, const RowRef &r,
                                                bool active) {
    const float mn = group.lo, mx = group.hi;
    const float own_mn = own.lo, own_mx = own.hi;  // this thread's extremes bound its numerators
    const __half s = int4_affine_scale(mn, mx);
    const __half z = int4_affine_zero(mn);
    const float sf = __half2float(s), zf = __half2float(z);
    uint4 raw = make_uint4(0, 0, 0, 0);
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    if (sf != 0.0f) {
      const float rc = __frcp_rn(sf);
      auto num = [&](int i) { return __fsub_rn(v(i), zf); };
      const uint32_t undecided = int4_pack_fast<kEpt, 0>(
          w, rc, 0.0f, 15.0f, __fsub_rn(own_mn, zf), __fsub_rn(own_mx, zf), num);
      if (__builtin_expect(undecided != 0, 0)) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (undecided & (1u << j))
            w[j] = int4_word_careful(j, sf, rc, 0.0f, 15.0f, num);
      }
    }
    if (active) {
      reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
      if (chunk % kLanes == 0) {
        const int g = (chunk / kLanes) * r.meta_step;
        r.scales[g] = __half_as_ushort(s);
        r.zeros[g] = __half_as_ushort(z);
      }
    }
  }

  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw);
    const int g = (chunk * kEpt / kGroup) * r.meta_step;
    const float sf = half_from_bits(r.scales[g]), zf = half_from_bits(r.zeros[g]);
#pragma unroll
    for (int i = 0; i < kEpt; ++i)
      v[i] = __fmaf_rn(small_uint_to_f32((w[i / 8] >> (4 * (i % 8))) & 0xF), sf, zf);
  }

  /// A chunk's bytes for decode_f16: its codes and its group's scale and zero, loaded first (a
  /// thread's loads of all its chunks in flight before decode_f16's branch).
  struct F16Raw {
    uint4 codes;
    uint16_t scale, zero;
  };
  static __device__ __forceinline__ F16Raw load_f16(const RowRef &r, int chunk) {
    const int g = (chunk * kEpt / kGroup) * r.meta_step;
    return {reinterpret_cast<const uint4 *>(r.codes)[chunk], r.scales[g], r.zeros[g]};
  }

  /// The chunk's values as f16 pairs (element 2i low in h[i]): code * scale + zero rounded once
  /// to f16 (decode's f32 fma then rounds twice: the two may differ by one f16 ulp), clamped to
  /// +-65504. For operand tiles (the prefill kernel).
  static __device__ __forceinline__ void decode_f16(const F16Raw &raw, uint32_t (&h)[kEpt / 2]) {
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw.codes);
    const __half s1 = __ushort_as_half(raw.scale), z1 = __ushort_as_half(raw.zero);
    const __half2 s = __half2half2(s1), z = __half2half2(z1);
    // 0 <= n <= 15: below this bound no value leaves f16's range, and none needs the clamp.
    const bool in_range = 15.f * fabsf(__half2float(s1)) + fabsf(__half2float(z1)) <= 65000.f;
    if (in_range && fabsf(__half2float(s1)) <= kSubnormalScaleMax) {
      // Each nibble an f16 subnormal n 2^-24, times 2^15 (n 2^-9), then times the scale times
      // 2^9 plus the zero: exact but the last step, which rounds n * s + z once. 3 instructions
      // a pair (the one below: 4).
      const __half2 s9 = __hmul2(s, __float2half2_rn(512.0f)), up = __float2half2_rn(32768.0f);
#pragma unroll
      for (int k = 0; k < kEpt / 8; ++k) {
        const uint32_t lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
        const uint32_t x[4] = {nibble_pair_subnormal<0>(lo, hi), nibble_pair_subnormal<1>(lo, hi),
                               nibble_pair_subnormal<2>(lo, hi), nibble_pair_subnormal<3>(lo, hi)};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          h[4 * k + i] = h2_bits(__hfma2(__hmul2(bits_h2(x[i]), up), s9, z));
      }
      return;
    }
    // Larger scales: each byte becomes 1024 + n per nibble, exact f16s; minus 1024, n * s + z
    // rounded once, clamped where the bound above does not hold.
    const __half2 bias = __float2half2_rn(1024.0f);
    auto unpack = [&](auto clamp) {
#pragma unroll
      for (int k = 0; k < kEpt / 8; ++k) {
        const uint32_t w4 = w[k] >> 4;
        const uint32_t x[4] = {nibble_pair_f16<0, 0>(w[k], w4), nibble_pair_f16<1, 0>(w[k], w4),
                               nibble_pair_f16<2, 0>(w[k], w4), nibble_pair_f16<3, 0>(w[k], w4)};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          h[4 * k + i] = clamp(__hfma2(__hsub2(bits_h2(x[i]), bias), s, z));
      }
    };
    unpack_f16_clamped_unless(in_range, unpack);
  }

  // ---- decode-kernel V role (decode/frag.cuh): raw codes, scale and zero on the P side ----

  static constexpr bool kDecodeK = false, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::I4;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = true;

  /// Head-dim index of the column that lane g supplies to n-tile j: n-tile j = 8 * G + c is
  /// column c of word g of group G (all 8 columns of an n-tile in one group, so P can carry
  /// that group's scale).
  static __device__ __forceinline__ int v_dim(int g, int j) { return 64 * (j / 8) + 8 * g + j % 8; }

  /// The value that B-fragment column c (0..8) of v_codes carries per unit of code: nibbles at
  /// bits 0-3 of a half are f16 subnormals n * 2^-24, at bits 4-7 n * 2^-20.
  static __host__ __device__ constexpr float v_col_unit_inv(int c) { return (c & 1) ? 1048576.f : 16777216.f; }

  /// Interleave word `a` (lower k index) and `b` of two tokens' codes into 8 B-fragment
  /// registers of the raw nibbles as exact f16 subnormals (one LOP3 each, no offset to remove):
  /// register c holds element c of both words, worth n * 2^-24 (c even) or n * 2^-20 (c odd).
  /// The kernel puts scale and zero on the P side (tensor cores take f16 subnormals as is).
  static __device__ __forceinline__ void v_codes(uint32_t a, uint32_t b, uint32_t (&out)[8]) {
    const uint32_t x[2] = {prmt(a, b, 0x5410), prmt(a, b, 0x7632)};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t x8 = x[i] >> 8;
      out[4 * i + 0] = x[i] & 0x000F000Fu;
      out[4 * i + 1] = x[i] & 0x00F000F0u;
      out[4 * i + 2] = x8 & 0x000F000Fu;
      out[4 * i + 3] = x8 & 0x00F000F0u;
    }
  }
};

}  // namespace kvq
