//! The CPU reference prefill (ragged batches, window, soft cap, sinks, ALiBi) against decode and
//! a naive f64 attention over the dequantized cache, and `merge_states` against attention over
//! the union of the keys.

use kvq::cache::{BlockTables, HostCache};
use kvq::cpu::{
    Accum, AttentionOptions, AttentionOutput, DecodeShape, DenseKv, HeadTerms, attention_dense,
    decode_attention, decode_attention_with, merge_states, prefill_attention,
};
use kvq::synth::Synth;
use kvq::{CacheConfig, Error, KvFormat};

const NKV: usize = 2;
const NQ: usize = 4;
const D: usize = 64;
const BS: usize = 16;

/// The format pairs every check runs on: f16 and grouped INT4 (keys by 32, values by 64).
const PAIRS: [(KvFormat, KvFormat); 2] = [
    (KvFormat::F16, KvFormat::F16),
    (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
];

/// A cache holding sequences of `lens` tokens in shuffled blocks, with their tables and
/// dequantized K/V (`[len, NKV, D]` each).
struct Setup {
    cache: HostCache,
    tables: BlockTables,
    dense: Vec<(Vec<f32>, Vec<f32>)>,
}

fn setup(k_format: KvFormat, v_format: KvFormat, lens: &[usize], seed: u64) -> Setup {
    let cfg = CacheConfig::new(NKV, D, BS, k_format, v_format).unwrap();
    let mut rng = Synth::new(seed);
    let num_blocks: usize = lens.iter().map(|l| l.div_ceil(BS)).sum::<usize>() + 1;
    let mut blocks: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut blocks);
    let mut cache = HostCache::new(cfg, num_blocks).unwrap();
    let mut rows = Vec::new();
    let mut next = 0;
    for &len in lens {
        let used = len.div_ceil(BS);
        let table = blocks[next..next + used].to_vec();
        next += used;
        let slots: Vec<usize> = (0..len)
            .map(|p| table[p / BS] as usize * BS + p % BS)
            .collect();
        let k = rng.with_outlier_channels(len, NKV, D, 2, 6.0);
        let v = rng.normal(len * NKV * D, 1.0);
        cache.write(&slots, &k, &v).unwrap();
        rows.push(table);
    }
    let row_refs: Vec<&[i32]> = rows.iter().map(|r| r.as_slice()).collect();
    let tables = BlockTables::from_rows(&row_refs, lens).unwrap();
    let dense = lens
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            let (mut k, mut v) = (vec![0f32; len * NKV * D], vec![0f32; len * NKV * D]);
            cache.gather(tables.row(b), len, &mut k, &mut v).unwrap();
            (k, v)
        })
        .collect();
    Setup {
        cache,
        tables,
        dense,
    }
}

/// Naive f64 attention of `n` query tokens (`q` `[n, NQ, D]`) that are the last `n` of a
/// sequence with dense K/V `[len, NKV, D]`: out `[n, NQ, D]`, lse `[n, NQ]`.
fn naive(
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    opts: &AttentionOptions,
    heads: HeadTerms<'_>,
) -> (Vec<f64>, Vec<f64>) {
    let n = q.len() / (NQ * D);
    let len = k.len() / (NKV * D);
    let mut out = vec![0f64; n * NQ * D];
    let mut lse = vec![0f64; n * NQ];
    for i in 0..n {
        let p = len - n + i;
        let lo = opts.window_left.map_or(0, |w| p.saturating_sub(w));
        for h in 0..NQ {
            let g = h / (NQ / NKV);
            let qr = &q[(i * NQ + h) * D..][..D];
            let logits: Vec<f64> = (lo..=p)
                .map(|t| {
                    let kr = &k[(t * NKV + g) * D..][..D];
                    let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let l = opts.softmax_scale as f64 * dot;
                    let l = opts
                        .logits_soft_cap
                        .map_or(l, |c| c as f64 * (l / c as f64).tanh());
                    l + heads
                        .alibi_slopes
                        .map_or(0.0, |m| m[h] as f64 * (t as f64 - p as f64))
                })
                .collect();
            let sink = heads.sinks.map(|s| s[h] as f64);
            let m = logits
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let denom: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            let o = &mut out[(i * NQ + h) * D..][..D];
            for (t, wt) in (lo..=p).zip(&w) {
                for (o, &x) in o.iter_mut().zip(&v[(t * NKV + g) * D..][..D]) {
                    *o += wt * x as f64;
                }
            }
            o.iter_mut().for_each(|x| *x /= denom);
            lse[i * NQ + h] = m + denom.ln();
        }
    }
    (out, lse)
}

