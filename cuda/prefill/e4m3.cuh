// prefill/e4m3.cuh: E4M3 operands (the E4M3 instances: an fp8-e4m3 cache on FP8 tensor cores,
// opt-in). The codes go to the MMAs as stored; the query rows and the probabilities become E4M3
// too (the accuracy this costs: docs/ACCURACY.md). A query row is quantized under its own scale,
// amax / 448 (FORMATS.md's E4M3 calibration), which multiplies its scores; a probability p is
// taken as the E4M3 of p * 2^8, which keeps the largest in E4M3's normal range.
//
// The k32 MMAs take both operands K-major (prim/wgmma.cuh). K's rows are: a B128 tile of
// kTokens rows of 128 codes. For O += P V the keys are the reduction, so V goes transposed into
// a B64 tile: row d holds channel d of the step's 64 keys. P comes from the S accumulators,
// where thread t holds keys 8 j + 2 (t % 4) + {0, 1}, while an A fragment's byte i of register
// 0 / 2 is key position 4 (t % 4) + i (+ 16): the keys' order is free in a sum, so V's row
// takes, at position 4 m + i of each 16, key 2 m + {0, 1, 8, 9}[i] of those 16: P's registers
// are then A fragments as they stand, after one byte permute per pair.
#pragma once

#include "codec/fp8.cuh"
#include "prefill/layout.cuh"
#include "prefill/wg_mma.cuh"
#include "prim/convert.cuh"
#include "prim/wgmma.cuh"

namespace kvq_prefill {

using namespace kvq;

/// Four words as their 4 x 4 byte transpose: out[b] holds byte b of a, b, c, d (low to high).
__device__ __forceinline__ void transpose_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d,
                                                uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410), out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410), out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

/// stage_e4m3's work. ALL: every row of the step lies in [lo, hi), as in all but a sequence's
/// first and last steps, so that no row is tested.
template <int NP, bool ALL>
__device__ __forceinline__ void stage_e4m3_rows(const uint8_t *rk, const uint8_t *rv, int run,
                                                uint8_t *kt, uint8_t *vt, int lo, int hi,
                                                unsigned pt) {
  const unsigned live = hi > lo ? (unsigned)(hi - lo) : 0u;
  // K: thread pt copies chunk pt % 8 of rows pt / 8 + i NP / 8, whose swizzle (row % 8) is the
  // same for every i, so that one address each side serves all of them.
  static_assert(NP % 64 == 0 && kTokens * 8 % NP == 0, "whole columns of chunks a thread");
  constexpr int kKUnits = kTokens * 8 / NP, kApart = NP / 8;
  static_assert(kApart % kRun == 0, "a thread's rows whole runs apart");
  const unsigned r0 = pt / 8, c = pt % 8;
  const uint8_t *const ksrc = rk + (r0 / kRun) * run + (r0 % kRun) * 128 + c * 16;
  uint8_t *const kdst = kt + b128_at<kTokens>(r0, c);
  uint4 kx[kKUnits];
#pragma unroll
  for (int i = 0; i < kKUnits; ++i) {
    kx[i] = make_uint4(0, 0, 0, 0);
    if (ALL || r0 + i * kApart - lo < live)
      kx[i] = *reinterpret_cast<const uint4 *>(ksrc + i * (kApart / kRun) * run);
  }
#pragma unroll
  for (int i = 0; i < kKUnits; ++i)
    *reinterpret_cast<uint4 *>(kdst + i * kApart * 128) = kx[i];
  // V: keys 16 q .. 16 q + 15 of channels 4 w .. 4 w + 3 a thread (a warp reads whole rows).
  constexpr int kVUnits = kTokens / 16 * (kWsD / 4);
  static_assert(kVUnits <= NP, "a V unit a producer thread");
  if (pt < kVUnits) {
    const unsigned q = pt / 32, w = pt % 32;
    static_assert(kRun == 16, "a V unit's keys one run");
    const uint8_t *const vsrc = rv + q * run + 4 * w;
    uint32_t x[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      x[k] = 0u;
      if (ALL || 16 * q + k - lo < live)
        x[k] = *reinterpret_cast<const uint32_t *>(vsrc + k * 128);
    }
    uint32_t t[4][4];  // [m][b]: positions 4 m .. 4 m + 3 of channel 4 w + b
#pragma unroll
    for (int m = 0; m < 4; ++m)
      transpose_bytes(x[2 * m], x[2 * m + 1], x[2 * m + 8], x[2 * m + 9], t[m]);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const unsigned d = 4 * w + b;
      *reinterpret_cast<uint4 *>(vt + d * 64 + ((q ^ ((d >> 1) & 3)) << 4)) =
          make_uint4(t[0][b], t[1][b], t[2][b], t[3][b]);
    }
  }
}

