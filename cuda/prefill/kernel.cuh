// prefill/kernel.cuh: attention of many query rows over the paged cache (chunked prefill,
// prefix hits, speculative verification), for every cache format.
//
// Grid (tiles, num_kv_heads, splits), R / 16 warps per CTA. A sequence's query rows are its
// new tokens x the G query heads of one KV head, token-major (row r = token r / G, head r % G),
// so the G heads share every KV byte read; a CTA serves R of them (16 a warp) over one split of
// the keys: R = 64, or 128 (wide tiles, two warpgroups sharing every KV tile and its decode)
// when the launch's sequences average that many rows, or on the warp-specialized kernel 192
// (triple tiles, three warpgroups; 16-bit or decoded sides) where the launcher's estimate says
// so. Tiles are numbered over the batch in the CTA itself (a scan of qo_indptr), each
// sequence's last (longest, under the causal mask) tile first, and the CTAs with the KV head
// and the split fastest, so that the longest tiles of every head start first.
//
// Per step of 64 KV tokens each warp computes S = Q K^T and O += P V for its 16 rows on tensor
// cores (f32 accumulate; on sm_90a at head_dim 64 / 128 as one warpgroup's wgmma, else mma.sync
// m16n8k16) with an online softmax in the log2 domain, from 16-bit operand tiles in shared
// memory. A side (K or V) whose cache format is its operand type (f16, bf16) is copied straight
// into two alternating operand tiles; a quantized side is copied raw (codes and metadata, runs of
// 16 tokens of one page) into two alternating staging areas and decoded by every thread with the
// format's codec (codec/: the exact FORMATS.md values; FP8's per-head scale is left out and
// applied to S and O) into an operand tile: a step ahead into the second tile up to head_dim 128
// (pipelined), else into one tile between two barriers. The next step's copies fly during this
// step's decode and MMAs.
//
// Operand types: bf16 for a bf16 side, else f16 (exact for FP8 codes; decoded INT4 values are
// rounded once). bf16 queries over an f16 key operand are scaled per row by a power of two into
// f16's range (as the decode kernel does), the factor applied to the row's scores.
//
// int4-kc keys, which have no row codec (a block is quantized per channel once it is full), have
// instances of their own (KC): a sealed block's code rows are staged with its s and z (once per
// block and step) and decoded to f16 (q * s + z, rounded once); the rows of a sequence's open
// last block are its f16 window, copied from the pool into the operand tile when the step is
// decoded.
//
// A split that is not the only one writes its normalized partial O and its lse to the
// workspace; merge_splits (prefill.cu) combines them and applies the sinks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "codec/codec.cuh"
#include "kvq.h"
#include "prim/bits.cuh"
#include "prim/convert.cuh"
#include "prim/cp_async.cuh"
#include "prim/fast_div.cuh"
#include "prim/fast_math.cuh"
#include "prim/mbarrier.cuh"
#include "prim/mma.cuh"
#include "prim/pdl.cuh"
#include "prim/wgmma.cuh"

namespace kvq_prefill {

using namespace kvq;

constexpr int kRows = KVQ_PREFILL_TILE_ROWS;      // query rows per CTA (narrow tiles)
constexpr int kWideRows = 2 * kRows;                // query rows per CTA (wide tiles)
constexpr int kTripleRows = 3 * kRows;  // (triple tiles: the warp-specialized kernel)
constexpr int kTokens = KVQ_PREFILL_TILE_TOKENS;  // KV tokens per step
/// Threads of a CTA serving R rows: a warp per 16.
template <int R> __host__ __device__ constexpr int threads_of() { return R * 2; }
constexpr int kRun = 16;  // tokens per copied run: pages hold a multiple of 16 tokens
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kWsD = 128;  // the head_dim of the warp-specialized instances
/// E4M3 operands: log2 of the factor on a probability before its E4M3 rounding.
constexpr float kE4m3POffset = 8.f;
/// Log2 of how far a row's logits may exceed its reference max before O and l are rescaled to a
/// new one (16-bit P): most steps then skip the rescale.
constexpr float kRescaleSlack = 8.f;

/// One side (K or V) of the cache as the kernel reads it.
struct Side {
  int32_t format;  // kvq_format
  int32_t codes_off, codes_row, meta_off, meta_row, meta_step;
  int32_t direct;  // 16-bit codes, which are their own operands: copied, not decoded
};

/// The warp-specialized kernel's staging of quantized sides, run-major: run r of a step at
/// r * bytes holds kRun rows each of K's codes, K's metadata, V's codes and V's metadata, at
/// these offsets: a head section's layout at pages of kRun tokens, so that a run whose page
/// holds it that way is one bulk copy (Params::ws_whole_runs).
struct RunLayout {
  int k_codes, k_meta, v_codes, v_meta, bytes;
};
__host__ __device__ inline RunLayout ws_run_layout(const Side &k, const Side &v) {
  RunLayout l;
  l.k_codes = 0;
  l.k_meta = kRun * k.codes_row;
  l.v_codes = l.k_meta + kRun * k.meta_row;
  l.v_meta = l.v_codes + kRun * v.codes_row;
  l.bytes = l.v_meta + kRun * v.meta_row;
  return l;
}

/// Everything a prefill launch needs; built by the launcher from kvq_prefill_args.
struct Params {
  const uint8_t *pool;
  const float *k_scales, *v_scales;
  int64_t head_stride, block_stride, num_blocks;
  Side k, v;
  int32_t block_size;
  FastDiv block_div;  // by block_size: a token's page
  const void *q;
  void *out;
  float *lse;
  int64_t q_tok, q_head, o_tok, o_head, l_tok, l_head;
  const int32_t *qo_indptr, *block_tables, *context_lens;
  const float *sinks;
  float *ws_o, *ws_lse;
  int64_t ws_rows;  // rows of one split in the workspace: max_tokens * num_q_heads
  unsigned long long *counters;
  int32_t q_bf16;  // q element type: 1 = bf16, 0 = f16
  int32_t out_dtype;
  int32_t batch, num_q_heads, group, max_blocks, max_tokens;
  int32_t num_splits, split_tokens, window_left;
  float sm_scale;  // softmax_scale
  float soft_cap;  // <= 0: none
  const float *alibi_slopes;  // [num_q_heads] or null
  int32_t e4m3_operands;      // E4M3 caches may take the E4M3 instances (the launcher's choice)
  int32_t ws_turns;  // quantized warp-specialized: producer warps take turns at a step's copies
  // Quantized warp-specialized: the staging of a run (ws_run_layout; the launcher's, so that
  // the kernel reads its offsets as constants), and whether a run's raw rows are its page's
  // head section as it stands, copied as one instead of a side and a region at a time.
  RunLayout ws_run;
  int32_t ws_whole_runs;
  int32_t heads_first;  // blocks numbered KV head and split fastest (begin_tile)
};

/// Bytes of one row of operand tiles in shared memory: 16 bytes of padding put the 8 rows that
/// one ldmatrix reads on distinct 16-byte bank groups at every supported head_dim.
template <int D> __host__ __device__ constexpr int pitch() { return D * 2 + 16; }

/// Raw bytes of one step of a quantized side: kTokens rows of codes, then of metadata (whole
/// KiB, so that every operand tile after it starts on a 1024-byte boundary).
__host__ __device__ inline int stage_bytes(const Side &s) {
  return (kTokens * (s.codes_row + s.meta_row) + 1023) / 1024 * 1024;
}

/// Whether the instance of head_dim D runs its MMAs as wgmma (sm_90a; whole 64-column blocks on
/// the pipelined schedule): its operand tiles are then B128 tiles (prim/wgmma.cuh), else rows of
/// pitch<D>() bytes.
template <int D> __host__ __device__ constexpr bool uses_wgmma() {
  return KVQ_HAS_WGMMA && D <= 128 && D % 64 == 0;
}

/// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `ROWS` rows: an operand tile
/// (kTokens rows) or the Q tile (a CTA's rows).
template <int D, bool SW, int ROWS> __device__ __forceinline__ int tile_at(int row, int chunk) {
  if constexpr (SW) return b128_at<ROWS>(row, chunk);
  else return row * (D * 2 + 16) + chunk * 16;
}

/// Whether head_dim D runs the pipelined schedule: Q fragments held in registers, every side
/// with two operand tiles, and a quantized side decoded one step ahead of the MMAs (no barrier
/// between decode and MMA). Wider rows keep Q in shared memory and decode each step between two
/// barriers into one operand tile, so two blocks still fit an SM.
__host__ __device__ constexpr bool pipelined(int d) { return d <= 128; }

/// Whether Q's fragments stay in registers across the steps. Else each step reads them from the
/// Q tile: wgmma takes them straight from shared memory (a descriptor, as for K), mma.sync by
/// ldmatrix. With wgmma only narrow tiles at head_dim 128 hold them (and alias the Q tile, so
/// that two blocks fit an SM beside quantized sides); at 64 ptxas 13.0 gave the registers of
/// held fragments that feed wgmma to other values inside the loop (the SASS showed it), and wide
/// tiles need those registers for their accumulators.
template <int D, int R> __host__ __device__ constexpr bool q_in_registers() {
  return pipelined(D) && D > 64 && (!uses_wgmma<D>() || R == kRows);
}

/// Where a launch's dynamic shared memory goes (offsets from its first 1024-byte boundary; the
/// size has room for the alignment): the Q tile, then per side its operand tiles (two, or one for
/// a quantized side off the pipelined schedule) and for a quantized side two staging areas.
/// When Q is held in registers and its tile is the size of an operand tile, the Q tile is K's
/// second operand tile: Q is in registers before step 1's copies or decode write there. Tiles are
/// sized for rows of pitch<D>() bytes, which also holds a B128 tile (a multiple of 1024 bytes at
/// every supported head_dim).
struct Layout {
  int q, k_op, k_stage, v_op, v_stage, bytes;
};

/// Bytes of a zero row (zero codes and metadata are zeros in every format: dead rows can be
/// decoded from it): a row of codes or metadata at every head_dim.
constexpr int kZeroRow = 512;
template <int D, int R> __host__ __device__ inline Layout smem_layout(const Side &k, const Side &v) {
  constexpr int d = D;
  const bool pipe = pipelined(d);
  const int tile = kTokens * (2 * d + 16);
  Layout l;
  int at = 0;
  const bool q_alias = q_in_registers<D, R>() && R == kTokens;
  l.q = at, at += q_alias ? 0 : R * (2 * d + 16);
  l.k_op = at, at += (k.direct || pipe) ? 2 * tile : tile;
  l.k_stage = at, at += k.direct ? 0 : 2 * stage_bytes(k);
  l.v_op = at, at += (v.direct || pipe) ? 2 * tile : tile;
  l.v_stage = at, at += v.direct ? 0 : 2 * stage_bytes(v);
  if (q_alias) l.q = l.k_op + tile;
  l.bytes = at + 1024;
  return l;
}

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

/// New tokens of sequence b and the first one's index over the batch; 0 tokens (and `*bad`)
/// when its qo_indptr entries are out of order or past the capacity, so nothing outside q, out
/// and the workspace is addressed whatever the entries hold.
__device__ __forceinline__ int seq_tokens(const Params &p, int b, int *q0, bool *bad) {
  const int a = p.qo_indptr[b], e = p.qo_indptr[b + 1];
  *bad = a < 0 || e < a || e > p.max_tokens;
  *q0 = *bad ? 0 : a;
  return *bad ? 0 : e - a;
}

/// Which sequence and which of its tiles CTA `tile` serves: a block-wide scan of the tiles per
/// sequence (ceil(n_b * G / R)). False when `tile` is past the batch's last.
template <int R, int kThreads>
__device__ __forceinline__ bool find_tile(const Params &p, int tile, int *seq, int *index,
                                          int *count) {
  constexpr int kWarps = kThreads / 32;
  // The warps' sums in whole 16-byte words of their own: the sums are read four at a time, and
  // such a read must not take in s_count, which a thread writes meanwhile (racecheck says so,
  // though the value goes unused).
  __shared__ __align__(16) int s_warp[(kWarps + 3) / 4 * 4];
  __shared__ int s_seq, s_index, s_count;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) s_seq = -1;
  __syncthreads();
  int base = 0;
  for (int b0 = 0; b0 < p.batch; b0 += kThreads) {
    const int b = b0 + tid;
    int n = 0, q0;
    bool bad;
    if (b < p.batch) n = seq_tokens(p, b, &q0, &bad);
    const int tiles = (int)(((int64_t)n * p.group + R - 1) / R);
    int incl = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += x;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = base, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += s_warp[w];
      total += s_warp[w];
    }
    const int first = before + incl - tiles;
    if (b < p.batch && tile >= first && tile < first + tiles) {
      s_seq = b;
      s_index = tile - first;
      s_count = tiles;
    }
    base += total;
    __syncthreads();
    if (s_seq >= 0 || base > tile) break;  // uniform: shared values after the barrier
  }
  *seq = s_seq, *index = s_index, *count = s_count;
  return s_seq >= 0;
}

