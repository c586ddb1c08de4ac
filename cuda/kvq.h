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
  KVQ_INT4_AFFINE64 = 5,
  KVQ_INT8_PTH = 6,  /* INT8, symmetric, an f32 scale per row (token and KV head) */
  KVQ_FP4_E2M1 = 7,  /* FP4 E2M1, an E4M3 scale per 16 elements, an f32 scale per KV head */
  KVQ_INT4_KC = 8    /* keys only: INT4 per channel over a block's tokens (below) */
} kvq_format;
/* The number of kvq_format ids: they are 0 to KVQ_NUM_FORMATS - 1, each with a codec
 * (cuda/codec/), and the kernels' format dispatch covers exactly these. */
#define KVQ_NUM_FORMATS 9

/* Byte layout of a paged cache block: kvq::layout::BlockLayout, field for field. Offsets are
 * relative to a head section; a head section of (block, head) starts at
 * block * block_stride + head * head_stride in the pool.
 *
 * KVQ_INT4_KC keys (block_size G of 16, 32 or 64): the K part of a head section is G * 2 *
 * head_dim bytes and holds one of two things. While the block is not full it is the *window*:
 * G rows of head_dim f16 values (row t at k_codes_offset + t * 2 * head_dim), the sanitized
 * inputs rounded to f16. Once its G-th token is appended the block is *sealed*, quantized in
 * place per channel (FORMATS.md): G rows of k_codes_row = head_dim / 2 code bytes at
 * k_codes_offset, then at k_meta_offset = k_codes_offset + G * head_dim / 2 the block's
 * s[head_dim] and z[head_dim] (f16); k_meta_row is 0. A reader tells the two apart by the
 * sequence's length: position p of a sequence of len tokens is sealed iff (p / G + 1) * G <= len. */
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

/* A cache in device memory: the block pool and the per-KV-head f32 scales of FP8 (s) and FP4
 * (g) (each [num_kv_heads]; ignored for other formats, may then be null). */
typedef struct kvq_cache {
  uint8_t *pool;
  const float *k_scales;
  const float *v_scales;
  kvq_layout layout;
} kvq_cache;

/* ---- append / quantize / dequantize (cuda/append.cu) ---- */

/* Element type of dense tensors (K/V inputs, dequantized outputs). */
typedef enum kvq_dtype {
  KVQ_DTYPE_F32 = 0,
  KVQ_DTYPE_F16 = 1,
  KVQ_DTYPE_BF16 = 2
} kvq_dtype;

/* Dense-only format id (beside kvq_format's FP8 and INT4 ids): per-tensor INT4, f32 scale. */
#define KVQ_DENSE_INT4_UNIFORM 16

/* Optional device counters (unsigned long long[KVQ_NUM_COUNTERS]) a launcher adds to:
 * non-finite inputs met (they are sanitized, FORMATS.md), tokens skipped because their slot
 * (append) or block id (gather) lies outside the pool, and finite inputs an append saturated:
 * past +-65504 (FORMATS.md's clamp) or, for FP8 and FP4, past the head scale times the largest
 * code (448 for E4M3, 57344 for E5M2, 2688 for FP4), which wants the scales calibrated. */
#define KVQ_COUNTER_NON_FINITE 0
#define KVQ_COUNTER_OUT_OF_RANGE 1
#define KVQ_COUNTER_SATURATED 2
#define KVQ_NUM_COUNTERS 3

/* Quantize-on-append. k and v are [num_tokens, num_kv_heads, head_dim] of `dtype` (kvq_dtype),
 * row t starting at element t * k_token_stride (resp. v_token_stride), a multiple of 8 that is
 * at least num_kv_heads * head_dim; k and v are 16-byte aligned. Token t goes to slot slots[t]
 * (int32 or, when slots_i64 != 0, int64): block slot / block_size, offset slot % block_size.
 * A negative slot skips the token (padding); a slot >= num_blocks * block_size skips it too and
 * counts it in counters[KVQ_COUNTER_OUT_OF_RANGE]. FP8 and FP4 formats read
 * cache->k_scales/v_scales. KVQ_INT4_KC keys are written to their blocks' f16 windows; then every
 * block whose last slot (slot % block_size == block_size - 1) this call wrote is sealed from its
 * window (kvq_layout's note), so a sequence's tokens must come in order, its block's last one
 * last (earlier ones in this call or before), and the slots of one call must be distinct. */
