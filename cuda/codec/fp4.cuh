// codec/fp4.cuh: FORMATS.md "FP4 E2M1 (`fp4-e2m1`)": E2M1 codes two per byte (element 2i in the
// low nibble), an E4M3 block scale byte per 16 elements (the row's metadata), and an f32 global
// scale g per KV head outside the rows (as FP8's head scale).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "codec/fp8.cuh"
#include "prim/bits.cuh"
#include "prim/packed.cuh"

namespace kvq {

// The largest E2M1 value under the largest E4M3 block scale, 448 * 6: the global scale's
// calibration maps amax to it.
constexpr float kFp4GlobalMax = 2688.0f;

// E2M1 of y (never NaN): nearest grid value, ties to the even mantissa, saturating at 6; a
// result of magnitude 0 is +0 (0x0, never 0x8).
KVQ_HD uint32_t e2m1_encode(float y) {
  const float a = fabsf(y);
  const uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                     (a >= 3.5f) + (a > 5.0f);
  return (y < 0.0f && m != 0u) ? (m | 8u) : m;
}

// ---- fast exact E2M1 codes: no division per element ---------------------------------------
//
// The magnitude code m of y = fl(x / d) (e2m1_encode, FORMATS.md) is rne(Z(|y|)) for |y| < 7,
// with Z(a) = min(2a, a + 2, a / 2 + 4): Z is increasing and piecewise linear, maps the E2M1
// magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 onto 0..7 and the decision boundaries 0.25, 0.75, 1.25,
// 1.75, 2.5, 3.5, 5 onto the half-integers 0.5 .. 6.5, each tie to the even code as the table says
// (and Z in [7, 7.5) for a in [6, 7): code 7).
//
// Z is the bit pattern of an f32: for a real v >= 0 let G(v) be the f32 bit pattern of v
// continued linearly between floats (G(v) = v 2^149 below 2^-126, (e + 127 + f) 2^23 for v =
// 2^e (1 + f) above). Then G(a 2^-126) = Z(a) 2^22 for a in [0, 8): the subnormals are E2M1's
// subnormal 0.5, the binades of 1, 2, 4 its exponents. So with rho ~ 2^-126 / d, the bits b of
// u = fl(|x| rho), one multiplication, are Z(|y|) 2^22 up to a small error, and m is b rounded
// at bit 22.
//
// Error: with r = rcp_approx(d) within 2^-21 of 1 / d and rho = fl(r 2^-126) (subnormal, within
// 2^-150 of r 2^-126, when r < 1), u is within relative 2^-21 + 2^-24 / r + 2^-24 (plus 2^-150
// absolute where u is subnormal) of |x| 2^-126 / d, and |y| 2^-126 within 2^-24 of it. G's
// slope at v is at most 2^24 / v, so |b - G(|y| 2^-126)| <= 8 + 1 / r + 2 + 1/2 + (tiny) <
// Delta = 13 + d (1 + 2^-20), d <= 2^16 (1 / r <= d (1 + 2^-21)).
//
// Decision: w = 64 (b + 2^21 + Delta) puts the code (b + 2^21 + Delta) >> 22 in bits 28..30; if
// the low 28 bits of w exceed 128 Delta, no tie (k + 1/2) 2^22 lies within Delta of b, so
// rne(Z(|y|)) is that code. Else (an element within about 2^-18 relative of a boundary: ties of
// data on a grid commensurate with d, and a few random values) the word is redone by division
// (e2m1_word_careful). A group takes this path when d is in [2^-126, 2^16] and b + Delta of its
// largest |x| lies below the tie 7.5 2^22 (|y| < 7: then no code passes 7 and w does not
// overflow), else (a block scale that saturated, or one in E4M3's subnormals far below the
// group's amax / 6) it is divided element by element; d == 0 gives rho = 0, every code 0.
constexpr float kFp4MaxD = 0x1p16f;
constexpr uint32_t kFp4TieSeven = 15u << 21;  // bits of the tie between codes 7 and 8

// One group's constants: rho, and k = 64 (2^21 + Delta), t = 128 Delta (mod 2^32).
struct E2m1Group {
  float rho;
  uint32_t k, t, delta;
  bool valid;  // d in the fast path's range
  KVQ_HD explicit E2m1Group(float d) {
    valid = d >= 0x1p-126f && d <= kFp4MaxD;
    rho = valid ? hd::mul_rn(hd::rcp_approx(d), 0x1p-126f) : 0.0f;
    // 2^23 + rne(13 + d (1 + 2^-20)): Delta in the low bits (d = 0 when not valid).
    const uint32_t db = hd::bits(hd::fma_rn(valid ? d : 0.0f, 1.0f + 0x1p-20f, 8388621.0f));
    delta = db - 0x4B000000u;
    k = db * 64u + (0x08000000u - 0x4B000000u * 64u);
    t = db * 128u - 0x4B000000u * 128u;
  }
  // Whether every |x| <= amax is decided here (or d == 0): |y| < 7.
  KVQ_HD bool fast(float amax) const {
    return hd::bits(hd::mul_rn(amax, rho)) + delta < kFp4TieSeven;
  }
};

// 64 (b + 2^21 + Delta) for x: E2M1 magnitude code of fl(x / d) in bits 28..30 unless `near` is
// set (then it may differ).
KVQ_HD uint32_t e2m1_mag(float x, const E2m1Group &g, bool &near) {
  const uint32_t w = hd::bits(hd::mul_rn(fabsf(x), g.rho)) * 64u + g.k;
  near |= (w & 0x0FFFFFFFu) <= g.t;
  return w;
}

// The magnitude codes (element i in bits 4i..4i+2) of eight elements, every one decided: the
// fast code where it decides, that of e2m1_encode(fl(x / d)) by division where it does not (or
// the group is outside the fast path). Out of line because it is rare, and because inlined it
// would share the fast path's values (keeping them live: spills) and outgrow the instruction
// cache (see int4_nibble_exact).
static __host__ __device__ __noinline__ uint32_t e2m1_word_careful(float x0, float x1, float x2,
                                                                   float x3, float x4, float x5,
                                                                   float x6, float x7, float d) {
  const float x[8] = {x0, x1, x2, x3, x4, x5, x6, x7};
  const E2m1Group g(d);
  uint32_t m = 0;
#pragma unroll
  for (int i = 7; i >= 0; --i) {
    bool near = !g.valid || !g.fast(fabsf(x[i]));
    uint32_t c = e2m1_mag(x[i], g, near) >> 28;
    if (near) c = d == 0.0f ? 0u : e2m1_encode(hd::div_rn(x[i], d)) & 7u;
    m = (m << 4) | c;
  }
  return m;
}

// Bit 4i + 3 set where element i (of eight) of a word has its sign bit set, from the raw pairs
// p0..p3 of a 16-bit input (element 2i in the low half of p_i): bytes of the signs spread by
// byte permutes, their bits picked.
KVQ_HD uint32_t e2m1_signs16(uint32_t p0, uint32_t p1, uint32_t p2, uint32_t p3) {
  const uint32_t lo = hd::prmt(p0, p1, 0xFDB9), hi = hd::prmt(p2, p3, 0xFDB9);  // 0x00 / 0xFF
  return (hd::prmt(lo, hi, 0x6420) & 0x08080808u) | (hd::prmt(lo, hi, 0x7531) & 0x80808080u);
}

// The same from f32 values.
template <typename Values> KVQ_HD uint32_t e2m1_signs32(const Values &v, int first) {
  uint32_t s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) s |= (hd::bits(v(first + i)) >> 31) << (4 * i + 3);
  return s;
}

