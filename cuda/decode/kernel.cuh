// decode/kernel.cuh: the fused paged decode-attention kernel family.
//
// Grid (splits, num_kv_heads * m_tiles, batch); 4 to 16 warps per CTA (a launch parameter). A
// CTA serves one KV head's tile of up to 8 query rows (G query heads x q_len tokens, rows
// g*q_len + i) over one split (a run of `split_tokens` tokens) of one sequence, so each KV byte
// of the split is read once per tile. Inside the CTA each of W warps takes every W-th step (16
// or 32 tokens) of the split and runs its own pipeline: cp.async copies of the step's K codes /
// K meta / V codes / V meta rows (contiguous runs of the page's head section, see
// src/layout.rs) into a ring of NS shared-memory stages, then S^T = K q^T and O^T += V^T P^T on
// tensor cores with an online softmax in f32 (log2 domain). Decode has few query rows per KV
// head, so they are the MMAs' N (8) and the KV tokens / head_dim their M (16): no padded
// 16-row query tile. The warps' partial results are merged through shared memory at the end. A
// sequence cut into several splits writes normalized partials + log2-sum-exp to the workspace;
// the CTA that finishes a (sequence, KV head, tile) last (an atomic counter, reset by it) merges
// them, so one launch does everything.
//
// Layout of the code: the copy pipeline's steps are decode/pipeline.cuh, the fragment geometry
// and the codecs' roles decode/frag.cuh. The sections below (query tile, main loop with S = K q,
// online softmax and O += V P, warp merge, split merge) stay in this one function body on
// purpose: with nvcc 13.0, moving any of them into a function of its own, even a force-inlined
// one or a lambda, changes the generated code (a callee is optimized on its own before it is
// inlined), and the kernel's PTX must not change with its layout (scripts/ptx-diff.sh). What
// differs by format goes through the codecs and branches only on the fragment kind
// (KC::kGroupFrags, VC::kGroupFrags, a row scale: RowScaleOf, a bias left on the codes:
// CodeBiasOf, per-block channel metadata: BlockChannelsOf), not on a format.
#pragma once

#include <stdint.h>

#include "decode/frag.cuh"
#include "decode/pipeline.cuh"
#include "decode/plan.cuh"
#include "kvq.h"
#include "prim/cp_async.cuh"
#include "prim/fast_math.cuh"
#include "prim/mma.cuh"
#include "prim/pdl.cuh"
#include "prim/vec_io.cuh"

