//! A small Llama-shaped model on candle with kvq as its KV cache: token embedding, per layer
//! RMSNorm → q/k/v projections → rotary positions → kvq append (INT4 keys and values) → kvq
//! attention → output projection → residual → SwiGLU MLP, then the logits. Two sequences of
//! different prompt lengths are prefilled in one ragged step (`kvq::candle::prefill`: every
//! prompt token attends causally to the cached prompt), then decoded side by side, one token
//! per step (`kvq::candle::decode`, greedy).
//!
//! The same model runs on candle's CPU device with kvq's CPU reference as its attention (a
//! `HostCache` that receives the same appends and `kvq::cpu::prefill_attention`), fed the GPU's
//! tokens; the logits of every step (the prefill's last token per sequence, then each decode)
//! are compared.
//!
//! ```sh
//! cargo run --release --features candle --example candle_llama -- [--steps N]
//! ```

use candle_core::{D, DType, Device, Tensor};
use kvq::cache::{BlockAllocator, HostCache, SeqId};
use kvq::cpu::{Accum, AttentionOptions, HeadTerms, prefill_attention};
use kvq::cuda::prefill::{PrefillCapacity, PrefillPlan, PrefillWorkspace, QoIndptr};
use kvq::cuda::{
    DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, TablesCapacity,
};
use kvq::{CacheConfig, KvFormat};

const VOCAB: usize = 256;
const HIDDEN: usize = 512;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const D_HEAD: usize = 64;
const MLP: usize = 1024;
const LAYERS: usize = 2;
const BS: usize = 16;
const BATCH: usize = 2;
const MAX_CTX: usize = 1024;
/// New tokens of one prefill step, over the batch.
const MAX_PROMPT_TOKENS: usize = 256;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The weights, on one device.
struct Weights {
    embed: Tensor,
    out: Tensor,
    final_norm: Tensor,
    layers: Vec<Layer>,
}

struct Layer {
    norm1: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    norm2: Tensor,
    wg: Tensor,
    wu: Tensor,
    wd: Tensor,
}

fn weights(dev: &Device) -> Res<Weights> {
    // Seeded: both devices get the same weights.
    let mut rng = kvq::synth::Synth::new(2026);
    let mut mat = |rows: usize, cols: usize, std: f32| -> Res<Tensor> {
        Ok(Tensor::from_vec(
            rng.normal(rows * cols, std),
            (rows, cols),
            dev,
        )?)
    };
    let ones = |n: usize| Tensor::ones(n, DType::F32, dev);
    let embed = mat(VOCAB, HIDDEN, 1.0)?;
    let out = mat(HIDDEN, VOCAB, 0.05)?;
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        layers.push(Layer {
            norm1: ones(HIDDEN)?,
            wq: mat(HIDDEN, HEADS * D_HEAD, 0.05)?,
            wk: mat(HIDDEN, KV_HEADS * D_HEAD, 0.05)?,
            wv: mat(HIDDEN, KV_HEADS * D_HEAD, 0.05)?,
            wo: mat(HEADS * D_HEAD, HIDDEN, 0.03)?,
            norm2: ones(HIDDEN)?,
            wg: mat(HIDDEN, MLP, 0.04)?,
            wu: mat(HIDDEN, MLP, 0.04)?,
            wd: mat(MLP, HIDDEN, 0.03)?,
        });
    }
    Ok(Weights {
        embed,
        out,
        final_norm: ones(HIDDEN)?,
        layers,
    })
}

fn rms_norm(x: &Tensor, w: &Tensor) -> Res<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.broadcast_mul(w)?)
}

/// Rotary positions on `x` `[tokens, heads, D_HEAD]` at the positions `pos` (one per row).
fn rope(x: &Tensor, pos: &[usize]) -> Res<Tensor> {
    let half = D_HEAD / 2;
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for &p in pos {
        for i in 0..half {
            let theta = p as f32 / 10000f32.powf(2.0 * i as f32 / D_HEAD as f32);
            cos.push(theta.cos());
            sin.push(theta.sin());
        }
    }
    let dev = x.device();
    let cos = Tensor::from_vec(cos, (pos.len(), 1, half), dev)?;
    let sin = Tensor::from_vec(sin, (pos.len(), 1, half), dev)?;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
    Ok(Tensor::cat(&[r1, r2], D::Minus1)?)
}

/// kvq on the GPU: one cache per layer; one decode plan, one prefill plan, their workspaces,
/// the block tables and a prefill step's offsets for all.
struct GpuAttention {
    caches: Vec<DeviceCache>,
    plan: DecodePlan,
    ws: DecodeWorkspace,
    prefill: PrefillPlan,
    pws: PrefillWorkspace,
    tables: DeviceBlockTables,
    qo: QoIndptr,
}

