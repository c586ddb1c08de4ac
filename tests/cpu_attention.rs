//! The CPU reference attention against a naive f64 computation on the same dequantized values,
//! its causal / GQA / paging semantics, its validation, and the accuracy of each cache format
//! against unquantized f32 attention on real (MiniLM) and synthetic outlier data.

mod common;

use common::Rng;
use half::f16;
use kvq::cache::{BlockAllocator, BlockTables, HostCache, SeqId};
use kvq::cpu::{
    Accum, AttentionOptions, AttentionOutput, DecodeShape, DenseKv, attention_dense,
    decode_attention,
};
use kvq::format::int4;
use kvq::{CacheConfig, Error, KvFormat, ScaleGranularity};

/// Naive causal attention of one sequence in f64 over dense K/V `[len, kv_heads, d]`, q
/// `[nq, q_len, d]`; returns out `[nq, q_len, d]` and lse `[nq, q_len]`.
fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    nkv: usize,
    d: usize,
    shape: &DecodeShape,
) -> (Vec<f64>, Vec<f64>) {
    let (nq, q_len, scale) = (shape.num_q_heads, shape.q_len, 1.0 / (d as f32).sqrt());
    let len = k.len() / (nkv * d);
    let mut out = vec![0f64; nq * q_len * d];
    let mut lse = vec![0f64; nq * q_len];
    for h in 0..nq {
        let g = h / (nq / nkv);
        for i in 0..q_len {
            let p = len - q_len + i;
            let qr = &q[(h * q_len + i) * d..][..d];
            let logits: Vec<f64> = (0..=p)
                .map(|t| {
                    let kr = &k[(t * nkv + g) * d..][..d];
                    let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    scale as f64 * dot
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (t, wt) in w.iter().enumerate() {
                let vr = &v[(t * nkv + g) * d..][..d];
                for (o, &x) in out[(h * q_len + i) * d..][..d].iter_mut().zip(vr) {
                    *o += wt * x as f64;
                }
            }
            for o in &mut out[(h * q_len + i) * d..][..d] {
                *o /= sum;
            }
            lse[h * q_len + i] = max + sum.ln();
        }
    }
    (out, lse)
}

/// ‖a − b‖₂ / ‖b‖₂.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max)
}

/// A batch of sequences in a paged cache, appended in interleaved random-size chunks so their
/// blocks are not contiguous.
struct Setup {
    cache: HostCache,
    alloc: BlockAllocator,
    seqs: Vec<SeqId>,
    tables: BlockTables,
    q: Vec<f32>,
    shape: DecodeShape,
}

fn setup(cfg: CacheConfig, group: usize, q_len: usize, lens: &[usize], seed: u64) -> Setup {
    let mut rng = Rng(seed);
    let (nkv, d, bs) = (cfg.num_kv_heads, cfg.head_dim, cfg.block_size);
    let row = nkv * d;
    let blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 2;
    let mut alloc = BlockAllocator::new(blocks, bs).unwrap();
    let mut cache = HostCache::new(cfg, blocks).unwrap();
    let data: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&l| (rng.normals(l * row, 1.5), rng.normals(l * row, 1.0)))
        .collect();
    let all_k: Vec<f32> = data.iter().flat_map(|(k, _)| k.iter().copied()).collect();
    let all_v: Vec<f32> = data.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    cache
        .calibrate_fp8_scales(&all_k, &all_v, ScaleGranularity::PerHead)
        .unwrap();
    let seqs: Vec<SeqId> = lens.iter().map(|_| alloc.create_sequence()).collect();
    let mut written = vec![0usize; lens.len()];
    while written.iter().zip(lens).any(|(w, l)| w < l) {
        for (i, &s) in seqs.iter().enumerate() {
            let n = (1 + rng.below(bs + 3)).min(lens[i] - written[i]);
            if n == 0 {
                continue;
            }
            let r = alloc.reserve(s, n).unwrap();
            assert!(r.copies.is_empty());
            let (k, v) = &data[i];
            let at = written[i] * row;
            let nf = cache
                .write(&r.slots, &k[at..at + n * row], &v[at..at + n * row])
                .unwrap();
            assert_eq!(nf, 0);
            written[i] += n;
        }
    }
    let tables = alloc.block_tables(&seqs).unwrap();
    let shape = DecodeShape::new(nkv * group, q_len);
    let q = rng.normals(lens.len() * shape.num_q_heads * q_len * d, 1.0);
    Setup {
        cache,
        alloc,
        seqs,
        tables,
        q,
        shape,
    }
}