namespace kvq_decode {

template <Fmt KF, Fmt VF, int D>
__global__ void __maxnreg__((Cfg<KF, VF, D>::MAX_REGS)) decode_kernel(const Params p) {
  using F = Frag<KF, VF, D>;
  using C = Cfg<KF, VF, D>;
  constexpr int CH = C::CH, STEP = C::STEP;
  const int NS = p.stages;
  extern __shared__ __align__(128) uint8_t smem_all[];
  uint2 *qfrag = reinterpret_cast<uint2 *>(smem_all);
  // int4-kc keys: [D / 32][32 lanes] uint4, lane (g, t)'s elements 8t..8t+7 of each 32 of row g.
  uint4 *qnat = reinterpret_cast<uint4 *>(smem_all + C::QFRAG);
  int64_t *row_q = reinterpret_cast<int64_t *>(smem_all + C::QFRAG + C::QNAT);  // q offset per row
  int64_t *row_o = row_q + kRows;                                      // out offset per row
  int64_t *row_l = row_o + kRows;                                      // lse offset per row
  float *row_c = reinterpret_cast<float *>(row_l + kRows);
  float *row_qs = row_c + kRows;
  int *row_lim = reinterpret_cast<int *>(row_qs + kRows);
  float *row_L = reinterpret_cast<float *>(row_lim + kRows);
  float *row_M = row_L + kRows;
  // ALiBi: per row its slope (log2 domain; 0 past the tile's rows) and its position, in row_L
  // and row_M, which the warp merge writes only after the main loop (the masked path's last
  // reads).
  float *row_slope = row_L;
  int *row_pos = reinterpret_cast<int *>(row_M);
  // INT4 K only: [D / 32][4] float4 {z(2t), z(2t+1), z(2t), z(2t+1)}, the C operand of lane t.
  float *row_z = row_M + kRows;
  int *flag = reinterpret_cast<int *>(row_z + (D / 32) * 16);
  int *row_lo = flag + 4;  // the window's first position per row (0 without a window)

  // Launched early (decode.cu): no global read before the stream's previous kernel (an append
  // of this step's tokens, say) has finished; the stream's next kernel may launch now and wait
  // likewise.
  wait_for_prerequisite_grids();
  allow_dependent_launch();

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_tiles, mt = blockIdx.y % p.m_tiles;
  const int b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int nthreads = blockDim.x, nw = nthreads / 32;

  bool bad_len;
  const int len = seq_len(p, b, &bad_len);
  const int nsplit = len <= 0 ? 1 : (len + p.split_tokens - 1) / p.split_tokens;
  if (split >= nsplit) return;
  int t0 = split * p.split_tokens;
  const int t1 = min(len, t0 + p.split_tokens);
  const int rows = p.group * p.q_len;
  const int row0 = mt * kRows;
  // This tile's first row in the workspace's [b][head][q_len] order.
  const int64_t row_base = ((int64_t)b * p.num_q_heads + (int64_t)kvh * p.group) * p.q_len + row0;
  // Row r of the tile is query token (row0 + r) % q_len of head kvh * G + (row0 + r) / q_len.
  if (tid < kRows) {
    const int gr = row0 + tid, h = kvh * p.group + gr / p.q_len, i = gr % p.q_len;
    row_q[tid] = row_at(p.q_rows, b, h, i);
    row_o[tid] = row_at(p.out_rows, b, h, i);
    row_l[tid] = row_at(p.lse_rows, b, h, i);
    // Query i sits at position len - q_len + i; with a window it sees window_left before it.
    row_lo[tid] = (gr < p.group * p.q_len && p.window_left >= 0)
                      ? max(0, len - p.q_len + i - p.window_left)
                      : 0;
    if (p.alibi_slopes != nullptr) {
      row_slope[tid] = gr < p.group * p.q_len ? p.alibi_slopes[h] * kLog2e : 0.f;
      row_pos[tid] = len - p.q_len + i;
    }
    // The query tile is read below while this block's copies fly; fetched from HBM behind them
    // it waited for the queue (6-7 % of the samples of short INT4 launches, PERFORMANCE.md v11),
    // so its lines are requested first.
    if (gr < p.group * p.q_len) {
      const uint16_t *row = static_cast<const uint16_t *>(p.q) + row_q[tid];
#pragma unroll
      for (int d = 0; d < D; d += 64) prefetch_l1(row + d);
      prefetch_l1(row + D - 1);  // a row that does not start on a line ends on one more
    }
  }
  __syncthreads();
  // With a window, the split's tokens before every row's window are skipped (from a chunk
  // boundary); lo_all: tokens from it on are inside every row's window.
  int lo_all = 0;
  if (p.window_left >= 0) {
    int lo_min = INT32_MAX;
    for (int r = 0; r < kRows && row0 + r < rows; ++r)
      lo_min = min(lo_min, row_lo[r]), lo_all = max(lo_all, row_lo[r]);
    if (lo_min != INT32_MAX) t0 = max(t0, lo_min & -kChunk);
  }

  // ---- 1. Start this warp's copies, so they fly while the query tile is prepared.
  const int nsteps = t1 > t0 ? (t1 - t0 + STEP - 1) / STEP : 0;
  const int my_steps = nsteps > warp ? (nsteps - warp + nw - 1) / nw : 0;
  uint8_t *const smem = smem_all + C::PRE;  // rings, later the merge areas
  uint8_t *ring = smem + warp * NS * C::STAGE;
  const uint32_t ring_u32 = smem_u32(ring);
  const uint8_t *head = p.pool + (int64_t)kvh * p.head_stride;
  const int32_t *table = p.block_tables + (int64_t)b * p.max_blocks;
  const int bs16 = p.block_size / kChunk;
  const uint32_t num_blocks = (uint32_t)min(p.num_blocks, (int64_t)INT32_MAX);
  // Where the next step to fetch starts: its first token, and its first 16-token chunk as (table
  // index, chunk within the block), advanced by the same amount per step (no division after
  // this one).
  int f_tok = t0 + warp * STEP;
  int f_blk = (f_tok / kChunk) / bs16, f_cib = f_tok / kChunk - f_blk * bs16;
  const int adv_blk = nw * CH / bs16, adv_cib = nw * CH - adv_blk * bs16;
  int fetched = 0;     // steps fetched so far
  bool fault = false;  // a live chunk's table entry was outside the pool (warp-uniform)
  const StepFetch<CH, STEP> fetch{f_blk, f_cib, bs16, fetched, my_steps, f_tok, t1, table, nw,
                                  adv_blk, adv_cib};
  uint32_t page_ok = 0;  // bit (slot * CH + c): chunk c of the step in `slot` has a valid page
  const StepIssue<F, C> issue{my_steps, ring_u32, num_blocks, fault, page_ok, head, p, lane};
#pragma unroll 1
  for (int k = 0; k < NS - 1; ++k) issue(k, k, fetch());
  Fetch<CH> next = fetch();  // step NS - 1

  // int4-kc keys: positions below sealed_end lie in sealed blocks. The rows of the sequence's
  // last, unsealed block are f16 (its window) and read from memory by the chunks that hold
  // them, at `window` (null when its table entry is outside the pool: the copies count that
  // fault and mask the chunk); this split's rows of it are prefetched into L2 now.
  int sealed_end = 0;
  const uint8_t *window = nullptr;
  if constexpr (F::KBLK) {
    sealed_end = len & -p.block_size;  // block sizes 16, 32, 64 (the launcher checks)
    if (t1 > sealed_end) {
      const uint32_t pg = (uint32_t)table[sealed_end / p.block_size];
      if (pg < num_blocks) {
        window = head + (int64_t)pg * p.block_stride + p.k_codes_off;
        const uint8_t *lo = window + (max(t0, sealed_end) - sealed_end) * 2 * D;
        const uint8_t *hi = window + (t1 - sealed_end) * 2 * D;
        for (const uint8_t *x = lo - ((uintptr_t)lo & 127) + 128 * tid; x < hi; x += 128 * nthreads)
          prefetch_l2(x);
      }
    }
  }

  // ---- 2. Query tile: each row scaled by a power of two so that the f16 operand neither
  // overflows nor loses precision (exact for bf16 inputs), then packed into B fragments in the
  // K-side head_dim order (decode/frag.cuh).
  float k_factor = 1.f;
  if constexpr (F::KC::kHeadScale) k_factor = p.k_scales[kvh] * F::KC::unit();
  if constexpr (F::KC::kGroupFrags) k_factor = F::KC::kScoreUnit;
  if constexpr (CodeBiasOf<typename F::KC>::value) k_factor = F::KC::kCodeUnit;
  for (int r = warp; r < kRows; r += nw) {
    const bool valid = row0 + r < rows;
    float mx = 0.f;
    if (valid)
      for (int d = lane; d < D; d += 32)
        mx = fmaxf(mx, fabsf(load_elem(p.q, row_q[r] + d, p.q_bf16)));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    const int e = (mx > 0.f && mx <= 3.0e38f) ? ilogbf(mx) : 0;
    if (lane == 0) {
      row_c[r] = p.sm_scale_log2 * ldexpf(1.f, e) * k_factor;
      row_qs[r] = ldexpf(1.f, -e);
      // Query i (row % q_len) sits at position len - q_len + i and sees tokens [0, that].
      const int lim = len - p.q_len + (row0 + r) % p.q_len + 1;
      row_lim[r] = valid ? max(0, min(lim, t1)) : 0;
    }
  }
  __syncthreads();
  // B fragments of q^T for k-step j: lane (g, t) holds row g at the K-side dims of registers
  // 2j and 2j + 1 of decode/frag.cuh's order.
  for (int i = tid; i < (D / 16) * 32; i += nthreads) {
    const int j = i / 32, ln = i % 32, gg = ln / 4, tt = ln % 4;
    const int dd[4] = {F::k_dim(tt, 2 * j, 0), F::k_dim(tt, 2 * j, 1),
                       F::k_dim(tt, 2 * j + 1, 0), F::k_dim(tt, 2 * j + 1, 1)};
    const bool valid = row0 + gg < rows;
    // INT4 K: k-steps 2G hold codes in units of 2^-24, 2G + 1 in 2^-20; the query carries the
    // 16 that brings both to 2^-20.
    const float sc = row_qs[gg] * F::KC::q_scale(j);
    float v[4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
      v[x] = valid ? load_elem(p.q, row_q[gg] + dd[x], p.q_bf16) * sc : 0.f;
    // k-steps 2m and 2m + 1 of a lane side by side (one 16-byte load for both).
    qfrag[(j / 2) * 64 + ln * 2 + j % 2] =
        make_uint2(pack2<F::K_BF16>(v[0], v[1]), pack2<F::K_BF16>(v[2], v[3]));
  }
  if constexpr (F::KBLK) {
    for (int i = tid; i < (D / 32) * 32; i += nthreads) {
      const int G = i / 32, ln = i % 32, gg = ln / 4, tt = ln % 4;
      uint32_t h[4] = {0u, 0u, 0u, 0u};
      if (row0 + gg < rows)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int64_t at = row_q[gg] + 32 * G + 8 * tt + 2 * x;
          h[x] = pack2<false>(load_elem(p.q, at, p.q_bf16) * row_qs[gg],
                              load_elem(p.q, at + 1, p.q_bf16) * row_qs[gg]);
        }
      qnat[i] = make_uint4(h[0], h[1], h[2], h[3]);
    }
  }
  if constexpr (F::KC::kGroupFrags && !F::KBLK) {
    // Each group's accumulator starts at the codec's zero term (KC::k_zero_term).
    constexpr int NG = D / F::KC::kGroup;
    for (int i = tid; i < kRows * NG; i += nthreads) {
      const int r = i / NG, G = i % NG;
      const float z = F::KC::k_zero_term(G, row0 + r < rows, [&](int d) {
        return load_elem(p.q, row_q[r] + d, p.q_bf16) * row_qs[r];
      });
      row_z[G * 16 + (r / 2) * 4 + r % 2] = z;
      row_z[G * 16 + (r / 2) * 4 + r % 2 + 2] = z;
    }
  }
  __syncthreads();
  // This lane's q^T fragments: in registers for the whole loop, except with INT4 keys, whose
  // loop needs the registers more (it reads them from shared memory, group by group).
  uint32_t qb[F::QREGS][2];
  const uint4 *q_lane = reinterpret_cast<const uint4 *>(qfrag) + lane;
  const uint4 *qnat_lane = qnat + lane;
  if constexpr (!F::KC::kGroupFrags) {
#pragma unroll
    for (int m = 0; 2 * m < D / 16; ++m) {
      const uint4 x = q_lane[32 * m];
      qb[2 * m][0] = x.x, qb[2 * m][1] = x.y;
      if (2 * m + 1 < D / 16) qb[2 * m + 1][0] = x.z, qb[2 * m + 1][1] = x.w;
    }
  }
  // Keys unpacked with a bias on every code (CodeBiasOf): each score starts at minus the bias
  // times its row's query, the same sum of products the MMAs add to it.
  float kb_r0 = 0.f, kb_r1 = 0.f;
  if constexpr (CodeBiasOf<typename F::KC>::value) {
    constexpr uint32_t kb_w = F::KC::kCodeBias;
    float kb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      mma16816<F::K_BF16>(kb, make_uint4(kb_w, kb_w, kb_w, kb_w), qb[j][0], qb[j][1]);
    kb_r0 = -kb[0], kb_r1 = -kb[1];
  }
  // This lane's output rows: r0 = 2t and r1 = 2t + 1 (C-fragment columns).
  const int lim_r0 = row_lim[2 * t], lim_r1 = row_lim[2 * t + 1];
  const float c_r0 = row_c[2 * t], c_r1 = row_c[2 * t + 1];
  // Tokens below lim_all are seen by every row of the tile (rows past the tile's end hold zero
  // queries: finite scores, never written out).
  int lim_all = t1;
  for (int r = 0; r < kRows && row0 + r < rows; ++r) lim_all = min(lim_all, row_lim[r]);
  // Steps starting in [lo_all, lo_all + plain_span] see every key in every row's window: the
  // plain path, one unsigned compare (none under a soft cap or ALiBi slopes, which the masked
  // path applies).
  const bool capped = p.soft_cap > 0.f, biased = p.alibi_slopes != nullptr;
  if (capped || biased || lim_all - STEP < lo_all)
    lo_all = INT32_MAX / 2, lim_all = lo_all + STEP;
  const uint32_t plain_span = (uint32_t)(lim_all - STEP - lo_all);
  // INT4 K: the zero terms of rows r0, r1 of group G at kz_lane[4 G], as the MMA's C operand
  // (read when used: registers are scarcer than shared-memory bandwidth).
  const float4 *kz_lane = reinterpret_cast<const float4 *>(row_z) + t;

  // Lane offsets inside a stage (loop invariant): K row g; its columns (chunk t, rotated and
  // swizzled) and V's (rows 2t.., chunk g) come from F::k_col / F::v_at, also loop invariant.
  // Other rows are compile-time immediates.
  const uint32_t k_lane = C::KC_OFF + g * F::KPITCH;
  const uint32_t km_lane = C::KM_OFF + g * F::KM_ROW;
  // INT4 V: lane g reads word g of each 64-group (decode/frag.cuh, V_LANE), and whole meta rows
  // (rows 2t.., as FP4 V its scale bytes).
  const uint32_t vm_lane = C::VM_OFF + 2 * t * F::VM_ROW;
  // Row (within the step) of V register e of k-step ks: tokens 2t, 2t+1, 2t+8, 2t+9.
  auto v_row = [](int ks, int e) { return ks * kChunk + (e & 1) + 8 * (e >> 1); };

  // ---- 3. Main loop: this warp's steps w, w+4, ... of [t0, t1).
  // O^T accumulators: m-tile i covers the V columns of decode/frag.cuh's n-tiles 2i (rows g) and
  // 2i + 1 (rows g + 8); C columns are this lane's query rows r0, r1.
  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r0 = -INFINITY, m_r1 = -INFINITY, l_r0 = 0.f, l_r1 = 0.f;
  // INT4 V: sum_n P_n z_{n,G} (Z^T P^T): group g, rows r0 / r1 in [0] / [1]; V unpacked with a
  // bias (CodeBiasOf): sum_n P_n bias, rows r0 / r1 in [0] / [1]; unused otherwise.
  float zsum[4] = {0.f, 0.f, 0.f, 0.f};
  // V row scales: the largest this warp has seen (O's unit) and its reciprocal; unused otherwise.
  float v_ref = 0.f, v_inv = 0.f;

  int slot = 0, issue_slot = NS - 1;
#pragma unroll 1
  for (int k = 0; k < my_steps; ++k) {
    cp_async_wait_at_most(NS - 2);
    __syncwarp();
    issue(k + NS - 1, issue_slot, next);  // into the slot step k-1 used
    issue_slot = slot;
    next = fetch();  // step k + NS
    const uint8_t *st = ring + slot * C::STAGE;
    const uint32_t st_s = ring_u32 + slot * C::STAGE;
    const int tok0 = t0 + (warp + k * nw) * STEP;
    const uint32_t ok_bits = page_ok >> (slot * CH);
    slot = slot + 1 == NS ? 0 : slot + 1;

    // S^T = K q^T per 16-token chunk ch: A = K (rows: tokens g, g + 8), B = q^T. Two
    // accumulators per chunk (even / odd k-steps) halve the MMA dependency chain.
    float s[CH][4], s2nd[CH][4];
#pragma unroll
    for (int ch = 0; ch < CH; ++ch)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[ch][e] = e % 2 ? kb_r1 : kb_r0, s2nd[ch][e] = 0.f;
    if constexpr (F::KBLK) {
      // int4-kc keys (codec/int4_kc.cuh). A sealed chunk: raw codes (INT4 K's geometry) times
      // the query fragments scaled by its block's s, set up when a block starts (each step's
      // first chunk, and a second chunk that starts a block); every score starts at the block's
      // q . z. A chunk of the unsealed block: its f16 rows times the query (qnat).
      constexpr int NG = D / 32;
      uint32_t kq[NG][4];   // q^T fragments of group G times the block's s
      float kc_unit = 0.f;  // what a unit of the codes' scores is worth
      float bias_r0 = 0.f, bias_r1 = 0.f;  // q . z of rows r0, r1
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        const int pos = tok0 + ch * kChunk;
        if (pos < sealed_end) {
          if (ch == 0 || (pos & (p.block_size - 1)) == 0) {
            const uint8_t *bm = st + C::KM_OFF + ch * F::KBM + 16 * t;  // s, then z at 2 D
            // q * s stays inside f16's range while every s <= 2047 (|q| < 32: q_scale's 16
            // times a row scaled below 2); a block whose channels span more than 30,000 takes
            // s / 2^11 instead (s >= 0: its f16 bits order as its values).
            uint4 sw[NG];
            uint32_t mx = 0u;
#pragma unroll
            for (int G = 0; G < NG; ++G) {
              sw[G] = *reinterpret_cast<const uint4 *>(bm + 64 * G);
              mx = __vmaxu2(mx, __vmaxu2(__vmaxu2(sw[G].x, sw[G].y), __vmaxu2(sw[G].z, sw[G].w)));
            }
            // The query fragments times s (kq), then, in the rare block that needs it, times
            // s / 2^11 instead: the common path does not wait for the vote.
            auto scale_q = [&](bool shift) {
#pragma unroll
              for (int G = 0; G < NG; ++G) {
                uint32_t sp[4];
                F::KC::k_pairs(sw[G], sp);
                const uint4 qg = q_lane[32 * G];  // k-steps 2G, 2G + 1
                const uint32_t qv[4] = {qg.x, qg.y, qg.z, qg.w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
                  kq[G][i] = h2_bits(__hmul2(
                      bits_h2(qv[i]),
                      shift ? __hmul2(bits_h2(sp[i]), bits_h2(0x10001000u)) : bits_h2(sp[i])));
              }
            };
            scale_q(false);
            const bool big = __any_sync(kFull, __vcmpgtu2(mx, 0x67FF67FFu) != 0u);
            kc_unit = big ? 2147483648.f : 1048576.f;  // 2^31 or 2^20 (the codes' 2^-20)
            if (big) scale_q(true);  // s times 2^-11
            // Every token row of A is z (natural order, as qnat): each C entry is the row's
            // q . z over the group.
            float be[4] = {0.f, 0.f, 0.f, 0.f}, bo[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int G = 0; G < NG; ++G) {
              const uint4 zw = *reinterpret_cast<const uint4 *>(bm + 2 * D + 64 * G);
              const uint4 qn = qnat_lane[32 * G];
              mma16816<false>(be, make_uint4(zw.x, zw.x, zw.y, zw.y), qn.x, qn.y);
              mma16816<false>(bo, make_uint4(zw.z, zw.z, zw.w, zw.w), qn.z, qn.w);
            }
            bias_r0 = be[0] + bo[0];
            bias_r1 = be[1] + bo[1];
          }
          auto group = [&](int G, uint32_t lo_w, uint32_t hi_w) {
            uint32_t lo[4], hi[4];
            F::KC::k_codes(lo_w, lo);
            F::KC::k_codes(hi_w, hi);
            mma16816<false>(s[ch], make_uint4(lo[0], hi[0], lo[2], hi[2]), kq[G][0], kq[G][1]);
            mma16816<false>(s2nd[ch], make_uint4(lo[1], hi[1], lo[3], hi[3]), kq[G][2], kq[G][3]);
          };
          const uint32_t k_rows = st_s + C::KC_OFF + ch * kChunk * F::KPITCH;
#pragma unroll
          for (int G2 = 0; G2 < D / 64; ++G2) {
            uint32_t w[4];
            ldmatrix_x4(k_rows + F::k_ldsm(lane, G2), w);
            group(2 * G2, w[0], w[1]);
            group(2 * G2 + 1, w[2], w[3]);
          }
          if constexpr (D % 64 != 0) {
            uint32_t w[2];
            ldmatrix_x2(k_rows + F::k_ldsm(lane, D / 64), w);
            group(NG - 1, w[0], w[1]);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[ch][e] = fmaf(s[ch][e] + s2nd[ch][e], kc_unit, e % 2 ? bias_r1 : bias_r0);
            s2nd[ch][e] = 0.f;
          }
        } else {
          // Rows g, g + 8 of the chunk from the window: lane t's elements 8t..8t+7 of each 32
          // (16 bytes), in qnat's order. Rows past the sequence are zeros (masked below).
          const int r = pos - sealed_end + g;
          const bool lo_ok = window != nullptr && pos + g < len;
          const bool hi_ok = window != nullptr && pos + g + 8 < len;
          const uint8_t *w_lo = window + (int64_t)r * 2 * D + 16 * t;
#pragma unroll
          for (int G = 0; G < NG; ++G) {
            const uint4 z4 = make_uint4(0u, 0u, 0u, 0u);
            const uint4 a = lo_ok ? *reinterpret_cast<const uint4 *>(w_lo + 64 * G) : z4;
            const uint4 b = hi_ok ? *reinterpret_cast<const uint4 *>(w_lo + 16 * D + 64 * G) : z4;
            const uint4 qn = qnat_lane[32 * G];
            mma16816<false>(s[ch], make_uint4(a.x, b.x, a.y, b.y), qn.x, qn.y);
            mma16816<false>(s2nd[ch], make_uint4(a.z, b.z, a.w, b.w), qn.z, qn.w);
          }
        }
      }
    } else if constexpr (F::KC::kGroupFrags) {
      // Per group G: two MMAs of raw codes (k-steps 2G, 2G + 1) from the zero term, then the
      // scores += scale(token, G) * that, in f32. C rows are tokens g and g + 8.
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        constexpr int KMW = (F::KM_ROW + 3) / 4;
        uint32_t sc_lo[KMW], sc_hi[KMW];  // f16 group scales of tokens g, g + 8
        lds_meta<F::KM_ROW>(st + km_lane + ch * kChunk * F::KM_ROW, sc_lo);
        lds_meta<F::KM_ROW>(st + km_lane + (ch * kChunk + 8) * F::KM_ROW, sc_hi);
        // Group G from word t of its tokens g (lo_w) and g + 8 (hi_w).
        auto group = [&](int G, uint32_t lo_w, uint32_t hi_w) {
          uint32_t lo[4], hi[4];
          F::KC::k_codes(lo_w, lo);
          F::KC::k_codes(hi_w, hi);
          const float4 z = kz_lane[4 * G];
          const uint4 qg = q_lane[32 * G];  // k-steps 2G, 2G + 1
          float r[4] = {z.x, z.y, z.z, z.w};
          mma16816<false>(r, make_uint4(lo[0], hi[0], lo[2], hi[2]), qg.x, qg.y);
          mma16816<false>(r, make_uint4(lo[1], hi[1], lo[3], hi[3]), qg.z, qg.w);
          const int sh = 16 * (G % 2);
          const float s_lo = __half2float(__ushort_as_half((uint16_t)(sc_lo[G / 2] >> sh)));
          const float s_hi = __half2float(__ushort_as_half((uint16_t)(sc_hi[G / 2] >> sh)));
          s[ch][0] = fmaf(s_lo, r[0], s[ch][0]);
          s[ch][1] = fmaf(s_lo, r[1], s[ch][1]);
          s[ch][2] = fmaf(s_hi, r[2], s[ch][2]);
          s[ch][3] = fmaf(s_hi, r[3], s[ch][3]);
        };
        const uint32_t k_rows = st_s + C::KC_OFF + ch * kChunk * F::KPITCH;
#pragma unroll
        for (int G2 = 0; G2 < D / 64; ++G2) {
          uint32_t w[4];  // word t of groups 2 G2 (w[0] token g, w[1] g + 8) and 2 G2 + 1
          ldmatrix_x4(k_rows + F::k_ldsm(lane, G2), w);
          group(2 * G2, w[0], w[1]);
          group(2 * G2 + 1, w[2], w[3]);
        }
        if constexpr (D % 64 != 0) {  // an odd group count (head_dim 96): the last one alone
          uint32_t w[2];
          ldmatrix_x2(k_rows + F::k_ldsm(lane, D / 64), w);
          group(D / 32 - 1, w[0], w[1]);
        }
      }
    } else {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
        for (int v = 0; v < F::KNV; ++v) {
          uint32_t w[2][F::KWORDS];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = ch * kChunk + h * 8;  // first K row of this half of the chunk
            lds<F::KVEC>(st + k_lane + row * F::KPITCH + F::k_col(g, t, v), w[h]);
          }
#pragma unroll
          for (int u = 0; u < F::KWORDS; u += F::KWU) {
            constexpr int R = F::KWU * F::KPPW;  // fragment registers of these words
            uint32_t kb[2][R];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
              for (int x = 0; x < F::KWU; ++x) {
                uint32_t r[F::KPPW];
                if constexpr (ScaledWordsOf<typename F::KC>::value) {
                  // The word's group scale: the byte of its group in the token's meta row.
                  constexpr int GB = F::KC::kGroup * F::KBITS / 8;  // code bytes per group
                  // Split where a lane's bytes are whole groups, so that the words of one
                  // group visibly share a load.
                  const int off = F::k_vec(t, v) * F::KVEC + 4 * (u + x);
                  const int grp = F::KCH % GB == 0 ? t * (F::KCH / GB) + off / GB
                                                   : (t * F::KCH + off) / GB;
                  const uint8_t sb = st[km_lane + (ch * kChunk + h * 8) * F::KM_ROW + grp];
                  F::KC::k_unpack(w[h][u + x], sb, r);
                } else {
                  F::KC::k_unpack(w[h][u + x], r);
                }
#pragma unroll
                for (int y = 0; y < F::KPPW; ++y) kb[h][x * F::KPPW + y] = r[y];
              }
            }
#pragma unroll
            for (int jj = 0; jj < R / 2; ++jj) {
              const int j = (v * F::KPAIRS + u * F::KPPW) / 2 + jj;  // k-step
              const uint4 a = make_uint4(kb[0][2 * jj], kb[1][2 * jj], kb[0][2 * jj + 1],
                                         kb[1][2 * jj + 1]);
              mma16816<F::K_BF16>((j & 1) ? s2nd[ch] : s[ch], a, qb[j][0], qb[j][1]);
            }
          }
        }
        if constexpr (RowScaleOf<typename F::KC>::value) {
          // Each token's row scale on its scores (C rows: tokens g and g + 8).
          const uint8_t *km = st + km_lane + ch * kChunk * F::KM_ROW;
          const float k_lo = *reinterpret_cast<const float *>(km);
          const float k_hi = *reinterpret_cast<const float *>(km + 8 * F::KM_ROW);
          s[ch][0] *= k_lo, s[ch][1] *= k_lo, s2nd[ch][0] *= k_lo, s2nd[ch][1] *= k_lo;
          s[ch][2] *= k_hi, s[ch][3] *= k_hi, s2nd[ch][2] *= k_hi, s2nd[ch][3] *= k_hi;
        }
      }
    }

    // Online softmax (log2 domain). Lane holds tokens tok0 + ch*16 + g (s[ch][0..1]) and + 8
    // (s[ch][2..3]) of rows r0 (s[ch][0], s[ch][2]) and r1. Masked entries become -inf whatever
    // the codes were.
    float mx_r0 = -INFINITY, mx_r1 = -INFINITY;
    constexpr uint32_t kAllChunks = (1u << CH) - 1;
    if ((ok_bits & kAllChunks) == kAllChunks && (uint32_t)(tok0 - lo_all) <= plain_span) {
      // Every token of the step is visible to every row: no masks (all steps but the last
      // of a split, and of every causal tail).
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[ch][e] = (s[ch][e] + s2nd[ch][e]) * (e % 2 ? c_r1 : c_r0);
        mx_r0 = fmaxf(mx_r0, fmaxf(s[ch][0], s[ch][2]));
        mx_r1 = fmaxf(mx_r1, fmaxf(s[ch][1], s[ch][3]));
      }
    } else {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        const bool ok = (ok_bits >> ch) & 1u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = tok0 + ch * kChunk + 8 * h + g;
          const float x0 = s[ch][2 * h] + s2nd[ch][2 * h];
          const float x1 = s[ch][2 * h + 1] + s2nd[ch][2 * h + 1];
          float y0 = x0 * c_r0, y1 = x1 * c_r1;
          if (capped) {
            // cap * tanh(logit / cap) in the log2 domain: y * ln 2 is the logit.
            const float m = kLn2 / p.soft_cap, c2 = p.soft_cap * kLog2e;
            y0 = c2 * tanh_approx(y0 * m), y1 = c2 * tanh_approx(y1 * m);
          }
          if (biased) {
            // ALiBi after the cap: the row's slope times the key's offset from the row's
            // position (<= 0 where the row sees the key).
            y0 = fmaf(row_slope[2 * t], (float)(tok - row_pos[2 * t]), y0);
            y1 = fmaf(row_slope[2 * t + 1], (float)(tok - row_pos[2 * t + 1]), y1);
          }
          s[ch][2 * h] = (ok && tok < lim_r0 && tok >= row_lo[2 * t]) ? y0 : -INFINITY;
          s[ch][2 * h + 1] = (ok && tok < lim_r1 && tok >= row_lo[2 * t + 1]) ? y1 : -INFINITY;
          mx_r0 = fmaxf(mx_r0, s[ch][2 * h]);
          mx_r1 = fmaxf(mx_r1, s[ch][2 * h + 1]);
        }
      }
    }
    // The running max of a row rarely grows once a few steps have been seen: the warp reduces
    // the step's max across lanes (three shuffle rounds on the step's critical path) and
    // rescales O only when some lane's scores exceed it. Same results as always reducing.
    if (__any_sync(kFull, mx_r0 > m_r0 || mx_r1 > m_r1)) {
#pragma unroll
      for (int x = 4; x <= 16; x <<= 1) {
        mx_r0 = fmaxf(mx_r0, __shfl_xor_sync(kFull, mx_r0, x));
        mx_r1 = fmaxf(mx_r1, __shfl_xor_sync(kFull, mx_r1, x));
      }
      const float mn_r0 = fmaxf(m_r0, mx_r0), mn_r1 = fmaxf(m_r1, mx_r1);
      // A row that has seen nothing keeps m = -inf and alpha 1 (its O and l are still 0).
      const float al_r0 = m_r0 == -INFINITY ? 1.f : fast_exp2(m_r0 - mn_r0);
      const float al_r1 = m_r1 == -INFINITY ? 1.f : fast_exp2(m_r1 - mn_r1);
      m_r0 = mn_r0, m_r1 = mn_r1;
      l_r0 *= al_r0, l_r1 *= al_r1;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        o[i][0] *= al_r0, o[i][1] *= al_r1;
        o[i][2] *= al_r0, o[i][3] *= al_r1;
      }
      if constexpr (F::VC::kGroupFrags || CodeBiasOf<typename F::VC>::value)
        zsum[0] *= al_r0, zsum[1] *= al_r1;
    }
    // A row that has seen nothing yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
    const float sub_r0 = m_r0 == -INFINITY ? 0.f : m_r0;
    const float sub_r1 = m_r1 == -INFINITY ? 0.f : m_r1;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[ch][2 * h] = fast_exp2(s[ch][2 * h] - sub_r0);
        s[ch][2 * h + 1] = fast_exp2(s[ch][2 * h + 1] - sub_r1);
        l_r0 += s[ch][2 * h];
        l_r1 += s[ch][2 * h + 1];
      }
    }

    // V row scales (kRowScale): P of token n carries s_n / v_ref, v_ref the largest scale this
    // warp has seen, so that it stays in [0, 1] (f16's range) whatever the scales are; O is
    // kept in units of v_ref and rescaled when v_ref grows (as for the softmax max). Tokens
    // past the split (rows maybe stale) get scale 0.
    if constexpr (RowScaleOf<typename F::VC>::value) {
      float vs[CH][2];  // scales of tokens g (P entries 0, 1) and g + 8 (2, 3) of each chunk
      float vmx = 0.f;
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = ch * kChunk + 8 * h + g;  // token within the step
          const float x = *reinterpret_cast<const float *>(st + C::VM_OFF + n * F::VM_ROW);
          vs[ch][h] = n < t1 - tok0 ? x : 0.f;
          vmx = fmaxf(vmx, vs[ch][h]);
        }
      if (__any_sync(kFull, vmx > v_ref)) {
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) vmx = fmaxf(vmx, __shfl_xor_sync(kFull, vmx, x));
        const float f = v_ref / vmx;  // vmx > v_ref >= 0
