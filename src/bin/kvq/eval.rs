//! `kvq eval`: how much each K/V format pair costs in accuracy on real attention tensors.
//!
//! For every layer `L` the file holds `q.L`, `k.L`, `v.L` (`[tokens, heads, head_dim]`). Each
//! format pair stores all of a layer's K and V in a paged [`HostCache`] (FP8 scales calibrated
//! from the same data), reads it back for the reconstruction error, and decodes the last
//! token's query over every token with [`cpu::decode_attention`]; the reference is
//! [`cpu::attention_dense`] on the unquantized f32 data. `int4-uniform` is not a cache format:
//! it is quantized with [`kvq::dense`] and attended with `attention_dense` on the dequantized
//! values. Errors pool over the chosen layers: relative L2 is `sqrt(Σ err² / Σ ref²)`.

use std::fmt::Write as _;
use std::path::PathBuf;

use kvq::cache::{BlockAllocator, HostCache};
use kvq::cpu::{self, Accum, DecodeShape, DenseKv};
use kvq::dense::{self, DenseFormat, Fp8ScaleChoice};
use kvq::layout::MAX_BLOCK_SIZE;
use kvq::{CacheConfig, KvFormat, ScaleGranularity};
use safetensors::SafeTensors;

use crate::files::{self, InputFile};
use crate::{CliError, print_out, progress};

/// Arguments of `kvq eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Safetensors file with q.L, k.L, v.L tensors, [tokens, heads, head_dim].
    input: PathBuf,
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
}

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
        let mut s = format!("{} / {}", self.k.name(), self.v.name());
        if self.k.is_fp8() || self.v.is_fp8() {
            s += match self.scales {
                ScaleGranularity::PerTensor => " (tensor)",
                ScaleGranularity::PerHead => " (head)",
            };
        }
        s
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
fn load3(st: &SafeTensors<'_>, name: &str) -> Result<(Vec<f32>, [usize; 3]), CliError> {
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

fn load_layer(st: &SafeTensors<'_>, index: usize, pair_heads: usize) -> Result<Layer, CliError> {
    let (q, qs) = load3(st, &format!("q.{index}"))?;
    let (k, ks) = load3(st, &format!("k.{index}"))?;
    let (v, vs) = load3(st, &format!("v.{index}"))?;
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
    if ks[1] % pair_heads != 0 || qs[1] % pair_heads != 0 {
        return Err(CliError::new(format!(
            "--pair-heads {pair_heads} does not divide the {} heads of layer {index}",
            ks[1]
        )));
    }
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
    })
}

impl Layer {
    /// The last token's query, `[q_heads, 1, head_dim]`.
    fn last_query(&self) -> &[f32] {
        let n = self.q_heads * self.head_dim;
        &self.q[(self.tokens - 1) * n..][..n]
    }

    fn shape(&self) -> DecodeShape {
        DecodeShape::new(self.q_heads, 1, self.head_dim)
    }

    fn dense(&self) -> [usize; 3] {
        [self.tokens, self.kv_heads, self.head_dim]
    }

    /// Attention over unquantized K/V: the reference every pair is compared with.
    fn reference(&self) -> Result<Vec<f32>, CliError> {
        self.attend_dense(&self.k, &self.v)
    }

