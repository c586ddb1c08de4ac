// decode.cu: the C launchers of the fused paged decode attention (kvq.h) and the one place
// that maps runtime (k_format, v_format, head_dim) to a template instance of decode/kernel.cuh.
#include <cuda_runtime.h>

#include <atomic>

#include "common.cuh"
#include "decode/kernel.cuh"
#include "kvq.h"

namespace kvq_decode {
namespace {

/// Whether kernel format M's codec in the K (V = false) or V role holds whole groups of D, in
/// code rows of whole 16-byte units (4-bit codes: head_dim a multiple of 32), which the K
/// fragments' word-by-word unpacking needs.
template <Fmt M, bool V, int D>
constexpr bool whole_groups() {
  using C = Codec<format_of<M, V>()>;
  return D % (C::kGroup > 0 ? C::kGroup : 1) == 0 && D * C::kBits / 8 % 16 == 0;
}

/// The instances: the kernel formats of the codecs with kDecodeMixed mixed freely (K x V), any
/// other one with itself, at head_dim 64, 80, 96, 112, 128, 192 and 256 where whole_groups
/// holds; with the codecs as they are, f16, bf16, fp8-e4m3, int8-pth, fp4-e2m1 (head_dim a
/// multiple of 32), int4 (keys: groups of 32, values: 64) and int4-kc keys (head_dim a multiple of
/// 32) mixed and e5m2 with itself. This is the one statement of the supported set
/// (kvq_decode_supported).
template <Fmt K, Fmt V, int D>
constexpr bool has_kernel() {
  return (K == V || (Codec<format_of<K, false>()>::kDecodeMixed &&
                     Codec<format_of<V, true>()>::kDecodeMixed)) &&
         whole_groups<K, false, D>() && whole_groups<V, true, D>();
}

template <Fmt K, Fmt V, int D, class Fn>
int run_if(Fn &fn) {
  if constexpr (has_kernel<K, V, D>())
    return fn.template run<K, V, D>();
  else
    return KVQ_ERR_UNSUPPORTED;
}

template <Fmt K, Fmt V, class Fn>
int with_dim(int d, Fn &fn) {
  switch (d) {
    case 64: return run_if<K, V, 64>(fn);
    case 80: return run_if<K, V, 80>(fn);
    case 96: return run_if<K, V, 96>(fn);
    case 112: return run_if<K, V, 112>(fn);
    case 128: return run_if<K, V, 128>(fn);
    case 192: return run_if<K, V, 192>(fn);
    case 256: return run_if<K, V, 256>(fn);
    default: return KVQ_ERR_UNSUPPORTED;
  }
}

/// Call fn(FormatTag<F>) for the stored format F of the list equal to `format` if the kernel
/// takes it in the K (V = false) or V role, else return KVQ_ERR_UNSUPPORTED.
template <bool V, class Fn, int... F>
int with_role_in(FormatList<F...>, int32_t format, Fn &&fn) {
  auto call = [&](auto f) -> int {
    if constexpr (has_role<decltype(f)::value, V>()) return fn(f);
    else return KVQ_ERR_UNSUPPORTED;
  };
  int status = KVQ_ERR_UNSUPPORTED;
  (void)((format == F && (status = call(FormatTag<F>{}), true)) || ...);
  return status;
}
template <bool V, class Fn>
int with_role(int32_t format, Fn &&fn) {
  return with_role_in<V>(AttentionFormats{}, format, static_cast<Fn &&>(fn));
}

/// Call fn.run<K, V, D>() for the instance serving keys in k_format and values in v_format
/// (kvq_format ids) at head_dim d, or return KVQ_ERR_UNSUPPORTED.
template <class Fn>
int dispatch(int32_t k_format, int32_t v_format, int d, Fn &fn) {
  return with_role<false>(k_format, [&](auto k) {
    return with_role<true>(v_format, [&](auto v) {
      return with_dim<Codec<decltype(k)::value>::kDecodeFmt,
                      Codec<decltype(v)::value>::kDecodeFmt>(d, fn);
    });
  });
}

/// Whether launches may be early (programmatic dependent launch): KVQ_DECODE_PDL=0 turns it
/// off, for A/B runs.
bool early_launch_allowed() {
  static const bool off = kvq::env_switch("KVQ_DECODE_PDL") == 0;
  return !off;
}

/// Raise the instance's dynamic shared-memory limit on the current device to what its largest
/// stage count that fits needs, once per device (so launches after the first, e.g. inside a
/// graph capture, make no attribute calls). `*limit` gets the device's per-block limit, `*early`
/// (if not null) whether the instance may launch early: the device runs code of it compiled for
/// sm_90 or later (whose first act is griddepcontrol.wait: decode/kernel.cuh).
template <Fmt K, Fmt V, int D>
cudaError_t prepare(int *limit, bool *early = nullptr) {
  static std::atomic<uint64_t> done{0};   // bit d: done on device d (< 64)
  static std::atomic<uint64_t> ptx90{0};  // bit d: its code on device d is from sm_90+ PTX
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (1ull << dev) : 0;
  if (early != nullptr)
    *early = bit != 0 && (ptx90.load(std::memory_order_acquire) & bit) != 0 &&
             early_launch_allowed();
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  cudaFuncAttributes attr{};
  e = cudaFuncGetAttributes(&attr, decode_kernel<K, V, D>);
  if (e != cudaSuccess) return e;
  if (attr.ptxVersion >= 90) ptx90.fetch_or(bit, std::memory_order_release);
  int want = Cfg<K, V, D>::bytes(4, kMinStages);
  for (int w = KVQ_DECODE_WARPS_MULTIPLE; w <= kMaxWarps; w += KVQ_DECODE_WARPS_MULTIPLE)
    for (int n = kMinStages; n <= kMaxStages; ++n)
      if (Cfg<K, V, D>::bytes(w, n) <= *limit && Cfg<K, V, D>::bytes(w, n) > want)
        want = Cfg<K, V, D>::bytes(w, n);
  e = cudaFuncSetAttribute(decode_kernel<K, V, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           want);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  if (early != nullptr)
    *early = e == cudaSuccess && attr.ptxVersion >= 90 && bit != 0 && early_launch_allowed();
  return e;
}

struct Occupancy {
  int32_t warps, stages;
  int32_t *ctas, *stage_bytes, *step_tokens;
  template <Fmt K, Fmt V, int D>
  int run() {
    int limit = 0;
    cudaError_t e = prepare<K, V, D>(&limit);
    int n = 0;
    const int smem = Cfg<K, V, D>::bytes(warps, stages);
    if (e == cudaSuccess && smem <= limit)
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_kernel<K, V, D>, warps * 32,
                                                        smem);
    if (e != cudaSuccess) {
      kvq::set_last_error(e);
      return KVQ_ERR_LAUNCH;
    }
    *ctas = n;
    *stage_bytes = Cfg<K, V, D>::STAGE;
    *step_tokens = Cfg<K, V, D>::STEP;
    return KVQ_OK;
  }
};

/// Answers whether an instance exists (its run is reached only for instances that do).
struct Supported {
  template <Fmt K, Fmt V, int D>
  int run() {
    return KVQ_OK;
  }
};

struct Launch {
  const Params &p;
  const kvq_layout &l;
  int warps;
  dim3 grid;
  cudaStream_t stream;
  template <Fmt K, Fmt V, int D>
  int run() {
    // The kernel's row sizes are compile-time; the layout must agree (it does when it comes
    // from kvq::layout).
    using F = Frag<K, V, D>;
    if (l.k_codes_row != F::KC_ROW || l.k_meta_row != F::KM_ROW || l.v_codes_row != F::VC_ROW ||
        l.v_meta_row != F::VM_ROW)
      return KVQ_ERR_INVALID;
    // int4-kc: a sealed block's s and z follow its G code rows (kvq.h).
    if (F::KBLK && l.k_meta_offset != l.k_codes_offset + l.block_size * F::KC_ROW)
      return KVQ_ERR_INVALID;
    int limit = 0;
    bool early = false;
    cudaError_t e = prepare<K, V, D>(&limit, &early);
    if (e != cudaSuccess) {
      kvq::set_last_error(e);
      return KVQ_ERR_LAUNCH;
    }
    const int smem = Cfg<K, V, D>::bytes(warps, p.stages);
    if (smem > limit) return KVQ_ERR_UNSUPPORTED;
    // Early: the kernel's blocks may be placed while the stream's previous kernel finishes;
    // they wait for it before their first read.
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(warps * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = early ? 1 : 0;
    e = cudaLaunchKernelEx(&cfg, decode_kernel<K, V, D>, p);
    if (e == cudaSuccess) return KVQ_OK;
    (void)cudaGetLastError();
    kvq::set_last_error(e);
    return KVQ_ERR_LAUNCH;
  }
};

/// What the launcher checks of one side's stored format before the dispatch: whether the kernel
/// takes it in this role, whether its operands are bf16 (keys so stored need bf16 queries: the
/// scores are computed with bf16 operands, and f16 queries would lose bits), and whether it has
/// per-head scales (FP8), which the cache must then give.
struct Side {
  bool taken = false, bf16 = false, head_scale = false, block_channels = false;
};

/// The Side of a kvq_format in the K (V = false) or V role.
template <bool V>
Side side(int32_t format) {
  Side s;
  with_role<V>(format, [&](auto f) {
    using C = Codec<decltype(f)::value>;
    s = {true, C::kBf16Operands, C::kHeadScale, BlockChannelsOf<C>::value};
    return (int)KVQ_OK;
  });
  return s;
}

}  // namespace
}  // namespace kvq_decode

