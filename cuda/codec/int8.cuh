// codec/int8.cuh: FORMATS.md "INT8 per token-head (`int8-pth`)": one two's-complement byte per
// element, one f32 scale s = amax / 127 per row (the row's metadata, little-endian).
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/warp.cuh"

namespace kvq {

// ---- fast exact INT8 codes: no division per element (the method of codec/exact.cuh) --------
//
// With s = fl(amax / 127) normal and r = fl(1 / s) (normal: s <= 65504 / 127), the exact product
// p = x * r is within |q| * 2^-24 of q = x / s, and fl(q) within |q| * 2^-24 (or 2^-150 where q is
// subnormal) of q. |x| <= amax gives |q| <= 127 * (1 + 2^-23), so |p - fl(q)| <= 2^-16. One fma
// rounds p to the integer n (ties to even); a second gives the residual p - n, rounded once
// (error <= 2^-26). If |fl(p - n)| < 0.5 - 2^-15, then |fl(q) - n| < 0.5 and rne(fl(q)) = n; the
// rare elements nearer a half-integer (ties of data on a grid commensurate with s) are redone by
// division. n needs no clamp: |p| < 127.5 - 2^-15 is checked once per thread on its amax, which
// with the above makes rne(fl(q)) lie in [-127, 127] too.
constexpr float kInt8TieWindow = 0x1p-15f;

// A word whose low byte is rne(x * r) as two's complement (the magic number's low byte is 0);
// sets `ambiguous` when that may differ from rne(fl(x / s)).
__device__ __forceinline__ uint32_t int8_round(float x, float r, bool &ambiguous) {
  const float t = __fmaf_rn(x, r, kRoundMagic);
  const float n = __fsub_rn(t, kRoundMagic);
  ambiguous |= fabsf(__fmaf_rn(x, r, -n)) >= 0.5f - kInt8TieWindow;
  return __float_as_uint(t);
}

// The low bytes of four words, in order.
__device__ __forceinline__ uint32_t int8_join(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
}

// Word (x0, x1, x2, x3) with every element decided: the fast code where it decides,
// clamp(rne(fl(x / s)), -127, 127) by division where it does not, or everywhere when `all` (a
// scale outside the fast path's range). Out of line because it is rare, and because inlined it
// would share the fast path's values (keeping them live: spills) and outgrow the instruction
// cache (see int4_nibble_exact).
static __device__ __noinline__ uint32_t int8_word_careful(float x0, float x1, float x2, float x3,
                                                          float s, float r, bool all) {
  const float x[4] = {x0, x1, x2, x3};
  uint32_t b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bool ambiguous = all;
    b[i] = int8_round(x[i], r, ambiguous);
    if (ambiguous)
      b[i] = (uint32_t)(int)fminf(fmaxf(rintf(__fdiv_rn(x[i], s)), -127.0f), 127.0f) & 0xFFu;
  }
  return int8_join(b[0], b[1], b[2], b[3]);
}

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
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &own,
                                                const Extremes &row, int chunk, const RowRef &r,
                                                bool active) {
    const float s = __fdiv_rn(row.hi, 127.0f);
    uint4 raw = make_uint4(0, 0, 0, 0);  // s == 0: every code is 0
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    if (s != 0.0f) {
      const float rc = __frcp_rn(s);
      // Outside the fast path's range (s subnormal, or |x| * rc near the clamp, which the row's
      // amax rules out) every element is divided.
      const bool all = !(s >= 0x1p-126f && __fmul_rn(own.hi, rc) < 127.5f - kInt8TieWindow);
      // Bit j: word j holds an element to redo (word by word, as FP8 redoes pairs: a divergent
      // branch costs the warp only the words some lane needs).
      uint32_t undecided = all ? 0xFu : 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        bool ambiguous = false;
        uint32_t b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = int8_round(v(4 * j + i), rc, ambiguous);
        w[j] = int8_join(b[0], b[1], b[2], b[3]);
        undecided |= (ambiguous ? 1u : 0u) << j;
      }
      if (__builtin_expect(undecided != 0, 0)) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (undecided & (1u << j))
            w[j] = int8_word_careful(v(4 * j), v(4 * j + 1), v(4 * j + 2), v(4 * j + 3), s, rc,
                                     all);
      }
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