/// The sections of one step's pages: for each run of 16 tokens, the byte offset in the pool of
/// its first row's head section (block * block_stride + in-page row 0 of the run), or -1 when
/// the run is past the keys or its block lies outside the pool (zero-filled, counted).
struct StepPages {
  int64_t at[kTokens / kRun];
  int32_t off[kTokens / kRun];  // the run's first row within its page
};

/// Queue the copies of a direct side's rows of one step into operand tile `op`: thread t of the
/// kThreads that copy (t = threadIdx.x % kThreads) copies 16-byte unit t of every kThreads, rows
/// at or past `hi` (relative to the step) zero-filled so that never-written codes cannot reach
/// the MMAs.
template <int D, bool SW, int kThreads>
__device__ __forceinline__ void issue_direct(const uint8_t *head, int32_t codes_off,
                                             const StepPages &pg, int hi, uint8_t *op) {
  constexpr int P = pitch<D>();
  constexpr int UR = D * 2 / 16;  // 16-byte units of a row
  constexpr int N = kTokens * UR / kThreads;
  constexpr int RPI = kThreads / UR;  // rows one pass of the block covers
  static_assert(kTokens * UR % kThreads == 0, "whole units per thread");
  static_assert(kTokens / kRun == 4, "four runs a step (pick below)");
  // The run's first row in the pool (or -1), by selects: an array indexed at run time would
  // live in local memory.
  int64_t first[4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    first[r] = pg.at[r] < 0 ? -1 : pg.at[r] + codes_off + (int64_t)pg.off[r] * (D * 2);
  if constexpr (kThreads % UR == 0 && kRun % RPI == 0) {
    // Pass i covers rows [i RPI, (i + 1) RPI), all in run i RPI / kRun: the run and the row's
    // place in it are known at compile time, the thread's row and column once (RPI is a
    // multiple of 8, so a B128 tile's swizzle is the same in every pass).
    static_assert(!SW || RPI % 8 == 0, "one swizzle per thread");
    const int row0 = threadIdx.x % kThreads / UR, c = threadIdx.x % UR;
    const uint32_t dst = smem_u32(op) + tile_at<D, SW, kTokens>(row0, c);
    constexpr int kRowBytes = SW ? 128 : P;
    const int in_row = row0 * (D * 2) + c * 16;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int64_t at = first[i * RPI / kRun];
      const bool live = at >= 0 && row0 + i * RPI < hi;
      const uint8_t *src = head + (live ? at + (i * RPI % kRun) * (D * 2) + in_row : 0);
      cp_async16(dst + i * RPI * kRowBytes, src, live ? 16u : 0u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int u = threadIdx.x % kThreads + i * kThreads;
      const int row = u / UR, c = u - row * UR, run = row / kRun;
      const int64_t at =
          run == 0 ? first[0] : run == 1 ? first[1] : run == 2 ? first[2] : first[3];
      const bool live = at >= 0 && row < hi;
      const uint8_t *src = head + (live ? at + (int64_t)(row % kRun) * (D * 2) + c * 16 : 0);
      cp_async16(smem_u32(op + tile_at<D, SW, kTokens>(row, c)), src, live ? 16u : 0u);
    }
  }
}

/// Queue the copies of a quantized side's codes and metadata of one step into staging area
/// `st` (kTokens rows of codes, then of metadata); runs past the keys are skipped (never
/// decoded), runs of blocks outside the pool read as zeros.
template <int kThreads>
__device__ __forceinline__ void issue_raw(const Side &s, const uint8_t *head, const StepPages &pg,
                                          int nruns, uint8_t *st) {
  const int cr = s.codes_row, mr = s.meta_row;  // 16-byte units of a run's codes, metadata
#pragma unroll 1
  for (int run = 0; run < nruns; ++run) {
    const int64_t at = pg.at[run];
    const int32_t off = pg.off[run];
    const uint8_t *sec = head + (at >= 0 ? at : 0);
    uint8_t *dc = st + run * kRun * cr, *dm = st + kTokens * cr + run * kRun * mr;
    for (int u = threadIdx.x; u < cr + mr; u += kThreads) {
      const bool meta = u >= cr;
      const int x = meta ? u - cr : u;
      const int row0 = meta ? s.meta_off + off * mr : s.codes_off + off * cr;
      const uint8_t *src = sec + row0 + x * 16;
      cp_async16(smem_u32((meta ? dm : dc) + x * 16), src, at >= 0 ? 16u : 0u);
    }
  }
}

// ---- int4-kc keys (kvq.h's layout note on KVQ_INT4_KC), instances of their own (KC): a sealed
// block's code rows and its s, z are staged and decoded; the rows of the sequence's open block
// (its f16 window) are copied into the operand tile as they are, at decode time. A staged step:
// kTokens rows of head_dim / 2 code bytes, then a slot of s[head_dim], z[head_dim] (f16) per
// run (side_of gives the side meta_row head_dim / 4, so that stage_bytes counts the 4 slots).

/// The first position of a sequence of `len` tokens that lies in no sealed block (of
/// `block_size` tokens): positions before it are sealed (layout.rs, BlockLayout::sealed).
__device__ __forceinline__ int kc_sealed_end(int len, int block_size) {
  return len / block_size * block_size;
}

/// Slot of the s and z that run `run` of a step reads: its block's first run in the step (the
/// only one of that block whose copies include them). A run lies in one block (blocks hold a
/// multiple of 16 tokens), and the runs before it in its block are the step's runs before it.
__device__ __forceinline__ int kc_meta_slot(const StepPages &pg, int run) {
  return max(run - pg.off[run] / kRun, 0);
}

/// Queue the copies of int4-kc keys of one step into staging area `st`, for its first `nruns`
/// runs (callers pass only runs of sealed blocks): each run's code rows, and its block's s and
/// z into its slot where the run is the block's first in the step (kc_meta_slot). Runs of
/// blocks outside the pool read as zeros.
template <int D, int kThreads>
__device__ __forceinline__ void issue_kc(const Side &s, const uint8_t *head, const StepPages &pg,
                                         int nruns, uint8_t *st) {
  constexpr int CU = D / 2;  // 16-byte units of a run's codes: 16 rows of head_dim / 2 bytes
  constexpr int MU = D / 4;  // 16-byte units of a block's s and z: 4 head_dim bytes
#pragma unroll 1
  for (int run = 0; run < nruns; ++run) {
    const int64_t at = pg.at[run];
    const uint8_t *sec = head + (at >= 0 ? at : 0);
    const int units = kc_meta_slot(pg, run) == run ? CU + MU : CU;
    uint8_t *dc = st + run * kRun * (D / 2), *dm = st + kTokens * (D / 2) + run * (4 * D);
    for (int u = threadIdx.x; u < units; u += kThreads) {
      const bool meta = u >= CU;
      const int x = meta ? u - CU : u;
      const uint8_t *src = sec + (meta ? s.meta_off : s.codes_off + pg.off[run] * (D / 2)) + x * 16;
      cp_async16(smem_u32((meta ? dm : dc) + x * 16), src, at >= 0 ? 16u : 0u);
    }
  }
}

/// Elements 8c .. 8c + 7 of a sealed int4-kc row as f16 pairs (element 8c + 2i low in h[i])
/// from their codes (element 8c in bits 0-3) and their channels' f16 s and z: q * s + z rounded
/// once to f16 (int4_kc_decode8's f32 fma, rounded again, may differ by one f16 ulp), clamped to
/// +-65504 (s rounded up can carry z + 15 s past it).
__device__ __forceinline__ void kc_decode8_f16(uint32_t codes, const uint4 &s, const uint4 &z,
                                               uint32_t (&h)[4]) {
  const uint32_t sw[4] = {s.x, s.y, s.z, s.w}, zw[4] = {z.x, z.y, z.z, z.w};
  const __half2 bias = __float2half2_rn(1024.0f), lim = __float2half2_rn(65504.0f);
  // Byte i holds elements 8c + 2i (low nibble) and 8c + 2i + 1; each becomes 1024 + n, exact.
  const uint32_t w4 = codes >> 4;
  const uint32_t x[4] = {nibble_pair_f16<0, 0>(codes, w4), nibble_pair_f16<1, 0>(codes, w4),
                         nibble_pair_f16<2, 0>(codes, w4), nibble_pair_f16<3, 0>(codes, w4)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 v = __hfma2(__hsub2(bits_h2(x[i]), bias), bits_h2(sw[i]), bits_h2(zw[i]));
    h[i] = h2_bits(__hmin2(__hmax2(v, __hneg2(lim)), lim));
  }
}

/// One step of int4-kc keys into operand tile `tile`: rows before `sealed` (relative to the
/// step; a multiple of 16) decoded from the staged codes and their block's s and z, rows from
/// `sealed` on (the open block) copied from the pool's window rows by cp.async, committed here
/// as one group the caller waits for before the MMAs read the tile; rows outside [lo, hi)
/// become zeros.
template <int D, bool SW, int NT>
__device__ __forceinline__ void decode_kc(const uint8_t *raw, const Side &s, const uint8_t *head,
                                          const StepPages &pg, uint8_t *tile, int lo, int hi,
                                          int sealed) {
  constexpr int kChunks = D / 8;  // 16-byte units of an operand row: 4 code bytes each
  const uint8_t *meta = raw + kTokens * (D / 2);
  // The s and z of chunk `cur % kChunks` of slot `cur / kChunks`, loaded again only when they
  // change: where kChunks divides NT a thread keeps one chunk, so once per block and step.
  int cur = -1;
  uint4 sv = make_uint4(0u, 0u, 0u, 0u), zv = sv;
  for (int u = threadIdx.x; u < kTokens * kChunks; u += NT) {
    const int j = u / kChunks, c = u % kChunks, run = j / kRun;
    uint8_t *dst = tile + tile_at<D, SW, kTokens>(j, c);
    const bool live = j >= lo && j < hi;
    if (live && j >= sealed) {
      const int64_t at = pg.at[run];
      const int64_t row = at + s.codes_off + (int64_t)(pg.off[run] + j % kRun) * (2 * D) + c * 16;
      cp_async16(smem_u32(dst), head + (at >= 0 ? row : 0), at >= 0 ? 16u : 0u);
      continue;
    }
    uint32_t h[4] = {0u, 0u, 0u, 0u};
    if (live) {
      const int slot = kc_meta_slot(pg, run);
      if (slot * kChunks + c != cur) {
        cur = slot * kChunks + c;
        const uint8_t *m = meta + slot * (4 * D) + c * 16;
        sv = *reinterpret_cast<const uint4 *>(m);
        zv = *reinterpret_cast<const uint4 *>(m + 2 * D);
      }
      kc_decode8_f16(*reinterpret_cast<const uint32_t *>(raw + j * (D / 2) + c * 4), sv, zv, h);
    }
    *reinterpret_cast<uint4 *>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
  }
  cp_async_commit();
}

/// Bounds and places of a CTA's query rows (shared memory).
template <int R> struct RowInfo {
  int lo[R], hi[R];        // keys [lo, hi) the row sees in this split
  int64_t out[R], lse[R];  // the row's offsets in out and lse
  int head[R];
  float qs[R];     // factor of the row's scores (q's power-of-two scaling)
  float slope[R];  // ALiBi slope (log2 domain; 0 past the rows), for the masked path
  int pos[R];      // the row's position, for ALiBi
};

/// What a CTA serves: rows [r0, r0 + R) of sequence b's rows (its n new tokens x G heads of KV
/// head kvh; the first is token q0 of the batch) over the keys of split `split` of its len.
struct TileJob {
  int b, q0, n, rows, r0, len, kvh, split;
  bool bad_len;  // qo_indptr or context_lens out of range: counted as a fault
};

/// Find the CTA's tile (false: past the batch's last) and fill the rows' bounds (threads < R).
template <int R, int kThreads>
__device__ __forceinline__ bool begin_tile(const Params &p, RowInfo<R> &rw, TileJob &j) {
  int index, count, tile = blockIdx.x;
  j.kvh = blockIdx.y, j.split = blockIdx.z;
  if (p.heads_first) {
    // Blocks start in the order of their linear index (x fastest). Read with the KV head and
    // the split fastest and the tile slowest, every head's longest tiles start first: longest
    // first over the grid, not one head after another.
    const unsigned heads = gridDim.y, splits = gridDim.z;
    const unsigned lin = blockIdx.x + gridDim.x * (blockIdx.y + heads * blockIdx.z);
    tile = (int)(lin / (heads * splits));
    j.kvh = (int)(lin / splits % heads), j.split = (int)(lin % splits);
  }
  if (!find_tile<R, kThreads>(p, tile, &j.b, &index, &count)) return false;
  const int G = p.group;
  bool bad_q;
  j.n = seq_tokens(p, j.b, &j.q0, &bad_q);
  const int cap = p.max_blocks * p.block_size;
  int len = p.context_lens[j.b];
  j.bad_len = bad_q || len < j.n || len > cap;
  j.len = min(max(len, 0), cap);
  j.rows = j.n * G;
  j.r0 = (count - 1 - index) * R;  // the last tile first: it has the most keys
  const int past = j.len - j.n;     // position of the first new token
  const int s_lo = j.split * p.split_tokens, s_hi = min(j.len, s_lo + p.split_tokens);
  const int tid = threadIdx.x;
  if (tid < R) {
    const int r = j.r0 + tid;
    int lo = 0, hi = 0, pos = 0;
    float slope = 0.f;
    if (r < j.rows) {
      const int i = r / G, h = j.kvh * G + r % G;
      pos = past + i;
      hi = min(pos + 1, s_hi);
      lo = max(max(p.window_left >= 0 ? pos - p.window_left : 0, s_lo), 0);
      rw.head[tid] = h;
      rw.out[tid] = (int64_t)(j.q0 + i) * p.o_tok + (int64_t)h * p.o_head;
      rw.lse[tid] = (int64_t)(j.q0 + i) * p.l_tok + (int64_t)h * p.l_head;
      if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[h] * kLog2e;
    }
    rw.slope[tid] = slope;
    rw.pos[tid] = pos;
    rw.lo[tid] = lo;
    rw.hi[tid] = max(hi, lo);
    rw.qs[tid] = 1.f;
  }
  return true;
}

/// Queue the copies of the CTA's Q rows into the Q tile (rows past the sequence: zeros), as
/// one commit group.
template <int D, int R, bool SW, int kThreads>
__device__ __forceinline__ void load_q(const Params &p, const TileJob &j, uint8_t *qs) {
  constexpr int U = D * 2 / 16;
  const int G = p.group;
  for (int u = threadIdx.x; u < R * U; u += kThreads) {
    const int rr = u / U, c = u % U, r = j.r0 + rr;
    const uint8_t *src = static_cast<const uint8_t *>(p.q);
    uint32_t bytes = 0;
    if (r < j.rows) {
      src += ((int64_t)(j.q0 + r / G) * p.q_tok + (int64_t)(j.kvh * G + r % G) * p.q_head) * 2 +
             c * 16;
      bytes = 16;
    }
    cp_async16(smem_u32(qs + tile_at<D, SW, R>(rr, c)), src, bytes);
  }
  cp_async_commit();
}

/// bf16 queries over an f16 key operand: each row of the Q tile scaled by a power of two into
/// f16's range and stored as f16 (warp w of nw takes rows w, w + nw, ...); the factor goes to
/// rw.qs.
template <int D, int R, bool SW>
__device__ __forceinline__ void scale_q(uint8_t *qs, RowInfo<R> &rw, int warp, int nw) {
  const int lane = threadIdx.x % 32;
  // Element d of row r, in the Q tile's layout.
  auto q_elem = [&](int r, int d) { return qs + tile_at<D, SW, R>(r, d / 8) + (d % 8) * 2; };
  for (int r = warp; r < R; r += nw) {
    float mx = 0.f;
    for (int d = lane; d < D; d += 32)
      mx = fmaxf(mx, fabsf(__bfloat162float(*reinterpret_cast<__nv_bfloat16 *>(q_elem(r, d)))));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    const int e = (mx > 0.f && mx <= 3.0e38f) ? ilogbf(mx) : 0;
    const float sc = ldexpf(1.f, -e);
    for (int d = lane; d < D; d += 32) {
      uint8_t *x = q_elem(r, d);
      const float v = __bfloat162float(*reinterpret_cast<__nv_bfloat16 *>(x));
      *reinterpret_cast<__half *>(x) = __float2half_rn(v * sc);
    }
    if (lane == 0) rw.qs[r] = ldexpf(1.f, e);
  }
}

/// Keys any row of the CTA sees in this split: [*lo, *hi), empty when *hi <= *lo.
/// Every warp computes it (lanes over the rows, then shuffles), with no barrier.
template <int R>
__device__ __forceinline__ void tile_keys(const RowInfo<R> &rw, int *lo, int *hi) {
  int kv_lo = INT32_MAX, kv_hi = 0;
#pragma unroll
  for (int r = threadIdx.x % 32; r < R; r += 32)
    if (rw.hi[r] > rw.lo[r]) kv_lo = min(kv_lo, rw.lo[r]), kv_hi = max(kv_hi, rw.hi[r]);
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    kv_lo = min(kv_lo, __shfl_xor_sync(kFull, kv_lo, o));
    kv_hi = max(kv_hi, __shfl_xor_sync(kFull, kv_hi, o));
  }
  *lo = kv_lo, *hi = kv_hi;
}

