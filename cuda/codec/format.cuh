// codec/format.cuh: the stored formats' ids and the codec template each one specialises
// (codec/<family>.cuh), plus the types a codec's row interface speaks: where a row's codes and
// metadata live, a thread's input chunk, and the extremes a quantizer needs; and the decode
// kernel's formats, which the codecs name.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "kvq.h"

namespace kvq {

// kvq_format's ids (cuda/kvq.h; Rust's side: src/format/spec.rs checks its table against kvq.h)
// under short names, usable as template arguments.
enum Format : int {
  kF16 = KVQ_F16,
  kBf16 = KVQ_BF16,
  kFp8E4m3 = KVQ_FP8_E4M3,
  kFp8E5m2 = KVQ_FP8_E5M2,
  kInt4Sym32 = KVQ_INT4_SYM32,
  kInt4Affine64 = KVQ_INT4_AFFINE64,
  kInt8Pth = KVQ_INT8_PTH,
  kFp4E2m1 = KVQ_FP4_E2M1,
  // Keys only, and no row codec: a block is quantized per channel once it is full (kvq.h's
  // layout note); append.cu serves it apart from the row formats.
  kInt4Kc = KVQ_INT4_KC,
};

// A list of format ids, for folds over formats. codec/codec.cuh makes the two lists the kernels
// dispatch over from kvq.h's id count and the codecs: AttentionFormats and AllFormats.
template <int... F> struct FormatList {};

// One stored format's device math, the counterpart of its src/format/ module. A codec holds:
//   constants  kBits (per code), kGroup (elements per group along head_dim, 0: none),
//              kGroupMeta (metadata bytes per group), kEpt (elements one thread of the row
//              kernels handles: one 16-byte vector of codes), kDense (served by the dense
//              quantize / dequantize), kHeadScale (an f32 scale per head, outside the rows;
//              with it kHeadMax, the largest value a head scale of 1 holds: past the scale
//              times it, inputs saturate),
//              kPackedExtremes (packed_extremes exists), optionally kRowMeta (metadata bytes
//              of the whole row), kRowGroup (the whole row is one group: row_extremes reduces
//              over the row's lanes where they divide a warp, the row kernels through shared
//              memory elsewhere; INT8), kFusedDecode = false (the decode kernel does not take
//              it though kDecodeK / kDecodeV say the attention kernels may: prefill does) and
//              kLongEncode (append gives each thread one row: a long encoder, FP4);
//   row role   extremes, group_extremes (or row_extremes), [packed_extremes,] encode, decode:
//              the exact FORMATS.md math of one thread's chunk of a row (append, gather,
//              dense);
//   K / V role the decode kernel's fragments (decode/frag.cuh): kBf16Operands, kGroupFrags
//              (which fragment kind), unit() with kHeadScale, q_scale, then per kind either
//              k_pair_elem, k_unpack / v_unpack (codes unpacked word by word into operands;
//              with kRowScale, an f32 row scale per token applied to S / P; with
//              kCodeBias and kCodeUnit, codes unpacked biased and in units, the bias taken
//              off the MMAs' sums; with kScaledWords, each word's group scale passed to the
//              unpack) or
//              k_dim, k_codes, kScoreUnit, k_zero_term / v_dim, v_codes, v_col_unit_inv
//              (grouped codes that enter the MMAs raw, their metadata applied around them);
//   decode     kDecodeK, kDecodeV (the decode kernel takes the format as keys / values) and,
//              with either, kDecodeFmt (its kernel format: one codec per kernel format and
//              role) and kDecodeMixed (kernels pair it with every other mixed format, else only
//              with its own kernel format): decode.cu's dispatch and instances follow from them;
//   calibration with kHeadScale, scale_from_amax: the dense path's per-head (tensor) scale.
// Zero codes and metadata decode to zeros in every row format: the prefill kernel decodes the
// rows a step does not see from a row of zero bytes (src/format's zero_bytes_decode_to_zeros).
template <int F> struct Codec;

// Whether codec C's group is its whole row (kRowGroup, default false).
template <class C, class = void> struct RowGroupOf : std::false_type {};
template <class C>
struct RowGroupOf<C, std::void_t<decltype(C::kRowGroup)>> : std::bool_constant<C::kRowGroup> {};

// Metadata bytes of one row of codec C that belong to the row, not to a group (kRowMeta, default
// 0): INT8's f32 scale.
template <class C, class = void> struct RowMetaOf : std::integral_constant<int, 0> {};
template <class C>
struct RowMetaOf<C, std::void_t<decltype(C::kRowMeta)>>
    : std::integral_constant<int, C::kRowMeta> {};

// Whether the decode kernel applies codec C's row metadata as one f32 scale per token
// (kRowScale, default false): on the token's scores (K), on its P (V).
template <class C, class = void> struct RowScaleOf : std::false_type {};
template <class C>
struct RowScaleOf<C, std::void_t<decltype(C::kRowScale)>> : std::bool_constant<C::kRowScale> {};

// Whether codec C's unpacks (k_unpack, v_unpack) leave a bias on every code (kCodeBias: its f16x2
// bits, a constant) for the decode kernel to take off the MMAs' sums (one MMA per chunk against
// the same operands) instead of subtracting it from every code: INT8's codes + 128.
template <class C, class = void> struct CodeBiasOf : std::false_type {};
template <class C>
struct CodeBiasOf<C, std::void_t<decltype(C::kCodeBias)>> : std::true_type {};

// Whether codec C's unpacks (k_unpack, v_unpack) take the group scale of the code words they
// unpack (kScaledWords, default false): FP4's E4M3 byte per 16 codes.
template <class C, class = void> struct ScaledWordsOf : std::false_type {};
template <class C>
struct ScaledWordsOf<C, std::void_t<decltype(C::kScaledWords)>>
    : std::bool_constant<C::kScaledWords> {};

// Whether codec C's K-role metadata is per block and channel (kBlockChannels, default false):
// int4-kc, whose sealed block holds s[head_dim] and z[head_dim] after its codes, and whose
// last, unsealed block of a sequence holds f16 rows (the decode kernel reads those itself).
template <class C, class = void> struct BlockChannelsOf : std::false_type {};
template <class C>
struct BlockChannelsOf<C, std::void_t<decltype(C::kBlockChannels)>>
    : std::bool_constant<C::kBlockChannels> {};

// Whether the decode kernel takes codec C in the roles kDecodeK / kDecodeV name (kFusedDecode,
// default true); prefill takes it either way.
template <class C, class = void> struct FusedDecodeOf : std::true_type {};
template <class C>
struct FusedDecodeOf<C, std::void_t<decltype(C::kFusedDecode)>>
    : std::bool_constant<C::kFusedDecode> {};

// Where one row's codes and metadata live: in a paged head section or in dense arrays. Group g's
// f16 scale (zero) is at scales[g * meta_step] (zeros[...]): the paged affine layout interleaves
// scale and zero (step 2), everything else is contiguous (step 1). Codecs whose metadata is not
// f16 read `scales` as the row's metadata bytes: FP4's E4M3 byte per group, INT8's f32 scale.
struct RowRef {
  uint8_t *codes;
  uint16_t *scales;
  uint16_t *zeros;
  int meta_step;
  float head_scale;  // FP8's s, FP4's g
};

// E input elements as loaded: raw 16-byte vectors, converted later, so that several rows'
// loads can be in flight before any of them is needed.
template <typename In, int E> struct RawChunk {
  static constexpr int kVectors = E * (int)sizeof(In) / 16;
  uint4 q[kVectors];
};

// The extremes of one thread's sanitized values that the INT4 quantizers need: the largest
// magnitude in `hi` (K), or the smallest and largest value (V). Idle lanes hold zeros.
struct Extremes {
  float lo, hi;
};

// The extremes of a symmetric code: the largest |x| of a thread's N values in hi (lo 0).
template <int N> __device__ __forceinline__ Extremes abs_max_extremes(const float (&v)[N]) {
  Extremes ex = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < N; ++i) ex.hi = fmaxf(ex.hi, fabsf(v[i]));
  return ex;
}

