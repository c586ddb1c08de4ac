//! `kvq eval`: how much each K/V format pair costs in accuracy on real attention tensors.
//!
//! For every layer `L` the file holds `q.L`, `k.L`, `v.L` (`[tokens, heads, head_dim]`); without
//! a file, seeded synthetic Llama-like layers stand in (keys with outlier channels). Each format
//! pair stores all of a layer's K and V in a paged [`HostCache`], reads it back for the
//! reconstruction error, and decodes queries over the cache with [`cpu::decode_attention`]; the
//! reference is [`cpu::attention_dense`] on the unquantized f32 data. `int4-uniform` is not a
//! cache format: it is quantized with [`kvq::format::int4`]'s uniform code and attended with
//! `attention_dense` on the dequantized values. Errors pool over the chosen layers: relative L2
//! is `sqrt(Σ err² / Σ ref²)`.
//!
//! Calibration is held out by default (`--calibrate-on first-half`): the per-tensor / per-head
//! scales (FP8, int4-uniform) come from the first half of the tokens and only the second half
//! is scored, as a server calibrates offline and then meets tokens it has not seen (larger
//! values saturate). `--calibrate-on all` scores in-sample scales, an optimistic bound.
//! `--positions last` scores one decode step (the last token's query); `--positions all` every
//! scored position, causally, as a prefill would.
//!
//! `--scales FILE` (written by `kvq calibrate`) replaces the per-head scales of the FP8 rows of
//! its format with the file's (those rows are marked `file`). `--budget E` measures, per layer,
//! every pair the GPU decode kernels serve and picks the cheapest whose attention error is at
//! most `E` (plan.rs; `--plan-out` writes it, `--plan` scores a written one again).
//! `--hadamard` adds a row of INT4 keys rotated by a normalized Walsh–Hadamard transform
//! (rotate.rs).
//!
//! `int4-kc` (per-channel INT4 keys, groups of G tokens, `--kc-group`): its keys are quantized
//! as a paged cache of block size G holds them ([`int4_kc::Mode::Paged`], what
//! `tests/int4_kc_cache.rs` checks the cache against) and attended with `attention_dense`, its
//! values go through the cache of their format as in the other rows. `--budget` leaves it out:
//! its cache blocks hold an f16 block's bytes (the open block stays f16), so it saves read
//! bandwidth but not the memory a plan ranks pairs by. `--outliers N:SCALE[:OFFSET]` sets the
//! synthetic keys' outlier channels (default 2:8; OFFSET gives them a mean of ±OFFSET base
//! stds).
//!
//! `int3 + topK f16` and `int2 + topK f16` ([`outlier`]: per-token affine INT3 / INT2 key rows
//! with each KV head's K channels of largest RMS over the calibration tokens kept in f16,
//! `--keep-channels K`, default 4) are CPU references too: the keys are dequantized and attended
//! with `attention_dense`, the values go through the cache as in the `int4-kc` rows.
//!
//! The `(e4m3 MMAs)` rows attend an E4M3 or FP4 cache as FP8 tensor cores would
//! (`kvq::cpu::e4m3_operands`): the query rounded to E4M3 per row and the probabilities to E4M3
//! before they weigh V, as the prefill kernel's opt-in E4M3 operands do for E4M3 caches (no
//! kernel takes FP4 codes so yet); the other rows are the kernels' arithmetic.

use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use kvq::cache::{BlockAllocator, BlockTables, HostCache};
use kvq::calibrate::LayerScales;
use kvq::cpu::{self, Accum, AttentionOptions, DecodeShape, DenseKv};
use kvq::dense::DenseFormat;
use kvq::format::int4_kc::{self, KcShape};
use kvq::format::outlier::{self, OutlierKeys};
use kvq::format::{Fp8Kind, int4, sanitize, sanitized_amax};
use kvq::layout::MAX_BLOCK_SIZE;
use kvq::synth::Synth;
use kvq::{CacheConfig, KvFormat, ScaleGranularity};
use safetensors::SafeTensors;
use serde_json::{Value, json};

use crate::calibrate::ScalesFile;
use crate::files::{self, InputFile, LayerPattern, Tensor3};
use crate::plan::{self, Candidate, Choice, Plan};
use crate::rotate;
use crate::{CliError, print_out, progress};
use kvq::cpu::e4m3_operands;

/// Arguments of `kvq eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Safetensors file with q.L, k.L, v.L tensors, [tokens, heads, head_dim] (default:
    /// synthetic Llama-like layers, 2 x 512 tokens, 32 query / 8 kv heads of head_dim 128).
    input: Option<PathBuf>,
    /// Name of layer L's queries in the file, {L} standing for the layer index.
    #[arg(long, default_value = "q.{L}")]
    query_pattern: LayerPattern,
    /// Name of layer L's keys in the file, {L} standing for the layer index.
    #[arg(long, default_value = "k.{L}")]
    key_pattern: LayerPattern,
    /// Name of layer L's values in the file, {L} standing for the layer index.
    #[arg(long, default_value = "v.{L}")]
    value_pattern: LayerPattern,
    /// Join N adjacent heads into one (e.g. 2: [512, 12, 32] -> [512, 6, 64]), queries too: the
    /// attention scored is then that of heads N times wider, not the model's own. A way to
    /// study formats whose groups are wider than the model's heads, not a measure of them on
    /// this model (a cache takes the model's head_dim).
    #[arg(long, default_value_t = 1)]
    pair_heads: usize,
    /// Layers to evaluate, comma separated (default: every layer in the file).
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Also print one row per layer and pair.
    #[arg(long)]
    per_layer: bool,
    /// Tokens the FP8 and int4-uniform scales are calibrated on. first-half: scales from the
    /// first half, errors scored on the second (held out, as in serving); all: in-sample.
    #[arg(long, value_enum, default_value_t = Calibration::FirstHalf)]
    calibrate_on: Calibration,
    /// Query positions scored: last (one decode step) or all (every scored position, causal).
    /// Default: last, and all with --budget or --plan (a choice made on one query per head does
    /// not hold on the others).
    #[arg(long, value_enum)]
    positions: Option<Positions>,
    /// Print one JSON object instead of Markdown tables.
    #[arg(long)]
    json: bool,
    /// FP8 per-head scales written by `kvq calibrate` (k_scale.L, v_scale.L): the per-head
    /// rows of its format use them instead of scales from the --calibrate-on tokens.
    #[arg(long)]
    scales: Option<PathBuf>,
    /// Per layer, pick the cheapest K/V pair (bytes per element) whose attention relative error
    /// is at most E, among the pairs the GPU decode kernels serve (FP8 scales per head;
    /// int4-kc keys are no candidate: their cache blocks keep f16's size).
    #[arg(long, allow_negative_numbers = true, value_name = "E")]
    budget: Option<f64>,
    /// With --budget: write the per-layer plan to FILE as JSON.
    #[arg(long, requires = "budget", value_name = "FILE")]
    plan_out: Option<PathBuf>,
    /// Also score int4-k32 keys rotated by a normalized Walsh-Hadamard transform over head_dim
    /// (queries alike, so the logits do not change), with int4-v64 values, as its own row
    /// (head_dim a power of two).
    #[arg(long)]
    hadamard: bool,
    /// Score a plan written by --plan-out on this input: each layer's pair, its error now and
    /// whether it still meets the plan's budget.
    #[arg(long, conflicts_with = "budget")]
    plan: Option<PathBuf>,
    /// Tokens per group (G) of the int4-kc rows: 16, 32 or 64.
    #[arg(long, default_value_t = 32)]
    kc_group: usize,
    /// Synthetic keys only: N channels per head scaled SCALE times the rest (e.g. 4:50); with
    /// N:SCALE:OFFSET they also get a mean of +-OFFSET times the base std (e.g. 4:20:10).
    #[arg(long, conflicts_with = "input", default_value = "2:8")]
    outliers: Outliers,
    /// Channels per KV head kept in f16 by the int3 / int2 + topK f16 rows (fewer than
    /// head_dim; 0 quantizes whole rows).
    #[arg(long, default_value_t = 4)]
    keep_channels: usize,
    /// Score only the rows whose label contains one of these (case-insensitive, comma
    /// separated; e.g. `--only fp8,int4-k32` or `--only "e4m3 mmas"`). Default: every row.
    #[arg(long, value_delimiter = ',', value_name = "TEXT")]
    only: Vec<String>,
}