impl Setup {
    /// Dequantized K/V of sequence `b`, `[len, kv_heads, d]`.
    fn dense(&self, b: usize) -> (Vec<f32>, Vec<f32>) {
        let c = self.cache.config();
        let len = self.alloc.len(self.seqs[b]).unwrap();
        let n = len * c.num_kv_heads * c.head_dim;
        let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
        let table = self.alloc.block_table(self.seqs[b]).unwrap();
        self.cache.gather(table, len, &mut k, &mut v).unwrap();
        (k, v)
    }

    /// The query block of sequence `b`, `[nq, q_len, d]`.
    fn q_of(&self, b: usize) -> &[f32] {
        let n = self.shape.num_q_heads * self.shape.q_len * self.cache.config().head_dim;
        &self.q[b * n..][..n]
    }

    /// Plain causal attention at the cache's `1 / sqrt(head_dim)`.
    fn opts(&self) -> AttentionOptions {
        AttentionOptions::new(self.cache.config().head_dim)
    }

    fn run(&self, accum: Accum) -> AttentionOutput {
        let opts = self.opts();
        decode_attention(
            &self.cache,
            &self.tables,
            &self.q,
            &self.shape,
            &opts,
            accum,
        )
        .unwrap()
    }

    /// Check F64 (and F32) results against the naive computation for every sequence.
    fn check_against_naive(&self, label: &str) {
        let c = self.cache.config();
        let (nq, d, q_len) = (self.shape.num_q_heads, c.head_dim, self.shape.q_len);
        let r64 = self.run(Accum::F64);
        let r32 = self.run(Accum::F32);
        let per_out = nq * q_len * d;
        let per_lse = nq * q_len;
        for b in 0..self.seqs.len() {
            let (k, v) = self.dense(b);
            let (want, want_lse) = naive(self.q_of(b), &k, &v, c.num_kv_heads, d, &self.shape);
            let out64 = &r64.out[b * per_out..][..per_out];
            let out32 = &r32.out[b * per_out..][..per_out];
            let lse64 = &r64.lse[b * per_lse..][..per_lse];
            let lse32 = &r32.lse[b * per_lse..][..per_lse];
            // f64 accumulation: only the final rounding to f32 differs.
            let scale = want.iter().fold(1e-30, |m: f64, x| m.max(x.abs()));
            assert!(
                max_abs_diff(out64, &want) <= 4e-7 * scale,
                "{label} seq {b}: f64 out differs by {}",
                max_abs_diff(out64, &want)
            );
            assert!(max_abs_diff(lse64, &want_lse) <= 1e-6 * (1.0 + want_lse[0].abs()));
            let e32 = rel_err(out32, &want);
            assert!(
                e32 < 2e-5,
                "{label} seq {b}: f32 accumulation rel err {e32}"
            );
            assert!(
                max_abs_diff(lse32, &want_lse) < 1e-4,
                "{label} seq {b}: f32 lse"
            );
        }
    }
}

#[test]
fn every_format_pair_matches_naive_f64() {
    for (i, k) in KvFormat::ALL.into_iter().enumerate() {
        for (j, v) in KvFormat::ALL
            .into_iter()
            .filter(|v| !v.block_groups())
            .enumerate()
        {
            let cfg = CacheConfig::new(2, 64, 16, k, v).unwrap();
            let s = setup(cfg, 6, 3, &[3, 16, 17, 40], (i * 6 + j) as u64);
            s.check_against_naive(&format!("k={k} v={v}"));
        }
    }
}

#[test]
fn block_sizes_head_dims_and_lengths() {
    let pairs = [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E5m2),
        (KvFormat::Bf16, KvFormat::F16),
    ];
    let mut seed = 100;
    for bs in [16, 32, 64] {
        for d in [64, 128, 256] {
            for (k, v) in pairs {
                seed += 1;
                let cfg = CacheConfig::new(2, d, bs, k, v).unwrap();
                // q_len 1: lengths 1 and around block boundaries.
                let s = setup(cfg, 3, 1, &[1, bs - 1, bs, bs + 1, 2 * bs], seed);
                s.check_against_naive(&format!("bs={bs} d={d} k={k} v={v} q_len=1"));
                // q_len 5 with the window straddling a block boundary.
                let s = setup(cfg, 2, 5, &[5, bs + 2, 2 * bs - 1], seed + 1000);
                s.check_against_naive(&format!("bs={bs} d={d} k={k} v={v} q_len=5"));
            }
        }
    }
}

