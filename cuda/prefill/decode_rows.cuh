// prefill/decode_rows.cuh: a quantized side's staged raw rows decoded into 16-bit operand tiles
// through each format's codec (codec/), by a fold over every stored format, so that a new codec
// is decoded here without an edit.
#pragma once

#include <type_traits>

#include "codec/codec.cuh"
#include "prefill/layout.cuh"
#include "prim/bits.cuh"
#include "prim/convert.cuh"

namespace kvq_prefill {

using namespace kvq;

/// x rounded to the operand type's bits; f16 saturates (a decoded INT4 value can round past
/// 65504, and f16 inputs never exceed it).
template <bool BF16> __device__ __forceinline__ uint16_t operand_bits(float x) {
  if constexpr (BF16) return bf16_bits(x);
  else return half_bits(fminf(fmaxf(x, -65504.f), 65504.f));
}

/// Whether a codec decodes straight to f16 pairs (decode_f16), skipping f32.
template <class C, class = void> struct HasF16Rows : std::false_type {};
template <class C>
struct HasF16Rows<C, std::void_t<decltype(&C::decode_f16)>> : std::true_type {};
/// Whether its f16 decode takes a chunk's bytes loaded first (load_f16, then decode_f16 of them):
/// codecs whose decode branches (a range check on the group's scale) keep a thread's loads
/// ahead of its first branch so.
template <class C, class = void> struct HasF16Load : std::false_type {};
template <class C>
struct HasF16Load<C, std::void_t<decltype(&C::load_f16)>> : std::true_type {};

/// Where a step's raw rows of one quantized side lie in shared memory: row i of run r (kRun
/// rows) at codes + r * codes_run + i * codes_row, its metadata alike. Side-major staging
/// (`side_major`, the block-synchronous kernel) holds a side's kTokens rows of codes, then of
/// metadata; the warp-specialized kernel stages run-major (ws_run_layout).
struct Staged {
  const uint8_t *codes, *meta;
  int codes_run, meta_run;
};
__device__ __forceinline__ Staged side_major(const uint8_t *raw, const Side &s) {
  return {raw, raw + kTokens * s.codes_row, kRun * s.codes_row, kRun * s.meta_row};
}

/// Decode the staged rows of one side into an operand tile; rows outside [lo, hi) become zeros
/// (past the sequence or the split: never-written or stale codes must not reach the MMAs,
/// where 0 * NaN would poison the sum). Run by NT threads, thread threadIdx.x % NT taking every
/// NT-th unit.
///
/// A thread's units (chunk c of a row) are decoded all first, then stored, so that no store
/// that might alias the staged rows comes between their shared-memory loads; codecs whose
/// decode branches load every unit before the first decode (load_f16), so that their loads are
/// in flight together instead of one unit's load and decode after another. A dead row is
/// decoded with ZR from `zero_row` (kZeroRow bytes of zeros): one select per pointer, not one
/// per value (measured 1.2 % faster in the warp-specialized kernel, 1-2 % slower in the
/// block-synchronous one); else from its staged bytes, whatever they hold, and its values
/// replaced by zeros.
template <int F, bool BF16, int D, bool SW, int NT, bool ZR>
__device__ __forceinline__ void decode_side(const Staged &raw, const uint8_t *zero_row,
                                            const Side &s, uint8_t *tile, int lo, int hi) {
  using C = Codec<F>;
  constexpr int E = C::kEpt;
  constexpr int kChunks = D / E;
  constexpr int kUnits = kTokens * kChunks;
  constexpr int N = (kUnits + NT - 1) / NT;  // units per thread
  static_assert(D % E == 0, "head_dim is whole chunks of the codec (kvq_prefill_supported)");
  const unsigned tid = threadIdx.x % NT;
  const unsigned live_rows = hi > lo ? (unsigned)(hi - lo) : 0u;
  // Unit i of this thread: its chunk, whether its row is live, and the row's staged bytes (or
  // with ZR the zero row's).
  auto unit = [&](int i, unsigned *c, bool *live) {
    const unsigned u = tid + i * NT;
    // Row and chunk; where kChunks divides NT a thread keeps one chunk, NT / kChunks rows apart.
    const unsigned j = NT % kChunks == 0 ? tid / kChunks + i * (NT / kChunks) : u / kChunks;
    *c = NT % kChunks == 0 ? tid % kChunks : u % kChunks;
    const unsigned jr = kUnits % NT == 0 ? j : min(j, (unsigned)kTokens - 1);  // in the stage
    *live = (kUnits % NT == 0 || u < kUnits) && j - lo < live_rows;
    // The row's run and place in it; where a thread's rows lie whole runs apart, its first
    // row's place serves every i.
    constexpr bool kRunsApart =
        kUnits % NT == 0 && NT % kChunks == 0 && (NT / kChunks) % kRun == 0;
    const unsigned j0 = tid / kChunks;
    const unsigned run = kRunsApart ? j0 / kRun + i * (NT / kChunks / kRun) : jr / kRun;
    const unsigned in_run = kRunsApart ? j0 % kRun : jr % kRun;
    const uint8_t *const crow = raw.codes + run * raw.codes_run + in_run * s.codes_row;
    const uint8_t *const mrow = raw.meta + run * raw.meta_run + in_run * s.meta_row;
    RowRef r;
    if constexpr (ZR) {
      r.codes = const_cast<uint8_t *>(*live ? crow : zero_row);
      r.scales = reinterpret_cast<uint16_t *>(const_cast<uint8_t *>(*live ? mrow : zero_row));
    } else {
      r.codes = const_cast<uint8_t *>(crow);
      r.scales = reinterpret_cast<uint16_t *>(const_cast<uint8_t *>(mrow));
    }
    r.zeros = r.scales + 1;
    r.meta_step = s.meta_step;
    r.head_scale = 1.0f;  // FP8: applied to S and O instead
    return r;
  };
  uint32_t h[N][E / 2];
  bool live[N];
  if constexpr (!BF16 && HasF16Load<C>::value) {
    typename C::F16Raw bytes[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      unsigned c;
      bytes[i] = C::load_f16(unit(i, &c, &live[i]), c);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) C::decode_f16(bytes[i], h[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      unsigned c;
      const RowRef r = unit(i, &c, &live[i]);
      if constexpr (!BF16 && HasF16Rows<C>::value) {
        C::decode_f16(r, c, h[i]);
      } else {
        float v[E];
        C::decode(r, c, v);
#pragma unroll
        for (int e = 0; e < E / 2; ++e)
          h[i][e] = (uint32_t)operand_bits<BF16>(v[2 * e]) |
                    ((uint32_t)operand_bits<BF16>(v[2 * e + 1]) << 16);
      }
    }
  }
  if constexpr (!ZR) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int e = 0; e < E / 2; ++e) h[i][e] = live[i] ? h[i][e] : 0u;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const unsigned u = tid + i * NT;
    if (kUnits % NT != 0 && u >= kUnits) break;
    const unsigned j = NT % kChunks == 0 ? tid / kChunks + i * (NT / kChunks) : u / kChunks;
    const unsigned c = NT % kChunks == 0 ? tid % kChunks : u % kChunks;
#pragma unroll
    for (int w = 0; w < E / 8; ++w)
      *reinterpret_cast<uint4 *>(tile + tile_at<D, SW, kTokens>(j, c * E / 8 + w)) =
          make_uint4(h[i][4 * w], h[i][4 * w + 1], h[i][4 * w + 2], h[i][4 * w + 3]);
  }
}

