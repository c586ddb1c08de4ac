// codec/int4_kc.cuh: FORMATS.md "INT4 keys per channel" in a paged cache: sealing a full block
// (each channel's G window values quantized as one affine group, INT4 V's math along tokens),
// decoding a sealed block's codes, and the decode kernel's K role (Codec<kInt4Kc>). The group
// math (int4_kc_group_of, int4_kc_codes) also serves the dense file's groups of up to 32 tokens
// (append.cu's quantize_kc_dense_kernel). Not a row
// codec (kInt4Kc is not in AllFormats): its groups cross rows, so append.cu serves it with
// kernels of its own. Every rounding step is an explicit `_rn`
// intrinsic (or rintf, ties to even), whatever flags the including file is compiled with.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "codec/int4_affine.cuh"
#include "prim/bits.cuh"
#include "prim/convert.cuh"

namespace kvq {

// One channel's group: s and z as stored (f16 bits) and as the f32 values the codes use.
struct KcGroup {
  uint16_t s, z;
  float sf, zf;
};

// Channel `half` (0: the low f16 of each word) of a block's window values, as f32.
__device__ __forceinline__ float kc_window_value(uint32_t w, int half) {
  return half_from_bits((uint16_t)(w >> (16 * half)));
}

// s and z of one channel's group from its least and largest value (src/format/int4.rs's
// quantize_affine_group). A zero extreme is +0.0 (FORMATS.md), whichever zero the caller's
// fminf / fmaxf kept.
__device__ __forceinline__ KcGroup int4_kc_group_of(float mn, float mx) {
  mn = __fadd_rn(mn, 0.0f);
  mx = __fadd_rn(mx, 0.0f);
  const __half s = int4_affine_scale(mn, mx), z = int4_affine_zero(mn);
  return {__half_as_ushort(s), __half_as_ushort(z), __half2float(s), __half2float(z)};
}

// The codes of one channel's group of N values (N a multiple of 4): value(t) for t < N, each in
// [mn, mx], the group's extremes, g computed from them (int4_kc_group_of). Code t,
// clamp(rne((value(t) - z) / s), 0, 15), 0 when s == 0, is OR-ed into byte t % 4 of
// codes[t / 4] at bit 4 * half (the byte's other nibble is the other channel's).
//
// Bit-exact with that division without a division per element (exact.cuh): one reciprocal
// rc = fl(1 / s) per group, then the numerator fl(x - z) times rc rounded, the code undecided
// where the product lies within kTieWindow of a rounding boundary. When the group's numerators
// [fl(mn - z), fl(mx - z)] all map inside the code range (int4_fits_unclamped, the usual case:
// only an f16 z far from mn, or an s rounded down, leaves it) the rounding needs no clamp
// (int4_round_biased, on the exact product); else each product is clamped first
// (int4_nibble_clamped). A word of 4 codes with an undecided one is redone per element, dividing
// for those only (int4_nibble_exact, out of line): rare on data off the grid of s, most words on
// it. Codes are masked to their nibble, so a NaN value (a window row never written: outside
// kvq.h's contract) spoils its own code only.
template <int N, typename Value>
__device__ __forceinline__ void int4_kc_codes(const KcGroup &g, float mn, float mx, int half,
                                              const Value &value, uint32_t (&codes)[N / 4]) {
  static_assert(N % 4 == 0 && N / 4 <= 32, "whole words of codes, a bit each");
  if (g.sf == 0.0f) return;
  const float rc = __frcp_rn(g.sf);
  const int shift = 4 * half;
  auto num = [&](int t) { return __fsub_rn(value(t), g.zf); };
  uint32_t undecided = 0;  // bit j: word j holds an undecided code
  // Every word's codes through `nibble` (x, ambiguous) -> the code in its low 4 bits.
  auto pack = [&](auto nibble) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      bool ambiguous = false;
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) word |= nibble(num(4 * j + i), ambiguous) << (8 * i);
      codes[j] |= word << shift;
      undecided |= (ambiguous ? 1u : 0u) << j;
    }
  };
  if (int4_fits_unclamped(__fsub_rn(mn, g.zf), __fsub_rn(mx, g.zf), rc, 0.0f, 15.0f))
    pack([&](float x, bool &a) { return int4_round_biased<0>(x, rc, a) & 0xFu; });
  else
    pack([&](float x, bool &a) { return int4_nibble_clamped(x, rc, 0.0f, 15.0f, a); });
  if (__builtin_expect(undecided != 0, 0)) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      if ((undecided & (1u << j)) == 0) continue;
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bool ambiguous = false;
        const float x = num(4 * j + i);
        uint32_t nibble = int4_nibble_clamped(x, rc, 0.0f, 15.0f, ambiguous);
        if (ambiguous) nibble = int4_nibble_exact(x, g.sf, 0.0f, 15.0f);
        word |= nibble << (8 * i);
      }
      codes[j] = (codes[j] & ~(0x0F0F0F0Fu << shift)) | (word << shift);
    }
  }
}