impl EvalArgs {
    /// The query positions scored: as given, else all when planning or checking a plan.
    fn positions(&self) -> Positions {
        match self.positions {
            Some(p) => p,
            None if self.budget.is_some() || self.plan.is_some() => Positions::All,
            None => Positions::Last,
        }
    }
}

/// The synthetic keys' outlier channels (`--outliers N:SCALE[:OFFSET]`).
#[derive(Clone, Copy, Debug)]
pub struct Outliers {
    channels: usize,
    scale: f32,
    /// Mean of each outlier channel in base standard deviations, its sign drawn per head and
    /// channel ([`Synth::with_offset_outlier_channels`]); 0 without the third field.
    offset: f32,
}

impl std::str::FromStr for Outliers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let fields: Vec<&str> = s.split(':').collect();
        let parsed = match fields[..] {
            [n, x] => Some((n, x, "0")),
            [n, x, o] => Some((n, x, o)),
            _ => None,
        }
        .and_then(|(n, x, o)| {
            let scale: f32 = x.parse().ok()?;
            let offset: f32 = o.parse().ok()?;
            let channels: usize = n.parse().ok()?;
            (channels <= SYNTH_HEAD_DIM
                && scale.is_finite()
                && scale > 0.0
                && offset.is_finite()
                && offset >= 0.0)
                .then_some(Outliers {
                    channels,
                    scale,
                    offset,
                })
        });
        parsed.ok_or_else(|| {
            format!(
                "'{s}' is not N:SCALE or N:SCALE:OFFSET (a channel count up to the synthetic \
                 head_dim {SYNTH_HEAD_DIM}, a positive finite scale and a finite offset >= 0, \
                 e.g. 4:50 or 4:20:10)"
            )
        })
    }
}

/// Where the per-tensor / per-head scales come from (`--calibrate-on`).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Calibration {
    /// Scales from tokens `0..T/2`, errors on `T/2..T`: what a server sees after calibrating.
    FirstHalf,
    /// Scales from every token, errors on every token: optimistic (no saturation).
    All,
}

/// Which queries are scored (`--positions`).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Positions {
    /// The last token's query over the whole context: one decode step.
    Last,
    /// Every scored token's query over the context up to it.
    All,
}

impl Calibration {
    fn name(self) -> &'static str {
        match self {
            Calibration::FirstHalf => "first-half",
            Calibration::All => "all",
        }
    }
}

impl Positions {
    fn name(self) -> &'static str {
        match self {
            Positions::Last => "last",
            Positions::All => "all",
        }
    }
}

/// The synthetic stand-in for a file: Llama-3-8B-like heads, keys with outlier channels.
const SYNTH_LAYERS: usize = 2;
const SYNTH_TOKENS: usize = 512;
const SYNTH_Q_HEADS: usize = 32;
const SYNTH_KV_HEADS: usize = 8;
const SYNTH_HEAD_DIM: usize = 128;
const SYNTH_SEED: u64 = 2024;

/// How one side (K or V) is stored.
#[derive(Clone, Copy)]
enum Storage {
    /// A cache format.
    Cache(KvFormat),
    /// Per-tensor INT4, the baseline without groups.
    Uniform,
    /// Keys in a cache format after a normalized Walsh–Hadamard rotation (`--hadamard`; the
    /// queries are rotated alike, rotate.rs).
    Hadamard(KvFormat),
    /// Keys in per-channel INT4 (`int4-kc`) with groups of this many tokens.
    KeysPerChannel(usize),
    /// Keys in per-token affine rows of `bits` bits with each head's `keep` largest channels in
    /// f16 ([`outlier`]).
    KeepOutliers { bits: u32, keep: usize },
}

impl Storage {
    fn name(self) -> String {
        match self {
            Storage::Cache(f) => f.name().to_string(),
            Storage::Uniform => DenseFormat::Int4Uniform.name().to_string(),
            Storage::Hadamard(f) => format!("{f} (hadamard)"),
            Storage::KeysPerChannel(g) => format!("{} (G={g})", int4_kc::NAME),
            Storage::KeepOutliers { bits, keep } => format!("int{bits} + top{keep} f16"),
        }
    }

    /// Bytes per element at `head_dim` (int8-pth's row scale and the outlier-aware rows' kept
    /// channels depend on it; a head_dim the outlier-aware rows cannot take counts their codes
    /// alone).
    fn bytes_per_element(self, head_dim: usize) -> f64 {
        match self {
            // The block size only matters to int4-kc, which is KeysPerChannel here.
            Storage::Cache(f) | Storage::Hadamard(f) => {
                f.bytes_per_element_at(head_dim, int4_kc::DENSE_GROUP)
            }
            Storage::Uniform => 0.5, // plus one f32 per tensor
            Storage::KeysPerChannel(g) => int4_kc::bytes_per_element(g),
            Storage::KeepOutliers { bits, keep } if keep < head_dim => {
                outlier::bytes_per_element(bits, keep, head_dim)
            }
            Storage::KeepOutliers { bits, .. } => bits as f64 / 8.0,
        }
    }

    fn check_head_dim(self, head_dim: usize) -> kvq::Result<()> {
        match self {
            Storage::Cache(f) => f.check_head_dim(head_dim),
            Storage::Uniform => DenseFormat::Int4Uniform.check_head_dim(head_dim),
            Storage::Hadamard(_) if !rotate::supports(head_dim) => {
                Err(kvq::Error::InvalidArgument(format!(
                    "the Hadamard rotation needs a power-of-two head_dim, not {head_dim}"
                )))
            }
            Storage::Hadamard(f) => f.check_head_dim(head_dim),
            Storage::KeysPerChannel(_) => int4_kc::check_head_dim(head_dim),
            Storage::KeepOutliers { keep, .. } => outlier::check_keep(keep, head_dim),
        }
    }

    /// Whether the storage takes calibrated scales per head or tensor (FP8's `s`, FP4's `g`).
    fn has_head_scale(self) -> bool {
        matches!(self, Storage::Cache(f) | Storage::Hadamard(f) if f.has_head_scale())
    }
}

/// Where a pair's FP8 scales come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scales {
    /// One scale per tensor, calibrated on the --calibrate-on tokens.
    Tensor,
    /// One scale per KV head, calibrated on the --calibrate-on tokens.
    Head,
    /// One scale per KV head, from the --scales file.
    File,
}

/// What the attention's MMAs take.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Operands {
    /// Codes decoded to f16 / bf16, with an f16 / bf16 query: the kernels' arithmetic, whose
    /// rounding does not show beside the cache's (the CPU reference sums in f64).
    Decoded,
    /// E4M3 on both sides, as FP8 tensor cores take them: the cache's codes as stored (E4M3, or
    /// E2M1 codes, which are E4M3 values, under group scales applied around the MMAs), the
    /// query and the probabilities rounded to E4M3 ([`e4m3_operands`]), as the prefill kernel's
    /// opt-in E4M3 operands do for E4M3 caches.
    E4m3,
}

