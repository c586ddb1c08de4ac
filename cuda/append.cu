// append.cu: quantize-on-append into the paged pool, gather-dequantize of a sequence's pages,
// and dense quantize / dequantize (the layout of src/dense.rs). Bit-exact with the CPU path.
//
// The element math is the formats' codecs (codec/). Work split of the row kernels: one thread
// per E consecutive elements of a row, E depending on the format (Codec::kEpt: 32 for INT4 — one thread writes one 16-byte vector of codes and owns a whole
// K group, 8 for f16 / bf16, 16 for FP8), so a row takes head_dim / E consecutive lanes and an
// INT4 V group 2 lanes, reduced with warp shuffles. A thread block holds whole rows (RowShape).
// Per-thread work is sized so that quantizing stays under the memory time (the codecs' fast
// exact paths avoid per-element division).
//
// A codec whose group is the whole row (INT8) reduces the row's extremes across its lanes: with
// xor shuffles when a row's lanes divide a warp (rows then tile warps evenly), else through
// shared memory (kBlockRows: rows that straddle warps, or span several).
//
// INT4-KC keys (codec/int4_kc.cuh) have no row codec: append writes their rows as f16 into the
// block's window, then seals each block its append filled (seal_kernel); gather reads a sealed
// block's codes or an unfilled block's window (gather_kc_kernel).
#include <algorithm>
#include <array>
#include <type_traits>

#include "codec/codec.cuh"
#include "codec/int4_kc.cuh"
#include "common.cuh"

namespace kvq {

namespace {
thread_local cudaError_t g_last_error = cudaSuccess;
}
void set_last_error(cudaError_t e) { g_last_error = e; }

namespace {

// Largest head_dim the row kernels serve: a row's lanes must fit in one thread block.
constexpr int kMaxHeadDim = kThreadsPerBlock * kChunk;

// ---- one thread's input chunk ------------------------------------------------------------

// Issue the loads of E consecutive elements at `p` (16-byte aligned). The input is read once, so
// the loads are streaming (evict-first) to spare L2 for the cache pool.
template <typename In, int E>
__device__ __forceinline__ void load_raw(const In *p, RawChunk<In, E> &raw) {
#pragma unroll
  for (int j = 0; j < RawChunk<In, E>::kVectors; ++j)
    raw.q[j] = __ldcs(reinterpret_cast<const uint4 *>(p) + j);
}

// Whether finite inputs of type In can lie outside f16's range (bf16, f32), so that sanitizing
// clamps them to ±65504.
template <typename In> constexpr bool kMayExceedF16 = !std::is_same<In, __half>::value;

// 1 when x is finite and past ±limit: an input that saturates (what HostCache::write_strict
// refuses).
__device__ __forceinline__ uint32_t saturates(float x, float limit) {
  const float a = fabsf(x);
  return a > limit && a <= 0x1.fffffep127f ? 1u : 0u;
}

// Widen to f32 and sanitize (FORMATS.md): returns how many inputs were non-finite, and adds to
// `saturated` (when given) the finite ones past `limit`. The common case (all finite, none past
// the limit) costs one compare per element, plus a clamp for types whose finite range exceeds
// f16's; a chunk with a non-finite value or one past the limit takes the careful path.
template <typename In, int E>
__device__ __forceinline__ uint32_t sanitize_raw(const RawChunk<In, E> &raw, float (&v)[E],
                                                 float limit = 0x1.fffffep127f,
                                                 uint32_t *saturated = nullptr) {
  float x[E];
#pragma unroll
  for (int j = 0; j < E / kChunk; ++j)
    unpack8(reinterpret_cast<const In *>(raw.q) + j * kChunk,
            *reinterpret_cast<float(*)[8]>(x + j * kChunk));
  bool careful = false;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    careful |= !(fabsf(x[i]) <= limit);  // NaN, ±Inf, or past the limit
    v[i] = kMayExceedF16<In> ? fminf(fmaxf(x[i], -kF16Max), kF16Max) : x[i];
  }
  uint32_t count = 0;
  if (careful) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      if (saturated != nullptr) *saturated += saturates(x[i], limit);
      v[i] = sanitize(x[i], count);
    }
  }
  return count;
}

// load_raw + sanitize_raw, for kernels that need the values at once.
template <typename In, int E>
__device__ __forceinline__ uint32_t load_sanitized(const In *p, float (&v)[E]) {
  RawChunk<In, E> raw;
  load_raw<In, E>(p, raw);
  return sanitize_raw<In, E>(raw, v);
}

// Rewrite the non-finite elements of a 16-bit chunk in place so that widening (plus, for bf16,
// the clamp to ±65504) gives the sanitized values: NaN → +0, and for f16 ±Inf → ±65504 (an f16
// value; bf16 infinities are left to the clamp). Returns how many were non-finite.
template <typename In, int E> __device__ uint32_t scrub_raw(RawChunk<In, E> &raw) {
  constexpr uint32_t kInf = std::is_same<In, __half>::value ? 0x7C00u : 0x7F80u;
  uint16_t *h = reinterpret_cast<uint16_t *>(raw.q);
  uint32_t count = 0;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const uint32_t mag = h[i] & 0x7FFFu;
    count += mag >= kInf ? 1u : 0u;
    if (mag > kInf) h[i] = 0;
    if (std::is_same<In, __half>::value && mag == kInf)
      h[i] = (uint16_t)((h[i] & 0x8000u) | 0x7BFFu);
  }
  return count;
}

// Whether appending In to codec C can saturate: with a head scale (inputs past the scale times
// the codec's largest value), or from inputs wider than f16's range (FORMATS.md's clamp).
template <typename In, class C> constexpr bool kMaySaturate = C::kHeadScale || kMayExceedF16<In>;

// What a side of codec C holds of an input: ±65504, and with a head scale at most the scale times
// C's largest value (the limit HostCache::write_strict checks, computed the same way in f32).
template <class C> __device__ __forceinline__ float saturation_limit(float head_scale) {
  if constexpr (C::kHeadScale) return fminf(head_scale * C::kHeadMax, kF16Max);
  else return kF16Max;
}

// Finite inputs of the chunk whose magnitude is past `limit`: the ones that saturate. Called on
// the raw chunk before scrub_raw, which turns f16 infinities into finite values.
template <typename In, int E>
__device__ __forceinline__ uint32_t count_saturated(const RawChunk<In, E> &raw, float limit) {
  uint32_t n = 0;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    n += saturates(to_f32(reinterpret_cast<const In *>(raw.q)[i]), limit);
  }
  return n;
}

// Element i of a 16-bit chunk as f32, clamped to ±65504 when Clamp: the sanitized input once
// scrub_raw has run (or when the chunk had nothing to scrub).
template <typename In, int E, bool Clamp> struct RawValues {
  const RawChunk<In, E> &raw;
  __device__ __forceinline__ float operator()(int i) const {
    const float x = to_f32(reinterpret_cast<const In *>(raw.q)[i]);
    return Clamp ? fminf(fmaxf(x, -kF16Max), kF16Max) : x;
  }
  // The raw 32-bit word of elements 2i and 2i + 1 (their signs are the sanitized values').
  __device__ __forceinline__ uint32_t pair_word(int i) const {
    return reinterpret_cast<const uint32_t *>(raw.q)[i];
  }
};

// ---- geometry ---------------------------------------------------------------------------

// How rows map onto threads, the same for every row kernel: head_dim / E consecutive threads per
// row, rows_per_block whole rows per block of kThreadsPerBlock (threads past them, when the
// threads per row do not divide the block, have no row but still take part in shuffles). Rows
// are counted in 32 bits: launchers reject more than kMaxRows.
struct RowShape {
  int head_dim;
  int tpr;  // threads per row
  int rows_per_block;
  FastDiv by_tpr;

  __host__ RowShape(int d, int ept)
      : head_dim(d), tpr(d / ept), rows_per_block(kThreadsPerBlock / (d / ept)),
        by_tpr((uint32_t)(d / ept)) {}
  // Blocks covering `rows` rows when each thread serves `rows_per_thread` of them.
  __host__ unsigned blocks(int64_t rows, int rows_per_thread = 1) const {
    const int64_t per_block = (int64_t)rows_per_block * rows_per_thread;
    return (unsigned)((rows + per_block - 1) / per_block);
  }
};

// Rows are counted in 32 bits, including the padding of the last block.
constexpr int64_t kMaxRows = (1ll << 31) - 2 * kThreadsPerBlock;

struct RowGrid {
  uint32_t row;
  int chunk;
  bool in_block;
};

// This thread's row in slab `slab` of rows_per_block rows (one slab per block, unless a kernel
// gives each block several), its chunk of that row, and whether it has a row at all.
__device__ __forceinline__ RowGrid row_grid(const RowShape &s, uint32_t slab) {
  const uint32_t local = s.by_tpr.div(threadIdx.x);
  RowGrid g;
  g.chunk = (int)(threadIdx.x - local * s.tpr);
  g.row = slab * (uint32_t)s.rows_per_block + local;
  g.in_block = local < (uint32_t)s.rows_per_block;
  return g;
}