/// Whether codec F's rows split into whole chunks and groups at head_dim D.
template <int F, int D> __host__ __device__ constexpr bool fits() {
  return D % Codec<F>::kEpt == 0 && D % (Codec<F>::kGroup > 0 ? Codec<F>::kGroup : 1) == 0;
}

/// Whether format F is a quantized side decoded into operands of type BF16 (bf16, else f16)
/// at head_dim D; 16-bit formats are always their operand type: copied, never decoded.
template <int F, bool BF16, int D> __host__ __device__ constexpr bool decodes_to() {
  return fits<F, D>() && Codec<F>::kBits < 16 && Codec<F>::kBf16Operands == BF16;
}

/// decode_side for the side's run-time format: a fold over every stored format (AllFormats),
/// so a new codec is decoded here without an edit. Only the formats that decode to the
/// instance's operand type (BF16) are compiled in: the launcher picks the instance by it.
template <bool BF16, int D, bool SW, int NT, bool ZR, int... F>
__device__ __forceinline__ void decode_in(FormatList<F...>, const Staged &raw,
                                          const uint8_t *zero_row, const Side &s, uint8_t *tile,
                                          int lo, int hi) {
  auto one = [&](auto f) {
    constexpr int G = decltype(f)::value;
    if constexpr (decodes_to<G, BF16, D>())
      decode_side<G, BF16, D, SW, NT, ZR>(raw, zero_row, s, tile, lo, hi);
  };
  (void)((s.format == F && (one(FormatTag<F>{}), true)) || ...);
}

