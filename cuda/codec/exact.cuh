// codec/exact.cuh: fast exact INT4 quantization (no division per element), shared by the INT4
// codecs. Everything here rounds exactly as FORMATS.md says: every rounding step is an explicit
// `_rn` intrinsic, so nvcc can neither contract `a * b + c` into an FMA nor pick an approximate
// division, whatever flags the including file is compiled with.
//
// The kernels must produce rne(fl(x / s)) exactly, but a correctly rounded division per element
// (and the conversion-unit instructions rintf / float→int use) would make quantization compute
// bound. Instead: y = x * r with r = fl(1 / s) is within |q| * 2^-22.9 of q = x / s, and fl(q)
// within |q| * 2^-24 of q, so unless y lies within kTieWindow of a rounding boundary, rounding y
// gives the same result as rounding fl(q). The rare cases near a boundary are flagged, and the
// caller redoes their word with int4_word_careful, which divides only for those elements.
#pragma once

#include <stdint.h>

#ifndef __CUDA_ARCH__
#include <cmath>
#include <cstring>
#endif

// KVQ_HD: a function of the fast exact encoders that also compiles for the host, so that a host
// program can check it against the CPU encoders on billions of inputs (scripts/encode_check.cu).
#define KVQ_HD __host__ __device__ __forceinline__

namespace kvq {

// ---- the encoders' f32 and bit operations, for device and host alike ----------------------
//
// Each is one correctly rounded operation (f32, round to nearest even) or a bit move, with the
// same result on both sides: the host compiles plain f32 arithmetic (SSE, no contraction across
// these calls) and std::fmaf.
namespace hd {
KVQ_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}
KVQ_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVQ_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVQ_HD uint32_t bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
KVQ_HD float from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
// An approximate reciprocal of a normal x whose reciprocal is normal: rcp.approx.ftz.f32, at most
// one ulp from 1 / x (PTX ISA), so within 2^-23 of it relatively. The encoders that use it allow
// 2^-21. The host (scripts/encode_check.cu) rounds 1 / x correctly, then moves it `rcp_ulps`
// ulps, to check that the codes do not depend on which approximation the device returns.
inline int rcp_ulps = 0;  // host only
KVQ_HD float rcp_approx(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  float r = 1.0f / x;
  for (int i = 0; i < rcp_ulps; ++i) r = std::nextafter(r, INFINITY);
  for (int i = 0; i > rcp_ulps; --i) r = std::nextafter(r, 0.0f);
  return r;
#endif
}
// The high word of (hi:lo) << n (n < 32): hi shifted left, lo's top bits shifted in.
KVQ_HD uint32_t funnel_l(uint32_t lo, uint32_t hi, uint32_t n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, n);
#else
  return (uint32_t)((((uint64_t)hi << 32) | lo) << n >> 32);
#endif
}
// PTX prmt.b32 (default mode): byte i of the result is byte (s >> 4i) & 7 of (b:a), or, when bit
// 3 of that selector nibble is set, its sign bit replicated over the byte (__byte_perm ignores
// that bit).
KVQ_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  if ((s & 0x8888u) == 0) return __byte_perm(a, b, s);
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
#else
  const uint64_t x = ((uint64_t)b << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 0xF;
    uint32_t byte = (uint32_t)(x >> (8 * (sel & 7))) & 0xFF;
    if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    d |= byte << (8 * i);
  }
  return d;
#endif
}
}  // namespace hd

// Adding 1.5 * 2^23 to |y| < 2^22 rounds y to an integer (ties to even) held in the low bits.
constexpr float kRoundMagic = 12582912.0f;
// Half-width of the band around a half-integer in which y cannot decide the rounding of fl(q):
// 2^-17 is twice the error bound for |q| <= 16, the range where INT4 rounding decisions happen.
constexpr float kTieWindow = 0x1p-17f;

// INT4 code for num / s as a 4-bit two's-complement nibble: rne(fl(num / s)) clamped to
// [lo, hi] (lo, hi integers in [-8, 15]), given r = __frcp_rn(s) for an f16-valued s > 0.
// Sets `ambiguous` when the result must be recomputed exactly (int4_nibble_exact).
__device__ __forceinline__ uint32_t int4_nibble_clamped(float num, float r, float lo, float hi,
                                                        bool &ambiguous) {
  // Clamping before rounding equals clamping after, for integer bounds; it also keeps |y| small
  // enough for the magic-number rounding.
  const float y = fminf(fmaxf(__fmul_rn(num, r), lo), hi);
  const float t = __fadd_rn(y, kRoundMagic);
  const float n = __fsub_rn(t, kRoundMagic);
  ambiguous |= fabsf(__fsub_rn(y, n)) >= 0.5f - kTieWindow;
  return __float_as_uint(t) & 0xF;
}