// One side (K or V) of the paged layout.
struct PagedSide {
  uint8_t *pool;
  int64_t head_stride, block_stride;
  int block_size, num_heads, head_dim;
  int codes_offset, codes_row, meta_offset, meta_row, meta_step;
  const float *head_scales;  // FP8 only
  FastDiv by_heads, by_block_size;

  __device__ __forceinline__ uint8_t *section(uint32_t block, uint32_t head) const {
    return pool + block * block_stride + head * head_stride;
  }
  __device__ __forceinline__ RowRef row(uint32_t block, uint32_t offset, uint32_t head) const {
    return row(block, offset, head, head_scales != nullptr ? head_scales[head] : 1.0f);
  }
  // The same with the head's scale already read (append reads it with the row's input).
  __device__ __forceinline__ RowRef row(uint32_t block, uint32_t offset, uint32_t head,
                                        float head_scale) const {
    uint8_t *const section = this->section(block, head);
    uint8_t *meta = section + meta_offset + offset * meta_row;
    RowRef r;
    r.codes = section + codes_offset + offset * codes_row;
    r.scales = reinterpret_cast<uint16_t *>(meta);
    r.zeros = reinterpret_cast<uint16_t *>(meta) + 1;
    r.meta_step = meta_step;
    r.head_scale = head_scale;
    return r;
  }
};

// Dense [rows, head_dim] quantized arrays (src/dense.rs): codes, and the scales of each row: f16
// per group (INT4; zeros apart), an E4M3 byte per group (FP4) or one f32 (INT8), contiguous
// rows; `scales` points to bytes of that type. Head scales: FP8's s, FP4's g.
struct DenseRows {
  uint8_t *codes;
  uint16_t *scales;
  uint16_t *zeros;
  int code_bytes, groups, heads, num_head_scales;
  const float *head_scales;
  FastDiv by_heads;

  // Row r of codec C's arrays.
  template <class C> __device__ __forceinline__ RowRef row(uint32_t r) const {
    RowRef ref;
    ref.codes = codes + (int64_t)r * code_bytes;
    uint8_t *const meta = reinterpret_cast<uint8_t *>(scales);
    if constexpr (RowGroupOf<C>::value)  // the row's one scale
      ref.scales = reinterpret_cast<uint16_t *>(meta + (int64_t)r * C::kRowMeta);
    else if constexpr (C::kGroupMeta == 1)  // a byte per group
      ref.scales = reinterpret_cast<uint16_t *>(meta + (int64_t)r * groups);
    else
      ref.scales = scales != nullptr ? scales + (int64_t)r * groups : nullptr;
    ref.zeros = zeros != nullptr ? zeros + (int64_t)r * groups : nullptr;
    ref.meta_step = 1;
    ref.head_scale = head_scales == nullptr ? 1.0f
                     : num_head_scales == 1 ? head_scales[0]
                                            : head_scales[r - by_heads.div(r) * heads];
    return ref;
  }
};

// ---- kernels --------------------------------------------------------------------------

// The quantizing kernels' format argument F: a kvq_format id, or a row-group codec's id with
// kBlockRows set when a row's lanes do not divide a warp (with_row_reduction picks it).
constexpr int kBlockRows = 1 << 8;
template <int F> using CodecOf = Codec<F & (kBlockRows - 1)>;

// The extremes of a row whose lanes need not lie in one warp (they may straddle two, or span
// several): each lane posts its own to shared memory and reads back its row's (lo the least, hi
// the largest). Two barriers, so every thread of the block must call it as often as the others.
__device__ __forceinline__ Extremes block_row_extremes(const Extremes &own, const RowShape &shape) {
  __shared__ Extremes posted[kThreadsPerBlock];
  __syncthreads();  // the reads of this thread block's previous rows are done
  posted[threadIdx.x] = own;
  __syncthreads();
  const int first = (int)(shape.by_tpr.div(threadIdx.x) * (uint32_t)shape.tpr);
  if (first + shape.tpr > kThreadsPerBlock) return own;  // past the block's whole rows: no row
  Extremes row = posted[first];
  for (int i = 1; i < shape.tpr; ++i) {
    const Extremes e = posted[first + i];
    row.lo = fminf(row.lo, e.lo);
    row.hi = fmaxf(row.hi, e.hi);
  }
  return row;
}

// The extremes the codec of F quantizes a thread's chunk with: its group's (group_extremes), or
// for a codec whose group is the row, the row's over its shape.tpr lanes (row_extremes within a
// warp, or block_row_extremes under kBlockRows). Every lane of the warp must call it; under
// kBlockRows every thread of the block.
template <int F>
__device__ __forceinline__ Extremes extremes_for(const Extremes &own, const RowShape &shape) {
  using C = CodecOf<F>;
  if constexpr ((F & kBlockRows) != 0) return block_row_extremes(own, shape);
  else if constexpr (RowGroupOf<C>::value) return C::row_extremes(own, shape.tpr);
  else return C::group_extremes(own);
}

// Whether append quantizes straight from the packed 16-bit input (f16 / bf16 into the INT4,
// INT8, FP8 and FP4 formats: the codecs with packed_extremes).
template <typename In, int F>
constexpr bool kPackedInput = sizeof(In) == 2 && CodecOf<F>::kPackedExtremes;

// A codec whose encoder is long (kLongEncode: FP4, 32 elements and two block scales a thread)
// takes one row per thread from 16-bit inputs, at 4 blocks per SM (64 registers): 48 -> 58 % of
// a device copy on grid values, 60 -> 65 % on random ones, where 2 rows at 3 blocks spilled
// (session 12's sweep with the encoder of then, ~24 instructions an element on the kernel's hot
// path; ~15 since "Append v3", PERFORMANCE.md, whose sweep is to be redone).
template <class C, class = void> struct LongEncodeOf : std::false_type {};
template <class C>
struct LongEncodeOf<C, std::void_t<decltype(C::kLongEncode)>> : std::bool_constant<C::kLongEncode> {};

// Rows each append thread handles, and the blocks per SM its registers must allow (launch
// bounds). A thread issues the loads of all its rows, then quantizes them one by one: more bytes
// in flight per thread, and the per-thread setup shared. Keeping the next rows' loads in flight
// while quantizing one (a software pipeline over 4-16 rows) measured level at best and up to 2x
// slower on the H200 (PERFORMANCE.md, "Append v2"). f32 input already loads twice the bytes per
// row.
// KVQ_APPEND_ROWS and KVQ_APPEND_MIN_BLOCKS override the picks (scripts/append_sweep.cu).
template <typename In, int F> struct AppendTuning {
#ifdef KVQ_APPEND_ROWS
  static constexpr int kRows = KVQ_APPEND_ROWS, kMinBlocks = KVQ_APPEND_MIN_BLOCKS;
#else
  static constexpr bool kLong = LongEncodeOf<CodecOf<F>>::value && sizeof(In) == 2;
  // INT4 from f16: two rows at 4 blocks (64 registers) wrote the same bytes 2 % faster than at 3
  // (session 16's sweep, PERFORMANCE.md); from bf16 the same bound spills.
  static constexpr bool kNibbles = CodecOf<F>::kBits == 4 && !kLong && std::is_same_v<In, __half>;
  static constexpr int kRows = sizeof(In) == 4 || kLong ? 1 : 2;
  static constexpr int kMinBlocks = kLong || kNibbles ? 4 : 3;
#endif
};

// The input chunk of one of a thread's rows, with where it goes; slot -1 when the row has
// nothing to append (past the end, or a skipped token).
template <typename In, int E> struct PendingRow {
  RawChunk<In, E> raw;
  uint32_t head;
  int64_t slot;
  float head_scale;  // FP8's s, FP4's g: read with the input, off the slot's critical path
};

