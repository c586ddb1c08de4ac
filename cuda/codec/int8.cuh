// codec/int8.cuh: FORMATS.md "INT8 per token-head (`int8-pth`)": one two's-complement byte per
// element, one f32 scale s = amax / 127 per row (the row's metadata, little-endian).
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/packed.cuh"
#include "prim/warp.cuh"

namespace kvq {

// ---- fast exact INT8 codes: no division per element --------------------------------------
//
// s = fl(amax / 127) (int8_scale). For s normal (s >= 2^-126) and |x| <= amax, |fl(x / s)| <=
// 127 (1 + 2^-23), so FORMATS.md's clamp never acts and the code is n = rne(fl(x / s)).
//
// With r within 2^-21 of 1 / s (hd::rcp_approx), r_lo = fl(r (1 - 2^-20)) < (1 / s)(1 - 2^-22)
// and r_hi = fl(r (1 + 2^-20)) > (1 / s)(1 + 2^-22), while fl(q) lies within q 2^-24 of q = x / s
// (or is 0 and |x r_hi| < 1/2 when q underflows): so x r_lo < fl(q) < x r_hi for x > 0 (reversed
// for x < 0), and since rne is monotonic, rne(x r_lo) <= n <= rne(x r_hi). An fma adding 1.5 * 2^23
// rounds each exact product to an integer (|x r| < 2^22) held in the low bits, the low byte n as
// two's complement; where the two words are equal, that is n. A word of four codes in which a
// pair differs (x / s within about |x / s| 2^-19 of a half-integer: ties of data on a grid
// commensurate with s, and a few random values) is redone by int8_word_careful.
constexpr float kInt8BracketLo = 1.0f - 0x1p-20f, kInt8BracketHi = 1.0f + 0x1p-20f;

// fl(amax / 127) for amax >= 0 finite, by two fmas around fl(1 / 127) (Markstein): equal to
// __fdiv_rn(amax, 127.0f) for every non-negative finite f32 (all 2^31 checked, encode_check).
KVQ_HD float int8_scale(float amax) {
  constexpr float kInv127 = 1.0f / 127.0f;
  const float q = hd::mul_rn(amax, kInv127);
  return hd::fma_rn(hd::fma_rn(-q, 127.0f, amax), kInv127, q);
}

// The bracket of 1 / s; `valid` when s is normal (else every code is divided).
struct Int8Bracket {
  float lo, hi;
  bool valid;
  KVQ_HD explicit Int8Bracket(float s) {
    valid = s >= 0x1p-126f;
    const float r = hd::rcp_approx(valid ? s : 1.0f);
    lo = hd::mul_rn(r, kInt8BracketLo);
    hi = hd::mul_rn(r, kInt8BracketHi);
  }
};

// A word whose low byte is rne(x r_lo) as two's complement; or-s into `differ` the bits in which
// the rounding of x r_hi differs (0 when both decide the same code).
KVQ_HD uint32_t int8_code(float x, const Int8Bracket &b, uint32_t &differ) {
  const uint32_t lo = hd::bits(hd::fma_rn(x, b.lo, kRoundMagic));
  const uint32_t hi = hd::bits(hd::fma_rn(x, b.hi, kRoundMagic));
  differ |= lo ^ hi;
  return lo;
}

// The low bytes of four words, in order.
KVQ_HD uint32_t int8_join(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return hd::prmt(hd::prmt(b0, b1, 0x0040), hd::prmt(b2, b3, 0x0040), 0x5410);
}

// Word (x0, x1, x2, x3) with every element decided: the bracket's code where it decides,
// clamp(rne(fl(x / s)), -127, 127) by division where it does not, or everywhere when the bracket
// is not valid (s subnormal). Out of line because it is rare, and because inlined it would share
// the fast path's values (keeping them live: spills) and outgrow the instruction cache (see
// int4_nibble_exact).
static __host__ __device__ __noinline__ uint32_t int8_word_careful(float x0, float x1, float x2,
                                                                   float x3, float s) {
  const float x[4] = {x0, x1, x2, x3};
  const Int8Bracket br(s);
  uint32_t b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t differ = 0;
    b[i] = int8_code(x[i], br, differ);
    if (differ != 0 || !br.valid) {
      // Clamping before rounding equals clamping after, for integer bounds.
      const float y = fminf(fmaxf(hd::div_rn(x[i], s), -127.0f), 127.0f);
      b[i] = hd::bits(hd::add_rn(y, kRoundMagic));
    }
  }
  return int8_join(b[0], b[1], b[2], b[3]);
}