/// One warp's online softmax over steps of kTokens keys (log2 domain), for this thread's rows
/// a and b of the C fragments: rows ra = 16 w + g and rb = ra + 8 of the CTA (warp w of the
/// MMAs).
template <int R> struct WarpSoftmax {
  const RowInfo<R> &rw;
  int ra, rb, t;
  int lo_a, hi_a, lo_b, hi_b;
  // Keys any of the warp's rows sees, [w_lo, w_hi), and that all of them see, [in_lo, in_hi).
  int w_lo, w_hi, in_lo, in_hi;
  float mul_a, mul_b, cap2;
  bool plain_ok, capped, biased;
  float m_a, m_b, l_a, l_b;

  __device__ __forceinline__ WarpSoftmax(const Params &p, const RowInfo<R> &rows, int warp,
                                         float k_factor)
      : rw(rows) {
    const int lane = threadIdx.x % 32, g = lane / 4;
    t = lane % 4;
    ra = warp * 16 + g, rb = ra + 8;
    lo_a = rw.lo[ra], hi_a = rw.hi[ra], lo_b = rw.lo[rb], hi_b = rw.hi[rb];
    w_lo = INT32_MAX, w_hi = 0, in_lo = 0, in_hi = INT32_MAX;
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
      if (rw.hi[r] > rw.lo[r]) w_lo = min(w_lo, rw.lo[r]), w_hi = max(w_hi, rw.hi[r]);
      in_lo = max(in_lo, rw.lo[r]), in_hi = min(in_hi, rw.hi[r]);
    }
    capped = p.soft_cap > 0.f, biased = p.alibi_slopes != nullptr;
    // Logits in the log2 domain: x * mul (no cap) or cap2 * tanh(x * mul) (capped), then plus
    // the ALiBi bias (biased).
    const float mul =
        capped ? p.sm_scale * k_factor / p.soft_cap : p.sm_scale * k_factor * kLog2e;
    cap2 = p.soft_cap * kLog2e;
    mul_a = mul * rw.qs[ra], mul_b = mul * rw.qs[rb];
    // A step whose keys every row of the warp sees, without a cap, takes the plain path: the
    // scale folds into the exponent's FMA and nothing is masked (a positive scale keeps the
    // max). ALiBi slopes empty the range every row sees instead (the masked path applies them;
    // a third term in plain_ok cost ptxas 23 registers at head_dim 64, wide tiles).
    plain_ok = !capped && mul > 0.f;
    if (biased) in_lo = INT32_MAX;
    m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  }

  /// Step of keys [tok0, tok0 + kTokens): from the scores s (16 rows x 64 keys a warp), rescale
  /// O and l, and return P as A operands in pa (n-tile j, rows a (0) / b (1), keys 2t, 2t + 1).
  template <bool VB, int D, bool E4M3 = false>
  __device__ __forceinline__ void step(float (&s)[8][4], int tok0, float (&o)[D / 8][4],
                                       uint32_t (&pa)[8][2]) {
    // Running max of the logits (log2 domain). The exponent below is s * e_a - sub_a: plain,
    // s is the raw score and e_a the row's scale; otherwise s is the finished logit (scaled,
    // capped, biased, masked to -inf) and e_a is 1.
    float mx_a = -INFINITY, mx_b = -INFINITY, e_a = 1.f, e_b = 1.f;
    if (plain_ok && tok0 >= in_lo && tok0 + kTokens <= in_hi) {
      // Pairwise, so that the chain of dependent maxima is 4 deep rather than 8.
      float ma[8], mb[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        ma[j] = fmaxf(s[j][0], s[j][1]), mb[j] = fmaxf(s[j][2], s[j][3]);
#pragma unroll
      for (int w = 4; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j)
          ma[j] = fmaxf(ma[j], ma[j + w]), mb[j] = fmaxf(mb[j], mb[j + w]);
      mx_a = ma[0], mx_b = mb[0];
      e_a = mul_a, e_b = mul_b;
    } else {
      // Key tok is in row a's range when tok - lo_a < hi_a - lo_a (unsigned).
      const int da = tok0 + 2 * t - lo_a, db = tok0 + 2 * t - lo_b;
      const unsigned wa = hi_a - lo_a, wb = hi_b - lo_b;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[j][e] * (e < 2 ? mul_a : mul_b);
          if (capped) {
            float th;
            asm("tanh.approx.f32 %0, %1;" : "=f"(th) : "f"(x));
            x = cap2 * th;
          }
          const int k = j * 8 + (e & 1);
          if (biased) {
            // ALiBi after the cap: the row's slope times the key's offset from its position.
            const int rr = e < 2 ? ra : rb;
            x = fmaf(rw.slope[rr], (float)(tok0 + 2 * t + k - rw.pos[rr]), x);
          }
          const bool in = e < 2 ? (unsigned)(da + k) < wa : (unsigned)(db + k) < wb;
          s[j][e] = in ? x : -INFINITY;
        }
        mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
      }
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      mx_a = fmaxf(mx_a, __shfl_xor_sync(kFull, mx_a, x));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(kFull, mx_b, x));
    }
    mx_a *= e_a, mx_b *= e_b;
    // A row's reference m moves to the step's max only when that exceeds it by more than
    // kSlack: until then its exponentials stay below 2^kSlack (f32 l and 16-bit P hold them as
    // well as below 1) and O and l keep their scale, since O / l is the same quotient under
    // any reference. A row that has seen nothing keeps m = -inf (-inf - -inf is NaN: no move;
    // O and l are 0). E4M3 P, which already carries 2^kE4m3POffset, moves at any growth.
    constexpr float kSlack = E4M3 ? 0.f : kRescaleSlack;
    const bool mv_a = mx_a - m_a > kSlack, mv_b = mx_b - m_b > kSlack;
    const float mn_a = mv_a ? mx_a : m_a, mn_b = mv_b ? mx_b : m_b;
    const float al_a = mv_a ? fast_exp2(m_a - mn_a) : 1.f;
    const float al_b = mv_b ? fast_exp2(m_b - mn_b) : 1.f;
    m_a = mn_a, m_b = mn_b;
    // E4M3 P: the exponentials carry the factor 2^kE4m3POffset (so does l; the caller takes it
    // out of both before finish).
    constexpr float kOff = E4M3 ? kE4m3POffset : 0.f;
    const float sub_a = (mn_a == -INFINITY ? 0.f : mn_a) - kOff;
    const float sub_b = (mn_b == -INFINITY ? 0.f : mn_b) - kOff;
    l_a *= al_a, l_b *= al_b;
    // O keeps its scale when no row of the warp moved its reference, most steps once the
    // rows' first keys are seen.
    if (__any_sync(kFull, mv_a || mv_b)) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        o[i][0] *= al_a, o[i][1] *= al_a, o[i][2] *= al_b, o[i][3] *= al_b;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = fast_exp2(fmaf(s[j][0], e_a, -sub_a));
      const float p1 = fast_exp2(fmaf(s[j][1], e_a, -sub_a));
      const float p2 = fast_exp2(fmaf(s[j][2], e_b, -sub_b));
      const float p3 = fast_exp2(fmaf(s[j][3], e_b, -sub_b));
      l_a += p0 + p1, l_b += p2 + p3;
      if constexpr (E4M3) {
        pa[j][0] = fp8x2_encode<kFp8E4m3>(make_float2(p0, p1));
        pa[j][1] = fp8x2_encode<kFp8E4m3>(make_float2(p2, p3));
      } else {
        pa[j][0] = pack2<VB>(p0, p1);
        pa[j][1] = pack2<VB>(p2, p3);
      }
    }
  }

  /// Epilogue: row sums across the quad, then this thread's two rows: the normalized partial
  /// and its lse to the workspace (more than one split), else out (sinks applied) and lse.
  template <int D>
  __device__ __forceinline__ void finish(const Params &p, const TileJob &j, float (&o)[D / 8][4],
                                         float v_factor) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      l_a += __shfl_xor_sync(kFull, l_a, x);
      l_b += __shfl_xor_sync(kFull, l_b, x);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rr = half ? rb : ra;
      if (j.r0 + rr >= j.rows) continue;
      const float m = half ? m_b : m_a, l = half ? l_b : l_a;
      const int h = rw.head[rr];
      const int64_t grow = (int64_t)(j.q0 + (j.r0 + rr) / p.group) * p.num_q_heads + h;
      if (p.num_splits > 1) {
        // Normalized partial and its natural-log lse; the merge applies the sinks.
        const float inv = l > 0.f ? v_factor / l : 0.f;
        float *dst = p.ws_o + ((int64_t)j.split * p.ws_rows + grow) * D;
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          const int d = c * 8 + 2 * t;
          const float *oc = o[c] + 2 * half;
          *reinterpret_cast<float2 *>(dst + d) = make_float2(oc[0] * inv, oc[1] * inv);
        }
        if (t == 0)
          p.ws_lse[(int64_t)j.split * p.ws_rows + grow] =
              l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
        continue;
      }
      float M = m, scale_o = 1.f, L = l;
      if (p.sinks != nullptr) {
        const float s2 = p.sinks[h] * kLog2e;
        M = fmaxf(m, s2);
        scale_o = m == -INFINITY ? 0.f : fast_exp2(m - M);
        L = l * scale_o + fast_exp2(s2 - M);
      }
      const float inv = L > 0.f ? scale_o * v_factor / L : 0.f;
      // A row starts on an even element when the view's strides are even (d is).
      const bool paired = ((p.o_tok | p.o_head) & 1) == 0 &&
                          (reinterpret_cast<uintptr_t>(p.out) & 7) == 0;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const int d = c * 8 + 2 * t;
        const float *oc = o[c] + 2 * half;
        store_out2(p.out, rw.out[rr] + d, oc[0] * inv, oc[1] * inv, p.out_dtype, paired);
      }
      if (t == 0 && p.lse != nullptr)
        p.lse[rw.lse[rr]] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    }
  }
};

