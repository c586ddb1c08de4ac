// decode/frag.cuh: the fragment geometry of the fused decode kernel (decode/kernel.cuh): which
// head-dim elements each lane's tensor-core fragments hold, the shared-memory row pitches, and
// which codec (codec/) unpacks the K and V codes into them. Nothing here knows about pages or
// softmax.
//
// The kernel uses mma.sync.m16n8k16 (f32 accumulate) twice per 16-token chunk, transposed so
// that the few query rows of a KV head are the N = 8 side:
//   S^T = K * q^T : M = 16 tokens, N = 8 query rows, K = head_dim.
//   O^T += V^T * P^T : M = 16 head-dim columns per m-tile, N = 8 query rows, K = 16 tokens.
// The geometry below describes K and V in terms of the untransposed product, where K^T and V
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
// whatever the format's cheapest unpacking produces; the codec's `k_pair_elem` says which
// elements those are, and the q fragments are built with the same function.
//
// For V the kernel picks lane g's columns as the contiguous chunk [g*D/8, (g+1)*D/8) of the
// row, n-tile j being column g*D/8 + j; k index (token) kk of the chunk is simply token kk, so
// lane t reads tokens {2t, 2t+1, 2t+8, 2t+9}. A V register pairs two tokens at one column, so
// the unpacking interleaves two rows with byte permutes. INT4 V differs (see the codec's
// v_dim / v_codes): n-tile 8G + c is element c of word g of group G, so that each n-tile lies in
// one group; V codes stay raw integers and the group's scale rides on P (P' = P * s per token,
// f16), its zero on a separate accumulator sum_n P_n z_n.
//
// Arithmetic types: K codes of FP8 caches and FP8 V codes become f16 (exact); f16 / bf16 caches
// are used as stored. INT4 codes of either side go in raw (f16 subnormals, exact), their group
// scales applied in f32 to the K MMA's result and on P for V.
// FP8's per-head scale is uniform over a head, so it is applied to S and to O in f32 instead of
// to every element. INT8 codes become f16 subnormals, code + 128 (exact, no arithmetic); the
// 128 comes off the scores and O as one more MMA against the same operands (kCodeBias); each
// token's f32 row scale (kRowScale) multiplies its scores (K) or its P (V, relative to the
// largest scale the warp has seen, so that P * s stays inside f16's range whatever the scales
// are).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "codec/codec.cuh"
#include "prim/bits.cuh"
#include "prim/mma.cuh"

