// prim/wgmma.cuh: Hopper warpgroup MMA (wgmma.mma_async, sm_90a) with the A operand in
// registers or shared memory and B read from shared memory through matrix descriptors, and the
// 128-byte swizzled tile layout those descriptors describe.
//
// Tile layout (B128): a [rows x cols] tile of 16-bit elements is stored as cols / 64 column
// blocks of rows x 128 bytes; in row r the 16-byte chunk c (elements 8c..8c+7 of the block) sits
// at chunk c ^ (r % 8). Each tile starts on a 1024-byte boundary (the swizzle reads address
// bits). The same bytes serve as a K-major B operand (rows = N, e.g. keys for S = Q K^T) and as
// an N-major one (rows = K, e.g. keys for O = P V, whose N is the head dimension).
//
// Accumulators and register A fragments have, per warp of the warpgroup (rows 16w..16w+15), the
// layouts of mma.sync m16n8k16's C and A fragments (prim/mma.cuh), so the code around the MMAs
// is the same for both.
//
// E4M3 MMAs (k32) take both operands K-major: A in 4 registers (thread t of a warp: row t / 4
// (+ 8 in registers 1 and 3), bytes k = 4 (t % 4) .. + 3, + 16 in registers 2 and 3) and B from
// a B128 tile (rows of 128 codes, as K's) or a B64 tile (rows of 64 codes: 16-byte chunk c of
// row r at chunk c ^ (r / 2 % 4), 512 bytes between 8-row groups).
#pragma once

#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVQ_HAS_WGMMA 1
#else
#define KVQ_HAS_WGMMA 0
#endif

namespace kvq {

/// Byte offset of 16-byte chunk `chunk` of row `row` in a B128 tile of `rows` rows.
template <int kTileRows>
__host__ __device__ constexpr int b128_at(int row, int chunk) {
  return (chunk / 8) * (kTileRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

/// A B128 operand's descriptor is two words: the low one holds the start address (in 16-byte
/// units) and the stride between column blocks, the high one what every B128 tile shares (1024
/// bytes between 8-row groups, the 128-byte swizzle). A loop keeps the low word of a tile and
/// adds each operand's offset to it (b128_desc_at): one add in place of the masks and shifts of
/// b128_desc. The add cannot carry out of the address field, since shared memory ends below
/// 2^18 bytes.
constexpr uint32_t kB128DescHi = (1024 >> 4) | (1u << 30);

/// Low word of the descriptor of a B128 operand at shared address `addr` (1024-aligned tile
/// base plus the operand's offset) whose column blocks are `block_bytes` apart (N-major operands
/// wider than one block).
__host__ __device__ constexpr uint32_t b128_desc_lo(uint32_t addr, uint32_t block_bytes) {
  return ((addr & 0x3FFFF) >> 4) | ((block_bytes >> 4) << 16);
}

/// Descriptor of the operand `bytes` past the one whose low word is `lo`.
__device__ __forceinline__ uint64_t b128_desc_at(uint32_t lo, uint32_t bytes) {
  return ((uint64_t)kB128DescHi << 32) | (lo + (bytes >> 4));
}

/// High word of a B64 operand's descriptor: 512 bytes between 8-row groups, the 64-byte swizzle.
constexpr uint32_t kB64DescHi = (512 >> 4) | (2u << 30);

/// Descriptor of the K-major B64 operand at shared address `addr` (a 512-aligned tile base plus
/// the k-step's byte offset within a row).
__device__ __forceinline__ uint64_t b64_desc(uint32_t addr) {
  return ((uint64_t)kB64DescHi << 32) | ((addr & 0x3FFFF) >> 4) | (1u << 16);
}

/// Descriptor of a B128 operand at shared address `addr` (b128_desc_lo).
__device__ __forceinline__ uint64_t b128_desc(uint32_t addr, uint32_t block_bytes) {
  return b128_desc_at(b128_desc_lo(addr, block_bytes), 0);
}

#if KVQ_HAS_WGMMA

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Orders this thread's earlier generic-proxy shared-memory writes (st.shared, cp.async) before
/// later async-proxy reads (wgmma operands); a barrier then extends it to the block.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/// Keeps the compiler from moving reads or writes of a wgmma operand register across the
/// fence or wait beside it (the asm statements of those name no registers).
__device__ __forceinline__ void fence_operand(float &x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t &x) {
  asm volatile("" : "+r"(x)::"memory");
}

#define KVQ_WG_ACC8(i)                                                                     \
  "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3]), "+f"(d[i + 1][0]),           \
      "+f"(d[i + 1][1]), "+f"(d[i + 1][2]), "+f"(d[i + 1][3])

// One wgmma with 64 x N f32 accumulators (N / 2 registers from %0), A in 4 registers, the B
// descriptor, scale-d from `acc` (0: D = A B) and B's major-ness as an immediate.
#define KVQ_WG_M64N64(T)                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " "                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "    \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, " \
               "%31}, {%32, %33, %34, %35}, %37, p, 1, 1, %38;\n}\n"                          \
               : KVQ_WG_ACC8(0), KVQ_WG_ACC8(2), KVQ_WG_ACC8(4), KVQ_WG_ACC8(6)             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(acc), "l"(desc),           \
                 "n"(kTransB))
#define KVQ_WG_M64N128(T)                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " "                   \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "    \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, " \
               "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
               "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, " \
               "%61, %62, %63}, {%64, %65, %66, %67}, %69, p, 1, 1, %70;\n}\n"                \
               : KVQ_WG_ACC8(0), KVQ_WG_ACC8(2), KVQ_WG_ACC8(4), KVQ_WG_ACC8(6),            \
                 KVQ_WG_ACC8(8), KVQ_WG_ACC8(10), KVQ_WG_ACC8(12), KVQ_WG_ACC8(14)          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(acc), "l"(desc),           \
                 "n"(kTransB))

#define KVQ_WG_M64N64_SS(T)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " "                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "    \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, " \
               "%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                          \
               : KVQ_WG_ACC8(0), KVQ_WG_ACC8(2), KVQ_WG_ACC8(4), KVQ_WG_ACC8(6)             \
               : "l"(a_desc), "l"(b_desc), "r"(acc))

/// d[8][4] (+)= A (64 x 16, registers) * B (16 x 64, descriptor); `acc` 0 overwrites d.
template <bool BF16, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4],
                                                uint64_t desc, int acc) {
  if constexpr (BF16) KVQ_WG_M64N64("bf16");
  else KVQ_WG_M64N64("f16");
}

