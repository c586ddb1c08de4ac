// append_sweep.cu: times kvq_append for one AppendTuning (cuda/append.cu) without cargo, so a
// sweep of tunings (or of whole append.cu versions, with -I) builds on the GPU machine itself
// (it has nvcc), several at once:
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false -Icuda -DKVQ_APPEND_ROWS=1 \
//        -DKVQ_APPEND_MIN_BLOCKS=4 scripts/append_sweep.cu -o /tmp/sweep && /tmp/sweep
//
// (-fmad=false as build.rs compiles append.cu; without the two -D, append.cu's own tuning.) The
// workload is benches/gpu_append.rs's: f16 K and V [262,144 tokens, 8 heads, 128] (1 GiB
// together) of its grid values and of its random ones, pages of 16 in a scrambled order, int64
// slots; bytes = inputs + slots read, codes and metadata written; a 2 GiB device copy (read +
// write) timed in the same process. Each pair prints its median GB/s, % of the copy, and a 64-bit
// checksum of the whole pool, which must be the same for every tuning and every version of
// append.cu (the quantized bytes do not depend on how rows are walked or coded).
//
//   /tmp/sweep [grid|random|both] [PAIR...]
//
// runs one kind of values or both (the default), and only the pairs named (int4-k32/int4-v64,
// fp8-e4m3, fp8-e5m2, int8-pth, fp4-e2m1, f16; default all). -DKVQ_SWEEP_LABEL=\"name\" tags the
// output lines, for A/B runs of two builds: e.g. the append.cu of an older commit, unpacked under
// old/ (git archive COMMIT cuda | tar -x -C old), built with -Iold/cuda before -Icuda, so that
// its append.cu and codecs are the ones included.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "append.cu"

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));            \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

