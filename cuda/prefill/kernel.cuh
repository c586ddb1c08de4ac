// prefill/kernel.cuh: attention of many query rows over the paged cache (chunked prefill,
// prefix hits, speculative verification), for every cache format; the block-synchronous
// kernel, which serves every instance (prefill_ws_kernel, ws_kernel.cuh, serves most on
// sm_90a at head_dim 128).
//
// Grid (tiles, num_kv_heads, splits), R / 16 warps per CTA. A sequence's query rows are its
// new tokens x the G query heads of one KV head, token-major (row r = token r / G, head r % G),
// so the G heads share every KV byte read; a CTA serves R of them (16 a warp) over one split of
// the keys: R = 64, or 128 (wide tiles, two warpgroups sharing every KV tile and its decode)
// when the launch's sequences average that many rows, or on the warp-specialized kernel 192
// (triple tiles, three warpgroups; 16-bit or decoded sides) where the launcher's estimate says
// so. Tiles are numbered over the batch in the CTA itself (a scan of qo_indptr), each
// sequence's last (longest, under the causal mask) tile first, and the CTAs with the KV head
// and the split fastest, so that the longest tiles of every head start first.
//
// Per step of 64 KV tokens each warp computes S = Q K^T and O += P V for its 16 rows on tensor
// cores (f32 accumulate; on sm_90a at head_dim 64 / 128 as one warpgroup's wgmma, else mma.sync
// m16n8k16) with an online softmax in the log2 domain, from 16-bit operand tiles in shared
// memory. A side (K or V) whose cache format is its operand type (f16, bf16) is copied straight
// into two alternating operand tiles; a quantized side is copied raw (codes and metadata, runs of
// 16 tokens of one page) into two alternating staging areas and decoded by every thread with the
// format's codec (codec/: the exact FORMATS.md values; FP8's per-head scale is left out and
// applied to S and O) into an operand tile: a step ahead into the second tile up to head_dim 128
// (pipelined), else into one tile between two barriers. The next step's copies fly during this
// step's decode and MMAs.
//
// Operand types: bf16 for a bf16 side, else f16 (exact for FP8 codes; decoded INT4 values are
// rounded once). bf16 queries over an f16 key operand are scaled per row by a power of two into
// f16's range (as the decode kernel does), the factor applied to the row's scores.
//
// int4-kc keys, which have no row codec (a block is quantized per channel once it is full), have
// instances of their own (KC): a sealed block's code rows are staged with its s and z (once per
// block and step) and decoded to f16 (q * s + z, rounded once); the rows of a sequence's open
// last block are its f16 window, copied from the pool into the operand tile when the step is
// decoded.
//
// A split that is not the only one writes its normalized partial O and its lse to the
// workspace; merge_splits (prefill.cu) combines them and applies the sinks.
//
// The pieces both kernels share are the other headers of prefill/, one concept each
// (docs/ARCHITECTURE.md says what each holds).
#pragma once

#include "prefill/copies.cuh"
#include "prefill/decode_rows.cuh"
#include "prefill/int4_kc.cuh"
#include "prefill/softmax.cuh"
#include "prefill/tiles.cuh"
#include "prefill/wg_mma.cuh"
#include "prim/mma.cuh"
#include "prim/pdl.cuh"

