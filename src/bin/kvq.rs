//! The `kvq` command-line tool (feature `cli`).
//!
//! - `kvq quantize --format F [--scale S | --per-head | --scales FILE] [--pair-heads N] IN OUT`:
//!   every tensor of a safetensors file to `NAME.codes` / `NAME.scales` / `NAME.zeros` (layout
//!   in `kvq::dense`), each N adjacent heads joined into one first if asked; `--scales` takes
//!   FP8 per-head scales from `kvq calibrate` for the keys and values it names.
//! - `kvq dequantize IN OUT`: back to F32 `NAME`.
//! - `kvq eval [IN] [--calibrate-on first-half|all] [--positions last|all] [--json]`:
//!   reconstruction and attention error of each K/V format pair on `q.L`, `k.L`, `v.L` tensors
//!   (synthetic ones without `IN`), scales calibrated on held-out tokens by default;
//!   `--scales FILE` takes the FP8 per-head scales from `kvq calibrate`; `--budget E` picks per
//!   layer the cheapest K/V pair whose attention error stays within `E` (`--plan-out FILE`
//!   writes the plan as JSON, `--plan FILE` scores one again); `--hadamard` adds a row of INT4
//!   keys rotated by a Walsh–Hadamard transform; `int4-kc` rows score per-channel INT4 keys
//!   (`--kc-group G`), `int3` / `int2 + topK f16` rows score per-token INT3 / INT2 keys with
//!   each head's K largest channels in f16 (`--keep-channels K`), `--outliers N:SCALE[:OFFSET]`
//!   sets the synthetic keys' outlier channels; the `(e4m3 MMAs)` rows price FP8 tensor-core
//!   operands (the query and the probabilities rounded to E4M3) on an E4M3 and an FP4 cache;
//!   `--only TEXT[,TEXT]` scores only the rows whose label contains one of them.
//! - `kvq calibrate [--format e4m3|e5m2] [--method amax|percentile] [--percentile P] IN OUT`:
//!   per-layer, per-KV-head FP8 scales of the keys and values `k.L`, `v.L` of `IN` (`--tokens
//!   A..B`: of those tokens only; `--per-tensor`: one per layer in every head's place)
//!   (`--key-pattern` / `--value-pattern` map other names): `OUT` holds `k_scale.L` and
//!   `v_scale.L`, F32 `[kv_heads]`, with `kvq.format` and `kvq.method` in its metadata.
//! - `kvq info`: version and what this build can run on.
//! - `kvq bench`: decode bandwidth per cache format against the measured read ceiling (CUDA).
//!
//! Bad input is one `kvq: error: ...` line on stderr and exit code 1 (usage errors: clap's 2);
//! outputs are written to `OUT.tmp` and renamed, so a failed run leaves no partial file.

// The binary's root is src/bin/kvq.rs (Cargo.toml), so its modules are named by path.
#[path = "kvq/bench.rs"]
mod bench;
#[path = "kvq/calibrate.rs"]
mod calibrate;
#[path = "kvq/eval.rs"]
mod eval;
#[path = "kvq/files.rs"]
mod files;
#[path = "kvq/plan.rs"]
mod plan;
#[path = "kvq/rotate.rs"]
mod rotate;

use std::collections::HashMap;
use std::fmt;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvq::dense::{self, DenseFormat, Fp8ScaleChoice, QuantizedChannels, QuantizedTensor};
use kvq::format::int4_kc;

use files::{InputFile, OutTensor};

/// Metadata key naming the format of a quantized file.
const META_FORMAT: &str = "kvq.format";
/// Metadata key with the kvq version that wrote a file.
const META_VERSION: &str = "kvq.version";
/// Metadata key saying how FP8 scales were chosen (informational).
const META_SCALE: &str = "kvq.scale";
/// Metadata key: the adjacent heads joined into one (`--pair-heads`).
const META_PAIR_HEADS: &str = "kvq.pair_heads";