template <typename In, int F>
__global__ void __launch_bounds__(kThreadsPerBlock, AppendTuning<In, F>::kMinBlocks)
    append_kernel(RowShape shape, const In *__restrict__ x, int64_t token_stride,
                  uint32_t num_tokens, const void *__restrict__ slots, int slots_i64,
                  int64_t num_slots, PagedSide side, int count_out_of_range,
                  unsigned long long *counters) {
  using C = CodecOf<F>;
  constexpr int E = C::kEpt;
  constexpr int R = AppendTuning<In, F>::kRows;
  const RowGrid g = row_grid(shape, blockIdx.x * R);
  const int chunk = g.chunk;
  const bool in_block = g.in_block;

  // Block b serves rows [b * R * rows_per_block, (b + 1) * R * rows_per_block): row k of this
  // thread is its row of the block's first slab, k slabs further.
  auto issue = [&](int k, PendingRow<In, E> &p) {
    const uint32_t row = g.row + k * (uint32_t)shape.rows_per_block;
    const uint32_t token = side.by_heads.div(row);
    p.head = row - token * side.num_heads;
    p.slot = -1;
    p.head_scale = 1.0f;
    if constexpr (C::kHeadScale)
      if (side.head_scales != nullptr && in_block && token < num_tokens)
        p.head_scale = side.head_scales[p.head];
    if (in_block && token < num_tokens) {
      load_raw<In, E>(x + token * token_stride + p.head * shape.head_dim + chunk * E, p.raw);
      p.slot = slots_i64 ? static_cast<const int64_t *>(slots)[token]
                         : (int64_t) static_cast<const int32_t *>(slots)[token];
    } else if constexpr (kPackedInput<In, F>) {
      p.raw = {};  // no row: zeros, which the encoders take without a slow path
    }
  };
  uint32_t non_finite = 0, out_of_range = 0, saturated = 0;
  // Every lane of the warp quantizes each k (the INT4 V group reduction shuffles).
  auto quantize = [&](PendingRow<In, E> &p) {
    // A slot past the pool is an error the host learns about through the counter.
    out_of_range += count_out_of_range && p.slot >= num_slots && p.head == 0 && chunk == 0;
    const bool active = p.slot >= 0 && p.slot < num_slots;  // -1 also for rows past the end
    RowRef r;  // read only where active
    if (active) {
      const uint32_t block = side.by_block_size.div((uint32_t)p.slot);
      r = side.row(block, (uint32_t)p.slot - block * side.block_size, p.head, p.head_scale);
    }
    if constexpr (kPackedInput<In, F>) {
      // From f16 / bf16: extremes on packed pairs, values widened as the codes need them.
      Extremes own = {0.0f, 0.0f};
      bool needs_clamp = false;
      if (active) {
        if (!C::packed_extremes(p.raw, own)) {
          if constexpr (kMaySaturate<In, C>)
            saturated += count_saturated<In, E>(p.raw, saturation_limit<C>(p.head_scale));
          non_finite += scrub_raw<In, E>(p.raw);
          C::packed_extremes(p.raw, own);
        } else if constexpr (kMaySaturate<In, C>) {
          // The extremes at hand bound |x| (both signs' ends, or a group's amax in either).
          const float limit = saturation_limit<C>(p.head_scale);
          if (__builtin_expect(fmaxf(-own.lo, own.hi) > limit, 0))
            saturated += count_saturated<In, E>(p.raw, limit);
        }
        // Only bf16 can exceed ±65504 once scrubbed (f16 never takes the clamped copy of the
        // encoder); the clamp is monotonic, so it commutes with taking extremes.
        if constexpr (kMayExceedF16<In>) {
          needs_clamp = own.lo < -kF16Max || own.hi > kF16Max;
          own.lo = fmaxf(own.lo, -kF16Max);
          own.hi = fminf(own.hi, kF16Max);
        }
      }
      const Extremes group = extremes_for<F>(own, shape);
      if (__builtin_expect(needs_clamp, 0))
        C::encode(RawValues<In, E, true>{p.raw}, own, group, chunk, r, active);
      else
        C::encode(RawValues<In, E, false>{p.raw}, own, group, chunk, r, active);
    } else {
      float v[E] = {};
      if (active) {
        // The saturation limit rides on the non-finite check's one compare an element.
        if constexpr (kMaySaturate<In, C>)
          non_finite += sanitize_raw<In, E>(p.raw, v, saturation_limit<C>(p.head_scale),
                                            &saturated);
        else
          non_finite += sanitize_raw<In, E>(p.raw, v);
      }
      const Extremes own = C::extremes(v);
      C::encode([&](int i) { return v[i]; }, own, extremes_for<F>(own, shape), chunk, r, active);
    }
  };

  PendingRow<In, E> rows[R];
#pragma unroll
  for (int k = 0; k < R; ++k) issue(k, rows[k]);
#pragma unroll
  for (int k = 0; k < R; ++k) quantize(rows[k]);
  warp_count(counters ? counters + KVQ_COUNTER_NON_FINITE : nullptr, non_finite);
  if constexpr (kMaySaturate<In, C>)
    warp_count(counters ? counters + KVQ_COUNTER_SATURATED : nullptr, saturated);
  if (count_out_of_range)
    warp_count(counters ? counters + KVQ_COUNTER_OUT_OF_RANGE : nullptr, out_of_range);
}

// ---- reading paged rows back --------------------------------------------------------------

// Elements a thread decodes of format F's rows: its codec's chunk, kChunk for INT4-KC keys.
template <int F> __host__ __device__ constexpr int chunk_elements() {
  if constexpr (F == kInt4Kc) return kChunk;
  else return Codec<F>::kEpt;
}

// Chunk `chunk` of the row at (block, offset, head) of one side of format F into v: INT4-KC keys
// (`side` their window's, paged_side) from the sealed codes when `sealed`, else from the f16
// window of a block the sequence has not filled. A block outside [0, num_blocks) leaves v zero
// and is counted once a token (by its head 0, chunk 0).
template <int F>
__device__ __forceinline__ void decode_paged_chunk(const PagedSide &side, int head_dim,
                                                   int64_t block, int64_t num_blocks,
                                                   uint32_t offset, uint32_t head, int chunk,
                                                   bool sealed, unsigned long long *counters,
                                                   float (&v)[chunk_elements<F>()]) {
  if (block >= 0 && block < num_blocks) {
    if constexpr (F == kInt4Kc) {
      if (sealed) {
        const uint8_t *section = side.section((uint32_t)block, head);
        const int code_row = head_dim / 2;
        const uint32_t codes = reinterpret_cast<const uint32_t *>(
            section + side.codes_offset + offset * code_row)[chunk];
        const uint4 *meta = reinterpret_cast<const uint4 *>(section + side.meta_offset);
        int4_kc_decode8(codes, meta[chunk], meta[head_dim / kChunk + chunk], v);
      } else {
        Codec<kF16>::decode(side.row((uint32_t)block, offset, head), chunk, v);
      }
    } else {
      Codec<F>::decode(side.row((uint32_t)block, offset, head), chunk, v);
    }
  } else if (counters != nullptr && head == 0 && chunk == 0) {
    atomicAdd(counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
  }
}

template <typename Out, int F>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_kernel(RowShape shape, PagedSide side, const int32_t *__restrict__ block_table,
                  uint32_t num_tokens, int64_t num_blocks, Out *__restrict__ out,
                  unsigned long long *counters) {
  constexpr int E = chunk_elements<F>();
  const RowGrid g = row_grid(shape, blockIdx.x);
  const uint32_t token = side.by_heads.div(g.row);
  const uint32_t head = g.row - token * side.num_heads;
  if (!g.in_block || token >= num_tokens) return;  // no shuffles below
  const uint32_t page = side.by_block_size.div(token);
  float v[E] = {};
  decode_paged_chunk<F>(side, shape.head_dim, block_table[page], num_blocks,
                        token - page * side.block_size, head, g.chunk, false, counters, v);
  Out *o = out + (int64_t)g.row * shape.head_dim + g.chunk * E;
#pragma unroll
  for (int j = 0; j < E / kChunk; ++j)
    store8(o + j * kChunk, *reinterpret_cast<const float(*)[8]>(v + j * kChunk));
}

// ---- INT4-KC keys ----------------------------------------------------------------------

// Threads of a seal block. A thread seals up to R channel pairs between two barriers (R of 1,
// 2 or 4, the fewest that hold a head's head_dim / 2 pairs), so one round covers a head_dim of up
// to kMaxHeadDim.
constexpr int kSealThreads = 256;
constexpr int kSealMaxRounds = kMaxHeadDim / 2 / kSealThreads;

// Seal the blocks an append filled (kvq.h's INT4-KC layout note), G the block_size: thread block
// (x, y) takes tokens [x * tokens_per_block, (x + 1) * tokens_per_block) of the append and KV
// heads y, y + gridDim.y, ... A thread per token reads its slot; the tokens that took their
// block's last slot are compacted (a ballot per warp) into a list of the blocks to seal, and the
// thread block seals those blocks' sections of its heads, per_round = kSealThreads * R / pairs
// sections a round, each thread up to R of their channel pairs (pair i of the round, counted
// across its sections, for i = r * kSealThreads + threadIdx.x, r < R). `side` is the window's
// (paged_side), by_pairs divides by head_dim / 2. The codes and s, z overwrite the window in
// place, so every thread quantizes its channel pairs of a round from the window before any
// writes (the barrier): a thread keeps G / 4 words of codes per pair, not the 2G values. The
// sections of two rounds differ (the slots of an append are distinct), so the next round's reads
// need no barrier.
template <int G, int R>
__global__ void __launch_bounds__(kSealThreads)
    seal_kernel(PagedSide side, const void *__restrict__ slots, int slots_i64, uint32_t num_tokens,
                int64_t num_slots, int tokens_per_block, FastDiv by_pairs) {
  __shared__ uint32_t to_seal[kSealThreads];
  __shared__ uint32_t warp_seals[kSealThreads / 32];
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
  const uint32_t token = blockIdx.x * (uint32_t)tokens_per_block + threadIdx.x;
  bool seals = false;
  uint32_t block = 0;
  if ((int)threadIdx.x < tokens_per_block && token < num_tokens) {
    const int64_t slot = slots_i64 ? static_cast<const int64_t *>(slots)[token]
                                   : (int64_t) static_cast<const int32_t *>(slots)[token];
    // A skipped token (negative slot) or one past the pool seals nothing.
    seals = slot >= 0 && slot < num_slots && (uint32_t)slot % G == G - 1;
    block = (uint32_t)slot / G;  // slot < num_slots <= kMaxRows when it seals
  }
  const uint32_t ballot = __ballot_sync(kFullMask, seals);
  if (lane == 0) warp_seals[warp] = __popc(ballot);
  __syncthreads();
  uint32_t before = 0, n = 0;  // blocks of earlier warps, of all warps
#pragma unroll
  for (int w = 0; w < kSealThreads / 32; ++w) {
    const uint32_t c = warp_seals[w];
    before += w < warp ? c : 0;
    n += c;
  }
  if (seals) to_seal[before + __popc(ballot & ((1u << lane) - 1))] = block;
  if (n == 0) return;  // the whole thread block: no barrier
  __syncthreads();

  const int pairs = side.head_dim / 2;
  const uint32_t per_round = (uint32_t)(kSealThreads * R / pairs);  // >= 1: launch_seal's R
  for (uint32_t head = blockIdx.y; head < (uint32_t)side.num_heads; head += gridDim.y) {
    for (uint32_t first = 0; first < n; first += per_round) {
      const int tasks = (int)(min(n - first, per_round) * (uint32_t)pairs);
      uint8_t *section[R];
      int pair[R];
      uint32_t codes[R][G / 4], s2[R], z2[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = r * kSealThreads + (int)threadIdx.x;
        section[r] = nullptr;
        pair[r] = 0;
        if (i < tasks) {
          const uint32_t j = by_pairs.div((uint32_t)i);
          const int p = i - (int)j * pairs;
          section[r] = side.section(to_seal[first + j], head);
          pair[r] = p;
          const uint8_t *const k = section[r] + side.codes_offset;
          uint32_t w[G];  // window row t's f16 values of channels 2p, 2p + 1
#pragma unroll
          for (int t = 0; t < G; ++t)
            w[t] = reinterpret_cast<const uint32_t *>(k + (int64_t)t * side.codes_row)[p];
          int4_kc_seal_pair<G>(w, codes[r], s2[r], z2[r]);
        }
      }
      __syncthreads();  // every window row of this round's sections read
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (section[r] != nullptr) {
          const int p = pair[r];
          uint8_t *const k = section[r] + side.codes_offset;
#pragma unroll
          for (int t = 0; t < G; ++t)
            k[t * pairs + p] = (uint8_t)(codes[r][t / 4] >> (8 * (t % 4)));
          uint32_t *const s = reinterpret_cast<uint32_t *>(section[r] + side.meta_offset);
          s[p] = s2[r];
          s[pairs + p] = z2[r];  // z[head_dim] follows s[head_dim]
        }
      }
    }
  }
}