int kvq_append(const kvq_cache *cache, int64_t num_blocks, const void *slots, int32_t slots_i64,
               int64_t num_tokens, const void *k, const void *v, int32_t dtype,
               int64_t k_token_stride, int64_t v_token_stride, unsigned long long *counters,
               void *stream);

/* Dequantize the first num_tokens tokens of one sequence (block_table[i] = its i-th block) into
 * dense [num_tokens, num_kv_heads, head_dim] tensors of out_dtype; k_out or v_out may be null.
 * KVQ_INT4_KC keys: the sequence is num_tokens long, so its full blocks are read sealed and a
 * last, unfilled one from its f16 window.
 * A block id outside [0, num_blocks) yields zeros for its tokens and counts them in
 * counters[KVQ_COUNTER_OUT_OF_RANGE]. Outputs 16-byte aligned. */
int kvq_gather_dequantize(const kvq_cache *cache, int64_t num_blocks, const int32_t *block_table,
                          int64_t num_tokens, int32_t out_dtype, void *k_out, void *v_out,
                          unsigned long long *counters, void *stream);

/* Decode the contexts of `batch` sequences into the 16-bit pool of `dst` (a cache of kvq_layout
 * with KVQ_F16 or KVQ_BF16 on both sides, the same heads, head_dim and block_size), once, for a
 * 16-bit attention pass over them. Sequence b's context is context_lens[b] tokens (clamped to
 * [0, max_blocks * block_size]) of the blocks block_tables[b * max_blocks + i]; its block i goes
 * to scratch block f_b + i, with f_b the number of blocks the sequences before it take
 * (ceil(len / block_size) each), and dst_tables[b * dst_max_blocks + i] is set to f_b + i (for
 * i < dst_max_blocks). Scratch ids past dst_blocks are written to the table but not decoded.
 * max_context_len bounds every length (the launch's grid: a longer one is decoded only that far).
 * Values are those of kvq_gather_dequantize; a block id outside [0, num_blocks) yields zeros
 * and counts its tokens in counters[KVQ_COUNTER_OUT_OF_RANGE]. batch <= 65535. */
int kvq_decode_context(const kvq_cache *cache, int64_t num_blocks, const int32_t *block_tables,
                       int32_t max_blocks, const int32_t *context_lens, int32_t batch,
                       int32_t max_context_len, const kvq_cache *dst, int64_t dst_blocks,
                       int32_t *dst_tables, int32_t dst_max_blocks,
                       unsigned long long *counters, void *stream);

/* Copy whole blocks inside one pool (copy-on-write after a fork, defragmentation): for each
 * i < num_pairs, every byte of block pairs[2i] (codes and metadata of every KV head) to block
 * pairs[2i + 1]. `pairs` is a device array of 2 * num_pairs int32. Destinations must be
 * distinct and none may also be a source in the same launch (the copies run in parallel; the
 * safe Rust API checks this). A pair with an id outside [0, num_blocks) is skipped and counted
 * in counters[KVQ_COUNTER_OUT_OF_RANGE] (counters may be null). Bytes are copied 16 at a time:
 * layout.block_stride is a multiple of 16 and the pool 16-byte aligned. */
int kvq_copy_blocks(const kvq_cache *cache, int64_t num_blocks, const int32_t *pairs,
                    int64_t num_pairs, unsigned long long *counters, void *stream);