/// Prefill of `tokens[b]` new tokens per sequence, each checked against [`naive`] within
/// f32 rounding of the f64 result.
fn check_prefill(s: &Setup, tokens: &[u32], opts: &AttentionOptions, heads: HeadTerms<'_>) {
    let mut qo = vec![0u32];
    for &n in tokens {
        qo.push(qo.last().unwrap() + n);
    }
    let total = *qo.last().unwrap() as usize;
    let q = Synth::new(total as u64).normal(total * NQ * D, 1.0);
    let r = prefill_attention(&s.cache, &s.tables, &qo, &q, NQ, opts, heads, Accum::F64).unwrap();
    assert_eq!((r.out.len(), r.lse.len()), (total * NQ * D, total * NQ));
    for (b, (k, v)) in s.dense.iter().enumerate() {
        let (t0, t1) = (qo[b] as usize, qo[b + 1] as usize);
        let (want, want_lse) = naive(&q[t0 * NQ * D..t1 * NQ * D], (k, v), opts, heads);
        let got = &r.out[t0 * NQ * D..t1 * NQ * D];
        let scale = want.iter().fold(1e-30, |m: f64, x| m.max(x.abs()));
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 4e-7 * scale,
                "{opts:?} seq {b} elem {i}: {g} vs {w}"
            );
        }
        for (&g, &w) in r.lse[t0 * NQ..t1 * NQ].iter().zip(&want_lse) {
            assert!(
                (g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "lse {g} vs {w}"
            );
        }
    }
}

/// (a) One token per sequence is decode with q_len 1, bit for bit, in both accumulators.
#[test]
fn single_tokens_equal_decode() {
    for (i, (kf, vf)) in PAIRS.into_iter().enumerate() {
        let s = setup(kf, vf, &[1, 17, 40, 5], i as u64);
        let batch = s.tables.batch();
        let q = Synth::new(9).normal(batch * NQ * D, 1.0);
        let qo: Vec<u32> = (0..=batch as u32).collect();
        let shape = DecodeShape::new(NQ, 1);
        let opts = AttentionOptions::new(D);
        for accum in [Accum::F32, Accum::F64] {
            let dec = decode_attention(&s.cache, &s.tables, &q, &shape, &opts, accum).unwrap();
            let pre = prefill_attention(
                &s.cache,
                &s.tables,
                &qo,
                &q,
                NQ,
                &opts,
                HeadTerms::default(),
                accum,
            )
            .unwrap();
            // [batch, NQ, 1, D] and [tokens = batch, NQ, D] are the same order.
            assert_eq!(pre, dec, "{kf}/{vf} {accum:?}");
            let with = decode_attention_with(
                &s.cache,
                &s.tables,
                &q,
                &shape,
                &opts,
                HeadTerms::default(),
                accum,
            )
            .unwrap();
            assert_eq!(with, dec);
        }
    }
}

/// (b) A whole prompt, a chunk after a cached prefix, a single token and an idle sequence in
/// one ragged batch.
#[test]
fn ragged_batch_matches_naive() {
    for (i, (kf, vf)) in PAIRS.into_iter().enumerate() {
        let s = setup(kf, vf, &[37, 50, 9, 20], 10 + i as u64);
        check_prefill(
            &s,
            &[37, 13, 0, 1],
            &AttentionOptions::new(D),
            HeadTerms::default(),
        );
        check_prefill(
            &s,
            &[0, 50, 9, 0],
            &AttentionOptions::new(D),
            HeadTerms::default(),
        );
    }
}

