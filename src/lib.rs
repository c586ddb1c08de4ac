//! # kvq — attention over a quantized, paged KV cache
//!
//! Data flows one way, and each step is a module you can read alone:
//!
//! | layer | module | what it holds |
//! |---|---|---|
//! | element format | [`format`](mod@format) | FP8 / INT4 / f16 / bf16 math for one token row, bit-exact with FORMATS.md |
//! | layout | [`layout`] | where codes, scales and zeros of a block live (host and device agree) |
//! | cache | [`cache`] | block allocator, block tables, a host-side pool that quantizes on append |
//! | attention | [`cpu`] | the reference attention (decode, ragged prefill, state merging), the oracle for the GPU kernels |
//! | GPU | `cuda` (feature `cuda`) | device cache, append / dequantize kernels, fused decode and prefill attention |
//!
//! Beside the pipeline: [`dense`] quantizes whole tensors in the file layout of `kvq quantize`;
//! [`calibrate`] computes per-KV-head FP8 scales from sample K/V (amax or a percentile of |x|);
//! [`synth`] makes seeded synthetic activations with outlier channels; `plan` (feature `plan`)
//! reads the per-layer format plans `kvq eval --budget` writes; `report` (feature
//! `bench`) holds benchmark results and the bytes a decode must read; `plot` (feature `plot`)
//! draws bench charts.
//! The format definitions are normative and bit-exact: `docs/FORMATS.md`. The GPU figures and
//! how they were measured: `docs/PERFORMANCE.md`.
//!
//! ## A step on the CPU
//!
//! The CPU path is the GPU's oracle and needs nothing but cargo: a cache, appends, a ragged
//! prefill and a decode step (the same code is in the README; the GPU path, README "Using the
//! GPU path", takes the same tables).
//!
//! ```
//! use kvq::cache::PagedKvCache;
//! use kvq::cpu::{self, Accum, AttentionOptions, DecodeShape, HeadTerms};
//! use kvq::{CacheConfig, KvFormat, ScaleGranularity};
//!
//! // One layer of a Llama-like model: 32 query heads over 8 KV heads of 128, blocks of 16
//! // tokens, FP8 keys and INT4 values (formats by name: `KvFormat::from_name("int4-v64")`), a
//! // pool of 64 blocks. `CacheConfig::new` takes the same fields in this order; the literal names
//! // them (`PagedKvCache::new` validates it).
//! let (q_heads, kv_heads, d) = (32, 8, 128);
//! let config = CacheConfig {
//!     num_kv_heads: kv_heads,
//!     head_dim: d,
//!     block_size: 16,
//!     k_format: KvFormat::Fp8E4m3,
//!     v_format: KvFormat::Int4Affine64,
//! };
//! let mut cache = PagedKvCache::new(config, 1, 64)?;
//! let values = |n: usize, seed: f32| -> Vec<f32> {
//!     (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect()
//! };
//!
//! // Two prompts of 20 and 7 tokens; K and V are [tokens, kv_heads, d] per layer. FP8's scales
//! // per KV head are set before the first write (under 1.0 it would saturate at 448).
//! let row = kv_heads * d;
//! let (k, v) = (values(27 * row, 0.0), values(27 * row, 1.0));
//! cache.layers_mut()[0].calibrate_fp8_scales(&k, &v, ScaleGranularity::PerHead)?;
//! let (a, b) = (cache.create_sequence(), cache.create_sequence());
//! cache.append(a, &[&k[..20 * row]], &[&v[..20 * row]])?;
//! cache.append(b, &[&k[20 * row..]], &[&v[20 * row..]])?;
//!
//! // Prefill: each prompt token attends causally to its sequence in the cache. q is
//! // [tokens, q_heads, d]; sequence i owns rows qo[i]..qo[i + 1]. Tables and lengths come from
//! // the allocator that reserved the slots.
//! let tables = cache.block_tables(&[a, b])?;
//! let qo = [0u32, 20, 27];
//! let q = values(27 * q_heads * d, 2.0);
//! let opts = AttentionOptions::new(d); // softmax_scale 1 / sqrt(d), no window or soft cap
//! let layer = &cache.layers()[0];
//! let none = HeadTerms::default(); // or sinks / ALiBi slopes per query head
//! let prefill = cpu::prefill_attention(layer, &tables, &qo, &q, q_heads, &opts, none, Accum::F64)?;
//! assert_eq!(prefill.out.len(), q.len());
//!
//! // Decode: append each sequence's next token, then one query per sequence,
//! // q [batch, q_heads, q_len, d].
//! for s in [a, b] {
//!     cache.append(s, &[&values(row, 3.0)], &[&values(row, 4.0)])?;
//! }
//! let tables = cache.block_tables(&[a, b])?;
//! let q = values(2 * q_heads * d, 5.0);
//! let shape = DecodeShape::new(q_heads, 1); // (num_q_heads, q_len)
//! let decode = cpu::decode_attention(&cache.layers()[0], &tables, &q, &shape, &opts, Accum::F64)?;
//! assert_eq!(decode.lse.len(), 2 * q_heads);
//!
//! // A prefix hit: a fork shares a's blocks; its first append copies the shared, partly filled
//! // last block (copy-on-write), so a keeps its tokens. With an allocator of the engine's own,
//! // `BlockAllocator::reserve` returns those copies for `HostCache::apply_copies` (or
//! // `DeviceCache::copy_blocks`) to apply before the write.
//! let c = cache.fork(a)?;
//! cache.append(c, &[&values(row, 6.0)], &[&values(row, 7.0)])?;
//! let tables = cache.block_tables(&[a, c])?;
//! assert_eq!((cache.len(a)?, cache.len(c)?), (21, 22));
//! assert_eq!(tables.row(0)[0], tables.row(1)[0]); // the full first block is still shared
//! assert_ne!(tables.row(0)[1], tables.row(1)[1]); // the last one was copied
//! # Ok::<(), kvq::Error>(())
//! ```

// Every unsafe operation sits in its own `unsafe` block with a `// SAFETY:` line, also inside
// `unsafe fn`s (whose bodies would otherwise be one implicit unsafe block).
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
// docs.rs (nightly, `--cfg docsrs`) marks feature-gated items with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod cache;
pub mod calibrate;
#[cfg(feature = "candle")]
#[cfg_attr(docsrs, doc(cfg(feature = "candle")))]
pub mod candle;
pub mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod dense;
pub mod error;
pub mod format;
pub mod layout;
#[cfg(feature = "plan")]
#[cfg_attr(docsrs, doc(cfg(feature = "plan")))]
pub mod plan;
#[cfg(feature = "plot")]
#[cfg_attr(docsrs, doc(cfg(feature = "plot")))]
pub mod plot;
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
pub mod report;
pub mod synth;

/// The `f16` / `bf16` types of kvq's API (rows, queries, outputs), so that a user's code names
/// the same `half` version kvq was built with.
pub use half;

pub use error::{Error, Result};
pub use format::{Element, KvFormat, ScaleGranularity};
pub use layout::{BlockLayout, CacheConfig};
