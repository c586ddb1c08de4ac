//! `kvq calibrate`: per-layer, per-KV-head FP8 scales from a K/V dump, as a server fixes them
//! offline before it serves (the math is [`kvq::calibrate`]).
//!
//! The input holds each layer's keys and values, `[tokens, kv_heads, head_dim]` in F16, BF16 or
//! F32, named `k.L` and `v.L` as `kvq eval` reads them, or as `--key-pattern` /
//! `--value-pattern` say (`model.layers.{L}.k`). The output is a safetensors file with, per
//! layer `L`, `k_scale.L` and `v_scale.L`: F32 `[kv_heads]`, the scale of each KV head (of the
//! joined heads with `--pair-heads`), for `HostCache::set_scales` / `DeviceCache::set_scales`.
//! Its metadata says what they are: `kvq.format` (`fp8-e4m3` or `fp8-e5m2`), `kvq.method`
//! (`amax` or `percentile`), `kvq.percentile` (with `percentile`), `kvq.pair_heads` and
//! `kvq.version`. `kvq eval --scales FILE` reads it back ([`ScalesFile`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use kvq::KvFormat;
use kvq::calibrate::{self, ClipMethod, LayerScales};
use kvq::format::Fp8Kind;
use safetensors::tensor::Dtype;

use crate::files::{self, InputFile, LayerPattern, OutTensor};
use crate::{CliError, META_FORMAT, META_PAIR_HEADS, META_VERSION, print_out, progress};

/// Metadata key: how the clipping value was chosen (`amax` or `percentile`).
pub const META_METHOD: &str = "kvq.method";
/// Metadata key: the percentile, with `kvq.method` `percentile`.
const META_PERCENTILE: &str = "kvq.percentile";
/// Metadata key: the tokens calibrated on, `A..B` (absent: every token).
const META_TOKENS: &str = "kvq.tokens";
/// Metadata key: `head` (a scale per KV head) or `tensor` (one per layer, repeated per head).
const META_GRANULARITY: &str = "kvq.granularity";
/// The percentile of `--method percentile` without `--percentile`.
const DEFAULT_PERCENTILE: f64 = 99.9;

/// Arguments of `kvq calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Safetensors file with each layer's keys and values, [tokens, kv_heads, head_dim].
    input: PathBuf,
    /// Output safetensors file: k_scale.L and v_scale.L, F32 [kv_heads], for every layer L.
    output: PathBuf,
    /// The FP8 encoding the scales are for.
    #[arg(long, value_enum, default_value_t = Fp8Format::E4m3)]
    format: Fp8Format,
    /// amax: the largest |x| of each head maps to the format's largest value (nothing in the
    /// sample saturates); percentile: the --percentile of |x| does (larger values saturate).
    #[arg(long, value_enum, default_value_t = Method::Amax)]
    method: Method,
    /// With --method percentile: the nearest-rank percentile of each head's |x|, in (0, 100]
    /// [default: 99.9].
    #[arg(long, allow_negative_numbers = true)]
    percentile: Option<f64>,
    /// Layers to calibrate, comma separated (default: every layer with keys and values).
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
    /// Join N adjacent heads into one (as `kvq eval --pair-heads`): one scale per joined head.
    #[arg(long, default_value_t = 1)]
    pair_heads: usize,
    /// Calibrate on tokens A..B of each layer only (default: every token). `--tokens 0..256`
    /// on a 512-token dump leaves `kvq eval --scales`' held-out half unseen, as its own
    /// calibration does.
    #[arg(long, value_name = "A..B")]
    tokens: Option<TokenRange>,
    /// One scale per layer and side, from all its heads' values, written once per KV head (a
    /// cache takes a scale per head; equal ones are eval's `(tensor)` rows).
    #[arg(long)]
    per_tensor: bool,
    /// Name of layer L's keys, {L} standing for the layer index.
    #[arg(long, default_value = "k.{L}")]
    key_pattern: LayerPattern,
    /// Name of layer L's values, {L} standing for the layer index.
    #[arg(long, default_value = "v.{L}")]
    value_pattern: LayerPattern,
}

/// A range of token positions, `A..B` with `A < B` (`--tokens`, `kvq.tokens`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRange(pub Range<usize>);

impl std::str::FromStr for TokenRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once("..").ok_or(format!("'{s}' is not A..B"))?;
        match (a.parse::<usize>(), b.parse::<usize>()) {
            (Ok(a), Ok(b)) if a < b => Ok(TokenRange(a..b)),
            _ => Err(format!(
                "'{s}' is not A..B with token positions A < B (B excluded)"
            )),
        }
    }
}

impl std::fmt::Display for TokenRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.0.start, self.0.end)
    }
}

/// `--format`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Fp8Format {
    /// FP8 E4M3 (max 448).
    #[value(alias = "fp8-e4m3")]
    E4m3,
    /// FP8 E5M2 (max 57344).
    #[value(alias = "fp8-e5m2")]
    E5m2,
}