/// (c) Sliding windows (including 0: only the token itself) and the soft cap, alone and
/// together, with a scale large enough that the cap bites.
#[test]
fn window_and_soft_cap_match_naive() {
    let (kf, vf) = PAIRS[1];
    let s = setup(kf, vf, &[45, 30], 20);
    let base = AttentionOptions::new(D);
    for window_left in [None, Some(0), Some(1), Some(7), Some(16), Some(100)] {
        for logits_soft_cap in [None, Some(2.0), Some(30.0)] {
            let opts = AttentionOptions {
                softmax_scale: 0.5,
                window_left,
                logits_soft_cap,
            };
            check_prefill(&s, &[45, 11], &opts, HeadTerms::default());
        }
    }
    check_prefill(
        &s,
        &[20, 30],
        &AttentionOptions {
            window_left: Some(5),
            ..base
        },
        HeadTerms::default(),
    );
    // Window 0: the output is the token's own value row.
    let opts = AttentionOptions {
        window_left: Some(0),
        ..base
    };
    let q = Synth::new(3).normal(75 * NQ * D, 1.0);
    let r = prefill_attention(
        &s.cache,
        &s.tables,
        &[0, 45, 75],
        &q,
        NQ,
        &opts,
        HeadTerms::default(),
        Accum::F64,
    )
    .unwrap();
    let v = &s.dense[1].1;
    for h in 0..NQ {
        let g = h / 2;
        assert_eq!(
            r.out[(74 * NQ + h) * D..][..D],
            v[(29 * NKV + g) * D..][..D]
        );
    }
}

/// A q_len-3 decode's output and lse (head-major [batch, NQ, 3]) against the naive attention of
/// the same rows, token-major, over each sequence's dense K / V.
fn check_decode_q3(
    s: &Setup,
    q: &[f32],
    r: &AttentionOutput,
    opts: &AttentionOptions,
    heads: HeadTerms<'_>,
) {
    for (b, kv) in s.dense.iter().enumerate() {
        // Token-major [3, NQ, D] from head-major [NQ, 3, D].
        let qb = &q[b * NQ * 3 * D..][..NQ * 3 * D];
        let qt: Vec<f32> = (0..3)
            .flat_map(|i| (0..NQ).flat_map(move |h| qb[(h * 3 + i) * D..][..D].to_vec()))
            .collect();
        let (want, want_lse) = naive(&qt, (&kv.0, &kv.1), opts, heads);
        for h in 0..NQ {
            for i in 0..3 {
                let got = &r.out[((b * NQ + h) * 3 + i) * D..][..D];
                for (&g, &w) in got.iter().zip(&want[(i * NQ + h) * D..][..D]) {
                    assert!((g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()));
                }
                let g = r.lse[(b * NQ + h) * 3 + i] as f64;
                assert!((g - want_lse[i * NQ + h]).abs() <= 1e-5);
            }
        }
    }
}

/// (d) Sinks join the denominator only; with decode_attention_with too.
#[test]
fn sinks_match_naive() {
    for (i, (kf, vf)) in PAIRS.into_iter().enumerate() {
        let s = setup(kf, vf, &[25, 33], 30 + i as u64);
        let sinks = [-1.5f32, 0.0, 2.0, 8.0];
        let opts = AttentionOptions::new(D);
        let with_sinks = HeadTerms {
            sinks: Some(&sinks),
            alibi_slopes: None,
        };
        check_prefill(&s, &[25, 6], &opts, with_sinks);
        let capped = AttentionOptions {
            window_left: Some(9),
            logits_soft_cap: Some(5.0),
            ..opts
        };
        check_prefill(&s, &[25, 6], &capped, with_sinks);
        // Decode with options: q_len 3 is the last 3 tokens, head-major.
        let shape = DecodeShape::new(NQ, 3);
        let q = Synth::new(4).normal(2 * NQ * 3 * D, 1.0);
        let r = decode_attention_with(
            &s.cache,
            &s.tables,
            &q,
            &shape,
            &capped,
            HeadTerms {
                sinks: Some(&sinks),
                alibi_slopes: None,
            },
            Accum::F64,
        )
        .unwrap();
        check_decode_q3(&s, &q, &r, &capped, with_sinks);
    }
}