/* kvq_copy_blocks on every layer of a model in one launch: `pools` is a device array of
 * num_layers pool addresses (each 16-byte aligned), every pool of num_blocks blocks of
 * block_stride bytes (a multiple of 16); `pairs` and its rules are kvq_copy_blocks', applied to
 * each pool. `counters`, a device array of num_layers counter addresses (or null, and an entry
 * may be null), gets layer l's skipped pairs in counters[l][KVQ_COUNTER_OUT_OF_RANGE]. At most
 * 65535 layers and 65535 pairs (grid y and z). */
int kvq_copy_blocks_layers(uint8_t *const *pools, unsigned long long *const *counters,
                           int32_t num_layers, int64_t block_stride, int64_t num_blocks,
                           const int32_t *pairs, int64_t num_pairs, void *stream);

/* Update device block tables in place from host memory the device reads directly (pinned and
 * mapped: CU_MEMHOSTALLOC_DEVICEMAP; `src` is its device address): lens_dst[i] = src[i] for
 * i < num_lens, then table_dst[src[num_lens + 2j]] = src[num_lens + 2j + 1] for j < num_pairs
 * (distinct indices, in elements). When every thread block has read its part, *done (mapped
 * host memory too) becomes `generation`, so the host knows when it may write `src` again.
 * `blocks_finished` is one device uint32, zero before the first launch (each launch leaves it
 * zero). One launch, no copy: the per-step update of kvq::cuda::DeviceBlockTables. */
int kvq_tables_update(const int32_t *src, int32_t num_lens, int32_t *lens_dst, int32_t *table_dst,
                      int64_t num_pairs, unsigned int *blocks_finished, unsigned int *done,
                      unsigned int generation, void *stream);

/* ---- calibration on the device (cuda/calibrate.cu) ---- */

/* Device scratch bytes kvq_head_clip needs for `heads` heads (0 for heads <= 0). */
int64_t kvq_head_clip_scratch_bytes(int32_t heads);

/* The clipping value of each head of a dense tensor x ([rows, head_dim] of `dtype`, row r of
 * head r % heads; rows a positive multiple of heads): clip_out[h] (device, f32) is the rank-th
 * smallest (1-based, rank in 1..rows / heads * head_dim) of the head's sanitized |x| values,
 * exactly (kvq::calibrate::head_clip: rank = the values' count gives the amax, the nearest rank
 * of a percentile the percentile). `scratch`: kvq_head_clip_scratch_bytes(heads) bytes of
 * device memory, 8-byte aligned. A memset and six launches on `stream`, no host synchronization. */
int kvq_head_clip(const void *x, int32_t dtype, int64_t rows, int32_t heads, int32_t head_dim,
                  int64_t rank, float *clip_out, void *scratch, void *stream);

/* Calibration scales of a dense tensor x ([rows, head_dim], rows cycling through `heads` heads,
 * so row r belongs to head r % heads) for `format` (FP8, FP4, or KVQ_DENSE_INT4_UNIFORM): FP8
 * amax / max_finite, FP4's global scale amax / 2688 (both 1 when the quotient is 0), one per head
 * when per_head != 0, else one for the tensor; uniform INT4 one amax / 7. amax runs over the sanitized inputs. `amax_scratch` holds
 * (per_head ? heads : 1) uint32 of device scratch. */
int kvq_dense_scales(int32_t format, const void *x, int32_t dtype, int64_t rows, int32_t heads,
                     int32_t head_dim, int32_t per_head, float *scales_out,
                     uint32_t *amax_scratch, void *stream);

