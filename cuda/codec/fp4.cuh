// codec/fp4.cuh: FORMATS.md "FP4 E2M1 (`fp4-e2m1`)": E2M1 codes two per byte (element 2i in the
// low nibble), an E4M3 block scale byte per 16 elements (the row's metadata), and an f32 global
// scale g per KV head outside the rows (as FP8's head scale).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "codec/format.cuh"
#include "codec/fp8.cuh"
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

// ---- fast exact E2M1 codes: no division per element ---------------------------------------
//
// Z(a) = min(2a, a + 2, a / 2 + 4, 7) is increasing and piecewise linear on [0, 6] and maps the
// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 onto the codes 0..7 and the decision boundaries
// 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 onto the half-integers 0.5 .. 6.5; every boundary's tie goes
// to the even code, and Z = 7 above 6, so e2m1_encode's magnitude is rne(Z(|y|)) for every y.
// With r = fl(1 / d) normal, Z is evaluated on the exact product |x| * r (one fma or an exact
// power-of-two multiple of r per piece, each rounded once) instead of on y = fl(x / d): for
// q = |x| / d, |x * r - q| and |y - q| are each <= q * 2^-24 (or 2^-150 in the subnormals), and the
// piece that decides has q <= 8, so the computed z is within 2^-19 of Z(|y|). If z is farther
// than 2^-17 from every half-integer, rne(z) = rne(Z(|y|)): no boundary lies between them, and
// z's residual against rne(z) is exact (Sterbenz). The rare undecided elements (ties of data on a
// grid commensurate with d) are redone by division.
constexpr float kFp4TieWindow = 0x1p-17f;
// Adding it to z in [-7, 7] rounds z to an integer n held in the low bits as 8 + n, in 1..15.
constexpr float kFp4BiasedMagic = 12582920.0f;  // 1.5 * 2^23 + 8 (even: ties stay to even)

// The reciprocal of a group's d and its halves / doubles the pieces of Z need (all exact
// multiples of r while r and r / 2 are normal: d in [2^-126, 2^125]).
struct E2m1Recip {
  float r, r2, rh;
  bool valid;
  __device__ __forceinline__ explicit E2m1Recip(float d) {
    r = __frcp_rn(d);
    r2 = __fmul_rn(r, 2.0f);
    rh = __fmul_rn(r, 0.5f);
    valid = d >= 0x1p-126f && d <= 0x1p125f;
  }
};

// A word whose low 4 bits are 8 + (the signed E2M1 code of x / d as -7..7), bits 4..21 clear;
// sets `ambiguous` when it may differ from e2m1_encode(fl(x / d)).
__device__ __forceinline__ uint32_t e2m1_biased_fast(float x, const E2m1Recip &k,
                                                    bool &ambiguous) {
  const float a = fabsf(x);
  const float z = fminf(fminf(__fmul_rn(a, k.r2), __fmaf_rn(a, k.r, 2.0f)),
                        fminf(__fmaf_rn(a, k.rh, 4.0f), 7.0f));
  // z with x's sign: rne is odd, so this rounds to the signed code.
  const float zs = __uint_as_float(__float_as_uint(z) | (__float_as_uint(x) & 0x80000000u));
  const float t = __fadd_rn(zs, kFp4BiasedMagic);
  // |n| = rne(z); z - |n| is exact.
  ambiguous |= fabsf(__fsub_rn(z, fabsf(__fsub_rn(t, kFp4BiasedMagic)))) >= 0.5f - kFp4TieWindow;
  return __float_as_uint(t);
}

// Eight biased nibbles 8 + n (element i at bits 4i) → E2M1 codes: n for n >= 0, 8 | -n for
// n < 0 (so -0 is never written). Per nibble: x = b ^ 8 is n for n >= 0 and 16 + n (bit 3 set)
// for n < 0, where (x ^ 7) + 1 = 8 - n; no carry leaves a nibble.
__device__ __forceinline__ uint32_t e2m1_word_from_biased(uint32_t b) {
  const uint32_t x = b ^ 0x88888888u;
  const uint32_t neg = (x >> 3) & 0x11111111u;
  return (x ^ (neg * 7u)) + neg;
}

