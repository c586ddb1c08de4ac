// prefill/params.cuh: what a prefill launch passes its kernels (Params, a side's layout as the
// kernel reads it) and the tile shape both kernels share.
#pragma once

#include <stdint.h>

#include "kvq.h"
#include "prim/fast_div.cuh"

namespace kvq_prefill {

using namespace kvq;

constexpr int kRows = KVQ_PREFILL_TILE_ROWS;      // query rows per CTA (narrow tiles)
constexpr int kWideRows = 2 * kRows;                // query rows per CTA (wide tiles)
constexpr int kTripleRows = 3 * kRows;  // (triple tiles: the warp-specialized kernel)
constexpr int kTokens = KVQ_PREFILL_TILE_TOKENS;  // KV tokens per step
/// Threads of a CTA serving R rows: a warp per 16.
template <int R> __host__ __device__ constexpr int threads_of() { return R * 2; }
constexpr int kRun = 16;  // tokens per copied run: pages hold a multiple of 16 tokens
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kWsD = 128;  // the head_dim of the warp-specialized instances
/// E4M3 operands: log2 of the factor on a probability before its E4M3 rounding.
constexpr float kE4m3POffset = 8.f;
/// Log2 of how far a row's logits may exceed its reference max before O and l are rescaled to a
/// new one (16-bit P): most steps then skip the rescale.
constexpr float kRescaleSlack = 8.f;

/// One side (K or V) of the cache as the kernel reads it.
struct Side {
  int32_t format;  // kvq_format
  int32_t codes_off, codes_row, meta_off, meta_row, meta_step;
  int32_t direct;  // 16-bit codes, which are their own operands: copied, not decoded
};

/// The warp-specialized kernel's staging of quantized sides, run-major: run r of a step at
/// r * bytes holds kRun rows each of K's codes, K's metadata, V's codes and V's metadata, at
/// these offsets: a head section's layout at pages of kRun tokens, so that a run whose page
/// holds it that way is one bulk copy (Params::ws_whole_runs).
struct RunLayout {
  int k_codes, k_meta, v_codes, v_meta, bytes;
};
__host__ __device__ inline RunLayout ws_run_layout(const Side &k, const Side &v) {
  RunLayout l;
  l.k_codes = 0;
  l.k_meta = kRun * k.codes_row;
  l.v_codes = l.k_meta + kRun * k.meta_row;
  l.v_meta = l.v_codes + kRun * v.codes_row;
  l.bytes = l.v_meta + kRun * v.meta_row;
  return l;
}

/// Everything a prefill launch needs; built by the launcher from kvq_prefill_args.
struct Params {
  const uint8_t *pool;
  const float *k_scales, *v_scales;
  int64_t head_stride, block_stride, num_blocks;
  Side k, v;
  int32_t block_size;
  FastDiv block_div;  // by block_size: a token's page
  const void *q;
  void *out;
  float *lse;
  int64_t q_tok, q_head, o_tok, o_head, l_tok, l_head;
  const int32_t *qo_indptr, *block_tables, *context_lens;
  const float *sinks;
  float *ws_o, *ws_lse;
  int64_t ws_rows;  // rows of one split in the workspace: max_tokens * num_q_heads
  unsigned long long *counters;
  int32_t q_bf16;  // q element type: 1 = bf16, 0 = f16
  int32_t out_dtype;
  int32_t batch, num_q_heads, group, max_blocks, max_tokens;
  int32_t num_splits, split_tokens, window_left;
  float sm_scale;  // softmax_scale
  float soft_cap;  // <= 0: none
  const float *alibi_slopes;  // [num_q_heads] or null
  int32_t e4m3_operands;      // E4M3 caches may take the E4M3 instances (the launcher's choice)
  int32_t ws_turns;  // quantized warp-specialized: producer warps take turns at a step's copies
  // Quantized warp-specialized: the staging of a run (ws_run_layout; the launcher's, so that
  // the kernel reads its offsets as constants), and whether a run's raw rows are its page's
  // head section as it stands, copied as one instead of a side and a region at a time.
  RunLayout ws_run;
  int32_t ws_whole_runs;
  int32_t heads_first;  // blocks numbered KV head and split fastest (begin_tile)
};

/// Pool offset of block `entry`'s section, or -1 (and `*fault`) for an id outside the pool.
__device__ __forceinline__ int64_t block_offset(const Params &p, int entry, bool *fault) {
  if (entry >= 0 && (int64_t)entry < p.num_blocks) return (int64_t)entry * p.block_stride;
  *fault = true;
  return -1;
}

/// A side's per-head scale (FP8), or 1 for formats without one (null scales).
__device__ __forceinline__ float head_factor(const float *scales, int kvh) {
  return scales != nullptr ? scales[kvh] : 1.f;
}

}  // namespace kvq_prefill