/* Quantize a dense tensor [rows, head_dim] (the layout of src/dense.rs): codes [rows, code
 * bytes]. FP8, FP4 and uniform INT4 take num_head_scales f32 head scales: FP8's s and FP4's g
 * 1 or `heads` (row r takes head r % heads' scale), uniform INT4's 1 (kvq_dense_scales
 * computes them from data). `scales` receives each row's scales: INT4 K f16 [rows, head_dim /
 * 32], INT4 V f16 [rows, head_dim / 64] (its zeros, the same, in group_zeros), FP4 E4M3 bytes
 * [rows, head_dim / 16], INT8 f32 [rows] (4-byte aligned); null for FP8 and uniform INT4.
 * Uniform INT4 packs the flat tensor (head_dim even).
 * KVQ_INT4_KC writes FORMATS.md's dense int4-kc file: x is [T, heads, head_dim] (T = rows /
 * heads, rows a multiple of heads; head_dim even, of any size), quantized per (head, channel)
 * in groups of 32 tokens, a last group of T % 32 tokens over only those; codes [rows,
 * head_dim / 2], `scales` and `group_zeros` f16 [ceil(T / 32), heads, head_dim] (s and z, both
 * 4-byte aligned); no head scales. KVQ_ERR_UNSUPPORTED past 2^31 - 512 element pairs
 * (rows * head_dim / 2). */
int kvq_quantize_dense(int32_t format, const void *x, int32_t dtype, int64_t rows, int32_t heads,
                       int32_t head_dim, const float *head_scales, int32_t num_head_scales,
                       uint8_t *codes, void *scales, uint16_t *group_zeros,
                       unsigned long long *counters, void *stream);

/* The inverse of kvq_quantize_dense, to a dense [rows, head_dim] tensor of out_dtype, each value
 * exactly as FORMATS.md decodes it (then rounded to out_dtype); KVQ_INT4_KC reads its scales
 * and zeros as kvq_quantize_dense writes them. */
int kvq_dequantize_dense(int32_t format, const uint8_t *codes, const float *head_scales,
                         int32_t num_head_scales, const void *scales,
                         const uint16_t *group_zeros, int64_t rows, int32_t heads,
                         int32_t head_dim, int32_t out_dtype, void *out, void *stream);

/* Message of the last launch that returned KVQ_ERR_LAUNCH on the calling host thread (a static
 * string; "no error" if none). */
const char *kvq_last_error(void);

/* The cudaError_t of that launch, as an int (0, cudaSuccess, if none): callers tell running out
 * of memory from a bad launch by the code, not the message. */
int kvq_last_error_code(void);


/* ---- fused paged decode attention (cuda/decode.cu) ---- */

/* The decode kernels' launch parameters, stated once (the Rust side reads them from here):
 * block_size must be a multiple of KVQ_DECODE_CHUNK_TOKENS; a thread block has
 * a multiple of KVQ_DECODE_WARPS_MULTIPLE warps, at most KVQ_DECODE_MAX_WARPS (those whose
 * registers and shared memory fit: kvq_decode_occupancy), of KVQ_DECODE_MIN_STAGES ..
 * KVQ_DECODE_MAX_STAGES copy stages each. Which (K format, V format, head_dim) have a kernel:
 * kvq_decode_supported. */
#define KVQ_DECODE_CHUNK_TOKENS 16
#define KVQ_DECODE_WARPS_MULTIPLE 4
#define KVQ_DECODE_MAX_WARPS 16
#define KVQ_DECODE_MIN_STAGES 2
#define KVQ_DECODE_MAX_STAGES 8
/* Longest split-KV fan-out one launch may use (the merge keeps one weight per split). */
#define KVQ_DECODE_MAX_SPLITS 256
/* Query rows (G query heads x q_len tokens of one KV head) one thread block serves: the N of
 * its tensor-core tiles. More rows take several tiles, each reading the KV head's bytes. */
#define KVQ_DECODE_TILE_ROWS 8

/* Where the rows of a query-shaped tensor live, in elements: element d of query token i of
 * query head h of sequence b is at b * seq + i * token + h * head + d (head_dim contiguous).
 * [batch, heads, q_len, head_dim] is {heads * q_len * head_dim, head_dim, q_len * head_dim};
 * [tokens, heads, head_dim] with q_len tokens per sequence is {q_len * t, t, head_dim} for a
 * token stride t (heads * head_dim, or more for a view into a fused QKV buffer). For lse the
 * same with head_dim 1. */
