// prefill.cu: the C launchers of attention over the paged cache for any query length (kvq.h):
// the kernel instances (head_dim x operand type; the cache formats are decoded by run-time
// codec choice inside the kernels, prefill/decode_rows.cuh; int4-kc keys, which have no row
// codec, by instances of their own), the split merge, and merge_states.
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "kvq.h"
#include "prefill/kernel.cuh"
#include "prefill/ws_kernel.cuh"
#include "prim/pdl.cuh"
#include "prim/warp.cuh"

namespace kvq_prefill {
namespace {

/// Whether (head_dim, K and V operand types) has a wide-tile instance (kWideRows rows a block,
/// two warpgroups): the head dims wgmma serves, one operand type on both sides.
template <int D, bool KB, bool VB> constexpr bool has_wide() {
  return (D == 64 || D == 128) && KB == VB;
}

/// int4-kc keys: head_dim a multiple of this (whole 16-byte vectors of codes, 32 elements:
/// KvFormat::head_dim_multiple), as the cache layout asks.
constexpr int kKcHeadDimMultiple = 32;

/// Call fn.template run<D, KB, VB, R, KC>() for a head_dim, the operand types of K and V, int4-kc
/// keys (KC: f16 key operands) and the tile rows (wide where the instance exists), or return
/// KVQ_ERR_UNSUPPORTED.
template <class Fn> int dispatch(int d, bool kb, bool vb, bool kc, bool wide, Fn &fn) {
  auto rows = [&](auto dim, auto k_bf16, auto v_bf16, auto kc_keys) -> int {
    constexpr int D = decltype(dim)::value;
    constexpr bool KB = decltype(k_bf16)::value, VB = decltype(v_bf16)::value;
    constexpr bool KC = decltype(kc_keys)::value;
    if constexpr (KC && (KB || D % kKcHeadDimMultiple != 0)) {
      return KVQ_ERR_UNSUPPORTED;
    } else {
      if constexpr (has_wide<D, KB, VB>())
        if (wide) return fn.template run<D, KB, VB, kWideRows, KC>();
      return fn.template run<D, KB, VB, kRows, KC>();
    }
  };
  auto go = [&](auto dim) -> int {
    using T = std::true_type;
    using F = std::false_type;
    if (kc) {
      if (kb) return KVQ_ERR_UNSUPPORTED;
      return vb ? rows(dim, F{}, T{}, T{}) : rows(dim, F{}, F{}, T{});
    }
    if (kb) return vb ? rows(dim, T{}, T{}, F{}) : rows(dim, T{}, F{}, F{});
    return vb ? rows(dim, F{}, T{}, F{}) : rows(dim, F{}, F{}, F{});
  };
  switch (d) {
    case 64: return go(std::integral_constant<int, 64>{});
    case 80: return go(std::integral_constant<int, 80>{});
    case 96: return go(std::integral_constant<int, 96>{});
    case 112: return go(std::integral_constant<int, 112>{});
    case 128: return go(std::integral_constant<int, 128>{});
    case 192: return go(std::integral_constant<int, 192>{});
    case 256: return go(std::integral_constant<int, 256>{});
    default: return KVQ_ERR_UNSUPPORTED;
  }
}

/// What the prefill needs to know of a side's format, from its codec.
struct Role {
  bool ok;          // the codec takes this role (decode's kDecodeK / kDecodeV)
  bool bf16;        // its operands are bf16 (kBf16Operands)
  bool head_scale;  // an f32 scale per KV head outside the rows (kHeadScale)
  int multiple;     // head_dim must be a multiple of this (FormatInfo::head_dim_multiple)
};
Role role_of(int32_t format, bool v) {
  Role r{false, false, false, 0};
  // int4-kc: keys only, decoded to f16 operands by the KC instances.
  if (format == KVQ_INT4_KC) return {!v, false, false, kKcHeadDimMultiple};
  FormatInfo info{};
  if (!format_info(format, info)) return r;
  with_format<false>(format, [&](auto f) {
    using C = Codec<decltype(f)::value>;
    r = {v ? C::kDecodeV : C::kDecodeK, C::kBf16Operands, C::kHeadScale,
         info.head_dim_multiple};
    return (int)KVQ_OK;
  });
  return r;
}

/// Whether a (K, V, head_dim, q dtype) has a kernel: each format in a role its codec takes,
/// head_dim one of the instances' and whole groups of each side, bf16 queries for bf16 key
/// operands.
bool supported(int32_t k, int32_t v, int32_t d, int32_t q_dtype) {
  if (q_dtype != KVQ_DTYPE_F16 && q_dtype != KVQ_DTYPE_BF16) return false;
  const Role rk = role_of(k, false), rv = role_of(v, true);
  if (!rk.ok || !rv.ok) return false;
  if (d != 64 && d != 80 && d != 96 && d != 112 && d != 128 && d != 192 && d != 256) return false;
  if (d % rk.multiple != 0 || d % rv.multiple != 0) return false;
  if (rk.bf16 && q_dtype != KVQ_DTYPE_BF16) return false;
  return true;
}

/// Raise a kernel's dynamic shared-memory limit to all the device gives a block beside its
/// static shared memory, once per device (`done` bit d: done on device d < 64; launches after
/// the first, e.g. under graph capture, make no attribute-setting calls); `*limit` gets that
/// limit and `*attr_out` (if not null) the kernel's attributes.
cudaError_t prepare_kernel(const void *fn, std::atomic<uint64_t> &done, int *limit,
                           cudaFuncAttributes *attr_out) {
  int dev = 0, optin = 0;
  cudaFuncAttributes attr{};
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, fn);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not left pending for the next launcher to report
    return e;
  }
  *limit = optin - (int)attr.sharedSizeBytes;
  if (attr_out != nullptr) *attr_out = attr;
  const uint64_t bit = dev < 64 ? (1ull << dev) : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, *limit);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  else (void)cudaGetLastError();
  return e;
}

