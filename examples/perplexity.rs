//! Perplexity of a Llama-shaped model with its KV cache in each kvq format, on the CPU: the
//! downstream figure a format choice is judged by, for anyone with the weights.
//!
//! ```sh
//! # A Hugging Face Llama-architecture checkpoint (config.json + *.safetensors: Llama, Mistral,
//! # TinyLlama...; no attention biases) and a text as token ids (whitespace-separated integers):
//! python3 -c "from transformers import AutoTokenizer as T; import sys; \
//!   print(*T.from_pretrained(sys.argv[1])(open(sys.argv[2]).read())['input_ids'])" \
//!   MODEL_DIR text.txt > tokens.txt
//! cargo run --release --features cli --example perplexity -- MODEL_DIR tokens.txt [--max-tokens N]
//! # A small random model (what the example's test runs):
//! cargo run --release --features cli --example perplexity -- --random
//! ```
//!
//! The model decodes the text one token at a time, as a server does: each token's keys and
//! values are appended to a paged cache of the pair's formats (FP8 and FP4 head scales
//! calibrated per KV head on the unquantized run's keys and values, in sample), and its query
//! attends over the cache with kvq's CPU reference (`cpu::decode_attention`, f64). The
//! reference run keeps K and V unquantized (`cpu::attention_dense`). Per pair: perplexity over
//! the text, its change against the reference, the mean KL divergence of the next-token
//! distributions from the reference's, and how often the most likely next token is the same.
//! Block size 32 (int4-kc's group). Matrix-vector products run on every core in f32.

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kvq::cache::{BlockAllocator, HostCache, SeqId};
use kvq::cpu::{Accum, AttentionOptions, DecodeShape, DenseKv, attention_dense, decode_attention};
use kvq::{CacheConfig, KvFormat, ScaleGranularity};
use safetensors::{Dtype, SafeTensors};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const BLOCK: usize = 32;

/// The shape of a Llama-architecture model (config.json's fields).
#[derive(Clone, Copy, Debug)]
struct Config {
    vocab: usize,
    hidden: usize,
    mlp: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    rope_theta: f32,
}

/// A `[rows, cols]` f32 matrix, row-major (a Linear's weight: `[out_features, in_features]`).
struct Matrix {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
}

impl Matrix {
    /// `W x`, the rows of a large matrix split over the machine's cores.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; self.rows];
        // Threads only pay for large matrices (a real model's, not the random one's).
        let threads = if self.w.len() < 1 << 20 {
            1
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        };
        let per = self.rows.div_ceil(threads).max(256);
        std::thread::scope(|s| {
            for (i, part) in y.chunks_mut(per).enumerate() {
                s.spawn(move || {
                    for (j, out) in part.iter_mut().enumerate() {
                        *out = dot(&self.w[(i * per + j) * self.cols..][..self.cols], x);
                    }
                });
            }
        });
        y
    }

    /// Row `r` (an embedding).
    fn row(&self, r: usize) -> &[f32] {
        &self.w[r * self.cols..][..self.cols]
    }
}

/// A dot product in eight lanes (it vectorizes; the order is fixed, so runs repeat exactly).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    mlp_norm: Vec<f32>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

struct Model {
    cfg: Config,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    head: Matrix,
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// Rotary positions in the Hugging Face Llama layout: element i pairs with i + head_dim / 2.
fn rope(x: &mut [f32], head_dim: usize, pos: usize, theta: f32) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let freq = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            let (a, b) = (head[i] as f64, head[i + half] as f64);
            head[i] = (a * cos - b * sin) as f32;
            head[i + half] = (b * cos + a * sin) as f32;
        }
    }
}

/// Where a run's attention reads its keys and values.
enum Kv {
    /// Unquantized, per layer `[tokens, kv_heads, head_dim]`: the reference.
    Dense(Vec<(Vec<f32>, Vec<f32>)>),
    /// One sequence in a paged cache per layer of one format pair.
    Cache {
        alloc: BlockAllocator,
        layers: Vec<HostCache>,
        seq: SeqId,
    },
}

