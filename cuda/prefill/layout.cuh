// prefill/layout.cuh: where operand tiles lie in shared memory (padded rows, or B128 tiles for
// wgmma) and the block-synchronous kernel's dynamic shared memory.
#pragma once

#include "prefill/params.cuh"
#include "prim/cp_async.cuh"
#include "prim/wgmma.cuh"

namespace kvq_prefill {

using namespace kvq;

/// Bytes of one row of operand tiles in shared memory: 16 bytes of padding put the 8 rows that
/// one ldmatrix reads on distinct 16-byte bank groups at every supported head_dim.
template <int D> __host__ __device__ constexpr int pitch() { return D * 2 + 16; }

/// Raw bytes of one step of a quantized side: kTokens rows of codes, then of metadata (whole
/// KiB, so that every operand tile after it starts on a 1024-byte boundary).
__host__ __device__ inline int stage_bytes(const Side &s) {
  return (kTokens * (s.codes_row + s.meta_row) + 1023) / 1024 * 1024;
}

/// Whether the instance of head_dim D runs its MMAs as wgmma (sm_90a; whole 64-column blocks on
/// the pipelined schedule): its operand tiles are then B128 tiles (prim/wgmma.cuh), else rows of
/// pitch<D>() bytes.
template <int D> __host__ __device__ constexpr bool uses_wgmma() {
  return KVQ_HAS_WGMMA && D <= 128 && D % 64 == 0;
}

/// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `ROWS` rows: an operand tile
/// (kTokens rows) or the Q tile (a CTA's rows).
template <int D, bool SW, int ROWS> __device__ __forceinline__ int tile_at(int row, int chunk) {
  if constexpr (SW) return b128_at<ROWS>(row, chunk);
  else return row * (D * 2 + 16) + chunk * 16;
}

/// Whether head_dim D runs the pipelined schedule: Q fragments held in registers, every side
/// with two operand tiles, and a quantized side decoded one step ahead of the MMAs (no barrier
/// between decode and MMA). Wider rows keep Q in shared memory and decode each step between two
/// barriers into one operand tile, so two blocks still fit an SM.
__host__ __device__ constexpr bool pipelined(int d) { return d <= 128; }

/// Whether Q's fragments stay in registers across the steps. Else each step reads them from the
/// Q tile: wgmma takes them straight from shared memory (a descriptor, as for K), mma.sync by
/// ldmatrix. With wgmma only narrow tiles at head_dim 128 hold them (and alias the Q tile, so
/// that two blocks fit an SM beside quantized sides); at 64 ptxas 13.0 gave the registers of
/// held fragments that feed wgmma to other values inside the loop (the SASS showed it), and wide
/// tiles need those registers for their accumulators.
template <int D, int R> __host__ __device__ constexpr bool q_in_registers() {
  return pipelined(D) && D > 64 && (!uses_wgmma<D>() || R == kRows);
}

/// Where a launch's dynamic shared memory goes (offsets from its first 1024-byte boundary; the
/// size has room for the alignment): the Q tile, then per side its operand tiles (two, or one for
/// a quantized side off the pipelined schedule) and for a quantized side two staging areas.
/// When Q is held in registers and its tile is the size of an operand tile, the Q tile is K's
/// second operand tile: Q is in registers before step 1's copies or decode write there. Tiles are
/// sized for rows of pitch<D>() bytes, which also holds a B128 tile (a multiple of 1024 bytes at
/// every supported head_dim).
struct Layout {
  int q, k_op, k_stage, v_op, v_stage, bytes;
};

/// Bytes of a zero row (zero codes and metadata are zeros in every format: dead rows can be
/// decoded from it): a row of codes or metadata at every head_dim.
constexpr int kZeroRow = 512;
template <int D, int R> __host__ __device__ inline Layout smem_layout(const Side &k, const Side &v) {
  constexpr int d = D;
  const bool pipe = pipelined(d);
  const int tile = kTokens * (2 * d + 16);
  Layout l;
  int at = 0;
  const bool q_alias = q_in_registers<D, R>() && R == kTokens;
  l.q = at, at += q_alias ? 0 : R * (2 * d + 16);
  l.k_op = at, at += (k.direct || pipe) ? 2 * tile : tile;
  l.k_stage = at, at += k.direct ? 0 : 2 * stage_bytes(k);
  l.v_op = at, at += (v.direct || pipe) ? 2 * tile : tile;
  l.v_stage = at, at += v.direct ? 0 : 2 * stage_bytes(v);
  if (q_alias) l.q = l.k_op + tile;
  l.bytes = at + 1024;
  return l;
}

/// The first 1024-byte boundary at or after the dynamic shared memory's start (B128 tiles).
__device__ __forceinline__ uint8_t *align1024(uint8_t *raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

}  // namespace kvq_prefill
