// prefill/softmax.cuh: a warp's online softmax over the steps (masks, windows, soft cap, ALiBi,
// the lazy reference max), and the rows' normalized output, lse and split partials.
#pragma once

#include "codec/fp8.cuh"
#include "prefill/tiles.cuh"
#include "prim/fast_math.cuh"
#include "prim/mma.cuh"

namespace kvq_prefill {

using namespace kvq;

/// One warp's online softmax over steps of kTokens keys (log2 domain), for this thread's rows
/// a and b of the C fragments: rows ra = 16 w + g and rb = ra + 8 of the CTA (warp w of the
/// MMAs).
template <int R> struct WarpSoftmax {
  const RowInfo<R> &rw;
  int ra, rb, t;
  int lo_a, hi_a, lo_b, hi_b;
  // Keys any of the warp's rows sees, [w_lo, w_hi), and that all of them see, [in_lo, in_hi).
  int w_lo, w_hi, in_lo, in_hi;
  float mul_a, mul_b, cap2;
  bool plain_ok, capped, biased;
  float m_a, m_b, l_a, l_b;

  __device__ __forceinline__ WarpSoftmax(const Params &p, const RowInfo<R> &rows, int warp,
                                         float k_factor)
      : rw(rows) {
    const int lane = threadIdx.x % 32, g = lane / 4;
    t = lane % 4;
    ra = warp * 16 + g, rb = ra + 8;
    lo_a = rw.lo[ra], hi_a = rw.hi[ra], lo_b = rw.lo[rb], hi_b = rw.hi[rb];
    w_lo = INT32_MAX, w_hi = 0, in_lo = 0, in_hi = INT32_MAX;
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
      if (rw.hi[r] > rw.lo[r]) w_lo = min(w_lo, rw.lo[r]), w_hi = max(w_hi, rw.hi[r]);
      in_lo = max(in_lo, rw.lo[r]), in_hi = min(in_hi, rw.hi[r]);
    }
    capped = p.soft_cap > 0.f, biased = p.alibi_slopes != nullptr;
    // Logits in the log2 domain: x * mul (no cap) or cap2 * tanh(x * mul) (capped), then plus
    // the ALiBi bias (biased).
    const float mul =
        capped ? p.sm_scale * k_factor / p.soft_cap : p.sm_scale * k_factor * kLog2e;
    cap2 = p.soft_cap * kLog2e;
    mul_a = mul * rw.qs[ra], mul_b = mul * rw.qs[rb];
    // A step whose keys every row of the warp sees, without a cap, takes the plain path: the
    // scale folds into the exponent's FMA and nothing is masked (a positive scale keeps the
    // max). ALiBi slopes empty the range every row sees instead (the masked path applies them;
    // a third term in plain_ok cost ptxas 23 registers at head_dim 64, wide tiles).
    plain_ok = !capped && mul > 0.f;
    if (biased) in_lo = INT32_MAX;
    m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  }