// Gather of INT4-KC keys, kChunk elements a thread: a token of a full block of the sequence (of
// num_tokens tokens) decodes from the sealed codes, one of its last, unfilled block is its f16
// window row. `side` is the window's (paged_side).
template <typename Out>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_kc_kernel(RowShape shape, PagedSide side, const int32_t *__restrict__ block_table,
                     uint32_t num_tokens, int64_t num_blocks, Out *__restrict__ out,
                     unsigned long long *counters) {
  const RowGrid g = row_grid(shape, blockIdx.x);
  const uint32_t token = side.by_heads.div(g.row);
  const uint32_t head = g.row - token * side.num_heads;
  if (!g.in_block || token >= num_tokens) return;
  const uint32_t page = side.by_block_size.div(token);
  const uint32_t offset = token - page * side.block_size;
  float v[kChunk] = {};
  decode_paged_chunk<kInt4Kc>(side, shape.head_dim, block_table[page], num_blocks, offset, head,
                              g.chunk, (page + 1) * (uint32_t)side.block_size <= num_tokens,
                              counters, v);
  store8(out + (int64_t)g.row * shape.head_dim + g.chunk * kChunk, v);
}

// ---- a step's context decoded for a 16-bit attention pass -----------------------------------

// How many scratch blocks the sequences before b take (each its length's blocks, lengths
// clamped to [0, cap] as the attention kernels clamp them), summed by the whole thread block:
// each thread block finds its sequence's first scratch block itself, so the pass needs no
// launch of its own for the offsets. Every thread of the block must call it.
__device__ uint32_t blocks_before(const int32_t *__restrict__ context_lens, uint32_t b, int cap,
                                  int block_size) {
  __shared__ uint32_t warp_sums[kThreadsPerBlock / 32];
  uint32_t sum = 0;
  for (uint32_t i = threadIdx.x; i < b; i += kThreadsPerBlock) {
    const int len = min(max(context_lens[i], 0), cap);
    sum += (uint32_t)((len + block_size - 1) / block_size);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  uint32_t total = 0;
#pragma unroll
  for (int w = 0; w < kThreadsPerBlock / 32; ++w) total += warp_sums[w];
  return total;
}

// Thread block (x, b) decodes rows [x * rows_per_block, ...) (token-major over the KV heads) of
// sequence b's context into the 16-bit pool `dst`: its page p goes to scratch block
// blocks_before(b) + p, which row b of dst_tables names (when not null: one side writes it).
// F is the side's format (kInt4Kc: keys read sealed or from the window, decode_paged_chunk);
// the scratch holds bf16 when bf16_out, else f16 (an argument, not a template parameter: one
// instance a format, for the build's time). A block id outside the pool decodes to zeros and
// is counted once a token.
template <int F>
__global__ void __launch_bounds__(kThreadsPerBlock)
    decode_context_kernel(RowShape shape, PagedSide side, PagedSide dst,
                          const int32_t *__restrict__ block_tables, int max_blocks,
                          const int32_t *__restrict__ context_lens, int64_t num_blocks,
                          int64_t dst_blocks, int32_t *__restrict__ dst_tables,
                          int dst_max_blocks, bool bf16_out, unsigned long long *counters) {
  constexpr int E = chunk_elements<F>();
  const uint32_t b = blockIdx.y;
  const int cap = max_blocks * side.block_size;
  const uint32_t len = (uint32_t)min(max(context_lens[b], 0), cap);
  if (side.by_heads.div(blockIdx.x * (uint32_t)shape.rows_per_block) >= len) return;  // uniform
  const uint32_t first = blocks_before(context_lens, b, cap, side.block_size);
  const RowGrid g = row_grid(shape, blockIdx.x);
  const uint32_t token = side.by_heads.div(g.row);
  const uint32_t head = g.row - token * side.num_heads;
  if (!g.in_block || token >= len) return;  // no barriers below
  const uint32_t page = side.by_block_size.div(token);
  const uint32_t offset = token - page * side.block_size;
  const uint32_t to = first + page;
  if (page >= (uint32_t)dst_max_blocks) return;  // a length the host did not check
  if (dst_tables != nullptr && head == 0 && g.chunk == 0 && offset == 0)
    dst_tables[(int64_t)b * dst_max_blocks + page] = (int32_t)to;
  if (to >= dst_blocks) return;  // the attention pass counts the table's id as out of range
  float v[E] = {};
  decode_paged_chunk<F>(side, shape.head_dim, block_tables[(int64_t)b * max_blocks + page],
                        num_blocks, offset, head, g.chunk,
                        (page + 1) * (uint32_t)side.block_size <= len, counters, v);
  uint8_t *const o = dst.row(to, offset, head).codes + g.chunk * E * 2;
#pragma unroll
  for (int j = 0; j < E / kChunk; ++j) {
    const float(&part)[8] = *reinterpret_cast<const float(*)[8]>(v + j * kChunk);
    if (bf16_out)
      store8(reinterpret_cast<__nv_bfloat16 *>(o) + j * kChunk, part);
    else
      store8(reinterpret_cast<__half *>(o) + j * kChunk, part);
  }
}

// ---- INT4-KC dense tensors -----------------------------------------------------------------

// FORMATS.md's dense int4-kc file: the tensor is [tokens, heads, head_dim], each (head, channel)
// quantized in groups of kKcDenseGroup tokens, a last group of tokens % kKcDenseGroup (when not
// 0) over only those. Both kernels go by channel pairs: pair i of the tensor is elements 2i and
// 2i + 1, one code byte (codes[i]); pair hp of a token's row of plane_pairs = heads * head_dim /
// 2 pairs has its s and z in word k * plane_pairs + hp of the scales and zeros (f16 pairs,
// [groups, heads, head_dim] as words), k the token's group.
constexpr int kKcDenseGroup = 32;

// The sanitized values of pair `pair` of x (elements 2 * pair, 2 * pair + 1), read once.
template <typename In>
__device__ __forceinline__ void load_pair(const In *x, uint32_t pair, float (&v)[2],
                                          uint32_t &non_finite) {
  if constexpr (sizeof(In) == 4) {
    const float2 p = __ldcs(reinterpret_cast<const float2 *>(x) + pair);
    v[0] = p.x;
    v[1] = p.y;
  } else {
    const uint32_t w = __ldcs(reinterpret_cast<const unsigned int *>(x) + pair);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16_t b = (uint16_t)(w >> (16 * h));
      v[h] = std::is_same<In, __half>::value ? half_from_bits(b) : bf16_from_bits(b);
    }
  }
  v[0] = sanitize(v[0], non_finite);
  v[1] = sanitize(v[1], non_finite);
}