template <int D, bool KB, bool VB, int R, bool KC> cudaError_t prepare(int *limit) {
  static std::atomic<uint64_t> done{0};
  return prepare_kernel((const void *)prefill_kernel<D, KB, VB, R, KC>, done, limit, nullptr);
}

/// Whether both sides are fp8-e4m3, whose codes the E4M3 instances take as MMA operands.
bool e4m3_sides(const Side &k, const Side &v) {
  return k.format == KVQ_FP8_E4M3 && v.format == KVQ_FP8_E4M3;
}

/// Call fn(std::bool_constant<QUANT>, std::bool_constant<E4M3>) for the warp-specialized
/// instance of sides k and v of operand type KB (QUANT: both quantized, decoded to f16 operands;
/// ws_sides), E4M3 where `e4m3` asks for E4M3 operands and both sides are fp8-e4m3.
template <bool KB, class Fn>
cudaError_t with_ws(const Side &k, const Side &v, bool e4m3, Fn &&fn) {
  using T = std::true_type;
  using F = std::false_type;
  if constexpr (KB) return fn(F{}, F{});
  else if (k.direct) return fn(F{}, F{});
  else return e4m3 && e4m3_sides(k, v) ? fn(T{}, T{}) : fn(T{}, F{});
}

/// Whether an instance may take its raw rows kWsRawDeep steps ahead: decoded sides at wide
/// tiles. (E4M3 operands measured 1-3 % faster one step ahead, at wide and narrow tiles; decoded
/// narrow tiles, which two blocks an SM leave room for only with INT4 and FP4, level.)
template <bool QUANT, int R, bool E4M3> constexpr bool may_go_deep() {
  return QUANT && R == kWideRows && !E4M3;
}

/// Call fn(std::integral_constant<int, A>) for the instance's raw steps ahead: kWsRawDeep where
/// `ahead` says so (may_go_deep), else 1.
template <bool QUANT, int R, bool E4M3, class Fn> cudaError_t with_ahead(int ahead, Fn &&fn) {
  if constexpr (may_go_deep<QUANT, R, E4M3>())
    if (ahead == kWsRawDeep) return fn(std::integral_constant<int, kWsRawDeep>{});
  return fn(std::integral_constant<int, 1>{});
}

/// Whether the warp-specialized kernel (prefill/ws_kernel.cuh) may serve an instance: head_dim
/// 128 and sides it takes (ws_sides). KVQ_PREFILL_WS=0 turns it off, for A/B runs against the
/// block-synchronous kernel.
template <int D, bool KB, bool VB, int R, bool KC>
bool ws_serves(const Side &k, const Side &v) {
  static const bool off = kvq::env_switch("KVQ_PREFILL_WS") == 0;
  return D == kWsD && !KC && ws_sides(k, v, KB, VB) && !off;
}

/// Prepare the warp-specialized kernel of operand type KB at tiles of R rows for sides k and v;
/// *usable is false where its layout does not fit or the device runs code of it built without
/// sm_90a features: other GPUs, or PTX alone JIT-compiled for a Hopper GPU, whose stub (binary
/// version 90 too) declares no shared memory, unlike the kernel.
template <bool KB, bool QUANT, int R, int A, bool E4M3>
cudaError_t prepare_ws(const Side &k, const Side &v, bool *usable) {
  static std::atomic<uint64_t> done{0};
  int limit = 0;
  cudaFuncAttributes attr{};
  const cudaError_t e = prepare_kernel((const void *)prefill_ws_kernel<KB, KB, QUANT, R, A, E4M3>,
                                       done, &limit, &attr);
  *usable = e == cudaSuccess && attr.binaryVersion == 90 && attr.sharedSizeBytes > 0 &&
            ws_layout(k, v, R, A, E4M3).bytes <= limit;
  return e;
}

/// The warp-specialized kernel's instance for a launch: whether it serves it, its raw steps
/// ahead (kWsRawDeep where that layout fits, else 1; KVQ_PREFILL_RAW_DEEP=0 forces 1, for A/B)
/// and its dynamic shared memory.
struct WsChoice {
  bool usable = false;
  int ahead = 1;
  int bytes = 0;
};