  /// Step of keys [tok0, tok0 + kTokens): from the scores s (16 rows x 64 keys a warp), rescale
  /// O and l, and return P as A operands in pa (n-tile j, rows a (0) / b (1), keys 2t, 2t + 1).
  template <bool VB, int D, bool E4M3 = false>
  __device__ __forceinline__ void step(float (&s)[8][4], int tok0, float (&o)[D / 8][4],
                                       uint32_t (&pa)[8][2]) {
    // Running max of the logits (log2 domain). The exponent below is s * e_a - sub_a: plain,
    // s is the raw score and e_a the row's scale; otherwise s is the finished logit (scaled,
    // capped, biased, masked to -inf) and e_a is 1.
    float mx_a = -INFINITY, mx_b = -INFINITY, e_a = 1.f, e_b = 1.f;
    if (plain_ok && tok0 >= in_lo && tok0 + kTokens <= in_hi) {
      // Pairwise, so that the chain of dependent maxima is 4 deep rather than 8.
      float ma[8], mb[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        ma[j] = fmaxf(s[j][0], s[j][1]), mb[j] = fmaxf(s[j][2], s[j][3]);
#pragma unroll
      for (int w = 4; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j)
          ma[j] = fmaxf(ma[j], ma[j + w]), mb[j] = fmaxf(mb[j], mb[j + w]);
      mx_a = ma[0], mx_b = mb[0];
      e_a = mul_a, e_b = mul_b;
    } else {
      // Key tok is in row a's range when tok - lo_a < hi_a - lo_a (unsigned).
      const int da = tok0 + 2 * t - lo_a, db = tok0 + 2 * t - lo_b;
      const unsigned wa = hi_a - lo_a, wb = hi_b - lo_b;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[j][e] * (e < 2 ? mul_a : mul_b);
          if (capped) {
            float th;
            asm("tanh.approx.f32 %0, %1;" : "=f"(th) : "f"(x));
            x = cap2 * th;
          }
          const int k = j * 8 + (e & 1);
          if (biased) {
            // ALiBi after the cap: the row's slope times the key's offset from its position.
            const int rr = e < 2 ? ra : rb;
            x = fmaf(rw.slope[rr], (float)(tok0 + 2 * t + k - rw.pos[rr]), x);
          }
          const bool in = e < 2 ? (unsigned)(da + k) < wa : (unsigned)(db + k) < wb;
          s[j][e] = in ? x : -INFINITY;
        }
        mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
      }
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      mx_a = fmaxf(mx_a, __shfl_xor_sync(kFull, mx_a, x));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(kFull, mx_b, x));
    }
    mx_a *= e_a, mx_b *= e_b;
    // A row's reference m moves to the step's max only when that exceeds it by more than
    // kSlack: until then its exponentials stay below 2^kSlack (f32 l and 16-bit P hold them as
    // well as below 1) and O and l keep their scale, since O / l is the same quotient under
    // any reference. A row that has seen nothing keeps m = -inf (-inf - -inf is NaN: no move;
    // O and l are 0). E4M3 P, which already carries 2^kE4m3POffset, moves at any growth.
    constexpr float kSlack = E4M3 ? 0.f : kRescaleSlack;
    const bool mv_a = mx_a - m_a > kSlack, mv_b = mx_b - m_b > kSlack;
    const float mn_a = mv_a ? mx_a : m_a, mn_b = mv_b ? mx_b : m_b;
    const float al_a = mv_a ? fast_exp2(m_a - mn_a) : 1.f;
    const float al_b = mv_b ? fast_exp2(m_b - mn_b) : 1.f;
    m_a = mn_a, m_b = mn_b;
    // E4M3 P: the exponentials carry the factor 2^kE4m3POffset (so does l; the caller takes it
    // out of both before finish).
    constexpr float kOff = E4M3 ? kE4m3POffset : 0.f;
    const float sub_a = (mn_a == -INFINITY ? 0.f : mn_a) - kOff;
    const float sub_b = (mn_b == -INFINITY ? 0.f : mn_b) - kOff;
    l_a *= al_a, l_b *= al_b;
    // O keeps its scale when no row of the warp moved its reference, most steps once the
    // rows' first keys are seen.
    if (__any_sync(kFull, mv_a || mv_b)) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        o[i][0] *= al_a, o[i][1] *= al_a, o[i][2] *= al_b, o[i][3] *= al_b;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = fast_exp2(fmaf(s[j][0], e_a, -sub_a));
      const float p1 = fast_exp2(fmaf(s[j][1], e_a, -sub_a));
      const float p2 = fast_exp2(fmaf(s[j][2], e_b, -sub_b));
      const float p3 = fast_exp2(fmaf(s[j][3], e_b, -sub_b));
      l_a += p0 + p1, l_b += p2 + p3;
      if constexpr (E4M3) {
        pa[j][0] = fp8x2_encode<kFp8E4m3>(make_float2(p0, p1));
        pa[j][1] = fp8x2_encode<kFp8E4m3>(make_float2(p2, p3));
      } else {
        pa[j][0] = pack2<VB>(p0, p1);
        pa[j][1] = pack2<VB>(p2, p3);
      }
    }
  }

  /// Epilogue: row sums across the quad, then this thread's two rows: the normalized partial
  /// and its lse to the workspace (more than one split), else out (sinks applied) and lse.
  template <int D>
  __device__ __forceinline__ void finish(const Params &p, const TileJob &j, float (&o)[D / 8][4],
                                         float v_factor) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      l_a += __shfl_xor_sync(kFull, l_a, x);
      l_b += __shfl_xor_sync(kFull, l_b, x);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rr = half ? rb : ra;
      if (j.r0 + rr >= j.rows) continue;
      const float m = half ? m_b : m_a, l = half ? l_b : l_a;
      const int h = rw.head[rr];
      const int64_t grow = (int64_t)(j.q0 + (j.r0 + rr) / p.group) * p.num_q_heads + h;
      if (p.num_splits > 1) {
        // Normalized partial and its natural-log lse; the merge applies the sinks.
        const float inv = l > 0.f ? v_factor / l : 0.f;
        float *dst = p.ws_o + ((int64_t)j.split * p.ws_rows + grow) * D;
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          const int d = c * 8 + 2 * t;
          const float *oc = o[c] + 2 * half;
          *reinterpret_cast<float2 *>(dst + d) = make_float2(oc[0] * inv, oc[1] * inv);
        }
        if (t == 0)
          p.ws_lse[(int64_t)j.split * p.ws_rows + grow] =
              l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
        continue;
      }
      float M = m, scale_o = 1.f, L = l;
      if (p.sinks != nullptr) {
        const float s2 = p.sinks[h] * kLog2e;
        M = fmaxf(m, s2);
        scale_o = m == -INFINITY ? 0.f : fast_exp2(m - M);
        L = l * scale_o + fast_exp2(s2 - M);
      }
      const float inv = L > 0.f ? scale_o * v_factor / L : 0.f;
      // A row starts on an even element when the view's strides are even (d is).
      const bool paired = ((p.o_tok | p.o_head) & 1) == 0 &&
                          (reinterpret_cast<uintptr_t>(p.out) & 7) == 0;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const int d = c * 8 + 2 * t;
        const float *oc = o[c] + 2 * half;
        store_out2(p.out, rw.out[rr] + d, oc[0] * inv, oc[1] * inv, p.out_dtype, paired);
      }
      if (t == 0 && p.lse != nullptr)
        p.lse[rw.lse[rr]] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    }
  }
};

}  // namespace kvq_prefill
