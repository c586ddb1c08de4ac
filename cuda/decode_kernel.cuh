// decode_kernel.cuh: the fused paged decode-attention kernel family and its split-KV reduce.
//
// Grid (splits, num_kv_heads * m_tiles, batch); 4 warps per CTA. A CTA serves one KV head's
// 16-row tile of query rows (G query heads x q_len tokens, rows g*q_len + i, padded to 16) over
// one split (a run of `split_tokens` tokens) of one sequence, so each KV byte of the split is
// read once per tile. Inside the CTA each warp takes every 4th 16-token step of the split and
// runs its own pipeline: cp.async copies of the step's K codes / K meta / V codes / V meta rows
// (each a contiguous run of the page's head section, see src/layout.rs) into a ring of NS
// shared-memory stages, then S = Q K^T and O += P V on tensor cores with an online softmax in
// f32 (log2 domain). The warps' partial results are merged through shared memory at the end;
// a sequence that needs several splits writes normalized partials + log2-sum-exp to the
// workspace and `merge_splits` combines them.
#pragma once

#include "decode_frag.cuh"
#include "kvq.h"

namespace kvq_decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStep = 16;                   // tokens per pipeline step (one P*V k-step)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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
  const int32_t *block_tables, *context_lens;
  float *ws_o, *ws_lse;
  int32_t q_bf16;         // q / out element type: 1 = bf16, 0 = f16
  int32_t num_q_heads, group, q_len, m_tiles;
  int32_t max_blocks, num_splits, split_tokens;
  float sm_scale_log2;    // softmax_scale * log2(e)
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory XOR swizzle of 16-byte units inside each 128-byte line (applied to the offset
// within a region when copying in and when reading out), against bank conflicts between rows.
__device__ __forceinline__ uint32_t swz(uint32_t off) { return off ^ (((off >> 7) & 7u) << 4); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int BYTES>
__device__ __forceinline__ void lds(const uint8_t *p, uint32_t (&w)[BYTES / 4]) {
  if constexpr (BYTES == 16) {
    const uint4 v = *reinterpret_cast<const uint4 *>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = *reinterpret_cast<const uint2 *>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(BYTES == 4, "load width");
    w[0] = *reinterpret_cast<const uint32_t *>(p);
  }
}

__device__ __forceinline__ float load_elem(const void *p, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i])
              : __half2float(reinterpret_cast<const __half *>(p)[i]);
}
__device__ __forceinline__ void store_elem(void *p, int64_t i, float x, bool bf16) {
  if (bf16)
    reinterpret_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(x);
  else
    reinterpret_cast<__half *>(p)[i] = __float2half_rn(x);
}

