// prefill/tiles.cuh: which query rows a block serves (the tile scan over a ragged batch), their
// bounds, the keys they see, and their Q tile.
#pragma once

#include "prefill/layout.cuh"
#include "prim/convert.cuh"
#include "prim/cp_async.cuh"

namespace kvq_prefill {

using namespace kvq;

/// New tokens of sequence b and the first one's index over the batch; 0 tokens (and `*bad`)
/// when its qo_indptr entries are out of order or past the capacity, so nothing outside q, out
/// and the workspace is addressed whatever the entries hold.
__device__ __forceinline__ int seq_tokens(const Params &p, int b, int *q0, bool *bad) {
  const int a = p.qo_indptr[b], e = p.qo_indptr[b + 1];
  *bad = a < 0 || e < a || e > p.max_tokens;
  *q0 = *bad ? 0 : a;
  return *bad ? 0 : e - a;
}

/// Which sequence and which of its tiles CTA `tile` serves: a block-wide scan of the tiles per
/// sequence (ceil(n_b * G / R)). False when `tile` is past the batch's last.
template <int R, int kThreads>
__device__ __forceinline__ bool find_tile(const Params &p, int tile, int *seq, int *index,
                                          int *count) {
  constexpr int kWarps = kThreads / 32;
  // The warps' sums in whole 16-byte words of their own: the sums are read four at a time, and
  // such a read must not take in s_count, which a thread writes meanwhile (racecheck says so,
  // though the value goes unused).
  __shared__ __align__(16) int s_warp[(kWarps + 3) / 4 * 4];
  __shared__ int s_seq, s_index, s_count;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) s_seq = -1;
  __syncthreads();
  int base = 0;
  for (int b0 = 0; b0 < p.batch; b0 += kThreads) {
    const int b = b0 + tid;
    int n = 0, q0;
    bool bad;
    if (b < p.batch) n = seq_tokens(p, b, &q0, &bad);
    const int tiles = (int)(((int64_t)n * p.group + R - 1) / R);
    int incl = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += x;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = base, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += s_warp[w];
      total += s_warp[w];
    }
    const int first = before + incl - tiles;
    if (b < p.batch && tile >= first && tile < first + tiles) {
      s_seq = b;
      s_index = tile - first;
      s_count = tiles;
    }
    base += total;
    __syncthreads();
    if (s_seq >= 0 || base > tile) break;  // uniform: shared values after the barrier
  }
  *seq = s_seq, *index = s_index, *count = s_count;
  return s_seq >= 0;
}

/// Bounds and places of a CTA's query rows (shared memory).
template <int R> struct RowInfo {
  int lo[R], hi[R];        // keys [lo, hi) the row sees in this split
  int64_t out[R], lse[R];  // the row's offsets in out and lse
  int head[R];
  float qs[R];     // factor of the row's scores (q's power-of-two scaling)
  float slope[R];  // ALiBi slope (log2 domain; 0 past the rows), for the masked path
  int pos[R];      // the row's position, for ALiBi
};

/// What a CTA serves: rows [r0, r0 + R) of sequence b's rows (its n new tokens x G heads of KV
/// head kvh; the first is token q0 of the batch) over the keys of split `split` of its len.
struct TileJob {
  int b, q0, n, rows, r0, len, kvh, split;
  bool bad_len;  // qo_indptr or context_lens out of range: counted as a fault
};