// Elements 2 * pair and 2 * pair + 1 of out, rounded to Out.
template <typename Out>
__device__ __forceinline__ void store_pair(Out *out, uint32_t pair, const float (&v)[2]) {
  if constexpr (sizeof(Out) == 4) {
    reinterpret_cast<float2 *>(out)[pair] = make_float2(v[0], v[1]);
  } else {
    const bool bf = std::is_same<Out, __nv_bfloat16>::value;
    const uint32_t lo = bf ? bf16_bits(v[0]) : half_bits(v[0]);
    const uint32_t hi = bf ? bf16_bits(v[1]) : half_bits(v[1]);
    reinterpret_cast<uint32_t *>(out)[pair] = lo | (hi << 16);
  }
}

// Quantize a dense int4-kc tensor: thread i seals pair hp of group k (i = k * plane_pairs + hp,
// i < tasks = groups * plane_pairs), reading its two channels over the group's tokens. A last
// group of n < kKcDenseGroup tokens repeats its first token's values in the missing places,
// which leaves the extremes unchanged; their codes are not stored. Consecutive threads take
// consecutive pairs of the same token rows, so every load and store is coalesced.
template <typename In>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_kc_dense_kernel(const In *__restrict__ x, uint32_t tokens, uint32_t plane_pairs,
                             FastDiv by_plane_pairs, uint32_t tasks, uint8_t *__restrict__ codes,
                             uint32_t *__restrict__ s2, uint32_t *__restrict__ z2,
                             unsigned long long *counters) {
  constexpr int N = kKcDenseGroup;
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t non_finite = 0;
  if (i < tasks) {
    const uint32_t k = by_plane_pairs.div(i), hp = i - k * plane_pairs;
    const uint32_t t0 = k * N;
    const int n = (int)min(tokens - t0, (uint32_t)N);
    float v[2][N];
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t < n) {
        float p[2];
        load_pair(x, (t0 + t) * plane_pairs + hp, p, non_finite);
        v[0][t] = p[0];
        v[1][t] = p[1];
      } else {
        v[0][t] = v[0][0];
        v[1][t] = v[1][0];
      }
    }
    uint32_t c[N / 4] = {}, s = 0, z = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mn = v[h][0], mx = mn;
#pragma unroll
      for (int t = 1; t < N; ++t) {
        mn = fminf(mn, v[h][t]);
        mx = fmaxf(mx, v[h][t]);
      }
      const KcGroup g = int4_kc_group_of(mn, mx);
      int4_kc_codes<N>(g, mn, mx, h, [&](int t) { return v[h][t]; }, c);
      s |= (uint32_t)g.s << (16 * h);
      z |= (uint32_t)g.z << (16 * h);
    }
#pragma unroll
    for (int t = 0; t < N; ++t)
      if (t < n) codes[(t0 + t) * plane_pairs + hp] = (uint8_t)(c[t / 4] >> (8 * (t % 4)));
    s2[i] = s;
    z2[i] = z;
  }
  warp_count(counters ? counters + KVQ_COUNTER_NON_FINITE : nullptr, non_finite);
}

// Dequantize a dense int4-kc tensor: thread j decodes pair j (j < pairs), fma(q, s, z).
template <typename Out>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_kc_dense_kernel(const uint8_t *__restrict__ codes, const uint32_t *__restrict__ s2,
                               const uint32_t *__restrict__ z2, uint32_t pairs,
                               uint32_t plane_pairs, FastDiv by_plane_pairs,
                               Out *__restrict__ out) {
  const uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= pairs) return;
  const uint32_t t = by_plane_pairs.div(j), hp = j - t * plane_pairs;
  const uint32_t m = t / kKcDenseGroup * plane_pairs + hp;
  const uint32_t c = codes[j], s = s2[m], z = z2[m];
  float v[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    v[h] = __fmaf_rn(small_uint_to_f32((c >> (4 * h)) & 0xFu), half_from_bits((uint16_t)(s >> (16 * h))),
                     half_from_bits((uint16_t)(z >> (16 * h))));
  store_pair(out, j, v);
}

template <typename In, int F>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_dense_kernel(RowShape shape, const In *__restrict__ x, uint32_t rows, DenseRows dst,
                          unsigned long long *counters) {
  using C = CodecOf<F>;
  constexpr int E = C::kEpt;
  const RowGrid g = row_grid(shape, blockIdx.x);
  const bool active = g.in_block && g.row < rows;
  float v[E] = {};
  uint32_t non_finite = 0;
  RowRef r = {};
  if (active) {
    non_finite = load_sanitized<In, E>(x + (int64_t)g.row * shape.head_dim + g.chunk * E, v);
    r = dst.row<C>(g.row);
  }
  const Extremes own = C::extremes(v);
  C::encode([&](int i) { return v[i]; }, own, extremes_for<F>(own, shape), g.chunk, r,
                     active);
  warp_count(counters ? counters + KVQ_COUNTER_NON_FINITE : nullptr, non_finite);
}

template <typename Out, int F>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_dense_kernel(RowShape shape, DenseRows src, uint32_t rows, Out *__restrict__ out) {
  using C = Codec<F>;
  constexpr int E = C::kEpt;
  const RowGrid g = row_grid(shape, blockIdx.x);
  if (!g.in_block || g.row >= rows) return;
  float v[E];
  C::decode(src.row<C>(g.row), g.chunk, v);
  Out *o = out + (int64_t)g.row * shape.head_dim + g.chunk * E;
#pragma unroll
  for (int j = 0; j < E / kChunk; ++j)
    store8(o + j * kChunk, *reinterpret_cast<const float(*)[8]>(v + j * kChunk));
}

// Sanitized values of elements [8c, min(8c + 8, n)) of a flat tensor; missing ones are 0.
template <typename In>
__device__ __forceinline__ int load_flat(const In *x, int64_t n, int64_t c, float (&v)[8],
                                         uint32_t &non_finite) {
  const int64_t base = c * kChunk;
  const int count = n - base < kChunk ? (int)(n - base) : kChunk;
  if (count == kChunk) {
    load8(x + base, v);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = i < count ? to_f32(x[base + i]) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = sanitize(v[i], non_finite);
  return count;
}

// amax over the sanitized |x|, per head (row r → head r % heads) or for the whole tensor, as
// f32 bit patterns (non-negative floats order like their bits, so atomicMax on uint32 works).
template <typename In>
__global__ void __launch_bounds__(kThreadsPerBlock)
    amax_kernel(const In *__restrict__ x, int64_t n, int head_dim, int heads, int per_head,
                uint32_t *amax) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t unused = 0;
  if (c * kChunk < n) load_flat(x, n, c, v, unused);
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));
  const uint32_t bits = __float_as_uint(a);
  if (per_head) {
    // head_dim is a multiple of 8 for the per-head (FP8, FP4) case, so a chunk lies in one row.
    if (bits != 0) atomicMax(amax + (c * kChunk / head_dim) % heads, bits);
  } else {
    const uint32_t m = __reduce_max_sync(kFullMask, bits);
    if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax, m);
  }
}

template <int F>
__global__ void scales_from_amax_kernel(const uint32_t *amax, int n, float *scales) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float a = __uint_as_float(amax[i]);
  if constexpr (F == KVQ_DENSE_INT4_UNIFORM)
    scales[i] = Int4Uniform::scale_from_amax(a);
  else
    scales[i] = Codec<F>::scale_from_amax(a);
}

using ScalesKernel = void (*)(const uint32_t *, int, float *);

/// Format F's calibration kernel: its codec's, for a format with a head scale; else null.
template <int F>
constexpr ScalesKernel scales_kernel() {
  if constexpr (Codec<F>::kHeadScale) return scales_from_amax_kernel<F>;
  else return nullptr;
}

