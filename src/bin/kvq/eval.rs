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

use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use kvq::cache::{BlockAllocator, HostCache};
use kvq::cpu::{self, Accum, DecodeShape, DenseKv};
use kvq::dense::DenseFormat;
use kvq::format::{int4, sanitize, sanitized_amax};
use kvq::layout::MAX_BLOCK_SIZE;
use kvq::synth::Synth;
use kvq::{CacheConfig, KvFormat, ScaleGranularity};
use safetensors::SafeTensors;
use serde_json::{Value, json};

use crate::files::{self, InputFile};
use crate::{CliError, print_out, progress};

/// Arguments of `kvq eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Safetensors file with q.L, k.L, v.L tensors, [tokens, heads, head_dim] (default:
    /// synthetic Llama-like layers, 2 x 512 tokens, 32 query / 8 kv heads of head_dim 128).
    input: Option<PathBuf>,
    /// Join N adjacent heads into one (e.g. 2: [512, 12, 32] -> [512, 6, 64]).
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
    #[arg(long, value_enum, default_value_t = Positions::Last)]
    positions: Positions,
    /// Print one JSON object instead of Markdown tables.
    #[arg(long)]
    json: bool,
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
}

impl Storage {
    fn name(self) -> &'static str {
        match self {
            Storage::Cache(f) => f.name(),
            Storage::Uniform => DenseFormat::Int4Uniform.name(),
        }
    }

    fn bytes_per_element(self) -> f64 {
        match self {
            Storage::Cache(f) => f.bytes_per_element(),
            Storage::Uniform => 0.5, // plus one f32 per tensor
        }
    }

    fn check_head_dim(self, head_dim: usize) -> kvq::Result<()> {
        match self {
            Storage::Cache(f) => f.check_head_dim(head_dim),
            Storage::Uniform => DenseFormat::Int4Uniform.check_head_dim(head_dim),
        }
    }

    fn is_fp8(self) -> bool {
        matches!(self, Storage::Cache(f) if f.fp8_kind().is_some())
    }
}

/// A K format, a V format, and the FP8 scale granularity (when either side is FP8).
struct Pair {
    k: Storage,
    v: Storage,
    scales: ScaleGranularity,
}

impl Pair {
    const fn new(k: Storage, v: Storage, scales: ScaleGranularity) -> Self {
        Pair { k, v, scales }
    }

    fn label(&self) -> String {
        let s = format!("{} / {}", self.k.name(), self.v.name());
        match self.scale_name() {
            Some(g) => format!("{s} ({g})"),
            None => s,
        }
    }
}

/// The pairs in the table, from full precision down.
const PAIRS: [Pair; 9] = {
    use KvFormat::*;
    use ScaleGranularity::*;
    use Storage::{Cache as C, Uniform as U};
    [
        Pair::new(C(F16), C(F16), PerTensor),
        Pair::new(C(Bf16), C(Bf16), PerTensor),
        Pair::new(C(Fp8E4m3), C(Fp8E4m3), PerTensor),
        Pair::new(C(Fp8E4m3), C(Fp8E4m3), PerHead),
        Pair::new(C(Fp8E5m2), C(Fp8E5m2), PerHead),
        Pair::new(C(Int4Sym32), C(Int4Affine64), PerTensor),
        Pair::new(C(Int4Sym32), C(Fp8E4m3), PerHead),
        Pair::new(C(Fp8E4m3), C(Int4Affine64), PerHead),
        Pair::new(U, U, PerTensor),
    ]
};

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
}

/// Sums from which the pooled errors are computed.
#[derive(Default, Clone, Copy)]
struct ErrorSums {
    k: Diff,
    v: Diff,
    out: Diff,
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
    }
}

/// Layer indices `L` for which `q.L`, `k.L` and `v.L` all exist, ascending.
fn layers_in(st: &SafeTensors<'_>) -> Vec<usize> {
    let names = st.names();
    let mut layers: Vec<usize> = names
        .iter()
        .filter_map(|n| n.strip_prefix("q.")?.parse().ok())
        .filter(|l| {
            ["k", "v"]
                .iter()
                .all(|p| names.contains(&&*format!("{p}.{l}")))
        })
        .collect();
    layers.sort_unstable();
    layers
}