/// A K format, a V format, where the FP8 scales come from (when either side is FP8), and what
/// the MMAs take.
#[derive(Clone, Copy)]
struct Pair {
    k: Storage,
    v: Storage,
    scales: Scales,
    operands: Operands,
}

impl Pair {
    const fn new(k: Storage, v: Storage, scales: Scales) -> Self {
        Pair {
            k,
            v,
            scales,
            operands: Operands::Decoded,
        }
    }

    /// A cache of `format` on both sides (its codes E4M3 values: fp8-e4m3, fp4-e2m1) attended
    /// with E4M3 MMA operands.
    const fn e4m3_mma(format: KvFormat, scales: Scales) -> Self {
        let side = Storage::Cache(format);
        Pair {
            k: side,
            v: side,
            scales,
            operands: Operands::E4m3,
        }
    }

    /// The pair with per-head scales from a --scales file of FP8 `kind`, where a side is FP8 of
    /// that kind and the scales are per head; else as it is.
    fn with_file_scales(self, kind: Option<Fp8Kind>) -> Self {
        let is_kind = |s: Storage| matches!(s, Storage::Cache(f) if f.fp8_kind() == kind);
        if kind.is_some() && self.scales == Scales::Head && (is_kind(self.k) || is_kind(self.v)) {
            Pair {
                scales: Scales::File,
                ..self
            }
        } else {
            self
        }
    }

    fn label(&self) -> String {
        let s = format!("{} / {}", self.k.name(), self.v.name());
        let notes: Vec<&str> = self
            .scale_name()
            .into_iter()
            .chain((self.operands == Operands::E4m3).then_some("e4m3 MMAs"))
            .collect();
        if notes.is_empty() {
            s
        } else {
            format!("{s} ({})", notes.join(", "))
        }
    }
}

/// The pairs in the table, from full precision down.
const PAIRS: [Pair; 17] = {
    use KvFormat::*;
    use Scales::{Head, Tensor};
    use Storage::{Cache as C, KeepOutliers as KO, KeysPerChannel as KC, Uniform as U};
    [
        Pair::new(C(F16), C(F16), Tensor),
        Pair::new(C(Bf16), C(Bf16), Tensor),
        Pair::new(C(Fp8E4m3), C(Fp8E4m3), Tensor),
        Pair::new(C(Fp8E4m3), C(Fp8E4m3), Head),
        Pair::e4m3_mma(Fp8E4m3, Head),
        Pair::new(C(Fp8E5m2), C(Fp8E5m2), Head),
        Pair::new(C(Int4Sym32), C(Int4Affine64), Tensor),
        Pair::new(C(Int4Sym32), C(Fp8E4m3), Head),
        // The group size is --kc-group's.
        Pair::new(KC(int4_kc::DENSE_GROUP), C(Int4Affine64), Tensor),
        Pair::new(KC(int4_kc::DENSE_GROUP), C(Fp8E4m3), Head),
        // The kept channels are --keep-channels'.
        Pair::new(KO { bits: 3, keep: 4 }, C(Int4Affine64), Tensor),
        Pair::new(KO { bits: 2, keep: 4 }, C(Int4Affine64), Tensor),
        Pair::new(C(Fp8E4m3), C(Int4Affine64), Head),
        Pair::new(C(Int8Pth), C(Int8Pth), Tensor),
        Pair::new(C(Fp4E2m1), C(Fp4E2m1), Head),
        Pair::e4m3_mma(Fp4E2m1, Head),
        Pair::new(U, U, Tensor),
    ]
};

/// The pairs a `--budget` plan chooses from: those the GPU decode kernels serve
/// (`kvq::cuda::decode::kernel_available`): f16, bf16, fp8-e4m3, int8-pth, fp4-e2m1 and INT4
/// (keys `int4-k32`, values `int4-v64`) mixed freely, and fp8-e5m2 with itself; FP8 and FP4
/// scales per KV head.
fn plan_candidates() -> Vec<Pair> {
    use KvFormat::*;
    let keys = [F16, Bf16, Fp8E4m3, Int8Pth, Fp4E2m1, Int4Sym32];
    let values = [F16, Bf16, Fp8E4m3, Int8Pth, Fp4E2m1, Int4Affine64];
    keys.iter()
        .flat_map(|&k| values.iter().map(move |&v| (k, v)))
        .chain([(Fp8E5m2, Fp8E5m2)])
        .map(|(k, v)| Pair::new(Storage::Cache(k), Storage::Cache(v), Scales::Head))
        .collect()
}

/// One layer's tensors, heads already joined.
struct Layer {
    index: usize,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Tokens the scales are calibrated on.
    calib: Range<usize>,
    /// Tokens whose K/V errors count (the queries scored are among them).
    scored: Range<usize>,
    /// Query positions scored: the last `q_len` tokens.
    q_len: usize,
    /// This layer's scales of the --scales file.
    file_scales: Option<LayerScales>,
}

/// Sums from which the pooled errors are computed.
#[derive(Default, Clone, Copy)]
struct ErrorSums {
    k: Diff,
    v: Diff,
    out: Diff,
    probs: ProbDiff,
}

/// How the attention distributions of the scored queries move when the keys are quantized:
/// Σ KL(p_ref ‖ p), and how many queries keep their most-attended token (the top-1 of p).
#[derive(Default, Clone, Copy)]
struct ProbDiff {
    kl: f64,
    top1_kept: usize,
    queries: usize,
}

impl ProbDiff {
    fn add(&mut self, o: ProbDiff) {
        self.kl += o.kl;
        self.top1_kept += o.top1_kept;
        self.queries += o.queries;
    }

    /// Mean KL divergence in nats (0 without queries).
    fn mean_kl(&self) -> f64 {
        self.kl / self.queries.max(1) as f64
    }

    /// Share of queries whose most-attended token is unchanged.
    fn top1(&self) -> f64 {
        if self.queries == 0 {
            1.0
        } else {
            self.top1_kept as f64 / self.queries as f64
        }
    }
}

/// Attention over a layer's unquantized K/V for its scored queries.
struct Reference {
    /// The output, as `cpu::attention_dense` gives it.
    out: Vec<f32>,
    /// Each query's attention distribution ([`Layer::distributions`]).
    probs: Vec<Vec<f64>>,
}

/// Σ (a − b)², Σ a², and max |a − b| of a reference `a` and an approximation `b`.
#[derive(Default, Clone, Copy)]
struct Diff {
    err2: f64,
    ref2: f64,
    max_abs: f64,
}

impl Diff {
    fn of(reference: &[f32], approx: &[f32]) -> Self {
        let mut d = Diff::default();
        for (&a, &b) in reference.iter().zip(approx) {
            let e = (a as f64 - b as f64).abs();
            d.err2 += e * e;
            d.ref2 += (a as f64) * (a as f64);
            d.max_abs = d.max_abs.max(e);
        }
        d
    }

    fn add(&mut self, o: Diff) {
        self.err2 += o.err2;
        self.ref2 += o.ref2;
        self.max_abs = self.max_abs.max(o.max_abs);
    }

    fn rel_l2(&self) -> f64 {
        if self.ref2 == 0.0 {
            self.err2.sqrt()
        } else {
            (self.err2 / self.ref2).sqrt()
        }
    }
}

impl ErrorSums {
    fn add(&mut self, o: ErrorSums) {
        self.k.add(o.k);
        self.v.add(o.v);
        self.out.add(o.out);
        self.probs.add(o.probs);
    }
}

/// Where the layers come from: a file, or the synthetic stand-in.
enum Source<'a> {
    File {
        path: &'a Path,
        st: SafeTensors<'a>,
        /// The names of a layer's q, k and v.
        names: [&'a LayerPattern; 3],
    },
    Synthetic(Outliers),
}

