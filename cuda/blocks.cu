// blocks.cu: cache maintenance that knows nothing of formats: whole-block copies inside one pool
// (kvq_copy_blocks, the device side of copy-on-write after a fork: a block is an opaque run of
// block_stride bytes) or inside every layer's pool in one launch (kvq_copy_blocks_layers), and
// the in-place update of block tables from mapped host memory (kvq_tables_update).
#include <cuda_runtime.h>

#include "common.cuh"
#include "kvq.h"

namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread

// Copy the x-th run of kCopyThreads * kCopyUnroll 16-byte words of block src to block dst
// (ids already checked): shared by the one-layer and the all-layer kernels.
__device__ __forceinline__ void copy_block_piece(uint8_t *__restrict__ pool,
                                                 int64_t words_per_block, int32_t src,
                                                 int32_t dst) {
  const uint4 *from = reinterpret_cast<const uint4 *>(pool) + src * words_per_block;
  uint4 *to = reinterpret_cast<uint4 *>(pool) + dst * words_per_block;
  const int64_t first = (int64_t)blockIdx.x * kCopyThreads * kCopyUnroll + threadIdx.x;
  uint4 v[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t i = first + u * kCopyThreads;
    if (i < words_per_block) v[u] = from[i];
  }
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t i = first + u * kCopyThreads;
    if (i < words_per_block) to[i] = v[u];
  }
}

__device__ __forceinline__ bool pair_in_pool(int32_t src, int32_t dst, int64_t num_blocks) {
  return src >= 0 && dst >= 0 && src < num_blocks && dst < num_blocks;
}

// Grid (pieces, pairs): block y copies pair y, its x-th run of kCopyThreads * kCopyUnroll
// 16-byte words. A pair naming a block outside the pool is skipped and counted once.
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_kernel(uint8_t *__restrict__ pool, int64_t words_per_block, int64_t num_blocks,
                       const int32_t *__restrict__ pairs, unsigned long long *counters) {
  const int32_t src = pairs[2 * (int64_t)blockIdx.y];
  const int32_t dst = pairs[2 * (int64_t)blockIdx.y + 1];
  if (!pair_in_pool(src, dst, num_blocks)) {
    if (counters != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
      atomicAdd(counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
    return;
  }
  copy_block_piece(pool, words_per_block, src, dst);
}

// Grid (pieces, layers, pairs): the one-layer kernel with layer y's pool (and counters) taken
// from device arrays, so one launch serves every layer of a model.
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_layers_kernel(uint8_t *const *__restrict__ pools,
                              unsigned long long *const *__restrict__ counters,
                              int64_t words_per_block, int64_t num_blocks,
                              const int32_t *__restrict__ pairs) {
  const int32_t src = pairs[2 * (int64_t)blockIdx.z];
  const int32_t dst = pairs[2 * (int64_t)blockIdx.z + 1];
  if (!pair_in_pool(src, dst, num_blocks)) {
    if (counters != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      unsigned long long *c = counters[blockIdx.y];
      if (c != nullptr) atomicAdd(c + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
    }
    return;
  }
  copy_block_piece(pools[blockIdx.y], words_per_block, src, dst);
}

// Thread i < num_lens copies a length, thread num_lens + j applies pair j; the last block to
// finish publishes `generation` to the host (the reads of src are done by then).
__global__ void tables_update_kernel(const int32_t *__restrict__ src, int32_t num_lens,
                                     int32_t *__restrict__ lens_dst,
                                     int32_t *__restrict__ table_dst, int64_t num_pairs,
                                     unsigned int *blocks_finished, unsigned int *done,
                                     unsigned int generation) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_lens) {
    lens_dst[i] = src[i];
  } else if (i < num_lens + num_pairs) {
    const int64_t j = i - num_lens;
    table_dst[src[num_lens + 2 * j]] = src[num_lens + 2 * j + 1];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(blocks_finished, 1u) == gridDim.x - 1) {
      *blocks_finished = 0u;
      __threadfence_system();
      *reinterpret_cast<volatile unsigned int *>(done) = generation;
    }
  }
}

}  // namespace

extern "C" int kvq_tables_update(const int32_t *src, int32_t num_lens, int32_t *lens_dst,
                                 int32_t *table_dst, int64_t num_pairs,
                                 unsigned int *blocks_finished, unsigned int *done,
                                 unsigned int generation, void *stream) {
  if (src == nullptr || lens_dst == nullptr || table_dst == nullptr || blocks_finished == nullptr ||
      done == nullptr || num_lens < 0 || num_pairs < 0)
    return KVQ_ERR_INVALID;
  const int64_t n = (int64_t)num_lens + num_pairs;
  tables_update_kernel<<<n > 0 ? kvq::blocks_for(n) : 1, kvq::kThreadsPerBlock, 0,
                         (cudaStream_t)stream>>>(src, num_lens, lens_dst, table_dst, num_pairs,
                                                 blocks_finished, done, generation);
  return kvq::launch_status();
}

extern "C" int kvq_copy_blocks(const kvq_cache *cache, int64_t num_blocks, const int32_t *pairs,
                               int64_t num_pairs, unsigned long long *counters, void *stream) {
  if (cache == nullptr || cache->pool == nullptr || !kvq::aligned16(cache->pool) ||
      num_blocks <= 0 || num_pairs < 0 || (num_pairs > 0 && pairs == nullptr) ||
      cache->layout.block_stride <= 0 || cache->layout.block_stride % 16 != 0)
    return KVQ_ERR_INVALID;
  if (num_pairs == 0) return KVQ_OK;
  if (num_pairs > 65535) return KVQ_ERR_UNSUPPORTED;  // grid y; the Rust API launches in chunks
  const int64_t words = cache->layout.block_stride / 16;
  const int64_t per_cta = (int64_t)kCopyThreads * kCopyUnroll;
  const dim3 grid((unsigned)((words + per_cta - 1) / per_cta), (unsigned)num_pairs);
  copy_blocks_kernel<<<grid, kCopyThreads, 0, (cudaStream_t)stream>>>(
      cache->pool, words, num_blocks, pairs, counters);
  return kvq::launch_status();
}

extern "C" int kvq_copy_blocks_layers(uint8_t *const *pools, unsigned long long *const *counters,
                                      int32_t num_layers, int64_t block_stride,
                                      int64_t num_blocks, const int32_t *pairs,
                                      int64_t num_pairs, void *stream) {
  if (pools == nullptr || num_layers <= 0 || num_blocks <= 0 || num_pairs < 0 ||
      (num_pairs > 0 && pairs == nullptr) || block_stride <= 0 || block_stride % 16 != 0)
    return KVQ_ERR_INVALID;
  if (num_pairs == 0) return KVQ_OK;
  // grid y and z; the Rust API launches pairs in chunks and refuses more layers
  if (num_pairs > 65535 || num_layers > 65535) return KVQ_ERR_UNSUPPORTED;
  const int64_t words = block_stride / 16;
  const int64_t per_cta = (int64_t)kCopyThreads * kCopyUnroll;
  const dim3 grid((unsigned)((words + per_cta - 1) / per_cta), (unsigned)num_layers,
                  (unsigned)num_pairs);
  copy_blocks_layers_kernel<<<grid, kCopyThreads, 0, (cudaStream_t)stream>>>(
      pools, counters, words, num_blocks, pairs);
  return kvq::launch_status();
}