/// Every format's calibration kernel, indexed by id (null for the ids the list skips). A table
/// built at compile time rather than a with_format launch: that keeps these kernels ahead of the
/// ones launched from templates in the PTX (scripts/ptx-diff.sh).
template <int... F>
constexpr std::array<ScalesKernel, std::max({F...}) + 1> scales_kernels(FormatList<F...>) {
  std::array<ScalesKernel, std::max({F...}) + 1> table{};
  ((table[F] = scales_kernel<F>()), ...);
  return table;
}

template <typename In>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_uniform_kernel(const In *__restrict__ x, int64_t n, const float *scale,
                            uint8_t *codes, unsigned long long *counters) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t non_finite = 0;
  if (c * kChunk < n) {
    const int count = load_flat(x, n, c, v, non_finite);
    const float s = *scale;
    int q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = Int4Uniform::code(v[i], s);
    const uint32_t w = pack8_nibbles(q);
    if (count == kChunk) {
      reinterpret_cast<uint32_t *>(codes)[c] = w;
    } else {
      for (int b = 0; b < count / 2; ++b) codes[c * 4 + b] = (uint8_t)(w >> (8 * b));
    }
  }
  warp_count(counters ? counters + KVQ_COUNTER_NON_FINITE : nullptr, non_finite);
}

template <typename Out>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_uniform_kernel(const uint8_t *codes, int64_t n, const float *scale, Out *out) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c * kChunk >= n) return;
  const int count = n - c * kChunk < kChunk ? (int)(n - c * kChunk) : kChunk;
  const float s = *scale;
  uint32_t w = 0;
  for (int b = 0; b < count / 2; ++b) w |= (uint32_t)codes[c * 4 + b] << (8 * b);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = Int4Uniform::value(nibble_s(w, i), s);
  if (count == kChunk) {
    store8(out + c * kChunk, v);
  } else {
    for (int i = 0; i < count; ++i) out[c * kChunk + i] = from_f32<Out>(v[i]);
  }
}

// ---- host-side dispatch -----------------------------------------------------------------

template <typename T> struct Tag {
  using type = T;
};

// Call fn(Tag<T>) for a kvq_dtype; KVQ_ERR_INVALID for an unknown one.
template <typename Fn> int with_dtype(int32_t dtype, Fn &&fn) {
  switch (dtype) {
  case KVQ_DTYPE_F32: return fn(Tag<float>{});
  case KVQ_DTYPE_F16: return fn(Tag<__half>{});
  case KVQ_DTYPE_BF16: return fn(Tag<__nv_bfloat16>{});
  default: return KVQ_ERR_INVALID;
  }
}

// head_dim rule of a format (mirrors KvFormat::head_dim_multiple) plus the kernels' own limit.
bool head_dim_ok(const FormatInfo &f, int head_dim) {
  return head_dim > 0 && head_dim % f.head_dim_multiple == 0 && head_dim <= kMaxHeadDim;
}

// Call fn(FormatTag<F>) to launch a quantizing kernel of format F over rows of `shape`; for a
// row-group codec whose rows do not tile warps evenly (a row's lanes do not divide 32),
// fn(FormatTag<F | kBlockRows>): its rows reduce through shared memory.
template <int F, typename Fn> int with_row_reduction(const RowShape &shape, Fn &&fn) {
  if constexpr (RowGroupOf<Codec<F>>::value) {
    if (32 % shape.tpr != 0) return fn(FormatTag<F | kBlockRows>{});
  }
  return fn(FormatTag<F>{});
}

// Whether a layout's INT4-KC key part is kvq.h's, which the kernels address from block_size,
// head_dim and the K offsets: the sealed codes and s, z inside the window, V after it.
bool kc_layout_ok(const kvq_layout &l) {
  const int64_t g = l.block_size, d = l.head_dim;
  return (g == 16 || g == 32 || g == 64) && d > 0 && d % 32 == 0 && l.k_codes_row == d / 2 &&
         l.k_meta_row == 0 && l.k_meta_offset == l.k_codes_offset + g * d / 2 &&
         l.v_codes_offset >= l.k_codes_offset + g * 2 * d;
}

// A side of the cache, or false when the layout's fields are inconsistent. INT4-KC keys give the
// side of their window, f16 rows of 2 * head_dim bytes (the K pass writes them as KVQ_F16);
// values are never INT4-KC (format_info knows no such row codec).
bool paged_side(const kvq_cache &c, bool k, PagedSide &s) {
  const kvq_layout &l = c.layout;
  const bool kc = k && l.k_format == KVQ_INT4_KC;
  FormatInfo f;
  if (!format_info(kc ? KVQ_F16 : k ? l.k_format : l.v_format, f)) return false;
  s.pool = c.pool;
  s.head_stride = l.head_stride;
  s.block_stride = l.block_stride;
  s.block_size = l.block_size;
  s.num_heads = l.num_kv_heads;
  s.head_dim = l.head_dim;
  s.codes_offset = k ? l.k_codes_offset : l.v_codes_offset;
  s.codes_row = kc ? 2 * l.head_dim : k ? l.k_codes_row : l.v_codes_row;
  s.meta_offset = k ? l.k_meta_offset : l.v_meta_offset;
  s.meta_row = k ? l.k_meta_row : l.v_meta_row;
  s.meta_step = f.group_entries > 1 ? f.group_entries : 1;  // scale and zero interleaved
  s.head_scales = f.head_scale ? (k ? c.k_scales : c.v_scales) : nullptr;
  if (l.num_kv_heads <= 0 || l.block_size <= 0) return false;
  s.by_heads = FastDiv((uint32_t)l.num_kv_heads);
  s.by_block_size = FastDiv((uint32_t)l.block_size);
  return c.pool != nullptr && aligned16(c.pool) && head_dim_ok(f, l.head_dim) && s.codes_row == f.code_bytes(l.head_dim) &&
         s.codes_offset % 16 == 0 && s.meta_offset % 16 == 0 &&
         (!f.head_scale || s.head_scales != nullptr) && (!kc || kc_layout_ok(l));
}

// Launch seal_kernel over the tokens of an append, for INT4-KC keys (`ks` their window side).
// A thread block scans up to kSealThreads tokens: fewer when the append is small (as few as 32,
// so a launch has about kSealThreads thread blocks or more), which spreads the sealing of a
// decode step whose tokens all fill their blocks over more SMs.
int launch_seal(const PagedSide &ks, const void *slots, int32_t slots_i64, int64_t num_tokens,
                int64_t num_slots, cudaStream_t s) {
  const int64_t spread = num_tokens * ks.num_heads / kSealThreads / 32 * 32;
  const int tokens_per_block = (int)std::min<int64_t>(std::max<int64_t>(spread, 32), kSealThreads);
  const dim3 grid((unsigned)((num_tokens + tokens_per_block - 1) / tokens_per_block),
                  (unsigned)std::min(ks.num_heads, 65535));
  const int pairs = ks.head_dim / 2;
  const int rounds = (pairs + kSealThreads - 1) / kSealThreads;  // head_dim_ok: at most 4
  const FastDiv by_pairs((uint32_t)pairs);
  auto go = [&](auto g, auto r) {
    seal_kernel<decltype(g)::value, decltype(r)::value><<<grid, kSealThreads, 0, s>>>(
        ks, slots, slots_i64 != 0, (uint32_t)num_tokens, num_slots, tokens_per_block, by_pairs);
    return launch_status();
  };
  auto with_rounds = [&](auto g) {
    static_assert(kSealMaxRounds == 4, "R of 1, 2 or 4 covers kMaxHeadDim");
    if (rounds <= 1) return go(g, std::integral_constant<int, 1>{});
    if (rounds <= 2) return go(g, std::integral_constant<int, 2>{});
    return go(g, std::integral_constant<int, 4>{});
  };
  switch (ks.block_size) {
  case 16: return with_rounds(std::integral_constant<int, 16>{});
  case 32: return with_rounds(std::integral_constant<int, 32>{});
  case 64: return with_rounds(std::integral_constant<int, 64>{});
  default: return KVQ_ERR_INVALID;  // kc_layout_ok admits no other
  }
}

}  // namespace
}  // namespace kvq

using namespace kvq;