typedef struct kvq_rows {
  int64_t seq;
  int64_t token;
  int64_t head;
} kvq_rows;

/* One decode step of attention over a paged cache, with the semantics of
 * kvq::cpu::decode_attention_with: context_lens[b] counts every token of sequence b including
 * its q_len new ones; query token i sits at position p = context_lens[b] - q_len + i and sees
 * positions max(0, p - window_left) ..= p (all of 0..=p when window_left < 0); query head h
 * reads KV head h / (num_q_heads / num_kv_heads).
 *   q             q_dtype (KVQ_DTYPE_F16 or _BF16), rows at q_rows
 *   out           out_dtype (KVQ_DTYPE_F16, _BF16 or _F32), rows at out_rows
 *   lse           f32 at lse_rows, natural log of the softmax denominator (logits include
 *                 softmax_scale, the cap and the ALiBi bias; the sink included); may be null
 *   logits        softmax_scale * q.k, then logits_soft_cap * tanh(logits / logits_soft_cap)
 *                 when logits_soft_cap > 0, then + alibi_slopes[h] * (j - p) for the key at
 *                 position j when alibi_slopes is given
 *   sinks         [num_q_heads] f32 or null: a logit per head that joins every row's softmax
 *                 denominator only (gpt-oss); not scaled, not capped, not biased
 *   alibi_slopes  [num_q_heads] f32 or null: ALiBi's slope m_h (finite) per query head; the
 *                 logit of the query at position p (head h) for the key at j <= p gains
 *                 m_h * (j - p), after the cap (null: no bias; with slopes every step takes the
 *                 kernel's masked path, as with a cap)
 *   block_tables  [batch, max_blocks] int32, context_lens [batch] int32
 *   ws_o, ws_lse, ws_counters  split-KV workspace, used when num_splits > 1:
 *                 ws_o [batch, num_splits, num_q_heads * q_len, head_dim] f32,
 *                 ws_lse [batch, num_splits, num_q_heads * q_len] f32,
 *                 ws_counters [batch, num_kv_heads, ceil(G * q_len / KVQ_DECODE_TILE_ROWS)] uint32, all zero
 *                 before the first launch (each launch leaves them zero again)
 *   counters      optional (may be null): counters[KVQ_COUNTER_OUT_OF_RANGE] is incremented once
 *                 by each thread block that met a block-table entry outside [0, num_blocks) or
 *                 a context length outside [0, max_blocks * block_size]
 * Sequence b is cut into ceil(len / split_tokens) splits (split_tokens a positive multiple of
 * 32; at most num_splits of them, 1 <= num_splits <= KVQ_DECODE_MAX_SPLITS), each served by its
 * own thread blocks; the last block of a sequence to finish merges them (one launch, one
 * kernel). One launch at a time per workspace. A sequence of length 0 is padding: its rows get
 * out = 0 and lse = -inf and nothing of the cache or its table row is read. Caller guarantees
 * (the safe Rust API checks them): buffers that hold every row the strides address; every
 * context_lens[b] 0 or in [q_len, max_blocks * block_size] and ceil(context_lens[b] /
 * split_tokens) <= num_splits; the first ceil(len / block_size) entries of each table row valid
 * block ids. Outside that the kernel stays in bounds of the pool (lengths are clamped, block ids
 * outside [0, num_blocks) are read as absent tokens and counted) but the output is unspecified.
 * Supported: what kvq_decode_supported says, block_size a multiple of KVQ_DECODE_CHUNK_TOKENS,
 * and a bf16 K cache needs bf16 queries. Else KVQ_ERR_UNSUPPORTED. */