/// Find the CTA's tile (false: past the batch's last) and fill the rows' bounds (threads < R).
template <int R, int kThreads>
__device__ __forceinline__ bool begin_tile(const Params &p, RowInfo<R> &rw, TileJob &j) {
  int index, count, tile = blockIdx.x;
  j.kvh = blockIdx.y, j.split = blockIdx.z;
  if (p.heads_first) {
    // Blocks start in the order of their linear index (x fastest). Read with the KV head and
    // the split fastest and the tile slowest, every head's longest tiles start first: longest
    // first over the grid, not one head after another.
    const unsigned heads = gridDim.y, splits = gridDim.z;
    const unsigned lin = blockIdx.x + gridDim.x * (blockIdx.y + heads * blockIdx.z);
    tile = (int)(lin / (heads * splits));
    j.kvh = (int)(lin / splits % heads), j.split = (int)(lin % splits);
  }
  if (!find_tile<R, kThreads>(p, tile, &j.b, &index, &count)) return false;
  const int G = p.group;
  bool bad_q;
  j.n = seq_tokens(p, j.b, &j.q0, &bad_q);
  const int cap = p.max_blocks * p.block_size;
  int len = p.context_lens[j.b];
  j.bad_len = bad_q || len < j.n || len > cap;
  j.len = min(max(len, 0), cap);
  j.rows = j.n * G;
  j.r0 = (count - 1 - index) * R;  // the last tile first: it has the most keys
  const int past = j.len - j.n;     // position of the first new token
  const int s_lo = j.split * p.split_tokens, s_hi = min(j.len, s_lo + p.split_tokens);
  const int tid = threadIdx.x;
  if (tid < R) {
    const int r = j.r0 + tid;
    int lo = 0, hi = 0, pos = 0;
    float slope = 0.f;
    if (r < j.rows) {
      const int i = r / G, h = j.kvh * G + r % G;
      pos = past + i;
      hi = min(pos + 1, s_hi);
      lo = max(max(p.window_left >= 0 ? pos - p.window_left : 0, s_lo), 0);
      rw.head[tid] = h;
      rw.out[tid] = (int64_t)(j.q0 + i) * p.o_tok + (int64_t)h * p.o_head;
      rw.lse[tid] = (int64_t)(j.q0 + i) * p.l_tok + (int64_t)h * p.l_head;
      if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[h] * kLog2e;
    }
    rw.slope[tid] = slope;
    rw.pos[tid] = pos;
    rw.lo[tid] = lo;
    rw.hi[tid] = max(hi, lo);
    rw.qs[tid] = 1.f;
  }
  return true;
}

/// Queue the copies of the CTA's Q rows into the Q tile (rows past the sequence: zeros), as
/// one commit group.
template <int D, int R, bool SW, int kThreads>
__device__ __forceinline__ void load_q(const Params &p, const TileJob &j, uint8_t *qs) {
  constexpr int U = D * 2 / 16;
  const int G = p.group;
  for (int u = threadIdx.x; u < R * U; u += kThreads) {
    const int rr = u / U, c = u % U, r = j.r0 + rr;
    const uint8_t *src = static_cast<const uint8_t *>(p.q);
    uint32_t bytes = 0;
    if (r < j.rows) {
      src += ((int64_t)(j.q0 + r / G) * p.q_tok + (int64_t)(j.kvh * G + r % G) * p.q_head) * 2 +
             c * 16;
      bytes = 16;
    }
    cp_async16(smem_u32(qs + tile_at<D, SW, R>(rr, c)), src, bytes);
  }
  cp_async_commit();
}

/// bf16 queries over an f16 key operand: each row of the Q tile scaled by a power of two into
/// f16's range and stored as f16 (warp w of nw takes rows w, w + nw, ...); the factor goes to
/// rw.qs.
template <int D, int R, bool SW>
__device__ __forceinline__ void scale_q(uint8_t *qs, RowInfo<R> &rw, int warp, int nw) {
  const int lane = threadIdx.x % 32;
  // Element d of row r, in the Q tile's layout.
  auto q_elem = [&](int r, int d) { return qs + tile_at<D, SW, R>(r, d / 8) + (d % 8) * 2; };
  for (int r = warp; r < R; r += nw) {
    float mx = 0.f;
    for (int d = lane; d < D; d += 32)
      mx = fmaxf(mx, fabsf(__bfloat162float(*reinterpret_cast<__nv_bfloat16 *>(q_elem(r, d)))));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    const int e = (mx > 0.f && mx <= 3.0e38f) ? ilogbf(mx) : 0;
    const float sc = ldexpf(1.f, -e);
    for (int d = lane; d < D; d += 32) {
      uint8_t *x = q_elem(r, d);
      const float v = __bfloat162float(*reinterpret_cast<__nv_bfloat16 *>(x));
      *reinterpret_cast<__half *>(x) = __float2half_rn(v * sc);
    }
    if (lane == 0) rw.qs[r] = ldexpf(1.f, e);
  }
}

/// Keys any row of the CTA sees in this split: [*lo, *hi), empty when *hi <= *lo.
/// Every warp computes it (lanes over the rows, then shuffles), with no barrier.
template <int R>
__device__ __forceinline__ void tile_keys(const RowInfo<R> &rw, int *lo, int *hi) {
  int kv_lo = INT32_MAX, kv_hi = 0;
#pragma unroll
  for (int r = threadIdx.x % 32; r < R; r += 32)
    if (rw.hi[r] > rw.lo[r]) kv_lo = min(kv_lo, rw.lo[r]), kv_hi = max(kv_hi, rw.hi[r]);
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    kv_lo = min(kv_lo, __shfl_xor_sync(kFull, kv_lo, o));
    kv_hi = max(kv_hi, __shfl_xor_sync(kFull, kv_hi, o));
  }
  *lo = kv_lo, *hi = kv_hi;
}

}  // namespace kvq_prefill
