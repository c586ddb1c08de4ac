// int4_f16_check.cu: the INT4 codecs' decode_f16 (the prefill kernel's operand decode, cuda/codec/
// int4_sym.cuh and int4_affine.cuh) against the values FORMATS.md defines, rounded once to f16 and
// clamped to +-65504, on the GPU:
//
//   source /work/shared/device/cuda-toolkit.sh
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icuda -L"$CUDA_HOME/lib" \
//        scripts/int4_f16_check.cu -o /tmp/int4_f16_check       # then, on the GPU machine:
//   /tmp/int4_f16_check
//
// int4-k32 (code q in -8..7, scale s): every code under every finite f16 scale, against
// f16(q * s) (the f32 product is exact). int4-v64 (code n in 0..15, scale s, zero z): every
// code under every finite f16 scale and, for each, 4,096 zeros (every 16th f16 bit pattern),
// against fma(n, s, z) in f16 (one rounding of the exact n * s + z). Prints the counts and the
// first differences; exits 1 on any.
#include <cuda_fp16.h>

#include <cstdio>

#include "common.cuh"
#include "codec/codec.cuh"

using namespace kvq;

namespace {

__device__ unsigned long long g_checked, g_bad;
__device__ unsigned g_first[8][4];

__device__ bool finite(uint16_t b) { return (b & 0x7C00u) != 0x7C00u; }

__device__ uint16_t clamped(__half v) {
  const float f = __half2float(v);
  if (f > 65504.f) return 0x7BFFu;
  if (f < -65504.f) return 0xFBFFu;
  return __half_as_ushort(v);
}

// Counts a difference; keeps the first 8: format (1 = k32, 2 = v64) | code << 8, the scale's
// bits, the bits decoded, the bits wanted | the zero's << 16.
__device__ void report(int what, uint32_t code, uint32_t scale, uint32_t got, uint32_t want) {
  const unsigned long long k = atomicAdd(&g_bad, 1ull);
  if (k >= 8) return;
  g_first[k][0] = what | (code << 8);
  g_first[k][1] = scale, g_first[k][2] = got, g_first[k][3] = want;
}

// Words holding every nibble 0..15 (element 2i low in byte i).
__device__ uint4 all_nibbles() {
  return make_uint4(0x67452301u, 0xEFCDAB89u, 0x67452301u, 0xEFCDAB89u);
}
__device__ int nibble_of(const uint4 &c, int e) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  return (w[e / 8] >> (4 * (e % 8))) & 0xF;
}

__global__ void check_k() {
  const uint32_t sb = blockIdx.x * blockDim.x + threadIdx.x;
  if (sb > 0xFFFFu || !finite((uint16_t)sb)) return;
  const uint4 codes = all_nibbles();
  uint32_t h[16];
  Codec<kInt4Sym32>::decode_f16({codes, (uint16_t)sb}, h);
  const float s = __half2float(__ushort_as_half((uint16_t)sb));
  for (int e = 0; e < 32; ++e) {
    const int n = nibble_of(codes, e), q = n >= 8 ? n - 16 : n;
    const uint16_t want = clamped(__float2half_rn((float)q * s));
    const uint16_t got = (uint16_t)(h[e / 2] >> (16 * (e % 2)));
    if (got != want) report(1, (uint32_t)q & 0xFF, sb, got, want);
  }
  atomicAdd(&g_checked, 32ull);
}

__global__ void check_v() {
  const uint32_t sb = blockIdx.x, zb = threadIdx.x * 16 + blockIdx.y * blockDim.x * 16;
  if (!finite((uint16_t)sb) || !finite((uint16_t)zb)) return;
  const uint4 codes = all_nibbles();
  uint32_t h[16];
  Codec<kInt4Affine64>::decode_f16({codes, (uint16_t)sb, (uint16_t)zb}, h);
  const __half s = __ushort_as_half((uint16_t)sb), z = __ushort_as_half((uint16_t)zb);
  for (int e = 0; e < 32; ++e) {
    const int n = nibble_of(codes, e);
    const uint16_t want = clamped(__hfma(__int2half_rn(n), s, z));
    const uint16_t got = (uint16_t)(h[e / 2] >> (16 * (e % 2)));
    if (got != want) report(2, (uint32_t)n, sb, got, want | (zb << 16));
  }
  atomicAdd(&g_checked, 32ull);
}

}  // namespace

int main() {
  check_k<<<256, 256>>>();
  check_v<<<dim3(65536, 16), 256>>>();
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  unsigned long long checked = 0, bad = 0;
  unsigned first[8][4];
  cudaMemcpyFromSymbol(&checked, g_checked, sizeof checked);
  cudaMemcpyFromSymbol(&bad, g_bad, sizeof bad);
  cudaMemcpyFromSymbol(first, g_first, sizeof first);
  std::printf("int4 decode_f16: %llu values checked, %llu differ\n", checked, bad);
  for (unsigned long long k = 0; k < bad && k < 8; ++k)
    std::printf("  %s code %d scale 0x%04x: got 0x%04x want 0x%04x (zero 0x%04x)\n",
                (first[k][0] & 0xFF) == 1 ? "k32" : "v64", (int)(signed char)(first[k][0] >> 8),
                first[k][1], first[k][2], first[k][3] & 0xFFFF, first[k][3] >> 16);
  return bad == 0 ? 0 : 1;
}