#if KVQ_HAS_WGMMA
/// O += P V on a warpgroup, committed, not waited (wg_pv_wait): P from this thread's A
/// fragments (n-tile j, rows a / b), which the MMAs read until their wait, V the operand tile
/// whose descriptor's low word is v_lo (b128_desc_lo; an N-major B: 16 keys are 2048 bytes of
/// every column block). The fences keep O's rescale and P's packing before the MMAs.
template <bool VB, int D>
__device__ __forceinline__ void wg_pv_issue(float (&o)[D / 8][4], uint32_t (&pa)[8][2],
                                            uint32_t v_lo) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int j = 0; j < 8; ++j) fence_operand(pa[j][0]), fence_operand(pa[j][1]);
  wgmma_fence();
#pragma unroll
  for (int ks2 = 0; ks2 < 4; ++ks2) {
    const uint32_t a[4] = {pa[2 * ks2][0], pa[2 * ks2][1], pa[2 * ks2 + 1][0], pa[2 * ks2 + 1][1]};
    const uint64_t desc = b128_desc_at(v_lo, ks2 * 2048);
    if constexpr (D == 128) wgmma_m64n128k16<VB, 1>(o, a, desc, 1);
    else wgmma_m64n64k16<VB, 1>(o, a, desc, 1);
  }
  wgmma_commit();
}
/// Wait until at most N committed groups of this warpgroup's MMAs are in flight; the fences keep
/// every use of o and pa after the wait.
template <int N, int D>
__device__ __forceinline__ void wg_pv_wait(float (&o)[D / 8][4], uint32_t (&pa)[8][2]) {
  wgmma_wait<N>();
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int j = 0; j < 8; ++j) fence_operand(pa[j][0]), fence_operand(pa[j][1]);
}
/// O += P V, waited.
template <bool VB, int D>
__device__ __forceinline__ void wg_pv(float (&o)[D / 8][4], uint32_t (&pa)[8][2], uint32_t v_lo) {
  wg_pv_issue<VB, D>(o, pa, v_lo);
  wg_pv_wait<0, D>(o, pa);
}
#endif

/// Pool offset of block `entry`'s section, or -1 (and `*fault`) for an id outside the pool.
__device__ __forceinline__ int64_t block_offset(const Params &p, int entry, bool *fault) {
  if (entry >= 0 && (int64_t)entry < p.num_blocks) return (int64_t)entry * p.block_stride;
  *fault = true;
  return -1;
}

/// A side's per-head scale (FP8), or 1 for formats without one (null scales).
__device__ __forceinline__ float head_factor(const float *scales, int kvh) {
  return scales != nullptr ? scales[kvh] : 1.f;
}

#if KVQ_HAS_WGMMA
/// Wait for every committed MMA group; the fences keep every use of s after the wait.
__device__ __forceinline__ void wg_wait_committed(float (&s)[8][4]) {
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) fence_operand(s[j][e]);
}
/// Commit and wait for a warpgroup's S MMAs.
__device__ __forceinline__ void wg_wait_scores(float (&s)[8][4]) {
  wgmma_commit();
  wg_wait_committed(s);
}

/// S = Q K^T on a warpgroup, waited (kWait false: committed, not waited; the caller waits,
/// wg_wait_committed): Q from this thread's A fragments qf (held in registers), K the operand
/// tile whose descriptor's low word is k_lo (b128_desc_lo; K-major: 64-column block kk / 4 of
/// the rows, 32 bytes per k-step within it).
template <bool KB, int D, bool kWait = true>
__device__ __forceinline__ void wg_qk(float (&s)[8][4], const uint32_t (&qf)[D / 16][4],
                                      uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t kd = b128_desc_at(k_lo, (kk / 4) * (kTokens * 128) + (kk % 4) * 32);
    wgmma_m64n64k16<KB, 0>(s, qf[kk], kd, kk > 0);
  }
  if constexpr (kWait) wg_wait_scores(s);
  else wgmma_commit();
}

/// The same with Q read from the Q tile (R rows, B128) by descriptor: q_lo is the low word of
/// the descriptor of this warpgroup's 64 rows (column blocks R * 128 bytes apart).
template <bool KB, int D, int R, bool kWait = true>
__device__ __forceinline__ void wg_qk_ss(float (&s)[8][4], uint32_t q_lo, uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t kd = b128_desc_at(k_lo, (kk / 4) * (kTokens * 128) + (kk % 4) * 32);
    const uint64_t qd = b128_desc_at(q_lo, (kk / 4) * (R * 128) + (kk % 4) * 32);
    wgmma_m64n64k16_ss<KB>(s, qd, kd, kk > 0);
  }
  if constexpr (kWait) wg_wait_scores(s);
  else wgmma_commit();
}
#endif

// ---- E4M3 operands (the E4M3 instances: an fp8-e4m3 cache on FP8 tensor cores, opt-in). The
// codes go to the MMAs as stored; the query rows and the probabilities become E4M3 too (the
// accuracy this costs: docs/ACCURACY.md). A query row is quantized under its own scale, amax /
// 448 (FORMATS.md's E4M3 calibration), which multiplies its scores; a probability p is taken
// as the E4M3 of p * 2^8, which keeps the largest in E4M3's normal range.
//
// The k32 MMAs take both operands K-major (prim/wgmma.cuh). K's rows are: a B128 tile of
// kTokens rows of 128 codes. For O += P V the keys are the reduction, so V goes transposed into
// a B64 tile: row d holds channel d of the step's 64 keys. P comes from the S accumulators,
// where thread t holds keys 8 j + 2 (t % 4) + {0, 1}, while an A fragment's byte i of register
// 0 / 2 is key position 4 (t % 4) + i (+ 16): the keys' order is free in a sum, so V's row
// takes, at position 4 m + i of each 16, key 2 m + {0, 1, 8, 9}[i] of those 16: P's registers
// are then A fragments as they stand, after one byte permute per pair.