#[test]
fn gqa_group_sizes_including_six() {
    for group in [1, 2, 4, 6, 7, 16] {
        let cfg = CacheConfig::new(3, 64, 16, KvFormat::Fp8E4m3, KvFormat::Int4Affine64).unwrap();
        let s = setup(cfg, group, 2, &[2, 33], 7 + group as u64);
        s.check_against_naive(&format!("group {group}"));
    }
}

/// Query `i` of a `q_len` window equals a single-token decode with the context cut at its
/// position: causal masking among the new tokens, checked bit for bit.
#[test]
fn q_len_window_is_causal() {
    let cfg = CacheConfig::new(2, 64, 16, KvFormat::Int4Sym32, KvFormat::Fp8E4m3).unwrap();
    for q_len in 1..=8 {
        let len = 16 + 3 * q_len;
        let s = setup(cfg, 6, q_len, &[len], 50 + q_len as u64);
        s.check_against_naive(&format!("q_len {q_len}"));
        let full = s.run(Accum::F64);
        let d = 64;
        let table = s.alloc.block_table(s.seqs[0]).unwrap();
        for i in 0..q_len {
            let p = len - q_len + i;
            let single = BlockTables::from_rows(&[table], &[p + 1]).unwrap();
            // q of every head at query i: [nq, 1, d].
            let q: Vec<f32> = (0..12)
                .flat_map(|h| s.q[(h * q_len + i) * d..][..d].iter().copied())
                .collect();
            let r = decode_attention(
                &s.cache,
                &single,
                &q,
                &DecodeShape {
                    q_len: 1,
                    ..s.shape
                },
                &s.opts(),
                Accum::F64,
            )
            .unwrap();
            for h in 0..12 {
                assert_eq!(
                    r.out[h * d..][..d],
                    full.out[(h * q_len + i) * d..][..d],
                    "q_len {q_len} query {i} head {h}"
                );
                assert_eq!(r.lse[h], full.lse[h * q_len + i]);
            }
        }
    }
}

/// The dense entry point on the gathered dequantized values runs the same loop: bit-equal.
#[test]
fn attention_dense_equals_paged_on_dequantized_values() {
    let cfg = CacheConfig::new(2, 128, 32, KvFormat::Fp8E5m2, KvFormat::Int4Affine64).unwrap();
    let s = setup(cfg, 4, 3, &[70, 3], 9);
    for accum in [Accum::F32, Accum::F64] {
        let paged = s.run(accum);
        let per = 8 * 3 * 128;
        for b in 0..2 {
            let (k, v) = s.dense(b);
            let kv = DenseKv {
                k: &k,
                v: &v,
                num_kv_heads: 2,
                head_dim: 128,
            };
            let dense = attention_dense(s.q_of(b), kv, &s.shape, &s.opts(), accum).unwrap();
            assert_eq!(dense.out, paged.out[b * per..][..per]);
            assert_eq!(dense.lse, paged.lse[b * 24..][..24]);
        }
    }
}

/// Large batches run on several threads; the result is bit-identical to one call per sequence
/// (small enough to stay on one thread).
#[test]
fn threaded_batch_equals_one_sequence_at_a_time() {
    let cfg = CacheConfig::new(2, 64, 16, KvFormat::Fp8E4m3, KvFormat::Int4Affine64).unwrap();
    let lens = [20_000, 17, 15_001];
    let s = setup(cfg, 3, 2, &lens, 77);
    let batched = s.run(Accum::F64);
    let per_out = 6 * 2 * 64;
    for (b, &len) in lens.iter().enumerate() {
        let table = s.alloc.block_table(s.seqs[b]).unwrap();
        let one = BlockTables::from_rows(&[table], &[len]).unwrap();
        let r =
            decode_attention(&s.cache, &one, s.q_of(b), &s.shape, &s.opts(), Accum::F64).unwrap();
        assert_eq!(r.out, batched.out[b * per_out..][..per_out], "seq {b}");
        assert_eq!(r.lse, batched.lse[b * 12..][..12], "seq {b}");
    }
}