// Whether a values functor offers the raw 16-bit pairs of its input (pair_word(i): elements 2i,
// 2i + 1), as append's packed path does.
template <class V, class = void> struct HasPairWords : std::false_type {};
template <class V>
struct HasPairWords<V, std::void_t<decltype(std::declval<const V &>().pair_word(0))>>
    : std::true_type {};

// The E4M3 block scale bytes of two groups (group k in byte k) with largest magnitudes a0, a1
// under global scale g: E4M3(fl(fl(a / 6) / g)), FORMATS.md. Decided without a division when
// fl(a c_lo) and fl(a c_hi) encode alike, c_lo and c_hi bracketing 1 / (6 g): with rcp_approx(g)
// within 2^-21 and fl(1 / 6), fl(c (1 -+ 2^-19)) lie below / above 1 / (6 g) by more than the
// 2^-23 that the two divisions' roundings move u (a >= 2^-120, g in [2^-100, 2^100]: all of it
// normal; a u below 2^-126 encodes to 0 with both ends), and the encoding is monotonic.
static __host__ __device__ __noinline__ uint32_t e4m3_scales_exact(float a0, float a1, float g) {
  const float u0 = hd::div_rn(hd::div_rn(a0, 6.0f), g), u1 = hd::div_rn(hd::div_rn(a1, 6.0f), g);
  return __nv_cvt_float2_to_fp8x2(make_float2(u0, u1), __NV_SATFINITE, __NV_E4M3);
}
KVQ_HD uint32_t e4m3_scales(float a0, float a1, float g) {
  const bool valid = g >= 0x1p-100f && g <= 0x1p100f && (a0 == 0.0f || a0 >= 0x1p-120f) &&
                     (a1 == 0.0f || a1 >= 0x1p-120f);
  const float c = hd::mul_rn(hd::rcp_approx(valid ? g : 1.0f), 1.0f / 6.0f);
  const float c_lo = hd::mul_rn(c, 1.0f - 0x1p-19f), c_hi = hd::mul_rn(c, 1.0f + 0x1p-19f);
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(
      make_float2(hd::mul_rn(a0, c_lo), hd::mul_rn(a1, c_lo)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(
      make_float2(hd::mul_rn(a0, c_hi), hd::mul_rn(a1, c_hi)), __NV_SATFINITE, __NV_E4M3);
  if (__builtin_expect(lo != hi || !valid, 0)) return e4m3_scales_exact(a0, a1, g);
  return lo;
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
  static constexpr float kHeadMax = kFp4GlobalMax;
  static constexpr bool kPackedExtremes = true;
  static constexpr bool kRowGroup = false;
  static constexpr bool kLongEncode = true;  // append tuning (append.cu's AppendTuning)
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");

  // ---- row role: each thread's groups are its own, so no extremes travel; a thread's
  // "extremes" are its two groups' amax: -amax of group 0 in lo, amax of group 1 in hi (so that
  // append's clamp of bf16 extremes to +-65504 clamps both) ----

  static __device__ __forceinline__ Extremes extremes(const float (&v)[kEpt]) {
    float a[kGroups] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < kGroups; ++k)
#pragma unroll
      for (int i = 0; i < kGroup; ++i) a[k] = fmaxf(a[k], fabsf(v[k * kGroup + i]));
    return {-a[0], a[1]};
  }
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) { return own; }

  // The same from a chunk of f16 / bf16 input, on packed pairs (HMNMX2, NaN-propagating), before
  // sanitizing; returns false when the chunk holds a NaN or ±Inf. Exact: the extremes of 16-bit
  // values are 16-bit values.
  template <typename In>
  static __device__ __forceinline__ bool packed_extremes(const RawChunk<In, kEpt> &raw,
                                                         Extremes &ex) {
    using P = typename PairOf<In>::type;
    float a[kGroups];
    bool finite = true;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      P p[kGroup / 2];
      load_pairs(reinterpret_cast<const uint32_t *>(raw.q) + k * kGroup / 2, 0xFFFFFFFFu, p);
      // |x| of both halves: HMNMX2 takes the absolute values as operand modifiers.
      const P m = tree_reduce(p, [](P x, P y) { return __hmax2_nan(__habs2(x), __habs2(y)); });
      const float m0 = __low2float(m), m1 = __high2float(m);
      a[k] = fmaxf(m0, m1);
      finite = finite && m0 <= 0x1.fffffep127f && m1 <= 0x1.fffffep127f;  // false for NaN
    }
    ex = {-a[0], a[1]};
    return finite;
  }

  template <typename Values>
  static KVQ_HD void encode(const Values &v, const Extremes &own, const Extremes &, int chunk,
                            const RowRef &r, bool active) {
    const float g = active ? r.head_scale : 1.0f;  // idle lanes: any valid scale
    const float amax[kGroups] = {-own.lo, own.hi};
    const uint32_t sb = e4m3_scales(amax[0], amax[1], g);
    const __half2 sv = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)sb, __NV_E4M3));
    const float d[kGroups] = {hd::mul_rn(__low2float(sv), g), hd::mul_rn(__high2float(sv), g)};
    uint4 raw;
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    // near[j]: word j (8 elements, half a group) holds an element to redo (word by word, as
    // FP8 redoes pairs: a divergent branch costs the warp only the words some lane needs).
    bool near[4];
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const E2m1Group grp(d[k]);
      const bool fast = d[k] == 0.0f || (grp.valid && grp.fast(amax[k]));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * k + h;
        near[j] = !fast;
        uint32_t m = 0;