/// Prepare the warp-specialized kernel for an instance (E4M3 operands where `e4m3` asks for them
/// and the sides are fp8-e4m3): KVQ_OK with *choice (usable false where it does not serve the
/// instance), or KVQ_ERR_LAUNCH (the error recorded).
template <int D, bool KB, bool VB, int R, bool KC>
int ws_instance(const Side &k, const Side &v, bool e4m3, WsChoice *choice) {
  *choice = WsChoice{};
  if (!ws_serves<D, KB, VB, R, KC>(k, v)) return KVQ_OK;
  bool e4m3_instance = false;  // the instance prepared takes E4M3 operands
  const cudaError_t e = with_ws<KB>(k, v, e4m3, [&](auto q, auto e8) {
    constexpr bool Q = decltype(q)::value, E = decltype(e8)::value;
    e4m3_instance = E;
    if constexpr (may_go_deep<Q, R, E>()) {
      static const bool shallow = kvq::env_switch("KVQ_PREFILL_RAW_DEEP") == 0;
      if (!shallow) {
        const cudaError_t deep = prepare_ws<KB, Q, R, kWsRawDeep, E>(k, v, &choice->usable);
        if (deep != cudaSuccess || choice->usable) {
          choice->ahead = kWsRawDeep;
          return deep;
        }
      }
    }
    return prepare_ws<KB, Q, R, 1, E>(k, v, &choice->usable);
  });
  if (e != cudaSuccess) {
    set_last_error(e);
    return KVQ_ERR_LAUNCH;
  }
  choice->bytes = ws_layout(k, v, R, choice->ahead, e4m3_instance).bytes;
  return KVQ_OK;
}

/// Whether a quantized warp-specialized launch copies each run as its page's head section
/// (Params::ws_whole_runs): pages of one run whose section is laid out as the staging run `l`
/// (ws_run_layout). KVQ_PREFILL_WHOLE_RUNS=0 forces a copy a side and a region (A/B).
bool ws_whole_runs(const Params &p, const RunLayout &l) {
  static const bool off = kvq::env_switch("KVQ_PREFILL_WHOLE_RUNS") == 0;
  return !off && p.block_size == kRun && p.k.codes_off == l.k_codes &&
         (p.k.meta_row == 0 || p.k.meta_off == l.k_meta) && p.v.codes_off == l.v_codes &&
         (p.v.meta_row == 0 || p.v.meta_off == l.v_meta);
}

/// Whether the quantized producer warps of the warp-specialized kernel take turns at a step's
/// copies (Params::ws_turns), where `whole` runs are one copy each (ws_whole_runs). One warp
/// issuing all four runs' copies every kPW steps measured faster (H100): with E4M3 operands
/// (-4 % on the 4k prompt); with whole runs at narrow tiles (INT4 extends -4 to -8 %) and, for
/// sides without metadata, at wide ones (decoded FP8 -1 to -2 %); with a copy a side and a
/// region, only at narrow tiles without metadata (decoded FP8 extends -8 to -9 %). Slower: whole
/// runs with metadata at wide tiles (INT4 +1 to +3 %); a copy a side and a region for INT4 (+3
/// to +9 %) and wide FP8 tiles (+3 to +4 %). KVQ_PREFILL_TURNS=0 or 1 forces it (A/B).
bool ws_turns(const Params &p, int r, bool e4m3, bool whole) {
  static const int forced = kvq::env_switch("KVQ_PREFILL_TURNS");
  if (forced >= 0) return forced == 1;
  const bool narrow = r == kRows, no_meta = p.k.meta_row == 0 && p.v.meta_row == 0;
  return e4m3 || (whole ? narrow || no_meta : narrow && no_meta);
}

/// Triple tiles' time a row against wide tiles' where the grid runs many waves, by the sides'
/// code width (4k prompts at B=4 on an H100, session 35): 16-bit sides 0.88, decoded 8-bit
/// codes 0.84 (their producers' decode serves 1.5 times the rows a step), narrower codes 0.93.
double triple_row_cost(const Side &k, const Side &v) {
  if (k.direct && v.direct) return 0.88;
  kvq::FormatInfo fk{}, fv{};
  kvq::format_info(k.format, fk);
  kvq::format_info(v.format, fv);
  return fk.bits == 8 && fv.bits == 8 ? 0.84 : 0.93;
}

/// Whether a launch of wide tiles takes triple ones where they serve (triple_instance): as
/// `wide_tile_rows` asks (the caller's choice from its sequences: the Rust plan's model of
/// src/cuda/prefill/heuristic.rs), or where it is 0 by this estimate of the launch from the
/// capacity alone. A tile's rows past its sequence cost as much as the others, and a grid's last
/// wave can leave SMs idle, so the launch's time is estimated as its waves (blocks over SMs,
/// rounded up) times the rows of a tile, at triple_row_cost for triple tiles, its sequences
/// taken as of even rows; and triple tiles need two waves of blocks at least (a 1k chunk's 1.3
/// waves measured 1-7 % slower than wide tiles' 1.9). KVQ_PREFILL_TRIPLE=0 or 1 forces the
/// choice (A/B).
bool triple_tiles(const Params &p, unsigned kv_heads, int wide_tile_rows) {
  static const int forced = kvq::env_switch("KVQ_PREFILL_TRIPLE");
  if (forced >= 0) return forced == 1;
  if (wide_tile_rows != 0) return wide_tile_rows == kTripleRows;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms <= 0) {
    cudaGetLastError();  // (an error here only costs the choice)
    return false;
  }
  const int64_t seq_rows = ((int64_t)p.max_tokens * p.group + p.batch - 1) / p.batch;
  auto blocks = [&](int r) { return (seq_rows + r - 1) / r * p.batch * kv_heads * p.num_splits; };
  auto cost = [&](int r) { return (double)((blocks(r) + sms - 1) / sms) * r; };
  return blocks(kTripleRows) >= 2 * sms &&
         cost(kTripleRows) * triple_row_cost(p.k, p.v) <= cost(kWideRows);
}