typedef struct kvq_decode_args {
  kvq_cache cache;
  int64_t num_blocks;
  const void *q;
  void *out;
  float *lse;
  kvq_rows q_rows;
  kvq_rows out_rows;
  kvq_rows lse_rows;
  const int32_t *block_tables;
  const int32_t *context_lens;
  float *ws_o;
  float *ws_lse;
  uint32_t *ws_counters;
  unsigned long long *counters;
  int32_t q_dtype;
  int32_t out_dtype;
  int32_t batch;
  int32_t num_q_heads;
  int32_t q_len;
  int32_t max_blocks;
  int32_t num_splits;
  int32_t split_tokens;
  int32_t warps;  /* warps per thread block, 4, 8, 12 or 16 (the plan picks it, with stages) */
  int32_t stages; /* copy stages per warp, 2..8 (the plan picks it from kvq_decode_occupancy) */
  float softmax_scale;
  const float *sinks;    /* may be null */
  int32_t window_left;   /* < 0: no window */
  float logits_soft_cap; /* <= 0: none */
  const float *alibi_slopes; /* may be null */
} kvq_decode_args;

/* 1 when this build has a decode kernel for keys in k_format and values in v_format
 * (kvq_format ids) at head_dim, else 0: f16, bf16, fp8-e4m3, int8-pth, fp4-e2m1 and int4 (K:
 * KVQ_INT4_SYM32 or KVQ_INT4_KC, V: KVQ_INT4_AFFINE64) mixed freely, or fp8-e5m2 for both;
 * head_dim 64, 80, 96, 112, 128, 192 or 256, a multiple of 32 with INT4 keys or fp4-e2m1 on
 * either side and of 64 with INT4 values. A host function: no device is needed. */
int kvq_decode_supported(int32_t k_format, int32_t v_format, int32_t head_dim);

/* Enqueue the decode kernel (and the split merge when num_splits > 1) on `stream`. On sm_90+
 * it is launched with programmatic stream serialization (KVQ_DECODE_PDL=0 in the environment
 * turns that off): its blocks may be placed while the stream's previous kernel finishes and
 * wait for it before their first read, and it lets the stream's next kernel launch early. A
 * kernel of the caller's launched after it with programmatic stream serialization must
 * therefore griddepcontrol.wait (cudaGridDependencySynchronize) before reading its output, as
 * any kernel launched that way must. */
int kvq_decode_attention(const kvq_decode_args *args, void *stream);

/* Thread blocks of the decode kernel for (k_format, v_format, head_dim) with `warps` warps (a
 * multiple of KVQ_DECODE_WARPS_MULTIPLE up to KVQ_DECODE_MAX_WARPS) of `stages` copy stages each
 * (2..8) that fit on one SM of the current device, written to *ctas_per_sm (0: they do not
 * fit); the bytes of one stage to *stage_bytes, and to *step_tokens the tokens a warp takes per
 * step (16 or 32: a block's warps take every warps-th step of its split). Also raises the
 * kernel's shared-memory limit, so call it once (outside graph capture) before the first launch
 * of that combination. */
int kvq_decode_occupancy(int32_t k_format, int32_t v_format, int32_t head_dim, int32_t warps,
                         int32_t stages, int32_t *ctas_per_sm, int32_t *stage_bytes,
                         int32_t *step_tokens);

/* ---- attention over the paged cache for any query length (cuda/prefill.cu) ---- */

/* Query rows (new tokens x query heads of one KV head, token-major) one thread block serves
 * (twice that, two warpgroups, at head_dim 64 / 128 when a launch's sequences average as many
 * rows), KV tokens it takes per step, and the longest split-KV fan-out of one launch. */
#define KVQ_PREFILL_TILE_ROWS 64
#define KVQ_PREFILL_TILE_TOKENS 64
#define KVQ_PREFILL_MAX_SPLITS 64

