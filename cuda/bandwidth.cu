// bandwidth.cu: a streaming-read probe (kvq_stream_read in kvq.h). Benchmarks time it next to
// the decode kernel to get the read ceiling of the same device, in the same run.
#include <cuda_runtime.h>

#include "common.cuh"
#include "kvq.h"

namespace {

constexpr int kReadThreads = 512;
constexpr int kReadBlocksMax = 4096;  // sink length in kvq.h
constexpr int kUnroll = 8;            // independent 16-byte loads in flight per thread

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__global__ void __launch_bounds__(kReadThreads) stream_read(const uint4 *src, int64_t n,
                                                              float *sink) {
  const int64_t stride = (int64_t)gridDim.x * kReadThreads;
  int64_t i = (int64_t)blockIdx.x * kReadThreads + threadIdx.x;
  uint32_t acc = 0;
  // Main part: kUnroll loads issued before any is used.
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = ld_stream(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  // One value per block: xor-reduce, written so the loads cannot be optimised away.
#pragma unroll
  for (int o = 16; o; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t red[kReadThreads / 32];
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t r = 0;
    for (int w = 0; w < kReadThreads / 32; ++w) r ^= red[w];
    sink[blockIdx.x] = (float)(r & 0xffff);
  }
}

}  // namespace

extern "C" int kvq_stream_read(const void *src, int64_t bytes, float *sink, void *stream) {
  if (src == nullptr || sink == nullptr || bytes <= 0 || bytes % 16 != 0 ||
      !kvq::aligned16(src))
    return KVQ_ERR_INVALID;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return kvq::launch_status();
  const int64_t n = bytes / 16;
  int64_t blocks = (int64_t)sms * 4;  // 4 x 512 threads fill an SM
  const int64_t need = (n + kReadThreads - 1) / kReadThreads;
  if (blocks > need) blocks = need;
  if (blocks > kReadBlocksMax) blocks = kReadBlocksMax;
  stream_read<<<(unsigned)blocks, kReadThreads, 0, (cudaStream_t)stream>>>(
      static_cast<const uint4 *>(src), n, sink);
  return kvq::launch_status();
}
