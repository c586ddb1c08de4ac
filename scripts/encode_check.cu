// encode_check.cu: the int8-pth and fp4-e2m1 row encoders of cuda/codec/ (the very functions
// append and the dense kernels run, compiled for the host through their KVQ_HD helpers) against
// ports of the CPU encoders that define the bytes (src/format/int8.rs, fp4.rs, fp8.rs), on the
// host, no GPU needed:
//
//   source /work/shared/device/cuda-toolkit.sh   # nvcc, for its headers and host compiler
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icuda -L"$CUDA_HOME/lib" \
//        -Xcompiler=-ffp-contract=off,-pthread scripts/encode_check.cu -o /tmp/encode_check
//   /tmp/encode_check [quick]
//
// (-L: the pip wheels' cudart; a full toolkit finds it without. Nothing runs on a GPU.) The full
// run checks about 4.5 billion inputs in 2 minutes on two cores; `quick` 55 million in 2 s.
//
// INT8: int8_scale on every non-negative finite f32; every f16 row amax with every f16 value up
// to it (the code of an f16 input depends on nothing else); random f32 rows and values on and
// next to rounding ties, under reciprocals moved by up to 3 ulps (rcp_approx's device result may
// be any of them). FP4: the block-scale bracket against division for every f16 amax under many
// global scales; for each global scale and each block-scale byte, every f16 value up to the
// largest (and a random) f16 amax that gives that byte, in groups whose amax it is; random f32
// groups with values on and next to the decision boundaries, saturated and subnormal block
// scales, zeros of both signs, under moved reciprocals. Prints the counts; exits 1 on the first
// difference. `quick` runs a sample of each (a few seconds).
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "codec/fp4.cuh"
#include "codec/int8.cuh"