#pragma unroll
        for (int i = 0; i < D / 16; ++i) o[i][0] *= f, o[i][1] *= f, o[i][2] *= f, o[i][3] *= f;
        if constexpr (CodeBiasOf<typename F::VC>::value) zsum[0] *= f, zsum[1] *= f;
        v_ref = vmx;
        v_inv = 1.f / vmx;
      }
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        const float u0 = vs[ch][0] * v_inv, u1 = vs[ch][1] * v_inv;
        s[ch][0] *= u0, s[ch][1] *= u0, s[ch][2] *= u1, s[ch][3] *= u1;
      }
    }

    // O^T += V^T P^T, one k-step per 16-token chunk. The B fragment of P^T (k = token, n = row)
    // is the transpose of the lane's S^T tile: two movmatrix per chunk. Lane t's V tokens: 2t,
    // 2t+1 (A registers 0, 1) and 2t+8, 2t+9 (registers 2, 3). Rows past the split's end may
    // hold stale or never-written codes: on a partial step their values are zeroed.
    const int n_valid = t1 - tok0;  // tokens of this step inside the split (>= 1)
#pragma unroll
    for (int ks = 0; ks < CH; ++ks) {
      const uint32_t pb0 = movmatrix_trans(pack2<F::V_BF16>(s[ks][0], s[ks][1]));
      const uint32_t pb1 = movmatrix_trans(pack2<F::V_BF16>(s[ks][2], s[ks][3]));
      uint32_t mask01 = kFull, mask89 = kFull;
      if (n_valid < STEP) {
        const int n = n_valid - ks * kChunk;
        mask01 = (2 * t < n ? 0x0000ffffu : 0u) | (2 * t + 1 < n ? 0xffff0000u : 0u);
        mask89 = (2 * t + 8 < n ? 0x0000ffffu : 0u) | (2 * t + 9 < n ? 0xffff0000u : 0u);
      }
      if constexpr (F::VC::kGroupFrags) {
        // O_j += n * (P * 4s)_G (A: raw nibbles as subnormals, n-tile j in group G = j / 8);
        // zsum += z * P (A row g = group g). P is 0 at masked tokens, and the codes are finite,
        // so only the metadata of rows past the split (maybe stale: NaN, inf) needs masking.
        uint32_t m[4][F::VG];
#pragma unroll
        for (int e = 0; e < 4; ++e) lds<F::VM_ROW>(st + vm_lane + v_row(ks, e) * F::VM_ROW, m[e]);
        const __half2 k4 = __half2half2(__ushort_as_half(0x4400));  // 4: keeps P * s normal
        uint32_t zb01 = 0u, zb89 = 0u;
#pragma unroll
        for (int G = 0; G < F::VG; ++G) {
          uint32_t s01 = prmt(m[0][G], m[1][G], 0x5410), s89 = prmt(m[2][G], m[3][G], 0x5410);
          uint32_t z01 = prmt(m[0][G], m[1][G], 0x7632), z89 = prmt(m[2][G], m[3][G], 0x7632);
          if (n_valid < STEP) s01 &= mask01, s89 &= mask89, z01 &= mask01, z89 &= mask89;
          if (g == G) zb01 = z01, zb89 = z89;
          const uint32_t pg0 = h2_bits(__hmul2(bits_h2(pb0), __hmul2(bits_h2(s01), k4)));
          const uint32_t pg1 = h2_bits(__hmul2(bits_h2(pb1), __hmul2(bits_h2(s89), k4)));
          // Word g of group G in rows 2t (vp0) and 2t + 1 (vp1), then 8 rows on.
          const int col = G * 32 + g * F::V_LANE;
          const uint8_t *vp0 = st + C::VC_OFF + F::v_at(t, 0, col) + ks * kChunk * F::VPITCH;
          const uint8_t *vp1 = st + C::VC_OFF + F::v_at(t, 1, col) + ks * kChunk * F::VPITCH;
          const uint32_t w0 = *reinterpret_cast<const uint32_t *>(vp0);
          const uint32_t w1 = *reinterpret_cast<const uint32_t *>(vp1);
          const uint32_t w8 = *reinterpret_cast<const uint32_t *>(vp0 + 8 * F::VPITCH);
          const uint32_t w9 = *reinterpret_cast<const uint32_t *>(vp1 + 8 * F::VPITCH);
          uint32_t b01[8], b89[8];
          F::VC::v_codes(w0, w1, b01);
          F::VC::v_codes(w8, w9, b89);
#pragma unroll
          for (int c = 0; c < 8; c += 2)
            mma16816<false>(o[4 * G + c / 2], make_uint4(b01[c], b01[c + 1], b89[c], b89[c + 1]),
                            pg0, pg1);
        }
        mma16816<false>(zsum, make_uint4(zb01, 0u, zb89, 0u), pb0, pb1);
      } else {
#pragma unroll
        for (int v = 0; v < F::VNV; ++v) {
          uint32_t w0[F::VWORDS], w1[F::VWORDS], w8[F::VWORDS], w9[F::VWORDS];
          // Rows 2t (vp0) and 2t + 1 (vp1) of chunk ks, then 8 rows on.
          const int col = F::v_col(g, v);
          const uint8_t *vp0 = st + C::VC_OFF + F::v_at(t, 0, col) + ks * kChunk * F::VPITCH;
          const uint8_t *vp1 =
              (F::VPITCH % 128 == 0 || !F::VSWZ)
                  ? vp0 + F::VPITCH
                  : st + C::VC_OFF + F::v_at(t, 1, col) + ks * kChunk * F::VPITCH;
          lds<F::VVEC>(vp0, w0);
          lds<F::VVEC>(vp1, w1);
          lds<F::VVEC>(vp0 + 8 * F::VPITCH, w8);
          lds<F::VVEC>(vp1 + 8 * F::VPITCH, w9);
#pragma unroll
          for (int i = 0; i < F::VWORDS; ++i) {
            uint32_t b01[F::VCPW], b89[F::VCPW];
            if constexpr (ScaledWordsOf<typename F::VC>::value) {
              // The words' group scales: the byte of their group in each token's meta row.
              constexpr int GB = F::VC::kGroup * F::VBITS / 8;  // code bytes per group
              const int off = F::v_vec(g, v) * F::VVEC + 4 * i;  // in lane g's bytes
              const uint8_t *vm = st + vm_lane +
                                  (F::V_LANE % GB == 0 ? g * (F::V_LANE / GB) + off / GB
                                                       : (g * F::V_LANE + off) / GB);
              auto sb = [&](int e) { return vm[v_row(ks, e) * F::VM_ROW]; };
              F::VC::v_unpack(w0[i], w1[i], sb(0), sb(1), b01);
              F::VC::v_unpack(w8[i], w9[i], sb(2), sb(3), b89);
            } else {
              F::VC::v_unpack(w0[i], w1[i], b01);
              F::VC::v_unpack(w8[i], w9[i], b89);
            }
            if (n_valid < STEP) {
#pragma unroll
              for (int c = 0; c < F::VCOLS; ++c) b01[c] &= mask01, b89[c] &= mask89;
            }
#pragma unroll
            for (int c = 0; c < F::VCOLS; c += 2)
              mma16816<F::V_BF16>(o[(v * F::VEV + i * F::VCPW + c) / 2],
                                  make_uint4(b01[c], b01[c + 1], b89[c], b89[c + 1]), pb0, pb1);
          }
        }
        if constexpr (CodeBiasOf<typename F::VC>::value) {
          // Every code of the chunk carried the bias: its sum against the same P.
          constexpr uint32_t vb = F::VC::kCodeBias;
          mma16816<F::V_BF16>(zsum, make_uint4(vb, vb, vb, vb), pb0, pb1);
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- 4. Merge the warps' (m, l, O) per row through shared memory.
#pragma unroll
  for (int x = 4; x <= 16; x <<= 1) {
    l_r0 += __shfl_xor_sync(kFull, l_r0, x);
    l_r1 += __shfl_xor_sync(kFull, l_r1, x);
  }
  // Every warp is done with its ring; one count per thread block that met a fault.
  if (__syncthreads_or(fault || bad_len) && tid == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
  float *osm = reinterpret_cast<float *>(smem);  // [warp][kRows][OPITCH], natural head_dim order
  float *msm = osm + nw * kRows * C::OPITCH;     // [warp][kRows]
  float *lsm = msm + nw * kRows;                 // [warp][kRows]
  {
    float *o_r0 = osm + (warp * kRows + 2 * t) * C::OPITCH, *o_r1 = o_r0 + C::OPITCH;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      // m-tile i rows g / g + 8 are the columns lane g supplied to n-tiles 2i / 2i + 1.
      const int da = F::v_dim(g, 2 * i), db = F::v_dim(g, 2 * i + 1);
      if constexpr (F::VC::kGroupFrags) {
        // O_j = unit * O_raw_j + sum_n P_n z_{n,G}: 1/4 because P carried 4s, the unit undoes
        // the subnormal code weight (decode/frag.cuh). Group G's sums for rows r0, r1 sit in
        // lane 4G + t, elements 0 and 1.
        const float ua = F::VC::v_col_unit_inv((2 * i) % 8) * 0.25f;
        const float ub = F::VC::v_col_unit_inv((2 * i + 1) % 8) * 0.25f;
        const int src = 4 * ((2 * i) / 8) + t;
        const float z0 = __shfl_sync(kFull, zsum[0], src);
        const float z1 = __shfl_sync(kFull, zsum[1], src);
        o_r0[da] = fmaf(o[i][0], ua, z0);
        o_r1[da] = fmaf(o[i][1], ua, z1);
        o_r0[db] = fmaf(o[i][2], ub, z0);
        o_r1[db] = fmaf(o[i][3], ub, z1);
      } else if constexpr (CodeBiasOf<typename F::VC>::value) {
        // O less the codes' bias, in units of the codes (and of v_ref: kRowScale).
        const float u = F::VC::kCodeUnit * (RowScaleOf<typename F::VC>::value ? v_ref : 1.f);
        o_r0[da] = (o[i][0] - zsum[0]) * u;
        o_r1[da] = (o[i][1] - zsum[1]) * u;
        o_r0[db] = (o[i][2] - zsum[0]) * u;
        o_r1[db] = (o[i][3] - zsum[1]) * u;
      } else if constexpr (RowScaleOf<typename F::VC>::value) {
        o_r0[da] = o[i][0] * v_ref;
        o_r1[da] = o[i][1] * v_ref;
        o_r0[db] = o[i][2] * v_ref;
        o_r1[db] = o[i][3] * v_ref;
      } else {
        o_r0[da] = o[i][0];
        o_r1[da] = o[i][1];
        o_r0[db] = o[i][2];
        o_r1[db] = o[i][3];
      }
    }
  }
  if (g == 0) {
    msm[warp * kRows + 2 * t] = m_r0, msm[warp * kRows + 2 * t + 1] = m_r1;
    lsm[warp * kRows + 2 * t] = l_r0, lsm[warp * kRows + 2 * t + 1] = l_r1;
  }
  __syncthreads();
  if (tid < kRows) {
    // A sink joins the max and the denominator once: here when the sequence has one split,
    // else in the split merge.
    const float sink = nsplit == 1 ? sink_log2(p, kvh, row0 + tid, rows) : -INFINITY;
    float M = sink;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, msm[w * kRows + tid]);
    float L = sink == -INFINITY ? 0.f : fast_exp2(sink - M);
    for (int w = 0; w < nw; ++w) {
      const float f = M == -INFINITY ? 0.f : fast_exp2(msm[w * kRows + tid] - M);
      msm[w * kRows + tid] = f;  // now the warp's weight
      L += f * lsm[w * kRows + tid];
    }
    row_L[tid] = L;
    row_M[tid] = M;
  }
  __syncthreads();
  float v_factor = 1.f;
  if constexpr (F::VC::kHeadScale) v_factor = p.v_scales[kvh] * F::VC::unit();
  const int nvalid = min(kRows, rows - row0);
  const int64_t rq = (int64_t)p.num_q_heads * p.q_len;  // rows of one sequence
  const int64_t seq_row = row_base - (int64_t)b * rq;   // this tile's first row in its sequence
  float *ws_o = p.ws_o + ((int64_t)b * p.num_splits * rq + seq_row) * D;  // + split * rq * D
  float *ws_lse = p.ws_lse + (int64_t)b * p.num_splits * rq + seq_row;   // + split * rq
  for (int i = tid; i < nvalid * D; i += nthreads) {
    const int r = i / D, d = i % D;
    float acc = 0.f;
    for (int w = 0; w < nw; ++w) acc += msm[w * kRows + r] * osm[(w * kRows + r) * C::OPITCH + d];
    const float L = row_L[r];
    const float val = L > 0.f ? acc * (v_factor / L) : 0.f;
    if (nsplit == 1)
      store_out(p.out, row_o[r] + d, val, p.out_dtype);
    else
      ws_o[(split * rq + r) * D + d] = val;
  }
  if (tid < nvalid) {
    const float L = row_L[tid];
    const float lse2 = L > 0.f ? row_M[tid] + log2f(L) : -INFINITY;
    if (nsplit == 1) {
      if (p.lse) p.lse[row_l[tid]] = lse2 * kLn2;
    } else {
      ws_lse[split * rq + tid] = lse2;
    }
  }
  if (nsplit == 1) return;

  // ---- 5. Split-KV: the last CTA of this (sequence, KV head, tile) to finish merges.
  __syncthreads();
  uint32_t *counter = p.ws_counters + ((int64_t)b * p.num_kv_heads + kvh) * p.m_tiles + mt;
  if (tid == 0) {
    __threadfence();  // publish this CTA's partials before counting it
    *flag = atomicAdd(counter, 1u) == (uint32_t)(nsplit - 1);
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();  // see the other CTAs' partials
  float *wts = reinterpret_cast<float *>(smem);  // [split][kRows] weights (ring area is free)
  float4 *part = reinterpret_cast<float4 *>(smem + KVQ_DECODE_MAX_SPLITS * kRows * 4);
  for (int r = warp; r < nvalid; r += nw) {
    const float sink = sink_log2(p, kvh, row0 + r, rows);
    float M = sink;
    for (int s = lane; s < nsplit; s += 32) M = fmaxf(M, __ldcg(ws_lse + s * rq + r));
#pragma unroll
    for (int x = 16; x; x >>= 1) M = fmaxf(M, __shfl_xor_sync(kFull, M, x));
    float L = 0.f;
    for (int s = lane; s < nsplit; s += 32) {
      const float f = M == -INFINITY ? 0.f : fast_exp2(__ldcg(ws_lse + s * rq + r) - M);
      wts[s * kRows + r] = f;
      L += f;
    }
#pragma unroll
    for (int x = 16; x; x >>= 1) L += __shfl_xor_sync(kFull, L, x);
    if (sink != -INFINITY) L += fast_exp2(sink - M);
    if (lane == 0) {
      row_L[r] = L;
      if (p.lse) p.lse[row_l[r]] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    }
  }
  __syncthreads();
  // Each of E float4 elements (row, 4 dims) is summed over the splits by `per` threads (more
  // than one when there are few elements), each taking every per-th split with 8 loads in
  // flight; then the slices are added up.
  constexpr int D4 = D / 4;
  const int E = nvalid * D4;
  int per = 1;
  while (per * 2 * E <= nthreads && per < 32) per *= 2;
  const int64_t stride4 = rq * D4;  // float4s between splits
  for (int base = 0; base < E * per; base += nthreads) {
    const int idx = base + tid, e = idx / per, sl = idx % per;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < E) {
      const int r = e / D4;
      const float4 *src = reinterpret_cast<const float4 *>(ws_o + r * D) + e % D4;
      for (int s0 = sl; s0 < nsplit; s0 += 8 * per) {
        float4 x[8];
        float w[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int s = s0 + u * per;
          x[u] = s < nsplit ? __ldcg(src + s * stride4) : make_float4(0.f, 0.f, 0.f, 0.f);
          w[u] = s < nsplit ? wts[s * kRows + r] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          acc.x += w[u] * x[u].x, acc.y += w[u] * x[u].y;
          acc.z += w[u] * x[u].z, acc.w += w[u] * x[u].w;
        }
      }
    }
    part[tid] = acc;
    __syncthreads();
    if (e < E && sl == 0) {
      for (int k = 1; k < per; ++k) {
        const float4 q = part[tid + k];
        acc.x += q.x, acc.y += q.y, acc.z += q.z, acc.w += q.w;
      }
      const int r = e / D4, d = (e % D4) * 4;
      const float L = row_L[r];
      const float inv = L > 0.f ? 1.f / L : 0.f;
      const int64_t at = row_o[r] + d;
      store_out(p.out, at, acc.x * inv, p.out_dtype);
      store_out(p.out, at + 1, acc.y * inv, p.out_dtype);
      store_out(p.out, at + 2, acc.z * inv, p.out_dtype);
      store_out(p.out, at + 3, acc.w * inv, p.out_dtype);
    }
    __syncthreads();
  }
  if (tid == 0) *counter = 0u;  // ready for the next launch
}

}  // namespace kvq_decode