/// (e) Attention over [0, L) is the merge of attention over [0, s) and over [s, L).
#[test]
fn merge_states_equals_attention_over_the_union() {
    let (kf, vf) = PAIRS[1];
    let s = setup(kf, vf, &[50], 40);
    let (k, v) = &s.dense[0];
    let q = Synth::new(5).normal(NQ * D, 1.0);
    let shape = DecodeShape::new(NQ, 1);
    let row = NKV * D;
    let part = |lo: usize, hi: usize| {
        let kv = DenseKv {
            k: &k[lo * row..hi * row],
            v: &v[lo * row..hi * row],
            num_kv_heads: NKV,
            head_dim: D,
        };
        attention_dense(&q, kv, &shape, &AttentionOptions::new(D), Accum::F64).unwrap()
    };
    let full = part(0, 50);
    for split in [1, 16, 33, 49] {
        let (a, b) = (part(0, split), part(split, 50));
        let (out, lse) = merge_states(&a.out, &a.lse, &b.out, &b.lse, D).unwrap();
        let num: f64 = out
            .iter()
            .zip(&full.out)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum();
        let den: f64 = full.out.iter().map(|&y| (y as f64).powi(2)).sum();
        assert!((num / den).sqrt() < 1e-6, "split {split}");
        for (&x, &y) in lse.iter().zip(&full.lse) {
            assert!(
                (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                "split {split}: {x} vs {y}"
            );
        }
    }
    // An empty part (lse -inf) leaves the other unchanged; two empty parts are empty.
    let empty_out = vec![0f32; NQ * D];
    let empty_lse = vec![f32::NEG_INFINITY; NQ];
    let (out, lse) = merge_states(&full.out, &full.lse, &empty_out, &empty_lse, D).unwrap();
    assert_eq!((out, lse), (full.out.clone(), full.lse.clone()));
    let (out, lse) = merge_states(&empty_out, &empty_lse, &empty_out, &empty_lse, D).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    // Shapes and values.
    assert!(matches!(
        merge_states(&full.out, &full.lse, &full.out, &full.lse[1..], D),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        merge_states(&full.out[1..], &full.lse, &full.out, &full.lse, D),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        merge_states(&[], &[], &[], &[], 0),
        Err(Error::Config { .. })
    ));
    let nan_lse = vec![f32::NAN; NQ];
    assert!(matches!(
        merge_states(&full.out, &nan_lse, &full.out, &full.lse, D),
        Err(Error::NonFinite { .. })
    ));
}

/// (f) Bad arguments are typed errors, never panics.
#[test]
fn invalid_inputs_are_errors() {
    let (kf, vf) = PAIRS[1];
    let s = setup(kf, vf, &[10, 20], 50);
    let opts = AttentionOptions::new(D);
    let q = vec![0.5f32; 12 * NQ * D];
    let run = |qo: &[u32], q: &[f32], opts: &AttentionOptions, sinks: Option<&[f32]>| {
        prefill_attention(
            &s.cache,
            &s.tables,
            qo,
            q,
            NQ,
            opts,
            HeadTerms {
                sinks,
                alibi_slopes: None,
            },
            Accum::F64,
        )
    };
    assert!(run(&[0, 10, 12], &q, &opts, None).is_ok());
    // qo_indptr: wrong length, not starting at 0, decreasing, total not matching q.
    assert!(matches!(
        run(&[0, 12], &q, &opts, None),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        run(&[1, 10, 12], &q, &opts, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        run(&[0, 10, 9], &q, &opts, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        run(&[0, 10, 11], &q, &opts, None),
        Err(Error::Length { .. })
    ));
    // More new tokens than context.
    assert!(matches!(
        run(&[0, 11, 12], &q, &opts, None),
        Err(Error::InvalidArgument(_))
    ));
    // Sinks: wrong length, non-finite.
    assert!(matches!(
        run(&[0, 10, 12], &q, &opts, Some(&[0.0; 3])),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        run(&[0, 10, 12], &q, &opts, Some(&[0.0, f32::NAN, 0.0, 0.0])),
        Err(Error::NonFinite { what: "sinks", .. })
    ));
    // ALiBi slopes: wrong length, non-finite.
    let run_alibi = |slopes: &[f32]| {
        prefill_attention(
            &s.cache,
            &s.tables,
            &[0, 10, 12],
            &q,
            NQ,
            &opts,
            HeadTerms {
                sinks: None,
                alibi_slopes: Some(slopes),
            },
            Accum::F64,
        )
    };
    assert!(run_alibi(&[0.5; NQ]).is_ok());
    assert!(matches!(
        run_alibi(&[0.5; NQ + 1]),
        Err(Error::Length { .. })
    ));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            run_alibi(&[0.5, 0.25, bad, 0.125]),
            Err(Error::NonFinite {
                what: "alibi_slopes",
                count: 1
            })
        ));
    }
    // Soft cap, or scale, not positive and finite.
    for cap in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        let bad = AttentionOptions {
            logits_soft_cap: Some(cap),
            ..opts
        };
        assert!(matches!(
            run(&[0, 10, 12], &q, &bad, None),
            Err(Error::InvalidArgument(_))
        ));
    }
    for softmax_scale in [f32::INFINITY, f32::NAN, 0.0, -0.5] {
        let bad = AttentionOptions {
            softmax_scale,
            ..opts
        };
        assert!(matches!(
            run(&[0, 10, 12], &q, &bad, None),
            Err(Error::InvalidArgument(_))
        ));
    }
    // Non-finite q, heads not a multiple of the KV heads, bad block id.
    let mut bad_q = q.clone();
    bad_q[5] = f32::NAN;
    assert!(matches!(
        run(&[0, 10, 12], &bad_q, &opts, None),
        Err(Error::NonFinite { what: "q", .. })
    ));
    assert!(matches!(
        prefill_attention(
            &s.cache,
            &s.tables,
            &[0, 10, 12],
            &q,
            3,
            &opts,
            HeadTerms::default(),
            Accum::F64
        ),
        Err(Error::InvalidArgument(_))
    ));
    let mut tables = s.tables.clone();
    tables.data[0] = 999;
    assert!(matches!(
        prefill_attention(
            &s.cache,
            &tables,
            &[0, 10, 12],
            &q,
            NQ,
            &opts,
            HeadTerms::default(),
            Accum::F64
        ),
        Err(Error::BlockIndex { .. })
    ));
    // decode_attention_with checks the options too.
    let shape = DecodeShape::new(NQ, 1);
    assert!(matches!(
        decode_attention_with(
            &s.cache,
            &s.tables,
            &q[..2 * NQ * D],
            &shape,
            &opts,
            HeadTerms {
                sinks: Some(&[1.0]),
                alibi_slopes: None
            },
            Accum::F64
        ),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        decode_attention_with(
            &s.cache,
            &s.tables,
            &q[..2 * NQ * D],
            &shape,
            &opts,
            HeadTerms {
                sinks: None,
                alibi_slopes: Some(&[0.5, 0.5, f32::NAN, 0.5])
            },
            Accum::F64
        ),
        Err(Error::NonFinite {
            what: "alibi_slopes",
            ..
        })
    ));
    // An empty batch, and sequences with no new tokens, give empty results.
    let none = BlockTables::from_rows(&[], &[]).unwrap();
    let r = prefill_attention(
        &s.cache,
        &none,
        &[0],
        &[],
        NQ,
        &opts,
        HeadTerms::default(),
        Accum::F64,
    )
    .unwrap();
    assert!(r.out.is_empty() && r.lse.is_empty());
    let r = run(&[0, 0, 0], &[], &opts, None).unwrap();
    assert!(r.out.is_empty() && r.lse.is_empty());
}