/// Four words as their 4 x 4 byte transpose: out[b] holds byte b of a, b, c, d (low to high).
__device__ __forceinline__ void transpose_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d,
                                                uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410), out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410), out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

/// stage_e4m3's work. ALL: every row of the step lies in [lo, hi), as in all but a sequence's
/// first and last steps, so that no row is tested.
template <int NP, bool ALL>
__device__ __forceinline__ void stage_e4m3_rows(const uint8_t *rk, const uint8_t *rv, int run,
                                                uint8_t *kt, uint8_t *vt, int lo, int hi,
                                                unsigned pt) {
  const unsigned live = hi > lo ? (unsigned)(hi - lo) : 0u;
  // K: thread pt copies chunk pt % 8 of rows pt / 8 + i NP / 8, whose swizzle (row % 8) is the
  // same for every i, so that one address each side serves all of them.
  static_assert(NP % 64 == 0 && kTokens * 8 % NP == 0, "whole columns of chunks a thread");
  constexpr int kKUnits = kTokens * 8 / NP, kApart = NP / 8;
  static_assert(kApart % kRun == 0, "a thread's rows whole runs apart");
  const unsigned r0 = pt / 8, c = pt % 8;
  const uint8_t *const ksrc = rk + (r0 / kRun) * run + (r0 % kRun) * 128 + c * 16;
  uint8_t *const kdst = kt + b128_at<kTokens>(r0, c);
  uint4 kx[kKUnits];
#pragma unroll
  for (int i = 0; i < kKUnits; ++i) {
    kx[i] = make_uint4(0, 0, 0, 0);
    if (ALL || r0 + i * kApart - lo < live)
      kx[i] = *reinterpret_cast<const uint4 *>(ksrc + i * (kApart / kRun) * run);
  }
#pragma unroll
  for (int i = 0; i < kKUnits; ++i)
    *reinterpret_cast<uint4 *>(kdst + i * kApart * 128) = kx[i];
  // V: keys 16 q .. 16 q + 15 of channels 4 w .. 4 w + 3 a thread (a warp reads whole rows).
  constexpr int kVUnits = kTokens / 16 * (kWsD / 4);
  static_assert(kVUnits <= NP, "a V unit a producer thread");
  if (pt < kVUnits) {
    const unsigned q = pt / 32, w = pt % 32;
    static_assert(kRun == 16, "a V unit's keys one run");
    const uint8_t *const vsrc = rv + q * run + 4 * w;
    uint32_t x[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      x[k] = 0u;
      if (ALL || 16 * q + k - lo < live)
        x[k] = *reinterpret_cast<const uint32_t *>(vsrc + k * 128);
    }
    uint32_t t[4][4];  // [m][b]: positions 4 m .. 4 m + 3 of channel 4 w + b
#pragma unroll
    for (int m = 0; m < 4; ++m)
      transpose_bytes(x[2 * m], x[2 * m + 1], x[2 * m + 8], x[2 * m + 9], t[m]);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const unsigned d = 4 * w + b;
      *reinterpret_cast<uint4 *>(vt + d * 64 + ((q ^ ((d >> 1) & 3)) << 4)) =
          make_uint4(t[0][b], t[1][b], t[2][b], t[3][b]);
    }
  }
}

/// One step's raw E4M3 rows (kTokens rows of kWsD codes each side, staging rows as the pool
/// holds them, run r of a side `run` bytes after its run 0) into the operand tiles: K's rows
/// into B128 tile kt, V's transposed into B64 tile vt (in the key order above); rows outside
/// [lo, hi) as zeros (staging rows there may hold anything, NaN codes included). Thread pt of
/// NP.
template <int NP>
__device__ __forceinline__ void stage_e4m3(const uint8_t *rk, const uint8_t *rv, int run,
                                           uint8_t *kt, uint8_t *vt, int lo, int hi,
                                           unsigned pt) {
  static_assert(kWsD == 128 && kTokens == 64, "128 codes a row, 64 keys a step");
  if (lo <= 0 && hi >= kTokens) stage_e4m3_rows<NP, true>(rk, rv, run, kt, vt, lo, hi, pt);
  else stage_e4m3_rows<NP, false>(rk, rv, run, kt, vt, lo, hi, pt);
}

/// This thread's Q fragments for S's k32 steps (rows ra = 16 cw + lane / 4 and rb = ra + 8 of
/// the Q tile, 16-bit B128), each row quantized to E4M3 under its own scale; *scale_a / *scale_b
/// get the two rows' scales.
template <int R>
__device__ __forceinline__ void e4m3_q_fragments(const uint8_t *qs, int cw, bool q_bf16,
                                                 uint32_t (&qf)[kWsD / 32][4], float *scale_a,
                                                 float *scale_b) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float x[2][kWsD / 32][2][4];  // row a / b, k-step, its half, element
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < kWsD / 32; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Elements 32 c + 16 h + 4 t .. + 3: half of a 16-byte chunk.
        const uint2 w = *reinterpret_cast<const uint2 *>(
            qs + b128_at<R>(cw * 16 + g + 8 * r, 4 * c + 2 * h + t / 2) + (t % 2) * 8);
        const uint32_t half_bits[4] = {w.x & 0xFFFFu, w.x >> 16, w.y & 0xFFFFu, w.y >> 16};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = q_bf16 ? bf16_from_bits((uint16_t)half_bits[e])
                                 : half_from_bits((uint16_t)half_bits[e]);
          x[r][c][h][e] = v;
          amax[r] = fmaxf(amax[r], fabsf(v));
        }
      }
  float scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFull, amax[r], 1));
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFull, amax[r], 2));
    scale[r] = fp8_scale_from_amax<kFp8E4m3>(amax[r]);
  }
#pragma unroll
  for (int c = 0; c < kWsD / 32; ++c)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float *v = x[r][c][h];
        const uint32_t lo = fp8x2_encode<kFp8E4m3>(
            make_float2(__fdiv_rn(v[0], scale[r]), __fdiv_rn(v[1], scale[r])));
        const uint32_t hi = fp8x2_encode<kFp8E4m3>(
            make_float2(__fdiv_rn(v[2], scale[r]), __fdiv_rn(v[3], scale[r])));
        qf[c][r + 2 * h] = lo | hi << 16;
      }
  *scale_a = scale[0], *scale_b = scale[1];
}

#if KVQ_HAS_WGMMA
/// S = Q K^T on a warpgroup from E4M3 operands, waited: Q's fragments qf, K the B128 tile whose
/// descriptor's low word is k_lo (32 codes per k-step).
__device__ __forceinline__ void wg_qk_e4m3(float (&s)[8][4], const uint32_t (&qf)[kWsD / 32][4],
                                           uint32_t k_lo) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kWsD / 32; ++kk)
    wgmma_m64n64k32_e4m3(s, qf[kk], b128_desc_at(k_lo, kk * 32), kk > 0);
  wg_wait_scores(s);
}

/// O += P V on a warpgroup from E4M3 operands, waited: P from this thread's E4M3 pairs (n-tile
/// j, rows a / b: WarpSoftmax's pa), V^T the B64 tile at shared address vt.
__device__ __forceinline__ void wg_pv_e4m3(float (&o)[kWsD / 8][4], const uint32_t (&pa)[8][2],
                                           uint32_t vt) {
#pragma unroll
  for (int i = 0; i < kWsD / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
  // The A fragments of the two k32 steps: a register is two of pa's pairs.
  uint32_t a[kTokens / 32][4];
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c) {
    a[c][0] = __byte_perm(pa[4 * c][0], pa[4 * c + 1][0], 0x5410);
    a[c][1] = __byte_perm(pa[4 * c][1], pa[4 * c + 1][1], 0x5410);
    a[c][2] = __byte_perm(pa[4 * c + 2][0], pa[4 * c + 3][0], 0x5410);
    a[c][3] = __byte_perm(pa[4 * c + 2][1], pa[4 * c + 3][1], 0x5410);
  }
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c)
    for (int e = 0; e < 4; ++e) fence_operand(a[c][e]);
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c) wgmma_m64n128k32_e4m3(o, a[c], b64_desc(vt + c * 32), 1);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kWsD / 8; ++i)
    for (int e = 0; e < 4; ++e) fence_operand(o[i][e]);
#pragma unroll
  for (int c = 0; c < kTokens / 32; ++c)
    for (int e = 0; e < 4; ++e) fence_operand(a[c][e]);
}
#endif