/// A forked sequence reads shared blocks; a table may list the same block for two sequences.
#[test]
fn shared_blocks_are_read_by_both_sequences() {
    let cfg = CacheConfig::new(1, 64, 16, KvFormat::F16, KvFormat::F16).unwrap();
    let mut s = setup(cfg, 2, 1, &[20], 11);
    let child = s.alloc.fork(s.seqs[0]).unwrap();
    s.seqs.push(child);
    s.tables = s.alloc.block_tables(&s.seqs).unwrap();
    let q0 = s.q.clone();
    s.q.extend_from_slice(&q0);
    let r = s.run(Accum::F64);
    let n = 2 * 64;
    assert_eq!(r.out[..n], r.out[n..]);
    s.check_against_naive("fork");
}

#[test]
fn invalid_inputs_are_errors() {
    let cfg = CacheConfig::new(2, 64, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
    let s = setup(cfg, 2, 2, &[5, 18], 3);
    let run = |tables: &BlockTables, q: &[f32], shape: &DecodeShape| {
        decode_attention(&s.cache, tables, q, shape, &s.opts(), Accum::F64)
    };
    assert!(run(&s.tables, &s.q, &s.shape).is_ok());
    // q of the wrong length.
    assert!(matches!(
        run(&s.tables, &s.q[1..], &s.shape),
        Err(Error::Length { .. })
    ));
    // q_len 0, q heads not a multiple of kv heads.
    for shape in [
        DecodeShape {
            q_len: 0,
            ..s.shape
        },
        DecodeShape {
            num_q_heads: 3,
            ..s.shape
        },
        DecodeShape {
            num_q_heads: 0,
            ..s.shape
        },
    ] {
        assert!(run(&s.tables, &s.q, &shape).is_err(), "{shape:?}");
    }
    // A softmax scale that is not positive and finite.
    for softmax_scale in [f32::NAN, f32::INFINITY, 0.0, -0.1] {
        let opts = AttentionOptions {
            softmax_scale,
            ..s.opts()
        };
        let r = decode_attention(&s.cache, &s.tables, &s.q, &s.shape, &opts, Accum::F64);
        assert!(
            matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("softmax_scale")),
            "{softmax_scale}: {r:?}"
        );
    }
    // context shorter than q_len.
    let short = BlockTables {
        context_lens: vec![1, 18],
        ..s.tables.clone()
    };
    assert!(matches!(
        run(&short, &s.q, &s.shape),
        Err(Error::InvalidArgument(_))
    ));
    // bad block id, negative used entry, table shape.
    let mut bad = s.tables.clone();
    bad.data[0] = 1000;
    assert!(matches!(
        run(&bad, &s.q, &s.shape),
        Err(Error::BlockIndex { block: 1000, .. })
    ));
    bad.data[0] = -1;
    assert!(run(&bad, &s.q, &s.shape).is_err());
    let mut bad = s.tables.clone();
    bad.data.push(0);
    assert!(matches!(
        run(&bad, &s.q, &s.shape),
        Err(Error::Length { .. })
    ));
    // non-finite q.
    let mut q = s.q.clone();
    q[7] = f32::INFINITY;
    assert!(matches!(
        run(&s.tables, &q, &s.shape),
        Err(Error::NonFinite { what: "q", .. })
    ));
    // An absurd FP8 scale that overflows f32 on decode is reported, not returned as NaN.
    let cfg8 = CacheConfig::new(1, 16, 16, KvFormat::Fp8E4m3, KvFormat::Fp8E4m3).unwrap();
    let mut c8 = HostCache::new(cfg8, 1).unwrap();
    c8.write(&[0], &[448.0f32; 16], &[1.0f32; 16]).unwrap();
    c8.set_scales(&[1e36], &[1e36]).unwrap(); // 448 * 1e36 overflows f32
    let t = BlockTables::from_rows(&[&[0]], &[1]).unwrap();
    assert!(matches!(
        decode_attention(
            &c8,
            &t,
            &[1.0; 16],
            &DecodeShape::new(1, 1),
            &AttentionOptions::new(16),
            Accum::F64
        ),
        Err(Error::NonFinite { .. })
    ));
    // Dense entry point.
    let plain = AttentionOptions::new(64);
    let k = vec![0f32; 4 * 64];
    let kv = DenseKv {
        k: &k,
        v: &k[..128],
        num_kv_heads: 1,
        head_dim: 64,
    };
    assert!(attention_dense(&[0.0; 64], kv, &DecodeShape::new(1, 1), &plain, Accum::F64).is_err());
    let kv = DenseKv {
        k: &k[..100],
        v: &k[..100],
        ..kv
    };
    assert!(attention_dense(&[0.0; 64], kv, &DecodeShape::new(1, 1), &plain, Accum::F64).is_err());
    let kv = DenseKv {
        k: &k,
        v: &k,
        head_dim: 0,
        ..kv
    };
    assert!(attention_dense(&[], kv, &DecodeShape::new(1, 1), &plain, Accum::F64).is_err());
    let kv = DenseKv {
        k: &k,
        v: &k,
        num_kv_heads: 1,
        head_dim: 64,
    };
    assert!(
        attention_dense(
            &[0.0; 64 * 5],
            kv,
            &DecodeShape::new(1, 5),
            &plain,
            Accum::F64
        )
        .is_err()
    );
}