// The same without the clamp, for callers that know num * r lies in (lo - 0.5 + kTieWindow,
// hi + 0.5 - kTieWindow) with lo + Bias >= 0 and hi + Bias <= 15 (see int4_fits_unclamped):
// returns a word whose low 22 bits are rne(fl(num / s)) + Bias, in 0..15 (the bits above are the
// magic number's), so that callers can pack codes with shifts and adds.
//
// It rounds the exact product p = num * r (one fma adds the magic number, a second gives the
// residual p - n): |p - q| <= |q| * 2^-24 and |fl(q) - q| <= |q| * 2^-24, so |p - fl(q)| <= 2^-19
// for |q| <= 16, well inside kTieWindow, and the residual fl(p - n) is within 2^-25 of p - n;
// the same test as above then proves rne(p) == rne(fl(q)).
template <int Bias>
__device__ __forceinline__ uint32_t int4_round_biased(float num, float r, bool &ambiguous) {
  constexpr float kMagic = kRoundMagic + (float)Bias;  // even, so ties still go to even
  const float t = __fmaf_rn(num, r, kMagic);
  const float n = __fsub_rn(t, kMagic);
  ambiguous |= fabsf(__fmaf_rn(num, r, -n)) >= 0.5f - kTieWindow;
  return __float_as_uint(t);
}

// Whether every num in [num_min, num_max] rounds into [lo, hi] without clamping: num ↦ num * r is
// monotonic, so the ends decide.
__device__ __forceinline__ bool int4_fits_unclamped(float num_min, float num_max, float r, float lo,
                                                    float hi) {
  return __fmul_rn(num_min, r) > lo - 0.5f + kTieWindow &&
         __fmul_rn(num_max, r) < hi + 0.5f - kTieWindow;
}

// The exact f32 value of a small integer held in the low bits of a word (no conversion unit):
// unsigned 0..15, and signed via the nibble's two's complement.
__device__ __forceinline__ float small_uint_to_f32(uint32_t n) {
  return __fsub_rn(__uint_as_float(0x4B000000u | n), 8388608.0f);
}
__device__ __forceinline__ float nibble_s_to_f32(uint32_t nibble) {
  return __fsub_rn(__uint_as_float(0x4B000000u | (nibble ^ 8u)), 8388616.0f);
}

// Pack E INT4 nibbles (element 2i low) into E / 8 words via the fast exact path; returns a mask
// of the words (bit j: word j) holding an element the fast path could not decide, which the
// caller redoes with int4_word_careful. `num(i)` is element i's numerator, [num_min, num_max]
// bounds them all (it lets typical groups skip the clamp). Codes lie in [lo, hi], within
// [-Bias, 15 - Bias]: Bias 8 for symmetric codes, 0 for affine ones.
template <int E, int Bias, typename Num>
__device__ __forceinline__ uint32_t int4_pack_fast(uint32_t (&w)[E / 8], float rc, float lo,
                                                   float hi, float num_min, float num_max,
                                                   Num num) {
  static_assert(Bias == 0 || Bias == 8, "codes are -8..7 or 0..15");
  uint32_t undecided = 0;
  if (int4_fits_unclamped(num_min, num_max, rc, lo, hi)) {
    // Biased codes are 0..15 with zeros up to bit 21, so four of them shifted into place and
    // added give 16 clean bits; a byte permute joins two such halves, and xor-ing the bias
    // out of every nibble turns code + 8 into the two's-complement nibble.
#pragma unroll
    for (int j = 0; j < E / 8; ++j) {
      bool ambiguous = false;
      uint32_t half[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t acc = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          acc += int4_round_biased<Bias>(num(8 * j + 4 * h + i), rc, ambiguous) << (4 * i);
        half[h] = acc;
      }
      w[j] = __byte_perm(half[0], half[1], 0x5410) ^ (Bias == 8 ? 0x88888888u : 0u);
      undecided |= (ambiguous ? 1u : 0u) << j;
    }
  } else {
#pragma unroll
    for (int j = 0; j < E / 8; ++j) {
      bool ambiguous = false;
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        word |= int4_nibble_clamped(num(8 * j + i), rc, lo, hi, ambiguous) << (4 * i);
      w[j] = word;
      undecided |= (ambiguous ? 1u : 0u) << j;
    }
  }
  return undecided;
}

// rne(fl(num / s)) clamped to [lo, hi], as a nibble: the exact code, for the elements the fast
// path leaves undecided. Out of line because it is rare: inlined at every element's site, the
// divisions made the quantizers' code outgrow the instruction cache (append's INT4 K pass lost
// a third of its issue slots waiting for instructions).
static __device__ __noinline__ uint32_t int4_nibble_exact(float num, float s, float lo, float hi) {
  const float q = rintf(__fdiv_rn(num, s));
  return (uint32_t)(int)fminf(fmaxf(q, lo), hi) & 0xFu;
}

// Word j of the codes (elements 8j..8j+7) with every element decided: the fast clamped code
// where it decides, the exact code where it does not (s: the scale, rc = __frcp_rn(s)). Data on
// a grid commensurate with the scale puts a few elements on rounding ties, so this redoes one
// word and divides only for its undecided elements, not for the whole chunk.
template <typename Num>
__device__ __forceinline__ uint32_t int4_word_careful(int j, float s, float rc, float lo, float hi,
                                                      Num num) {
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    bool ambiguous = false;
    const float x = num(8 * j + i);
    uint32_t nibble = int4_nibble_clamped(x, rc, lo, hi, ambiguous);
    if (ambiguous) nibble = int4_nibble_exact(x, s, lo, hi);
    word |= nibble << (4 * i);
  }
  return word;
}

}  // namespace kvq