/// Prepare the triple-tile instance where wide tiles on the warp-specialized kernel could take
/// it (16-bit or decoded sides; E4M3 operands, where `e4m3` asks for them, keep wide tiles):
/// KVQ_OK with *bytes its layout (0 where it does not serve or fit), or KVQ_ERR_LAUNCH.
template <int D, bool KB, bool VB, int R, bool KC>
int triple_instance(const Side &k, const Side &v, bool e4m3, int *bytes) {
  *bytes = 0;
  if constexpr (R == kWideRows && D == kWsD && !KC && KB == VB) {
    if (!ws_serves<D, KB, VB, R, KC>(k, v) || (e4m3 && e4m3_sides(k, v))) return KVQ_OK;
    bool usable = false;
    const cudaError_t e = with_ws<KB>(k, v, false, [&](auto q, auto) {
      return prepare_ws<KB, decltype(q)::value, kTripleRows, 1, false>(k, v, &usable);
    });
    if (e != cudaSuccess) {
      set_last_error(e);
      return KVQ_ERR_LAUNCH;
    }
    if (usable) *bytes = ws_layout(k, v, kTripleRows, 1).bytes;
  }
  return KVQ_OK;
}

/// Prepare an instance (its shared-memory limit) and check that its layout fits; *smem gets
/// the largest layout prepared.
struct Prepare {
  const Side &k, &v;
  int32_t *smem;
  template <int D, bool KB, bool VB, int R, bool KC> int run() {
    int limit = 0;
    const cudaError_t e = prepare<D, KB, VB, R, KC>(&limit);
    if (e != cudaSuccess) {
      set_last_error(e);
      return KVQ_ERR_LAUNCH;
    }
    int bytes = smem_layout<D, R>(k, v).bytes;
    if (bytes > limit) return KVQ_ERR_UNSUPPORTED;
    // Both the decoded and (fp8-e4m3 sides) the E4M3 instances: a launch may ask for either.
    for (const bool e4m3 : {false, true}) {
      if (e4m3 && !e4m3_sides(k, v)) continue;
      WsChoice ws;
      const int status = ws_instance<D, KB, VB, R, KC>(k, v, e4m3, &ws);
      if (status != KVQ_OK) return status;
      if (ws.usable) bytes = bytes > ws.bytes ? bytes : ws.bytes;
    }
    int triple = 0;
    const int status = triple_instance<D, KB, VB, R, KC>(k, v, false, &triple);
    if (status != KVQ_OK) return status;
    bytes = bytes > triple ? bytes : triple;
    *smem = bytes > *smem ? bytes : *smem;
    return KVQ_OK;
  }
};

/// The warp-specialized kernel's Params for a launch at tiles of r rows: for quantized sides
/// the staging of a run and how its copies are issued.
Params ws_params_of(const Params &p, bool quant, int r, bool e4m3) {
  Params w = p;
  w.ws_run = ws_run_layout(p.k, p.v);
  w.ws_whole_runs = quant && ws_whole_runs(p, w.ws_run);
  w.ws_turns = quant && ws_turns(p, r, e4m3, w.ws_whole_runs);
  return w;
}