extern "C" int kvq_append(const kvq_cache *cache, int64_t num_blocks, const void *slots,
                          int32_t slots_i64, int64_t num_tokens, const void *k, const void *v,
                          int32_t dtype, int64_t k_token_stride, int64_t v_token_stride,
                          unsigned long long *counters, void *stream) {
  if (cache == nullptr || num_tokens < 0 || num_blocks <= 0) return KVQ_ERR_INVALID;
  if (num_tokens == 0) return KVQ_OK;
  PagedSide ks, vs;
  if (!paged_side(*cache, true, ks) || !paged_side(*cache, false, vs)) return KVQ_ERR_INVALID;
  const int64_t row_elems = (int64_t)ks.num_heads * ks.head_dim;
  if (slots == nullptr || k == nullptr || v == nullptr || !aligned16(k) || !aligned16(v) ||
      k_token_stride < row_elems || v_token_stride < row_elems || k_token_stride % kChunk != 0 ||
      v_token_stride % kChunk != 0)
    return KVQ_ERR_INVALID;
  // Rows and slots are counted in 32 bits on the device.
  const int64_t num_slots = num_blocks * ks.block_size;
  if (num_tokens * ks.num_heads > kMaxRows || num_slots > kMaxRows) return KVQ_ERR_UNSUPPORTED;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  auto launch_side = [&](const void *x, int64_t stride, const PagedSide &side, int32_t format,
                         bool count_out_of_range) {
    return with_dtype(dtype, [&](auto in) {
      using In = typename decltype(in)::type;
      return with_format<false>(format, [&](auto f) {
        constexpr int F = decltype(f)::value;
        const RowShape shape(side.head_dim, Codec<F>::kEpt);
        const unsigned grid =
            shape.blocks(num_tokens * side.num_heads, AppendTuning<In, F>::kRows);
        return with_row_reduction<F>(shape, [&](auto k) {
          append_kernel<In, decltype(k)::value><<<grid, kThreadsPerBlock, 0, s>>>(
              shape, static_cast<const In *>(x), stride, (uint32_t)num_tokens, slots,
              slots_i64 != 0, num_slots, side, count_out_of_range, counters);
          return launch_status();
        });
      });
    });
  };
  // INT4-KC keys go to their blocks' windows as f16, then the blocks this append filled are
  // sealed (after the K pass, on the same stream).
  const bool kc = cache->layout.k_format == KVQ_INT4_KC;
  const int rk = launch_side(k, k_token_stride, ks, kc ? KVQ_F16 : cache->layout.k_format, true);
  if (rk != KVQ_OK) return rk;
  // A skipped token is counted once, by the K pass.
  const int rv = launch_side(v, v_token_stride, vs, cache->layout.v_format, false);
  if (rv != KVQ_OK || !kc) return rv;
  return launch_seal(ks, slots, slots_i64, num_tokens, num_slots, s);
}

extern "C" int kvq_gather_dequantize(const kvq_cache *cache, int64_t num_blocks,
                                     const int32_t *block_table, int64_t num_tokens,
                                     int32_t out_dtype, void *k_out, void *v_out,
                                     unsigned long long *counters, void *stream) {
  if (cache == nullptr || block_table == nullptr || num_tokens < 0 || num_blocks <= 0)
    return KVQ_ERR_INVALID;
  if (num_tokens == 0) return KVQ_OK;
  PagedSide ks, vs;
  if (!paged_side(*cache, true, ks) || !paged_side(*cache, false, vs)) return KVQ_ERR_INVALID;
  if ((k_out != nullptr && !aligned16(k_out)) || (v_out != nullptr && !aligned16(v_out)))
    return KVQ_ERR_INVALID;
  if (num_tokens * ks.num_heads > kMaxRows) return KVQ_ERR_UNSUPPORTED;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  bool counted = false;
  auto launch_side = [&](void *out, const PagedSide &side, int32_t format) {
    if (out == nullptr) return (int)KVQ_OK;
    // Count out-of-range blocks once, on the first side gathered.
    unsigned long long *c = counted ? nullptr : counters;
    counted = true;
    return with_dtype(out_dtype, [&](auto o) {
      using Out = typename decltype(o)::type;
      if (format == KVQ_INT4_KC) {
        const RowShape shape(side.head_dim, kChunk);
        gather_kc_kernel<Out><<<shape.blocks(num_tokens * side.num_heads), kThreadsPerBlock, 0,
                                s>>>(shape, side, block_table, (uint32_t)num_tokens, num_blocks,
                                     static_cast<Out *>(out), c);
        return launch_status();
      }
      return with_format<false>(format, [&](auto f) {
        const RowShape shape(side.head_dim, Codec<decltype(f)::value>::kEpt);
        const unsigned grid = shape.blocks(num_tokens * side.num_heads);
        gather_kernel<Out, decltype(f)::value><<<grid, kThreadsPerBlock, 0, s>>>(
            shape, side, block_table, (uint32_t)num_tokens, num_blocks, static_cast<Out *>(out),
            c);
        return launch_status();
      });
    });
  };
  const int rk = launch_side(k_out, ks, cache->layout.k_format);
  if (rk != KVQ_OK) return rk;
  return launch_side(v_out, vs, cache->layout.v_format);
}

extern "C" int kvq_decode_context(const kvq_cache *cache, int64_t num_blocks,
                                  const int32_t *block_tables, int32_t max_blocks,
                                  const int32_t *context_lens, int32_t batch,
                                  int32_t max_context_len, const kvq_cache *dst,
                                  int64_t dst_blocks, int32_t *dst_tables,
                                  int32_t dst_max_blocks, unsigned long long *counters,
                                  void *stream) {
  if (cache == nullptr || dst == nullptr || block_tables == nullptr || context_lens == nullptr ||
      dst_tables == nullptr || num_blocks <= 0 || dst_blocks < 0 || max_blocks <= 0 ||
      dst_max_blocks <= 0 || batch < 0 || max_context_len < 0)
    return KVQ_ERR_INVALID;
  const kvq_layout &l = cache->layout, &d = dst->layout;
  const int32_t out_format = d.k_format;
  if ((out_format != KVQ_F16 && out_format != KVQ_BF16) || d.v_format != out_format ||
      d.num_kv_heads != l.num_kv_heads || d.head_dim != l.head_dim ||
      d.block_size != l.block_size)
    return KVQ_ERR_INVALID;
  PagedSide ks, vs, dks, dvs;
  if (!paged_side(*cache, true, ks) || !paged_side(*cache, false, vs) ||
      !paged_side(*dst, true, dks) || !paged_side(*dst, false, dvs))
    return KVQ_ERR_INVALID;
  if (batch == 0 || max_context_len == 0) return KVQ_OK;
  if (batch > 65535) return KVQ_ERR_UNSUPPORTED;  // grid y; the Rust API never asks for more
  if ((int64_t)max_context_len * ks.num_heads > kMaxRows) return KVQ_ERR_UNSUPPORTED;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The K side writes the scratch tables and counts out-of-range blocks.
  const bool bf16_out = out_format == KVQ_BF16;
  auto launch_side = [&](const PagedSide &side, const PagedSide &to, int32_t format,
                         int32_t *tables, unsigned long long *c) {
    auto launch = [&](auto f) {
      constexpr int F = decltype(f)::value;
      const RowShape shape(side.head_dim, chunk_elements<F>());
      const dim3 grid(shape.blocks((int64_t)max_context_len * side.num_heads), (unsigned)batch);
      decode_context_kernel<F><<<grid, kThreadsPerBlock, 0, s>>>(
          shape, side, to, block_tables, max_blocks, context_lens, num_blocks, dst_blocks,
          tables, dst_max_blocks, bf16_out, c);
      return launch_status();
    };
    if (format == KVQ_INT4_KC) return launch(FormatTag<kInt4Kc>{});
    return with_format<false>(format, launch);
  };
  const int rk = launch_side(ks, dks, l.k_format, dst_tables, counters);
  if (rk != KVQ_OK) return rk;
  return launch_side(vs, dvs, l.v_format, nullptr, nullptr);
}

extern "C" int kvq_dense_scales(int32_t format, const void *x, int32_t dtype, int64_t rows,
                                int32_t heads, int32_t head_dim, int32_t per_head,
                                float *scales_out, uint32_t *amax_scratch, void *stream) {
  const bool uniform = format == KVQ_DENSE_INT4_UNIFORM;
  FormatInfo f = {};
  const bool head_scaled = format_info(format, f) && f.head_scale;
  if (!(uniform || head_scaled) || x == nullptr || !aligned16(x) || scales_out == nullptr ||
      amax_scratch == nullptr || rows < 0 || heads <= 0 || head_dim <= 0 ||
      (uniform && (per_head || head_dim % 2 != 0)) || (!uniform && !head_dim_ok(f, head_dim)))
    return KVQ_ERR_INVALID;
  const int n_scales = per_head ? heads : 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(amax_scratch, 0, sizeof(uint32_t) * n_scales, s) != cudaSuccess)
    return launch_status();
  const int64_t n = rows * head_dim;
  if (n > 0) {
    const int r = with_dtype(dtype, [&](auto in) {
      using In = typename decltype(in)::type;
      amax_kernel<In><<<blocks_for((n + kChunk - 1) / kChunk), kThreadsPerBlock, 0, s>>>(
          static_cast<const In *>(x), n, head_dim, heads, per_head, amax_scratch);
      return launch_status();
    });
    if (r != KVQ_OK) return r;
  }
  const unsigned grid = blocks_for(n_scales);
  // Not uniform: a format with a head scale (checked above), which its codec calibrates.
  constexpr auto kernels = scales_kernels(AllFormats{});
  const ScalesKernel kernel =
      uniform ? scales_from_amax_kernel<KVQ_DENSE_INT4_UNIFORM> : kernels[format];
  kernel<<<grid, kThreadsPerBlock, 0, s>>>(amax_scratch, n_scales, scales_out);
  return launch_status();
}