// Seal channels 2p and 2p + 1 of a block from their window values, w[t] holding token t's pair
// (channel 2p in the low half): the code byte of token t (channel 2p in the low nibble) goes to
// byte t % 4 of codes[t / 4], the pair's s and z to s2 and z2 (channel 2p in the low half). The
// extremes of both channels come from packed f16 minima and maxima of the words (exact: the
// extremes of f16 values are f16 values; a NaN loses to a number, as in fminf).
template <int G>
__device__ __forceinline__ void int4_kc_seal_pair(const uint32_t (&w)[G], uint32_t (&codes)[G / 4],
                                                  uint32_t &s2, uint32_t &z2) {
#pragma unroll
  for (int i = 0; i < G / 4; ++i) codes[i] = 0;
  __half2 lo = bits_h2(w[0]), hi = lo;
#pragma unroll
  for (int t = 1; t < G; ++t) {
    lo = __hmin2(lo, bits_h2(w[t]));
    hi = __hmax2(hi, bits_h2(w[t]));
  }
  s2 = z2 = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float mn = half == 0 ? __low2float(lo) : __high2float(lo);
    const float mx = half == 0 ? __low2float(hi) : __high2float(hi);
    const KcGroup g = int4_kc_group_of(mn, mx);
    int4_kc_codes<G>(g, mn, mx, half, [&](int t) { return kc_window_value(w[t], half); }, codes);
    s2 |= (uint32_t)g.s << (16 * half);
    z2 |= (uint32_t)g.z << (16 * half);
  }
}

// Elements 8c .. 8c + 7 of a sealed row from their codes (4 bytes, element 8c in bits 0-3) and
// their channels' f16 s and z: fma(q, s, z), one rounding.
__device__ __forceinline__ void int4_kc_decode8(uint32_t codes, const uint4 &s, const uint4 &z,
                                                float (&v)[8]) {
  const uint16_t *sh = reinterpret_cast<const uint16_t *>(&s);
  const uint16_t *zh = reinterpret_cast<const uint16_t *>(&z);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    v[i] = __fmaf_rn(small_uint_to_f32((codes >> (4 * i)) & 0xF), half_from_bits(sh[i]),
                     half_from_bits(zh[i]));
}

// The decode kernel's K role (decode/frag.cuh, decode/kernel.cuh): INT4 K's fragment geometry
// (k_dim, ldmatrix rows, codes raw as f16 subnormals), with the metadata per block and channel
// instead of per token and group. Since s and z are constant along a block's tokens, they go on
// the query: for a sealed block, S = sum_c (q_c s_c) code_c + sum_c q_c z_c, so the kernel
// multiplies its query fragments by the block's s once per block (by s / 2^11 where an s passes
// 2047, which q * s would carry past f16's range) and adds the block's q . z to every score. A
// sequence's last, unsealed block is read as f16.
template <> struct Codec<kInt4Kc> {
  static constexpr int kBits = 4;
  // The geometry's groups: each k-step lies inside 32 elements (k_dim), as INT4 K's do. No
  // metadata rows: s and z are the block's (kBlockChannels).
  static constexpr int kGroup = 32;
  static constexpr int kGroupMeta = 0;
  static constexpr bool kHeadScale = false;
  static constexpr bool kBlockChannels = true;

  static constexpr bool kDecodeK = true, kDecodeV = false, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::I4C;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = true;

  /// The kernel applies a sealed chunk's unit itself (2^20, or 2^31 under s / 2^11).
  static constexpr float kScoreUnit = 1.f;
  /// As INT4 K: k-steps 2G hold codes in units of 2^-24, 2G + 1 in 2^-20.
  static __device__ __forceinline__ float q_scale(int j) { return j % 2 == 0 ? 16.f : 1.f; }

  /// As INT4 K (Codec<kInt4Sym32>::k_dim): lane t supplies elements 8t..8t+7 of each 32, the
  /// even ones in k-step 2G, the odd ones in 2G + 1.
  static __device__ __forceinline__ int k_dim(int t, int p, int e) {
    const int j = p / 2, odd = j % 2, b1 = p % 2;
    return 32 * (j / 2) + 8 * t + 2 * b1 + odd + 4 * e;
  }

  /// Word of 8 unsigned codes (element i at bits 4i) as raw f16 subnormals, left in place:
  /// out[0] / out[2] elements (0, 4) / (2, 6) worth q * 2^-24, out[1] / out[3] (1, 5) / (3, 7)
  /// worth q * 2^-20.
  static __device__ __forceinline__ void k_codes(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t w8 = w >> 8;
    out[0] = w & 0x000F000Fu;
    out[1] = w & 0x00F000F0u;
    out[2] = w8 & 0x000F000Fu;
    out[3] = w8 & 0x00F000F0u;
  }

  /// Eight consecutive f16 values of one lane (elements 8t..8t+7 of a 32, as 4 words: a
  /// block's s) in k_codes' order: (0, 4), (2, 6), (1, 5), (3, 7).
  static __device__ __forceinline__ void k_pairs(const uint4 &w, uint32_t (&out)[4]) {
    out[0] = prmt(w.x, w.z, 0x5410);
    out[1] = prmt(w.y, w.w, 0x5410);
    out[2] = prmt(w.x, w.z, 0x7632);
    out[3] = prmt(w.y, w.w, 0x7632);
  }
};

}  // namespace kvq