// The row role of the formats without groups (16-bit, FP8): no metadata in the rows, no extremes
// to find; EPT elements a thread, one 16-byte vector of BITS-bit codes.
template <int EPT, int BITS> struct UngroupedRows {
  static constexpr int kBits = BITS;
  static constexpr int kGroup = 0;
  static constexpr int kGroupMeta = 0;
  static constexpr int kEpt = EPT;
  static constexpr bool kPackedExtremes = false;
  static_assert(kEpt * kBits / 8 == 16, "each thread stores one 16-byte vector of codes");

  static __device__ __forceinline__ Extremes extremes(const float (&)[EPT]) {
    return {0.0f, 0.0f};
  }
  static __device__ __forceinline__ Extremes group_extremes(const Extremes &own) { return own; }
};

}  // namespace kvq

namespace kvq_decode {

// The decode kernel's (decode/kernel.cuh) template argument for one side's codes: one value per
// fragment unpacking, which a K-role and a V-role codec may share (I4: INT4 K groups of 32,
// symmetric; INT4 V groups of 64, affine; I8: INT8 rows under an f32 scale per token; F4: E2M1
// codes under E4M3 scales per 16; I4C: INT4 K per block and channel). A codec names its own
// (kDecodeFmt). Declared here for the codecs, and in kvq_decode because it is part of the
// kernels' names.
enum class Fmt : int { F16, BF16, E4M3, E5M2, I4, I8, F4, I4C };

}  // namespace kvq_decode