#pragma unroll
        for (int i = 7; i >= 0; --i)
          m = hd::funnel_l(e2m1_mag(v(8 * j + i), grp, near[j]), m, 4);
        w[j] = m;
      }
    }
    if (__builtin_expect(near[0] || near[1] || near[2] || near[3], 0)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (near[j])
          w[j] = e2m1_word_careful(v(8 * j), v(8 * j + 1), v(8 * j + 2), v(8 * j + 3),
                                   v(8 * j + 4), v(8 * j + 5), v(8 * j + 6), v(8 * j + 7),
                                   d[j / 2]);
      }
    }
    // Signs: bit 3 of a nonzero code's nibble (m + 7 has bit 3 set for m in 1..7; no carry
    // leaves a nibble), so that -0 is never written.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t s;
      if constexpr (HasPairWords<Values>::value)
        s = e2m1_signs16(v.pair_word(4 * j), v.pair_word(4 * j + 1), v.pair_word(4 * j + 2),
                         v.pair_word(4 * j + 3));
      else
        s = e2m1_signs32(v, 8 * j);
      w[j] |= s & (w[j] + 0x77777777u);
    }
    if (active) {
      reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
      *reinterpret_cast<uint16_t *>(reinterpret_cast<uint8_t *>(r.scales) + chunk * kGroups) =
          (uint16_t)sb;
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

  // ---- decode-kernel fragment roles (decode/frag.cuh): each code becomes the f16 of
  // value(c) * 2^-14 by bit moves alone (sign to bit 15, the three magnitude bits to the
  // exponent's two low bits and the mantissa's top one: E2M1's normals and its subnormal land on
  // f16's exactly), times its group's scale * 2^7 (exact in f16: 2 and 4 significant bits,
  // 2^-17..21); g and the 2^7 are applied to S and O (unit). Hopper issues conversions at a
  // quarter of the rate of bit operations, so the codes take none ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::F4;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = false;
  static constexpr bool kScaledWords = true;  // the unpacks take the word's group scale

  /// Factor between an unpacked code (times its group scale) and its value, before g.
  static __device__ __forceinline__ float unit() { return 128.0f; }

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds: a word's four
  /// registers hold its elements (0, 2), (4, 6), (1, 3), (5, 7) (see f16_high_bytes).
  static __device__ __forceinline__ int k_pair_elem(int p, int e) {
    const int r = p % 4;
    return 8 * (p / 4) + 4 * (r % 2) + r / 2 + 2 * e;
  }

  /// The high bytes of the f16 of value(c) * 2^-14 for the codes c in the low (lo) and high
  /// (hi) nibbles of x's bytes: sign to bit 7, the three magnitude bits to bits 3..1 (the low
  /// byte is 0: 2^(e-15) (1 + m/2) and the subnormal 2^-14 m/2 are E2M1's values times 2^-14).
  static __device__ __forceinline__ void f16_high_bytes(uint32_t x, uint32_t &lo, uint32_t &hi) {
    lo = ((x << 4) & 0x80808080u) | ((x << 1) & 0x0E0E0E0Eu);
    hi = (x & 0x80808080u) | ((x >> 3) & 0x0E0E0E0Eu);
  }

  /// A group scale byte pair (s_a, s_b) as the f16x2 (s_a 2^7, s_b 2^7): exact (E4M3's values
  /// are f16's, and 448 * 2^7 is below f16's largest).
  static __device__ __forceinline__ uint32_t scale2(uint8_t a, uint8_t b) {
    return h2_bits(__hmul2(fp8x2_to_half2<kFp8E4m3>((uint16_t)(a | (b << 8))),
                           __half2(__ushort_as_half(0x5800), __ushort_as_half(0x5800))));
  }

  /// High bytes (b0, b1) and (b2, b3) of `e` as f16x2 times the f16x2 scale `s`.
  static __device__ __forceinline__ void scaled_pairs(uint32_t e, uint32_t s, uint32_t &p01,
                                                      uint32_t &p23) {
    p01 = h2_bits(__hmul2(bits_h2(prmt(e, 0u, 0x1404)), bits_h2(s)));
    p23 = h2_bits(__hmul2(bits_h2(prmt(e, 0u, 0x3424)), bits_h2(s)));
  }

  /// K role: code word `w` (8 codes of one group, scale byte `sb`) → four fragment registers
  /// (pairs as k_pair_elem says).
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint8_t sb, uint32_t (&out)[4]) {
    uint32_t lo, hi;
    f16_high_bytes(w, lo, hi);
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
    f16_high_bytes(prmt(a, b, 0x5140), lo, hi);
    scaled_pairs(lo, s, out[0], out[2]);
    scaled_pairs(hi, s, out[1], out[3]);
    f16_high_bytes(prmt(a, b, 0x7362), lo, hi);
    scaled_pairs(lo, s, out[4], out[6]);
    scaled_pairs(hi, s, out[5], out[7]);
  }
};

}  // namespace kvq
