// decode/plan.cuh: what a decode launch needs (Params, built by decode.cu's launcher), the
// kernel's constants, and the compile-time plan of one instance (Cfg: step size, stage layout,
// shared memory, register budget).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "decode/frag.cuh"
#include "kvq.h"

namespace kvq_decode {

constexpr int kMaxWarps = KVQ_DECODE_MAX_WARPS;  // warps per CTA: 4, 8, 12, 16 (blockDim.x / 32)
// Tokens per copy chunk: one page segment, one MMA M / k-step.
constexpr int kChunk = KVQ_DECODE_CHUNK_TOKENS;
static_assert(kChunk == 16, "the MMA's M is 16 tokens");
constexpr int kRows = KVQ_DECODE_TILE_ROWS;  // query rows per CTA: the MMA N (8)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

/// Everything a decode launch needs; built by the launcher from kvq_decode_args.
struct Params {
  const uint8_t *pool;
  const float *k_scales, *v_scales;
  int64_t head_stride, block_stride, num_blocks;
  int32_t k_codes_off, k_meta_off, v_codes_off, v_meta_off;
  int32_t block_size;
  const void *q;
  void *out;
  float *lse;
  kvq_rows q_rows, out_rows, lse_rows;  // element strides (kvq.h)
  const int32_t *block_tables, *context_lens;
  float *ws_o, *ws_lse;
  uint32_t *ws_counters;
  unsigned long long *counters;  // may be null: faults met (kvq.h)
  int32_t q_bf16;     // q element type: 1 = bf16, 0 = f16
  int32_t out_dtype;  // kvq_dtype of out
  int32_t num_q_heads, num_kv_heads, group, q_len, m_tiles;
  int32_t max_blocks, num_splits, split_tokens;
  int32_t stages;       // copy stages per warp, 2..8
  float sm_scale_log2;  // softmax_scale * log2(e)
  const float *sinks;   // [num_q_heads] or null
  int32_t window_left;  // < 0: none
  float soft_cap;       // <= 0: none
  const float *alibi_slopes;  // [num_q_heads] or null
};

/// Shared-memory stages per warp a launch may use.
constexpr int kMinStages = KVQ_DECODE_MIN_STAGES, kMaxStages = KVQ_DECODE_MAX_STAGES;

__device__ __forceinline__ float load_elem(const void *p, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i])
              : __half2float(reinterpret_cast<const __half *>(p)[i]);
}

/// Offset (elements) of query row `b, h, i` in a tensor whose rows are at `r` (kvq_rows).
__device__ __forceinline__ int64_t row_at(const kvq_rows &r, int b, int h, int i) {
  return (int64_t)b * r.seq + (int64_t)i * r.token + (int64_t)h * r.head;
}

/// Tokens of sequence b the kernel may touch: its length clamped to what its table row maps
/// and to what the launch's splits cover (both hold for valid input); `*bad` is set when the
/// length had to be clamped.
__device__ __forceinline__ int seq_len(const Params &p, int b, bool *bad) {
  const long long cap = min((long long)p.max_blocks * p.block_size,
                            (long long)p.num_splits * p.split_tokens);
  const int len = p.context_lens[b];
  *bad = len < 0 || len > cap;
  return len < 0 ? 0 : (len > cap ? (int)cap : len);
}

/// The sink of tile row `gr` (of `rows`) of KV head kvh, in the log2 domain; -inf without
/// sinks or for a row past the tile's rows.
__device__ __forceinline__ float sink_log2(const Params &p, int kvh, int gr, int rows) {
  return p.sinks != nullptr && gr < rows ? p.sinks[kvh * p.group + gr / p.q_len] * kLog2e
                                         : -INFINITY;
}