// ---- accuracy of the quantized formats vs unquantized f32 attention ----

/// Format pairs whose accuracy is recorded, with an upper bound on the relative error that
/// holds with a wide margin (the measured numbers are printed).
const ACCURACY: [(KvFormat, KvFormat, f64); 7] = [
    (KvFormat::F16, KvFormat::F16, 5e-3),
    (KvFormat::Bf16, KvFormat::Bf16, 3e-2),
    (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, 0.1),
    (KvFormat::Fp8E5m2, KvFormat::Fp8E5m2, 0.2),
    (KvFormat::Int4Sym32, KvFormat::Int4Affine64, 0.35),
    (KvFormat::Fp8E4m3, KvFormat::Int4Affine64, 0.25),
    (KvFormat::Int4Sym32, KvFormat::Fp8E4m3, 0.35),
];

/// Relative error of attention over K/V quantized with (`kf`, `vf`) vs f32 attention, one
/// sequence of `[len, nkv, d]` data, q `[nq, q_len, d]`.
fn format_error(
    kf: KvFormat,
    vf: KvFormat,
    (k, v): (&[f32], &[f32]),
    q: &[f32],
    nkv: usize,
    d: usize,
    shape: &DecodeShape,
) -> f64 {
    let len = k.len() / (nkv * d);
    let cfg = CacheConfig::new(nkv, d, 16, kf, vf).unwrap();
    let mut alloc = BlockAllocator::new(len.div_ceil(16), 16).unwrap();
    let mut cache = HostCache::new(cfg, len.div_ceil(16)).unwrap();
    cache
        .calibrate_fp8_scales(k, v, ScaleGranularity::PerHead)
        .unwrap();
    let seq = alloc.create_sequence();
    let r = alloc.reserve(seq, len).unwrap();
    cache.write(&r.slots, k, v).unwrap();
    let tables = alloc.block_tables(&[seq]).unwrap();
    let got = decode_attention(
        &cache,
        &tables,
        q,
        shape,
        &AttentionOptions::new(d),
        Accum::F64,
    )
    .unwrap();
    let want = reference(q, k, v, nkv, d, shape);
    rel_err(&got.out, &want)
}

/// Unquantized f32-input attention, accumulated in f64.
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    nkv: usize,
    d: usize,
    shape: &DecodeShape,
) -> Vec<f64> {
    let kv = DenseKv {
        k,
        v,
        num_kv_heads: nkv,
        head_dim: d,
    };
    let r = attention_dense(q, kv, shape, &AttentionOptions::new(d), Accum::F64).unwrap();
    r.out.iter().map(|&x| x as f64).collect()
}

/// Per-tensor uniform INT4 (the ungrouped baseline) applied to a whole tensor.
fn uniform_int4(x: &[f32]) -> Vec<f32> {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = int4::uniform_scale(amax);
    x.iter()
        .map(|&v| int4::dequantize_uniform(int4::quantize_uniform(v, s), s))
        .collect()
}

fn uniform_error(
    k: &[f32],
    v: &[f32],
    q: &[f32],
    nkv: usize,
    d: usize,
    shape: &DecodeShape,
) -> f64 {
    let want = reference(q, k, v, nkv, d, shape);
    let (kq, vq) = (uniform_int4(k), uniform_int4(v));
    let got = reference(q, &kq, &vq, nkv, d, shape);
    let got: Vec<f32> = got.iter().map(|&x| x as f32).collect();
    rel_err(&got, &want)
}