namespace kvq_prefill {

using namespace kvq;

/// KC: the instance for int4-kc keys (f16 operands), whatever p.k says; the other instances
/// carry none of its code.
template <int D, bool KB, bool VB, int R, bool KC = false>
__global__ void __launch_bounds__(threads_of<R>()) prefill_kernel(const Params p) {
  static_assert(!(KC && KB), "int4-kc keys decode to f16 operands");
  constexpr int kThreads = threads_of<R>(), kWarps = kThreads / 32;
  constexpr int P = pitch<D>();
  constexpr int TILE = kTokens * P;
  // Pipelined (decode a step ahead) up to head_dim 128; wider rows decode between two barriers.
  constexpr bool PIPE = pipelined(D);
  constexpr bool QREG = q_in_registers<D, R>();
  // wgmma (a warpgroup per 64 rows) on B128 tiles, else mma.sync per warp on padded rows.
  constexpr bool WG = uses_wgmma<D>();
  static_assert(!WG || (kTokens == 64 && R % 64 == 0), "warpgroups of 64 rows, 64-token steps");
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t *const smem = align1024(smem_raw);
  __shared__ RowInfo<R> rw;

  TileJob job;
  if (!begin_tile<R, kThreads>(p, rw, job)) return;
  const int kvh = job.kvh, len = job.len;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const bool k_direct = !KC && p.k.direct, v_direct = p.v.direct;
  const Layout L = smem_layout<D, R>(p.k, p.v);
  uint8_t *qs = smem + L.q;

  // ---- Q tile: commit group 1 of 3.
  load_q<D, R, WG, kThreads>(p, job, qs);
  __syncthreads();  // row bounds

  int kv_lo, kv_hi;
  tile_keys(rw, &kv_lo, &kv_hi);
  const int base = kv_hi > kv_lo ? kv_lo / kRun * kRun : 0;
  const int nsteps = kv_hi > kv_lo ? (kv_hi - base + kTokens - 1) / kTokens : 0;

  const uint8_t *head = p.pool + (int64_t)kvh * p.head_stride;
  const int32_t *table = p.block_tables + (int64_t)job.b * p.max_blocks;
  bool fault = false;
  // Step s's operand tile and (quantized side) staging area of each side.
  auto k_op = [&](int s) {
    return smem + L.k_op + ((k_direct || PIPE) ? (s & 1) * TILE : 0);
  };
  auto v_op = [&](int s) {
    return smem + L.v_op + ((v_direct || PIPE) ? (s & 1) * TILE : 0);
  };
  auto k_stage = [&](int s) { return smem + L.k_stage + (s & 1) * stage_bytes(p.k); };
  auto v_stage = [&](int s) { return smem + L.v_stage + (s & 1) * stage_bytes(p.v); };
  // Page offsets of step s, found by threads 0..3 three steps ahead into set s % 4 and read
  // after the next barrier (a direct side's copies are queued one step ahead, a quantized
  // side's two on the pipelined schedule).
  __shared__ StepPages pages[4];
  auto find_pages = [&](int st) {
    if (tid < kTokens / kRun && st < nsteps) {
      const int tok = base + st * kTokens + tid * kRun;
      int64_t at = -1;
      int32_t off = 0;
      if (tok < kv_hi) {
        const int page = (int)p.block_div.div((uint32_t)tok);
        off = tok - page * p.block_size;
        at = block_offset(p, table[page], &fault);
      }
      pages[st & 3].at[tid] = at;
      pages[st & 3].off[tid] = off;
    }
  };
  // Queue the copies of direct sides for step ds and of quantized sides for step rs (steps
  // past the last are skipped), as one commit group.
  auto issue = [&](int ds, int rs) {
    const int d_hi = kv_hi - (base + ds * kTokens), r_hi = kv_hi - (base + rs * kTokens);
    const int r_runs = min(kTokens / kRun, (r_hi + kRun - 1) / kRun);
    if (k_direct) {
      if (ds < nsteps)
        issue_direct<D, WG, kThreads>(head, p.k.codes_off, pages[ds & 3], d_hi, k_op(ds));
    } else if (rs < nsteps) {
      if constexpr (KC) {
        const int sealed_runs = (kc_sealed_end(len, p.block_size) - (base + rs * kTokens)) / kRun;
        issue_kc<D, kThreads>(p.k, head, pages[rs & 3], min(r_runs, sealed_runs), k_stage(rs));
      } else {
        issue_raw<kThreads>(p.k, head, pages[rs & 3], r_runs, k_stage(rs));
      }
    }
    if (v_direct) {
      if (ds < nsteps)
        issue_direct<D, WG, kThreads>(head, p.v.codes_off, pages[ds & 3], d_hi, v_op(ds));
    } else if (rs < nsteps) {
      issue_raw<kThreads>(p.v, head, pages[rs & 3], r_runs, v_stage(rs));
    }
    cp_async_commit();
  };
  // Decode the quantized sides of step s from their staging areas into their operand tiles.
  auto decode_step = [&](int s) {
    if (s >= nsteps) return;
    const int tok0 = base + s * kTokens;
    const int lo = max(kv_lo, tok0) - tok0, hi = min(kv_hi, tok0 + kTokens) - tok0;
    if (!k_direct) {
      const uint8_t *raw = k_stage(s);
      if constexpr (KC)
        decode_kc<D, WG, kThreads>(raw, p.k, head, pages[s & 3], k_op(s), lo, hi,
                                   kc_sealed_end(len, p.block_size) - tok0);
      else
        decode_any<KB, D, WG, kThreads, false>(side_major(raw, p.k), nullptr, p.k, k_op(s), lo,
                                               hi);
    }
    if (!v_direct) {
      const uint8_t *raw = v_stage(s);
      decode_any<VB, D, WG, kThreads, false>(side_major(raw, p.v), nullptr, p.v, v_op(s), lo,
                                             hi);
    }
  };
  find_pages(0);
  find_pages(1);
  find_pages(2);
  __syncthreads();
  issue(0, 0);                 // group 2
  issue(nsteps, PIPE ? 1 : nsteps);  // group 3 (empty off the pipelined schedule)

  cp_async_wait<2>();  // the Q tile
  __syncthreads();
  if (p.q_bf16 && !KB) {
    scale_q<D, R, WG>(qs, rw, warp, kWarps);
    __syncthreads();
  }

  const float k_factor = head_factor(p.k_scales, kvh), v_factor = head_factor(p.v_scales, kvh);
  WarpSoftmax<R> sm(p, rw, warp, k_factor);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  // ldmatrix row addresses of this lane: Q (A operand) rows warp*16 + lane % 16, column half
  // lane / 16; K (B operand, two n-tiles) token (lane / 16) * 8 + lane % 8, column half
  // (lane / 8) % 2; V (transposed B) token lane % 8 + ((lane / 8) % 2) * 8, column half lane / 16.
  const uint32_t q_addr = smem_u32(qs) + (warp * 16 + lane % 16) * P + (lane / 16) * 16;
  const uint32_t k_lane = ((lane / 16) * 8 + lane % 8) * P + ((lane / 8) % 2) * 16;
  const uint32_t v_lane = (lane % 8 + ((lane / 8) % 2) * 8) * P + (lane / 16) * 16;
  uint32_t qf[QREG ? D / 16 : 1][4];
  // Q fragment kk of this warp (A operand): in the B128 tile, chunk 2 kk + lane / 16 of row
  // warp * 16 + lane % 16.
  auto q_frag = [&](int kk, uint32_t(&a)[4]) {
    if constexpr (WG)
      ldmatrix_x4(smem_u32(qs) + tile_at<D, true, R>(warp * 16 + lane % 16, 2 * kk + lane / 16),
                  a);
    else ldmatrix_x4(q_addr + kk * 32, a);
  };
  if constexpr (QREG) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) q_frag(kk, qf[kk]);
  }
  if (PIPE) {
    cp_async_wait<1>();  // step 0
    __syncthreads();
    decode_step(0);
  }

