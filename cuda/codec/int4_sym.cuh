// codec/int4_sym.cuh: FORMATS.md "INT4 K" (groups of 32 along head_dim, symmetric, an f16 scale
// per group) and the dense-only "Uniform INT4" (the same codes under one f32 scale per tensor).
// "Packing": element 2i in the low nibble of byte i.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/convert.cuh"
#include "prim/packed.cuh"

namespace kvq {

// Symmetric group scale from the group's amax: f16(amax / 7).
__device__ __forceinline__ __half int4_sym_scale(float amax) {
  return __float2half_rn(__fdiv_rn(amax, 7.0f));
}

// Symmetric code in -7..=7 for x with scale sf = f32(s); 0 when sf == 0.
__device__ __forceinline__ int int4_sym_code(float x, float sf) {
  if (sf == 0.0f) return 0;
  const float q = rintf(__fdiv_rn(x, sf));
  return (int)fminf(fmaxf(q, -7.0f), 7.0f);
}

// q * s, one rounding.
__device__ __forceinline__ float int4_sym_dequantize(int q, float sf) {
  return __fmul_rn((float)q, sf);
}

// Nibble i (0..7) of a packed 32-bit word of 8 codes, two's-complement signed.
__device__ __forceinline__ int nibble_s(uint32_t word, int i) {
  return ((int)(word << (28 - 4 * i))) >> 28;
}

// Pack 8 codes (element 2i in the low nibble of byte i) into a 32-bit little-endian word.
__device__ __forceinline__ uint32_t pack8_nibbles(const int (&q)[8]) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= (uint32_t)(q[i] & 0xF) << (4 * i);
  return w;
}

template <> struct Codec<kInt4Sym32> {
  static constexpr int kBits = 4;
  static constexpr int kGroup = 32;
  static constexpr int kGroupMeta = 2;  // f16 scale
  static constexpr int kEpt = 32;       // a thread owns one group
  static constexpr bool kDense = true;
  static constexpr bool kHeadScale = false;
  static constexpr bool kPackedExtremes = true;
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");

  // ---- row role ----

  static __device__ __forceinline__ Extremes extremes(const float (&v)[kEpt]) {
    return abs_max_extremes(v);
  }
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) { return own; }

  // Extremes (as extremes) of a chunk of f16 / bf16 input, found on packed pairs (HMNMX2,
  // NaN-propagating), before sanitizing; returns false when the chunk holds a NaN or ±Inf. Exact:
  // the extremes of 16-bit values are 16-bit values.
  template <typename In>
  static __device__ __forceinline__ bool packed_extremes(const RawChunk<In, kEpt> &raw,
                                                         Extremes &ex) {
    using P = typename PairOf<In>::type;
    P a[kEpt / 2];
    load_pairs(raw.q, 0x7FFF7FFFu, a);  // |x| of both halves
    const P m = tree_reduce(a, [](P x, P y) { return __hmax2_nan(x, y); });
    const float m0 = __low2float(m), m1 = __high2float(m);
    ex.lo = 0.0f;
    ex.hi = fmaxf(m0, m1);
    return m0 <= 0x1.fffffep127f && m1 <= 0x1.fffffep127f;  // false for NaN
  }

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &own,
                                                const Extremes &, int chunk, const RowRef &r,
                                                bool active) {
    const float amax = own.hi;
    const __half s = int4_sym_scale(amax);
    const float sf = __half2float(s);
    uint4 raw = make_uint4(0, 0, 0, 0);
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    if (sf != 0.0f) {
      const float rc = __frcp_rn(sf);
      auto num = [&](int i) { return v(i); };
      const uint32_t undecided = int4_pack_fast<kEpt, 8>(w, rc, -7.0f, 7.0f, -amax, amax, num);
      if (__builtin_expect(undecided != 0, 0)) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (undecided & (1u << j))
            w[j] = int4_word_careful(j, sf, rc, -7.0f, 7.0f, num);
      }
    }
    if (active) {
      reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
      r.scales[chunk * r.meta_step] = __half_as_ushort(s);
    }
  }

  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw);
    const float sf = half_from_bits(r.scales[chunk * r.meta_step]);