/// Where attention runs: kvq on the GPU, or kvq's CPU reference (one host cache per layer).
enum Attention {
    Gpu(Box<GpuAttention>),
    Cpu(Vec<HostCache>),
}

/// The sequences of one step: their new tokens (token-major over the batch: sequence b's are
/// `qo[b]..qo[b + 1]`), the tokens' positions and pool slots.
struct StepInput<'a> {
    alloc: &'a BlockAllocator,
    seqs: &'a [SeqId],
    tokens: &'a [u32],
    qo: &'a [u32],
    pos: &'a [usize],
    slots: &'a [usize],
}

/// One step of the whole model over every sequence's new tokens (a prompt, or one token each);
/// returns the logits of each sequence's last new token, `[batch, VOCAB]`.
fn step(w: &Weights, att: &mut Attention, inp: &StepInput, dev: &Device) -> Res<Tensor> {
    let StepInput {
        alloc,
        seqs,
        tokens,
        qo,
        pos,
        slots,
    } = *inp;
    let n = tokens.len();
    let ids = Tensor::from_vec(tokens.to_vec(), n, dev)?;
    let mut h = w.embed.index_select(&ids, 0)?; // [tokens, HIDDEN]
    let tables = alloc.block_tables(seqs)?;
    let decode = qo.windows(2).all(|r| r[1] - r[0] == 1);
    if let Attention::Gpu(g) = att {
        // One upload of each per step, for every layer.
        g.tables.update(&tables)?;
        if !decode {
            g.qo.set(qo)?;
        }
    }
    for (li, l) in w.layers.iter().enumerate() {
        let a = rms_norm(&h, &l.norm1)?;
        let q = rope(&a.matmul(&l.wq)?.reshape((n, HEADS, D_HEAD))?, pos)?;
        let k = rope(&a.matmul(&l.wk)?.reshape((n, KV_HEADS, D_HEAD))?, pos)?;
        let v = a.matmul(&l.wv)?.reshape((n, KV_HEADS, D_HEAD))?;
        // kvq attends with f16 queries: both paths see the same rounded q.
        let q16 = q.to_dtype(DType::F16)?;
        let attn = match att {
            Attention::Gpu(g) => {
                let slots = Tensor::from_vec(
                    slots.iter().map(|&s| s as i64).collect::<Vec<_>>(),
                    slots.len(),
                    dev,
                )?;
                let cache = &mut g.caches[li];
                kvq::candle::append(cache, &slots, &k.contiguous()?, &v.contiguous()?)?;
                if decode {
                    kvq::candle::decode(&g.plan, &mut g.ws, cache, &g.tables, &q16, 1, DType::F32)?
                } else {
                    kvq::candle::prefill(
                        &g.prefill,
                        &mut g.pws,
                        cache,
                        &g.tables,
                        &g.qo,
                        &q16,
                        DType::F32,
                    )?
                }
            }
            Attention::Cpu(caches) => {
                let kf = k.flatten_all()?.to_vec1::<f32>()?;
                let vf = v.flatten_all()?.to_vec1::<f32>()?;
                caches[li].write(slots, &kf, &vf)?;
                let qf = q16.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let out = prefill_attention(
                    &caches[li],
                    &tables,
                    qo,
                    &qf,
                    HEADS,
                    &AttentionOptions::new(D_HEAD),
                    HeadTerms::default(),
                    Accum::F64,
                )?;
                Tensor::from_vec(out.out, (n, HEADS, D_HEAD), dev)?
            }
        };
        h = (h + attn.reshape((n, HEADS * D_HEAD))?.matmul(&l.wo)?)?;
        let m = rms_norm(&h, &l.norm2)?;
        let g = m.matmul(&l.wg)?.silu()?;
        let u = m.matmul(&l.wu)?;
        h = (h + (g * u)?.matmul(&l.wd)?)?;
    }
    let last: Vec<u32> = qo[1..].iter().map(|&e| e - 1).collect();
    let h = h.index_select(&Tensor::from_vec(last, seqs.len(), dev)?, 0)?;
    Ok(rms_norm(&h, &w.final_norm)?.matmul(&w.out)?)
}

