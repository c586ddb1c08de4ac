// bandwidth.cu: streaming-read probes (kvq_stream_read* in kvq.h). Benchmarks time every variant
// in the same run as the decode kernel and divide by the fastest, so "% of ceiling" is measured
// against the best plain read this build can do on that GPU, not against one fixed recipe whose
// fit to the memory system varies from GPU to GPU.
//
// Every variant adds the 32-bit words it reads (mod 2^32) into the sink: the loads cannot be
// optimised away, and on a buffer from kvq_stream_fill the host can check that a variant read
// every byte exactly once (a variant that skipped part of the buffer would otherwise "win").
#include <cuda_runtime.h>

#include "common.cuh"
#include "kvq.h"
#include "prim/mbarrier.cuh"

namespace {

// ---- 16-byte global loads ---------------------------------------------------------------------

// How a 16-byte load is issued (PTX; the SASS is LDG.E.128 with the matching cache bits).
enum class Ld {
  kCs,     // ld.global.cs: streaming, evict-first
  kNc,     // ld.global.nc.L1::no_allocate: read-only path, no L1 line allocated
  kNc256,  // kNc plus an L2::256B prefetch hint: L2 fetches 256-byte blocks from DRAM
  kPlain,  // ld.global: default caching
};

template <Ld L>
__device__ __forceinline__ uint4 load16(const uint4 *p);

template <>
__device__ __forceinline__ uint4 load16<Ld::kCs>(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint4 load16<Ld::kNc>(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint4 load16<Ld::kNc256>(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint4 load16<Ld::kPlain>(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t sum4(const uint4 v) { return v.x + v.y + v.z + v.w; }

// Block-wide sum of `acc`, added by thread 0 to one sink word. An atomic rather than a store
// because one-tile-per-block grids have far more blocks than the sink has words.
template <int T>
__device__ __forceinline__ void publish(uint32_t acc, uint32_t *sink) {
#pragma unroll
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t red[T / 32];
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t r = 0;
#pragma unroll
    for (int w = 0; w < T / 32; ++w) r += red[w];
    atomicAdd(sink + blockIdx.x % KVQ_STREAM_SINK_WORDS, r);
  }
}

// ---- register variants: every thread keeps U loads in flight ----------------------------------

// Which 16-byte vectors a thread block reads.
enum class Walk {
  // Load u of a thread at i + u * (threads in the grid): each batch of U loads of the whole grid
  // covers U windows of grid x T vectors (the layout of the original probe).
  kStrided,
  // Tiles of T * U contiguous vectors; block b reads tiles b, b + grid, ... With one block per
  // tile this is a non-persistent kernel, the layout of a Triton streaming read.
  kTiles,
  // One contiguous run of tiles per block: grid independent sequential streams.
  kChunks,
};

// Threads an SM of the arch being compiled holds (sm_86 / sm_87 / sm_89: 1536), so that launch
// bounds never ask for more blocks per SM than fit (ptxas would ignore them, with a warning).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
constexpr int kSmThreads = 1536;
#else
constexpr int kSmThreads = 2048;
#endif
constexpr int min_blocks(int threads, int blocks) {
  return blocks * threads <= kSmThreads ? blocks : kSmThreads / threads;
}

// MinBlocks caps registers (65536 / (MinBlocks * T)) so that many blocks fit on an SM; U must fit
// in what is left (4 registers per load), or ptxas consumes early loads before issuing late ones.
template <Ld L, int T, int U, Walk W, int MinBlocks>
__global__ void __launch_bounds__(T, min_blocks(T, MinBlocks))
    read_regs(const uint4 *__restrict__ src, int64_t n, uint32_t *sink) {
  uint32_t acc = 0;
  if constexpr (W == Walk::kStrided) {
    const int64_t stride = (int64_t)gridDim.x * T;
    int64_t i = (int64_t)blockIdx.x * T + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load16<L>(src + i + u * stride);
#pragma unroll
      for (int u = 0; u < U; ++u) acc += sum4(v[u]);
    }
    for (; i < n; i += stride) acc += sum4(load16<L>(src + i));
  } else {
    constexpr int64_t kTile = (int64_t)T * U;
    const int64_t tiles = (n + kTile - 1) / kTile;
    int64_t t, end, step;
    if constexpr (W == Walk::kTiles) {
      t = blockIdx.x;
      end = tiles;
      step = gridDim.x;
    } else {
      const int64_t per = (tiles + gridDim.x - 1) / gridDim.x;
      t = (int64_t)blockIdx.x * per;
      end = t + per < tiles ? t + per : tiles;
      step = 1;
    }
    const int64_t whole = n / kTile;  // tiles without a ragged end
    const int64_t stop = end < whole ? end : whole;
    if (t < stop) {
      // Pointer-stepped so that the loop keeps few registers beside the U loads.
      const uint4 *p = src + t * kTile + threadIdx.x;
      const uint4 *const p_stop = src + stop * kTile;
      const int64_t p_step = step * kTile;
      do {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = load16<L>(p + u * T);
#pragma unroll
        for (int u = 0; u < U; ++u) acc += sum4(v[u]);
        p += p_step;
      } while (p < p_stop);
      t += (stop - 1 - t) / step * step + step;  // first tile past stop
    }
    if (t < end) {  // this block owns the ragged last tile (t == whole)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = t * kTile + u * T + threadIdx.x;
        if (i < n) acc += sum4(load16<L>(src + i));
      }
    }
  }
  publish<T>(acc, sink);
}

// ---- bulk-copy variants (Hopper): cp.async.bulk global -> shared, mbarrier completion ---------

constexpr int kBulkThreads = 256;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using kvq::bulk_to_shared, kvq::fence_mbarrier_init, kvq::mbar_arrive_expect_tx, kvq::mbar_init,
    kvq::mbar_try_wait, kvq::smem_u32;

// Wait for phase `parity` of `bar`; false after about a second, so that a protocol error shows up
// as a wrong checksum instead of a hung process.
__device__ __forceinline__ bool mbar_wait_or_give_up(uint64_t *bar, uint32_t parity) {
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - t0 > (2ll << 30)) return false;
  return true;
}
#endif

// S stages of B bytes in shared memory. Block b reads pieces b, b + grid, ... of B bytes: thread 0
// keeps S copies queued, each stage has a full barrier, and after all threads have summed a stage
// (the checksum) and passed __syncthreads, thread 0 refills it with the block's piece S ahead.
template <int S, int B>
__global__ void __launch_bounds__(kBulkThreads, 1)
    read_bulk(const uint8_t *__restrict__ src, int64_t bytes, uint32_t *sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t stages[];
  __shared__ uint64_t full[S];
  const int64_t pieces = (bytes + B - 1) / B;
  const int mine =
      blockIdx.x < pieces ? (int)((pieces - 1 - blockIdx.x) / gridDim.x + 1) : 0;
  auto piece_offset = [&](int j) { return ((int64_t)blockIdx.x + (int64_t)j * gridDim.x) * B; };
  auto piece_bytes = [&](int64_t off) {
    return (uint32_t)(bytes - off < B ? bytes - off : B);
  };
  auto issue = [&](int j, int s) {
    const int64_t off = piece_offset(j);
    const uint32_t size = piece_bytes(off);
    mbar_arrive_expect_tx(&full[s], size);
    bulk_to_shared(stages + s * B, src + off, size, &full[s]);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    // Make the initialised barriers visible to the async proxy that completes the copies.
    fence_mbarrier_init();
    for (int j = 0; j < S && j < mine; ++j) issue(j, j);
  }
  __syncthreads();

  uint32_t acc = 0;
  int s = 0;
  uint32_t phase = 0;
  for (int j = 0; j < mine; ++j) {
    const bool arrived = mbar_wait_or_give_up(&full[s], phase);
    const int vecs = (int)(piece_bytes(piece_offset(j)) / 16);
    const uint4 *v = reinterpret_cast<const uint4 *>(stages + s * B);
#pragma unroll 8
    for (int i = threadIdx.x; i < vecs; i += kBulkThreads) acc += sum4(v[i]);
    // Every thread is done with stage s (and agrees whether the copy arrived) before it is reused.
    if (__syncthreads_or(!arrived)) {
      if (threadIdx.x == 0) acc += KVQ_STREAM_FILL_STEP;  // a timeout must fail the checksum
      break;
    }
    if (threadIdx.x == 0 && j + S < mine) {
      // Order this CTA's generic-proxy reads of the stage before the async-proxy overwrite.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(j + S, s);
    }
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  }
  publish<kBulkThreads>(acc, sink);
#endif
}

// ---- fill -------------------------------------------------------------------------------------

// Word i of the buffer = seed + i * KVQ_STREAM_FILL_STEP (mod 2^32): non-zero, varied data with a
// word sum the host computes in closed form.
__global__ void __launch_bounds__(256) stream_fill(uint4 *dst, int64_t n, uint32_t seed) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t w = seed + (uint32_t)(4 * i) * (uint32_t)KVQ_STREAM_FILL_STEP;
    const uint32_t d = (uint32_t)KVQ_STREAM_FILL_STEP;
    dst[i] = make_uint4(w, w + d, w + 2 * d, w + 3 * d);
  }
}