/// One step's raw E4M3 rows (kTokens rows of kWsD codes each side, staging rows as the pool
/// holds them, run r of a side `run` bytes after its run 0) into the operand tiles: K's rows
/// into B128 tile kt, V's transposed into B64 tile vt (in the key order above); rows outside
/// [lo, hi) as zeros (staging rows there may hold anything, NaN codes included). Thread pt of
/// NP.
template <int NP>
__device__ __forceinline__ void stage_e4m3(const uint8_t *rk, const uint8_t *rv, int run,
                                           uint8_t *kt, uint8_t *vt, int lo, int hi,
                                           unsigned pt) {
  static_assert(kWsD == 128 && kTokens == 64, "128 codes a row, 64 keys a step");
  if (lo <= 0 && hi >= kTokens) stage_e4m3_rows<NP, true>(rk, rv, run, kt, vt, lo, hi, pt);
  else stage_e4m3_rows<NP, false>(rk, rv, run, kt, vt, lo, hi, pt);
}

/// This thread's Q fragments for S's k32 steps (rows ra = 16 cw + lane / 4 and rb = ra + 8 of
/// the Q tile, 16-bit B128), each row quantized to E4M3 under its own scale; *scale_a / *scale_b
/// get the two rows' scales.
template <int R>
__device__ __forceinline__ void e4m3_q_fragments(const uint8_t *qs, int cw, bool q_bf16,
                                                 uint32_t (&qf)[kWsD / 32][4], float *scale_a,
                                                 float *scale_b) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float x[2][kWsD / 32][2][4];  // row a / b, k-step, its half, element
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < kWsD / 32; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Elements 32 c + 16 h + 4 t .. + 3: half of a 16-byte chunk.
        const uint2 w = *reinterpret_cast<const uint2 *>(
            qs + b128_at<R>(cw * 16 + g + 8 * r, 4 * c + 2 * h + t / 2) + (t % 2) * 8);
        const uint32_t half_bits[4] = {w.x & 0xFFFFu, w.x >> 16, w.y & 0xFFFFu, w.y >> 16};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = q_bf16 ? bf16_from_bits((uint16_t)half_bits[e])
                                 : half_from_bits((uint16_t)half_bits[e]);
          x[r][c][h][e] = v;
          amax[r] = fmaxf(amax[r], fabsf(v));
        }
      }
  float scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFull, amax[r], 1));
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFull, amax[r], 2));
    scale[r] = fp8_scale_from_amax<kFp8E4m3>(amax[r]);
  }
#pragma unroll
  for (int c = 0; c < kWsD / 32; ++c)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float *v = x[r][c][h];
        const uint32_t lo = fp8x2_encode<kFp8E4m3>(
            make_float2(__fdiv_rn(v[0], scale[r]), __fdiv_rn(v[1], scale[r])));
        const uint32_t hi = fp8x2_encode<kFp8E4m3>(
            make_float2(__fdiv_rn(v[2], scale[r]), __fdiv_rn(v[3], scale[r])));
        qf[c][r + 2 * h] = lo | hi << 16;
      }
  *scale_a = scale[0], *scale_b = scale[1];
}

#if KVQ_HAS_WGMMA
/// S = Q K^T on a warpgroup from E4M3 operands, waited: Q's fragments qf, K the B128 tile whose
/// descriptor's low word is k_lo (32 codes per k-step).
__device__ __forceinline__ void wg_qk_e4m3(float (&s)[8][4], const uint32_t (&qf)[kWsD / 32][4],
                                           uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kWsD / 32; ++kk)
    wgmma_m64n64k32_e4m3(s, qf[kk], b128_desc_at(k_lo, kk * 32), kk > 0);
  wg_wait_scores(s);
}

/// O += P V on a warpgroup from E4M3 operands, waited: P from this thread's E4M3 pairs (n-tile
/// j, rows a / b: WarpSoftmax's pa), V^T the B64 tile at shared address vt.
__device__ __forceinline__ void wg_pv_e4m3(float (&o)[kWsD / 8][4], const uint32_t (&pa)[8][2],
                                           uint32_t vt) {
#pragma unroll
  for (int i = 0; i < kWsD / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
  // The A fragments of the two k32 steps: a register is two of pa's pairs.
  uint32_t a[kTokens / 32][4];
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c) {
    a[c][0] = __byte_perm(pa[4 * c][0], pa[4 * c + 1][0], 0x5410);
    a[c][1] = __byte_perm(pa[4 * c][1], pa[4 * c + 1][1], 0x5410);
    a[c][2] = __byte_perm(pa[4 * c + 2][0], pa[4 * c + 3][0], 0x5410);
    a[c][3] = __byte_perm(pa[4 * c + 2][1], pa[4 * c + 3][1], 0x5410);
  }
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c)
    for (int e = 0; e < 4; ++e) fence_operand(a[c][e]);
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c) wgmma_m64n128k32_e4m3(o, a[c], b64_desc(vt + c * 32), 1);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kWsD / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c)
    for (int e = 0; e < 4; ++e) fence_operand(a[c][e]);
}
#endif

}  // namespace kvq_prefill