namespace {
/// The checks both uniform-INT4 dense launchers make: KVQ_OK with `n` = elements, or the error.
int uniform_elems(int64_t rows, int32_t head_dim, const float *head_scales,
                  int32_t num_head_scales, int64_t &n) {
  if (head_dim <= 0 || head_dim % 2 != 0 || head_scales == nullptr || num_head_scales != 1)
    return KVQ_ERR_INVALID;
  n = rows * head_dim;
  return KVQ_OK;
}

/// The checks both row-wise dense launchers make, and the rows they launch over: KVQ_OK with
/// `out` filled, or the error to return.
int dense_rows(int32_t format, uint8_t *codes, const float *head_scales, int32_t num_head_scales,
               void *scales, uint16_t *group_zeros, int64_t rows, int32_t heads,
               int32_t head_dim, DenseRows &out) {
  FormatInfo f;
  if (!format_info(format, f) || !head_dim_ok(f, head_dim)) return KVQ_ERR_INVALID;
  const int g = f.group;
  if (f.head_scale && (head_scales == nullptr || (num_head_scales != 1 && num_head_scales != heads)))
    return KVQ_ERR_INVALID;
  // Scales per group or, for a row-group codec, per row; zeros per group when affine.
  if ((g != 0 || f.row_group) &&
      (scales == nullptr || (f.group_entries > 1 && group_zeros == nullptr)))
    return KVQ_ERR_INVALID;
  if (rows > kMaxRows) return KVQ_ERR_UNSUPPORTED;
  out = {codes,
         static_cast<uint16_t *>(scales),
         group_zeros,
         f.code_bytes(head_dim),
         g != 0 ? head_dim / g : 0,
         heads,
         num_head_scales,
         f.head_scale ? head_scales : nullptr,
         FastDiv((uint32_t)heads)};
  return KVQ_OK;
}

/// The int4-kc dense tensor's pair geometry (quantize_kc_dense_kernel), as both launchers check
/// it: KVQ_OK with `out` filled, or the error to return. Pairs are counted in 32 bits.
struct KcDense {
  uint32_t tokens, plane_pairs, pairs;
};
int kc_dense(int64_t rows, int32_t heads, int32_t head_dim, const void *scales,
             const void *group_zeros, KcDense &out) {
  const auto aligned4 = [](const void *p) { return (reinterpret_cast<uintptr_t>(p) & 3) == 0; };
  if (head_dim <= 0 || head_dim % 2 != 0 || rows % heads != 0 || scales == nullptr ||
      group_zeros == nullptr || !aligned4(scales) || !aligned4(group_zeros))
    return KVQ_ERR_INVALID;
  // rows <= 2^31 and head_dim < 2^31: no overflow in 64 bits.
  if (rows > kMaxRows || rows * head_dim / 2 > kMaxRows) return KVQ_ERR_UNSUPPORTED;
  out.tokens = (uint32_t)(rows / heads);
  out.plane_pairs = (uint32_t)((int64_t)heads * head_dim / 2);  // <= pairs when rows > 0
  out.pairs = (uint32_t)(rows * head_dim / 2);
  return KVQ_OK;
}
}  // namespace

extern "C" int kvq_quantize_dense(int32_t format, const void *x, int32_t dtype, int64_t rows,
                                  int32_t heads, int32_t head_dim, const float *head_scales,
                                  int32_t num_head_scales, uint8_t *codes, void *scales,
                                  uint16_t *group_zeros, unsigned long long *counters,
                                  void *stream) {
  if (x == nullptr || !aligned16(x) || codes == nullptr || !aligned16(codes) || rows < 0 ||
      heads <= 0)
    return KVQ_ERR_INVALID;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (format == KVQ_INT4_KC) {
    KcDense kc;
    const int status = kc_dense(rows, heads, head_dim, scales, group_zeros, kc);
    if (status != KVQ_OK || rows == 0) return status;
    const uint32_t tasks = (kc.tokens + kKcDenseGroup - 1) / kKcDenseGroup * kc.plane_pairs;
    return with_dtype(dtype, [&](auto in) {
      using In = typename decltype(in)::type;
      quantize_kc_dense_kernel<In><<<blocks_for(tasks), kThreadsPerBlock, 0, s>>>(
          static_cast<const In *>(x), kc.tokens, kc.plane_pairs, FastDiv(kc.plane_pairs), tasks,
          codes, static_cast<uint32_t *>(scales), reinterpret_cast<uint32_t *>(group_zeros),
          counters);
      return launch_status();
    });
  }
  if (format == KVQ_DENSE_INT4_UNIFORM) {
    int64_t n = 0;
    const int status = uniform_elems(rows, head_dim, head_scales, num_head_scales, n);
    if (status != KVQ_OK || n == 0) return status;
    return with_dtype(dtype, [&](auto in) {
      using In = typename decltype(in)::type;
      quantize_uniform_kernel<In><<<blocks_for((n + kChunk - 1) / kChunk), kThreadsPerBlock, 0,
                                    s>>>(static_cast<const In *>(x), n, head_scales, codes,
                                         counters);
      return launch_status();
    });
  }
  DenseRows dst;
  const int status = dense_rows(format, codes, head_scales, num_head_scales, scales,
                                group_zeros, rows, heads, head_dim, dst);
  if (status != KVQ_OK || rows == 0) return status;
  return with_dtype(dtype, [&](auto in) {
    using In = typename decltype(in)::type;
    return with_format<true>(format, [&](auto f) {
      constexpr int F = decltype(f)::value;
      const RowShape shape(head_dim, Codec<F>::kEpt);
      const unsigned grid = shape.blocks(rows);
      return with_row_reduction<F>(shape, [&](auto k) {
        quantize_dense_kernel<In, decltype(k)::value><<<grid, kThreadsPerBlock, 0, s>>>(
            shape, static_cast<const In *>(x), (uint32_t)rows, dst, counters);
        return launch_status();
      });
    });
  });
}

extern "C" int kvq_dequantize_dense(int32_t format, const uint8_t *codes,
                                    const float *head_scales, int32_t num_head_scales,
                                    const void *scales, const uint16_t *group_zeros,
                                    int64_t rows, int32_t heads, int32_t head_dim,
                                    int32_t out_dtype, void *out, void *stream) {
  if (codes == nullptr || !aligned16(codes) || out == nullptr || !aligned16(out) || rows < 0 ||
      heads <= 0)
    return KVQ_ERR_INVALID;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (format == KVQ_INT4_KC) {
    KcDense kc;
    const int status = kc_dense(rows, heads, head_dim, scales, group_zeros, kc);
    if (status != KVQ_OK || rows == 0) return status;
    return with_dtype(out_dtype, [&](auto o) {
      using Out = typename decltype(o)::type;
      dequantize_kc_dense_kernel<Out><<<blocks_for(kc.pairs), kThreadsPerBlock, 0, s>>>(
          codes, static_cast<const uint32_t *>(scales),
          reinterpret_cast<const uint32_t *>(group_zeros), kc.pairs, kc.plane_pairs,
          FastDiv(kc.plane_pairs), static_cast<Out *>(out));
      return launch_status();
    });
  }
  if (format == KVQ_DENSE_INT4_UNIFORM) {
    int64_t n = 0;
    const int status = uniform_elems(rows, head_dim, head_scales, num_head_scales, n);
    if (status != KVQ_OK || n == 0) return status;
    return with_dtype(out_dtype, [&](auto o) {
      using Out = typename decltype(o)::type;
      dequantize_uniform_kernel<Out><<<blocks_for((n + kChunk - 1) / kChunk), kThreadsPerBlock,
                                       0, s>>>(codes, n, head_scales, static_cast<Out *>(out));
      return launch_status();
    });
  }
  // The kernel only reads through src.
  DenseRows src;
  const int status = dense_rows(format, const_cast<uint8_t *>(codes), head_scales,
                                num_head_scales, const_cast<void *>(scales),
                                const_cast<uint16_t *>(group_zeros), rows, heads, head_dim, src);
  if (status != KVQ_OK || rows == 0) return status;
  return with_dtype(out_dtype, [&](auto o) {
    using Out = typename decltype(o)::type;
    return with_format<true>(format, [&](auto f) {
      const RowShape shape(head_dim, Codec<decltype(f)::value>::kEpt);
      const unsigned grid = shape.blocks(rows);
      dequantize_dense_kernel<Out, decltype(f)::value><<<grid, kThreadsPerBlock, 0, s>>>(
          shape, src, (uint32_t)rows, static_cast<Out *>(out));
      return launch_status();
    });
  });
}

extern "C" const char *kvq_last_error(void) { return cudaGetErrorString(g_last_error); }

extern "C" int kvq_last_error_code(void) { return static_cast<int>(g_last_error); }