using namespace kvq_decode;

/// Warp counts per CTA the kernel is launched with.
static bool valid_warps(int32_t w) {
  return w > 0 && w <= KVQ_DECODE_MAX_WARPS && w % KVQ_DECODE_WARPS_MULTIPLE == 0;
}

extern "C" int kvq_decode_supported(int32_t k_format, int32_t v_format, int32_t head_dim) {
  Supported fn;
  return dispatch(k_format, v_format, head_dim, fn) == KVQ_OK ? 1 : 0;
}

extern "C" int kvq_decode_occupancy(int32_t k_format, int32_t v_format, int32_t head_dim,
                                    int32_t warps, int32_t stages, int32_t *ctas_per_sm,
                                    int32_t *stage_bytes, int32_t *step_tokens) {
  if (ctas_per_sm == nullptr || stage_bytes == nullptr || step_tokens == nullptr ||
      stages < kMinStages || stages > kMaxStages || !valid_warps(warps))
    return KVQ_ERR_INVALID;
  Occupancy fn{warps, stages, ctas_per_sm, stage_bytes, step_tokens};
  return dispatch(k_format, v_format, head_dim, fn);
}

extern "C" int kvq_decode_attention(const kvq_decode_args *a, void *stream) {
  if (a == nullptr) return KVQ_ERR_INVALID;
  const kvq_layout &l = a->cache.layout;
  if (a->q_dtype != KVQ_DTYPE_F16 && a->q_dtype != KVQ_DTYPE_BF16) return KVQ_ERR_UNSUPPORTED;
  if (a->out_dtype != KVQ_DTYPE_F16 && a->out_dtype != KVQ_DTYPE_BF16 &&
      a->out_dtype != KVQ_DTYPE_F32)
    return KVQ_ERR_UNSUPPORTED;
  const Side ks = side<false>(l.k_format), vs = side<true>(l.v_format);
  if (!ks.taken || !vs.taken || (ks.bf16 && a->q_dtype != KVQ_DTYPE_BF16))
    return KVQ_ERR_UNSUPPORTED;
  if (l.block_size <= 0 || l.block_size % kvq_decode::kChunk != 0) return KVQ_ERR_UNSUPPORTED;
  // int4-kc blocks are 16, 32 or 64 tokens (a power of two: the kernel masks positions by it).
  if (ks.block_channels && l.block_size != 16 && l.block_size != 32 && l.block_size != 64)
    return KVQ_ERR_INVALID;
  if (a->batch <= 0 || a->num_q_heads <= 0 || l.num_kv_heads <= 0 ||
      a->num_q_heads % l.num_kv_heads != 0 || a->q_len <= 0 || a->max_blocks <= 0 ||
      a->num_splits <= 0 || a->num_splits > KVQ_DECODE_MAX_SPLITS || a->split_tokens <= 0 ||
      a->split_tokens % 32 != 0 || a->num_blocks <= 0 || a->stages < kMinStages ||
      a->stages > kMaxStages || !valid_warps(a->warps))
    return KVQ_ERR_INVALID;
  for (const kvq_rows *r : {&a->q_rows, &a->out_rows, &a->lse_rows})
    if (r->seq < 0 || r->token < 0 || r->head < 0) return KVQ_ERR_INVALID;
  if (a->cache.pool == nullptr || a->q == nullptr || a->out == nullptr ||
      a->block_tables == nullptr || a->context_lens == nullptr)
    return KVQ_ERR_INVALID;
  if ((ks.head_scale && a->cache.k_scales == nullptr) ||
      (vs.head_scale && a->cache.v_scales == nullptr))
    return KVQ_ERR_INVALID;
  if (!(a->logits_soft_cap <= 0.f || a->logits_soft_cap < INFINITY)) return KVQ_ERR_INVALID;
  if (a->num_splits > 1 &&
      (a->ws_o == nullptr || a->ws_lse == nullptr || a->ws_counters == nullptr))
    return KVQ_ERR_INVALID;

  Params p{};
  p.pool = a->cache.pool;
  p.k_scales = a->cache.k_scales;
  p.v_scales = a->cache.v_scales;
  p.head_stride = l.head_stride;
  p.block_stride = l.block_stride;
  p.num_blocks = a->num_blocks;
  p.k_codes_off = l.k_codes_offset;
  p.k_meta_off = l.k_meta_offset;
  p.v_codes_off = l.v_codes_offset;
  p.v_meta_off = l.v_meta_offset;
  p.block_size = l.block_size;
  p.q = a->q;
  p.out = a->out;
  p.lse = a->lse;
  p.q_rows = a->q_rows;
  p.out_rows = a->out_rows;
  p.lse_rows = a->lse_rows;
  p.counters = a->counters;
  p.out_dtype = a->out_dtype;
  p.block_tables = a->block_tables;
  p.context_lens = a->context_lens;
  p.ws_o = a->ws_o;
  p.ws_lse = a->ws_lse;
  p.ws_counters = a->ws_counters;
  p.q_bf16 = a->q_dtype == KVQ_DTYPE_BF16;
  p.num_q_heads = a->num_q_heads;
  p.num_kv_heads = l.num_kv_heads;
  p.group = a->num_q_heads / l.num_kv_heads;
  p.q_len = a->q_len;
  p.m_tiles = (p.group * a->q_len + kRows - 1) / kRows;
  p.max_blocks = a->max_blocks;
  p.num_splits = a->num_splits;
  p.split_tokens = a->split_tokens;
  p.stages = a->stages;
  p.sm_scale_log2 = a->softmax_scale * kLog2e;
  p.sinks = a->sinks;
  p.window_left = a->window_left;
  p.soft_cap = a->logits_soft_cap;
  p.alibi_slopes = a->alibi_slopes;

  const int64_t y = (int64_t)l.num_kv_heads * p.m_tiles;
  if (y > 65535 || a->batch > 65535) return KVQ_ERR_UNSUPPORTED;
  Launch fn{p, l, a->warps, dim3(a->num_splits, (unsigned)y, a->batch), (cudaStream_t)stream};
  return dispatch(l.k_format, l.v_format, l.head_dim, fn);
}
