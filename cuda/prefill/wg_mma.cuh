// prefill/wg_mma.cuh: a step's S = Q K^T and O += P V as one warpgroup's wgmma (sm_90a), and
// their waits.
#pragma once

#include "prefill/params.cuh"
#include "prim/wgmma.cuh"

namespace kvq_prefill {

using namespace kvq;

#if KVQ_HAS_WGMMA
/// O += P V on a warpgroup, committed, not waited (wg_pv_wait): P from this thread's A
/// fragments (n-tile j, rows a / b), which the MMAs read until their wait, V the operand tile
/// whose descriptor's low word is v_lo (b128_desc_lo; an N-major B: 16 keys are 2048 bytes of
/// every column block). The fences keep O's rescale and P's packing before the MMAs.
template <bool VB, int D>
__device__ __forceinline__ void wg_pv_issue(float (&o)[D / 8][4], uint32_t (&pa)[8][2],
                                            uint32_t v_lo) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int j = 0; j < 8; ++j) fence_operand(pa[j][0]), fence_operand(pa[j][1]);
  wgmma_fence();
#pragma unroll
  for (int ks2 = 0; ks2 < 4; ++ks2) {
    const uint32_t a[4] = {pa[2 * ks2][0], pa[2 * ks2][1], pa[2 * ks2 + 1][0], pa[2 * ks2 + 1][1]};
    const uint64_t desc = b128_desc_at(v_lo, ks2 * 2048);
    if constexpr (D == 128) wgmma_m64n128k16<VB, 1>(o, a, desc, 1);
    else wgmma_m64n64k16<VB, 1>(o, a, desc, 1);
  }
  wgmma_commit();
}
/// Wait until at most N committed groups of this warpgroup's MMAs are in flight; the fences keep
/// every use of o and pa after the wait.
template <int N, int D>
__device__ __forceinline__ void wg_pv_wait(float (&o)[D / 8][4], uint32_t (&pa)[8][2]) {
  wgmma_wait<N>();
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int j = 0; j < 8; ++j) fence_operand(pa[j][0]), fence_operand(pa[j][1]);
}
/// O += P V, waited.
template <bool VB, int D>
__device__ __forceinline__ void wg_pv(float (&o)[D / 8][4], uint32_t (&pa)[8][2], uint32_t v_lo) {
  wg_pv_issue<VB, D>(o, pa, v_lo);
  wg_pv_wait<0, D>(o, pa);
}
#endif

#if KVQ_HAS_WGMMA
/// Wait for every committed MMA group; the fences keep every use of s after the wait.
__device__ __forceinline__ void wg_wait_committed(float (&s)[8][4]) {
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) fence_operand(s[j][e]);
}
/// Commit and wait for a warpgroup's S MMAs.
__device__ __forceinline__ void wg_wait_scores(float (&s)[8][4]) {
  wgmma_commit();
  wg_wait_committed(s);
}

/// S = Q K^T on a warpgroup, waited (kWait false: committed, not waited; the caller waits,
/// wg_wait_committed): Q from this thread's A fragments qf (held in registers), K the operand
/// tile whose descriptor's low word is k_lo (b128_desc_lo; K-major: 64-column block kk / 4 of
/// the rows, 32 bytes per k-step within it).
template <bool KB, int D, bool kWait = true>
__device__ __forceinline__ void wg_qk(float (&s)[8][4], const uint32_t (&qf)[D / 16][4],
                                      uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t kd = b128_desc_at(k_lo, (kk / 4) * (kTokens * 128) + (kk % 4) * 32);
    wgmma_m64n64k16<KB, 0>(s, qf[kk], kd, kk > 0);
  }
  if constexpr (kWait) wg_wait_scores(s);
  else wgmma_commit();
}

/// The same with Q read from the Q tile (R rows, B128) by descriptor: q_lo is the low word of
/// the descriptor of this warpgroup's 64 rows (column blocks R * 128 bytes apart).
template <bool KB, int D, int R, bool kWait = true>
__device__ __forceinline__ void wg_qk_ss(float (&s)[8][4], uint32_t q_lo, uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t kd = b128_desc_at(k_lo, (kk / 4) * (kTokens * 128) + (kk % 4) * 32);
    const uint64_t qd = b128_desc_at(q_lo, (kk / 4) * (R * 128) + (kk % 4) * 32);
    wgmma_m64n64k16_ss<KB>(s, qd, kd, kk > 0);
  }
  if constexpr (kWait) wg_wait_scores(s);
  else wgmma_commit();
}
#endif

}  // namespace kvq_prefill