namespace {

using kvq::hd::bits;
using kvq::hd::from_bits;

// ---- ports of the CPU encoders (src/format) ------------------------------------------------

float rne(float y) { return std::nearbyint(y); }  // default rounding mode: ties to even

// int8.rs quantize: clamp(rne(x / s), -127, 127), 0 when s == 0.
uint8_t cpu_int8(float x, float s) {
  if (s == 0.0f) return 0;
  const float q = std::fmin(std::fmax(rne(x / s), -127.0f), 127.0f);
  return (uint8_t)(int8_t)(int)q;
}

// fp8.rs Fp8Kind::E4M3.encode (never NaN here).
uint8_t cpu_e4m3(float y) {
  const uint32_t b = bits(y);
  const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
  const float a = std::fabs(y);
  uint32_t code;
  if (a < from_bits((uint32_t)(-6 + 127) << 23)) {
    const float scaled = a * from_bits((uint32_t)(127 + 9) << 23);
    code = (uint32_t)rne(scaled);
  } else if (a >= 448.0f) {
    code = 0x7E;
  } else {
    const uint32_t ab = bits(a), lsb = (ab >> 20) & 1;
    const uint32_t rounded = (ab + (1u << 19) - 1 + lsb) >> 20;
    code = std::min(rounded - ((127u - 7u) << 3), 0x7Eu);
  }
  return (uint8_t)(sign | code);
}

float cpu_e4m3_value(uint8_t c) {
  const int mag = c & 0x7F, e = mag >> 3, m = mag & 7;
  const float v = e == 0 ? m / 8.0f * std::ldexp(1.0f, -6) : (1 + m / 8.0f) * std::ldexp(1.0f, e - 7);
  return (c & 0x80) ? -v : v;
}

// fp4.rs e2m1.
uint8_t cpu_e2m1(float y) {
  const float a = std::fabs(y);
  const uint8_t m = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
                  : a <= 2.5f  ? 4 : a < 3.5f  ? 5 : a <= 5.0f  ? 6 : 7;
  return (y < 0.0f && m != 0) ? (uint8_t)(m | 8) : m;
}

// fp4.rs block_scale and quantize_group (16 values): codes one per element, returns sb.
uint8_t cpu_fp4_group(const float *x, float g, uint8_t *codes) {
  float amax = 0.0f;
  for (int i = 0; i < 16; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const uint8_t sb = cpu_e4m3(amax / 6.0f / g);
  const float d = cpu_e4m3_value(sb) * g;
  for (int i = 0; i < 16; ++i) codes[i] = d == 0.0f ? 0 : cpu_e2m1(x[i] / d);
  return sb;
}

// ---- the device encoders on the host ---------------------------------------------------------

// Values as the dense kernels give them, and as append's packed path does: the raw f16 pairs
// beside the widened values.
struct Values {
  const float *v;
  __host__ __device__ float operator()(int i) const { return v[i]; }
};
struct PairValues {
  const float *v;
  const uint32_t *w;
  __host__ __device__ float operator()(int i) const { return v[i]; }
  __host__ __device__ uint32_t pair_word(int i) const { return w[i]; }
};


// One INT8 chunk of 16 values under the row amax: codes and the scale the encoder stores.
void dev_int8(const float *v, float amax, uint8_t *codes, float &s) {
  alignas(16) uint8_t out[16];
  alignas(16) float scale = -1.0f;
  kvq::RowRef r = {};
  r.codes = out;
  r.scales = reinterpret_cast<uint16_t *>(&scale);
  kvq::Codec<kvq::kInt8Pth>::encode(Values{v}, kvq::Extremes{0.0f, 0.0f},
                                    kvq::Extremes{0.0f, amax}, 0, r, true);
  std::memcpy(codes, out, 16);
  s = scale;
}

// One FP4 chunk of 32 values (two groups): 16 bytes of codes and the two sb bytes. With
// `pairs` the f16 words of the values (then every value is an f16), through the raw-pairs path.
void dev_fp4(const float *v, const uint32_t *pairs, float g, uint8_t *codes, uint8_t *sb) {
  alignas(16) uint8_t out[16];
  alignas(16) uint8_t meta[2];
  float a[2] = {0.0f, 0.0f};
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < 16; ++i) a[k] = std::fmax(a[k], std::fabs(v[16 * k + i]));
  kvq::RowRef r = {};
  r.codes = out;
  r.scales = reinterpret_cast<uint16_t *>(meta);
  r.head_scale = g;
  const kvq::Extremes own = {-a[0], a[1]};
  if (pairs != nullptr)
    kvq::Codec<kvq::kFp4E2m1>::encode(PairValues{v, pairs}, own, own, 0, r, true);
  else
    kvq::Codec<kvq::kFp4E2m1>::encode(Values{v}, own, own, 0, r, true);
  std::memcpy(codes, out, 16);
  sb[0] = meta[0];
  sb[1] = meta[1];
}

// ---- checking ----------------------------------------------------------------------------

std::atomic<uint64_t> g_checked{0};

[[noreturn]] void fail(const char *what, const float *v, int n, float extra) {
  std::printf("MISMATCH %s (extra %a, rcp_ulps %d):", what, extra, kvq::hd::rcp_ulps);
  for (int i = 0; i < n; ++i) std::printf(" %a", v[i]);
  std::printf("\n");
  std::exit(1);
}

void check_int8(const float *v, float amax) {
  uint8_t codes[16];
  float s;
  dev_int8(v, amax, codes, s);
  const float cs = amax / 127.0f;
  if (bits(s) != bits(cs)) fail("int8 scale", v, 16, amax);
  for (int i = 0; i < 16; ++i)
    if (codes[i] != cpu_int8(v[i], cs)) fail("int8 code", v, 16, amax);
  g_checked += 16;
}

void check_fp4(const float *v, float g, bool f16) {
  uint32_t pairs[16];
  if (f16)
    for (int i = 0; i < 16; ++i)
      pairs[i] = (uint32_t)__half_as_ushort(__float2half_rn(v[2 * i])) |
                 ((uint32_t)__half_as_ushort(__float2half_rn(v[2 * i + 1])) << 16);
  uint8_t codes[16], sb[2], want[32], want_sb[2];
  dev_fp4(v, f16 ? pairs : nullptr, g, codes, sb);
  for (int k = 0; k < 2; ++k) want_sb[k] = cpu_fp4_group(v + 16 * k, g, want + 16 * k);
  if (sb[0] != want_sb[0] || sb[1] != want_sb[1]) fail("fp4 block scale", v, 32, g);
  for (int i = 0; i < 32; ++i)
    if (((codes[i / 2] >> (4 * (i % 2))) & 0xF) != want[i]) fail("fp4 code", v, 32, g);
  g_checked += 32;
}

float f16v(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// Every f16 bit pattern of a finite value with |x| <= a, in order.
std::vector<float> f16_upto(float a) {
  std::vector<float> out;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = f16v((uint16_t)h);
    if (std::isfinite(x) && std::fabs(x) <= a) out.push_back(x);
  }
  return out;
}

// Run fn(i) for i in [0, n) on two threads.
template <typename Fn> void parallel(int64_t n, Fn fn) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next++) < n;) fn(i);
  };
  std::thread t(work);
  work();
  t.join();
}