/// d[8][4] (+)= A (64 x 16, K-major descriptor) * B (16 x 64, K-major descriptor); `acc` 0
/// overwrites d.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a_desc,
                                                   uint64_t b_desc, int acc) {
  if constexpr (BF16) KVQ_WG_M64N64_SS("bf16");
  else KVQ_WG_M64N64_SS("f16");
}

/// d[16][4] (+)= A (64 x 16, registers) * B (16 x 128, descriptor); `acc` 0 overwrites d.
template <bool BF16, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], const uint32_t (&a)[4],
                                                 uint64_t desc, int acc) {
  if constexpr (BF16) KVQ_WG_M64N128("bf16");
  else KVQ_WG_M64N128("f16");
}

/// d[8][4] (+)= A (64 x 32 E4M3, registers) * B (32 x 64 E4M3, K-major descriptor); `acc` 0
/// overwrites d.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[8][4], const uint32_t (&a)[4],
                                                     uint64_t desc, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
               "%31}, {%32, %33, %34, %35}, %37, p, 1, 1;\n}\n"
               : KVQ_WG_ACC8(0), KVQ_WG_ACC8(2), KVQ_WG_ACC8(4), KVQ_WG_ACC8(6)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(acc), "l"(desc));
}

/// d[16][4] (+)= A (64 x 32 E4M3, registers) * B (32 x 128 E4M3, K-major descriptor); `acc` 0
/// overwrites d.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[16][4], const uint32_t (&a)[4],
                                                      uint64_t desc, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
               "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
               "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, "
               "%61, %62, %63}, {%64, %65, %66, %67}, %69, p, 1, 1;\n}\n"
               : KVQ_WG_ACC8(0), KVQ_WG_ACC8(2), KVQ_WG_ACC8(4), KVQ_WG_ACC8(6),
                 KVQ_WG_ACC8(8), KVQ_WG_ACC8(10), KVQ_WG_ACC8(12), KVQ_WG_ACC8(14)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(acc), "l"(desc));
}

#undef KVQ_WG_M64N64
#undef KVQ_WG_M64N128
#undef KVQ_WG_M64N64_SS
#undef KVQ_WG_ACC8

#endif  // KVQ_HAS_WGMMA

}  // namespace kvq