/// Queue the copy of 16 rows of ROW bytes (rows `off`.. of the region at `region_off` of the head
/// section `base`) into shared memory at `dst`, swizzled; zero-fill when `ok` is false.
template <int ROW>
__device__ __forceinline__ void copy_rows(uint32_t dst, const uint8_t *base, bool ok,
                                          int region_off, int off, int lane) {
  constexpr int CHUNKS = ROW;  // 16 rows * ROW bytes / 16 bytes
  if constexpr (CHUNKS > 0) {
    const uint8_t *src = ok ? base + region_off + (int64_t)off * ROW : base;
#pragma unroll
    for (int i = 0; i < (CHUNKS + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (CHUNKS % 32 == 0 || c < CHUNKS)
        cp_async16(dst + swz(c * 16), ok ? src + c * 16 : src, ok ? 16u : 0u);
    }
  }
}

/// Tokens of sequence b the kernels may touch: its length clamped to what its table row maps
/// and to what the launch's splits cover (both hold for valid input).
__device__ __forceinline__ int seq_len(const Params &p, int b) {
  const long long cap = min((long long)p.max_blocks * p.block_size,
                            (long long)p.num_splits * p.split_tokens);
  const int len = p.context_lens[b];
  return len < 0 ? 0 : (len > cap ? (int)cap : len);
}
__device__ __forceinline__ int splits_of(const Params &p, int len) {
  return len <= 0 ? 1 : (len + p.split_tokens - 1) / p.split_tokens;
}

/// Compile-time shared-memory plan of one instance.
template <Fmt KF, Fmt VF, int D>
struct Smem {
  using F = Frag<KF, VF, D>;
  static constexpr int r128(int n) { return (n + 127) / 128 * 128; }
  // One stage: 16 rows of each region, regions 128-byte aligned.
  static constexpr int KC = r128(kStep * F::KC_ROW);
  static constexpr int KM = r128(kStep * F::KM_ROW);
  static constexpr int VC = r128(kStep * F::VC_ROW);
  static constexpr int VM = r128(kStep * F::VM_ROW);
  static constexpr int KC_OFF = 0, KM_OFF = KC, VC_OFF = KM_OFF + KM, VM_OFF = VC_OFF + VC;
  static constexpr int STAGE = VM_OFF + VM;
  // ~16 KB of copies in flight per warp, 2..8 stages.
  static constexpr int NS_RAW = 16384 / STAGE;
  static constexpr int NS = NS_RAW < 2 ? 2 : (NS_RAW > 8 ? 8 : NS_RAW);
  static constexpr int RING = kWarps * NS * STAGE;
  // After the main loop the ring holds each warp's O tile and (m, l) per row.
  static constexpr int COMBINE = kWarps * 16 * D * 4 + 2 * kWarps * 16 * 4;
  static constexpr int QSTAGE = 16 * D * 4;
  static constexpr int BIG0 = RING > COMBINE ? RING : COMBINE;
  static constexpr int BIG = BIG0 > QSTAGE ? BIG0 : QSTAGE;
  static constexpr int QFRAG = (D / 16) * 32 * 16;
  static constexpr int SMALL = 16 * 4 * 4;  // row factor, row limit, merged L, merged M
  static constexpr int BYTES = BIG + QFRAG + SMALL;
};

template <Fmt KF, Fmt VF, int D>
__global__ void __launch_bounds__(kThreads) decode_kernel(const Params p) {
  using F = Frag<KF, VF, D>;
  using S = Smem<KF, VF, D>;
  constexpr int NS = S::NS;
  extern __shared__ __align__(128) uint8_t smem[];
  uint4 *qfrag = reinterpret_cast<uint4 *>(smem + S::BIG);
  float *row_c = reinterpret_cast<float *>(smem + S::BIG + S::QFRAG);
  int *row_lim = reinterpret_cast<int *>(row_c + 16);
  float *row_L = reinterpret_cast<float *>(row_lim + 16);
  float *row_M = row_L + 16;

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_tiles, mt = blockIdx.y % p.m_tiles;
  const int b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  const int len = seq_len(p, b);
  const int nsplit = splits_of(p, len);
  if (split >= nsplit) return;
  const int t0 = split * p.split_tokens;
  const int t1 = min(len, t0 + p.split_tokens);
  const int rows = p.group * p.q_len;
  const int row0 = mt * 16;
  // Rows of this tile are contiguous in q / out: [b][kvh*G .. ][q_len] flattened.
  const int64_t row_base = ((int64_t)b * p.num_q_heads + (int64_t)kvh * p.group) * p.q_len + row0;

  // ---- 1. Query tile → f32 in shared memory, each row scaled by a power of two so that the
  // f16 operand neither overflows nor loses precision (exact for bf16 inputs), then packed into
  // A fragments in the K-side head_dim order.
  float *qs = reinterpret_cast<float *>(smem);
  for (int i = tid; i < 16 * D; i += kThreads) {
    const int r = i / D;
    qs[i] = row0 + r < rows ? load_elem(p.q, (row_base + r) * D + i % D, p.q_bf16) : 0.f;
  }
  __syncthreads();
  float k_factor = 1.f;
  if constexpr (KF == Fmt::E4M3 || KF == Fmt::E5M2) k_factor = p.k_scales[kvh] * fp8_unit<KF>();
  for (int r = warp; r < 16; r += kWarps) {
    float mx = 0.f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qs[r * D + d]));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const int e = (mx > 0.f && mx <= 3.0e38f) ? ilogbf(mx) : 0;
    for (int d = lane; d < D; d += 32) qs[r * D + d] = ldexpf(qs[r * D + d], -e);
    if (lane == 0) {
      row_c[r] = p.sm_scale_log2 * ldexpf(1.f, e) * k_factor;
      // Query i (row % q_len) sits at position len - q_len + i and sees tokens [0, that].
      const int lim = len - p.q_len + (row0 + r) % p.q_len + 1;
      row_lim[r] = row0 + r < rows ? max(0, min(lim, t1)) : 0;
    }
  }
  __syncthreads();
  for (int i = tid; i < (D / 16) * 32; i += kThreads) {
    const int j = i / 32, ln = i % 32, gg = ln / 4, tt = ln % 4;
    const int d0 = F::k_dim(tt, 2 * j, 0), d1 = F::k_dim(tt, 2 * j, 1);
    const int d2 = F::k_dim(tt, 2 * j + 1, 0), d3 = F::k_dim(tt, 2 * j + 1, 1);
    const float *r0 = qs + gg * D, *r8 = qs + (gg + 8) * D;
    qfrag[i] = make_uint4(pack2<F::K_BF16>(r0[d0], r0[d1]), pack2<F::K_BF16>(r8[d0], r8[d1]),
                          pack2<F::K_BF16>(r0[d2], r0[d3]), pack2<F::K_BF16>(r8[d2], r8[d3]));
  }
  __syncthreads();
  const float c_lo = row_c[g], c_hi = row_c[g + 8];
  const int lim_lo = row_lim[g], lim_hi = row_lim[g + 8];

  // ---- 2. Main loop: this warp's steps w, w+4, ... of [t0, t1).
  const int nsteps = t1 > t0 ? (t1 - t0 + kStep - 1) / kStep : 0;
  const int my_steps = nsteps > warp ? (nsteps - warp + kWarps - 1) / kWarps : 0;
  uint8_t *ring = smem + warp * NS * S::STAGE;
  const uint8_t *head = p.pool + (int64_t)kvh * p.head_stride;
  const int32_t *table = p.block_tables + (int64_t)b * p.max_blocks;
  auto step_token = [&](int k) { return t0 + (warp + k * kWarps) * kStep; };
  // Block-table entry of this warp's step k, read one step before its copy is issued.
  auto page_of = [&](int k) { return k < my_steps ? table[step_token(k) / p.block_size] : -1; };
  uint32_t page_ok = 0;  // bit (k % NS): step k's page was a valid block id

  auto issue = [&](int k, int page) {
    if (k < my_steps) {
      const bool ok = page >= 0 && page < p.num_blocks;
      page_ok = ok ? (page_ok | (1u << (k % NS))) : (page_ok & ~(1u << (k % NS)));
      const int off = step_token(k) % p.block_size;
      const uint8_t *base = ok ? head + page * p.block_stride : p.pool;
      const uint32_t dst = smem_u32(ring + (k % NS) * S::STAGE);
      copy_rows<F::KC_ROW>(dst + S::KC_OFF, base, ok, p.k_codes_off, off, lane);
      copy_rows<F::KM_ROW>(dst + S::KM_OFF, base, ok, p.k_meta_off, off, lane);
      copy_rows<F::VC_ROW>(dst + S::VC_OFF, base, ok, p.v_codes_off, off, lane);
      copy_rows<F::VM_ROW>(dst + S::VM_OFF, base, ok, p.v_meta_off, off, lane);
    }
    cp_async_commit();
  };

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