/// f16 tensor `name` of the file as f32.
fn tensor_f32(st: &safetensors::SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F16);
    let data = t
        .data()
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    (data, t.shape().to_vec())
}

/// Real keys/values of MiniLM (6 layers, 512 tokens, 12 heads of 32, paired into 6 heads of
/// 64): attention of the last 32 positions over all 512, per layer and format.
#[test]
fn accuracy_on_minilm() {
    let Some(path) = common::minilm_data("accuracy_on_minilm") else {
        return;
    };
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (nkv, d, q_len) = (6, 64, 32);
    let shape = DecodeShape::new(nkv, q_len);
    println!("rel. error of attention output vs f32 (MiniLM, last {q_len} of 512 positions):");
    println!("{:<22} layer 0..5", "k / v");
    let mut table: Vec<(String, Vec<f64>)> = Vec::new();
    for layer in 0..6 {
        let (q, shape_q) = tensor_f32(&st, &format!("q.{layer}"));
        let (k, _) = tensor_f32(&st, &format!("k.{layer}"));
        let (v, _) = tensor_f32(&st, &format!("v.{layer}"));
        assert_eq!(shape_q, vec![512, 12, 32]);
        // [512, 12, 32] is [512, 6, 64] with adjacent heads paired; q goes to [6, q_len, 64].
        let len = shape_q[0];
        let mut qh = Vec::with_capacity(nkv * q_len * d);
        for h in 0..nkv {
            for t in len - q_len..len {
                qh.extend_from_slice(&q[(t * nkv + h) * d..][..d]);
            }
        }
        for (i, &(kf, vf, bound)) in ACCURACY.iter().enumerate() {
            let e = format_error(kf, vf, (&k, &v), &qh, nkv, d, &shape);
            assert!(e < bound, "layer {layer} {kf}/{vf}: rel err {e} >= {bound}");
            if layer == 0 {
                table.push((format!("{kf} / {vf}"), Vec::new()));
            }
            table[i].1.push(e);
        }
        let e = uniform_error(&k, &v, &qh, nkv, d, &shape);
        if layer == 0 {
            table.push(("int4-uniform (both)".into(), Vec::new()));
        }
        table[ACCURACY.len()].1.push(e);
    }
    for (name, errs) in &table {
        let cols: Vec<String> = errs.iter().map(|e| format!("{e:.2e}")).collect();
        println!("{name:<22} {}", cols.join("  "));
    }
}

/// Synthetic keys with a few strong outlier channels (as in real LLM keys): grouped INT4 keeps
/// the damage inside the outliers' groups, per-tensor uniform INT4 does not.
#[test]
fn accuracy_with_outlier_channels() {
    let (len, nkv, d, nq, q_len) = (1024, 2, 128, 8, 4);
    let mut rng = Rng(2024);
    let mut k = rng.normals(len * nkv * d, 1.0);
    for t in 0..len {
        for h in 0..nkv {
            for (c, mag) in [(5, 15.0), (77, -10.0), (100, 20.0)] {
                k[(t * nkv + h) * d + c] = mag + rng.normal();
            }
        }
    }
    let v = rng.normals(len * nkv * d, 1.0);
    let q = rng.normals(nq * q_len * d, 1.0);
    let shape = DecodeShape::new(nq, q_len);
    println!("rel. error of attention output vs f32 (synthetic keys with outlier channels):");
    // Outliers make the softmax peaky and amplify key error, so only sanity is asserted here
    // (finite, better than no information at all); the numbers are recorded.
    let mut errs = Vec::new();
    for &(kf, vf, _) in &ACCURACY {
        let e = format_error(kf, vf, (&k, &v), &q, nkv, d, &shape);
        println!("{:<22} {e:.3e}", format!("{kf} / {vf}"));
        assert!(e < 1.0, "{kf}/{vf}: rel err {e}");
        errs.push(e);
    }
    assert!(errs[0] < 5e-3, "f16 rel err {}", errs[0]);
    let uniform = uniform_error(&k, &v, &q, nkv, d, &shape);
    println!("{:<22} {uniform:.3e}", "int4-uniform (both)");
    let grouped = errs[4];
    assert!(
        grouped < uniform,
        "grouped int4 ({grouped}) should beat uniform int4 ({uniform}) on outlier keys"
    );
}