fn run(steps: usize) -> Res<()> {
    let gpu_dev = Device::new_cuda(0)?;
    let cpu_dev = Device::Cpu;
    let (wg, wc) = (weights(&gpu_dev)?, weights(&cpu_dev)?);
    let config = CacheConfig::new(
        KV_HEADS,
        D_HEAD,
        BS,
        KvFormat::Int4Sym32,
        KvFormat::Int4Affine64,
    )?;
    let num_blocks = BATCH * MAX_CTX / BS;
    // kvq on candle's own stream: appends and decodes queue in order with candle's kernels.
    let gpu = kvq::candle::gpu(&gpu_dev)?;
    println!("{}", gpu.summary());
    let caches = (0..LAYERS)
        .map(|_| DeviceCache::new(&gpu, config, num_blocks))
        .collect::<kvq::Result<Vec<_>>>()?;
    let plan = DecodePlan::new(
        &gpu,
        caches[0].layout(),
        DecodeCapacity {
            max_batch: BATCH,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: MAX_CTX,
        },
    )?;
    let ws = DecodeWorkspace::new(&plan)?;
    let prefill = PrefillPlan::new(
        &gpu,
        caches[0].layout(),
        PrefillCapacity {
            max_batch: BATCH,
            num_q_heads: HEADS,
            max_tokens: MAX_PROMPT_TOKENS,
            max_context_len: MAX_CTX,
        },
    )?;
    let pws = PrefillWorkspace::new(&prefill)?;
    let tables = DeviceBlockTables::with_capacity(
        &caches[0],
        TablesCapacity {
            max_batch: BATCH,
            max_context_len: MAX_CTX,
        },
    )?;
    let qo = QoIndptr::new(&gpu, BATCH)?;
    let mut on_gpu = Attention::Gpu(Box::new(GpuAttention {
        caches,
        plan,
        ws,
        prefill,
        pws,
        tables,
        qo,
    }));
    let mut on_cpu = Attention::Cpu(
        (0..LAYERS)
            .map(|_| HostCache::new(config, num_blocks))
            .collect::<kvq::Result<Vec<_>>>()?,
    );
    let mut alloc = BlockAllocator::for_config(&config, num_blocks)?;
    let seqs: Vec<SeqId> = (0..BATCH).map(|_| alloc.create_sequence()).collect();
    let prompts: [&[u8]; BATCH] = [
        b"kvq decodes a quantized paged cache",
        b"on candle's stream",
    ];
    // Step 0 prefills both prompts in one ragged step; every later step decodes one token
    // per sequence (the GPU's greedy choice, fed to both models).
    let mut tokens: Vec<u32> = prompts
        .iter()
        .flat_map(|p| p.iter().map(|&c| c as u32))
        .collect();
    let mut qo: Vec<u32> = vec![0];
    for p in &prompts {
        qo.push(qo.last().unwrap() + p.len() as u32);
    }
    let (mut worst, mut agree) = (0f64, 0usize);
    for _ in 0..steps {
        let (mut slots, mut pos) = (Vec::new(), Vec::new());
        for (b, &s) in seqs.iter().enumerate() {
            let n = (qo[b + 1] - qo[b]) as usize;
            let start = alloc.len(s)?;
            let r = alloc.reserve(s, n)?;
            // No sequence here shares blocks (no forks), so no copy-on-write is ever due; an
            // engine with prefix sharing applies `r.copies` to every layer first (README).
            assert!(r.copies.is_empty());
            slots.extend(r.slots);
            pos.extend(start..start + n);
        }
        let inp = StepInput {
            alloc: &alloc,
            seqs: &seqs,
            tokens: &tokens,
            qo: &qo,
            pos: &pos,
            slots: &slots,
        };
        let lg = step(&wg, &mut on_gpu, &inp, &gpu_dev)?;
        let lc = step(&wc, &mut on_cpu, &inp, &cpu_dev)?;
        let lg = lg.to_device(&cpu_dev)?;
        let diff = (&lg - &lc)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        let norm = lc.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        let rel = (diff / norm).sqrt();
        worst = worst.max(rel);
        let next_g = lg.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let next_c = lc.argmax(D::Minus1)?.to_vec1::<u32>()?;
        agree += next_g.iter().zip(&next_c).filter(|(a, b)| a == b).count();
        tokens = next_g;
        qo = (0..=BATCH as u32).collect();
    }
    println!(
        "{steps} steps x {BATCH} sequences (a ragged prefill of the prompts, then decode), \
         {LAYERS} layers, INT4 K/V cache: logits of the candle GPU model (kvq prefill and \
         decode) vs the CPU model (kvq's reference attention): worst relative L2 difference \
         {worst:.2e}; greedy tokens agree {agree} of {}",
        steps * BATCH
    );
    if worst > 2e-2 {
        return Err(format!("GPU and CPU logits differ by {worst:.2e}").into());
    }
    Ok(())
}

fn main() {
    let mut steps = 64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => steps = args.next().and_then(|s| s.parse().ok()).unwrap_or(steps),
            other => {
                eprintln!("unknown argument {other}; use --steps N");
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = run(steps) {
        eprintln!("candle_llama: {e}");
        std::process::exit(1);
    }
}