/// Compile-time plan of one instance: step size, stage layout, shared memory.
template <Fmt KF, Fmt VF, int D>
struct Cfg {
  using F = Frag<KF, VF, D>;
  static constexpr int r128(int n) { return (n + 127) / 128 * 128; }
  // The most compact formats (issue-bound, small stages) take two 16-token chunks per step,
  // halving per-step overheads.
  static constexpr int CHUNK_RAW = kChunk * (F::KC_ROW + F::KM_ROW + F::VC_ROW + F::VM_ROW);
  static constexpr int CH = CHUNK_RAW <= 2560 ? 2 : 1;
  static constexpr int STEP = kChunk * CH;
  // One stage: STEP rows of each region (code rows padded to their pitch), 128-byte aligned.
  static constexpr int KC = r128(STEP * F::KPITCH);
  // K meta: STEP rows, and for int4-kc a slot per chunk for its block's s and z.
  static constexpr int KM = r128(STEP * F::KM_ROW + CH * F::KBM);
  static constexpr int VC = r128(STEP * F::VPITCH);
  static constexpr int VM = r128(STEP * F::VM_ROW);
  static constexpr int KC_OFF = 0, KM_OFF = KC, VC_OFF = KM_OFF + KM, VM_OFF = VC_OFF + VC;
  static constexpr int STAGE = VM_OFF + VM;
  // Shared memory: Q fragments and per-row values first, then the warps' rings of `stages`
  // stages each. After the main loop the ring area holds each warp's O tile and (m, l) per
  // row, then the split merge's weights and partial sums.
  // B fragments of q^T, two registers a lane per k-step, stored in pairs of k-steps.
  static constexpr int QFRAG = (D / 32 + D % 32 / 16) * 64 * 8;
  // int4-kc keys: each lane's 8 consecutive query elements of each 32 (f16, natural order).
  static constexpr int QNAT = F::KBLK ? D / 32 * 32 * 16 : 0;
  // Per row: q / out / lse offsets (int64), then factor, q scale, limit, L, M (before the warp
  // merge: the ALiBi slope and position); INT4-K zero terms (D / 32 groups x 16); a flag; per
  // row the window's first position.
  static constexpr int SMALL = kRows * 8 * 3 + kRows * 4 * 5 + (D / 32) * 16 * 4 + 16 + kRows * 4;
  static constexpr int PRE = r128(QFRAG + QNAT + SMALL);
  // Per-warp O tiles are stored at a pitch of D + 1 floats: the lanes of one store (rows 2t,
  // columns 8g + c) then spread over 16 banks instead of 4.
  static constexpr int OPITCH = D + 1;
  static constexpr int combine(int warps) {
    return warps * kRows * OPITCH * 4 + 2 * warps * kRows * 4;
  }
  static constexpr int merge(int warps) {
    return KVQ_DECODE_MAX_SPLITS * kRows * 4 + warps * 32 * 16;
  }
  static constexpr int cmax(int a, int b) { return a > b ? a : b; }
  /// Dynamic shared memory of a launch with `warps` warps of `stages` stages each.
  static constexpr int bytes(int warps, int stages) {
    return PRE + cmax(warps * stages * STAGE, cmax(combine(warps), merge(warps)));
  }
  // Register budget: 4 CTAs of 4 warps (2 of 8) per SM up to head_dim 64, and up to 128 when
  // either side is FP8 or INT8: those pairs mostly wait on memory and gain from 16 warps per SM. Other
  // pairs at 65..128 get 3 CTAs of 4 warps (1 of 8): INT4 is issue-bound and the tighter budget
  // costs it instructions, 16-bit pairs do not gain (docs/PERFORMANCE.md, v11). No spills at
  // these bounds.
  static constexpr bool FP8_SIDE = KF == Fmt::E4M3 || KF == Fmt::E5M2 || KF == Fmt::I8 ||
                                   VF == Fmt::E4M3 || VF == Fmt::E5M2 || VF == Fmt::I8;
  static constexpr int MAX_REGS =
      (D <= 64 || (D <= 128 && FP8_SIDE)) ? 128 : (D <= 128 ? 168 : 255);
};

}  // namespace kvq_decode