#pragma unroll 1
  for (int k = 0; k < NS - 1; ++k) issue(k, page_of(k));
  int next_page = page_of(NS - 1);

#pragma unroll 1
  for (int k = 0; k < my_steps; ++k) {
    cp_async_wait<NS - 2>();
    __syncwarp();
    issue(k + NS - 1, next_page);  // into the slot step k-1 used
    next_page = page_of(k + NS);
    const uint8_t *st = ring + (k % NS) * S::STAGE;
    const int tok0 = step_token(k);
    const bool ok = (page_ok >> (k % NS)) & 1u;

    // S = Q K^T for tokens tok0 + [0, 8) (n-tile 0) and tok0 + [8, 16) (n-tile 1).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int v = 0; v < F::KNV; ++v) {
      uint32_t kb[2][F::KPAIRS];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int row = nt * 8 + g;
        uint32_t w[F::KWORDS];
        lds<F::KVEC>(st + S::KC_OFF + swz(row * F::KC_ROW + t * F::KCH + v * F::KVEC), w);
        uint16_t scale = 0;
        if constexpr (KF == Fmt::I4)
          scale = *reinterpret_cast<const uint16_t *>(
              st + S::KM_OFF + swz(row * F::KM_ROW + F::k_group(t, v) * 2));
        F::k_unpack(w, scale, kb[nt]);
      }