impl Model {
    /// Log-probabilities of the token after each of `tokens`, the text decoded one token a step
    /// with attention over `kv`.
    fn run(&self, tokens: &[u32], kv: &mut Kv) -> Res<Vec<Vec<f32>>> {
        let c = self.cfg;
        let (shape, opts) = (
            DecodeShape::new(c.heads, 1),
            AttentionOptions::new(c.head_dim),
        );
        let mut out = Vec::with_capacity(tokens.len());
        for (pos, &t) in tokens.iter().enumerate() {
            let slots = match kv {
                Kv::Cache { alloc, seq, .. } => alloc.reserve(*seq, 1)?.slots,
                Kv::Dense(_) => Vec::new(),
            };
            let mut x = self.embed.row(t as usize).to_vec();
            for (l, layer) in self.layers.iter().enumerate() {
                let h = rms_norm(&x, &layer.attn_norm, c.eps);
                let (mut q, mut k, v) =
                    (layer.wq.apply(&h), layer.wk.apply(&h), layer.wv.apply(&h));
                rope(&mut q, c.head_dim, pos, c.rope_theta);
                rope(&mut k, c.head_dim, pos, c.rope_theta);
                let attn = match kv {
                    Kv::Dense(per_layer) => {
                        let (ks, vs) = &mut per_layer[l];
                        ks.extend_from_slice(&k);
                        vs.extend_from_slice(&v);
                        let kv = DenseKv {
                            k: ks,
                            v: vs,
                            num_kv_heads: c.kv_heads,
                            head_dim: c.head_dim,
                        };
                        attention_dense(&q, kv, &shape, &opts, Accum::F64)?.out
                    }
                    Kv::Cache { alloc, layers, seq } => {
                        layers[l].write(&slots, &k, &v)?;
                        let tables = alloc.block_tables(&[*seq])?;
                        decode_attention(&layers[l], &tables, &q, &shape, &opts, Accum::F64)?.out
                    }
                };
                add(&mut x, &layer.wo.apply(&attn));
                let h = rms_norm(&x, &layer.mlp_norm, c.eps);
                let (g, u) = (layer.gate.apply(&h), layer.up.apply(&h));
                let act: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                add(&mut x, &layer.down.apply(&act));
            }
            out.push(log_softmax(
                &self.head.apply(&rms_norm(&x, &self.norm, c.eps)),
            ));
        }
        Ok(out)
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    x.iter().map(|&v| (v as f64 - lse) as f32).collect()
}

/// A row of the table: a format pair (`None`: the unquantized reference) and its score.
type Row = (Option<(KvFormat, KvFormat)>, Score);

/// One row's figures.
struct Score {
    perplexity: f64,
    kl: f64,
    top1: f64,
}

/// Perplexity of `tokens` under `logp` (the prediction after token i scores token i + 1), and
/// against the reference's predictions the mean KL(ref ‖ logp) and the top-1 agreement.
fn score(tokens: &[u32], logp: &[Vec<f32>], reference: &[Vec<f32>]) -> Score {
    let n = tokens.len() - 1;
    let nll: f64 = (0..n)
        .map(|i| -logp[i][tokens[i + 1] as usize] as f64)
        .sum();
    let argmax = |p: &[f32]| (0..p.len()).fold(0, |b, i| if p[i] > p[b] { i } else { b });
    let (mut kl, mut same) = (0.0, 0usize);
    for (p, r) in logp.iter().zip(reference).take(n) {
        kl += r
            .iter()
            .zip(p)
            .map(|(&lr, &lp)| (lr as f64).exp() * (lr as f64 - lp as f64))
            .sum::<f64>();
        same += usize::from(argmax(p) == argmax(r));
    }
    Score {
        perplexity: (nll / n as f64).exp(),
        kl: kl / n as f64,
        top1: same as f64 / n as f64,
    }
}

/// The format pairs scored: those a server would pick between.
fn pairs() -> Vec<(KvFormat, KvFormat)> {
    use KvFormat::*;
    vec![
        (F16, F16),
        (Bf16, Bf16),
        (Fp8E4m3, Fp8E4m3),
        (Fp8E5m2, Fp8E5m2),
        (Int8Pth, Int8Pth),
        (Int4Sym32, Fp8E4m3),
        (Int4Kc, Fp8E4m3),
        (Int4Sym32, Int4Affine64),
        (Int4Kc, Int4Affine64),
        (Fp4E2m1, Fp4E2m1),
    ]
}

/// The reference run, then every pair: the table's rows, `(pair, score)`, the reference first
/// (`None`).
fn evaluate(model: &Model, tokens: &[u32]) -> Res<Vec<Row>> {
    let c = model.cfg;
    let mut dense = Kv::Dense(vec![(Vec::new(), Vec::new()); c.layers]);
    let reference = model.run(tokens, &mut dense)?;
    let Kv::Dense(samples) = dense else {
        unreachable!()
    };
    let mut rows = vec![(None, score(tokens, &reference, &reference))];
    for (k, v) in pairs() {
        if k.check_head_dim(c.head_dim).is_err() || v.check_head_dim(c.head_dim).is_err() {
            eprintln!("{k} / {v}: skipped at head_dim {}", c.head_dim);
            continue;
        }
        let config = CacheConfig::new(c.kv_heads, c.head_dim, BLOCK, k, v)?;
        let blocks = tokens.len().div_ceil(BLOCK) + 1;
        let mut layers = Vec::with_capacity(c.layers);
        for (ks, vs) in &samples {
            let mut cache = HostCache::new(config, blocks)?;
            cache.calibrate_fp8_scales(ks, vs, ScaleGranularity::PerHead)?;
            layers.push(cache);
        }
        let mut alloc = BlockAllocator::new(blocks, BLOCK)?;
        let seq = alloc.create_sequence();
        let logp = model.run(tokens, &mut Kv::Cache { alloc, layers, seq })?;
        rows.push((Some((k, v)), score(tokens, &logp, &reference)));
    }
    Ok(rows)
}

fn table(rows: &[Row], head_dim: usize) -> String {
    let base = rows[0].1.perplexity;
    let mut t = String::from(
        "| K / V cache | B/elem | perplexity | change | next-token KL | top-1 same |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for (pair, s) in rows {
        let (label, bytes) = match pair {
            None => ("unquantized (f32)".to_string(), 4.0),
            Some((k, v)) => {
                let per = |f: KvFormat| f.bytes_per_element_at(head_dim, BLOCK);
                (format!("{k} / {v}"), (per(*k) + per(*v)) / 2.0)
            }
        };
        t += &format!(
            "| {label} | {bytes:.4} | {:.4} | {:+.3}% | {:.2e} | {:.1}% |\n",
            s.perplexity,
            100.0 * (s.perplexity / base - 1.0),
            s.kl,
            100.0 * s.top1
        );
    }
    t
}

// ---- weights ---------------------------------------------------------------------------------

/// A random model of `cfg` (weights ~ N(0, 1 / fan_in), embeddings N(0, 1)), seeded.
fn random_model(cfg: Config, seed: u64) -> Model {
    let mut state = seed;
    let mut normal = move || {
        // splitmix64, then a sum of four uniforms: roughly normal.
        let mut u = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        ((u() + u() + u() + u() - 2.0) * 3f64.sqrt()) as f32
    };
    let mut matrix = |rows: usize, cols: usize, scale: f32| Matrix {
        rows,
        cols,
        w: (0..rows * cols).map(|_| normal() * scale).collect(),
    };
    let (h, q, kv) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let fan = |n: usize| 1.0 / (n as f32).sqrt();
    let embed = matrix(cfg.vocab, h, 1.0);
    let layers = (0..cfg.layers)
        .map(|_| Layer {
            attn_norm: vec![1.0; h],
            // Larger queries and keys than 1 / fan_in: attention with some peaks to move.
            wq: matrix(q, h, 2.0 * fan(h)),
            wk: matrix(kv, h, 2.0 * fan(h)),
            wv: matrix(kv, h, fan(h)),
            wo: matrix(h, q, fan(q)),
            mlp_norm: vec![1.0; h],
            gate: matrix(cfg.mlp, h, fan(h)),
            up: matrix(cfg.mlp, h, fan(h)),
            down: matrix(h, cfg.mlp, fan(cfg.mlp)),
        })
        .collect();
    let head = matrix(cfg.vocab, h, fan(h));
    Model {
        cfg,
        embed,
        layers,
        norm: vec![1.0; h],
        head,
    }
}

/// The tensors of every `*.safetensors` file in `dir`, read whole.
struct Checkpoint {
    files: Vec<Vec<u8>>,
}

impl Checkpoint {
    fn open(dir: &Path) -> Res<Self> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(format!("no .safetensors files in {}", dir.display()).into());
        }
        Ok(Checkpoint {
            files: paths
                .iter()
                .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Tensor `name` as f32 with its shape, from whichever file holds it.
    fn tensor(&self, name: &str) -> Res<(Vec<f32>, Vec<usize>)> {
        for bytes in &self.files {
            let st = SafeTensors::deserialize(bytes)?;
            let Ok(t) = st.tensor(name) else { continue };
            let data = t.data();
            let values = match t.dtype() {
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(format!("{name}: dtype {other:?} is not f32 / f16 / bf16").into());
                }
            };
            return Ok((values, t.shape().to_vec()));
        }
        Err(format!("no tensor {name} in the checkpoint").into())
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Res<Matrix> {
        let (w, shape) = self.tensor(name)?;
        if shape != [rows, cols] {
            return Err(format!("{name}: shape {shape:?}, expected [{rows}, {cols}]").into());
        }
        Ok(Matrix { rows, cols, w })
    }

    fn vector(&self, name: &str, n: usize) -> Res<Vec<f32>> {
        let (w, shape) = self.tensor(name)?;
        if shape != [n] {
            return Err(format!("{name}: shape {shape:?}, expected [{n}]").into());
        }
        Ok(w)
    }
}

/// A Hugging Face Llama-architecture checkpoint: `dir/config.json` and its safetensors.
fn load_model(dir: &Path) -> Res<Model> {
    let cfg_path = dir.join("config.json");
    let cfg_text =
        std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let j: serde_json::Value =
        serde_json::from_str(&cfg_text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let int = |k: &str| -> Res<usize> {
        j[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| format!("config.json has no integer {k}").into())
    };
    let (hidden, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    let cfg = Config {
        vocab: int("vocab_size")?,
        hidden,
        mlp: int("intermediate_size")?,
        layers: int("num_hidden_layers")?,
        heads,
        kv_heads: int("num_key_value_heads").unwrap_or(heads),
        head_dim: int("head_dim").unwrap_or(hidden / heads),
        eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        rope_theta: j["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
    };
    let ck = Checkpoint::open(dir)?;
    let (h, q, kv) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let embed = ck.matrix("model.embed_tokens.weight", cfg.vocab, h)?;
    let mut layers = Vec::with_capacity(cfg.layers);
    for l in 0..cfg.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        layers.push(Layer {
            attn_norm: ck.vector(&p("input_layernorm"), h)?,
            wq: ck.matrix(&p("self_attn.q_proj"), q, h)?,
            wk: ck.matrix(&p("self_attn.k_proj"), kv, h)?,
            wv: ck.matrix(&p("self_attn.v_proj"), kv, h)?,
            wo: ck.matrix(&p("self_attn.o_proj"), h, q)?,
            mlp_norm: ck.vector(&p("post_attention_layernorm"), h)?,
            gate: ck.matrix(&p("mlp.gate_proj"), cfg.mlp, h)?,
            up: ck.matrix(&p("mlp.up_proj"), cfg.mlp, h)?,
            down: ck.matrix(&p("mlp.down_proj"), h, cfg.mlp)?,
        });
        eprintln!("loaded layer {l}");
    }
    let head = match ck.matrix("lm_head.weight", cfg.vocab, h) {
        Ok(m) => m,
        // Tied embeddings.
        Err(_) => ck.matrix("model.embed_tokens.weight", cfg.vocab, h)?,
    };
    Ok(Model {
        cfg,
        embed,
        layers,
        norm: ck.vector("model.norm.weight", h)?,
        head,
    })
}

/// A small model the random run and the test use: two layers, GQA 2:1, head_dim 64.
const RANDOM: Config = Config {
    vocab: 96,
    hidden: 128,
    mlp: 256,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 64,
    eps: 1e-5,
    rope_theta: 10_000.0,
};

/// Tokens of the random run: a seeded walk over the vocabulary with repeats, so that attention
/// has earlier tokens to find.
fn random_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7 + (i / 5) * 13 + (i * i) % 11) % vocab) as u32)
        .collect()
}

