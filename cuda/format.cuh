// format.cuh: the device side of FORMATS.md, element by element. It mirrors src/format/
// (sanitize.rs, fp8.rs, int4.rs) and must stay bit-exact with it: every rounding step below is an
// explicit `_rn` intrinsic, so nvcc can neither contract `a * b + c` into an FMA nor pick an
// approximate division, whatever flags the including file is compiled with.
//
// Kernels that want speed over exactness (the fused decode may dequantize in f16, FORMATS.md
// "What is not bit-exact") can use the raw code helpers (fp8_to_half2, int4 nibble unpacking)
// and do their own arithmetic; everything named quantize_* / dequantize_* here is exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "prim/convert.cuh"

namespace kvq {

// Discriminants of kvq_format (cuda/kvq.h) and kvq::KvFormat, usable as template arguments.
enum Format : int {
  kF16 = 0,
  kBf16 = 1,
  kFp8E4m3 = 2,
  kFp8E5m2 = 3,
  kInt4Sym32 = 4,
  kInt4Affine64 = 5,
};

// Largest finite f16; inputs are clamped into [-kF16Max, kF16Max].
constexpr float kF16Max = 65504.0f;
// Group sizes of the INT4 formats (elements along head_dim).
constexpr int kSymGroup = 32;
constexpr int kAffineGroup = 64;

// ---- input sanitizing (FORMATS.md "Input sanitizing") -------------------------------------

// NaN → 0, then clamp to ±65504 (so ±Inf → ±65504); adds 1 to `non_finite` for NaN or ±Inf.
// The sign of a zero is kept, as the CPU's f32::clamp keeps it.
__device__ __forceinline__ float sanitize(float x, uint32_t &non_finite) {
  if (isnan(x)) {
    non_finite += 1;
    return 0.0f;
  }
  non_finite += isinf(x) ? 1u : 0u;
  return fminf(fmaxf(x, -kF16Max), kF16Max);
}

// ---- FP8 (FORMATS.md "FP8 E4M3", E5M2) ----------------------------------------------------

template <int F> struct Fp8Traits;
template <> struct Fp8Traits<kFp8E4m3> {
  static constexpr __nv_fp8_interpretation_t kind = __NV_E4M3;
  static constexpr float max_finite = 448.0f;
};
template <> struct Fp8Traits<kFp8E5m2> {
  static constexpr __nv_fp8_interpretation_t kind = __NV_E5M2;
  static constexpr float max_finite = 57344.0f;
};

// Encode y (already divided by the scale) with round-to-nearest-even and saturation to ±max.
template <int F> __device__ __forceinline__ uint8_t fp8_encode(float y) {
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<F>::kind);
}

// Encode two values at once: x.x in the low byte (one cvt instruction on sm_89+).
template <int F> __device__ __forceinline__ uint16_t fp8x2_encode(float2 y) {
  return __nv_cvt_float2_to_fp8x2(y, __NV_SATFINITE, Fp8Traits<F>::kind);
}

// Two codes (low byte → .x) as f16x2, exact.
template <int F> __device__ __forceinline__ __half2 fp8x2_to_half2(uint16_t codes) {
  return __half2(__nv_cvt_fp8x2_to_halfraw2(codes, Fp8Traits<F>::kind));
}

// Calibration scale: amax / max_finite, or 1 when that quotient is 0 (amax == 0, or so small
// that the division underflows: FORMATS.md).
template <int F> __device__ __forceinline__ float fp8_scale_from_amax(float amax) {
  const float s = __fdiv_rn(amax, Fp8Traits<F>::max_finite);
  return s == 0.0f ? 1.0f : s;
}

// ---- INT4 (FORMATS.md "INT4 K", "INT4 V", "Uniform INT4", "Packing") -----------------------

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

// Affine group scale and zero from the group's min and max: f16((mx - mn) / 15), f16(mn).
__device__ __forceinline__ __half int4_affine_scale(float mn, float mx) {
  return __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), 15.0f));
}
__device__ __forceinline__ __half int4_affine_zero(float mn) { return __float2half_rn(mn); }

// Affine code in 0..=15 for x with scale sf = f32(s) and zero zf = f32(z); 0 when sf == 0.
__device__ __forceinline__ int int4_affine_code(float x, float sf, float zf) {
  if (sf == 0.0f) return 0;
  const float q = rintf(__fdiv_rn(__fsub_rn(x, zf), sf));
  return (int)fminf(fmaxf(q, 0.0f), 15.0f);
}

// Uniform (per-tensor) INT4: codes as symmetric INT4 but with an f32 scale amax / 7.
__device__ __forceinline__ float int4_uniform_scale(float amax) { return __fdiv_rn(amax, 7.0f); }

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

// ---- fast exact quantization (no division per element) -------------------------------------
//
// The kernels must produce rne(fl(x / s)) exactly, but a correctly rounded division per element
// (and the conversion-unit instructions rintf / float→int use) would make quantization compute
// bound. Instead: y = x * r with r = fl(1 / s) is within |q| * 2^-22.9 of q = x / s, and fl(q)
// within |q| * 2^-24 of q, so unless y lies within kTieWindow of a rounding boundary, rounding y
// gives the same result as rounding fl(q). The rare cases near a boundary are flagged and the
// caller recomputes them with the exact formula above.

// Adding 1.5 * 2^23 to |y| < 2^22 rounds y to an integer (ties to even) held in the low bits.
constexpr float kRoundMagic = 12582912.0f;
// Half-width of the band around a half-integer in which y cannot decide the rounding of fl(q):
// 2^-17 is twice the error bound for |q| <= 16, the range where INT4 rounding decisions happen.
constexpr float kTieWindow = 0x1p-17f;

// INT4 code for num / s as a 4-bit two's-complement nibble: rne(fl(num / s)) clamped to
// [lo, hi] (lo, hi integers in [-8, 15]), given r = __frcp_rn(s) for an f16-valued s > 0.
// Sets `ambiguous` when the result must be recomputed exactly (int4_sym_code / _affine_code).
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

// FP8 bracket: the reciprocal scale nudged down and up by 2^-20, so that for every x,
// x * r_lo and x * r_hi enclose fl(x / s) (see Fp8Bracket::valid). When both ends encode to
// the same code, that is the code of fl(x / s): the encoding is monotonic.
struct Fp8Bracket {
  float lo, hi;
  __device__ __forceinline__ explicit Fp8Bracket(float s) {
    const float r = __frcp_rn(s);
    lo = __fmul_rn(r, 1.0f - 0x1p-20f);
    hi = __fmul_rn(r, 1.0f + 0x1p-20f);
  }
  // The error analysis needs normal, finite reciprocals (not true for extreme scales).
  __device__ __forceinline__ bool valid() const { return lo >= 0x1p-126f && hi <= 0x1.fffffep127f; }
};

// Encode the pair (x0, x1) / s into two FP8 codes (x0 in the low byte); sets `mismatch` bits when
// the bracket does not decide and fp8x2_encode(__fdiv_rn(x, s)) must be used instead.
template <int F>
__device__ __forceinline__ uint16_t fp8x2_quantize_fast(float x0, float x1, const Fp8Bracket &b,
                                                        uint32_t &mismatch) {
  const uint16_t lo = fp8x2_encode<F>(make_float2(__fmul_rn(x0, b.lo), __fmul_rn(x1, b.lo)));
  const uint16_t hi = fp8x2_encode<F>(make_float2(__fmul_rn(x0, b.hi), __fmul_rn(x1, b.hi)));
  mismatch |= (uint32_t)(lo ^ hi);
  return lo;
}

}  // namespace kvq