/* Attention of a ragged batch of new tokens over a paged cache (chunked prefill, prefix-cache
 * hits, speculative verification, decode), with the semantics of kvq::cpu::prefill_attention:
 * sequence b has n_b = qo_indptr[b + 1] - qo_indptr[b] new tokens (0 allowed), already
 * appended, and context_lens[b] = L_b >= n_b tokens in all; its query token i sits at position
 * p = L_b - n_b + i and sees positions max(0, p - window_left) ..= p (all of 0..=p when
 * window_left < 0); query head h reads KV head h / (num_q_heads / num_kv_heads).
 *   q, out      [total_tokens, num_q_heads, head_dim] rows: element d of token t (counted over
 *               the batch) and head h at t * token_stride + h * head_stride + d; q is q_dtype
 *               (f16 or bf16: it is also the tensor cores' operand type, so a bf16 cache needs
 *               bf16 queries), out is out_dtype (f16, bf16 or f32); q 16-byte aligned with
 *               strides that are multiples of 8
 *   lse         f32 [total_tokens, num_q_heads] at lse strides, natural log of the softmax
 *               denominator (sink included); may be null
 *   qo_indptr   [batch + 1] int32, non-decreasing, qo_indptr[batch] <= max_tokens; the rows of
 *               q / out / lse are tokens qo_indptr[0] .. qo_indptr[batch] (qo_indptr[0] is 0
 *               unless the launch serves the tail of a batch whose first rows went elsewhere)
 *   sinks       [num_q_heads] f32 or null: a logit per head that joins every row's softmax
 *               denominator only (gpt-oss); not scaled, not capped, not biased
 *   alibi_slopes  [num_q_heads] f32 or null: ALiBi's slope m_h (finite) per query head; the
 *               logit of the query at position p (head h) for the key at j <= p gains
 *               m_h * (j - p), after the cap (null: no bias)
 *   logits      softmax_scale * q.k, then logits_soft_cap * tanh(logits / logits_soft_cap)
 *               when logits_soft_cap > 0, then the ALiBi bias
 *   ws_o, ws_lse  split-KV workspace, used when num_splits > 1: f32 [num_splits, max_tokens *
 *               num_q_heads, head_dim] and [num_splits, max_tokens * num_q_heads]; a second
 *               kernel merges the splits (one launch at a time per workspace); after the
 *               warp-specialized kernel (sm_90a) it is launched with programmatic stream
 *               serialization: its blocks may be placed while the attention kernel finishes,
 *               and wait for it before their first read
 * The grid is sized by the capacity (max_tokens, batch), not by the step's token count, so one
 * launch captured in a CUDA graph serves any later step within it. Block ids outside
 * [0, num_blocks) and lengths outside [n_b, max_blocks * block_size] are counted in
 * counters[KVQ_COUNTER_OUT_OF_RANGE] (may be null); their tokens read as zeros.
 * Supported: kvq_prefill_supported. */
typedef struct kvq_prefill_args {
  kvq_cache cache;
  int64_t num_blocks;
  const void *q;
  void *out;
  float *lse;
  int64_t q_token_stride, q_head_stride;
  int64_t out_token_stride, out_head_stride;
  int64_t lse_token_stride, lse_head_stride;
  const int32_t *qo_indptr;
  const int32_t *block_tables;
  const int32_t *context_lens;
  const float *sinks;
  float *ws_o;
  float *ws_lse;
  unsigned long long *counters;
  int32_t q_dtype;
  int32_t out_dtype;
  int32_t batch;
  int32_t num_q_heads;
  int32_t max_blocks;
  int32_t max_tokens;
  int32_t num_splits;   /* 1..KVQ_PREFILL_MAX_SPLITS */
  int32_t split_tokens; /* a positive multiple of KVQ_PREFILL_TILE_TOKENS */
  int32_t window_left;  /* < 0: no window */
  float softmax_scale;
  float logits_soft_cap; /* <= 0: none */
  const float *alibi_slopes; /* may be null */
  int32_t e4m3_operands; /* 1: an fp8-e4m3 cache's codes feed FP8 tensor cores (sm_90a, head_dim
                          * 128), q and P rounded to E4M3 (docs/ACCURACY.md); else ignored */
  int32_t wide_tile_rows; /* the rows of a thread block's tile when the launch takes wide tiles
                           * (its sequences average 2 * KVQ_PREFILL_TILE_ROWS query rows or more):
                           * 3 * KVQ_PREFILL_TILE_ROWS asks for triple tiles (where they serve:
                           * sm_90a, head_dim 128, sides both 16-bit or both quantized), 2 * for
                           * wide ones; 0 lets the launcher choose by max_tokens over batch, as if
                           * every sequence had as many new tokens */
} kvq_prefill_args;

