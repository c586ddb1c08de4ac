// codec/int4_kc.cuh: FORMATS.md "INT4 keys per channel" in a paged cache: sealing a full block
// (each channel's G window values quantized as one affine group, INT4 V's math along tokens) and
// decoding a sealed block's codes. Not a row codec (no Codec<kInt4Kc>): its groups cross rows,
// so append.cu serves it with kernels of its own. Every rounding step is an explicit `_rn`
// intrinsic (or rintf, ties to even), whatever flags the including file is compiled with.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/exact.cuh"
#include "codec/int4_affine.cuh"
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

// s and z of one channel of a block from its G window values (src/format/int4.rs's
// quantize_affine_group).
template <int G>
__device__ __forceinline__ KcGroup int4_kc_group(const uint32_t (&w)[G], int half) {
  float mn = kc_window_value(w[0], half), mx = mn;
#pragma unroll
  for (int t = 1; t < G; ++t) {
    mn = fminf(mn, kc_window_value(w[t], half));
    mx = fmaxf(mx, kc_window_value(w[t], half));
  }
  // A zero extreme is +0.0 (FORMATS.md), whichever zero fminf / fmaxf kept.
  mn = __fadd_rn(mn, 0.0f);
  mx = __fadd_rn(mx, 0.0f);
  const __half s = int4_affine_scale(mn, mx), z = int4_affine_zero(mn);
  return {__half_as_ushort(s), __half_as_ushort(z), __half2float(s), __half2float(z)};
}

// Code of x in its group: clamp(rne((x - z) / s), 0, 15), 0 when s == 0. Divides: sealing runs
// once per G tokens. A NaN quotient (only from a window never written) clamps to 0 as the CPU's
// float-to-u8 cast does.
__device__ __forceinline__ uint32_t int4_kc_code(float x, const KcGroup &g) {
  if (g.sf == 0.0f) return 0;
  const float q = rintf(__fdiv_rn(__fsub_rn(x, g.zf), g.sf));
  return (uint32_t)fminf(fmaxf(q, 0.0f), 15.0f);
}

// Seal channels 2p and 2p + 1 of a block from their window values, w[t] holding token t's pair
// (channel 2p in the low half): the code byte of token t (channel 2p in the low nibble) goes to
// byte t % 4 of codes[t / 4], the pair's s and z to s2 and z2 (channel 2p in the low half).
template <int G>
__device__ __forceinline__ void int4_kc_seal_pair(const uint32_t (&w)[G], uint32_t (&codes)[G / 4],
                                                  uint32_t &s2, uint32_t &z2) {
#pragma unroll
  for (int i = 0; i < G / 4; ++i) codes[i] = 0;
  s2 = z2 = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const KcGroup g = int4_kc_group(w, half);
#pragma unroll
    for (int t = 0; t < G; ++t)
      codes[t / 4] |= int4_kc_code(kc_window_value(w[t], half), g) << (8 * (t % 4) + 4 * half);
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

}  // namespace kvq