impl Source<'_> {
    fn describe(&self) -> String {
        match self {
            Source::File { path, .. } => path.display().to_string(),
            Source::Synthetic(o) => format!(
                "synthetic (seed {SYNTH_SEED}, keys with {} outlier channel(s) at {}x{}; pass a \
                 file for real data)",
                o.channels,
                o.scale,
                if o.offset > 0.0 {
                    format!(", offset +-{} std", o.offset)
                } else {
                    String::new()
                }
            ),
        }
    }

    fn layers(&self) -> Vec<usize> {
        match self {
            Source::File { st, names, .. } => files::layers_with(st, names),
            Source::Synthetic(_) => (0..SYNTH_LAYERS).collect(),
        }
    }

    /// q, k and v of layer `index`, heads not yet joined.
    fn tensors(&self, index: usize) -> Result<[Tensor3; 3], CliError> {
        match self {
            Source::File { st, names, .. } => Ok([
                files::load3(st, &names[0].name(index))?,
                files::load3(st, &names[1].name(index))?,
                files::load3(st, &names[2].name(index))?,
            ]),
            Source::Synthetic(o) => {
                let (t, kvh, d) = (SYNTH_TOKENS, SYNTH_KV_HEADS, SYNTH_HEAD_DIM);
                let mut s = Synth::new(SYNTH_SEED + index as u64);
                let k = s.with_offset_outlier_channels(t, kvh, d, o.channels, o.scale, o.offset);
                // Values with a per-channel offset (what affine INT4's zero point absorbs).
                let offsets = s.uniform(kvh * d, -1.0, 1.0);
                let mut v = s.normal(t * kvh * d, 0.5);
                for row in v.chunks_exact_mut(kvh * d) {
                    row.iter_mut().zip(&offsets).for_each(|(x, o)| *x += o);
                }
                let q = s.normal(t * SYNTH_Q_HEADS * d, 1.0);
                Ok([
                    (q, [t, SYNTH_Q_HEADS, d]),
                    (k, [t, kvh, d]),
                    (v, [t, kvh, d]),
                ])
            }
        }
    }
}

/// Which tokens calibrate, which are scored and how many queries, for `tokens` tokens.
fn plan(
    tokens: usize,
    calibrate_on: Calibration,
    positions: Positions,
) -> Result<(Range<usize>, Range<usize>, usize), CliError> {
    let (calib, scored) = match calibrate_on {
        Calibration::All => (0..tokens, 0..tokens),
        Calibration::FirstHalf if tokens < 2 => {
            return Err(CliError::new(format!(
                "--calibrate-on first-half needs at least 2 tokens, the file has {tokens} \
                 (use --calibrate-on all)"
            )));
        }
        Calibration::FirstHalf => (0..tokens / 2, tokens / 2..tokens),
    };
    let q_len = match positions {
        Positions::Last => 1,
        Positions::All => scored.len(),
    };
    Ok((calib, scored, q_len))
}

/// Layer `index` of `source`, heads joined, with its scales from `scales` (given only when a
/// scored pair takes them); `--keep-channels` is checked against its head_dim when `keep`
/// (a scored pair keeps outlier channels).
fn load_layer(
    source: &Source<'_>,
    index: usize,
    args: &EvalArgs,
    scales: Option<&ScalesFile>,
    keep: bool,
) -> Result<Layer, CliError> {
    let [(q, qs), (k, ks), (v, vs)] = source.tensors(index)?;
    if ks != vs
        || qs[0] != ks[0]
        || qs[2] != ks[2]
        || ks[1] == 0
        || ks[2] == 0
        || qs[1] % ks[1] != 0
        || qs[0] == 0
    {
        return Err(CliError::new(format!(
            "layer {index}: shapes q {qs:?}, k {ks:?}, v {vs:?} do not fit together \
             (need the same tokens > 0 and head_dim > 0, k and v equal, q heads a multiple of \
             kv heads > 0)"
        )));
    }
    let pair_heads = args.pair_heads;
    if ks[1] % pair_heads != 0 || qs[1] % pair_heads != 0 {
        return Err(CliError::new(format!(
            "--pair-heads {pair_heads} does not divide the {} heads of layer {index}",
            ks[1]
        )));
    }
    let (calib, scored, q_len) = plan(ks[0], args.calibrate_on, args.positions())?;
    let kv_heads = ks[1] / pair_heads;
    let head_dim = ks[2] * pair_heads;
    if keep {
        outlier::check_keep(args.keep_channels, head_dim).map_err(|e| {
            CliError::new(format!(
                "--keep-channels {} at head_dim {head_dim} of layer {index}: {e}",
                args.keep_channels
            ))
        })?;
    }
    let file_scales = match scales {
        Some(f) => Some(f.layer(index, kv_heads)?.clone()),
        None => None,
    };
    // Adjacent heads are adjacent in memory, so joining them only changes the shape.
    Ok(Layer {
        index,
        tokens: ks[0],
        q_heads: qs[1] / pair_heads,
        kv_heads,
        head_dim,
        q,
        k,
        v,
        calib,
        scored,
        q_len,
        file_scales,
    })
}

impl Layer {
    /// The scored queries, the last `q_len` tokens', head-major `[q_heads, q_len, head_dim]`
    /// as decode takes them (the file is token-major).
    fn queries(&self) -> Vec<f32> {
        let (h, d) = (self.q_heads, self.head_dim);
        let mut q = Vec::with_capacity(h * self.q_len * d);
        for head in 0..h {
            for t in self.tokens - self.q_len..self.tokens {
                q.extend_from_slice(&self.q[(t * h + head) * d..][..d]);
            }
        }
        q
    }

    fn shape(&self) -> DecodeShape {
        DecodeShape::new(self.q_heads, self.q_len)
    }

    /// Plain causal attention at `1 / sqrt(head_dim)`.
    fn opts(&self) -> AttentionOptions {
        AttentionOptions::new(self.head_dim)
    }

    /// Elements of the `[tokens, kv_heads, head_dim]` rows of `tokens`.
    fn rows(&self, tokens: &Range<usize>) -> Range<usize> {
        let row = self.kv_heads * self.head_dim;
        tokens.start * row..tokens.end * row
    }

    /// Attention over unquantized K/V, the reference every pair is compared with: computed
    /// once a layer.
    fn reference(&self, q: &[f32]) -> Result<Reference, CliError> {
        let mut probs = Vec::new();
        self.distributions(q, &self.k, |_, p| probs.push(p.to_vec()));
        Ok(Reference {
            out: self.attend_dense(q, &self.k, &self.v)?,
            probs,
        })
    }

    /// The KV head that query row `row` (head-major, as [`queries`](Self::queries)) reads.
    fn kv_head_of(&self, row: usize) -> usize {
        row / self.q_len / (self.q_heads / self.kv_heads)
    }

    /// The unnormalized attention weights `exp(s - max)` of every scored query (head-major `q`)
    /// over the tokens it sees (causal: query `i` of `q_len` sees tokens up to
    /// `tokens - q_len + i`) with keys `k`, in f64, passed to `f` one at a time.
    fn weights(&self, q: &[f32], k: &[f32], mut f: impl FnMut(usize, &mut Vec<f64>)) {
        let d = self.head_dim;
        let scale = f64::from(self.opts().softmax_scale);
        let mut p = Vec::with_capacity(self.tokens);
        for (row, qr) in q.chunks_exact(d).enumerate() {
            let kv = self.kv_head_of(row);
            let seen = self.tokens - self.q_len + row % self.q_len + 1;
            p.clear();
            p.extend((0..seen).map(|t| {
                let kr = &k[(t * self.kv_heads + kv) * d..][..d];
                scale
                    * qr.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
            }));
            let max = p.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            p.iter_mut().for_each(|x| *x = (*x - max).exp());
            f(row, &mut p);
        }
    }