// ---- launchers --------------------------------------------------------------------------------

using Launch = int (*)(const void *src, int64_t bytes, uint32_t *sink, cudaStream_t stream,
                       int sms);

// Blocks of `kernel` (with `smem` dynamic bytes) resident per SM, at most `want`; 0 on error.
template <typename Kernel>
int resident(Kernel kernel, int threads, size_t smem, int want) {
  int fit = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return fit < want ? fit : want;
}

// K > 0: a persistent grid of K blocks per SM (fewer where fewer fit, e.g. 1536-thread SMs, so
// the grid is always one wave). K == 0: one block per tile.
template <Ld L, int T, int U, Walk W, int MinBlocks, int K>
int launch_regs(const void *src, int64_t bytes, uint32_t *sink, cudaStream_t stream, int sms) {
  const auto kernel = read_regs<L, T, U, W, MinBlocks>;
  const int64_t n = bytes / 16;
  const int64_t tiles = (n + (int64_t)T * U - 1) / ((int64_t)T * U);
  int64_t grid = tiles;
  if (K > 0) {
    const int per_sm = resident(kernel, T, 0, K);
    if (per_sm == 0) return KVQ_ERR_UNSUPPORTED;
    grid = (int64_t)sms * per_sm < tiles ? (int64_t)sms * per_sm : tiles;
  }
  if (grid > 0x7fffffff) grid = 0x7fffffff;  // then blocks loop over tiles
  kernel<<<(unsigned)grid, T, 0, stream>>>(static_cast<const uint4 *>(src), n, sink);
  return kvq::launch_status();
}