// Eight elements' biased nibbles: four shifted adds leave 16 clean bits (the magic number's
// bits start at 22), a byte permute joins the halves.
__device__ __forceinline__ uint32_t e2m1_join(const uint32_t (&t)[8]) {
  uint32_t half[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t acc = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc += t[4 * h + i] << (4 * i);
    half[h] = acc;
  }
  return __byte_perm(half[0], half[1], 0x5410);
}

// The biased word of elements (x0..x7) with every element decided: the fast nibble where it
// decides, that of e2m1_encode(fl(x / d)) by division where it does not, or everywhere when d
// is outside the fast path's range. Out of line because it is rare, and because inlined it would
// share the fast path's values (keeping them live: spills) and outgrow the instruction cache
// (see int4_nibble_exact).
static __device__ __noinline__ uint32_t e2m1_word_careful(float x0, float x1, float x2, float x3,
                                                          float x4, float x5, float x6, float x7,
                                                          float d) {
  const float x[8] = {x0, x1, x2, x3, x4, x5, x6, x7};
  const E2m1Recip k(d);
  uint32_t t[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    bool ambiguous = !k.valid;
    t[i] = e2m1_biased_fast(x[i], k, ambiguous);
    if (ambiguous) {
      const uint32_t c = e2m1_encode(__fdiv_rn(x[i], d));
      t[i] = (c & 8u) != 0u ? 8u - (c & 7u) : 8u + c;
    }
  }
  return e2m1_join(t);
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
  // Served by the paged row kernels, the dense kernels (E4M3 bytes per group, g per head as
  // FP8's head scale), prefill and the decode kernel.
  static constexpr bool kDense = true;
  static constexpr bool kHeadScale = true;  // g, per KV head
  static constexpr bool kPackedExtremes = false;
  static constexpr bool kRowGroup = false;
  static constexpr bool kLongEncode = true;  // append tuning (append.cu's AppendTuning)
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
    uint4 raw;
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    uint8_t sb[kGroups];
    float d[kGroups];
    // Bit j: word j (8 elements, half a group) holds an element to redo (word by word, as FP8
    // redoes pairs: a divergent branch costs the warp only the words some lane needs).
    uint32_t undecided = 0;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) amax = fmaxf(amax, fabsf(v(k * kGroup + i)));
      const float u = __fdiv_rn(__fdiv_rn(amax, 6.0f), g);
      sb[k] = (uint8_t)__nv_cvt_float_to_fp8(u, __NV_SATFINITE, __NV_E4M3);
      d[k] = __fmul_rn(e4m3_value(sb[k]), g);
      const E2m1Recip rk(d[k]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * k + h;
        bool ambiguous = !rk.valid;  // d outside the fast path's range: every element divided
        uint32_t t[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) t[i] = e2m1_biased_fast(v(8 * j + i), rk, ambiguous);
        w[j] = e2m1_join(t);
        undecided |= (ambiguous ? 1u : 0u) << j;
      }
      // d == 0: every code of the group is 0 (biased 8).
      if (d[k] == 0.0f) {
        w[2 * k] = w[2 * k + 1] = 0x88888888u;
        undecided &= ~(3u << (2 * k));
      }
    }
    if (__builtin_expect(undecided != 0, 0)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (undecided & (1u << j))
          w[j] = e2m1_word_careful(v(8 * j), v(8 * j + 1), v(8 * j + 2), v(8 * j + 3),
                                   v(8 * j + 4), v(8 * j + 5), v(8 * j + 6), v(8 * j + 7),
                                   d[j / 2]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = e2m1_word_from_biased(w[j]);
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

  // ---- decode-kernel fragment roles (decode/frag.cuh): each code becomes the E4M3 byte of
  // value(c) * 2^-6 (a bit move), then f16 by conversion, times its group's scale (exact in
  // f16, as decode_f16); g and the 2^6 are applied to S and O (unit) ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::F4;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = false;
  static constexpr bool kScaledWords = true;  // the unpacks take the word's group scale

  /// Factor between an unpacked code (times its group scale) and its value, before g.
  static __device__ __forceinline__ float unit() { return 64.0f; }

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds: a word's four
  /// registers hold its elements (0, 2), (4, 6), (1, 3), (5, 7) (see e4m3_of_codes).
  static __device__ __forceinline__ int k_pair_elem(int p, int e) {
    const int r = p % 4;
    return 8 * (p / 4) + 4 * (r % 2) + r / 2 + 2 * e;
  }

  /// The E4M3 bytes of value(c) * 2^-6 for the codes c in the low (lo) and high (hi) nibbles
  /// of x's bytes: sign to bit 7, the three magnitude bits to bits 4..2 (exponent e, mantissa
  /// m / 2: 2^(e-7) (1 + m/2) and the subnormal 2^-6 m/2 are E2M1's values times 2^-6).
  static __device__ __forceinline__ void e4m3_of_codes(uint32_t x, uint32_t &lo, uint32_t &hi) {
    lo = ((x << 4) & 0x80808080u) | ((x << 2) & 0x1C1C1C1Cu);
    hi = (x & 0x80808080u) | ((x >> 2) & 0x1C1C1C1Cu);
  }

  /// A group scale byte as f16x2 (s, s), and two tokens' (s_a, s_b): exact.
  static __device__ __forceinline__ uint32_t scale2(uint8_t a, uint8_t b) {
    return h2_bits(fp8x2_to_half2<kFp8E4m3>((uint16_t)(a | (b << 8))));
  }

  /// E4M3 bytes (b0, b1) and (b2, b3) of `e` as f16x2 times the f16x2 scale `s`.
  static __device__ __forceinline__ void scaled_pairs(uint32_t e, uint32_t s, uint32_t &p01,
                                                      uint32_t &p23) {
    p01 = h2_bits(__hmul2(fp8x2_to_half2<kFp8E4m3>((uint16_t)(e & 0xFFFFu)), bits_h2(s)));
    p23 = h2_bits(__hmul2(fp8x2_to_half2<kFp8E4m3>((uint16_t)(e >> 16)), bits_h2(s)));
  }

  /// K role: code word `w` (8 codes of one group, scale byte `sb`) → four fragment registers
  /// (pairs as k_pair_elem says).
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint8_t sb, uint32_t (&out)[4]) {
    uint32_t lo, hi;
    e4m3_of_codes(w, lo, hi);
    const uint32_t s = scale2(sb, sb);
    scaled_pairs(lo, s, out[0], out[1]);
    scaled_pairs(hi, s, out[2], out[3]);
  }

  /// V role: interleave word `a` of one token's codes (the lower k index, scale byte sa) and
  /// word `b` of the next token's (sb) into eight B-fragment registers, register c holding
  /// column c of both.
  static __device__ __forceinline__ void v_unpack(uint32_t a, uint32_t b, uint8_t sa, uint8_t sb,
                                                  uint32_t (&out)[8]) {
    const uint32_t s = scale2(sa, sb);
    uint32_t lo, hi;
    // Bytes (a0, b0, a1, b1): columns 0 / 2 in the low nibbles, 1 / 3 in the high ones.
    e4m3_of_codes(prmt(a, b, 0x5140), lo, hi);
    scaled_pairs(lo, s, out[0], out[2]);
    scaled_pairs(hi, s, out[1], out[3]);
    e4m3_of_codes(prmt(a, b, 0x7362), lo, hi);
    scaled_pairs(lo, s, out[4], out[6]);
    scaled_pairs(hi, s, out[5], out[7]);
  }
};

}  // namespace kvq