// ---- INT8 ----------------------------------------------------------------------------------

void int8_scale_all(bool quick) {
  const uint32_t step = quick ? 4099 : 1;
  std::atomic<uint64_t> n{0};
  parallel(256, [&](int64_t part) {
    uint64_t local = 0;
    const uint32_t lo = (uint32_t)(part * 0x7F8000ull / 256 * 256), hi = (uint32_t)((part + 1) * 0x7F8000ull / 256 * 256);
    for (uint32_t u = lo; u < hi; u += step) {
      const float a = from_bits(u);
      if (bits(kvq::int8_scale(a)) != bits(a / 127.0f)) fail("int8_scale", &a, 1, 0.0f);
      ++local;
    }
    n += local;
  });
  std::printf("int8_scale: %llu amax values\n", (unsigned long long)n.load());
}

void int8_f16_exhaustive(bool quick) {
  std::vector<float> all = f16_upto(65504.0f);  // sorted by bit pattern, both signs
  std::vector<float> pos;
  for (float x : all)
    if (x > 0.0f) pos.push_back(x);
  std::sort(pos.begin(), pos.end());
  const uint64_t before = g_checked;
  const int64_t n = (int64_t)pos.size();
  const int stride = quick ? 97 : 1;
  parallel(n / stride, [&](int64_t k) {
    const float amax = pos[k * stride];
    std::vector<float> xs;
    for (float x : all)
      if (std::fabs(x) <= amax) xs.push_back(x);
    while (xs.size() % 16) xs.push_back(amax);
    for (size_t i = 0; i < xs.size(); i += 16) check_int8(&xs[i], amax);
  });
  std::printf("int8 f16: %lld amax values, %llu elements\n", (long long)(n / stride),
              (unsigned long long)(g_checked - before));
}