struct Launch {
  const Params &p;
  unsigned kv_heads;
  int wide_tile_rows;  // kvq_prefill_args::wide_tile_rows
  cudaStream_t stream;
  bool ws = false;  // out: the warp-specialized kernel ran
  /// The grid of tiles of R rows for the capacity (sum over sequences of ceil(n_b G / R) <=
  /// ceil(total G / R) + batch); false where it is too large.
  template <int R> bool grid_of(dim3 *grid) const {
    const int64_t tiles = ((int64_t)p.max_tokens * p.group + R - 1) / R + p.batch;
    *grid = dim3((unsigned)tiles, kv_heads, (unsigned)p.num_splits);
    return tiles <= INT32_MAX;
  }
  template <int D, bool KB, bool VB, int R, bool KC> int run() {
    if constexpr (R == kWideRows && D == kWsD && !KC && KB == VB) {
      int triple = 0;
      if (triple_tiles(p, kv_heads, wide_tile_rows)) {
        const int status =
            triple_instance<D, KB, VB, R, KC>(p.k, p.v, p.e4m3_operands != 0, &triple);
        if (status != KVQ_OK) return status;
      }
      if (triple > 0) {
        constexpr int R3 = kTripleRows;
        dim3 grid;
        if (!grid_of<R3>(&grid)) return KVQ_ERR_UNSUPPORTED;
        with_ws<KB>(p.k, p.v, false, [&](auto q, auto) {
          constexpr bool Q = decltype(q)::value;
          prefill_ws_kernel<KB, KB, Q, R3, 1, false>
              <<<grid, ws_threads(Q, R3), triple, stream>>>(ws_params_of(p, Q, R3, false));
          return cudaSuccess;
        });
        ws = true;
        return launch_status();
      }
    }
    dim3 grid;
    if (!grid_of<R>(&grid)) return KVQ_ERR_UNSUPPORTED;
    WsChoice ws_choice;
    const bool e4m3 = p.e4m3_operands != 0;
    const int status = ws_instance<D, KB, VB, R, KC>(p.k, p.v, e4m3, &ws_choice);
    if (status != KVQ_OK) return status;
    if (ws_choice.usable) {
      with_ws<KB>(p.k, p.v, e4m3, [&](auto q, auto e8) {
        constexpr bool Q = decltype(q)::value, E = decltype(e8)::value;
        const Params ws_params = ws_params_of(p, Q, R, E);
        return with_ahead<Q, R, E>(ws_choice.ahead, [&](auto a) {
          constexpr int A = decltype(a)::value;
          prefill_ws_kernel<KB, KB, Q, R, A, E>
              <<<grid, ws_threads(Q, R), ws_choice.bytes, stream>>>(ws_params);
          return cudaSuccess;
        });
      });
      ws = true;
      return launch_status();
    }
    int limit = 0;
    const cudaError_t e = prepare<D, KB, VB, R, KC>(&limit);
    if (e != cudaSuccess) {
      set_last_error(e);
      return KVQ_ERR_LAUNCH;
    }
    const int bytes = smem_layout<D, R>(p.k, p.v).bytes;
    if (bytes > limit) return KVQ_ERR_UNSUPPORTED;
    prefill_kernel<D, KB, VB, R, KC><<<grid, threads_of<R>(), bytes, stream>>>(p);
    return launch_status();
  }
};

/// Wide tiles when the launch's sequences average at least kWideRows query rows (capacity over
/// batch): long prompts and chunks; extend and decode rows keep narrow ones, whose MMAs are
/// not padded past the rows.
bool wide_tiles(const Params &p) {
  return (int64_t)p.max_tokens * p.group >= (int64_t)kWideRows * p.batch;
}

constexpr int kMergeWarps = 8;
constexpr int kMergeMaxAhead = 8;  // splits whose partials one warp loads at once, at most

/// How the split merge covers a row: W warps (a power of two, at most a block's), each loading
/// its AHEAD splits' partials at once. A merge of few rows is bound by those loads' latency (a
/// warp a row reading a split at a time took 24 us for 512 rows of 33 splits, session 19), a
/// merge of many rows over few splits by how many warps fit an SM: the fewest warps for which a
/// warp's share is one group of at most kMergeMaxAhead loads, and no more loads (registers)
/// than that share.
struct MergeShape {
  int warps, ahead;
};
inline MergeShape merge_shape(int splits) {
  int w = 1;
  while (w < kMergeWarps && w * kMergeMaxAhead < splits) w *= 2;
  const int share = (splits + w - 1) / w;
  return {w, share <= 2 ? 2 : share <= 4 ? 4 : kMergeMaxAhead};
}

/// Blocks of the merge an SM holds: as many as the registers of a thread's AHEAD x PER loaded
/// values leave room for (no spills).
constexpr int merge_blocks_per_sm(int loaded) { return loaded <= 8 ? 8 : loaded <= 32 ? 4 : 2; }