namespace kvq_decode {

using namespace kvq;

/// Whether codec F is taken in the V (values) or K role (its kDecodeV / kDecodeK), unless the
/// decode kernel has no fragment kind for it (kFusedDecode false, which no codec sets today;
/// prefill still takes such a codec).
template <int F, bool V>
constexpr bool has_role() {
  if constexpr (FusedDecodeOf<Codec<F>>::value) return V ? Codec<F>::kDecodeV : Codec<F>::kDecodeK;
  else return false;
}

/// Whether codec F stands for kernel format M in the K (V = false) or V role.
template <int F, bool V>
constexpr bool decodes_as(Fmt M) {
  if constexpr (has_role<F, V>()) return Codec<F>::kDecodeFmt == M;
  else return false;
}

/// The stored format (codec) of kernel format M in the K (V = false) or V role: the one of the
/// list that names M in that role, -1 if none does.
template <Fmt M, bool V, int... F>
constexpr int format_in(FormatList<F...>) {
  int out = -1;
  (void)((decodes_as<F, V>(M) && (out = F, true)) || ...);
  return out;
}
template <Fmt M, bool V>
constexpr int format_of() {
  return format_in<M, V>(AttentionFormats{});
}

/// Codecs of the list that stand for kernel format M in the K (V = false) or V role.
template <bool V, int... F>
constexpr int codecs_of(Fmt M, FormatList<F...>) {
  return (0 + ... + int(decodes_as<F, V>(M)));
}

/// Whether codec F is the only one of its kernel format in each of its roles: the dispatch
/// (decode.cu) sends a stored format to its kernel format's instance, whose codec is format_of's.
template <int F>
constexpr bool role_alone() {
  if constexpr (has_role<F, false>() || has_role<F, true>()) {
    constexpr Fmt M = Codec<F>::kDecodeFmt;
    return (!has_role<F, false>() || codecs_of<false>(M, AttentionFormats{}) == 1) &&
           (!has_role<F, true>() || codecs_of<true>(M, AttentionFormats{}) == 1);
  } else {
    return true;
  }
}
template <int... F>
constexpr bool roles_alone(FormatList<F...>) {
  return (role_alone<F>() && ...);
}
static_assert(roles_alone(AttentionFormats{}), "two codecs name one kernel format in one role");

constexpr int cmin(int a, int b) { return a < b ? a : b; }

/// The widest shared-memory load (16, 8, 4 or 2 bytes) that divides a lane's `bytes`: rows of
/// head dims like 80 or 112 split into per-lane chunks that 16-byte loads do not fit.
constexpr int load_width(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}

/// Metadata bytes of one row of `d` elements.
template <class C>
constexpr int meta_row(int d) {
  return (C::kGroup != 0 ? d / C::kGroup * C::kGroupMeta : 0) + RowMetaOf<C>::value;
}

// ---------------------------------------------------------------------------------------------
// Geometry of one format pair at one head_dim, and the K / V fragment builders (the codecs'
// fragment roles: k_unpack / k_codes, v_unpack / v_codes).

template <Fmt KF, Fmt VF, int D>
struct Frag {
  static_assert(format_of<KF, false>() >= 0 && format_of<VF, true>() >= 0,
                "no codec has this kernel format in this role");
  using KC = Codec<format_of<KF, false>()>;
  using VC = Codec<format_of<VF, true>()>;
  static constexpr bool K_BF16 = KC::kBf16Operands;  // S = Q K^T operand type
  static constexpr bool V_BF16 = VC::kBf16Operands;  // O = P V operand type

  // ---- K: lane t owns bytes [t*KCH, (t+1)*KCH) of a token's code row.
  static constexpr int KBITS = KC::kBits;
  static constexpr int KC_ROW = D * KBITS / 8;
  static constexpr int KM_ROW = meta_row<KC>(D);
  /// int4-kc (BlockChannelsOf): bytes of a sealed block's s[D] and z[D] (f16), copied once per
  /// block a step touches; 0 otherwise.
  static constexpr bool KBLK = BlockChannelsOf<KC>::value;
  static constexpr int KBM = KBLK ? 4 * D : 0;
  static constexpr int KCH = KC_ROW / 4;
  static constexpr int KVEC = load_width(KCH);   // bytes per shared-memory load
  static constexpr int KNV = KCH / KVEC;         // loads per token
  static constexpr int KEV = KVEC * 8 / KBITS;   // elements per load
  static constexpr int KPAIRS = KEV / 2;         // fragment registers per load
  static constexpr int KWORDS = KVEC / 4;