/// (g) ALiBi by hand: one head, two tokens whose keys give known logits. The query at
/// position 1 sees key 0 at distance 1 (bias -m) and itself (bias 0); the query at position 0
/// sees only itself, whatever the slope. The bias comes after the soft cap.
#[test]
fn alibi_two_tokens_by_hand() {
    let d = 16;
    let cfg = CacheConfig::new(1, d, BS, KvFormat::F16, KvFormat::F16).unwrap();
    let mut cache = HostCache::new(cfg, 1).unwrap();
    // q . k0 = 16 * 0.5 = 8 and q . k1 = 0 (q all ones); v0 all 2, v1 all 6 (exact in f16).
    let k: Vec<f32> = [vec![0.5f32; d], vec![0.0; d]].concat();
    let v: Vec<f32> = [vec![2.0f32; d], vec![6.0; d]].concat();
    cache.write(&[0, 1], &k, &v).unwrap();
    let tables = BlockTables::from_rows(&[&[0]], &[2]).unwrap();
    let q = vec![1.0f32; 2 * d];
    let m = 0.75f32;
    for cap in [None, Some(1.5f32)] {
        let opts = AttentionOptions {
            softmax_scale: 0.25, // logit of key 0: 2, then capped: 1.5 tanh(2 / 1.5)
            window_left: None,
            logits_soft_cap: cap,
        };
        let l0 = cap.map_or(2.0, |c| c as f64 * (2.0 / c as f64).tanh());
        let l0 = l0 - m as f64; // position 0 from position 1
        let (w0, w1) = (l0.exp(), 1.0f64); // key 1: logit 0, bias 0
        let want = (2.0 * w0 + 6.0 * w1) / (w0 + w1);
        let want_lse = (w0 + w1).ln();
        // Prefill of both tokens (token-major [2, 1, d]).
        let r = prefill_attention(
            &cache,
            &tables,
            &[0, 2],
            &q,
            1,
            &opts,
            HeadTerms {
                sinks: None,
                alibi_slopes: Some(&[m]),
            },
            Accum::F64,
        )
        .unwrap();
        assert!(r.out[..d].iter().all(|&x| x == 2.0), "{cap:?}");
        let own = cap.map_or(2.0, |c| c as f64 * (2.0 / c as f64).tanh()); // bias 0
        assert!((r.lse[0] as f64 - own).abs() <= 1e-6);
        for &x in &r.out[d..] {
            assert!((x as f64 - want).abs() <= 1e-6, "{cap:?}: {x} vs {want}");
        }
        assert!((r.lse[1] as f64 - want_lse).abs() <= 1e-6);
        // Decode of the last token: the same row.
        let shape = DecodeShape::new(1, 1);
        let dec = decode_attention_with(
            &cache,
            &tables,
            &q[d..],
            &shape,
            &opts,
            HeadTerms {
                sinks: None,
                alibi_slopes: Some(&[m]),
            },
            Accum::F64,
        )
        .unwrap();
        assert_eq!(dec.out, r.out[d..]);
        assert_eq!(dec.lse, r.lse[1..]);
    }
}

