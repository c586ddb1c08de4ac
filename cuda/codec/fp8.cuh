// codec/fp8.cuh: FORMATS.md "FP8 E4M3" and E5M2: one code per element, divided by a per-head
// (or per-tensor) f32 scale that lives outside the rows.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "codec/format.cuh"
#include "prim/bits.cuh"
#include "prim/packed.cuh"

// FP8 E4M3 unpacking in the decode kernel: sm_89+ has a conversion instruction; sm_80 moves the
// bits into an f16 whose value is the code's value * 2^-8 (exact, subnormals included), and the
// 2^8 is folded into the per-head scale.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVQ_E4M3_CVT 1
#else
#define KVQ_E4M3_CVT 0
#endif

namespace kvq {

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

// ---- fast exact quantization (no division per element; see codec/exact.cuh) ---------------

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

// Encode (x0, x1, x2, x3) / s into four FP8 codes (x0 in the low byte); `differ` gets the bits
// where the bracket's two ends encode differently: there the codes must come from
// fp8x2_encode(__fdiv_rn(x, s)) instead. Whole words, so one XOR compares four codes.
template <int F>
__device__ __forceinline__ uint32_t fp8x4_quantize_fast(float x0, float x1, float x2, float x3,
                                                        const Fp8Bracket &b, uint32_t &differ) {
  auto word = [&](float r) {
    const uint32_t c01 = fp8x2_encode<F>(make_float2(__fmul_rn(x0, r), __fmul_rn(x1, r)));
    const uint32_t c23 = fp8x2_encode<F>(make_float2(__fmul_rn(x2, r), __fmul_rn(x3, r)));
    return c01 | c23 << 16;
  };
  const uint32_t lo = word(b.lo), hi = word(b.hi);
  differ = lo ^ hi;
  return lo;
}

// Word `w` of four codes (x0 in the low byte) with each pair that `differ` marks (nonzero bits
// in its half) replaced by the codes of (x0, x1) / s, (x2, x3) / s by correctly rounded
// division. Out of line because it is rare (see int4_nibble_exact), and so that the hot path
// keeps whole words.
template <int F>
static __device__ __noinline__ uint32_t fp8x4_redo(uint32_t w, uint32_t differ, float x0,
                                                    float x1, float x2, float x3, float s) {
  uint32_t lo = w & 0xFFFFu, hi = w >> 16;
  if ((differ & 0xFFFFu) != 0)
    lo = fp8x2_encode<F>(make_float2(__fdiv_rn(x0, s), __fdiv_rn(x1, s)));
  if ((differ >> 16) != 0)
    hi = fp8x2_encode<F>(make_float2(__fdiv_rn(x2, s), __fdiv_rn(x3, s)));
  return lo | hi << 16;
}

// ---- decode-kernel unpacking ---------------------------------------------------------------

/// Two E4M3 codes (bytes 0 and 1 of `w`) and (bytes 2 and 3) → two f16x2.
__device__ __forceinline__ void e4m3x4_cvt(uint32_t w, uint32_t &lo, uint32_t &hi) {
#if KVQ_E4M3_CVT
  asm("{ .reg .b16 l, h;\n\t mov.b32 {l, h}, %2;\n\t cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
      " cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  (void)w;
  lo = hi = 0;  // not used on this architecture
#endif
}

/// Bit-move E4M3 → f16 * 2^-8: bytes (0, 2) → `a`, bytes (1, 3) → `b`.
__device__ __forceinline__ void e4m3x4_bits(uint32_t w, uint32_t &a, uint32_t &b) {
  a = ((w << 8) & 0x80008000u) | ((w << 7) & 0x3F803F80u);
  b = (w & 0x80008000u) | ((w >> 1) & 0x3F803F80u);
}

// ---- the codec ----------------------------------------------------------------------------

template <int F> struct Fp8Codec : UngroupedRows<16, 8> {
  static_assert(F == kFp8E4m3 || F == kFp8E5m2, "FP8 formats only");
  static constexpr bool kDense = true;
  static constexpr bool kHeadScale = true;  // per head (or tensor), outside the rows
  static constexpr float kHeadMax = Fp8Traits<F>::max_finite;
  static constexpr bool kPackedExtremes = true;

  // ---- row role ----

  template <typename Values>
  static __device__ __forceinline__ void encode(const Values &v, const Extremes &, const Extremes &,
                                                int chunk, const RowRef &r, bool active) {
    const float s = active ? r.head_scale : 1.0f;  // idle lanes: any valid scale
    const Fp8Bracket bracket(s);
    uint4 raw;
    uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&raw);
    uint32_t differ[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = fp8x4_quantize_fast<F>(v(4 * j), v(4 * j + 1), v(4 * j + 2), v(4 * j + 3), bracket,
                                    differ[j]);
    // Undecided words are redone pair by pair, not all 16 elements: inputs that sit on a rounding
    // tie of x / s (data on a grid commensurate with the scale, e.g. 3.75 / (10 / 448) = 168, an
    // E4M3 midpoint) leave a few undecided pairs in most warps, and a divergent branch costs the
    // warp only the words some lane needs.
    if (!bracket.valid()) differ[0] = differ[1] = differ[2] = differ[3] = ~0u;
    if (__builtin_expect((differ[0] | differ[1] | differ[2] | differ[3]) != 0, 0)) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (differ[j] != 0)
          w[j] = fp8x4_redo<F>(w[j], differ[j], v(4 * j), v(4 * j + 1), v(4 * j + 2),
                               v(4 * j + 3), s);
    }
    if (active) reinterpret_cast<uint4 *>(r.codes)[chunk] = raw;
  }

  // This thread's largest |x| (as extremes: lo 0) of a chunk of f16 / bf16 input, on packed
  // pairs; false when the chunk holds a NaN or ±Inf. Append checks it against the saturation
  // limit: one compare a chunk, where the f32 values took one an element.
  template <typename In>
  static __device__ __forceinline__ bool packed_extremes(const RawChunk<In, kEpt> &raw,
                                                         Extremes &ex) {
    ex.lo = 0.0f;
    return packed_abs_max<In, kEpt / 2>(raw.q, ex.hi);
  }

  static __device__ __forceinline__ void decode(const RowRef &r, int chunk, float (&v)[kEpt]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint16_t *c = reinterpret_cast<const uint16_t *>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __half22float2(fp8x2_to_half2<F>(c[i]));
      v[2 * i] = __fmul_rn(f.x, r.head_scale);
      v[2 * i + 1] = __fmul_rn(f.y, r.head_scale);
    }
  }

