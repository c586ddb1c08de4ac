// decode_frag.cuh: how each cache format turns stored codes into tensor-core fragments for the
// fused decode kernel (decode_kernel.cuh). Nothing here knows about pages or softmax.
//
// The kernel uses mma.sync.m16n8k16 (f32 accumulate) twice per 16-token chunk, transposed so
// that the few query rows of a KV head are the N = 8 side:
//   S^T = K * q^T : M = 16 tokens, N = 8 query rows, K = head_dim.
//   O^T += V^T * P^T : M = 16 head-dim columns per m-tile, N = 8 query rows, K = 16 tokens.
// The builders below describe K and V in terms of the untransposed product, where K^T and V
// are B operands: lane (g = lane / 4, t = lane % 4) holds column n = g and k indices {2t, 2t+1}
// (register b0) and {2t+8, 2t+9} (register b1) of an "n-tile" of 8 columns. Two such n-tiles
// side by side are exactly one A fragment of the transposed product (a0 = b0 of the first,
// a1 = b0 of the second, a2 = b1 of the first, a3 = b1 of the second): for K the two n-tiles
// are tokens g and g + 8 of the chunk, for V the column pairs n-tile 2i / 2i + 1 of m-tile i.
//
// Because Q*K^T sums over head_dim, any permutation of head_dim applied to both Q and K is free.
// We choose it so that lane t's K elements of one token are one contiguous chunk of the row
// (bytes [t*R/4, (t+1)*R/4) of an R-byte row): for INT4 at head_dim 128 that is exactly one
// 32-element group and one scale. The pairing of elements inside a 32-bit fragment register is
// whatever the format's cheapest unpacking produces; `k_pair_elem` says which elements those
// are, and the q fragments are built with the same function.
//
// For V the kernel picks lane g's columns as the contiguous chunk [g*D/8, (g+1)*D/8) of the
// row, n-tile j being column g*D/8 + j; k index (token) kk of the chunk is simply token kk, so
// lane t reads tokens {2t, 2t+1, 2t+8, 2t+9}. A V register pairs two tokens at one column, so
// the unpacking interleaves two rows with byte permutes. INT4 V differs (see v_dim /
// v_codes_i4): n-tile 8G + c is element c of word g of group G, so that each n-tile lies in
// one group; V codes stay raw integers and the group's scale rides on P (P' = P * s per token,
// f16), its zero on a separate accumulator sum_n P_n z_n.
//
// Arithmetic types: K codes of FP8 caches and FP8 V codes become f16 (exact); f16 / bf16 caches
// are used as stored. INT4 codes of either side go in raw (f16 subnormals, exact), their group
// scales applied in f32 to the K MMA's result and on P for V.
// FP8's per-head scale is uniform over a head, so it is applied to S and to O in f32 instead of
// to every element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "prim/bits.cuh"
#include "prim/mma.cuh"