    /// The attention distribution of every scored query ([`weights`](Self::weights)
    /// normalized), passed to `f` one at a time.
    fn distributions(&self, q: &[f32], k: &[f32], mut f: impl FnMut(usize, &[f64])) {
        self.weights(q, k, |row, p| {
            let sum: f64 = p.iter().sum();
            p.iter_mut().for_each(|x| *x /= sum);
            f(row, p);
        });
    }

    /// Attention as FP8 MMAs would compute it ([`e4m3_operands`]): `q` already rounded to E4M3 per
    /// row, `k` and `v` the cache's values, each probability rounded to E4M3 before it weighs
    /// V, the normalizer summing the unrounded ones.
    fn attend_e4m3_mma(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let d = self.head_dim;
        let mut out = vec![0f32; q.len()];
        let mut acc = vec![0f64; d];
        self.weights(q, k, |row, p| {
            let kv = self.kv_head_of(row);
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (t, &w) in p.iter().enumerate() {
                let w8 = e4m3_operands::probability(w);
                let vr = &v[(t * self.kv_heads + kv) * d..][..d];
                acc.iter_mut()
                    .zip(vr)
                    .for_each(|(a, &x)| *a += w8 * f64::from(x));
            }
            let sum: f64 = p.iter().sum();
            for (o, a) in out[row * d..][..d].iter_mut().zip(&acc) {
                *o = (a / sum) as f32;
            }
        });
        out
    }

    /// KL divergence and top-1 agreement of the scored queries' attention with keys `k`
    /// against the unquantized keys' (`reference`, one distribution per query). Only the keys
    /// move the distribution.
    fn prob_diff(&self, q: &[f32], k: &[f32], reference: &[Vec<f64>]) -> ProbDiff {
        let argmax =
            |p: &[f64]| (0..p.len()).fold(0, |best, t| if p[t] > p[best] { t } else { best });
        let mut diff = ProbDiff::default();
        self.distributions(q, k, |row, p| {
            let r = &reference[row];
            diff.kl += r
                .iter()
                .zip(p)
                .filter(|&(&a, _)| a > 0.0)
                .map(|(&a, &b)| a * (a / b.max(f64::MIN_POSITIVE)).ln())
                .sum::<f64>();
            diff.top1_kept += usize::from(argmax(r) == argmax(p));
            diff.queries += 1;
        });
        diff
    }