/// Merge the splits' partials of every row of the launch's tokens (qo_indptr[0] up to
/// qo_indptr[batch]) and apply the sinks: W consecutive warps a row, warp x of them summing
/// splits x, x + W, ..., AHEAD at a time, then (W > 1) the W sums through shared memory. Every
/// warp of a row weighs the splits itself: lane l loads the lse of splits l and l + 32. Lane l
/// holds elements l, l + 32, ... (loads and stores of consecutive elements across the warp).
template <int D, int W, int AHEAD>
__global__ void __launch_bounds__(kMergeWarps * 32, merge_blocks_per_sm(AHEAD * ((D + 31) / 32)))
    merge_splits(const Params p) {
  static_assert(KVQ_PREFILL_MAX_SPLITS <= 64, "two splits' lse a lane");
  constexpr int PER = (D + 31) / 32, kRowsPerBlock = kMergeWarps / W;
  const int64_t first = (int64_t)min(max(p.qo_indptr[0], 0), p.max_tokens) * p.num_q_heads;
  const int64_t end = (int64_t)min(max(p.qo_indptr[p.batch], 0), p.max_tokens) * p.num_q_heads;
  const int splits = p.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, x = warp % W;
  const int64_t block_row = first + (int64_t)blockIdx.x * kRowsPerBlock;
  const int64_t row = block_row + warp / W;
  float acc[PER] = {};
  float inv = 0.f;
  wait_for_prerequisite_grids();  // the attention kernel's partials
  if (row < end) {
    const int h = (int)(row % p.num_q_heads);
    float ls[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int s = lane + 32 * k;
      ls[k] = s < splits ? __ldcg(p.ws_lse + s * p.ws_rows + row) : -INFINITY;
    }
    // Splits s0, s0 + W, ... (AHEAD of them); past the last split, its partial again
    // (weighted 0 below: no branch between the loads). The first group's loads are issued
    // before the weights wait for the lse.
    float v[AHEAD][PER];
    auto load_group = [&](int s0) {
#pragma unroll
      for (int j = 0; j < AHEAD; ++j) {
        const float *src = p.ws_o + (min(s0 + j * W, splits - 1) * p.ws_rows + row) * D;
#pragma unroll
        for (int i = 0; i < PER; ++i)
          v[j][i] = lane + 32 * i < D ? __ldcg(src + lane + 32 * i) : 0.f;
      }
    };
    load_group(x);
    float M = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
    M = fmaxf(M, group_max<32>(fmaxf(ls[0], ls[1])));
    float w[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) w[k] = ls[k] == -INFINITY ? 0.f : expf(ls[k] - M);
    for (int s0 = x;;) {
#pragma unroll
      for (int j = 0; j < AHEAD; ++j) {
        const int s = min(s0 + j * W, splits - 1);
        const float wt = __shfl_sync(kFull, s < 32 ? w[0] : w[1], s & 31);
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] += (s0 + j * W < splits ? wt : 0.f) * v[j][i];
      }
      s0 += W * AHEAD;
      if (s0 >= splits) break;
      load_group(s0);
    }
    float L = group_sum<32>(w[0] + w[1]);
    if (p.sinks != nullptr) L += expf(p.sinks[h] - M);
    inv = L > 0.f ? 1.f / L : 0.f;
    if (x == 0 && lane == 0 && p.lse != nullptr)
      p.lse[row / p.num_q_heads * p.l_tok + (int64_t)h * p.l_head] =
          L > 0.f ? M + logf(L) : -INFINITY;
  }
  auto out_at = [&](int64_t r) {
    return r / p.num_q_heads * p.o_tok + (r % p.num_q_heads) * p.o_head;
  };
  if constexpr (W == 1) {
    if (row < end)
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (lane + 32 * i < D)
          store_out(p.out, out_at(row) + lane + 32 * i, acc[i] * inv, p.out_dtype);
  } else {
    __shared__ float part[kMergeWarps][PER * 32];
    __shared__ float inv_l[kMergeWarps];  // 1 / L of a row, at its first warp
#pragma unroll
    for (int i = 0; i < PER; ++i) part[warp][lane + 32 * i] = acc[i];
    if (x == 0 && lane == 0) inv_l[warp] = inv;
    __syncthreads();
    // Element c of the block's row r (rows in order: the first past the end ends the loop).
    for (int e = threadIdx.x; e < kRowsPerBlock * D; e += kMergeWarps * 32) {
      const int r = e / D, c = e % D;
      if (block_row + r >= end) break;
      float sum = part[r * W][c];
#pragma unroll
      for (int k = 1; k < W; ++k) sum += part[r * W + k][c];
      store_out(p.out, out_at(block_row + r) + c, sum * inv_l[r * W], p.out_dtype);
    }
  }
}

struct MergeSplits {
  const Params &p;
  cudaStream_t stream;
  bool after_ws;  // the attention kernel was the warp-specialized one (sm_90a): launch early
  template <int D, bool, bool, int, bool> int run() {
    const MergeShape m = merge_shape(p.num_splits);
    const int64_t rows_per_block = kMergeWarps / m.warps;
    cudaLaunchAttribute early{};
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3((unsigned)((p.ws_rows + rows_per_block - 1) / rows_per_block));
    cfg.blockDim = dim3(kMergeWarps * 32);
    cfg.stream = stream;
    cfg.attrs = &early;
    cfg.numAttrs = after_ws ? 1 : 0;
    auto go = [&](auto kernel) { return cudaLaunchKernelEx(&cfg, kernel, p); };
    constexpr int A = kMergeMaxAhead;
    const cudaError_t e = m.warps == 8   ? go(merge_splits<D, 8, A>)
                          : m.warps == 4 ? go(merge_splits<D, 4, A>)
                          : m.warps == 2 ? go(merge_splits<D, 2, A>)
                          : m.ahead == A ? go(merge_splits<D, 1, A>)
                          : m.ahead == 4 ? go(merge_splits<D, 1, 4>)
                                         : go(merge_splits<D, 1, 2>);
    if (e == cudaSuccess) return KVQ_OK;
    (void)cudaGetLastError();
    set_last_error(e);
    return KVQ_ERR_LAUNCH;
  }
};