namespace kvq_decode {

using namespace kvq;

/// Cache element formats the decode kernel is instantiated for (K INT4 means groups of 32,
/// symmetric; V INT4 means groups of 64, affine).
enum class Fmt : int { F16, BF16, E4M3, E5M2, I4 };

template <Fmt F>
constexpr int fmt_bits() {
  return (F == Fmt::F16 || F == Fmt::BF16) ? 16 : (F == Fmt::I4 ? 4 : 8);
}

constexpr int cmin(int a, int b) { return a < b ? a : b; }

/// The widest shared-memory load (16, 8, 4 or 2 bytes) that divides a lane's `bytes`: rows of
/// head dims like 80 or 112 split into per-lane chunks that 16-byte loads do not fit.
constexpr int load_width(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}

// FP8 E4M3 unpacking: sm_89+ has a conversion instruction; sm_80 moves the bits into an f16
// whose value is the code's value * 2^-8 (exact, subnormals included), and the 2^8 is folded
// into the per-head scale.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVQ_E4M3_CVT 1
constexpr float kE4m3Unit = 1.0f;
#else
#define KVQ_E4M3_CVT 0
constexpr float kE4m3Unit = 256.0f;
#endif

/// Factor between an unpacked FP8 code and its value (before the per-head scale).
template <Fmt F>
__device__ __forceinline__ float fp8_unit() {
  return F == Fmt::E4M3 ? kE4m3Unit : 1.0f;
}

/// Two E4M3 codes (bytes 0 and 1 of `w`) and (bytes 2 and 3) → two f16x2.
__device__ __forceinline__ void e4m3x4_cvt(uint32_t w, uint32_t &lo, uint32_t &hi) {
#if KVQ_E4M3_CVT
  asm("{ .reg .b16 l, h;\n\t mov.b32 {l, h}, %2;\n\t cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
      " cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  (void)w;
  lo = hi = 0;  // not used on this architecture
#endif
}

/// Bit-move E4M3 → f16 * 2^-8: bytes (0, 2) → `a`, bytes (1, 3) → `b`.
__device__ __forceinline__ void e4m3x4_bits(uint32_t w, uint32_t &a, uint32_t &b) {
  a = ((w << 8) & 0x80008000u) | ((w << 7) & 0x3F803F80u);
  b = (w & 0x80008000u) | ((w >> 1) & 0x3F803F80u);
}

// ---------------------------------------------------------------------------------------------
// Geometry of one format at one head_dim, and the K / V fragment builders.

template <Fmt KF, Fmt VF, int D>
struct Frag {
  static constexpr bool K_BF16 = KF == Fmt::BF16;  // S = Q K^T operand type
  static constexpr bool V_BF16 = VF == Fmt::BF16;  // O = P V operand type

  // ---- K: lane t owns bytes [t*KCH, (t+1)*KCH) of a token's code row.
  static constexpr int KBITS = fmt_bits<KF>();
  static constexpr int KC_ROW = D * KBITS / 8;
  static constexpr int KM_ROW = KF == Fmt::I4 ? D / 32 * 2 : 0;
  static constexpr int KCH = KC_ROW / 4;
  static constexpr int KVEC = load_width(KCH);   // bytes per shared-memory load
  static constexpr int KNV = KCH / KVEC;         // loads per token
  static constexpr int KEV = KVEC * 8 / KBITS;   // elements per load
  static constexpr int KPAIRS = KEV / 2;         // fragment registers per load
  static constexpr int KWORDS = KVEC / 4;

  /// Element (0..KEV) of a load that half `e` of fragment register `p` holds (not INT4).
  static __device__ __forceinline__ int k_pair_elem(int p, int e) {
    if constexpr (KF == Fmt::E4M3 && !KVQ_E4M3_CVT) {
      return 4 * (p / 2) + (p % 2) + 2 * e;
    } else {
      return 2 * p + e;
    }
  }

  // Shared memory holds K code rows at a pitch of KPITCH bytes, padded so that the 8 lanes of a
  // quarter-warp (rows g, g+1; t = 0..3) hit distinct 16-byte bank groups. With 4 or 8 loads
  // per lane, lanes t of one row would still collide: lane t then reads its loads in an order
  // rotated by k_rot(t). Any such order is free, since Q fragments follow the same mapping.
  // INT4 rows are read by ldmatrix (8 rows x 16 bytes per matrix): one 16-byte pad makes the 8
  // rows of a matrix distinct bank groups.
  static constexpr int KPITCH =
      KC_ROW + (KF == Fmt::I4 ? 16 : KNV == 2 ? 16 : KNV == 4 ? 32 : KNV == 8 ? 16 : 0);
  static __host__ __device__ constexpr int k_rot(int t) {
    return KNV == 4 ? (t >> 1) : KNV == 8 ? 2 * t : 0;
  }
  /// Which load of its chunk lane t issues as its v-th.
  static __host__ __device__ constexpr int k_vec(int t, int v) { return (v + k_rot(t)) % KNV; }

  /// Head-dim index of half `e` of lane t's fragment register `p` (0..D/8) of a token:
  /// registers 2j and 2j + 1 are b0 and b1 of k-step j.
  /// INT4 K instead keeps each k-step inside one 32-element group, so that the group's scale
  /// can be applied to the MMA's result: k-steps 2G and 2G + 1 are group G, lane t supplies
  /// word t of the group (elements 8t..8t+7), its even elements in k-step 2G and its odd ones
  /// in k-step 2G + 1 (see k_codes_i4).
  static __device__ __forceinline__ int k_dim(int t, int p, int e) {
    if constexpr (KF == Fmt::I4) {
      const int j = p / 2, odd = j % 2, b1 = p % 2;
      return 32 * (j / 2) + 8 * t + 2 * b1 + odd + 4 * e;
    } else {
      return t * (D / 4) + k_vec(t, p / KPAIRS) * KEV + k_pair_elem(p % KPAIRS, e);
    }
  }


  /// Fragment registers one 32-bit word of K codes unpacks into.
  static constexpr int KPPW = 32 / KBITS / 2;
  /// Words unpacked together: enough for at least one k-step (two registers).
  static constexpr int KWU = KPPW >= 2 ? 1 : 2;

  /// Unpack K code word `w` into KPPW fragment registers (pairs as k_pair_elem says); 16-bit
  /// and FP8 formats (INT4 uses k_codes_i4).
  static __device__ __forceinline__ void k_unpack(uint32_t w, uint32_t (&out)[KPPW]) {
    if constexpr (KF == Fmt::F16 || KF == Fmt::BF16) {
      out[0] = w;
    } else if constexpr (KF == Fmt::E5M2) {
      out[0] = prmt(w, 0u, 0x1404);
      out[1] = prmt(w, 0u, 0x3424);
    } else if constexpr (KF == Fmt::E4M3) {
#if KVQ_E4M3_CVT
      e4m3x4_cvt(w, out[0], out[1]);
#else
      e4m3x4_bits(w, out[0], out[1]);
#endif
    } else {
      static_assert(KF != Fmt::I4, "INT4 K codes go through k_codes_i4");
    }
  }

  /// INT4 K: word `w` of one token's group (8 symmetric codes, element i at bits 4i) as raw
  /// f16 subnormals, one LOP3 each: nibble n ^ 8 = q + 8 (the XOR rides in the LOP3), left in
  /// place. out[0] / out[2] hold elements (0, 4) / (2, 6) worth (q + 8) * 2^-24 (b0 / b1 of
  /// k-step 2G), out[1] / out[3] elements (1, 5) / (3, 7) worth (q + 8) * 2^-20 (k-step 2G + 1).
  static __device__ __forceinline__ void k_codes_i4(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t w8 = w >> 8;
    out[0] = and_xor<0x000F000Fu>(w, 0x00080008u);
    out[1] = and_xor<0x00F000F0u>(w, 0x00800080u);
    out[2] = and_xor<0x000F000Fu>(w8, 0x00080008u);
    out[3] = and_xor<0x00F000F0u>(w8, 0x00800080u);
  }

  // ---- V: lane g owns bytes [g*VCH, (g+1)*VCH) of each of its four tokens' rows.
  static constexpr int VBITS = fmt_bits<VF>();
  static constexpr int VC_ROW = D * VBITS / 8;
  static constexpr int VM_ROW = VF == Fmt::I4 ? D / 64 * 4 : 0;
  static constexpr int VCH = VC_ROW / 8;
  static constexpr int VVEC = VF == Fmt::I4 ? 8 : load_width(VCH);
  static constexpr int VNV = VCH / VVEC;
  static constexpr int VEV = VVEC * 8 / VBITS;   // elements (= n-tiles) per load
  // 32-bit words per load (a 2-byte FP8 load is one word whose upper half is not used).
  static constexpr int VWORDS = VVEC >= 4 ? VVEC / 4 : 1;

  // V code rows at a pitch of VPITCH bytes: one 16-byte pad separates the rows 2t of lanes t;
  // with several 16-byte loads per lane, odd lanes g read theirs in the other order.
  static constexpr int VPITCH = VC_ROW + 16;
  static __host__ __device__ constexpr int v_rot(int g) {
    return (VVEC == 16 && VNV >= 2) ? (g & 1) : 0;
  }
  /// Which load of its chunk lane g issues as its v-th.
  static __host__ __device__ constexpr int v_vec(int g, int v) { return (v + v_rot(g)) % VNV; }
  /// Head-dim index of the column that lane g supplies to n-tile j (= v * VEV + c).
  /// INT4 V instead: n-tile j = 8 * G + c is column c of word g of group G (all 8 columns of
  /// an n-tile in one group, so P can carry that group's scale).
  static __device__ __forceinline__ int v_dim(int g, int j) {
    if constexpr (VF == Fmt::I4) {
      return 64 * (j / 8) + 8 * g + j % 8;
    } else {
      return g * (D / 8) + v_vec(g, j / VEV) * VEV + j % VEV;
    }
  }

  /// INT4 V: groups per row.
  static constexpr int VG = D / 64;
  /// INT4 V: the value that B-fragment column c (0..8) of v_codes_i4 carries per unit of code:
  /// nibbles at bits 0-3 of a half are f16 subnormals n * 2^-24, at bits 4-7 n * 2^-20.
  static __host__ __device__ constexpr float v_col_unit_inv(int c) { return (c & 1) ? 1048576.f : 16777216.f; }

  /// B-fragment registers (columns) one 32-bit word of each of two V rows unpacks into.
  static constexpr int VCPW = 32 / VBITS;
  /// Of those, the ones a load really holds (fewer for a 2-byte load).
  static constexpr int VCOLS = cmin(VCPW, VEV);

  /// INT4 V: interleave word `a` (lower k index) and `b` of two tokens' codes into 8 B-fragment
  /// registers of the raw nibbles as exact f16 subnormals (one LOP3 each, no offset to remove):
  /// register c holds element c of both words, worth n * 2^-24 (c even) or n * 2^-20 (c odd).
  /// The kernel puts scale and zero on the P side (tensor cores take f16 subnormals as is).
  static __device__ __forceinline__ void v_codes_i4(uint32_t a, uint32_t b, uint32_t (&out)[8]) {
    const uint32_t x[2] = {prmt(a, b, 0x5410), prmt(a, b, 0x7632)};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t x8 = x[i] >> 8;
      out[4 * i + 0] = x[i] & 0x000F000Fu;
      out[4 * i + 1] = x[i] & 0x00F000F0u;
      out[4 * i + 2] = x8 & 0x000F000Fu;
      out[4 * i + 3] = x8 & 0x00F000F0u;
    }
  }

  /// Interleave word `a` of one token's codes (the lower k index) and word `b` of the next
  /// token's into VCPW B-fragment registers, register c holding column c of both (16-bit and
  /// FP8 formats; INT4 uses v_codes_i4).
  static __device__ __forceinline__ void v_unpack(uint32_t a, uint32_t b, uint32_t (&out)[VCPW]) {
    if constexpr (VF == Fmt::F16 || VF == Fmt::BF16) {
      out[0] = prmt(a, b, 0x5410);
      out[1] = prmt(a, b, 0x7632);
    } else if constexpr (VF == Fmt::E5M2) {
      const uint32_t lo = prmt(a, b, 0x5140), hi = prmt(a, b, 0x7362);
      out[0] = prmt(lo, 0u, 0x1404);
      out[1] = prmt(lo, 0u, 0x3424);
      out[2] = prmt(hi, 0u, 0x1404);
      out[3] = prmt(hi, 0u, 0x3424);
    } else if constexpr (VF == Fmt::E4M3) {
#if KVQ_E4M3_CVT
      e4m3x4_cvt(prmt(a, b, 0x5140), out[0], out[1]);
      e4m3x4_cvt(prmt(a, b, 0x7362), out[2], out[3]);
#else
      e4m3x4_bits(prmt(a, b, 0x5410), out[0], out[1]);
      e4m3x4_bits(prmt(a, b, 0x7632), out[2], out[3]);
#endif
    } else {
      static_assert(VF != Fmt::I4, "INT4 V codes go through v_codes_i4");
    }
  }
};

}  // namespace kvq_decode