#pragma unroll 1
  for (int st = 0; st < nsteps; ++st) {
    const int tok0 = base + st * kTokens;
    cp_async_wait<0>();
#if KVQ_HAS_WGMMA
    if constexpr (WG) fence_proxy_async();  // this thread's copies and decoded rows, for wgmma
#endif
    // Step st is in (and, pipelined, decoded); every warp is done with step st - 1's tiles.
    __syncthreads();
    issue(st + 1, st + (PIPE ? 2 : 1));
    find_pages(st + 3);  // set (st - 1) % 4: read by the copies queued before this barrier
    if (PIPE) {
      decode_step(st + 1);  // into the tiles step st - 1 used; read after the next barrier
    } else if (!k_direct || !v_direct) {
      decode_step(st);
      // int4-kc: the open block's rows it copied (the next step's copies wait with them).
      if constexpr (KC)
        if (kc_sealed_end(len, p.block_size) < min(kv_hi, tok0 + kTokens)) cp_async_wait<0>();
      __syncthreads();
    }
    // No key of this step for the warp: skipped, but the warpgroup's MMAs take every warp.
    if (!WG && (tok0 >= sm.w_hi || tok0 + kTokens <= sm.w_lo)) continue;
    const uint32_t ks_u = smem_u32(k_op(st)) + k_lane;
    const uint32_t vs_u = smem_u32(v_op(st)) + v_lane;

    // S = Q K^T: 16 rows x 64 tokens (8 n-tiles of 8 tokens) a warp.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#if KVQ_HAS_WGMMA
    if constexpr (WG) {
      // K-major A and B: 64-column block kk / 4 of the rows, 32 bytes per k-step within it; A
      // is this warpgroup's 64 rows of the Q tile (or, held, its registers).
      const uint32_t kt = smem_u32(k_op(st)), qt = smem_u32(qs) + (warp / 4) * 64 * 128;
      if constexpr (QREG) {
        wg_qk<KB, D>(s, qf, b128_desc_lo(kt, 8192));
      } else {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint64_t kd = b128_desc(kt + (kk / 4) * (kTokens * 128) + (kk % 4) * 32, 8192);
          const uint64_t qd = b128_desc(qt + (kk / 4) * (R * 128) + (kk % 4) * 32, R * 128);
          wgmma_m64n64k16_ss<KB>(s, qd, kd, kk > 0);
        }
        wg_wait_scores(s);
      }
    }