/// merge_states: warp per row, elements of type T.
template <typename T>
__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_two(const T *a, const float *a_lse, const T *b, const float *b_lse, T *out,
              float *out_lse, int64_t rows, int d) {
  const int64_t row = (int64_t)blockIdx.x * kMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float la = a_lse[row], lb = b_lse[row];
  const float M = fmaxf(la, lb);
  const float wa = la == -INFINITY ? 0.f : expf(la - M), wb = lb == -INFINITY ? 0.f : expf(lb - M);
  const float L = wa + wb;
  const float fa = L > 0.f ? wa / L : 0.f, fb = L > 0.f ? wb / L : 0.f;
  // Read every element of the row before writing any: out may alias a or b.
  for (int i = lane; i < d; i += 32) {
    const float x = fa * to_f32(a[row * d + i]) + fb * to_f32(b[row * d + i]);
    out[row * d + i] = from_f32<T>(x);
  }
  __syncwarp();
  if (lane == 0) out_lse[row] = L > 0.f ? M + logf(L) : -INFINITY;
}

}  // namespace
}  // namespace kvq_prefill

using namespace kvq_prefill;

extern "C" int kvq_prefill_supported(int32_t k_format, int32_t v_format, int32_t head_dim,
                                     int32_t q_dtype) {
  return supported(k_format, v_format, head_dim, q_dtype) ? 1 : 0;
}

namespace {
kvq_prefill::Side side_of(int32_t format, int32_t codes_off, int32_t codes_row, int32_t meta_off,
                          int32_t meta_row) {
  // int4-kc keys: meta_row is not the layout's (0: s and z are per block) but a staged step's
  // slots of s and z per kTokens rows (prefill/int4_kc.cuh), so that stage_bytes counts them.
  if (format == KVQ_INT4_KC) return {format, codes_off, codes_row, meta_off, codes_row / 2, 1, 0};
  kvq::FormatInfo f{};
  kvq::format_info(format, f);
  const int meta_step = f.group_entries > 1 ? f.group_entries : 1;  // scale, zero interleaved
  return {format, codes_off, codes_row, meta_off, meta_row, meta_step, f.bits == 16};
}
}  // namespace

extern "C" int kvq_prefill_prepare(const kvq_layout *l, int32_t q_dtype, int32_t *smem_bytes) {
  if (l == nullptr || smem_bytes == nullptr) return KVQ_ERR_INVALID;
  *smem_bytes = 0;
  if (!supported(l->k_format, l->v_format, l->head_dim, q_dtype)) return KVQ_ERR_UNSUPPORTED;
  const Side k = side_of(l->k_format, l->k_codes_offset, l->k_codes_row, l->k_meta_offset,
                         l->k_meta_row);
  const Side v = side_of(l->v_format, l->v_codes_offset, l->v_codes_row, l->v_meta_offset,
                         l->v_meta_row);
  const bool kb = role_of(l->k_format, false).bf16, vb = role_of(l->v_format, true).bf16;
  const bool kc = l->k_format == KVQ_INT4_KC;
  Prepare fn{k, v, smem_bytes};
  const int status = dispatch(l->head_dim, kb, vb, kc, false, fn);
  return status != KVQ_OK ? status : dispatch(l->head_dim, kb, vb, kc, true, fn);
}