  // Shared memory holds K code rows at a pitch of KPITCH bytes. A copy moves whole 32-byte
  // sectors only when every row starts on a 32-byte boundary, so rows are never padded by 16
  // where avoidable: the 8 lanes of a quarter-warp (rows g, g + 1; t = 0..3) reach distinct
  // 16-byte bank groups through the rotated order k_rot(t) in which lane t issues its loads
  // together with a 32-byte pad (4 loads a lane) or an XOR of the row's 32- or 64-byte units by
  // its parity (KSWZ: 2 or 8 loads a lane, rows of whole 128-byte lines; k_swz). Any load order
  // is free, since Q fragments follow the same mapping. INT4 rows (32 to 128 bytes) are read
  // by ldmatrix, 8 rows x one 16-byte group per matrix: their 16-byte units are XORed by row so
  // that the 8 rows of a matrix hit distinct bank groups (this swaps the halves of some 32-byte
  // sectors, which costs the copies nothing: measured).
  static constexpr bool KSWZ = KC::kGroupFrags
                                   ? (KC_ROW == 32 || KC_ROW == 64 || KC_ROW == 128)
                                   : KVEC == 16 && KC_ROW % 128 == 0 && (KNV == 2 || KNV == 8);
  static constexpr int KPITCH =
      KC_ROW +
      (KSWZ ? 0 : KC::kGroupFrags ? 16 : KNV == 2 ? 16 : KNV == 4 ? 32 : KNV == 8 ? 16 : 0);
  static __host__ __device__ constexpr int k_rot(int t) {
    if (KC::kGroupFrags) return 0;  // unused: the codec places grouped K (k_dim)
    return KSWZ ? (KNV == 2 ? (t & 1) : t) : KNV == 4 ? (t >> 1) : KNV == 8 ? 2 * t : 0;
  }
  /// Which load of its chunk lane t issues as its v-th.
  static __host__ __device__ constexpr int k_vec(int t, int v) { return (v + k_rot(t)) % KNV; }
  /// The XOR on byte offsets of K row r as stored: the row's parity flips one 32-byte (KNV 2)
  /// or 64-byte (KNV 8) unit bit; INT4 rows XOR their 16-byte units by (r / 4) % 2 (32-byte
  /// rows), (r / 2) % 4 (64-byte rows, which exchange units with the other row of their
  /// 128-byte line) or r % 8.
  static __host__ __device__ constexpr int k_swz(int r) {
    if constexpr (!KSWZ) return 0;
    else if constexpr (KC::kGroupFrags)
      return (KC_ROW == 32 ? (r >> 2) & 1 : KC_ROW == 64 ? (r >> 1) & 3 : r & 7) << 4;
    else return (r & 1) << (KNV == 2 ? 5 : 6);
  }
  /// Grouped K (ldmatrix x4): offset in the chunk of the row lane supplies for groups 2 G2 and
  /// 2 G2 + 1: rows 0-7 (lanes 8m.., m even) or 8-15, first (m < 2) or second 16-byte group.
  static __host__ __device__ constexpr int k_ldsm(int lane, int G2) {
    const int r = ((lane >> 3) & 1) * 8 + (lane & 7), c = (lane >> 4) + 2 * G2;
    return (r * KPITCH + 16 * c) ^ k_swz(r);
  }
  /// Offset in its row of lane (g, t)'s v-th load: lane g reads rows of g's parity only.
  static __host__ __device__ constexpr int k_col(int g, int t, int v) {
    return (t * KCH + k_vec(t, v) * KVEC) ^ k_swz(g);
  }

  /// Head-dim index of half `e` of lane t's fragment register `p` (0..D/8) of a token:
  /// registers 2j and 2j + 1 are b0 and b1 of k-step j. Grouped K codecs (INT4) place each
  /// k-step inside one group instead (their k_dim).
  static __device__ __forceinline__ int k_dim(int t, int p, int e) {
    if constexpr (KC::kGroupFrags) {
      return KC::k_dim(t, p, e);
    } else {
      return t * (D / 4) + k_vec(t, p / KPAIRS) * KEV + KC::k_pair_elem(p % KPAIRS, e);
    }
  }

  /// k-steps of q^T fragments a lane keeps in registers: all, except with grouped K codes,
  /// whose loop needs the registers more (it reads them from shared memory, group by group).
  static constexpr int QREGS = KC::kGroupFrags ? 1 : D / 16;

  /// Fragment registers one 32-bit word of K codes unpacks into.
  static constexpr int KPPW = 32 / KBITS / 2;
  /// Words unpacked together: enough for at least one k-step (two registers).
  static constexpr int KWU = KPPW >= 2 ? 1 : 2;