impl Fp8Format {
    fn format_and_kind(self) -> (KvFormat, Fp8Kind) {
        match self {
            Fp8Format::E4m3 => (KvFormat::Fp8E4m3, Fp8Kind::E4M3),
            Fp8Format::E5m2 => (KvFormat::Fp8E5m2, Fp8Kind::E5M2),
        }
    }
}

/// `--method`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Method {
    /// Largest |x| per head.
    Amax,
    /// A percentile of |x| per head (--percentile).
    Percentile,
}

/// Run `kvq calibrate`.
pub fn run(args: &CalibrateArgs) -> Result<(), CliError> {
    if args.pair_heads == 0 {
        return Err(CliError::new("--pair-heads must be at least 1"));
    }
    let method = match (args.method, args.percentile) {
        (Method::Amax, Some(_)) => {
            return Err(CliError::new(
                "--percentile applies only with --method percentile",
            ));
        }
        (Method::Amax, None) => ClipMethod::Amax,
        (Method::Percentile, p) => {
            ClipMethod::Percentile(p.unwrap_or(DEFAULT_PERCENTILE)).check()?
        }
    };
    let (format, kind) = args.format.format_and_kind();
    let file = InputFile::read(&args.input)?;
    let st = file.parse()?;
    let (kp, vp) = (&args.key_pattern, &args.value_pattern);
    let source = args.input.display().to_string();
    let available = files::layers_with(&st, &[kp, vp]);
    if available.is_empty() {
        return Err(files::no_layers_error(
            &file,
            &st,
            &[(kp, "--key-pattern"), (vp, "--value-pattern")],
        ));
    }
    let chosen = files::choose_layers(&args.layers, &available, &source)?;

    let bar = progress(chosen.len(), "calibrate");
    let (mut out, mut report, mut kv_heads) = (Vec::new(), String::new(), 0);
    for &layer in &chosen {
        let (k, ks) = files::load3(&st, &kp.name(layer))?;
        let (v, vs) = files::load3(&st, &vp.name(layer))?;
        let heads = ks[1];
        if ks[1..] != vs[1..] {
            return Err(CliError::new(format!(
                "layer {layer}: keys {ks:?} and values {vs:?} need the same heads and head_dim"
            )));
        }
        if heads % args.pair_heads != 0 {
            return Err(CliError::new(format!(
                "layer {layer}: --pair-heads {} does not divide its {heads} heads",
                args.pair_heads
            )));
        }
        if ks[0] == 0 || vs[0] == 0 {
            return Err(CliError::new(format!(
                "layer {layer}: no tokens to calibrate on (keys {ks:?}, values {vs:?})"
            )));
        }
        // Rows of whole tokens: [tokens, heads, head_dim].
        let row = heads * ks[2];
        let (k, v) = match &args.tokens {
            Some(TokenRange(r)) if r.end > ks[0].min(vs[0]) => {
                return Err(CliError::new(format!(
                    "layer {layer}: --tokens {}..{} reaches past its {} tokens",
                    r.start,
                    r.end,
                    ks[0].min(vs[0])
                )));
            }
            Some(TokenRange(r)) => (
                &k[r.start * row..r.end * row],
                &v[r.start * row..r.end * row],
            ),
            None => (&k[..], &v[..]),
        };
        // Adjacent heads are adjacent in memory: joining them only changes the shape.
        let (h, d) = (heads / args.pair_heads, ks[2] * args.pair_heads);
        let scales = |x: &[f32]| {
            // Per tensor: the whole token row is one "head", its scale repeated.
            let (groups, width) = if args.per_tensor { (1, h * d) } else { (h, d) };
            calibrate::fp8_head_scales(x, groups, width, kind, method)
                .map(|s| if args.per_tensor { vec![s[0]; h] } else { s })
                .map_err(|e| CliError::new(format!("layer {layer}: {e}")))
        };
        let s = LayerScales {
            k: scales(k)?,
            v: scales(v)?,
        };
        let _ = writeln!(
            report,
            "| {layer} | {h} | {} | {} |",
            range(&s.k),
            range(&s.v)
        );
        out.push((format!("k_scale.{layer}"), OutTensor::f32(vec![h], &s.k)));
        out.push((format!("v_scale.{layer}"), OutTensor::f32(vec![h], &s.v)));
        kv_heads = h;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let (method_name, percentile) = match method {
        ClipMethod::Amax => ("amax", None),
        ClipMethod::Percentile(p) => ("percentile", Some(p)),
    };
    let mut metadata = HashMap::from([
        (META_FORMAT.to_string(), format.name().to_string()),
        (META_METHOD.to_string(), method_name.to_string()),
        (META_PAIR_HEADS.to_string(), args.pair_heads.to_string()),
        (
            META_GRANULARITY.to_string(),
            if args.per_tensor { "tensor" } else { "head" }.to_string(),
        ),
        (
            META_VERSION.to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
    ]);
    if let Some(p) = percentile {
        metadata.insert(META_PERCENTILE.to_string(), p.to_string());
    }
    if let Some(t) = &args.tokens {
        metadata.insert(META_TOKENS.to_string(), t.to_string());
    }
    files::write_atomic(&args.output, out, metadata)?;
    let how = percentile.map_or("amax".to_string(), |p| format!("percentile {p} of |x|"));
    print_out(&format!(
        "{source} -> {} ({format} scales, {how}, {} layer(s) of {kv_heads} kv heads)\n\n\
         | layer | kv heads | K scales (min .. max) | V scales (min .. max) |\n\
         |---:|---:|---|---|\n{report}",
        args.output.display(),
        chosen.len(),
    ))
}

/// `min .. max` of a layer's scales.
fn range(s: &[f32]) -> String {
    let min = s.iter().copied().fold(f32::INFINITY, f32::min);
    let max = s.iter().copied().fold(0.0, f32::max);
    format!("{min:.3e} .. {max:.3e}")
}

/// A file written by `kvq calibrate`, read back: its FP8 kind and each layer's scales.
pub struct ScalesFile {
    path: PathBuf,
    kind: Fp8Kind,
    /// The tokens calibrated on (`None`: every token).
    tokens: Option<TokenRange>,
    layers: BTreeMap<usize, LayerScales>,
}

impl ScalesFile {
    /// Read and check `path`: an FP8 `kvq.format`, and F32 `[kv_heads]` `k_scale.L` and
    /// `v_scale.L` of equal length for every layer it names.
    pub fn read(path: &Path) -> Result<Self, CliError> {
        let file = InputFile::read(path)?;
        let st = file.parse()?;
        let meta = file.metadata()?;
        let shown = path.display();
        if !meta.contains_key(META_METHOD) {
            return Err(CliError::new(format!(
                "'{shown}' was not written by `kvq calibrate` (no {META_METHOD} in its metadata; \
                 a `kvq quantize` output holds codes, not scales)"
            )));
        }
        let kind = meta
            .get(META_FORMAT)
            .and_then(|f| KvFormat::from_name(f).ok()?.fp8_kind())
            .ok_or_else(|| {
                CliError::new(format!(
                    "'{shown}' was not written by `kvq calibrate` (its {META_FORMAT} is not an \
                     FP8 format)"
                ))
            })?;
        let tokens = match meta.get(META_TOKENS) {
            None => None,
            Some(t) => Some(
                t.parse::<TokenRange>()
                    .map_err(|e| CliError::new(format!("'{shown}': {META_TOKENS} {e}")))?,
            ),
        };
        let k_pattern = LayerPattern::with_prefix("k_scale.");
        let v_pattern = LayerPattern::with_prefix("v_scale.");
        let vector = |name: &str| -> Result<Vec<f32>, CliError> {
            let view = st
                .tensor(name)
                .map_err(|_| CliError::new(format!("'{shown}' lacks tensor '{name}'")))?;
            if view.dtype() != Dtype::F32 || view.shape().len() != 1 {
                return Err(CliError::new(format!(
                    "'{shown}': tensor '{name}' is {:?} {:?}; expected F32 [kv_heads]",
                    view.dtype(),
                    view.shape()
                )));
            }
            files::to_f32(name, &view)
        };
        let mut layers = BTreeMap::new();
        for name in st.names() {
            let Some(layer) = k_pattern.layer_of(name) else {
                continue;
            };
            let s = LayerScales {
                k: vector(name)?,
                v: vector(&v_pattern.name(layer))?,
            };
            if s.k.len() != s.v.len() {
                return Err(CliError::new(format!(
                    "'{shown}': layer {layer} has {} key and {} value scales",
                    s.k.len(),
                    s.v.len()
                )));
            }
            layers.insert(layer, s);
        }
        Ok(ScalesFile {
            path: path.to_path_buf(),
            kind,
            tokens,
            layers,
        })
    }

    /// The FP8 encoding the scales are for.
    pub fn kind(&self) -> Fp8Kind {
        self.kind
    }

    /// The tokens the scales were calibrated on (`None`: every token).
    pub fn tokens(&self) -> Option<&Range<usize>> {
        self.tokens.as_ref().map(|t| &t.0)
    }

    /// Layer `layer`'s scales, which must be `kv_heads` per side.
    pub fn layer(&self, layer: usize, kv_heads: usize) -> Result<&LayerScales, CliError> {
        let shown = self.path.display();
        let s = self
            .layers
            .get(&layer)
            .ok_or_else(|| CliError::new(format!("'{shown}' has no scales of layer {layer}")))?;
        if s.k.len() != kv_heads {
            return Err(CliError::new(format!(
                "'{shown}' has {} scales for layer {layer}, which has {kv_heads} kv heads \
                 (calibrate with the same --pair-heads)",
                s.k.len()
            )));
        }
        Ok(s)
    }
}