#[derive(Parser)]
#[command(
    name = "kvq",
    version,
    about = "Quantized KV-cache formats: convert tensors, measure errors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Quantize every tensor ([..., heads, head_dim], F16/BF16/F32) of a safetensors file.
    Quantize(QuantizeArgs),
    /// Turn a file written by `kvq quantize` back into F32 tensors.
    Dequantize {
        /// Input file written by `kvq quantize`.
        input: PathBuf,
        /// Output safetensors file (F32 NAME).
        output: PathBuf,
    },
    /// Compare K/V format pairs on q.L, k.L, v.L tensors ([tokens, heads, head_dim]), or on
    /// synthetic ones: every pair of docs/ACCURACY.md's tables (f16 down to int4-uniform: the
    /// cache formats, mixed K / V pairs, FP8 per tensor and per head, and the CPU-only
    /// references), one row each.
    Eval(eval::EvalArgs),
    /// Per-layer, per-KV-head FP8 scales from a K/V dump (k.L, v.L: [tokens, kv_heads,
    /// head_dim]), by amax or a percentile of |x|: k_scale.L and v_scale.L, F32 [kv_heads].
    Calibrate(calibrate::CalibrateArgs),
    /// Version, CUDA support compiled in, GPU architectures built, visible GPUs.
    Info,
    /// Decode bandwidth of every cache format over the standard shapes (needs CUDA and a GPU).
    Bench(bench::BenchArgs),
}

/// `kvq quantize`'s arguments.
#[derive(clap::Args)]
struct QuantizeArgs {
    /// The format (int4-kc: per-channel INT4 keys, groups of 32 tokens). head_dim, the last
    /// axis, must be one a cache of the format takes: a multiple of 16 for 8-bit codes, 32 for
    /// 4-bit ones, 64 for int4-v64 (int4-uniform: even).
    #[arg(long, ignore_case = true, value_parser = file_format_names())]
    format: String,
    /// FP8 only: use this scale for every tensor instead of amax / max_finite.
    #[arg(long, conflicts_with_all = ["per_head", "scales"], allow_negative_numbers = true)]
    scale: Option<f32>,
    /// FP8 only: one amax scale per head (second-to-last axis) instead of per tensor.
    #[arg(long, conflicts_with = "scales")]
    per_head: bool,
    /// FP8 only: the per-head scales of a `kvq calibrate` file (k_scale.L, v_scale.L, of the
    /// same FP8 format and --pair-heads) for the keys and values it names (--key-pattern,
    /// --value-pattern); the input's other tensors are an error. Values past a head's scale
    /// times the largest code saturate (counted in a note).
    #[arg(long)]
    scales: Option<PathBuf>,
    /// With --scales: the name of layer L's keys, {L} standing for the layer index.
    #[arg(long, default_value = "k.{L}")]
    key_pattern: files::LayerPattern,
    /// With --scales: the name of layer L's values, {L} standing for the layer index.
    #[arg(long, default_value = "v.{L}")]
    value_pattern: files::LayerPattern,
    /// Join N adjacent heads into one before quantizing (e.g. 2: [512, 12, 32] -> [512, 6,
    /// 64], so that int4-v64's groups fit heads of 32). Recorded in the file's metadata;
    /// `kvq dequantize` gives back the original shape.
    #[arg(long, default_value_t = 1)]
    pair_heads: usize,
    /// Input safetensors file.
    input: PathBuf,
    /// Output safetensors file: NAME.codes and the format's NAME.scales, NAME.zeros,
    /// NAME.global_scales (layout in kvq::dense, docs/FORMATS.md).
    output: PathBuf,
}

/// A failure to report: one line, exit code 1.
#[derive(Debug)]
pub struct CliError(String);