// K blocks of kBulkThreads per SM, S stages of B bytes each.
template <int S, int B, int K>
int launch_bulk(const void *src, int64_t bytes, uint32_t *sink, cudaStream_t stream, int sms) {
  const auto kernel = read_bulk<S, B>;
  constexpr int kSmem = S * B;
  // The device runs the SASS / PTX of the highest arch it supports; below sm_90 that build has
  // no bulk-copy code.
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return KVQ_ERR_UNSUPPORTED;
  }
  if (attr.binaryVersion < 90) return KVQ_ERR_UNSUPPORTED;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return KVQ_ERR_UNSUPPORTED;
  }
  // All K blocks of an SM must fit at once, or the grid would run in two waves.
  if (resident(kernel, kBulkThreads, kSmem, K) < K) return KVQ_ERR_UNSUPPORTED;
  const int64_t pieces = (bytes + B - 1) / B;
  const int64_t grid = (int64_t)sms * K < pieces ? (int64_t)sms * K : pieces;
  kernel<<<(unsigned)grid, kBulkThreads, kSmem, stream>>>(static_cast<const uint8_t *>(src),
                                                          bytes, sink);
  return kvq::launch_status();
}

struct Variant {
  const char *name;
  Launch launch;
};

// Names: <load>-x<16-byte loads in flight per thread>-t<threads per block>-k<blocks per SM>-<walk>
// ("oneshot": one tile per block, as many blocks as tiles); bulk-<stages>x<stage KiB>-k<blocks>.
// Register budgets (65536 per SM) are chosen so that every load of a batch can be in flight.
constexpr Variant kVariants[] = {
    // The original probe (what the ceiling was before variants), for comparison.
    {"cs-x8-t512-k4-strided", launch_regs<Ld::kCs, 512, 8, Walk::kStrided, 4, 4>},
    // Bytes in flight per SM vs occupancy: 2048, 1280, 768, 256 threads.
    {"nc-x4-t512-k4-tiles", launch_regs<Ld::kNc, 512, 4, Walk::kTiles, 4, 4>},
    {"nc-x8-t256-k5-tiles", launch_regs<Ld::kNc, 256, 8, Walk::kTiles, 5, 5>},
    {"nc-x16-t256-k3-tiles", launch_regs<Ld::kNc, 256, 16, Walk::kTiles, 3, 3>},
    {"nc-x32-t256-k1-tiles", launch_regs<Ld::kNc, 256, 32, Walk::kTiles, 1, 1>},
    // Load flavours at the x16 shape.
    {"cs-x16-t256-k3-tiles", launch_regs<Ld::kCs, 256, 16, Walk::kTiles, 3, 3>},
    {"plain-x16-t256-k3-tiles", launch_regs<Ld::kPlain, 256, 16, Walk::kTiles, 3, 3>},
    {"nc256-x16-t256-k3-tiles", launch_regs<Ld::kNc256, 256, 16, Walk::kTiles, 3, 3>},
    // Other walks at the x16 shape.
    {"nc-x16-t256-k3-chunks", launch_regs<Ld::kNc, 256, 16, Walk::kChunks, 3, 3>},
    {"nc-x16-t256-oneshot", launch_regs<Ld::kNc, 256, 16, Walk::kTiles, 3, 0>},
    // One tile per block at full occupancy (32 registers: ptxas keeps ~5 of the 8 loads in
    // flight), the shape of a tuned Triton streaming read.
    {"nc-x8-t256-oneshot", launch_regs<Ld::kNc, 256, 8, Walk::kTiles, 8, 0>},
    // Hopper bulk copies into shared memory (sm_90+ only).
    {"bulk-4x32k-k1", launch_bulk<4, 32 << 10, 1>},
    {"bulk-6x16k-k2", launch_bulk<6, 16 << 10, 2>},
};
constexpr int kNumVariants = (int)(sizeof(kVariants) / sizeof(kVariants[0]));

