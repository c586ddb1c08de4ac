/* kvq.h: the crate's only C ABI. Plain C99, no CUDA headers, so Rust bindings need nothing
 * but this file. Every launcher:
 *   - enqueues work on `stream` (a cudaStream_t / CUstream passed as void*) and returns at once;
 *   - returns KVQ_OK or a negative kvq_status (invalid arguments are caught in Rust first: the
 *     checks here are a last line of defence, not the validation layer);
 *   - never allocates and never synchronizes, so it can be captured in a CUDA graph.
 * Pointers are device pointers unless named `host_`. */
#ifndef KVQ_H
#define KVQ_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvq_status {
  KVQ_OK = 0,
  KVQ_ERR_INVALID = -1,     /* an argument the launcher cannot serve (null, bad shape) */
  KVQ_ERR_UNSUPPORTED = -2, /* a valid combination this build has no kernel for */
  KVQ_ERR_LAUNCH = -3       /* the CUDA runtime reported an error at launch */
} kvq_status;

/* Element formats: the discriminants of kvq::KvFormat. */
typedef enum kvq_format {
  KVQ_F16 = 0,
  KVQ_BF16 = 1,
  KVQ_FP8_E4M3 = 2,
  KVQ_FP8_E5M2 = 3,
  KVQ_INT4_SYM32 = 4,
  KVQ_INT4_AFFINE64 = 5
} kvq_format;

/* Byte layout of a paged cache block: kvq::layout::BlockLayout, field for field. Offsets are
 * relative to a head section; a head section of (block, head) starts at
 * block * block_stride + head * head_stride in the pool. */
typedef struct kvq_layout {
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t k_format; /* kvq_format */
  int32_t v_format; /* kvq_format */
  int32_t k_codes_offset, k_codes_row;
  int32_t k_meta_offset, k_meta_row;
  int32_t v_codes_offset, v_codes_row;
  int32_t v_meta_offset, v_meta_row;
  int64_t head_stride;
  int64_t block_stride;
} kvq_layout;

/* A cache in device memory: the block pool and FP8's per-KV-head f32 scales (each
 * [num_kv_heads]; ignored for other formats, may then be null). */
typedef struct kvq_cache {
  uint8_t *pool;
  const float *k_scales;
  const float *v_scales;
  kvq_layout layout;
} kvq_cache;

/* ---- append / quantize / dequantize (cuda/append.cu) ---- */

/* ---- fused paged decode attention (cuda/decode.cu) ---- */

#ifdef __cplusplus
}
#endif
#endif /* KVQ_H */