impl CliError {
    /// An error with this message (newlines are folded so it stays one line).
    pub fn new(msg: impl Into<String>) -> Self {
        CliError(msg.into().replace('\n', " "))
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<kvq::Error> for CliError {
    fn from(e: kvq::Error) -> Self {
        CliError::new(e.to_string())
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress(len: usize, what: &'static str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what);
    bar
}

/// Print to stdout; a closed pipe (`kvq eval | head`) is not an error.
pub fn print_out(text: &str) -> Result<(), CliError> {
    match std::io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::new(format!("cannot write to stdout: {e}")))
        }
        _ => Ok(()),
    }
}

/// The names `kvq quantize --format` takes: clap lists them in `--help` and suggests the
/// nearest for a misspelt one.
fn file_format_names() -> clap::builder::PossibleValuesParser {
    let names = DenseFormat::ALL
        .iter()
        .map(|f| f.name())
        .chain([int4_kc::NAME]);
    clap::builder::PossibleValuesParser::new(names)
}

/// A dense file's format: one of the row formats of [`DenseFormat`], or per-channel INT4 keys
/// (`int4-kc`), whose groups run across rows ([`dense::quantize_int4_kc`]).
#[derive(Clone, Copy)]
enum FileFormat {
    Rows(DenseFormat),
    Int4Kc,
}

impl FileFormat {
    /// A [`DenseFormat`] name or `int4-kc`.
    fn from_name(name: &str) -> Result<Self, CliError> {
        if name.eq_ignore_ascii_case(int4_kc::NAME) {
            return Ok(FileFormat::Int4Kc);
        }
        DenseFormat::from_name(name)
            .map(FileFormat::Rows)
            .map_err(|_| {
                let known: Vec<_> = DenseFormat::ALL.iter().map(|f| f.name()).collect();
                CliError::new(format!(
                    "unknown format '{name}' (known: {}, {})",
                    known.join(", "),
                    int4_kc::NAME
                ))
            })
    }

    fn fp8_kind(self) -> Option<kvq::format::Fp8Kind> {
        match self {
            FileFormat::Rows(f) => f.fp8_kind(),
            FileFormat::Int4Kc => None,
        }
    }
}

impl fmt::Display for FileFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileFormat::Rows(d) => d.fmt(f),
            FileFormat::Int4Kc => f.write_str(int4_kc::NAME),
        }
    }
}

/// The scales of `file` for tensor `name` of `shape` (heads joined already): its layer's key or
/// value scales by `args`' patterns, one per head.
fn file_scales<'a>(
    file: &'a calibrate::ScalesFile,
    args: &QuantizeArgs,
    name: &str,
    shape: &[usize],
) -> Result<&'a [f32], CliError> {
    let heads = shape.iter().rev().nth(1).copied().unwrap_or(1);
    let (layer, keys) = match (
        args.key_pattern.layer_of(name),
        args.value_pattern.layer_of(name),
    ) {
        (Some(l), _) => (l, true),
        (None, Some(l)) => (l, false),
        (None, None) => {
            return Err(CliError::new(format!(
                "tensor '{name}' is neither keys nor values by --key-pattern / \
                 --value-pattern, so --scales has no scales for it (quantize it without \
                 --scales, from a file of its own)"
            )));
        }
    };
    let s = file.layer(layer, heads)?;
    Ok(if keys { &s.k } else { &s.v })
}

/// `shape` ([..., heads, head_dim]) with each `n` adjacent heads joined into one: [..., heads /
/// n, head_dim * n], the same elements in the same order (any shape as it is for `n = 1`).
fn pair_heads(name: &str, shape: &[usize], n: usize) -> Result<Vec<usize>, CliError> {
    let mut paired = shape.to_vec();
    match paired.as_mut_slice() {
        _ if n == 1 => Ok(paired),
        [.., h, d] if *h % n == 0 => {
            (*h, *d) = (*h / n, *d * n);
            Ok(paired)
        }
        _ => Err(CliError::new(format!(
            "tensor '{name}' has shape {shape:?}: --pair-heads {n} needs [..., heads, head_dim] \
             with heads a multiple of {n}"
        ))),
    }
}