// The 16 codes of one thread's chunk (element 4j + i in byte i of w[j]) under the row's scale s
// (s != 0), every one decided.
template <typename Values>
KVQ_HD void int8_encode_chunk(const Values &v, float s, uint32_t (&w)[4]) {
  const Int8Bracket br(s);
  // differ[j]: word j holds an element to redo (word by word, as FP8 redoes pairs: a divergent
  // branch costs the warp only the words some lane needs).
  uint32_t differ[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    differ[j] = 0;
    uint32_t b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = int8_code(v(4 * j + i), br, differ[j]);
    w[j] = int8_join(b[0], b[1], b[2], b[3]);
  }
  if (__builtin_expect((differ[0] | differ[1] | differ[2] | differ[3]) != 0 || !br.valid, 0)) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (differ[j] != 0 || !br.valid)
        w[j] = int8_word_careful(v(4 * j), v(4 * j + 1), v(4 * j + 2), v(4 * j + 3), s);
  }
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
  static constexpr bool kPackedExtremes = true;
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
  // two dividing 32, rows aligned to it). Every lane of the warp must call it. The common row of
  // 8 lanes (head_dim 128) takes three shuffles without a loop.
  static __device__ __forceinline__ Extremes row_extremes(const Extremes &own, int lanes) {
    float hi = own.hi;
    if (lanes == 8) {
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    } else {
      for (int off = 1; off < lanes; off <<= 1)
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
    return {0.0f, hi};
  }

  // This thread's amax (as extremes) of a chunk of f16 / bf16 input, found on packed pairs
  // (HMNMX2, NaN-propagating), before sanitizing; returns false when the chunk holds a NaN or
  // ±Inf. Exact: the extremes of 16-bit values are 16-bit values.
  template <typename In>
  static __device__ __forceinline__ bool packed_extremes(const RawChunk<In, kEpt> &raw,
                                                         Extremes &ex) {
    ex.lo = 0.0f;
    return packed_abs_max<In, kEpt / 2>(raw.q, ex.hi);
  }

  template <typename Values>
  static KVQ_HD void encode(const Values &v, const Extremes &, const Extremes &row, int chunk,
                            const RowRef &r, bool active) {
    const float s = int8_scale(row.hi);
    uint4 raw = make_uint4(0, 0, 0, 0);  // s == 0: every code is 0
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    if (s != 0.0f) int8_encode_chunk(v, s, w);
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

  // ---- decode-kernel fragment roles (decode/frag.cuh): codes become f16, exactly, as code +
  // 128 in units of 2^-24 (subnormals: no arithmetic on them); the kernel takes the 128 off the
  // MMAs' sums (kCodeBias) and the row's scale times 2^24 (kCodeUnit) multiplies the scores of
  // its token (K) or rides on P (V: kRowScale) ----

  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = true;
  static constexpr kvq_decode::Fmt kDecodeFmt = kvq_decode::Fmt::I8;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = false;
  static constexpr bool kRowScale = true;
  /// What every unpacked code carries besides its code, as f16x2 bits (both halves), and what a
  /// unit of the unpacked codes is worth.
  static constexpr uint32_t kCodeBias = 0x00800080u;
  static constexpr float kCodeUnit = 16777216.0f;

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds.
  static __device__ __forceinline__ int k_pair_elem(int p, int e) { return 2 * p + e; }

  /// Bytes (x.b[i], x.b[j]) of a word of biased codes (code ^ 0x80 = code + 128) as f16x2
  /// subnormals: (code + 128) 2^-24 each, exact.
  static __device__ __forceinline__ uint32_t biased_pair(uint32_t x, uint32_t sel) {
    return prmt(x, 0u, sel);
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
