// prefill/int4_kc.cuh: int4-kc keys (kvq.h's layout note on KVQ_INT4_KC), in instances of
// their own (KC): a sealed block's code rows and its s, z are staged and decoded; the rows of the
// sequence's open block (its f16 window) are copied into the operand tile as they are, at decode
// time. A staged step: kTokens rows of head_dim / 2 code bytes, then a slot of s[head_dim],
// z[head_dim] (f16) per run (side_of gives the side meta_row head_dim / 4, so that stage_bytes
// counts the 4 slots).
#pragma once

#include <cuda_fp16.h>

#include "prefill/copies.cuh"
#include "prim/bits.cuh"
#include "prim/cp_async.cuh"

namespace kvq_prefill {

using namespace kvq;

/// The first position of a sequence of `len` tokens that lies in no sealed block (of
/// `block_size` tokens): positions before it are sealed (layout.rs, BlockLayout::sealed).
__device__ __forceinline__ int kc_sealed_end(int len, int block_size) {
  return len / block_size * block_size;
}

/// Slot of the s and z that run `run` of a step reads: its block's first run in the step (the
/// only one of that block whose copies include them). A run lies in one block (blocks hold a
/// multiple of 16 tokens), and the runs before it in its block are the step's runs before it.
__device__ __forceinline__ int kc_meta_slot(const StepPages &pg, int run) {
  return max(run - pg.off[run] / kRun, 0);
}

/// Queue the copies of int4-kc keys of one step into staging area `st`, for its first `nruns`
/// runs (callers pass only runs of sealed blocks): each run's code rows, and its block's s and
/// z into its slot where the run is the block's first in the step (kc_meta_slot). Runs of
/// blocks outside the pool read as zeros.
template <int D, int kThreads>
__device__ __forceinline__ void issue_kc(const Side &s, const uint8_t *head, const StepPages &pg,
                                         int nruns, uint8_t *st) {
  constexpr int CU = D / 2;  // 16-byte units of a run's codes: 16 rows of head_dim / 2 bytes
  constexpr int MU = D / 4;  // 16-byte units of a block's s and z: 4 head_dim bytes
#pragma unroll 1
  for (int run = 0; run < nruns; ++run) {
    const int64_t at = pg.at[run];
    const uint8_t *sec = head + (at >= 0 ? at : 0);
    const int units = kc_meta_slot(pg, run) == run ? CU + MU : CU;
    uint8_t *dc = st + run * kRun * (D / 2), *dm = st + kTokens * (D / 2) + run * (4 * D);
    for (int u = threadIdx.x; u < units; u += kThreads) {
      const bool meta = u >= CU;
      const int x = meta ? u - CU : u;
      const uint8_t *src = sec + (meta ? s.meta_off : s.codes_off + pg.off[run] * (D / 2)) + x * 16;
      cp_async16(smem_u32((meta ? dm : dc) + x * 16), src, at >= 0 ? 16u : 0u);
    }
  }
}

/// Elements 8c .. 8c + 7 of a sealed int4-kc row as f16 pairs (element 8c + 2i low in h[i])
/// from their codes (element 8c in bits 0-3) and their channels' f16 s and z: q * s + z rounded
/// once to f16 (int4_kc_decode8's f32 fma, rounded again, may differ by one f16 ulp), clamped to
/// +-65504 (s rounded up can carry z + 15 s past it).
__device__ __forceinline__ void kc_decode8_f16(uint32_t codes, const uint4 &s, const uint4 &z,
                                               uint32_t (&h)[4]) {
  const uint32_t sw[4] = {s.x, s.y, s.z, s.w}, zw[4] = {z.x, z.y, z.z, z.w};
  const __half2 bias = __float2half2_rn(1024.0f), lim = __float2half2_rn(65504.0f);
  // Byte i holds elements 8c + 2i (low nibble) and 8c + 2i + 1; each becomes 1024 + n, exact.
  const uint32_t w4 = codes >> 4;
  const uint32_t x[4] = {nibble_pair_f16<0, 0>(codes, w4), nibble_pair_f16<1, 0>(codes, w4),
                         nibble_pair_f16<2, 0>(codes, w4), nibble_pair_f16<3, 0>(codes, w4)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 v = __hfma2(__hsub2(bits_h2(x[i]), bias), bits_h2(sw[i]), bits_h2(zw[i]));
    h[i] = h2_bits(__hmin2(__hmax2(v, __hneg2(lim)), lim));
  }
}

/// One step of int4-kc keys into operand tile `tile`: rows before `sealed` (relative to the
/// step; a multiple of 16) decoded from the staged codes and their block's s and z, rows from
/// `sealed` on (the open block) copied from the pool's window rows by cp.async, committed here
/// as one group the caller waits for before the MMAs read the tile; rows outside [lo, hi)
/// become zeros.
template <int D, bool SW, int NT>
__device__ __forceinline__ void decode_kc(const uint8_t *raw, const Side &s, const uint8_t *head,
                                          const StepPages &pg, uint8_t *tile, int lo, int hi,
                                          int sealed) {
  constexpr int kChunks = D / 8;  // 16-byte units of an operand row: 4 code bytes each
  const uint8_t *meta = raw + kTokens * (D / 2);
  // The s and z of chunk `cur % kChunks` of slot `cur / kChunks`, loaded again only when they
  // change: where kChunks divides NT a thread keeps one chunk, so once per block and step.
  int cur = -1;
  uint4 sv = make_uint4(0u, 0u, 0u, 0u), zv = sv;
  for (int u = threadIdx.x; u < kTokens * kChunks; u += NT) {
    const int j = u / kChunks, c = u % kChunks, run = j / kRun;
    uint8_t *dst = tile + tile_at<D, SW, kTokens>(j, c);
    const bool live = j >= lo && j < hi;
    if (live && j >= sealed) {
      const int64_t at = pg.at[run];
      const int64_t row = at + s.codes_off + (int64_t)(pg.off[run] + j % kRun) * (2 * D) + c * 16;
      cp_async16(smem_u32(dst), head + (at >= 0 ? row : 0), at >= 0 ? 16u : 0u);
      continue;
    }
    uint32_t h[4] = {0u, 0u, 0u, 0u};
    if (live) {
      const int slot = kc_meta_slot(pg, run);
      if (slot * kChunks + c != cur) {
        cur = slot * kChunks + c;
        const uint8_t *m = meta + slot * (4 * D) + c * 16;
        sv = *reinterpret_cast<const uint4 *>(m);
        zv = *reinterpret_cast<const uint4 *>(m + 2 * D);
      }
      kc_decode8_f16(*reinterpret_cast<const uint32_t *>(raw + j * (D / 2) + c * 4), sv, zv, h);
    }
    *reinterpret_cast<uint4 *>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
  }
  cp_async_commit();
}

}  // namespace kvq_prefill