    fn attend_dense(&self, k: &[f32], v: &[f32]) -> Result<Vec<f32>, CliError> {
        let kv = DenseKv {
            k,
            v,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        Ok(cpu::attention_dense(self.last_query(), kv, &self.shape(), Accum::F64)?.out)
    }

    /// K, V and attention output through a paged cache of `k_format` / `v_format`.
    fn through_cache(
        &self,
        k_format: KvFormat,
        v_format: KvFormat,
        scales: ScaleGranularity,
        block_size: usize,
    ) -> Result<[Vec<f32>; 3], CliError> {
        let config =
            CacheConfig::new(self.kv_heads, self.head_dim, block_size, k_format, v_format)?;
        let blocks = self.tokens.div_ceil(block_size);
        let mut allocator = BlockAllocator::new(blocks, block_size)?;
        let mut cache = HostCache::new(config, blocks)?;
        cache.calibrate_fp8_scales(&self.k, &self.v, scales)?;
        let seq = allocator.create_sequence();
        let reservation = allocator.reserve(seq, self.tokens)?;
        cache.write(&reservation.slots, &self.k, &self.v)?;
        let tables = allocator.block_tables(&[seq])?;
        let (mut k, mut v) = (vec![0f32; self.k.len()], vec![0f32; self.v.len()]);
        cache.gather(tables.row(0), self.tokens, &mut k, &mut v)?;
        let out = cpu::decode_attention(
            &cache,
            &tables,
            self.last_query(),
            &self.shape(),
            Accum::F64,
        )?
        .out;
        Ok([k, v, out])
    }

    /// K and V through `int4-uniform`, attended densely.
    fn through_uniform(&self) -> Result<[Vec<f32>; 3], CliError> {
        let round_trip = |x: &[f32]| -> Result<Vec<f32>, CliError> {
            let q = dense::quantize(
                DenseFormat::Int4Uniform,
                x,
                &self.dense(),
                Fp8ScaleChoice::PerTensorAmax,
            )?;
            Ok(dense::dequantize(&q))
        };
        let (k, v) = (round_trip(&self.k)?, round_trip(&self.v)?);
        let out = self.attend_dense(&k, &v)?;
        Ok([k, v, out])
    }

    /// Error sums of one pair on this layer.
    fn measure(
        &self,
        pair: &Pair,
        reference: &[f32],
        block_size: usize,
    ) -> Result<ErrorSums, CliError> {
        let [k, v, out] = match (pair.k, pair.v) {
            (Storage::Cache(kf), Storage::Cache(vf)) => {
                self.through_cache(kf, vf, pair.scales, block_size)?
            }
            (Storage::Uniform, Storage::Uniform) => self.through_uniform()?,
            _ => {
                return Err(CliError::new(
                    "int4-uniform pairs only with itself (it is not a cache format)",
                ));
            }
        };
        Ok(ErrorSums {
            k: Diff::of(&self.k, &k),
            v: Diff::of(&self.v, &v),
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

fn row(label: &str, pair: &Pair, e: Option<&ErrorSums>) -> String {
    let bpe = (pair.k.bytes_per_element() + pair.v.bytes_per_element()) / 2.0;
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
    let file = InputFile::read(&args.input)?;
    let st = file.parse()?;
    let available = layers_in(&st);
    if available.is_empty() {
        return Err(CliError::new(format!(
            "'{}' holds no layer with all of q.L, k.L and v.L",
            args.input.display()
        )));
    }
    let chosen = if args.layers.is_empty() {
        available.clone()
    } else if let Some(l) = args.layers.iter().find(|l| !available.contains(l)) {
        return Err(CliError::new(format!(
            "layer {l} is not in '{}' (it has layers {available:?})",
            args.input.display()
        )));
    } else {
        args.layers.clone()
    };

    let bar = progress(chosen.len() * PAIRS.len(), "eval");
    let mut pooled: Vec<Option<ErrorSums>> = vec![Some(ErrorSums::default()); PAIRS.len()];
    let mut skipped: Vec<Option<String>> = vec![None; PAIRS.len()];
    let mut per_layer = String::new();
    let mut geometry = None;
    for &index in &chosen {
        let layer = load_layer(&st, index, args.pair_heads)?;
        geometry.get_or_insert((layer.tokens, layer.q_heads, layer.kv_heads, layer.head_dim));
        let reference = layer.reference()?;
        for (i, pair) in PAIRS.iter().enumerate() {
            bar.inc(1);
            if let Some(why) = unsupported(pair, layer.head_dim) {
                pooled[i] = None;
                skipped[i] = Some(why);
                continue;
            }
            let e = layer
                .measure(pair, &reference, args.block_size)
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
            }
        }
    }
    bar.finish_and_clear();

    let (tokens, q_heads, kv_heads, head_dim) = geometry.expect("at least one layer");
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{}: layers {chosen:?}, {tokens} tokens, {q_heads} query / {kv_heads} kv heads of \
         head_dim {head_dim}{}, block size {}",
        args.input.display(),
        if args.pair_heads > 1 {
            format!(" ({} heads joined)", args.pair_heads)
        } else {
            String::new()
        },
        args.block_size
    );
    let _ = writeln!(
        text,
        "decode of the last token's query over all tokens, f64 accumulation; errors vs \
         unquantized f32, pooled over layers (rel L2 = sqrt(sum err^2 / sum ref^2))\n"
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