#pragma unroll
      for (int jj = 0; jj < F::KPAIRS / 2; ++jj) {
        const uint4 a = qfrag[(v * F::KPAIRS / 2 + jj) * 32 + lane];
        mma16816<F::K_BF16>(s[0], a, kb[0][2 * jj], kb[0][2 * jj + 1]);
        mma16816<F::K_BF16>(s[1], a, kb[1][2 * jj], kb[1][2 * jj + 1]);
      }
    }

    // Online softmax (log2 domain). Thread holds rows g (s[.][0..1]) and g+8 (s[.][2..3]),
    // tokens tok0 + nt*8 + 2t + {0,1}. Masked entries become -inf whatever the codes were.
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok0 + nt * 8 + 2 * t + e;
        s[nt][e] = (ok && tok < lim_lo) ? s[nt][e] * c_lo : -INFINITY;
        s[nt][2 + e] = (ok && tok < lim_hi) ? s[nt][2 + e] * c_hi : -INFINITY;
        mx_lo = fmaxf(mx_lo, s[nt][e]);
        mx_hi = fmaxf(mx_hi, s[nt][2 + e]);
      }
    }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o2));
    }
    const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
    // A row that has seen nothing yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
    const float sub_lo = mn_lo == -INFINITY ? 0.f : mn_lo;
    const float sub_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
    const float al_lo = fast_exp2(m_lo - sub_lo), al_hi = fast_exp2(m_hi - sub_hi);
    m_lo = mn_lo, m_hi = mn_hi;
    float ps_lo = 0.f, ps_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[nt][e] = fast_exp2(s[nt][e] - sub_lo);
        s[nt][2 + e] = fast_exp2(s[nt][2 + e] - sub_hi);
        ps_lo += s[nt][e];
        ps_hi += s[nt][2 + e];
      }
    }
    l_lo = l_lo * al_lo + ps_lo;
    l_hi = l_hi * al_hi + ps_hi;
    if (__any_sync(0xffffffffu, al_lo != 1.f || al_hi != 1.f)) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][0] *= al_lo, o[j][1] *= al_lo;
        o[j][2] *= al_hi, o[j][3] *= al_hi;
      }
    }
    // The S accumulators of n-tiles 0 and 1 are exactly the A fragment of P (k = token).
    const uint4 pa = make_uint4(pack2<F::V_BF16>(s[0][0], s[0][1]),
                                pack2<F::V_BF16>(s[0][2], s[0][3]),
                                pack2<F::V_BF16>(s[1][0], s[1][1]),
                                pack2<F::V_BF16>(s[1][2], s[1][3]));

    // O += P V. Lane t's tokens: 2t, 2t+1 (register b0) and 2t+8, 2t+9 (register b1). Rows past
    // the split's end may hold stale or never-written codes: their values are zeroed.
    uint32_t mask01 = 0xffffffffu, mask89 = 0xffffffffu;
    if (tok0 + kStep > t1) {
      const int n = t1 - tok0;
      mask01 = (2 * t < n ? 0x0000ffffu : 0u) | (2 * t + 1 < n ? 0xffff0000u : 0u);
      mask89 = (2 * t + 8 < n ? 0x0000ffffu : 0u) | (2 * t + 9 < n ? 0xffff0000u : 0u);
    }