extern "C" int kvq_prefill_attention(const kvq_prefill_args *a, void *stream) {
  if (a == nullptr) return KVQ_ERR_INVALID;
  const kvq_layout &l = a->cache.layout;
  if (!supported(l.k_format, l.v_format, l.head_dim, a->q_dtype)) return KVQ_ERR_UNSUPPORTED;
  if (a->out_dtype != KVQ_DTYPE_F16 && a->out_dtype != KVQ_DTYPE_BF16 &&
      a->out_dtype != KVQ_DTYPE_F32)
    return KVQ_ERR_UNSUPPORTED;
  if (l.block_size <= 0 || l.block_size % kRun != 0) return KVQ_ERR_UNSUPPORTED;
  // int4-kc keys: code rows of head_dim / 2 bytes, as the KC instances read them.
  if (l.k_format == KVQ_INT4_KC && l.k_codes_row != l.head_dim / 2) return KVQ_ERR_INVALID;
  if (a->batch <= 0 || a->num_q_heads <= 0 || l.num_kv_heads <= 0 ||
      a->num_q_heads % l.num_kv_heads != 0 || a->max_blocks <= 0 || a->max_tokens <= 0 ||
      a->num_splits <= 0 || a->num_splits > KVQ_PREFILL_MAX_SPLITS || a->split_tokens <= 0 ||
      a->split_tokens % kTokens != 0 || a->num_blocks <= 0 ||
      (a->wide_tile_rows != 0 && a->wide_tile_rows != kWideRows &&
       a->wide_tile_rows != kTripleRows))
    return KVQ_ERR_INVALID;
  if (a->cache.pool == nullptr || a->q == nullptr || a->out == nullptr ||
      a->qo_indptr == nullptr || a->block_tables == nullptr || a->context_lens == nullptr)
    return KVQ_ERR_INVALID;
  if (!aligned16(a->q) || a->q_token_stride % 8 != 0 || a->q_head_stride % 8 != 0 ||
      a->q_token_stride < 0 || a->q_head_stride < 0 || a->out_token_stride < 0 ||
      a->out_head_stride < 0 || a->lse_token_stride < 0 || a->lse_head_stride < 0)
    return KVQ_ERR_INVALID;
  const Role rk = role_of(l.k_format, false), rv = role_of(l.v_format, true);
  if ((rk.head_scale && a->cache.k_scales == nullptr) ||
      (rv.head_scale && a->cache.v_scales == nullptr))
    return KVQ_ERR_INVALID;
  if (a->num_splits > 1 && (a->ws_o == nullptr || a->ws_lse == nullptr)) return KVQ_ERR_INVALID;

  Params p{};
  p.pool = a->cache.pool;
  p.k_scales = rk.head_scale ? a->cache.k_scales : nullptr;
  p.v_scales = rv.head_scale ? a->cache.v_scales : nullptr;
  p.head_stride = l.head_stride;
  p.block_stride = l.block_stride;
  p.num_blocks = a->num_blocks;
  p.k = side_of(l.k_format, l.k_codes_offset, l.k_codes_row, l.k_meta_offset, l.k_meta_row);
  p.v = side_of(l.v_format, l.v_codes_offset, l.v_codes_row, l.v_meta_offset, l.v_meta_row);
  p.block_size = l.block_size;
  p.block_div = FastDiv((uint32_t)l.block_size);
  p.q = a->q;
  p.out = a->out;
  p.lse = a->lse;
  p.q_tok = a->q_token_stride, p.q_head = a->q_head_stride;
  p.o_tok = a->out_token_stride, p.o_head = a->out_head_stride;
  p.l_tok = a->lse_token_stride, p.l_head = a->lse_head_stride;
  p.qo_indptr = a->qo_indptr;
  p.block_tables = a->block_tables;
  p.context_lens = a->context_lens;
  p.sinks = a->sinks;
  p.ws_o = a->ws_o;
  p.ws_lse = a->ws_lse;
  p.ws_rows = (int64_t)a->max_tokens * a->num_q_heads;
  p.counters = a->counters;
  p.q_bf16 = a->q_dtype == KVQ_DTYPE_BF16;
  p.out_dtype = a->out_dtype;
  p.batch = a->batch;
  p.num_q_heads = a->num_q_heads;
  p.group = a->num_q_heads / l.num_kv_heads;
  p.max_blocks = a->max_blocks;
  p.max_tokens = a->max_tokens;
  p.num_splits = a->num_splits;
  p.split_tokens = a->split_tokens;
  p.window_left = a->window_left < 0 ? -1 : a->window_left;
  p.sm_scale = a->softmax_scale;
  p.soft_cap = a->logits_soft_cap > 0.f ? a->logits_soft_cap : 0.f;
  p.alibi_slopes = a->alibi_slopes;
  p.e4m3_operands = a->e4m3_operands != 0;
  static const bool heads_later = kvq::env_switch("KVQ_PREFILL_HEADS_FIRST") == 0;
  p.heads_first = !heads_later;

  if (l.num_kv_heads > 65535) return KVQ_ERR_UNSUPPORTED;
  const bool kb = rk.bf16, vb = rv.bf16;
  Launch fn{p, (unsigned)l.num_kv_heads, a->wide_tile_rows, (cudaStream_t)stream};
  const int status = dispatch(l.head_dim, kb, vb, l.k_format == KVQ_INT4_KC, wide_tiles(p), fn);
  if (status != KVQ_OK || a->num_splits == 1) return status;
  MergeSplits merge{p, (cudaStream_t)stream, fn.ws};
  return dispatch(l.head_dim, kb, vb, false, false, merge);
}

extern "C" int kvq_merge_states(const void *a, const float *a_lse, const void *b,
                                const float *b_lse, void *out, float *out_lse, int64_t rows,
                                int32_t head_dim, int32_t dtype, void *stream) {
  if (rows < 0 || head_dim <= 0) return KVQ_ERR_INVALID;
  if (rows == 0) return KVQ_OK;
  if (a == nullptr || a_lse == nullptr || b == nullptr || b_lse == nullptr || out == nullptr ||
      out_lse == nullptr)
    return KVQ_ERR_INVALID;
  const unsigned blocks = (unsigned)((rows + kMergeWarps - 1) / kMergeWarps);
  if ((rows + kMergeWarps - 1) / kMergeWarps > INT32_MAX) return KVQ_ERR_UNSUPPORTED;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case KVQ_DTYPE_F32:
      merge_two<float><<<blocks, kMergeWarps * 32, 0, s>>>(
          static_cast<const float *>(a), a_lse, static_cast<const float *>(b), b_lse,
          static_cast<float *>(out), out_lse, rows, head_dim);
      break;
    case KVQ_DTYPE_F16:
      merge_two<__half><<<blocks, kMergeWarps * 32, 0, s>>>(
          static_cast<const __half *>(a), a_lse, static_cast<const __half *>(b), b_lse,
          static_cast<__half *>(out), out_lse, rows, head_dim);
      break;
    case KVQ_DTYPE_BF16:
      merge_two<__nv_bfloat16><<<blocks, kMergeWarps * 32, 0, s>>>(
          static_cast<const __nv_bfloat16 *>(a), a_lse, static_cast<const __nv_bfloat16 *>(b),
          b_lse, static_cast<__nv_bfloat16 *>(out), out_lse, rows, head_dim);
      break;
    default: return KVQ_ERR_UNSUPPORTED;
  }
  return launch_status();
}