template <bool BF16, int D, bool SW, int NT, bool ZR>
__device__ __forceinline__ void decode_any(const Staged &raw, const uint8_t *zero_row,
                                           const Side &s, uint8_t *tile, int lo, int hi) {
  decode_in<BF16, D, SW, NT, ZR>(AllFormats{}, raw, zero_row, s, tile, lo, hi);
}

/// A side's decoder for a loop over steps: decode_side of format F where the loop is specialized
/// to it (F >= 0), else (kAnyFormat) decode_any's run-time switch.
constexpr int kAnyFormat = -1;
template <int F, bool BF16, int D, bool SW, int NT, bool ZR> struct SideDecoder {
  const uint8_t *zero_row;
  const Side &s;
  __device__ __forceinline__ void operator()(const Staged &raw, uint8_t *tile, int lo,
                                             int hi) const {
    if constexpr (F == kAnyFormat)
      decode_any<BF16, D, SW, NT, ZR>(raw, zero_row, s, tile, lo, hi);
    else
      decode_side<F, BF16, D, SW, NT, ZR>(raw, zero_row, s, tile, lo, hi);
  }
};

/// Run `loop(decode_k, decode_v)` with the two sides' decoders (the warp-specialized kernel's
/// quantized producers: f16 operands, swizzled tiles, dead rows from the zero row), specialized
/// to their formats where the pair is one a quantized cache takes in practice (one format on
/// both sides, or INT4's K / V pairing: int4-sym32 keys, int4-affine64 values), so that the
/// loop holds no format switch (INT4 extends measured 6-12 % faster so); other pairs decode by
/// run-time switch. A new format's own pair is specialized without an edit here.
template <int D, int NT, class Loop, int... F>
__device__ __forceinline__ void with_decoder_pair(FormatList<F...>, const Side &k, const Side &v,
                                                  const uint8_t *zero_row, Loop &&loop) {
  auto pair = [&](auto kf, auto vf) __attribute__((always_inline)) {
    constexpr int KF = decltype(kf)::value, VF = decltype(vf)::value;
    loop(SideDecoder<KF, false, D, true, NT, true>{zero_row, k},
         SideDecoder<VF, false, D, true, NT, true>{zero_row, v});
  };
  auto same = [&](auto f) __attribute__((always_inline)) {
    constexpr int G = decltype(f)::value;
    if constexpr (decodes_to<G, false, D>()) {
      if (k.format == G && v.format == G) return pair(f, f), true;
    }
    return false;
  };
  if ((same(FormatTag<F>{}) || ...)) return;
  if constexpr (decodes_to<kInt4Sym32, false, D>() && decodes_to<kInt4Affine64, false, D>()) {
    if (k.format == kInt4Sym32 && v.format == kInt4Affine64)
      return pair(FormatTag<kInt4Sym32>{}, FormatTag<kInt4Affine64>{});
  }
  pair(FormatTag<kAnyFormat>{}, FormatTag<kAnyFormat>{});
}

}  // namespace kvq_prefill
