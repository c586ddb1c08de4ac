// prim/packed.cuh: reductions over packed pairs of 16-bit values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace kvq {

template <typename In> struct PairOf;
template <> struct PairOf<__half> {
  using type = __half2;
};
template <> struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

// The N pairs of 16-bit values held in N 32-bit words at `w`, each word and-ed with `mask`
// (0x7FFF7FFF keeps the magnitudes).
template <typename P, int N>
__device__ __forceinline__ void load_pairs(const void *w, uint32_t mask, P (&p)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const uint32_t x = reinterpret_cast<const uint32_t *>(w)[j] & mask;
    p[j] = *reinterpret_cast<const P *>(&x);
  }
}

// Reduce N packed pairs with `op`, as a tree (independent instructions), into p[0].
template <typename P, int N, typename Op>
__device__ __forceinline__ P tree_reduce(P (&p)[N], Op op) {
#pragma unroll
  for (int step = 1; step < N; step *= 2) {
#pragma unroll
    for (int i = 0; i + step < N; i += 2 * step) p[i] = op(p[i], p[i + step]);
  }
  return p[0];
}

// The largest magnitude of the 2N 16-bit values (In: __half or __nv_bfloat16) in the N words at
// `w`, as f32 in `amax` (exact: it is one of them), found on packed pairs (HMNMX2 takes |x| as
// operand modifiers; NaN-propagating). Returns false when a value is NaN or ±Inf.
template <typename In, int N>
__device__ __forceinline__ bool packed_abs_max(const void *w, float &amax) {
  using P = typename PairOf<In>::type;
  P a[N];
  load_pairs(w, 0xFFFFFFFFu, a);
  const P m = tree_reduce(a, [](P x, P y) { return __hmax2_nan(__habs2(x), __habs2(y)); });
  const float m0 = __low2float(m), m1 = __high2float(m);
  amax = fmaxf(m0, m1);
  return m0 <= 0x1.fffffep127f && m1 <= 0x1.fffffep127f;  // false for NaN
}

}  // namespace kvq