    fn attend_dense(&self, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>, CliError> {
        let kv = DenseKv {
            k,
            v,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        Ok(cpu::attention_dense(q, kv, &self.shape(), &self.opts(), Accum::F64)?.out)
    }

    /// The layer's K (`k`: the layer's keys, or the rotated keys of `--hadamard`) and V stored in
    /// a paged cache of `k_format` / `v_format`, with FP8 scales from the calibration tokens
    /// only, or from the --scales file: the cache, its one sequence's tables, and K and V read
    /// back.
    fn store(
        &self,
        k: &[f32],
        (k_format, v_format): (KvFormat, KvFormat),
        scales: Scales,
        block_size: usize,
    ) -> Result<(HostCache, BlockTables, [Vec<f32>; 2]), CliError> {
        let config =
            CacheConfig::new(self.kv_heads, self.head_dim, block_size, k_format, v_format)?;
        let blocks = self.tokens.div_ceil(block_size);
        let mut allocator = BlockAllocator::new(blocks, block_size)?;
        let mut cache = HostCache::new(config, blocks)?;
        let calib = self.rows(&self.calib);
        let (k_calib, v_calib) = (&k[calib.clone()], &self.v[calib]);
        match (scales, &self.file_scales) {
            (Scales::Tensor, _) => {
                cache.calibrate_fp8_scales(k_calib, v_calib, ScaleGranularity::PerTensor)?;
            }
            (Scales::Head, _) => {
                cache.calibrate_fp8_scales(k_calib, v_calib, ScaleGranularity::PerHead)?;
            }
            (Scales::File, Some(s)) => cache.set_scales(&s.k, &s.v)?,
            (Scales::File, None) => return Err(CliError::new("no --scales file was given")),
        }
        let seq = allocator.create_sequence();
        let reservation = allocator.reserve(seq, self.tokens)?;
        cache.write(&reservation.slots, k, &self.v)?;
        let tables = allocator.block_tables(&[seq])?;
        let (mut k, mut v) = (vec![0f32; k.len()], vec![0f32; self.v.len()]);
        cache.gather(tables.row(0), self.tokens, &mut k, &mut v)?;
        Ok((cache, tables, [k, v]))
    }

    /// K, V and attention output through a paged cache ([`store`](Self::store)); `q` is rotated
    /// alike where `k` is.
    fn through_cache(
        &self,
        q: &[f32],
        k: &[f32],
        formats: (KvFormat, KvFormat),
        scales: Scales,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let (cache, tables, [k, v]) = self.store(k, formats, scales, block_size)?;
        let out =
            cpu::decode_attention(&cache, &tables, q, &self.shape(), &self.opts(), Accum::F64)?.out;
        Ok([k, v, out])
    }

    /// [`through_cache`](Self::through_cache) with the keys and queries rotated by the
    /// normalized Walsh–Hadamard matrix first (the logits do not change, rotate.rs); the keys
    /// read back are rotated back for their error.
    fn through_rotated(
        &self,
        q: &[f32],
        formats: (KvFormat, KvFormat),
        scales: Scales,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let (mut q, mut k) = (q.to_vec(), self.k.clone());
        rotate::hadamard_rows(&mut q, self.head_dim);
        rotate::hadamard_rows(&mut k, self.head_dim);
        let [mut k, v, out] = self.through_cache(&q, &k, formats, scales, block_size)?;
        rotate::hadamard_rows(&mut k, self.head_dim);
        Ok([k, v, out])
    }

    /// K and V through `int4-uniform` (one scale `amax / 7` from the calibration tokens),
    /// attended densely.
    fn through_uniform(&self, q: &[f32]) -> Result<[Vec<f32>; 3], CliError> {
        let calib = self.rows(&self.calib);
        let round_trip = |x: &[f32]| -> Vec<f32> {
            let s = int4::uniform_scale(sanitized_amax(&x[calib.clone()]));
            x.iter()
                .map(|&v| int4::dequantize_uniform(int4::quantize_uniform(sanitize(v).0, s), s))
                .collect()
        };
        let (k, v) = (round_trip(&self.k), round_trip(&self.v));
        let out = self.attend_dense(q, &k, &v)?;
        Ok([k, v, out])
    }

    /// Keys through `int4-kc` with groups of `group` tokens as a paged cache of that block size
    /// would hold them (f16 first, full groups quantized per channel, an unfilled tail f16),
    /// values through a paged cache of `v_format` (stored beside f16 keys: V's scales and values
    /// are then exactly those of the other rows), attended densely.
    fn through_kc(
        &self,
        q: &[f32],
        group: usize,
        v_format: KvFormat,
        scales: Scales,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let shape = KcShape::new(self.tokens, self.kv_heads, self.head_dim, group)?;
        let k = int4_kc::quantize(&self.k, shape, int4_kc::Mode::Paged)?.dequantize()?;
        let formats = (KvFormat::F16, v_format);
        let (_, _, [_, v]) = self.store(&self.k, formats, scales, block_size)?;
        let out = self.attend_dense(q, &k, &v)?;
        Ok([k, v, out])
    }

    /// Keys as INT`bits` rows with each head's `keep` channels of largest RMS over the
    /// calibration tokens in f16 ([`OutlierKeys`]), values through a paged cache of `v_format`
    /// as in [`through_kc`](Self::through_kc), attended densely.
    fn through_outliers(
        &self,
        q: &[f32],
        (bits, keep): (u32, usize),
        v_format: KvFormat,
        scales: Scales,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let calib = &self.k[self.rows(&self.calib)];
        let keys = OutlierKeys::calibrate(calib, self.kv_heads, self.head_dim, bits, keep)?;
        let k = keys.round_trip(&self.k)?;
        let formats = (KvFormat::F16, v_format);
        let (_, _, [_, v]) = self.store(&self.k, formats, scales, block_size)?;
        let out = self.attend_dense(q, &k, &v)?;
        Ok([k, v, out])
    }

    /// Error sums of one pair on this layer: K/V over the scored tokens, the output over the
    /// scored queries.
    fn measure(
        &self,
        pair: &Pair,
        q: &[f32],
        reference: &Reference,
        block_size: usize,
    ) -> Result<ErrorSums, CliError> {
        // The query the logits see: the kernels' (as given), or E4M3's.
        let q_mma = (pair.operands == Operands::E4m3)
            .then(|| e4m3_operands::quantize_rows(q, self.head_dim));
        let [k, v, out] = match (pair.k, pair.v) {
            (Storage::Cache(kf), Storage::Cache(vf)) => match &q_mma {
                None => self.through_cache(q, &self.k, (kf, vf), pair.scales, block_size)?,
                Some(q_mma) => {
                    let (_, _, [k, v]) = self.store(&self.k, (kf, vf), pair.scales, block_size)?;
                    let out = self.attend_e4m3_mma(q_mma, &k, &v);
                    [k, v, out]
                }
            },
            (Storage::Hadamard(kf), Storage::Cache(vf)) => {
                self.through_rotated(q, (kf, vf), pair.scales, block_size)?
            }
            (Storage::KeysPerChannel(g), Storage::Cache(vf)) => {
                self.through_kc(q, g, vf, pair.scales, block_size)?
            }
            (Storage::KeepOutliers { bits, keep }, Storage::Cache(vf)) => {
                self.through_outliers(q, (bits, keep), vf, pair.scales, block_size)?
            }
            (Storage::Uniform, Storage::Uniform) => self.through_uniform(q)?,
            _ => {
                return Err(CliError::new(
                    "int4-uniform pairs only with itself (it is not a cache format), and only \
                     keys are rotated, per channel or outlier-aware",
                ));
            }
        };
        let q = q_mma.as_deref().unwrap_or(q);
        let scored = self.rows(&self.scored);
        // Rotated keys come back rotated back, so the logits are the original q's with them.
        Ok(ErrorSums {
            k: Diff::of(&self.k[scored.clone()], &k[scored.clone()]),
            v: Diff::of(&self.v[scored.clone()], &v[scored]),
            out: Diff::of(&reference.out, &out),
            probs: self.prob_diff(q, &k, &reference.probs),
        })
    }
}

/// Why a pair cannot run at this head_dim, if it cannot.
fn unsupported(pair: &Pair, head_dim: usize) -> Option<String> {
    [pair.k, pair.v]
        .iter()
        .find_map(|s| s.check_head_dim(head_dim).err())
        .map(|e| e.to_string())
}

const HEADER: &str = "| K / V format | B/elem | K rel L2 | K max abs | V rel L2 | V max abs | attn KL | top-1 kept | attn rel err |\n\
                      |---|---:|---:|---:|---:|---:|---:|---:|---:|\n";

impl Pair {
    /// Mean of the K and V storage cost at `head_dim`.
    fn bytes_per_element(&self, head_dim: usize) -> f64 {
        (self.k.bytes_per_element(head_dim) + self.v.bytes_per_element(head_dim)) / 2.0
    }

    /// Where the head scales come from, when a side is FP8 or FP4 (whose `g` is always per
    /// head).
    fn scale_name(&self) -> Option<&'static str> {
        (self.k.has_head_scale() || self.v.has_head_scale()).then_some(match self.scales {
            Scales::Tensor => "tensor",
            Scales::Head => "head",
            Scales::File => "file",
        })
    }
}

fn row(label: &str, pair: &Pair, head_dim: usize, e: Option<&ErrorSums>) -> String {
    let bpe = pair.bytes_per_element(head_dim);
    match e {
        Some(e) => format!(
            "| {label} | {bpe:.4} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.1}% | {:.2e} |\n",
            e.k.rel_l2(),
            e.k.max_abs,
            e.v.rel_l2(),
            e.v.max_abs,
            e.probs.mean_kl(),
            100.0 * e.probs.top1(),
            e.out.rel_l2()
        ),
        None => format!("| {label} | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |\n"),
    }
}

/// One pair's row as JSON (`errors` null when the pair cannot run at this head_dim).
fn json_row(pair: &Pair, head_dim: usize, e: Option<&ErrorSums>, skipped: Option<&str>) -> Value {
    let errors = e.map(|e| {
        json!({
            "k_rel_l2": e.k.rel_l2(),
            "k_max_abs": e.k.max_abs,
            "v_rel_l2": e.v.rel_l2(),
            "v_max_abs": e.v.max_abs,
            "attn_rel_err": e.out.rel_l2(),
            "attn_kl": e.probs.mean_kl(),
            "top1_kept": e.probs.top1(),
        })
    });
    // Format names as the other commands take them; how the keys were stored beside them.
    let k_format = match pair.k {
        Storage::KeysPerChannel(_) => int4_kc::NAME.to_string(),
        Storage::Hadamard(f) => f.name().to_string(),
        k => k.name(),
    };
    let mut doc = json!({
        "label": pair.label(),
        "k_format": k_format,
        "v_format": pair.v.name(),
        "fp8_scales": pair.scale_name(),
        "mma_operands": match pair.operands {
            Operands::Decoded => "decoded",
            Operands::E4m3 => "e4m3",
        },
        // A skipped pair has no storage at this head_dim.
        "bytes_per_element": skipped.is_none().then(|| pair.bytes_per_element(head_dim)),
        "errors": errors,
        "skipped": skipped,
    });
    match pair.k {
        Storage::KeysPerChannel(g) => doc["kc_group"] = json!(g),
        Storage::Hadamard(_) => doc["k_rotation"] = json!("hadamard"),
        _ => {}
    }
    doc
}

impl Pair {
    /// The K and V cache formats (`None` for int4-uniform, which is not one).
    fn formats(&self) -> Option<(KvFormat, KvFormat)> {
        match (self.k, self.v) {
            (Storage::Cache(k), Storage::Cache(v)) => Some((k, v)),
            _ => None,
        }
    }
}

/// Per layer, the measured candidates of a `--budget` plan and the choice among them.
fn choose_for_layer(
    layer: &Layer,
    candidates: &[Pair],
    budget: f64,
    measure: &mut dyn FnMut(&Pair) -> Result<ErrorSums, CliError>,
) -> Result<Choice, CliError> {
    let mut measured = Vec::with_capacity(candidates.len());
    for pair in candidates {
        let Some((k, v)) = pair.formats() else {
            continue;
        };
        if unsupported(pair, layer.head_dim).is_some() {
            continue;
        }
        measured.push(Candidate {
            k,
            v,
            bytes_per_element: pair.bytes_per_element(layer.head_dim),
            attn_err: measure(pair)?.out.rel_l2(),
        });
    }
    plan::choose(layer.index, budget, &measured).ok_or_else(|| {
        CliError::new(format!(
            "layer {}: no pair of the plan's candidates supports head_dim {}",
            layer.index, layer.head_dim
        ))
    })
}

/// The `--budget` plan as a Markdown table, with the mean bytes per element.
fn plan_text(plan: &Plan, scales: &str) -> String {
    let mut text = format!(
        "\nplan for --budget {:.2e}: per layer, the cheapest pair the GPU decode kernels serve \
         whose attn rel err is within it (FP8 scales {scales}):\n\n\
         | layer | K format | V format | B/elem | attn rel err |\n|---:|---|---|---:|---:|\n",
        plan.budget
    );
    for c in &plan.layers {
        let over = if c.within_budget {
            ""
        } else {
            " (over budget: the most accurate pair)"
        };
        let _ = writeln!(
            text,
            "| {} | {} | {} | {:.4} | {:.2e}{over} |",
            c.layer, c.pair.k, c.pair.v, c.pair.bytes_per_element, c.pair.attn_err
        );
    }
    let n = plan.layers.len().max(1) as f64;
    let mean = plan
        .layers
        .iter()
        .map(|c| c.pair.bytes_per_element)
        .sum::<f64>()
        / n;
    let _ = writeln!(
        text,
        "\nmean {mean:.4} bytes per element over {} layer(s) (f16: 2.0000)",
        plan.layers.len()
    );
    text
}

/// A `--plan` scored again: each layer's planned choice and its error on this input.
struct PlanCheck {
    planned: Choice,
    now: f64,
}

fn plan_check_text(path: &Path, budget: f64, checks: &[PlanCheck]) -> String {
    let mut text = format!(
        "\nplan '{}' (budget {budget:.2e}) on this input:\n\n\
         | layer | K format | V format | B/elem | attn rel err, planned | attn rel err, now | \
         within budget |\n|---:|---|---|---:|---:|---:|---|\n",
        path.display()
    );
    for c in checks {
        let p = &c.planned.pair;
        let _ = writeln!(
            text,
            "| {} | {} | {} | {:.4} | {:.2e} | {:.2e} | {} |",
            c.planned.layer,
            p.k,
            p.v,
            p.bytes_per_element,
            p.attn_err,
            c.now,
            if c.now <= budget { "yes" } else { "no" }
        );
    }
    text
}

/// Which tokens a scales file was calibrated on, and whether the scored ones are among them.
fn file_tokens(file: &ScalesFile, scored: &Range<usize>) -> String {
    match file.tokens() {
        None => "calibrated on every token: in-sample for these rows".to_string(),
        Some(t) if t.end <= scored.start || scored.end <= t.start => {
            format!("calibrated on tokens {t:?}: held out")
        }
        Some(t) => format!("calibrated on tokens {t:?}: in-sample where they meet {scored:?}"),
    }
}

/// Run `kvq eval`.
pub fn run(args: &EvalArgs) -> Result<(), CliError> {
    if args.pair_heads == 0 {
        return Err(CliError::new("--pair-heads must be at least 1"));
    }
    if args.block_size == 0 || args.block_size > MAX_BLOCK_SIZE {
        return Err(CliError::new(format!(
            "--block-size {} is not in 1..={MAX_BLOCK_SIZE}",
            args.block_size
        )));
    }
    let budget = args.budget.map(plan::check_budget).transpose()?;
    let scales = args.scales.as_deref().map(ScalesFile::read).transpose()?;
    let given_plan = args.plan.as_deref().map(Plan::read).transpose()?;
    if let Some(path) = &args.plan {
        files::note_input(path);
    }
    let file_kind = scales.as_ref().map(ScalesFile::kind);
    let file = match &args.input {
        Some(path) => Some(InputFile::read(path)?),
        None => None,
    };
    let source = match &file {
        Some(f) => Source::File {
            path: f.path(),
            st: f.parse()?,
            names: [&args.query_pattern, &args.key_pattern, &args.value_pattern],
        },
        None => Source::Synthetic(args.outliers),
    };
    let available = source.layers();
    if let (true, Some(f), Source::File { st, .. }) = (available.is_empty(), &file, &source) {
        return Err(files::no_layers_error(
            f,
            st,
            &[
                (&args.query_pattern, "--query-pattern"),
                (&args.key_pattern, "--key-pattern"),
                (&args.value_pattern, "--value-pattern"),
            ],
        ));
    }
    let chosen = files::choose_layers(&args.layers, &available, &source.describe())?;
    int4_kc::check_group(args.kc_group).map_err(|e| CliError::new(format!("--kc-group: {e}")))?;
    let mut pairs: Vec<Pair> = PAIRS
        .iter()
        .map(|p| match p.k {
            Storage::KeysPerChannel(_) => Pair {
                k: Storage::KeysPerChannel(args.kc_group),
                ..*p
            },
            Storage::KeepOutliers { bits, .. } => Pair {
                k: Storage::KeepOutliers {
                    bits,
                    keep: args.keep_channels,
                },
                ..*p
            },
            _ => *p,
        })
        .map(|p| p.with_file_scales(file_kind))
        .collect();
    if args.hadamard {
        // Beside the unrotated pair it is compared with.
        let (k, v) = (KvFormat::Int4Sym32, KvFormat::Int4Affine64);
        let at = pairs
            .iter()
            .position(|p| p.formats() == Some((k, v)))
            .map_or(pairs.len(), |i| i + 1);
        let rotated = Pair::new(Storage::Hadamard(k), Storage::Cache(v), Scales::Tensor);
        pairs.insert(at, rotated);
    }
    if !args.only.is_empty() {
        let wanted: Vec<String> = args.only.iter().map(|t| t.to_lowercase()).collect();
        let labels: Vec<String> = pairs.iter().map(Pair::label).collect();
        pairs.retain(|p| {
            let label = p.label().to_lowercase();
            wanted.iter().any(|t| label.contains(t.as_str()))
        });
        if pairs.is_empty() {
            return Err(CliError::new(format!(
                "--only {}: no row's label contains it (rows: {})",
                args.only.join(","),
                labels.join("; ")
            )));
        }
    }
    let candidates: Vec<Pair> = match budget {
        Some(_) => plan_candidates()
            .into_iter()
            .map(|p| p.with_file_scales(file_kind))
            .collect(),
        None => Vec::new(),
    };

    // What the scored pairs need of each layer: its scales from the file, a valid
    // --keep-channels.
    let takes_file_scales = |p: &Pair| p.scales == Scales::File;
    let file_scales = scales
        .as_ref()
        .filter(|_| given_plan.is_some() || pairs.iter().chain(&candidates).any(takes_file_scales));
    let keep = pairs
        .iter()
        .any(|p| matches!(p.k, Storage::KeepOutliers { .. }));
    let bar = progress(chosen.len() * (pairs.len() + candidates.len()), "eval");
    let mut pooled: Vec<Option<ErrorSums>> = vec![Some(ErrorSums::default()); pairs.len()];
    let mut skipped: Vec<Option<String>> = vec![None; pairs.len()];
    let (mut per_layer, mut per_layer_json) = (String::new(), Vec::new());
    let (mut choices, mut checks) = (Vec::new(), Vec::new());
    let mut first = None;
    for &index in &chosen {
        let layer = load_layer(&source, index, args, file_scales, keep)?;
        let q = layer.queries();
        let reference = layer.reference(&q)?;
        let mut measure = |pair: &Pair| {
            bar.inc(1);
            layer
                .measure(pair, &q, &reference, args.block_size)
                .map_err(|e| CliError::new(format!("layer {index}, {}: {e}", pair.label())))
        };
        for (i, pair) in pairs.iter().enumerate() {
            if let Some(why) = unsupported(pair, layer.head_dim) {
                bar.inc(1);
                pooled[i] = None;
                skipped[i] = Some(why);
                continue;
            }
            let e = measure(pair)?;
            if let Some(p) = &mut pooled[i] {
                p.add(e);
            }
            if args.per_layer {
                per_layer += &row(
                    &format!("L{} {}", layer.index, pair.label()),
                    pair,
                    layer.head_dim,
                    Some(&e),
                );
                let mut r = json_row(pair, layer.head_dim, Some(&e), None);
                r["layer"] = json!(layer.index);
                per_layer_json.push(r);
            }
        }
        if let Some(budget) = budget {
            choices.push(choose_for_layer(&layer, &candidates, budget, &mut measure)?);
        }
        if let Some(p) = &given_plan {
            let planned = *p.layer(index).ok_or_else(|| {
                CliError::new(format!("the plan has no layer {index} (--layers)"))
            })?;
            if let Some(d) = p.head_dim.filter(|&d| d != layer.head_dim) {
                return Err(CliError::new(format!(
                    "the plan was measured at head_dim {d}, layer {index} here has heads of {} \
                     (score a plan with the --pair-heads it was made with; here {})",
                    layer.head_dim, args.pair_heads
                )));
            }
            let (k, v) = (planned.pair.k, planned.pair.v);
            let pair = Pair::new(Storage::Cache(k), Storage::Cache(v), Scales::Head)
                .with_file_scales(file_kind);
            if let Some(why) = unsupported(&pair, layer.head_dim) {
                return Err(CliError::new(format!(
                    "layer {index} of the plan: {why} (score a plan with the --pair-heads it \
                     was made with; here {})",
                    args.pair_heads
                )));
            }
            let now = measure(&pair)?.out.rel_l2();
            checks.push(PlanCheck { planned, now });
        }
        if first.is_none() {
            // Drop the tensors: only the geometry is reported.
            first = Some(Layer {
                q: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                ..layer
            });
        }
    }
    bar.finish_and_clear();
    let Some(g) = first else {
        return Err(CliError::new("no layer was evaluated"));
    };
    if skipped.iter().all(Option::is_some) {
        let rows = if args.only.is_empty() {
            "no format pair takes"
        } else {
            "no row --only keeps takes"
        };
        return Err(CliError::new(format!(
            "{rows} head_dim {} (heads joined by --pair-heads {}; {}): --pair-heads N scores N \
             adjacent heads joined into one, queries too",
            g.head_dim,
            args.pair_heads,
            skipped.iter().flatten().next().map_or("", String::as_str)
        )));
    }
    let plan = budget.map(|budget| Plan {
        budget,
        head_dim: Some(g.head_dim),
        layers: choices,
    });
    if let (Some(plan), Some(path)) = (&plan, &args.plan_out) {
        plan::write(plan, path)?;
    }
    let scales_note = match &args.scales {
        Some(path) => format!("per head, from '{}' for its format", path.display()),
        None => "per head from the calibration tokens".to_string(),
    };

    if args.json {
        let pairs: Vec<Value> = pairs
            .iter()
            .zip(pooled.iter().zip(&skipped))
            .map(|(pair, (e, why))| json_row(pair, g.head_dim, e.as_ref(), why.as_deref()))
            .collect();
        let mut doc = json!({
            "kvq_version": env!("CARGO_PKG_VERSION"),
            "input": args.input.as_ref().map(|p| p.display().to_string()),
            "source": source.describe(),
            "layers": chosen,
            "tokens": g.tokens,
            "q_heads": g.q_heads,
            "kv_heads": g.kv_heads,
            "head_dim": g.head_dim,
            "pair_heads": args.pair_heads,
            "block_size": args.block_size,
            "calibrate_on": args.calibrate_on.name(),
            "calibration_tokens": [g.calib.start, g.calib.end],
            "scored_tokens": [g.scored.start, g.scored.end],
            "positions": args.positions().name(),
            "scored_queries": g.q_heads * g.q_len * chosen.len(),
            "query_positions": g.q_len,
            "accumulation": "f64",
            "scales_file": args.scales.as_ref().map(|p| p.display().to_string()),
            "scales_file_tokens": scales
                .as_ref()
                .map(|f| f.tokens().map(|t| [t.start, t.end])),
            "pairs": pairs,
        });
        if args.per_layer {
            doc["per_layer"] = Value::Array(per_layer_json);
        }
        if let Some(plan) = &plan {
            doc["plan"] = plan.to_value();
        }
        if let Some(p) = &given_plan {
            let rows: Vec<Value> = checks
                .iter()
                .map(|c| {
                    json!({
                        "layer": c.planned.layer,
                        "k_format": c.planned.pair.k.name(),
                        "v_format": c.planned.pair.v.name(),
                        "planned_attn_err": c.planned.pair.attn_err,
                        "attn_err": c.now,
                        "within_budget": c.now <= p.budget,
                    })
                })
                .collect();
            doc["plan_check"] = json!({ "budget": p.budget, "layers": rows });
        }
        let text = serde_json::to_string_pretty(&doc)
            .map_err(|e| CliError::new(format!("cannot format the JSON output: {e}")))?;
        return print_out(&(text + "\n"));
    }

    let mut text = String::new();
    let _ = writeln!(
        text,
        "{}: layers {chosen:?}, {} tokens, {} query / {} kv heads of head_dim {}{}, block size {}",
        source.describe(),
        g.tokens,
        g.q_heads,
        g.kv_heads,
        g.head_dim,
        if args.pair_heads > 1 {
            format!(
                " ({} heads joined, queries too: the attention of these wider heads, not the \
                 model's)",
                args.pair_heads
            )
        } else {
            String::new()
        },
        args.block_size
    );
    let calibration = match args.calibrate_on {
        Calibration::FirstHalf => format!(
            "FP8 / int4-uniform scales from tokens {:?}, errors on the held-out tokens {:?}",
            g.calib, g.scored
        ),
        Calibration::All => "FP8 / int4-uniform scales from every token (in-sample), \
                             errors on every token"
            .to_string(),
    };
    let calibration = match (&args.scales, &scales) {
        (Some(path), Some(file)) => format!(
            "{calibration} (rows marked (file): FP8 scales from '{}', {})",
            path.display(),
            file_tokens(file, &g.scored)
        ),
        _ => calibration,
    };
    let queries = match args.positions() {
        Positions::Last => "decode of the last token's query over all tokens".to_string(),
        Positions::All => format!(
            "the queries of tokens {:?}, each over the tokens up to it",
            g.tokens - g.q_len..g.tokens
        ),
    };
    let _ = writeln!(
        text,
        "{calibration};\n{queries}: {} scored queries ({} heads x {} position(s) x {} layer(s); \
         one query is {:.2} % of top-1 kept), f64 accumulation; errors vs unquantized f32, \
         pooled over layers (rel L2 = sqrt(sum err^2 / sum ref^2); --per-layer shows each)\n",
        g.q_heads * g.q_len * chosen.len(),
        g.q_heads,
        g.q_len,
        chosen.len(),
        100.0 / (g.q_heads * g.q_len * chosen.len()) as f64
    );
    text += HEADER;
    for (pair, e) in pairs.iter().zip(&pooled) {
        text += &row(&pair.label(), pair, g.head_dim, e.as_ref());
    }
    for (pair, why) in pairs.iter().zip(&skipped) {
        if let Some(why) = why {
            let _ = writeln!(text, "\n{}: n/a, {why}", pair.label());
        }
    }
    if skipped.iter().any(Option::is_some) {
        let _ = writeln!(
            text,
            "\n(n/a: the format does not take head_dim {}; --pair-heads N scores N adjacent \
             heads joined into one of head_dim N x {}, queries too: the attention of heads \
             that wide, not this model's)",
            g.head_dim,
            g.head_dim / args.pair_heads
        );
    }
    if args.per_layer {
        text += "\nper layer:\n\n";
        text += HEADER;
        text += &per_layer;
    }
    if let Some(plan) = &plan {
        text += &plan_text(plan, &scales_note);
    }
    if let (Some(p), Some(path)) = (&given_plan, &args.plan) {
        text += &plan_check_text(path, p.budget, &checks);
    }
    print_out(&text)
}