  /// The chunk's values without the head scale as f16 pairs (element 2i low in h[i]): exact,
  /// every FP8 value is an f16. For operand tiles (the prefill kernel).
  static __device__ __forceinline__ void decode_f16(const RowRef &r, int chunk,
                                                    uint32_t (&h)[kEpt / 2]) {
    const uint4 raw = reinterpret_cast<const uint4 *>(r.codes)[chunk];
    const uint16_t *c = reinterpret_cast<const uint16_t *>(&raw);
#pragma unroll
    for (int i = 0; i < kEpt / 2; ++i) h[i] = h2_bits(fp8x2_to_half2<F>(c[i]));
  }

  // Calibration scale of the dense path.
  static __device__ __forceinline__ float scale_from_amax(float amax) {
    return fp8_scale_from_amax<F>(amax);
  }

  // ---- decode-kernel fragment roles (decode/frag.cuh): codes become f16, exactly ----

  // E5M2 pairs only with itself: it keeps the instance count down.
  static constexpr bool kDecodeK = true, kDecodeV = true, kDecodeMixed = F == kFp8E4m3;
  static constexpr kvq_decode::Fmt kDecodeFmt =
      F == kFp8E4m3 ? kvq_decode::Fmt::E4M3 : kvq_decode::Fmt::E5M2;
  static constexpr bool kBf16Operands = false;
  static constexpr bool kGroupFrags = false;

  /// Factor between an unpacked code and its value, before the per-head scale.
  static __device__ __forceinline__ float unit() {
#if KVQ_E4M3_CVT
    return 1.0f;
#else
    return F == kFp8E4m3 ? 256.0f : 1.0f;
#endif
  }

  /// Factor on the query of k-step j: none.
  static __device__ __forceinline__ float q_scale(int) { return 1.f; }

  /// Element (0..) of a load that half `e` of K fragment register `p` holds.
  static __device__ __forceinline__ int k_pair_elem(int p, int e) {
    if constexpr (F == kFp8E4m3 && !KVQ_E4M3_CVT) {
      return 4 * (p / 2) + (p % 2) + 2 * e;
    } else {
      return 2 * p + e;
    }
  }

  /// K role: code word `w` → two fragment registers (pairs as k_pair_elem says).
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint32_t (&out)[2]) {
    if constexpr (F == kFp8E5m2) {
      out[0] = prmt(w, 0u, 0x1404);
      out[1] = prmt(w, 0u, 0x3424);
    } else {
#if KVQ_E4M3_CVT
      e4m3x4_cvt(w, out[0], out[1]);
#else
      e4m3x4_bits(w, out[0], out[1]);
#endif
    }
  }

  /// V role: interleave word `a` of one token's codes (the lower k index) and word `b` of the
  /// next token's into four B-fragment registers, register c holding column c of both.
  static __device__ __forceinline__ void v_unpack(uint32_t a, uint32_t b, uint32_t (&out)[4]) {
    if constexpr (F == kFp8E5m2) {
      const uint32_t lo = prmt(a, b, 0x5140), hi = prmt(a, b, 0x7362);
      out[0] = prmt(lo, 0u, 0x1404);
      out[1] = prmt(lo, 0u, 0x3424);
      out[2] = prmt(hi, 0u, 0x1404);
      out[3] = prmt(hi, 0u, 0x3424);
    } else {
#if KVQ_E4M3_CVT
      e4m3x4_cvt(prmt(a, b, 0x5140), out[0], out[1]);
      e4m3x4_cvt(prmt(a, b, 0x7362), out[2], out[3]);
#else
      e4m3x4_bits(prmt(a, b, 0x5410), out[0], out[1]);
      e4m3x4_bits(prmt(a, b, 0x7632), out[2], out[3]);
#endif
    }
  }
};

template <> struct Codec<kFp8E4m3> : Fp8Codec<kFp8E4m3> {};
template <> struct Codec<kFp8E5m2> : Fp8Codec<kFp8E5m2> {};

}  // namespace kvq
