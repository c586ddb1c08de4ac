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

// Every unsafe operation sits in its own `unsafe` block with a `// SAFETY:` line, also inside
// `unsafe fn`s (whose bodies would otherwise be one implicit unsafe block).
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
pub use format::{KvFormat, ScaleGranularity};
pub use layout::{BlockLayout, CacheConfig};