/// The first 1024-byte boundary at or after the dynamic shared memory's start (B128 tiles).
__device__ __forceinline__ uint8_t *align1024(uint8_t *raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

/// KC: the instance for int4-kc keys (f16 operands), whatever p.k says; the other instances
/// carry none of its code.
template <int D, bool KB, bool VB, int R, bool KC = false>
__global__ void __launch_bounds__(threads_of<R>()) prefill_kernel(const Params p) {
  static_assert(!(KC && KB), "int4-kc keys decode to f16 operands");
  constexpr int kThreads = threads_of<R>(), kWarps = kThreads / 32;
  constexpr int P = pitch<D>();
  constexpr int TILE = kTokens * P;
  // Pipelined (decode a step ahead) up to head_dim 128; wider rows decode between two barriers.
  constexpr bool PIPE = pipelined(D);
  constexpr bool QREG = q_in_registers<D, R>();
  // wgmma (a warpgroup per 64 rows) on B128 tiles, else mma.sync per warp on padded rows.
  constexpr bool WG = uses_wgmma<D>();
  static_assert(!WG || (kTokens == 64 && R % 64 == 0), "warpgroups of 64 rows, 64-token steps");
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t *const smem = align1024(smem_raw);
  __shared__ RowInfo<R> rw;

  TileJob job;
  if (!begin_tile<R, kThreads>(p, rw, job)) return;
  const int kvh = job.kvh, len = job.len;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const bool k_direct = !KC && p.k.direct, v_direct = p.v.direct;
  const Layout L = smem_layout<D, R>(p.k, p.v);
  uint8_t *qs = smem + L.q;

  // ---- Q tile: commit group 1 of 3.
  load_q<D, R, WG, kThreads>(p, job, qs);
  __syncthreads();  // row bounds

  int kv_lo, kv_hi;
  tile_keys(rw, &kv_lo, &kv_hi);
  const int base = kv_hi > kv_lo ? kv_lo / kRun * kRun : 0;
  const int nsteps = kv_hi > kv_lo ? (kv_hi - base + kTokens - 1) / kTokens : 0;

  const uint8_t *head = p.pool + (int64_t)kvh * p.head_stride;
  const int32_t *table = p.block_tables + (int64_t)job.b * p.max_blocks;
  bool fault = false;
  // Step s's operand tile and (quantized side) staging area of each side.
  auto k_op = [&](int s) {
    return smem + L.k_op + ((k_direct || PIPE) ? (s & 1) * TILE : 0);
  };
  auto v_op = [&](int s) {
    return smem + L.v_op + ((v_direct || PIPE) ? (s & 1) * TILE : 0);
  };
  auto k_stage = [&](int s) { return smem + L.k_stage + (s & 1) * stage_bytes(p.k); };
  auto v_stage = [&](int s) { return smem + L.v_stage + (s & 1) * stage_bytes(p.v); };
  // Page offsets of step s, found by threads 0..3 three steps ahead into set s % 4 and read
  // after the next barrier (a direct side's copies are queued one step ahead, a quantized
  // side's two on the pipelined schedule).
  __shared__ StepPages pages[4];
  auto find_pages = [&](int st) {
    if (tid < kTokens / kRun && st < nsteps) {
      const int tok = base + st * kTokens + tid * kRun;
      int64_t at = -1;
      int32_t off = 0;
      if (tok < kv_hi) {
        const int page = (int)p.block_div.div((uint32_t)tok);
        off = tok - page * p.block_size;
        at = block_offset(p, table[page], &fault);
      }
      pages[st & 3].at[tid] = at;
      pages[st & 3].off[tid] = off;
    }
  };
  // Queue the copies of direct sides for step ds and of quantized sides for step rs (steps
  // past the last are skipped), as one commit group.
  auto issue = [&](int ds, int rs) {
    const int d_hi = kv_hi - (base + ds * kTokens), r_hi = kv_hi - (base + rs * kTokens);
    const int r_runs = min(kTokens / kRun, (r_hi + kRun - 1) / kRun);
    if (k_direct) {
      if (ds < nsteps)
        issue_direct<D, WG, kThreads>(head, p.k.codes_off, pages[ds & 3], d_hi, k_op(ds));
    } else if (rs < nsteps) {
      if constexpr (KC) {
        const int sealed_runs = (kc_sealed_end(len, p.block_size) - (base + rs * kTokens)) / kRun;
        issue_kc<D, kThreads>(p.k, head, pages[rs & 3], min(r_runs, sealed_runs), k_stage(rs));
      } else {
        issue_raw<kThreads>(p.k, head, pages[rs & 3], r_runs, k_stage(rs));
      }
    }
    if (v_direct) {
      if (ds < nsteps)
        issue_direct<D, WG, kThreads>(head, p.v.codes_off, pages[ds & 3], d_hi, v_op(ds));
    } else if (rs < nsteps) {
      issue_raw<kThreads>(p.v, head, pages[rs & 3], r_runs, v_stage(rs));
    }
    cp_async_commit();
  };
  // Decode the quantized sides of step s from their staging areas into their operand tiles.
  auto decode_step = [&](int s) {
    if (s >= nsteps) return;
    const int tok0 = base + s * kTokens;
    const int lo = max(kv_lo, tok0) - tok0, hi = min(kv_hi, tok0 + kTokens) - tok0;
    if (!k_direct) {
      const uint8_t *raw = k_stage(s);
      if constexpr (KC)
        decode_kc<D, WG, kThreads>(raw, p.k, head, pages[s & 3], k_op(s), lo, hi,
                                   kc_sealed_end(len, p.block_size) - tok0);
      else
        decode_any<KB, D, WG, kThreads, false>(side_major(raw, p.k), nullptr, p.k, k_op(s), lo,
                                               hi);
    }
    if (!v_direct) {
      const uint8_t *raw = v_stage(s);
      decode_any<VB, D, WG, kThreads, false>(side_major(raw, p.v), nullptr, p.v, v_op(s), lo,
                                             hi);
    }
  };
  find_pages(0);
  find_pages(1);
  find_pages(2);
  __syncthreads();
  issue(0, 0);                 // group 2
  issue(nsteps, PIPE ? 1 : nsteps);  // group 3 (empty off the pipelined schedule)

  cp_async_wait<2>();  // the Q tile
  __syncthreads();
  if (p.q_bf16 && !KB) {
    scale_q<D, R, WG>(qs, rw, warp, kWarps);
    __syncthreads();
  }

  const float k_factor = head_factor(p.k_scales, kvh), v_factor = head_factor(p.v_scales, kvh);
  WarpSoftmax<R> sm(p, rw, warp, k_factor);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  // ldmatrix row addresses of this lane: Q (A operand) rows warp*16 + lane % 16, column half
  // lane / 16; K (B operand, two n-tiles) token (lane / 16) * 8 + lane % 8, column half
  // (lane / 8) % 2; V (transposed B) token lane % 8 + ((lane / 8) % 2) * 8, column half lane / 16.
  const uint32_t q_addr = smem_u32(qs) + (warp * 16 + lane % 16) * P + (lane / 16) * 16;
  const uint32_t k_lane = ((lane / 16) * 8 + lane % 8) * P + ((lane / 8) % 2) * 16;
  const uint32_t v_lane = (lane % 8 + ((lane / 8) % 2) * 8) * P + (lane / 16) * 16;
  uint32_t qf[QREG ? D / 16 : 1][4];
  // Q fragment kk of this warp (A operand): in the B128 tile, chunk 2 kk + lane / 16 of row
  // warp * 16 + lane % 16.
  auto q_frag = [&](int kk, uint32_t(&a)[4]) {
    if constexpr (WG)
      ldmatrix_x4(smem_u32(qs) + tile_at<D, true, R>(warp * 16 + lane % 16, 2 * kk + lane / 16),
                  a);
    else ldmatrix_x4(q_addr + kk * 32, a);
  };
  if constexpr (QREG) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) q_frag(kk, qf[kk]);
  }
  if (PIPE) {
    cp_async_wait<1>();  // step 0
    __syncthreads();
    decode_step(0);
  }

#pragma unroll 1
  for (int st = 0; st < nsteps; ++st) {
    const int tok0 = base + st * kTokens;
    cp_async_wait<0>();
#if KVQ_HAS_WGMMA
    if constexpr (WG) fence_proxy_async();  // this thread's copies and decoded rows, for wgmma
#endif
    // Step st is in (and, pipelined, decoded); every warp is done with step st - 1's tiles.
    __syncthreads();
    issue(st + 1, st + (PIPE ? 2 : 1));
    find_pages(st + 3);  // set (st - 1) % 4: read by the copies queued before this barrier
    if (PIPE) {
      decode_step(st + 1);  // into the tiles step st - 1 used; read after the next barrier
    } else if (!k_direct || !v_direct) {
      decode_step(st);
      // int4-kc: the open block's rows it copied (the next step's copies wait with them).
      if constexpr (KC)
        if (kc_sealed_end(len, p.block_size) < min(kv_hi, tok0 + kTokens)) cp_async_wait<0>();
      __syncthreads();
    }
    // No key of this step for the warp: skipped, but the warpgroup's MMAs take every warp.
    if (!WG && (tok0 >= sm.w_hi || tok0 + kTokens <= sm.w_lo)) continue;
    const uint32_t ks_u = smem_u32(k_op(st)) + k_lane;
    const uint32_t vs_u = smem_u32(v_op(st)) + v_lane;

    // S = Q K^T: 16 rows x 64 tokens (8 n-tiles of 8 tokens) a warp.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#if KVQ_HAS_WGMMA
    if constexpr (WG) {
      // K-major A and B: 64-column block kk / 4 of the rows, 32 bytes per k-step within it; A
      // is this warpgroup's 64 rows of the Q tile (or, held, its registers).
      const uint32_t kt = smem_u32(k_op(st)), qt = smem_u32(qs) + (warp / 4) * 64 * 128;
      if constexpr (QREG) {
        wg_qk<KB, D>(s, qf, b128_desc_lo(kt, 8192));
      } else {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint64_t kd = b128_desc(kt + (kk / 4) * (kTokens * 128) + (kk % 4) * 32, 8192);
          const uint64_t qd = b128_desc(qt + (kk / 4) * (R * 128) + (kk % 4) * 32, R * 128);
          wgmma_m64n64k16_ss<KB>(s, qd, kd, kk > 0);
        }
        wg_wait_scores(s);
      }
    }
#endif
#pragma unroll
    for (int kk = 0; kk < (WG ? 0 : D / 16); ++kk) {
      uint32_t a[4];
      if constexpr (QREG) {
        a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
      } else {
        q_frag(kk, a);
      }
      const uint4 av = make_uint4(a[0], a[1], a[2], a[3]);
#pragma unroll
      for (int j2 = 0; j2 < 4; ++j2) {
        uint32_t bk[4];
        ldmatrix_x4(ks_u + j2 * 16 * P + kk * 32, bk);
        mma16816<KB>(s[2 * j2], av, bk[0], bk[1]);
        mma16816<KB>(s[2 * j2 + 1], av, bk[2], bk[3]);
      }
    }

    uint32_t pa[8][2];  // P as A operands: n-tile j, rows a (0) / b (1), tokens 2t, 2t + 1
    sm.template step<VB, D>(s, tok0, o, pa);

    // O += P V: per 16 tokens, A = P (n-tiles 2ks, 2ks + 1), B = V^T by transposed ldmatrix
    // (or, wgmma, an N-major B: 16 keys are 2048 bytes of every column block).
#if KVQ_HAS_WGMMA
    if constexpr (WG) wg_pv<VB, D>(o, pa, b128_desc_lo(smem_u32(v_op(st)), 8192));