void int8_random(uint64_t rows, int ulps) {
  kvq::hd::rcp_ulps = ulps;
  const uint64_t before = g_checked;
  parallel(64, [&](int64_t part) {
    std::mt19937_64 rng(1234 + part + 1000 * (ulps + 10));
    std::uniform_real_distribution<float> u01(0.0f, 1.0f);
    for (uint64_t r = 0; r < rows / 64; ++r) {
      // amax over many decades, down to the subnormals.
      const int e = (int)(rng() % 170) - 150;
      float amax = std::ldexp(1.0f + u01(rng), e);
      if (rng() % 8 == 0) amax = from_bits((uint32_t)(rng() % 0x800));  // tiny
      amax = std::fmin(amax, 65504.0f);
      const float s = amax / 127.0f;
      float v[16];
      for (int i = 0; i < 16; ++i) {
        const int kind = (int)(rng() % 6);
        float x;
        if (kind == 0) {
          x = amax * (2 * u01(rng) - 1);
        } else if (kind <= 3) {  // on or next to a tie (k + 1/2) s
          const float k = (float)(int)(rng() % 254) - 127.0f + 0.5f;
          x = k * s;
          for (int m = (int)(rng() % 7) - 3; m != 0; m += m > 0 ? -1 : 1)
            x = std::nextafter(x, m > 0 ? INFINITY : -INFINITY);
        } else if (kind == 4) {
          x = (rng() % 2 ? 1 : -1) * amax;
        } else {
          x = (rng() % 2 ? 0.0f : -0.0f);
        }
        v[i] = std::fmin(std::fmax(x, -amax), amax);
      }
      check_int8(v, amax);
    }
  });
  kvq::hd::rcp_ulps = 0;
  std::printf("int8 random rows, rcp moved %+d ulps: %llu elements\n", ulps,
              (unsigned long long)(g_checked - before));
}

// ---- FP4 -----------------------------------------------------------------------------------

std::vector<float> global_scales(int n, uint64_t seed) {
  std::vector<float> g = {10.0f / 2688.0f, 1.0f, 65504.0f / 2688.0f, 0x1p-24f / 2688.0f,
                          1.0f / 3.0f,     0.1f, 7.0f,  0x1p-100f, 0x1p100f, 0x1.8p-101f,
                          0x1.fffffep99f,  1e-30f, 1e30f, 0x1p-140f};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  while ((int)g.size() < n) {
    // calibrated-looking scales (amax / 2688 for amax over f16's range), and arbitrary ones.
    if (rng() % 2)
      g.push_back(std::ldexp(1.0f + u01(rng), (int)(rng() % 40) - 24) / 2688.0f);
    else
      g.push_back(std::ldexp(1.0f + u01(rng), (int)(rng() % 80) - 40));
  }
  return g;
}

void fp4_scales_all(bool quick) {
  std::vector<float> gs = global_scales(quick ? 16 : 400, 7);
  std::vector<float> amax;
  for (uint32_t h = 0; h < 0x7C00; ++h) amax.push_back(f16v((uint16_t)h));
  std::atomic<uint64_t> n{0};
  parallel((int64_t)gs.size(), [&](int64_t k) {
    const float g = gs[k];
    for (size_t i = 0; i + 1 < amax.size(); i += 1) {
      const float a0 = amax[i], a1 = amax[amax.size() - 1 - i];
      const uint32_t got = kvq::e4m3_scales(a0, a1, g);
      if ((got & 0xFF) != cpu_e4m3(a0 / 6.0f / g) || (got >> 8) != cpu_e4m3(a1 / 6.0f / g))
        fail("e4m3_scales", &a0, 1, g);
    }
    n += amax.size() - 1;
  });
  std::printf("fp4 block scales: %zu global scales x %zu f16 amax pairs (%llu)\n", gs.size(),
              amax.size() - 1, (unsigned long long)n.load());
}

