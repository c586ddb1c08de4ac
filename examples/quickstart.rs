//! Quickstart: a paged, quantized KV cache for one Llama-like attention layer (8 KV heads,
//! 32 query heads, head_dim 128, blocks of 16 tokens). For each K/V format pair it appends a few
//! thousand tokens of synthetic keys and values (keys with a few outlier channels, as real
//! models have) to several sequences, decodes one new token per sequence with the CPU reference,
//! and prints what the format costs: bytes per element, pool size, and the attention output's
//! error against f32 attention on the unquantized data.
//!
//! ```text
//! cargo run --release --example quickstart
//! ```

use kvq::cache::PagedKvCache;
use kvq::cpu::{self, Accum, AttentionOptions, DecodeShape, DenseKv};
use kvq::synth::Synth;
use kvq::{CacheConfig, KvFormat, ScaleGranularity};

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const HEAD_DIM: usize = 128;
const BLOCK_SIZE: usize = 16;
/// Tokens per sequence: a batch of uneven lengths, as a server would have.
const SEQ_LENS: [usize; 4] = [509, 1024, 1537, 2000];
/// Key channels per head that carry large values, and how much larger they are.
const OUTLIER_CHANNELS: usize = 2;
const OUTLIER_SCALE: f32 = 8.0;

/// One sequence's keys and values, `[len, KV_HEADS, HEAD_DIM]` each.
struct Sequence {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Keys with outlier channels; values with a per-channel offset (what affine INT4's zero point
/// absorbs) plus noise.
fn synthetic_sequence(synth: &mut Synth, len: usize, v_offsets: &[f32]) -> Sequence {
    let k = synth.with_outlier_channels(len, KV_HEADS, HEAD_DIM, OUTLIER_CHANNELS, OUTLIER_SCALE);
    let mut v = synth.normal(len * KV_HEADS * HEAD_DIM, 0.5);
    for row in v.chunks_exact_mut(KV_HEADS * HEAD_DIM) {
        for (x, offset) in row.iter_mut().zip(v_offsets) {
            *x += offset;
        }
    }
    Sequence { k, v }
}

/// Relative L2 error of `approx` against `reference`.
fn rel_l2(reference: &[f32], approx: &[f32]) -> f64 {
    let (mut err, mut norm) = (0f64, 0f64);
    for (&a, &b) in reference.iter().zip(approx) {
        err += (a as f64 - b as f64).powi(2);
        norm += (a as f64).powi(2);
    }
    (err / norm).sqrt()
}

fn main() -> kvq::Result<()> {
    let mut synth = Synth::new(2024);
    let v_offsets = synth.uniform(KV_HEADS * HEAD_DIM, -1.0, 1.0);
    let seqs: Vec<Sequence> = SEQ_LENS
        .iter()
        .map(|&len| synthetic_sequence(&mut synth, len, &v_offsets))
        .collect();
    // The new token's query of every sequence: [batch, Q_HEADS, q_len = 1, HEAD_DIM].
    let q = synth.normal(SEQ_LENS.len() * Q_HEADS * HEAD_DIM, 1.0);
    let (shape, opts) = (
        DecodeShape::new(Q_HEADS, 1),
        AttentionOptions::new(HEAD_DIM),
    );

    // The yardstick: f32 attention over the unquantized keys and values.
    let mut reference = Vec::new();
    for (b, s) in seqs.iter().enumerate() {
        let kv = DenseKv {
            k: &s.k,
            v: &s.v,
            num_kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
        };
        let q_b = &q[b * Q_HEADS * HEAD_DIM..][..Q_HEADS * HEAD_DIM];
        reference.extend(cpu::attention_dense(q_b, kv, &shape, &opts, Accum::F64)?.out);
    }

    // FP8 scales are calibrated from sample data; here, the first sequence.
    let (sample_k, sample_v) = (&seqs[0].k, &seqs[0].v);
    let num_blocks: usize = SEQ_LENS.iter().map(|l| l.div_ceil(BLOCK_SIZE)).sum();
    let total: usize = SEQ_LENS.iter().sum();
    println!(
        "{} sequences, {total} tokens; {KV_HEADS} KV heads, {Q_HEADS} query heads, \
         head_dim {HEAD_DIM}, block size {BLOCK_SIZE}; FP8 scales per KV head\n",
        SEQ_LENS.len()
    );
    println!(
        "{:<24} {:>10} {:>9} {:>20}",
        "K / V format", "bytes/elem", "pool MiB", "out rel err vs f32"
    );

    use KvFormat::*;
    let pairs = [
        (F16, F16),
        (Bf16, Bf16),
        (Fp8E4m3, Fp8E4m3),
        (Fp8E5m2, Fp8E5m2),
        (Int4Sym32, Fp8E4m3),
        (Fp8E4m3, Int4Affine64),
        (Int4Sym32, Int4Affine64),
    ];
    for (k_format, v_format) in pairs {
        let config = CacheConfig::new(KV_HEADS, HEAD_DIM, BLOCK_SIZE, k_format, v_format)?;
        let mut cache = PagedKvCache::new(config, 1, num_blocks)?;
        cache.layers_mut()[0].calibrate_fp8_scales(
            sample_k,
            sample_v,
            ScaleGranularity::PerHead,
        )?;

        // Prefill every sequence but its last token in one append, then append that token
        // alone, as a decode step would.
        let mut ids = Vec::new();
        for s in &seqs {
            let id = cache.create_sequence();
            let row = KV_HEADS * HEAD_DIM;
            let split = s.k.len() - row;
            cache.append(id, &[&s.k[..split]], &[&s.v[..split]])?;
            cache.append(id, &[&s.k[split..]], &[&s.v[split..]])?;
            ids.push(id);
        }

        let tables = cache.block_tables(&ids)?;
        let out =
            cpu::decode_attention(&cache.layers()[0], &tables, &q, &shape, &opts, Accum::F64)?;

        let layout = config.layout();
        let bytes_per_element = layout.bytes_per_token_head() / (2 * HEAD_DIM) as f64;
        let pool_mib = layout.pool_bytes(num_blocks) as f64 / (1 << 20) as f64;
        println!(
            "{:<24} {:>10.4} {:>9.2} {:>20.2e}",
            format!("{k_format} / {v_format}"),
            bytes_per_element,
            pool_mib,
            rel_l2(&reference, &out.out)
        );
    }
    Ok(())
}