#pragma unroll
    for (int i = 0; i < kEpt; ++i)
      v[i] = __fmul_rn(nibble_s_to_f32((w[i / 8] >> (4 * (i % 8))) & 0xF), sf);
  }

  /// A chunk's bytes for decode_f16: its codes and its group's scale, loaded first (a thread's
  /// loads of all its chunks in flight before decode_f16's branch).
  struct F16Raw {
    uint4 codes;
    uint16_t scale;
  };
  static __device__ __forceinline__ F16Raw load_f16(const RowRef &r, int chunk) {
    return {reinterpret_cast<const uint4 *>(r.codes)[chunk], r.scales[chunk * r.meta_step]};
  }

  /// The chunk's values as f16 pairs (element 2i low in h[i]): code * scale rounded once, as
  /// decode's exact f32 product rounds to f16, clamped to +-65504 (a product of the largest
  /// code and a scale rounded up can pass it). For operand tiles (the prefill kernel).
  static __device__ __forceinline__ void decode_f16(const F16Raw &raw, uint32_t (&h)[kEpt / 2]) {
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&raw.codes);
    const __half s1 = __ushort_as_half(raw.scale);
    const __half2 s = __half2half2(s1);
    if (fabsf(__half2float(s1)) <= kSubnormalScaleMax) {
      // Each nibble n ^ 8 (= code + 8) an f16 subnormal (n ^ 8) 2^-24; times 2^15 minus 2^-6
      // the code times 2^-9, then times the scale times 2^9: every step exact but the last,
      // which rounds code * scale once. 3 instructions a pair (the one below: 4).
      const __half2 s9 = __hmul2(s, __float2half2_rn(512.0f));
      const __half2 up = __float2half2_rn(32768.0f), bias = __float2half2_rn(-0.015625f);
#pragma unroll
      for (int k = 0; k < kEpt / 8; ++k) {
        const uint32_t lo = and_xor<0x0F0F0F0Fu>(w[k], 0x08080808u);
        const uint32_t hi = and_xor<0x0F0F0F0Fu>(w[k] >> 4, 0x08080808u);
        const uint32_t x[4] = {nibble_pair_subnormal<0>(lo, hi), nibble_pair_subnormal<1>(lo, hi),
                               nibble_pair_subnormal<2>(lo, hi), nibble_pair_subnormal<3>(lo, hi)};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          h[4 * k + i] = h2_bits(__hmul2(__hfma2(bits_h2(x[i]), up, bias), s9));
      }
      return;
    }
    // Larger scales: each byte becomes 1024 + (n ^ 8) per nibble, exact f16s, minus 1032 the
    // signed code, times the scale, clamped.
    const __half2 bias = __float2half2_rn(1032.0f);
    auto unpack = [&](auto clamp) {
#pragma unroll
      for (int k = 0; k < kEpt / 8; ++k) {
        const uint32_t w4 = w[k] >> 4;
        const uint32_t x[4] = {nibble_pair_f16<0, 8>(w[k], w4), nibble_pair_f16<1, 8>(w[k], w4),
                               nibble_pair_f16<2, 8>(w[k], w4), nibble_pair_f16<3, 8>(w[k], w4)};
#pragma unroll
        for (int i = 0; i < 4; ++i) h[4 * k + i] = clamp(__hmul2(__hsub2(bits_h2(x[i]), bias), s));
      }
    };
    // |q| <= 8: below this scale no product leaves f16's range, and none needs the clamp.
    unpack_f16_clamped_unless(fabsf(__half2float(s1)) <= 8000.f, unpack);
  }

  // ---- decode-kernel K role (decode/frag.cuh): raw codes, the group's scale on the result ----

  static constexpr bool kDecodeK = true, kDecodeV = false, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::I4;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = true;

  /// What one unit of the MMAs' scores is worth: 2^20 (see k_codes).
  static constexpr float kScoreUnit = 1048576.f;
  /// Factor on the query of k-step j: k-steps 2G hold codes in units of 2^-24, 2G + 1 in
  /// 2^-20; the query carries the 16 that brings both to 2^-20.
  static __device__ __forceinline__ float q_scale(int j) { return j % 2 == 0 ? 16.f : 1.f; }

  /// The start of group G's accumulator for one query row: the codes enter the MMAs as q + 8,
  /// so it is -8 * sum(q) over the group, summing the query values exactly as the fragments
  /// hold them (in 2^-20 units). `x(d)` is element d of the row's scaled query; a row that is
  /// not `valid` sums nothing.
  template <class X>
  static __device__ __forceinline__ float k_zero_term(int G, bool valid, X x) {
    float sum = 0.f;
    if (valid) {
      for (int d = kGroup * G; d < kGroup * G + kGroup; ++d) {
        const float v = x(d);
        sum += d % 2 == 0 ? __half2float(__float2half_rn(16.f * v)) * 0.0625f
                          : __half2float(__float2half_rn(v));
      }
    }
    return -8.f / 1048576.f * sum;
  }

  /// Head-dim index of half `e` of lane t's fragment register `p` of a token: each k-step lies
  /// inside one 32-element group, so that the group's scale can be applied to the MMA's result:
  /// k-steps 2G and 2G + 1 are group G, lane t supplies word t of the group (elements
  /// 8t..8t+7), its even elements in k-step 2G and its odd ones in k-step 2G + 1 (see k_codes).
  static __device__ __forceinline__ int k_dim(int t, int p, int e) {
    const int j = p / 2, odd = j % 2, b1 = p % 2;
    return 32 * (j / 2) + 8 * t + 2 * b1 + odd + 4 * e;
  }

  /// Word `w` of one token's group (8 symmetric codes, element i at bits 4i) as raw f16
  /// subnormals, one LOP3 each: nibble n ^ 8 = q + 8 (the XOR rides in the LOP3), left in
  /// place. out[0] / out[2] hold elements (0, 4) / (2, 6) worth (q + 8) * 2^-24 (b0 / b1 of
  /// k-step 2G), out[1] / out[3] elements (1, 5) / (3, 7) worth (q + 8) * 2^-20 (k-step 2G + 1).
  static __device__ __forceinline__ void k_codes(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t w8 = w >> 8;
    out[0] = and_xor<0x000F000Fu>(w, 0x00080008u);
    out[1] = and_xor<0x00F000F0u>(w, 0x00800080u);
    out[2] = and_xor<0x000F000Fu>(w8, 0x00080008u);
    out[3] = and_xor<0x00F000F0u>(w8, 0x00800080u);
  }
};

// Uniform (per-tensor) INT4, dense only: codes as symmetric INT4 but with an f32 scale amax / 7.
struct Int4Uniform {
  static __device__ __forceinline__ float scale_from_amax(float amax) {
    return __fdiv_rn(amax, 7.0f);
  }
  // The code of a sanitized value, and a code's value.
  static __device__ __forceinline__ int code(float x, float s) { return int4_sym_code(x, s); }
  static __device__ __forceinline__ float value(int q, float s) {
    return int4_sym_dequantize(q, s);
  }
};

}  // namespace kvq