#pragma unroll
    for (int v = 0; v < F::VNV; ++v) {
      uint32_t w0[F::VWORDS], w1[F::VWORDS], w8[F::VWORDS], w9[F::VWORDS];
      const int col = g * F::VCH + v * F::VVEC;
      lds<F::VVEC>(st + S::VC_OFF + swz((2 * t) * F::VC_ROW + col), w0);
      lds<F::VVEC>(st + S::VC_OFF + swz((2 * t + 1) * F::VC_ROW + col), w1);
      lds<F::VVEC>(st + S::VC_OFF + swz((2 * t + 8) * F::VC_ROW + col), w8);
      lds<F::VVEC>(st + S::VC_OFF + swz((2 * t + 9) * F::VC_ROW + col), w9);
      uint32_t m0 = 0, m1 = 0, m8 = 0, m9 = 0;
      if constexpr (VF == Fmt::I4) {
        const int mo = F::v_group(g) * 4;
        m0 = *reinterpret_cast<const uint32_t *>(st + S::VM_OFF + swz((2 * t) * F::VM_ROW + mo));
        m1 = *reinterpret_cast<const uint32_t *>(st + S::VM_OFF +
                                                 swz((2 * t + 1) * F::VM_ROW + mo));
        m8 = *reinterpret_cast<const uint32_t *>(st + S::VM_OFF +
                                                 swz((2 * t + 8) * F::VM_ROW + mo));
        m9 = *reinterpret_cast<const uint32_t *>(st + S::VM_OFF +
                                                 swz((2 * t + 9) * F::VM_ROW + mo));
      }
      uint32_t b01[F::VEV], b89[F::VEV];
      F::v_unpack(w0, w1, m0, m1, b01);
      F::v_unpack(w8, w9, m8, m9, b89);
#pragma unroll
      for (int c = 0; c < F::VEV; ++c)
        mma16816<F::V_BF16>(o[v * F::VEV + c], pa, b01[c] & mask01, b89[c] & mask89);
    }
  }
  cp_async_wait<0>();

  // ---- 3. Merge the 4 warps' (m, l, O) per row through shared memory.
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o2);
  }
  __syncthreads();  // every warp is done with its ring
  float *osm = reinterpret_cast<float *>(smem);  // [warp][16][D], head_dim in natural order
  float *msm = osm + kWarps * 16 * D;            // [warp][16]
  float *lsm = msm + kWarps * 16;                // [warp][16]
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    // n-tile j, column n is head_dim n * D/8 + j; lane holds columns 2t, 2t+1.
    float *r_lo = osm + (warp * 16 + g) * D, *r_hi = r_lo + 8 * D;
    r_lo[(2 * t) * (D / 8) + j] = o[j][0];
    r_lo[(2 * t + 1) * (D / 8) + j] = o[j][1];
    r_hi[(2 * t) * (D / 8) + j] = o[j][2];
    r_hi[(2 * t + 1) * (D / 8) + j] = o[j][3];
  }
  if (t == 0) {
    msm[warp * 16 + g] = m_lo, msm[warp * 16 + g + 8] = m_hi;
    lsm[warp * 16 + g] = l_lo, lsm[warp * 16 + g + 8] = l_hi;
  }
  __syncthreads();
  if (tid < 16) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, msm[w * 16 + tid]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = M == -INFINITY ? 0.f : fast_exp2(msm[w * 16 + tid] - M);
      msm[w * 16 + tid] = f;  // now the warp's weight
      L += f * lsm[w * 16 + tid];
    }
    row_L[tid] = L;
    row_M[tid] = M;
  }
  __syncthreads();
  float v_factor = 1.f;
  if constexpr (VF == Fmt::E4M3 || VF == Fmt::E5M2) v_factor = p.v_scales[kvh] * fp8_unit<VF>();
  const bool direct = nsplit == 1;
  const int nvalid = min(16, rows - row0);
  for (int i = tid; i < nvalid * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += msm[w * 16 + r] * osm[(w * 16 + r) * D + d];
    const float L = row_L[r];
    const float val = L > 0.f ? acc * (v_factor / L) : 0.f;
    const int64_t row = row_base + r;
    if (direct) {
      store_elem(p.out, row * D + d, val, p.q_bf16);
    } else {
      const int64_t rq = (int64_t)p.num_q_heads * p.q_len;
      const int64_t wrow = ((int64_t)b * p.num_splits + split) * rq + (row - (int64_t)b * rq);
      p.ws_o[wrow * D + d] = val;
    }
  }
  if (tid < nvalid) {
    const float L = row_L[tid];
    const float lse2 = L > 0.f ? row_M[tid] + log2f(L) : -INFINITY;
    const int64_t row = row_base + tid;
    if (direct) {
      if (p.lse) p.lse[row] = lse2 * kLn2;
    } else {
      const int64_t rq = (int64_t)p.num_q_heads * p.q_len;
      p.ws_lse[((int64_t)b * p.num_splits + split) * rq + (row - (int64_t)b * rq)] = lse2;
    }
  }
}

