// prefill/copies.cuh: a step's copies from the paged pool: 16-bit sides straight into operand
// tiles, quantized sides raw into a staging area.
#pragma once

#include "prefill/layout.cuh"
#include "prim/cp_async.cuh"

namespace kvq_prefill {

using namespace kvq;

/// The sections of one step's pages: for each run of 16 tokens, the byte offset in the pool of
/// its first row's head section (block * block_stride + in-page row 0 of the run), or -1 when
/// the run is past the keys or its block lies outside the pool (zero-filled, counted).
struct StepPages {
  int64_t at[kTokens / kRun];
  int32_t off[kTokens / kRun];  // the run's first row within its page
};

/// Queue the copies of a direct side's rows of one step into operand tile `op`: thread t of the
/// kThreads that copy (t = threadIdx.x % kThreads) copies 16-byte unit t of every kThreads, rows
/// at or past `hi` (relative to the step) zero-filled so that never-written codes cannot reach
/// the MMAs.
template <int D, bool SW, int kThreads>
__device__ __forceinline__ void issue_direct(const uint8_t *head, int32_t codes_off,
                                             const StepPages &pg, int hi, uint8_t *op) {
  constexpr int P = pitch<D>();
  constexpr int UR = D * 2 / 16;  // 16-byte units of a row
  constexpr int N = kTokens * UR / kThreads;
  constexpr int RPI = kThreads / UR;  // rows one pass of the block covers
  static_assert(kTokens * UR % kThreads == 0, "whole units per thread");
  static_assert(kTokens / kRun == 4, "four runs a step (pick below)");
  // The run's first row in the pool (or -1), by selects: an array indexed at run time would
  // live in local memory.
  int64_t first[4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    first[r] = pg.at[r] < 0 ? -1 : pg.at[r] + codes_off + (int64_t)pg.off[r] * (D * 2);
  if constexpr (kThreads % UR == 0 && kRun % RPI == 0) {
    // Pass i covers rows [i RPI, (i + 1) RPI), all in run i RPI / kRun: the run and the row's
    // place in it are known at compile time, the thread's row and column once (RPI is a
    // multiple of 8, so a B128 tile's swizzle is the same in every pass).
    static_assert(!SW || RPI % 8 == 0, "one swizzle per thread");
    const int row0 = threadIdx.x % kThreads / UR, c = threadIdx.x % UR;
    const uint32_t dst = smem_u32(op) + tile_at<D, SW, kTokens>(row0, c);
    constexpr int kRowBytes = SW ? 128 : P;
    const int in_row = row0 * (D * 2) + c * 16;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int64_t at = first[i * RPI / kRun];
      const bool live = at >= 0 && row0 + i * RPI < hi;
      const uint8_t *src = head + (live ? at + (i * RPI % kRun) * (D * 2) + in_row : 0);
      cp_async16(dst + i * RPI * kRowBytes, src, live ? 16u : 0u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int u = threadIdx.x % kThreads + i * kThreads;
      const int row = u / UR, c = u - row * UR, run = row / kRun;
      const int64_t at =
          run == 0 ? first[0] : run == 1 ? first[1] : run == 2 ? first[2] : first[3];
      const bool live = at >= 0 && row < hi;
      const uint8_t *src = head + (live ? at + (int64_t)(row % kRun) * (D * 2) + c * 16 : 0);
      cp_async16(smem_u32(op + tile_at<D, SW, kTokens>(row, c)), src, live ? 16u : 0u);
    }
  }
}

/// Queue the copies of a quantized side's codes and metadata of one step into staging area
/// `st` (kTokens rows of codes, then of metadata); runs past the keys are skipped (never
/// decoded), runs of blocks outside the pool read as zeros.
template <int kThreads>
__device__ __forceinline__ void issue_raw(const Side &s, const uint8_t *head, const StepPages &pg,
                                          int nruns, uint8_t *st) {
  const int cr = s.codes_row, mr = s.meta_row;  // 16-byte units of a run's codes, metadata
#pragma unroll 1
  for (int run = 0; run < nruns; ++run) {
    const int64_t at = pg.at[run];
    const int32_t off = pg.off[run];
    const uint8_t *sec = head + (at >= 0 ? at : 0);
    uint8_t *dc = st + run * kRun * cr, *dm = st + kTokens * cr + run * kRun * mr;
    for (int u = threadIdx.x; u < cr + mr; u += kThreads) {
      const bool meta = u >= cr;
      const int x = meta ? u - cr : u;
      const int row0 = meta ? s.meta_off + off * mr : s.codes_off + off * cr;
      const uint8_t *src = sec + row0 + x * 16;
      cp_async16(smem_u32((meta ? dm : dc) + x * 16), src, at >= 0 ? 16u : 0u);
    }
  }
}

}  // namespace kvq_prefill