/// (h) ALiBi against the naive attention: the standard geometric slopes and larger ones, alone
/// and with a window, a soft cap and sinks, in ragged prefill and in decode (q_len 3); slopes
/// of 0 equal no slopes, bit for bit.
#[test]
fn alibi_matches_naive_and_zero_slopes_are_none() {
    // 2^(-8 (h + 1) / NQ): 1/4, 1/16, 1/64, 1/256.
    let geometric: Vec<f32> = (0..NQ)
        .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / NQ as f32))
        .collect();
    let large = [1.0f32, 2.5, 0.5, 8.0];
    let sinks = [-1.5f32, 0.0, 2.0, 8.0];
    for (i, (kf, vf)) in PAIRS.into_iter().enumerate() {
        let s = setup(kf, vf, &[45, 30, 12], 60 + i as u64);
        let base = AttentionOptions::new(D);
        let options = [
            base,
            AttentionOptions {
                window_left: Some(9),
                logits_soft_cap: Some(5.0),
                ..base
            },
        ];
        for opts in options {
            for slopes in [&geometric[..], &large[..]] {
                for sinks in [None, Some(&sinks[..])] {
                    let heads = HeadTerms {
                        sinks,
                        alibi_slopes: Some(slopes),
                    };
                    check_prefill(&s, &[45, 11, 1], &opts, heads);
                    check_prefill(&s, &[0, 30, 12], &opts, heads);
                }
            }
        }
        // Decode with q_len 3, head-major, against the naive token-major rows.
        let capped = options[1];
        let shape = DecodeShape::new(NQ, 3);
        let q = Synth::new(6).normal(3 * NQ * 3 * D, 1.0);
        let heads = HeadTerms {
            sinks: Some(&sinks),
            alibi_slopes: Some(&large),
        };
        let r = decode_attention_with(&s.cache, &s.tables, &q, &shape, &capped, heads, Accum::F64)
            .unwrap();
        check_decode_q3(&s, &q, &r, &capped, heads);
        // Slopes of 0 are no slopes, in both accumulators.
        let zeros = [0.0f32; NQ];
        let qo = [0u32, 45, 56, 57];
        let qp = Synth::new(7).normal(57 * NQ * D, 1.0);
        for accum in [Accum::F32, Accum::F64] {
            for opts in options {
                let pre = |alibi| {
                    prefill_attention(
                        &s.cache,
                        &s.tables,
                        &qo,
                        &qp,
                        NQ,
                        &opts,
                        HeadTerms {
                            sinks: Some(&sinks),
                            alibi_slopes: alibi,
                        },
                        accum,
                    )
                    .unwrap()
                };
                assert_eq!(pre(Some(&zeros)), pre(None), "{kf}/{vf} {accum:?}");
                let dec = |alibi| {
                    decode_attention_with(
                        &s.cache,
                        &s.tables,
                        &q,
                        &shape,
                        &opts,
                        HeadTerms {
                            sinks: None,
                            alibi_slopes: alibi,
                        },
                        accum,
                    )
                    .unwrap()
                };
                assert_eq!(dec(Some(&zeros)), dec(None), "{kf}/{vf} {accum:?}");
            }
        }
    }
}