/// A `[tokens, heads, head_dim]` tensor as f32 with its three axes.
type Tensor3 = (Vec<f32>, [usize; 3]);

/// A `[tokens, heads, head_dim]` tensor of the file as f32.
fn load3(st: &SafeTensors<'_>, name: &str) -> Result<Tensor3, CliError> {
    let view = st
        .tensor(name)
        .map_err(|_| CliError::new(format!("tensor '{name}' is missing")))?;
    let &[t, h, d] = view.shape() else {
        return Err(CliError::new(format!(
            "tensor '{name}' has shape {:?}; expected [tokens, heads, head_dim]",
            view.shape()
        )));
    };
    Ok((files::to_f32(name, &view)?, [t, h, d]))
}

/// Where the layers come from: a file, or the synthetic stand-in.
enum Source<'a> {
    File { path: &'a Path, st: SafeTensors<'a> },
    Synthetic,
}

impl Source<'_> {
    fn describe(&self) -> String {
        match self {
            Source::File { path, .. } => path.display().to_string(),
            Source::Synthetic => format!(
                "synthetic (seed {SYNTH_SEED}, keys with outlier channels; pass a file for \
                 real data)"
            ),
        }
    }

    fn layers(&self) -> Vec<usize> {
        match self {
            Source::File { st, .. } => layers_in(st),
            Source::Synthetic => (0..SYNTH_LAYERS).collect(),
        }
    }

    /// q, k and v of layer `index`, heads not yet joined.
    fn tensors(&self, index: usize) -> Result<[Tensor3; 3], CliError> {
        match self {
            Source::File { st, .. } => Ok([
                load3(st, &format!("q.{index}"))?,
                load3(st, &format!("k.{index}"))?,
                load3(st, &format!("v.{index}"))?,
            ]),
            Source::Synthetic => {
                let (t, kvh, d) = (SYNTH_TOKENS, SYNTH_KV_HEADS, SYNTH_HEAD_DIM);
                let mut s = Synth::new(SYNTH_SEED + index as u64);
                let k = s.with_outlier_channels(t, kvh, d, 2, 8.0);
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

fn load_layer(source: &Source<'_>, index: usize, args: &EvalArgs) -> Result<Layer, CliError> {
    let [(q, qs), (k, ks), (v, vs)] = source.tensors(index)?;
    if ks != vs
        || qs[0] != ks[0]
        || qs[2] != ks[2]
        || ks[1] == 0
        || qs[1] % ks[1] != 0
        || qs[0] == 0
    {
        return Err(CliError::new(format!(
            "layer {index}: shapes q {qs:?}, k {ks:?}, v {vs:?} do not fit together \
             (need the same tokens > 0 and head_dim, k and v equal, q heads a multiple of \
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
    let (calib, scored, q_len) = plan(ks[0], args.calibrate_on, args.positions)?;
    // Adjacent heads are adjacent in memory, so joining them only changes the shape.
    Ok(Layer {
        index,
        tokens: ks[0],
        q_heads: qs[1] / pair_heads,
        kv_heads: ks[1] / pair_heads,
        head_dim: ks[2] * pair_heads,
        q,
        k,
        v,
        calib,
        scored,
        q_len,
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
        DecodeShape::new(self.q_heads, self.q_len, self.head_dim)
    }

    /// Elements of the `[tokens, kv_heads, head_dim]` rows of `tokens`.
    fn rows(&self, tokens: &Range<usize>) -> Range<usize> {
        let row = self.kv_heads * self.head_dim;
        tokens.start * row..tokens.end * row
    }

    /// Attention over unquantized K/V: the reference every pair is compared with.
    fn reference(&self, q: &[f32]) -> Result<Vec<f32>, CliError> {
        self.attend_dense(q, &self.k, &self.v)
    }

    fn attend_dense(&self, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>, CliError> {
        let kv = DenseKv {
            k,
            v,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        Ok(cpu::attention_dense(q, kv, &self.shape(), Accum::F64)?.out)
    }

    /// K, V and attention output through a paged cache of `k_format` / `v_format`, with FP8
    /// scales from the calibration tokens only.
    fn through_cache(
        &self,
        q: &[f32],
        (k_format, v_format): (KvFormat, KvFormat),
        scales: ScaleGranularity,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let config =
            CacheConfig::new(self.kv_heads, self.head_dim, block_size, k_format, v_format)?;
        let blocks = self.tokens.div_ceil(block_size);
        let mut allocator = BlockAllocator::new(blocks, block_size)?;
        let mut cache = HostCache::new(config, blocks)?;
        let calib = self.rows(&self.calib);
        cache.calibrate_fp8_scales(&self.k[calib.clone()], &self.v[calib], scales)?;
        let seq = allocator.create_sequence();
        let reservation = allocator.reserve(seq, self.tokens)?;
        cache.write(&reservation.slots, &self.k, &self.v)?;
        let tables = allocator.block_tables(&[seq])?;
        let (mut k, mut v) = (vec![0f32; self.k.len()], vec![0f32; self.v.len()]);
        cache.gather(tables.row(0), self.tokens, &mut k, &mut v)?;
        let out = cpu::decode_attention(&cache, &tables, q, &self.shape(), Accum::F64)?.out;
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

    /// Error sums of one pair on this layer: K/V over the scored tokens, the output over the
    /// scored queries.
    fn measure(
        &self,
        pair: &Pair,
        q: &[f32],
        reference: &[f32],
        block_size: usize,
    ) -> Result<ErrorSums, CliError> {
        let [k, v, out] = match (pair.k, pair.v) {
            (Storage::Cache(kf), Storage::Cache(vf)) => {
                self.through_cache(q, (kf, vf), pair.scales, block_size)?
            }
            (Storage::Uniform, Storage::Uniform) => self.through_uniform(q)?,
            _ => {
                return Err(CliError::new(
                    "int4-uniform pairs only with itself (it is not a cache format)",
                ));
            }
        };
        let scored = self.rows(&self.scored);
        Ok(ErrorSums {
            k: Diff::of(&self.k[scored.clone()], &k[scored.clone()]),
            v: Diff::of(&self.v[scored.clone()], &v[scored]),
            out: Diff::of(reference, &out),
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

const HEADER: &str = "| K / V format | B/elem | K rel L2 | K max abs | V rel L2 | V max abs | attn rel err |\n\
                      |---|---:|---:|---:|---:|---:|---:|\n";

impl Pair {
    /// Mean of the K and V storage cost.
    fn bytes_per_element(&self) -> f64 {
        (self.k.bytes_per_element() + self.v.bytes_per_element()) / 2.0
    }

    /// The FP8 scale granularity, when a side is FP8.
    fn scale_name(&self) -> Option<&'static str> {
        (self.k.is_fp8() || self.v.is_fp8()).then_some(match self.scales {
            ScaleGranularity::PerTensor => "tensor",
            ScaleGranularity::PerHead => "head",
        })
    }
}

fn row(label: &str, pair: &Pair, e: Option<&ErrorSums>) -> String {
    let bpe = pair.bytes_per_element();
    match e {
        Some(e) => format!(
            "| {label} | {bpe:.4} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |\n",
            e.k.rel_l2(),
            e.k.max_abs,
            e.v.rel_l2(),
            e.v.max_abs,
            e.out.rel_l2()
        ),
        None => format!("| {label} | {bpe:.4} | n/a | n/a | n/a | n/a | n/a |\n"),
    }
}

/// One pair's row as JSON (`errors` null when the pair cannot run at this head_dim).
fn json_row(pair: &Pair, e: Option<&ErrorSums>, skipped: Option<&str>) -> Value {
    let errors = e.map(|e| {
        json!({
            "k_rel_l2": e.k.rel_l2(),
            "k_max_abs": e.k.max_abs,
            "v_rel_l2": e.v.rel_l2(),
            "v_max_abs": e.v.max_abs,
            "attn_rel_err": e.out.rel_l2(),
        })
    });
    json!({
        "label": pair.label(),
        "k_format": pair.k.name(),
        "v_format": pair.v.name(),
        "fp8_scales": pair.scale_name(),
        "bytes_per_element": pair.bytes_per_element(),
        "errors": errors,
        "skipped": skipped,
    })
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
    let file = match &args.input {
        Some(path) => Some(InputFile::read(path)?),
        None => None,
    };
    let source = match &file {
        Some(f) => Source::File {
            path: f.path(),
            st: f.parse()?,
        },
        None => Source::Synthetic,
    };
    let available = source.layers();
    if available.is_empty() {
        return Err(CliError::new(format!(
            "'{}' holds no layer with all of q.L, k.L and v.L",
            source.describe()
        )));
    }
    let chosen = if args.layers.is_empty() {
        available.clone()
    } else if let Some(l) = args.layers.iter().find(|l| !available.contains(l)) {
        return Err(CliError::new(format!(
            "layer {l} is not in '{}' (it has layers {available:?})",
            source.describe()
        )));
    } else {
        args.layers.clone()
    };

    let bar = progress(chosen.len() * PAIRS.len(), "eval");
    let mut pooled: Vec<Option<ErrorSums>> = vec![Some(ErrorSums::default()); PAIRS.len()];
    let mut skipped: Vec<Option<String>> = vec![None; PAIRS.len()];
    let (mut per_layer, mut per_layer_json) = (String::new(), Vec::new());
    let mut first = None;
    for &index in &chosen {
        let layer = load_layer(&source, index, args)?;
        let q = layer.queries();
        let reference = layer.reference(&q)?;
        for (i, pair) in PAIRS.iter().enumerate() {
            bar.inc(1);
            if let Some(why) = unsupported(pair, layer.head_dim) {
                pooled[i] = None;
                skipped[i] = Some(why);
                continue;
            }
            let e = layer
                .measure(pair, &q, &reference, args.block_size)
                .map_err(|e| CliError::new(format!("layer {index}, {}: {e}", pair.label())))?;
            if let Some(p) = &mut pooled[i] {
                p.add(e);
            }
            if args.per_layer {
                per_layer += &row(
                    &format!("L{} {}", layer.index, pair.label()),
                    pair,
                    Some(&e),
                );
                let mut r = json_row(pair, Some(&e), None);
                r["layer"] = json!(layer.index);
                per_layer_json.push(r);
            }
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

    if args.json {
        let pairs: Vec<Value> = PAIRS
            .iter()
            .zip(pooled.iter().zip(&skipped))
            .map(|(pair, (e, why))| json_row(pair, e.as_ref(), why.as_deref()))
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
            "positions": args.positions.name(),
            "query_positions": g.q_len,
            "accumulation": "f64",
            "pairs": pairs,
        });
        if args.per_layer {
            doc["per_layer"] = Value::Array(per_layer_json);
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
            format!(" ({} heads joined)", args.pair_heads)
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
    let queries = match args.positions {
        Positions::Last => "decode of the last token's query over all tokens".to_string(),
        Positions::All => format!(
            "the queries of tokens {:?}, each over the tokens up to it",
            g.tokens - g.q_len..g.tokens
        ),
    };
    let _ = writeln!(
        text,
        "{calibration};\n{queries}, f64 accumulation; errors vs unquantized f32, pooled over \
         layers (rel L2 = sqrt(sum err^2 / sum ref^2))\n"
    );
    text += HEADER;
    for (pair, e) in PAIRS.iter().zip(&pooled) {
        text += &row(&pair.label(), pair, e.as_ref());
    }
    for (pair, why) in PAIRS.iter().zip(&skipped) {
        if let Some(why) = why {
            let _ = writeln!(text, "\n{}: n/a, {why}", pair.label());
        }
    }
    if args.per_layer {
        text += "\nper layer:\n\n";
        text += HEADER;
        text += &per_layer;
    }
    print_out(&text)
}
