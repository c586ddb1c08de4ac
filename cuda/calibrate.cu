// calibrate.cu: the per-head clipping values of FP8 calibration on a device tensor
// (src/calibrate.rs's head_clip): the rank-th smallest sanitized |x| of each head, exactly.
// Non-negative floats order as their bit patterns, so a radix selection finds it: three passes,
// each a histogram of the next 11, 11 and 10 bits of the values whose higher bits the passes
// before fixed, then one thread per head walks its histogram to the bin that holds the rank.
#include "codec/sanitize.cuh"
#include "common.cuh"
#include "prim/convert.cuh"

namespace kvq {
namespace {

constexpr int kClipBins = 1 << 11;
constexpr int kClipPasses = 3;
// Pass p histograms bits [kShift[p], kShift[p] + kWidth[p]) of a value's f32 pattern.
__constant__ const int kShift[kClipPasses] = {21, 10, 0};
__constant__ const int kWidth[kClipPasses] = {11, 11, 10};

// Per head: the histogram of the current pass, the bits fixed so far and the rank still to
// find among the values that carry them.
struct ClipState {
  unsigned long long *hist;       // [heads][kClipBins]
  uint32_t *prefix;               // [heads]
  unsigned long long *remaining;  // [heads]
};

ClipState clip_state(void *scratch, int heads) {
  auto *hist = static_cast<unsigned long long *>(scratch);
  auto *remaining = hist + (size_t)heads * kClipBins;
  return {hist, reinterpret_cast<uint32_t *>(remaining + heads), remaining};
}

// The sanitized |x| of element i, as bits.
template <typename In> __device__ __forceinline__ uint32_t abs_bits(const In *x, int64_t i) {
  uint32_t unused = 0;
  return __float_as_uint(fabsf(sanitize(to_f32(x[i]), unused)));
}

// Pass `pass` over head blockIdx.y's values (rows r with r % heads == head, `per_head` values
// in all): a shared histogram per thread block, added to the head's.
template <typename In>
__global__ void __launch_bounds__(kThreadsPerBlock)
    clip_histogram(const In *__restrict__ x, int64_t per_head, int heads, int head_dim, int pass,
                   ClipState st) {
  __shared__ uint32_t bins[kClipBins];
  for (int b = threadIdx.x; b < kClipBins; b += blockDim.x) bins[b] = 0;
  __syncthreads();
  const int head = blockIdx.y;
  const int shift = kShift[pass], width = kWidth[pass];
  const int fixed = shift + width;  // bits at and above it were fixed by earlier passes
  const uint32_t prefix = st.prefix[head];
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < per_head; e += stride) {
    const int64_t row = e / head_dim;
    const uint32_t bits = abs_bits(x, (row * heads + head) * head_dim + (e - row * head_dim));
    if (fixed < 32 && (bits >> fixed) != (prefix >> fixed)) continue;
    atomicAdd(&bins[(bits >> shift) & ((1u << width) - 1)], 1u);
  }
  __syncthreads();
  unsigned long long *hist = st.hist + (size_t)head * kClipBins;
  for (int b = threadIdx.x; b < kClipBins; b += blockDim.x)
    if (bins[b] != 0) atomicAdd(hist + b, (unsigned long long)bins[b]);
}

// After pass `pass`: each head's bin holding its remaining rank fixes the pass's bits; the
// histogram is cleared for the next pass, and after the last the value is the clip.
__global__ void clip_select(int heads, int pass, long long rank, ClipState st, float *clip) {
  const int head = blockIdx.x * blockDim.x + threadIdx.x;
  if (head >= heads) return;
  unsigned long long *hist = st.hist + (size_t)head * kClipBins;
  unsigned long long left = pass == 0 ? (unsigned long long)rank : st.remaining[head];
  uint32_t prefix = pass == 0 ? 0u : st.prefix[head];
  int b = 0;
  for (; b < kClipBins - 1 && hist[b] < left; ++b) left -= hist[b];
  for (int i = 0; i < kClipBins; ++i) hist[i] = 0;
  prefix |= (uint32_t)b << kShift[pass];
  st.prefix[head] = prefix;
  st.remaining[head] = left;
  if (pass == kClipPasses - 1) clip[head] = __uint_as_float(prefix);
}

template <typename In>
int run_clip(const In *x, int64_t rows, int heads, int head_dim, long long rank, float *clip,
             void *scratch, cudaStream_t s) {
  const ClipState st = clip_state(scratch, heads);
  const int64_t per_head = rows / heads * head_dim;
  // Enough blocks to fill the GPU several times over, whatever the head count.
  const int64_t want = (per_head + kThreadsPerBlock * 16 - 1) / (kThreadsPerBlock * 16);
  const dim3 grid((unsigned)(want < 1 ? 1 : want > 512 ? 512 : want), (unsigned)heads);
  for (int pass = 0; pass < kClipPasses; ++pass) {
    clip_histogram<In><<<grid, kThreadsPerBlock, 0, s>>>(x, per_head, heads, head_dim, pass, st);
    clip_select<<<(heads + 127) / 128, 128, 0, s>>>(heads, pass, rank, st, clip);
  }
  return launch_status();
}

}  // namespace
}  // namespace kvq

using namespace kvq;

extern "C" int64_t kvq_head_clip_scratch_bytes(int32_t heads) {
  if (heads <= 0) return 0;
  return (int64_t)heads * (kClipBins * 8 + 8 + 4);
}

extern "C" int kvq_head_clip(const void *x, int32_t dtype, int64_t rows, int32_t heads,
                             int32_t head_dim, int64_t rank, float *clip_out, void *scratch,
                             void *stream) {
  if (x == nullptr || clip_out == nullptr || scratch == nullptr || heads <= 0 || heads > 65535 ||
      head_dim <= 0 || rows <= 0 || rows % heads != 0 || rank < 1 ||
      rank > rows / heads * head_dim || (reinterpret_cast<uintptr_t>(scratch) & 7) != 0)
    return KVQ_ERR_INVALID;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The histograms start empty (clip_select clears them between passes).
  if (cudaMemsetAsync(scratch, 0, (size_t)heads * kClipBins * 8, s) != cudaSuccess)
    return launch_status();
  switch (dtype) {
  case KVQ_DTYPE_F32:
    return run_clip(static_cast<const float *>(x), rows, heads, head_dim, rank, clip_out,
                    scratch, s);
  case KVQ_DTYPE_F16:
    return run_clip(static_cast<const __half *>(x), rows, heads, head_dim, rank, clip_out,
                    scratch, s);
  case KVQ_DTYPE_BF16:
    return run_clip(static_cast<const __nv_bfloat16 *>(x), rows, heads, head_dim, rank,
                    clip_out, scratch, s);
  default: return KVQ_ERR_INVALID;
  }
}