// For each block-scale byte under g: the largest f16 amax that gives it, and a random one.
void fp4_f16_exhaustive(bool quick) {
  std::vector<float> gs = global_scales(quick ? 6 : 120, 11);
  std::vector<float> pos;
  for (uint32_t h = 1; h < 0x7C00; ++h) pos.push_back(f16v((uint16_t)h));
  const uint64_t before = g_checked;
  std::atomic<uint64_t> groups{0};
  parallel((int64_t)gs.size(), [&](int64_t gi) {
    const float g = gs[gi];
    std::mt19937_64 rng(gi);
    // amax values by block-scale byte.
    std::vector<std::vector<float>> by_sb(128);
    for (float a : pos) by_sb[cpu_e4m3(a / 6.0f / g) & 0x7F].push_back(a);
    for (auto &list : by_sb) {
      if (list.empty()) continue;
      float picks[2] = {list.back(), list[rng() % list.size()]};
      for (int p = 0; p < (quick ? 1 : 2); ++p) {
        const float amax = picks[p];
        std::vector<float> xs = f16_upto(amax);
        std::shuffle(xs.begin(), xs.end(), rng);
        // Groups of 16 whose amax is amax: 15 of the values and +-amax at a random place.
        size_t next = 0;
        for (size_t i = 0; i < xs.size(); i += 30) {
          float v[32];
          for (int k = 0; k < 2; ++k) {
            for (int j = 0; j < 15; ++j) v[16 * k + j] = xs[next++ % xs.size()];
            v[16 * k + 15] = rng() % 2 ? amax : -amax;
            std::swap(v[16 * k + 15], v[16 * k + rng() % 16]);
          }
          check_fp4(v, g, true);
          groups += 2;
        }
      }
    }
  });
  std::printf("fp4 f16: %zu global scales, %llu groups, %llu elements\n", gs.size(),
              (unsigned long long)groups.load(), (unsigned long long)(g_checked - before));
}

void fp4_random(uint64_t chunks, int ulps) {
  kvq::hd::rcp_ulps = ulps;
  std::vector<float> gs = global_scales(200, 99 + ulps);
  const float bounds[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 1.5f,
                          2.0f,  3.0f,  4.0f,  6.0f,  7.0f, 0.0f};
  const uint64_t before = g_checked;
  parallel(64, [&](int64_t part) {
    std::mt19937_64 rng(77 + part + 1000 * (ulps + 10));
    std::uniform_real_distribution<float> u01(0.0f, 1.0f);
    for (uint64_t c = 0; c < chunks / 64; ++c) {
      const float g = gs[rng() % gs.size()];
      float v[32];
      for (int k = 0; k < 2; ++k) {
        // A group amax over many decades (relative to g: saturated and subnormal block scales).
        const float amax =
            std::fmin(std::ldexp(1.0f + u01(rng), (int)(rng() % 60) - 30) * g * 2688.0f *
                          (rng() % 4 == 0 ? std::ldexp(1.0f, (int)(rng() % 40) - 20) : 1.0f),
                      65504.0f);
        const uint8_t sb = cpu_e4m3(amax / 6.0f / g);
        const float d = cpu_e4m3_value(sb) * g;
        for (int i = 0; i < 16; ++i) {
          const int kind = (int)(rng() % 6);
          float x;
          if (kind == 0) {
            x = amax * (2 * u01(rng) - 1);
          } else if (kind <= 3) {  // a decision boundary (or grid value) times d, moved
            x = bounds[rng() % 16] * d * (rng() % 2 ? 1.0f : -1.0f);
            for (int m = (int)(rng() % 9) - 4; m != 0; m += m > 0 ? -1 : 1)
              x = std::nextafter(x, m > 0 ? INFINITY : -INFINITY);
          } else if (kind == 4) {
            x = (rng() % 2 ? 1 : -1) * amax;
          } else {
            x = rng() % 2 ? 0.0f : -0.0f;
          }
          v[16 * k + i] = std::fmin(std::fmax(x, -amax), amax);
        }
      }
      check_fp4(v, g, false);
    }
  });
  kvq::hd::rcp_ulps = 0;
  std::printf("fp4 random f32 chunks, rcp moved %+d ulps: %llu elements\n", ulps,
              (unsigned long long)(g_checked - before));
}

}  // namespace

int main(int argc, char **argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  int8_scale_all(quick);
  int8_f16_exhaustive(quick);
  for (int ulps = -3; ulps <= 3; ++ulps) int8_random(quick ? 1 << 16 : 1 << 22, ulps);
  fp4_scales_all(quick);
  for (int ulps = -3; ulps <= 3; ++ulps) fp4_random(quick ? 1 << 15 : 1 << 21, ulps);
  fp4_f16_exhaustive(quick);
  std::printf("all %llu elements match\n", (unsigned long long)g_checked.load());
  return 0;
}