/* 1 when this build has a prefill kernel for (k_format, v_format, head_dim, q_dtype): every
 * cache format for K and V (INT4 sym32 and KVQ_INT4_KC as K, affine64 as V; int8-pth and fp4-e2m1
 * either), head_dim 64, 80, 96, 112, 128, 192 or 256 (a multiple of each format's group and of 32
 * for fp4-e2m1 and int4-kc), f16 or bf16 queries, and bf16 queries whenever a side is bf16. A
 * host function. */
int kvq_prefill_supported(int32_t k_format, int32_t v_format, int32_t head_dim, int32_t q_dtype);

/* Dynamic shared memory one prefill thread block of this layout and q_dtype uses (the largest
 * of its tile widths'; 0 when unsupported); also raises the kernels' limits, so call it once
 * outside graph capture. */
int kvq_prefill_prepare(const kvq_layout *layout, int32_t q_dtype, int32_t *smem_bytes);

/* Enqueue the prefill kernel (and the split merge when num_splits > 1) on `stream`. */
int kvq_prefill_attention(const kvq_prefill_args *args, void *stream);

/* Merge two partial attentions of the same rows over disjoint key sets (out normalized, lse
 * natural log, as kvq returns them): rows [rows, head_dim] of dtype (f16, bf16 or f32) in a,
 * b and out (contiguous), lse f32 [rows]; out may alias a or b, out_lse may alias a_lse or
 * b_lse. Rows whose lse are both -inf become zeros with lse -inf. */
int kvq_merge_states(const void *a, const float *a_lse, const void *b, const float *b_lse,
                     void *out, float *out_lse, int64_t rows, int32_t head_dim, int32_t dtype,
                     void *stream);

/* ---- streaming-read probes for bandwidth ceilings (cuda/bandwidth.cu) ---- */

/* Every probe reads a buffer once and adds the sum (mod 2^32) of the 32-bit words it read into
 * the words of a sink (uint32[KVQ_STREAM_SINK_WORDS], some words each): so nothing is optimised
 * away, and after zeroing the sink and one launch the sink's words sum to the buffer's. */
#define KVQ_STREAM_SINK_WORDS 4096
/* kvq_stream_fill writes 32-bit word i of a buffer as seed + i * KVQ_STREAM_FILL_STEP
 * (mod 2^32). */
#define KVQ_STREAM_FILL_STEP 0x9E3779B9

/* Number of read variants (load flavour, loads in flight, grid shape, bulk copies), and the
 * stable name of one ("nc-x16-t256-k3-tiles"; a static string), or null out of range. */
int32_t kvq_stream_read_variants(void);
const char *kvq_stream_read_variant_name(int32_t variant);

/* Read `bytes` (a multiple of 16, `src` 16-byte aligned) once with `variant`, checksum into
 * `sink` as above. KVQ_ERR_UNSUPPORTED: the variant cannot run on this device with this build
 * (bulk copies need sm_90+ code), or its blocks do not fit on an SM. */
int kvq_stream_read_variant(int32_t variant, const void *src, int64_t bytes, uint32_t *sink,
                            void *stream);

/* The default variant (the benchmark timer's L2 flush). `sink` holds at least
 * KVQ_STREAM_SINK_WORDS floats, used as raw uint32 checksum words. */
int kvq_stream_read(const void *src, int64_t bytes, float *sink, void *stream);

/* Fill `bytes` (a multiple of 16, 16-byte aligned) with the KVQ_STREAM_FILL_STEP sequence. */
int kvq_stream_fill(void *dst, int64_t bytes, uint32_t seed, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* KVQ_H */