fn quantize_file(args: &QuantizeArgs) -> Result<(), CliError> {
    let (input, output) = (args.input.as_path(), args.output.as_path());
    let (scale, pair) = (args.scale, args.pair_heads);
    let format = FileFormat::from_name(&args.format)?;
    if pair == 0 {
        return Err(CliError::new("--pair-heads must be at least 1"));
    }
    let (choice, mut scale_note) = match (scale, args.per_head) {
        (Some(s), _) => (Fp8ScaleChoice::Fixed(s), format!("fixed {s}")),
        (None, true) => (Fp8ScaleChoice::PerHeadAmax, "per-head amax".into()),
        (None, false) => (Fp8ScaleChoice::PerTensorAmax, "per-tensor amax".into()),
    };
    if format.fp8_kind().is_none()
        && (choice != Fp8ScaleChoice::PerTensorAmax || args.scales.is_some())
    {
        return Err(CliError::new(format!(
            "--scale, --per-head and --scales apply only to FP8 formats, not {format}"
        )));
    }
    // Scales calibrated elsewhere (`kvq calibrate`), per layer and head.
    let given = match (&args.scales, format.fp8_kind()) {
        (Some(path), Some(kind)) => {
            let file = calibrate::ScalesFile::read(path)?;
            if file.kind() != kind {
                let name = |k| match k {
                    kvq::format::Fp8Kind::E4M3 => "e4m3",
                    kvq::format::Fp8Kind::E5M2 => "e5m2",
                };
                return Err(CliError::new(format!(
                    "'{}' holds {} scales; --format {format} takes {} ones (`kvq calibrate \
                     --format {}`)",
                    path.display(),
                    name(file.kind()),
                    name(kind),
                    name(kind)
                )));
            }
            scale_note = format!("per-head scales of {}", path.display());
            Some(file)
        }
        _ => None,
    };
    let file = InputFile::read(input)?;
    let st = file.parse()?;
    let mut names = st.names();
    names.sort();
    if names.is_empty() {
        return Err(CliError::new(format!(
            "'{}' holds no tensors",
            input.display()
        )));
    }
    let bar = progress(names.len(), "quantize");
    let (mut out, mut non_finite, mut bytes_in, mut bytes_out) = (Vec::new(), 0u64, 0, 0);
    // A fixed or given FP8 scale: the values it cannot represent, beyond max_finite * s
    // (saturated) or nonzero below the smallest subnormal's half (flushed to 0).
    let (mut saturated, mut flushed) = (0usize, 0usize);
    for name in names {
        let view = st
            .tensor(name)
            .map_err(|e| CliError::new(format!("tensor '{name}': {e}")))?;
        let x = files::to_f32(name, &view)?;
        let shape = pair_heads(name, view.shape(), pair)?;
        let head_scales: Option<&[f32]> = match &given {
            Some(file) => Some(file_scales(file, args, name, &shape)?),
            None => scale.as_ref().map(std::slice::from_ref),
        };
        if let (Some(kind), Some(scales), Some(&d)) = (format.fp8_kind(), head_scales, shape.last())
        {
            // Row r of [..., heads, head_dim] is head r % heads (one scale: every head's).
            for (r, row) in x.chunks(d.max(1)).enumerate() {
                let s = scales[r % scales.len()];
                let (hi, lo) = (kind.max_finite() * s, kind.min_subnormal() * s / 2.0);
                saturated += row.iter().filter(|v| v.abs() > hi).count();
                flushed += row.iter().filter(|v| **v != 0.0 && v.abs() < lo).count();
            }
        }
        let in_tensor = |e: kvq::Error| {
            // Heads too narrow for the format's groups: joining adjacent ones may fit them.
            let heads = shape.iter().rev().nth(1).copied();
            let hint = match e {
                kvq::Error::HeadDim {
                    head_dim, multiple, ..
                } if pair == 1
                    && head_dim > 0
                    && multiple % head_dim == 0
                    && heads.is_some_and(|h| h % (multiple / head_dim) == 0) =>
                {
                    let n = multiple / head_dim;
                    format!(" (--pair-heads {n} joins adjacent heads into heads of {multiple})")
                }
                _ => String::new(),
            };
            CliError::new(format!("tensor '{name}': {e}{hint}"))
        };
        let (codes, scales, zeros, global_scales) = match format {
            FileFormat::Rows(format) => {
                let q = match (&given, head_scales) {
                    (Some(_), Some(scales)) => {
                        dense::quantize_fp8_with_scales(format, &x, &shape, scales)
                    }
                    _ => dense::quantize(format, &x, &shape, choice),
                }
                .map_err(in_tensor)?;
                non_finite += q.non_finite();
                bytes_out += q.stored_bytes();
                q.into_parts()
            }
            FileFormat::Int4Kc => {
                let q = dense::quantize_int4_kc(&x, &shape).map_err(in_tensor)?;
                non_finite += q.non_finite();
                bytes_out += q.stored_bytes();
                let (codes, scales, zeros) = q.into_parts();
                (codes, scales, Some(zeros), None)
            }
        };
        bytes_in += view.data().len();
        out.push((format!("{name}.codes"), OutTensor::stored(codes)));
        out.push((format!("{name}.scales"), OutTensor::stored(scales)));
        if let Some(z) = zeros {
            out.push((format!("{name}.zeros"), OutTensor::stored(z)));
        }
        if let Some(g) = global_scales {
            out.push((format!("{name}.global_scales"), OutTensor::stored(g)));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut metadata = HashMap::from([
        (META_FORMAT.to_string(), format.to_string()),
        (
            META_VERSION.to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
    ]);
    if format.fp8_kind().is_some() {
        // The other formats keep their scales per row or group, in the file's tensors.
        metadata.insert(META_SCALE.to_string(), scale_note.clone());
    }
    if pair > 1 {
        metadata.insert(META_PAIR_HEADS.to_string(), pair.to_string());
    }
    files::write_atomic(output, out, metadata)?;
    if saturated + flushed > 0 {
        eprintln!(
            "kvq: note: {scale_note}: {saturated} value(s) saturated at ±{} x their scale and \
             {flushed} nonzero value(s) flushed to 0 (amax scales, without --scale or --scales, \
             fit the data)",
            format.fp8_kind().map_or(0.0, |k| k.max_finite())
        );
    }
    if non_finite > 0 {
        eprintln!(
            "kvq: note: {non_finite} non-finite input value(s) were sanitized (NaN -> 0, ±Inf -> ±65504)"
        );
    }
    print_out(&format!(
        "{} -> {} ({format}): {bytes_in} -> {bytes_out} bytes\n",
        input.display(),
        output.display()
    ))
}

fn dequantize_file(input: &std::path::Path, output: &std::path::Path) -> Result<(), CliError> {
    let file = InputFile::read(input)?;
    let st = file.parse()?;
    let meta = file.metadata()?;
    let format_name = meta.get(META_FORMAT).ok_or_else(|| {
        CliError::new(format!(
            "'{}' was not written by `kvq quantize` (no {META_FORMAT} in its metadata)",
            file.path().display()
        ))
    })?;
    if meta.contains_key(calibrate::META_METHOD) {
        return Err(CliError::new(format!(
            "'{}' holds scales written by `kvq calibrate` ({} in its metadata), not the codes \
             of `kvq quantize`",
            file.path().display(),
            calibrate::META_METHOD
        )));
    }
    let format = FileFormat::from_name(format_name)?;
    // Heads joined by `--pair-heads` are split again: [..., h, d] -> [..., h * n, d / n].
    let pair = match meta.get(META_PAIR_HEADS) {
        None => 1,
        Some(n) => n.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| {
            CliError::new(format!(
                "'{}': {META_PAIR_HEADS} '{n}' is not a positive integer",
                file.path().display()
            ))
        })?,
    };
    let mut names = st.names();
    names.sort();
    // Every tensor must belong to exactly one NAME: its codes, scales, zeros or global scales.
    let bases: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_suffix(".codes"))
        .collect();
    if let Some(stray) = names.iter().find(|n| {
        !["codes", "scales", "zeros", "global_scales"]
            .iter()
            .any(|part| {
                n.strip_suffix(part)
                    .and_then(|b| b.strip_suffix('.'))
                    .is_some_and(|b| bases.contains(&b))
            })
    }) {
        let part_of = ["scales", "zeros", "global_scales"]
            .iter()
            .find_map(|part| stray.strip_suffix(part).and_then(|b| b.strip_suffix('.')));
        return Err(CliError::new(match part_of {
            Some(base) => format!("tensor '{stray}' has no '{base}.codes' beside it"),
            None => format!(
                "tensor '{stray}' is not the codes, scales, zeros or global_scales of any \
                 NAME.codes"
            ),
        }));
    }
    let bar = progress(bases.len(), "dequantize");
    let mut out = Vec::new();
    for base in bases {
        let part = |suffix: &str| -> Result<Option<dense::StoredTensor>, CliError> {
            let name = format!("{base}.{suffix}");
            match st.tensor(&name) {
                Ok(view) => files::to_stored(&name, &view).map(Some),
                Err(_) => Ok(None),
            }
        };
        let codes = part("codes")?.expect("listed above");
        let scales = part("scales")?
            .ok_or_else(|| CliError::new(format!("tensor '{base}.scales' is missing")))?;
        let in_tensor = |e: kvq::Error| CliError::new(format!("tensor '{base}': {e}"));
        let (shape, values) = match format {
            FileFormat::Rows(format) => {
                let q = QuantizedTensor::from_parts(
                    format,
                    codes,
                    scales,
                    part("zeros")?,
                    part("global_scales")?,
                )
                .map_err(in_tensor)?;
                (q.shape().to_vec(), dense::dequantize(&q))
            }
            FileFormat::Int4Kc => {
                if part("global_scales")?.is_some() {
                    return Err(CliError::new(format!(
                        "tensor '{base}': has global scales, which only FP4 uses"
                    )));
                }
                let zeros = part("zeros")?
                    .ok_or_else(|| CliError::new(format!("tensor '{base}.zeros' is missing")))?;
                let q = QuantizedChannels::from_parts(codes, scales, zeros).map_err(in_tensor)?;
                (q.shape().to_vec(), q.dequantize().map_err(in_tensor)?)
            }
        };
        let shape = match shape.as_slice() {
            _ if pair == 1 => shape,
            [.., h, d] if *d % pair == 0 => {
                let mut s = shape.clone();
                let r = s.len();
                (s[r - 2], s[r - 1]) = (*h * pair, *d / pair);
                s
            }
            _ => {
                return Err(CliError::new(format!(
                    "tensor '{base}' has shape {shape:?}, which {META_PAIR_HEADS} {pair} \
                     cannot split"
                )));
            }
        };
        out.push((base.to_string(), OutTensor::f32(shape, &values)));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let n = out.len();
    files::write_atomic(output, out, HashMap::new())?;
    print_out(&format!(
        "{} -> {} ({format}): {n} tensor(s) as F32\n",
        input.display(),
        output.display()
    ))
}

/// Visible GPUs, as the CUDA layer describes them: its lines (build targets, then one per device
/// or why there is none), each on its own indented line.
#[cfg(feature = "cuda")]
fn visible_gpus() -> String {
    kvq::cuda::device_summary()
        .iter()
        .map(|line| format!("\n  {line}"))
        .collect()
}

/// Visible GPUs: none can be used without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn visible_gpus() -> String {
    "n/a (built without feature `cuda`)".into()
}

fn info() -> Result<(), CliError> {
    let cuda = if cfg!(feature = "cuda") {
        "yes"
    } else {
        "no (rebuild with --features cuda)"
    };
    let archs = option_env!("KVQ_CUDA_ARCHS_BUILT").unwrap_or("none");
    print_out(&format!(
        "kvq {}\ncuda support: {cuda}\ngpu archs built: {archs}\nvisible gpus: {}\n",
        env!("CARGO_PKG_VERSION"),
        visible_gpus()
    ))
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Quantize(args) => quantize_file(&args),
        Command::Dequantize { input, output } => dequantize_file(&input, &output),
        Command::Eval(args) => eval::run(&args),
        Command::Calibrate(args) => calibrate::run(&args),
        Command::Info => info(),
        Command::Bench(args) => bench::run(&args),
    }
}

fn main() -> ExitCode {
    // Usage errors exit with clap's code 2; --help and --version with 0.
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvq: error: {e}");
            ExitCode::from(1)
        }
    }
}