/// Merge the splits of every (sequence, query row) that needed more than one: one CTA per
/// row, one thread per head_dim element.
template <int D>
__global__ void __launch_bounds__(D) merge_splits(const Params p) {
  __shared__ float w[1024];  // per-split weight (launcher guarantees num_splits <= 1024)
  __shared__ float red[32];
  const int64_t rq = (int64_t)p.num_q_heads * p.q_len;
  const int b = blockIdx.x / rq;
  const int64_t r = blockIdx.x % rq;
  const int len = seq_len(p, b);
  const int n = splits_of(p, len);
  if (n <= 1) return;  // written directly by decode_kernel
  const float *lse = p.ws_lse + (int64_t)b * p.num_splits * rq + r;
  float M = -INFINITY;
  for (int s = threadIdx.x; s < n; s += D) M = fmaxf(M, lse[s * rq]);
#pragma unroll
  for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = M;
  __syncthreads();
  M = -INFINITY;
  for (int i = 0; i < D / 32; ++i) M = fmaxf(M, red[i]);
  __syncthreads();
  float L = 0.f;
  for (int s = threadIdx.x; s < n; s += D) {
    const float f = M == -INFINITY ? 0.f : fast_exp2(lse[s * rq] - M);
    w[s] = f;
    L += f;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = L;
  __syncthreads();
  L = 0.f;
  for (int i = 0; i < D / 32; ++i) L += red[i];
  const float *po = p.ws_o + ((int64_t)b * p.num_splits * rq + r) * D + threadIdx.x;
  float acc = 0.f;
  for (int s = 0; s < n; ++s) acc += w[s] * po[s * rq * D];
  const int64_t row = (int64_t)b * rq + r;
  store_elem(p.out, row * D + threadIdx.x, L > 0.f ? acc / L : 0.f, p.q_bf16);
  if (threadIdx.x == 0 && p.lse) p.lse[row] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
}

}  // namespace kvq_decode