#endif
#pragma unroll
    for (int kk = 0; kk < (WG ? 0 : D / 16); ++kk) {
      uint32_t a[4];
      if constexpr (QREG) {
        a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
      } else {
        q_frag(kk, a);
      }
      const uint4 av = make_uint4(a[0], a[1], a[2], a[3]);
#pragma unroll
      for (int j2 = 0; j2 < 4; ++j2) {
        uint32_t bk[4];
        ldmatrix_x4(ks_u + j2 * 16 * P + kk * 32, bk);
        mma16816<KB>(s[2 * j2], av, bk[0], bk[1]);
        mma16816<KB>(s[2 * j2 + 1], av, bk[2], bk[3]);
      }
    }

    uint32_t pa[8][2];  // P as A operands: n-tile j, rows a (0) / b (1), tokens 2t, 2t + 1
    sm.template step<VB, D>(s, tok0, o, pa);

    // O += P V: per 16 tokens, A = P (n-tiles 2ks, 2ks + 1), B = V^T by transposed ldmatrix
    // (or, wgmma, an N-major B: 16 keys are 2048 bytes of every column block).
#if KVQ_HAS_WGMMA
    if constexpr (WG) wg_pv<VB, D>(o, pa, b128_desc_lo(smem_u32(v_op(st)), 8192));
#endif
#pragma unroll
    for (int ks2 = 0; ks2 < (WG ? 0 : 4); ++ks2) {
      const uint4 av = make_uint4(pa[2 * ks2][0], pa[2 * ks2][1], pa[2 * ks2 + 1][0],
                                  pa[2 * ks2 + 1][1]);
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(vs_u + ks2 * 16 * P + d2 * 32, bv);
        mma16816<VB>(o[2 * d2], av, bv[0], bv[1]);
        mma16816<VB>(o[2 * d2 + 1], av, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();

  // One count per thread block that met a fault.
  if (__syncthreads_or(fault || job.bad_len) && tid == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);

  sm.template finish<D>(p, job, o, v_factor);
}

}  // namespace kvq_prefill