  // ---- V: lane g owns bytes [g*VCH, (g+1)*VCH) of each of its four tokens' rows.
  static constexpr int VBITS = VC::kBits;
  static constexpr int VC_ROW = D * VBITS / 8;
  static constexpr int VM_ROW = meta_row<VC>(D);
  static constexpr int VCH = VC_ROW / 8;
  static constexpr int VVEC = VC::kGroupFrags ? 8 : load_width(VCH);
  static constexpr int VNV = VCH / VVEC;
  static constexpr int VEV = VVEC * 8 / VBITS;   // elements (= n-tiles) per load
  // 32-bit words per load (a 2-byte FP8 load is one word whose upper half is not used).
  static constexpr int VWORDS = VVEC >= 4 ? VVEC / 4 : 1;

  // V code rows: lane t reads rows 2t, 2t + 1, 2t + 8, 2t + 9 (+ 16 per chunk), lanes g of a
  // quarter-warp the same 16-byte columns of them (INT4: lanes g words g of a group, 4-byte
  // loads). Rows of whole 128-byte lines, and rows of 64 or 32 bytes (INT4 at head_dim 128 /
  // 64, FP8 at 64: the rows of a line exchange units within it), are stored unpadded with their
  // 32-byte units XORed by (row / 2) % 4 (VSWZ; v_swz), which puts rows 2t of lanes t on
  // distinct bank groups while every copied sector lands whole; other rows are padded by 16
  // bytes. With several 16-byte loads per lane, odd lanes g read theirs in the other order.
  static constexpr bool VSWZ = VC_ROW % 128 == 0 || VC_ROW == 64 || VC_ROW == 32;
  static constexpr int VPITCH = VSWZ ? VC_ROW : VC_ROW + 16;
  static __host__ __device__ constexpr int v_rot(int g) {
    return (VVEC == 16 && VNV >= 2) ? (g & 1) : 0;
  }
  /// Which load of its chunk lane g issues as its v-th.
  static __host__ __device__ constexpr int v_vec(int g, int v) { return (v + v_rot(g)) % VNV; }
  /// The XOR on byte offsets of V row r as stored (32-byte units only; rows of 64 bytes
  /// exchange units with the other row of their 128-byte line).
  static __host__ __device__ constexpr int v_swz(int r) { return VSWZ ? ((r >> 1) & 3) << 5 : 0; }

  /// Head-dim index of the column that lane g supplies to n-tile j (= v * VEV + c); grouped V
  /// codecs (INT4) keep each n-tile inside one group instead (their v_dim).
  static __device__ __forceinline__ int v_dim(int g, int j) {
    if constexpr (VC::kGroupFrags) {
      return VC::v_dim(g, j);
    } else {
      return g * (D / 8) + v_vec(g, j / VEV) * VEV + j % VEV;
    }
  }

  /// Bytes between the row chunks of lanes g and g + 1: VCH, or one word of each group for
  /// grouped V codes (lane g reads word g of every group).
  static constexpr int V_LANE = VC::kGroupFrags ? 4 : VCH;
  /// Byte of lane g's v-th load in a V row (ungrouped V; grouped V reads word g of each group).
  static __host__ __device__ constexpr int v_col(int g, int v) {
    return g * V_LANE + v_vec(g, v) * VVEC;
  }
  /// Offset in the chunk of byte `col` of V row 2t + p as stored. Rows 8 and 16 on are VPITCH
  /// * 8 and * 16 further (they share the XOR of rows 2t); unless rows are shorter than 128
  /// bytes, row 2t + 1's offset is VPITCH after row 2t's.
  static __host__ __device__ constexpr int v_at(int t, int p, int col) {
    return ((2 * t + p) * VPITCH + col) ^ v_swz(2 * t);
  }

  /// Grouped V: groups per row.
  static constexpr int VG = VC::kGroupFrags ? D / VC::kGroup : 0;

  /// B-fragment registers (columns) one 32-bit word of each of two V rows unpacks into.
  static constexpr int VCPW = 32 / VBITS;
  /// Of those, the ones a load really holds (fewer for a 2-byte load).
  static constexpr int VCOLS = cmin(VCPW, VEV);
};

}  // namespace kvq_decode