#endif
#pragma unroll
    for (int ks2 = 0; ks2 < (WG ? 0 : 4); ++ks2) {
      const uint4 av = make_uint4(pa[2 * ks2][0], pa[2 * ks2][1], pa[2 * ks2 + 1][0],
                                  pa[2 * ks2 + 1][1]);
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(vs_u + ks2 * 16 * P + d2 * 32, bv);
        mma16816<VB>(o[2 * d2], av, bv[0], bv[1]);
        mma16816<VB>(o[2 * d2 + 1], av, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();

  // One count per thread block that met a fault.
  if (__syncthreads_or(fault || job.bad_len) && tid == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);

  sm.template finish<D>(p, job, o, v_factor);
}

// ---- Warp-specialized tiles (sm_90a, head_dim 128; sides both stored as their 16-bit operands
// or both quantized; wide and narrow tiles, and triple ones but for E4M3 operands). Producer
// warps fill a ring of stages with each step's K and V operand tiles — copied, or for quantized
// sides copied raw into a staging area steps ahead and decoded by the producers — and hand every
// stage over through an mbarrier; a consumer warpgroup per 64 rows (Q fragments held in
// registers, or at triple tiles, whose consumers have 144-152 registers, read from the Q tile
// by descriptor) runs S = Q K^T, the softmax and O += P V from the ring and gives each stage
// back through a second mbarrier. No block-wide barrier is left in the loop, so one consumer
// warpgroup's softmax runs beside another's MMAs (of the block, or of the SM's other block at
// narrow tiles), and the copies and the decode run ahead of them.

/// Threads of a warp-specialized block: a consumer warpgroup per 64 of its R rows, then its
/// producer threads: one warpgroup, or for quantized sides at wide tiles kWsQuantProducers (the
/// decode is most of a producer's work; narrow tiles share an SM, and its registers, with
/// another block).
constexpr int kWsQuantProducers = 256;
__host__ __device__ constexpr int ws_producers(bool quant, int r) {
  return quant && r == kWideRows ? kWsQuantProducers : 128;
}
__host__ __device__ constexpr int ws_threads(bool quant, int r) {
  return ws_producers(quant, r) + 2 * r;
}
/// Blocks an SM holds: wide and triple tiles one (two or three consumer warpgroups), narrow
/// tiles two, so that an SM still has two consumer warpgroups.
__host__ __device__ constexpr int ws_blocks_per_sm(int r) { return r == kRows ? 2 : 1; }
/// Stages of the ring: what fits the blocks an SM holds.
__host__ __device__ constexpr int ws_stages(int r) { return r == kRows ? 2 : 4; }
/// Steps whose copies a producer thread keeps in flight before handing the oldest over (16-bit
/// sides): at most three, at most the stages.
__host__ __device__ constexpr int ws_in_flight(int r) {
  return ws_stages(r) < 3 ? ws_stages(r) : 3;
}
/// Quantized sides: steps whose raw rows are in flight ahead of the one being decoded (the
/// kernel's A), in a ring of A + 1 staging areas (the step being decoded holds one). Decoded
/// sides at wide tiles take kWsRawDeep where the layout fits the block (INT4: 3-4 % faster than
/// one step ahead on an H100; FP8's does not fit, and was level at two), else one; narrow tiles
/// (two blocks an SM) and E4M3 operands one.
constexpr int kWsRawDeep = 3;

/// Bytes of one operand tile of the ring: kTokens rows of kWsD 16-bit operands, or of E4M3 codes
/// (the E4M3 instances).
__host__ __device__ constexpr int ws_tile_bytes(bool e4m3) {
  return kTokens * kWsD * (e4m3 ? 1 : 2);
}

/// Where the warp-specialized kernel's dynamic shared memory goes (offsets from its first
/// 1024-byte boundary; `bytes` has room for the alignment): the Q tile, the ring's K and V
/// operand tiles (B128) per stage, for quantized sides `ahead` + 1 staging areas of raw rows
/// and the zero row. Quantized sides at narrow tiles (two blocks an SM) put the Q tile over the
/// staging areas from the second on: the consumers hold Q in registers before the producers
/// first copy there (the kernel's q_free).
struct WsLayout {
  int q, ring, raw, slot, zero, bytes;
};
__host__ __device__ inline WsLayout ws_layout(const Side &k, const Side &v, int r, int ahead,
                                              bool e4m3 = false) {
  const bool quant = !k.direct, q_over_raw = quant && r == kRows;
  const int q_bytes = r * kWsD * 2;
  WsLayout l;
  l.slot = quant ? stage_bytes(k) + stage_bytes(v) : 0;
  l.ring = q_over_raw ? 0 : q_bytes;
  l.raw = l.ring + ws_stages(r) * 2 * ws_tile_bytes(e4m3);
  l.q = q_over_raw ? l.raw + l.slot : 0;
  int staging = quant ? (ahead + 1) * l.slot : 0;
  if (q_over_raw && staging < l.slot + q_bytes) staging = l.slot + q_bytes;
  l.zero = l.raw + staging;
  l.bytes = l.zero + (quant ? kZeroRow : 0) + 1024;
  return l;
}
/// Whether the warp-specialized kernel serves a pair of sides: both 16-bit (one operand type)
/// or both quantized (f16 operands); int4-kc keys and mixed pairs take the block-synchronous
/// one.
__host__ __device__ inline bool ws_sides(const Side &k, const Side &v, bool kb, bool vb) {
  return kb == vb && k.direct == v.direct && k.format != KVQ_INT4_KC;
}

/// QUANT: both sides quantized (decoded by the producer into f16 operands), else both 16-bit.
/// R: the tile's query rows (kWideRows or kRows). A: quantized sides' raw steps in flight ahead
/// of the one being decoded (kWsRawDeep or 1). E4M3: both sides fp8-e4m3, their codes the MMAs'
/// operands (the producers copy K's and transpose V's; the consumers quantize Q and P).
template <bool KB, bool VB, bool QUANT, int R, int A, bool E4M3 = false>
__global__ void __launch_bounds__(ws_threads(QUANT, R), ws_blocks_per_sm(R))
    prefill_ws_kernel(const Params p) {
  static_assert(!QUANT || (!KB && !VB), "quantized sides decode to f16 operands");
  static_assert(!E4M3 || QUANT, "E4M3 operands are a quantized cache's");
  static_assert(R == kWideRows || R == kRows || (R == kTripleRows && !E4M3 && A == 1),
                "wide or narrow tiles, or triple tiles of decoded sides");
#if KVQ_HAS_WGMMA
  // Registers of a producer and a consumer thread (setmaxnreg). The block's pool is what it
  // launched with (kLaunchRegs a thread, from the launch bound): a consumer's increase waits
  // until the producers' decrease covers it, so the two must fit in it.
  constexpr int NP = ws_producers(QUANT, R), NC = 2 * R, kThreads = ws_threads(QUANT, R);
  constexpr int kLaunchRegs = 65536 / (kThreads * ws_blocks_per_sm(R)) / 8 * 8;
  // Decoded sides' producers: narrow tiles 88 (80 spilled in the decode of run-major staging);
  // triple tiles 80 (their consumers get 144 either way); wide tiles 80 where the raw rows are
  // kWsRawDeep steps ahead (INT4: 64 spilled ~8 registers a step; 80 measured 3-4 % faster on
  // 4k prompts), else 64 (decoded FP8: its consumers lost 4-8 % at 176 registers).
  constexpr int kProducerRegs =
      !QUANT ? 56 : R == kRows ? 88 : (R == kTripleRows || A > 1) ? 80 : 64;
  constexpr int kPoolLeft = (kThreads * kLaunchRegs - NP * kProducerRegs) / NC / 8 * 8;
  constexpr int kConsumerRegs = kPoolLeft < 224 ? kPoolLeft : 224;
  static_assert(NP * kProducerRegs + NC * kConsumerRegs <= kThreads * kLaunchRegs,
                "register pool");
  constexpr int D = kWsD, S = ws_stages(R), kInFlight = ws_in_flight(R);
  static_assert(kInFlight <= S, "in-flight steps hold stages");
  constexpr int TILE = ws_tile_bytes(E4M3);
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t *const smem = align1024(smem_raw);
  __shared__ RowInfo<R> rw;
  __shared__ uint64_t full[S], empty[S];  // stage landed (producer threads), consumed (consumers)
  // Quantized sides: a staging area's raw rows landed (the copying lanes and their bytes),
  // decoded (every producer thread).
  constexpr int kRawSlots = A + 1;
  __shared__ uint64_t raw_full[kRawSlots], raw_free[kRawSlots];
  // Quantized sides at narrow tiles: the consumers hold Q in registers (the Q tile lies over the
  // staging areas from the second on).
  __shared__ uint64_t q_free;
  // The split merge (prefill.cu) may launch now: it waits for this grid before its reads, and
  // its blocks take the SMs this grid's blocks leave.
  allow_dependent_launch();

  TileJob job;
  if (!begin_tile<R, kThreads>(p, rw, job)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const WsLayout L = ws_layout(p.k, p.v, R, A, E4M3);
  constexpr bool kQOverRaw = QUANT && R == kRows;
  // Triple tiles' consumers have 144-152 registers: Q stays in its tile, read by descriptor.
  constexpr bool kQHeld = R != kTripleRows;
  uint8_t *const qs = smem + L.q;
  auto k_op = [&](int s) { return smem + L.ring + s * 2 * TILE; };
  auto v_op = [&](int s) { return k_op(s) + TILE; };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], NP), mbar_init(&empty[s], NC);
#pragma unroll
    for (int s = 0; s < kRawSlots; ++s)
      mbar_init(&raw_full[s], kTokens / kRun), mbar_init(&raw_free[s], NP);
    mbar_init(&q_free, NC);
    fence_mbarrier_init();
  }
  load_q<D, R, true, kThreads>(p, job, qs);
  // Quantized sides: the zero row after the staging areas, stored before the barrier below.
  uint8_t *const zero_row = smem + L.zero;
  if (QUANT && tid < kZeroRow / 16)
    reinterpret_cast<uint4 *>(zero_row)[tid] = make_uint4(0, 0, 0, 0);
  cp_async_wait<0>();
  __syncthreads();  // row bounds, the barriers, the Q tile
  if (p.q_bf16 && !KB && !E4M3) {  // (E4M3 quantizes either query type as it is)
    scale_q<D, R, true>(qs, rw, warp, kThreads / 32);
    __syncthreads();
  }

  int kv_lo, kv_hi;
  tile_keys(rw, &kv_lo, &kv_hi);
  const int base = kv_hi > kv_lo ? kv_lo / kRun * kRun : 0;
  const int nsteps = kv_hi > kv_lo ? (kv_hi - base + kTokens - 1) / kTokens : 0;
  bool fault = false;

  // The consumer warps come first (warps 0 .. NC / 32 - 1), the producers after them: quantized
  // sides measured 0.5-1.5 % faster so than the other way round, 16-bit ones level.
  if (warp >= NC / 32) {
    // ---- Producers. A step's four runs are looked up by four threads, each run's table entry
    // loaded ahead so that the load's latency hides behind copies: for 16-bit sides lane r of
    // every producer warp, one step ahead (the warp shares the four by shuffles); for quantized
    // sides the threads that copy the runs' raw rows: lane 0 of producer warp r, every step, or
    // with `p.ws_turns` lane r of warp j % kPW for step j, kPW steps ahead, so that each warp
    // issues one step's copies in kPW (a bulk copy's issue, ~40 instructions, is its warp's
    // serial work beside the decode all producers share; Launch decides which pays).
    setmaxnreg_dec<kProducerRegs>();
    const uint8_t *head = p.pool + (int64_t)job.kvh * p.head_stride;
    const int32_t *table = p.block_tables + (int64_t)job.b * p.max_blocks;
    const int pw = warp - NC / 32;  // the producer warp
    constexpr int kPW = NP / 32;     // producer warps
    static_assert(kTokens / kRun <= 32 && kTokens / kRun <= kPW, "a run a lane, or a warp");
    const bool turns = QUANT && p.ws_turns != 0;
    const int my_run = QUANT && !turns ? pw : lane;
    const bool looks_up =
        QUANT && !turns ? lane == 0 && pw < kTokens / kRun : lane < kTokens / kRun;
    const int issue_apart = turns ? kPW : 1;  // steps between two a warp copies
    bool live = false;       // this thread's run of the looked-up step lies before kv_hi
    int entry = 0, off = 0;  // its table entry and first row within its page
    auto load_entry = [&](int st) {
      const int tok = base + st * kTokens + my_run * kRun;
      live = looks_up && st < nsteps && tok < kv_hi;
      if (live) {
        const int page = (int)p.block_div.div((uint32_t)tok);
        off = tok - page * p.block_size;
        entry = __ldg(table + page);
      }
    };
    // This thread's run of the step whose entries were loaded last: its pool offset, or -1.
    auto run_offset = [&] { return live ? block_offset(p, entry, &fault) : int64_t{-1}; };
    // The pages of the step whose entries were loaded last.
    auto pages = [&] {
      const int64_t at = run_offset();
      StepPages pg;
#pragma unroll
      for (int r = 0; r < kTokens / kRun; ++r) {
        pg.at[r] = __shfl_sync(kFull, at, r);
        pg.off[r] = __shfl_sync(kFull, off, r);
      }
      return pg;
    };
    // Step j's operand tiles are written: make them visible to wgmma (async proxy) and hand
    // the stage over.
    auto hand_over = [&](int j) {
      fence_proxy_async();
      mbar_arrive(&full[j % S]);
    };
    load_entry(turns ? pw : 0);  // the first step this thread looks up
    if constexpr (!QUANT) {
#pragma unroll 1
      for (int st = 0; st < nsteps; ++st) {
        const int s = st % S;
        const StepPages pg = pages();
        load_entry(st + 1);
        if (st >= S) mbar_wait(&empty[s], (st / S + 1) & 1);  // step st - S consumed
        const int hi = kv_hi - (base + st * kTokens);
        issue_direct<D, true, 128>(head, p.k.codes_off, pg, hi, k_op(s));
        issue_direct<D, true, 128>(head, p.v.codes_off, pg, hi, v_op(s));
        cp_async_commit();
        if (st >= kInFlight - 1) {
          cp_async_wait<kInFlight - 1>();
          hand_over(st - (kInFlight - 1));
        }
      }
      // The last steps still in flight, oldest first.
      cp_async_wait<0>();
      for (int j = max(nsteps - (kInFlight - 1), 0); j < nsteps; ++j) hand_over(j);
    } else {
      // Quantized sides: the looking-up thread of run r of step j copies its raw rows (codes,
      // metadata; both sides) by bulk copies (one, of the page's head section, where
      // p.ws_whole_runs), A steps ahead, into run r of staging area j % (A + 1) (run-major,
      // p.ws_run: the area holds kTokens / kRun of them, stage_bytes(k) + stage_bytes(v)),
      // and arrives on its raw_full barrier expecting their bytes; every producer thread waits
      // there, decodes (or stages) the step into the stage's operand tiles, and gives the
      // staging area back (raw_free).
      const RunLayout &rl = p.ws_run;
      uint8_t *const raw0 = smem + L.raw;
      auto raw_k = [&](int j) { return raw0 + (j % kRawSlots) * L.slot; };
      auto staged_k = [&](const uint8_t *area) {
        return Staged{area + rl.k_codes, area + rl.k_meta, rl.bytes, rl.bytes};
      };
      auto staged_v = [&](const uint8_t *area) {
        return Staged{area + rl.v_codes, area + rl.v_meta, rl.bytes, rl.bytes};
      };
      auto issue_step = [&](int j) {
        if (!looks_up || j >= nsteps || (turns && j % kPW != pw)) return;
        // The Q tile lies over staging areas 1 on (as many as it spans): each one's first copy
        // waits until the consumers hold Q in registers (a completed phase: later waits pass).
        if (kQOverRaw && j >= 1 && j < kRawSlots) mbar_wait(&q_free, 0);
        const int slot = j % kRawSlots;
        if (j >= kRawSlots) mbar_wait(&raw_free[slot], (j / kRawSlots + 1) & 1);
        const bool run_live = live;
        const int run_off = off;
        const int64_t at = run_offset();
        load_entry(j + issue_apart);  // this thread's next step
        uint8_t *const run_at = raw_k(j) + my_run * rl.bytes;  // this run's raw rows
        if (run_live && at < 0) {
          // A block outside the pool (counted): its rows read as zeros, stored before this
          // lane's arrival releases them, and ordered before the bulk copies that later refill
          // the staging area.
          for (int x = 0; x < rl.bytes; x += 16)
            *reinterpret_cast<uint4 *>(run_at + x) = make_uint4(0, 0, 0, 0);
          fence_proxy_async();
        }
        mbar_arrive_expect_tx(&raw_full[slot], run_live && at >= 0 ? rl.bytes : 0);
        if (!run_live || at < 0) return;  // past the keys (never decoded), or zeros stored
        const uint8_t *sec = head + at;
        if (p.ws_whole_runs) {  // (the run is its whole page: run_off is 0)
          bulk_to_shared(run_at, sec, rl.bytes, &raw_full[slot]);
          return;
        }
        const Side *sides[2] = {&p.k, &p.v};
        const int to[2][2] = {{rl.k_codes, rl.k_meta}, {rl.v_codes, rl.v_meta}};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const Side &sd = *sides[i];
          bulk_to_shared(run_at + to[i][0], sec + sd.codes_off + run_off * sd.codes_row,
                         kRun * sd.codes_row, &raw_full[slot]);
          if (sd.meta_row > 0)
            bulk_to_shared(run_at + to[i][1], sec + sd.meta_off + run_off * sd.meta_row,
                           kRun * sd.meta_row, &raw_full[slot]);
        }
      };
#pragma unroll 1
      for (int j = 0; j < A; ++j) issue_step(j);
      // The steps, with the sides' decoders (E4M3: none, the codes staged as they are).
      auto steps = [&](auto decode_k, auto decode_v) __attribute__((always_inline)) {
#pragma unroll 1
        for (int st = 0; st < nsteps; ++st) {
          const int s = st % S, slot = st % kRawSlots;
          issue_step(st + A);
          __syncwarp();  // the copying lanes rejoin their warp before the decode
          mbar_wait(&raw_full[slot], (st / kRawSlots) & 1);  // step st's raw rows landed
          if (st >= S) mbar_wait(&empty[s], (st / S + 1) & 1);  // step st - S consumed
          const int tok0 = base + st * kTokens;
          const int lo = max(kv_lo, tok0) - tok0, hi = min(kv_hi, tok0 + kTokens) - tok0;
          const uint8_t *area = raw_k(st);
          if constexpr (E4M3) {
            stage_e4m3<NP>(area + rl.k_codes, area + rl.v_codes, rl.bytes, k_op(s), v_op(s),
                           lo, hi, (unsigned)(tid - NC));
          } else {
            decode_k(staged_k(area), k_op(s), lo, hi);
            decode_v(staged_v(area), v_op(s), lo, hi);
          }
          hand_over(st);
          mbar_arrive(&raw_free[slot]);  // this thread is done reading the staging area
        }
      };
      if constexpr (E4M3) steps(0, 0);
      else with_decoder_pair<D, NP>(AllFormats{}, p.k, p.v, zero_row, steps);
    }
  } else {
    // ---- Consumers: warpgroup c = warp / 4 serves rows 64 c .. 64 c + 63.
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = warp;  // the warp's 16 rows: 16 cw ..
    const float k_factor = head_factor(p.k_scales, job.kvh);
    const float v_factor = head_factor(p.v_scales, job.kvh);
    WarpSoftmax<R> sm(p, rw, cw, k_factor);
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    // The warp's Q fragments (A of S): 16-bit, chunk 2 kk + lane / 16; or E4M3 (k32 steps).
    uint32_t qf[E4M3 || !kQHeld ? 1 : D / 16][4], q8[E4M3 ? D / 32 : 1][4];
    if constexpr (E4M3) {
      float scale_a, scale_b;
      e4m3_q_fragments<R>(qs, cw, p.q_bf16 != 0, q8, &scale_a, &scale_b);
      sm.mul_a *= scale_a, sm.mul_b *= scale_b;  // the rows' scales multiply their scores
    } else if constexpr (kQHeld) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(smem_u32(qs) + tile_at<D, true, R>(cw * 16 + lane % 16, 2 * kk + lane / 16),
                    qf[kk]);
    }
    if constexpr (kQOverRaw) mbar_arrive(&q_free);  // the producers may copy over the Q tile
    // Addresses the loop would otherwise convert every step: stage s's barriers are 8 s bytes
    // past the first, its K tile's descriptor 2 TILE bytes past stage 0's, its V tile's TILE
    // past its K tile's.
    const uint32_t full0 = smem_u32(full), empty0 = smem_u32(empty);
    const uint32_t k_op0 = smem_u32(k_op(0)), k_lo0 = b128_desc_lo(k_op0, 8192);
    const uint32_t q_lo = b128_desc_lo(smem_u32(qs) + (cw / 4) * 64 * 128, R * 128);
    // The low descriptor word of step st's K tile (its V tile's is TILE >> 4 past it).
    auto k_lo_of = [&](int st) { return k_lo0 + (st % S) * (2 * TILE >> 4); };
    // 16-bit sides at triple tiles and decoded sides at wide tiles one raw step ahead (FP8 and
    // the other byte-wide formats): step st's P V stays in flight while step st + 1's S is
    // issued, so that the tensor cores run the two back to back; step st's stage is released
    // when its P V has completed. Measured on an H100 against waiting for each P V (session
    // 44): 1.4-2.4 % faster on bf16's prompts and chunks (triple tiles), 6.4 % on decoded FP8's
    // extend of 64 tokens (wide tiles); from 1.5 % faster to 10 % slower on the other instances
    // (16-bit sides at wide tiles, decoded ones at triple tiles or three raw steps ahead, E4M3
    // operands). Waiting for step st + 1 while holding step st's stage stalls no producer: their
    // rings of four stages hand step st + 1 over once step st - 1's stage is free. (Narrow
    // tiles' two stages would deadlock 16-bit sides, which hand a step over only after copying
    // the next.)
    constexpr bool kPvInFlight = (!QUANT && R == kTripleRows) ||
                                 (QUANT && !E4M3 && R == kWideRows && A == 1);
    if constexpr (kPvInFlight) {
      uint32_t pa[8][2];
      float sc[8][4];
      auto issue_scores = [&](int st) {  // S of step st, committed once the step has landed
        mbar_wait(full0 + 8 * (st % S), (st / S) & 1);
        if constexpr (kQHeld) wg_qk<KB, D, false>(sc, qf, k_lo_of(st));
        else wg_qk_ss<KB, D, R, false>(sc, q_lo, k_lo_of(st));
      };
      auto issue_pv = [&](int st) { wg_pv_issue<VB, D>(o, pa, k_lo_of(st) + (TILE >> 4)); };
      if (nsteps > 0) {
        issue_scores(0);
        wg_wait_committed(sc);
        sm.template step<VB, D>(sc, base, o, pa);
#pragma unroll 1
        for (int st = 0; st + 1 < nsteps; ++st) {
          issue_pv(st);
          issue_scores(st + 1);
          wg_pv_wait<1, D>(o, pa);  // step st's P V (step st + 1's S may still run)
          mbar_arrive(empty0 + 8 * (st % S));
          wg_wait_committed(sc);
          sm.template step<VB, D>(sc, base + (st + 1) * kTokens, o, pa);
        }
        issue_pv(nsteps - 1);
        wg_pv_wait<0, D>(o, pa);
      }
    } else {
#pragma unroll 1
      for (int st = 0; st < nsteps; ++st) {
        const int s = st % S;
        const uint32_t k_lo = k_lo_of(st);
        mbar_wait(full0 + 8 * s, (st / S) & 1);
        float sc[8][4];
        if constexpr (E4M3) wg_qk_e4m3(sc, q8, k_lo);
        else if constexpr (kQHeld) wg_qk<KB, D>(sc, qf, k_lo);
        else wg_qk_ss<KB, D, R>(sc, q_lo, k_lo);

        uint32_t pa[8][2];
        sm.template step<VB, D, E4M3>(sc, base + st * kTokens, o, pa);

        if constexpr (E4M3) wg_pv_e4m3(o, pa, k_op0 + s * 2 * TILE + TILE);
        else wg_pv<VB, D>(o, pa, k_lo + (TILE >> 4));
        mbar_arrive(empty0 + 8 * s);  // this thread is done with the stage's tiles
      }
    }
    if constexpr (E4M3) {
      // P's factor 2^kE4m3POffset out of l and O.
      constexpr float kInv = 1.f / (1 << (int)kE4m3POffset);
      sm.l_a *= kInv, sm.l_b *= kInv;
      sm.template finish<D>(p, job, o, v_factor * kInv);
    } else {
      sm.template finish<D>(p, job, o, v_factor);
    }
  }

  // One count per thread block that met a fault.
  if (__syncthreads_or(fault || job.bad_len) && tid == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
#else
  // Built without sm_90a features: the launcher never selects this instance (prefill.cu tells
  // it by its binary version and by the shared memory it declares, none here); were it run,
  // every row would be left unwritten, so count it.
  if (threadIdx.x == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
#endif
}

}  // namespace kvq_prefill