const USAGE: &str = "usage: perplexity MODEL_DIR TOKENS_FILE [--max-tokens N] | --random";

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("perplexity: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let max_tokens = match args.iter().position(|a| a == "--max-tokens") {
        Some(i) => {
            let n = args.get(i + 1).ok_or("--max-tokens needs a value")?;
            Some(
                n.parse::<usize>()
                    .map_err(|e| format!("--max-tokens {n}: {e}"))?,
            )
        }
        None => None,
    };
    let (model, tokens) = if args.first().map(String::as_str) == Some("--random") {
        (
            random_model(RANDOM, 1),
            random_tokens(max_tokens.unwrap_or(160), RANDOM.vocab),
        )
    } else {
        let [dir, tokens, ..] = args.as_slice() else {
            return Err(USAGE.into());
        };
        let model = load_model(Path::new(dir))?;
        let text = std::fs::read_to_string(tokens).map_err(|e| format!("{tokens}: {e}"))?;
        let mut ids: Vec<u32> = text
            .split_whitespace()
            .map(|t| t.parse().map_err(|e| format!("{tokens}: token '{t}': {e}")))
            .collect::<Result<_, _>>()?;
        ids.truncate(max_tokens.unwrap_or(512));
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= model.cfg.vocab) {
            return Err(format!("token {bad} is outside the vocabulary").into());
        }
        (model, ids)
    };
    if tokens.len() < 2 {
        return Err("need at least two tokens".into());
    }
    let rows = evaluate(&model, &tokens)?;
    println!(
        "{} tokens, {} layers, {} / {} heads of head_dim {}, block size {BLOCK}\n",
        tokens.len(),
        model.cfg.layers,
        model.cfg.heads,
        model.cfg.kv_heads,
        model.cfg.head_dim
    );
    print!("{}", table(&rows, model.cfg.head_dim));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The random model through every pair: 16-bit caches stay within their rounding of the
    /// reference, quantized ones move it more, and the table lists them all.
    #[test]
    fn random_model_through_every_pair() {
        let model = random_model(RANDOM, 1);
        let tokens = random_tokens(72, RANDOM.vocab);
        let rows = evaluate(&model, &tokens).unwrap();
        assert_eq!(rows.len(), 1 + pairs().len());
        let base = &rows[0].1;
        assert!(base.kl == 0.0 && base.top1 == 1.0);
        assert!(base.perplexity > 1.0 && base.perplexity < RANDOM.vocab as f64 * 4.0);
        let of = |k, v| &rows.iter().find(|(p, _)| *p == Some((k, v))).unwrap().1;
        use KvFormat::*;
        let f16 = of(F16, F16);
        assert!(
            (f16.perplexity / base.perplexity - 1.0).abs() < 1e-3,
            "{}",
            f16.perplexity
        );
        assert!(f16.kl < 1e-5 && f16.top1 > 0.95);
        let int4 = of(Int4Sym32, Int4Affine64);
        assert!(int4.kl > f16.kl && int4.kl < 0.5, "{}", int4.kl);
        for (_, s) in &rows {
            assert!(s.perplexity.is_finite() && s.kl >= -1e-9 && (0.0..=1.0).contains(&s.top1));
        }
        let text = table(&rows, RANDOM.head_dim);
        assert_eq!(text.lines().count(), 2 + rows.len());
        assert!(text.contains("int4-kc / fp8-e4m3"));
    }
}