// kvq_stream_read's variant: also the L2 flush of the benchmark timer.
constexpr int kDefaultVariant = 3;
static_assert(kDefaultVariant < kNumVariants, "default variant");

int sm_count(int *sms) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return kvq::launch_status();
  return KVQ_OK;
}

}  // namespace

extern "C" int32_t kvq_stream_read_variants(void) { return kNumVariants; }

extern "C" const char *kvq_stream_read_variant_name(int32_t variant) {
  return variant >= 0 && variant < kNumVariants ? kVariants[variant].name : nullptr;
}

extern "C" int kvq_stream_read_variant(int32_t variant, const void *src, int64_t bytes,
                                       uint32_t *sink, void *stream) {
  if (variant < 0 || variant >= kNumVariants || src == nullptr || sink == nullptr ||
      bytes <= 0 || bytes % 16 != 0 || !kvq::aligned16(src))
    return KVQ_ERR_INVALID;
  int sms = 0;
  if (const int st = sm_count(&sms); st != KVQ_OK) return st;
  return kVariants[variant].launch(src, bytes, sink, (cudaStream_t)stream, sms);
}

extern "C" int kvq_stream_read(const void *src, int64_t bytes, float *sink, void *stream) {
  return kvq_stream_read_variant(kDefaultVariant, src, bytes, reinterpret_cast<uint32_t *>(sink),
                                 stream);
}

extern "C" int kvq_stream_fill(void *dst, int64_t bytes, uint32_t seed, void *stream) {
  if (dst == nullptr || bytes <= 0 || bytes % 16 != 0 || !kvq::aligned16(dst))
    return KVQ_ERR_INVALID;
  int sms = 0;
  if (const int st = sm_count(&sms); st != KVQ_OK) return st;
  const int64_t n = bytes / 16;
  int64_t blocks = (n + 255) / 256;
  if (blocks > (int64_t)sms * 8) blocks = (int64_t)sms * 8;
  stream_fill<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(static_cast<uint4 *>(dst), n,
                                                                   seed);
  return kvq::launch_status();
}