namespace {
constexpr int kHeads = 8, kDim = 128, kBlockSize = 16;
constexpr int64_t kTokens = (1ll << 30) / (2 * kHeads * kDim * 2);

int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

// Row bytes of codes and metadata of `f`, from the codec's constants.
void rows_of(int f, int &codes, int &meta) {
  kvq::FormatInfo info = {};
  if (!kvq::format_info(f, info)) exit(1);
  codes = info.code_bytes(kDim);
  kvq::with_format<false>(f, [&](auto t) {
    using C = kvq::Codec<decltype(t)::value>;
    meta = (C::kGroup != 0 ? kDim / C::kGroup * C::kGroupMeta : 0) + kvq::RowMetaOf<C>::value;
    return 0;
  });
}

kvq_layout layout_of(int kf, int vf) {
  kvq_layout l = {};
  l.num_kv_heads = kHeads;
  l.head_dim = kDim;
  l.block_size = kBlockSize;
  l.k_format = kf;
  l.v_format = vf;
  int rows[4];
  rows_of(kf, rows[0], rows[1]);
  rows_of(vf, rows[2], rows[3]);
  int32_t *off[4] = {&l.k_codes_offset, &l.k_meta_offset, &l.v_codes_offset, &l.v_meta_offset};
  int32_t *row[4] = {&l.k_codes_row, &l.k_meta_row, &l.v_codes_row, &l.v_meta_row};
  int64_t at = 0;
  for (int i = 0; i < 4; ++i) {
    *off[i] = (int32_t)at;
    *row[i] = rows[i];
    at += align16((int64_t)rows[i] * kBlockSize);
  }
  l.head_stride = at;
  l.block_stride = at * kHeads;
  return l;
}

template <typename Fn> float median_ms(int reps, Fn &&fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  fn();  // untimed first
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
}  // namespace

// The bench's random values: kvq::synth::Synth::new(1).uniform(n, -10, 10) (SplitMix64, the top
// 24 bits of each draw, a value that rounds up to 10 drawn again).
struct Synth {
  uint64_t state = 1;
  float unit() {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
  }
  float uniform(float lo, float hi) {
    for (;;) {
      const float x = lo + (hi - lo) * unit();
      if (x < hi) return x;
    }
  }
};

#ifndef KVQ_SWEEP_LABEL
#define KVQ_SWEEP_LABEL ""
#endif

int main(int argc, char **argv) {
  int kinds = 3;  // bit 0: grid values, bit 1: random ones
  std::vector<std::string> only;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "grid") kinds = 1;
    else if (arg == "random") kinds = 2;
    else if (arg == "both") kinds = 3;
    else only.push_back(arg);
  }
  const int64_t n = kTokens * kHeads * kDim;
  const int64_t pages = kTokens / kBlockSize;
  std::vector<int64_t> slots(kTokens);
  for (int64_t t = 0; t < kTokens; ++t)
    slots[t] = (t / kBlockSize * 7919) % pages * kBlockSize + t % kBlockSize;
  __half *k, *v;
  int64_t *dslots;
  CHECK(cudaMalloc(&k, n * 2));
  CHECK(cudaMalloc(&v, n * 2));
  CHECK(cudaMalloc(&dslots, kTokens * 8));
  CHECK(cudaMemcpy(dslots, slots.data(), kTokens * 8, cudaMemcpyHostToDevice));

  const size_t copy_bytes = 2ull << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  CHECK(cudaMemset(src, 0, copy_bytes));
  const float copy_ms =
      median_ms(9, [&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = 2.0 * copy_bytes / copy_ms / 1e6;
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
#ifdef KVQ_APPEND_ROWS
  printf("%s rows %d min_blocks %d: ", KVQ_SWEEP_LABEL, KVQ_APPEND_ROWS, KVQ_APPEND_MIN_BLOCKS);
#else
  printf("%s default tuning: ", KVQ_SWEEP_LABEL);
#endif
  printf("dtod copy %.0f GB/s\n", copy_gbps);

  constexpr int kPairs = 6;
  const int pairs[kPairs][2] = {{KVQ_INT4_SYM32, KVQ_INT4_AFFINE64}, {KVQ_FP8_E4M3, KVQ_FP8_E4M3},
                                {KVQ_FP8_E5M2, KVQ_FP8_E5M2},         {KVQ_INT8_PTH, KVQ_INT8_PTH},
                                {KVQ_FP4_E2M1, KVQ_FP4_E2M1},         {KVQ_F16, KVQ_F16}};
  const char *names[kPairs] = {"int4-k32/int4-v64", "fp8-e4m3", "fp8-e5m2",
                               "int8-pth",          "fp4-e2m1", "f16"};
  // Head scales that let the data use the range: FP8's s, FP4's g.
  float *scales, *fp4_scales;
  CHECK(cudaMalloc(&scales, kHeads * 4));
  CHECK(cudaMalloc(&fp4_scales, kHeads * 4));
  std::vector<float> hs(kHeads, 10.0f / 448.0f), gs(kHeads, 10.0f / 2688.0f);
  CHECK(cudaMemcpy(scales, hs.data(), kHeads * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(fp4_scales, gs.data(), kHeads * 4, cudaMemcpyHostToDevice));
  std::vector<__half> host(n);
  for (int kind = 0; kind < 2; ++kind) {
    if (!(kinds & (1 << kind))) continue;
    const bool random = kind == 1;
    Synth synth;
    for (int64_t i = 0; i < n; ++i)
      host[i] = __float2half(random ? synth.uniform(-10.0f, 10.0f)
                                    : (float)((uint64_t)i * 2654435761ull % 2001) / 100.0f - 10.0f);
    CHECK(cudaMemcpy(k, host.data(), n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(v, host.data(), n * 2, cudaMemcpyHostToDevice));
    for (int p = 0; p < kPairs; ++p) {
      if (!only.empty() && std::find(only.begin(), only.end(), names[p]) == only.end()) continue;
      kvq_cache c = {};
      c.layout = layout_of(pairs[p][0], pairs[p][1]);
      const size_t pool_bytes = (size_t)c.layout.block_stride * pages;
      CHECK(cudaMalloc(&c.pool, pool_bytes));
      CHECK(cudaMemset(c.pool, 0, pool_bytes));
      c.k_scales = c.v_scales = pairs[p][0] == KVQ_FP4_E2M1 ? fp4_scales : scales;
      auto run = [&] {
        const int r = kvq_append(&c, pages, dslots, 1, kTokens, k, v, KVQ_DTYPE_F16,
                                 kHeads * kDim, kHeads * kDim, nullptr, nullptr);
        if (r != KVQ_OK) {
          fprintf(stderr, "kvq_append: %d %s\n", r, kvq_last_error());
          exit(1);
        }
      };
      const float ms = median_ms(9, run);
      cudaFuncAttributes ka = {}, va = {};
      with_format<false>(pairs[p][0], [&](auto f) {
        return (int)cudaFuncGetAttributes(&ka, append_kernel<__half, decltype(f)::value>);
      });
      with_format<false>(pairs[p][1], [&](auto f) {
        return (int)cudaFuncGetAttributes(&va, append_kernel<__half, decltype(f)::value>);
      });
      const int64_t written = kTokens * kHeads *
                              (int64_t)(c.layout.k_codes_row + c.layout.k_meta_row +
                                        c.layout.v_codes_row + c.layout.v_meta_row);
      const int64_t bytes = 2 * n * 2 + kTokens * 8 + written;
      const double gbps = bytes / ms / 1e6;
      std::vector<uint64_t> pool(pool_bytes / 8);
      CHECK(cudaMemcpy(pool.data(), c.pool, pool_bytes, cudaMemcpyDeviceToHost));
      uint64_t h = 1469598103934665603ull;
      for (uint64_t w : pool) h = (h ^ w) * 1099511628211ull;
      printf("%s %-6s %-18s %8.1f us %6.0f GB/s %5.1f %% of copy  regs K %d V %d  pool %016llx\n",
             KVQ_SWEEP_LABEL, random ? "random" : "grid", names[p], ms * 1e3, gbps,
             100.0 * gbps / copy_gbps, ka.numRegs, va.numRegs, (unsigned long long)h);
      CHECK(cudaFree(c.pool));
    }
  }
  return 0;
}
