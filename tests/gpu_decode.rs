//! The fused paged decode kernels against the CPU reference (`kvq::cpu::decode_attention`, f64)
//! on the same quantized cache: every supported K x V format pair, head_dim 64/128/256, block
//! sizes 16/32/64, GQA groups 1..16 (6 included), q_len 1..8 (causal), mixed lengths in a batch,
//! block- and split-boundary lengths (int4-kc: sealed blocks and the open window on either side
//! of a split), a 128k context, forced split counts, windows, soft caps, sinks and ALiBi slopes,
//! and real MiniLM K/V.
//!
//! Each case: relative error ‖e‖ / ‖ref‖ ≤ 2e-3 over the whole output, where e is |out − ref|
//! beyond half an ulp of the output type (rounding the result to f16 / bf16 is not kernel
//! error), no row worse than 1e-2, `lse` within 1e-3 (5e-3 for INT4 keys, whose scale times
//! the query is rounded to f16), plus 10 % of that per unit of |lse|, of the CPU's, and every output
//! element written (outputs are poisoned with NaN first). Inputs are fresh random draws each
//! run; the seed is printed and `KVQ_SEED=<n>` replays it.
//!
//! `KVQ_DECODE_QUICK=1` shrinks the suite (for compute-sanitizer runs). Without a GPU the tests
//! print `SKIPPED`; with `KVQ_REQUIRE_GPU=1` they fail instead.
#![cfg(feature = "cuda")]

mod common;

use common::{Rng, fresh_rng as rng};
use cudarc::driver::DevicePtr;
use half::{bf16, f16};
use kvq::cache::{BlockTables, HostCache};
use kvq::cpu::{Accum, AttentionOptions, DecodeShape, HeadTerms, decode_attention_with};
use kvq::cuda::decode::{
    DecodeCapacity, DecodeElement, DecodePlan, DecodeStep, DecodeWorkspace, DeviceBlockTables,
    HEAD_DIMS, RowStrides, WARPS, kernel_available, kernel_available_for,
};
use kvq::cuda::{DeviceCache, Gpu, require_gpu_or_skip};
use kvq::{CacheConfig, Error, KvFormat, ScaleGranularity};

const REL_TOL: f64 = 2e-3;
const ROW_TOL: f64 = 1e-2;

// ---- small utilities ------------------------------------------------------------------------

fn quick() -> bool {
    std::env::var("KVQ_DECODE_QUICK").is_ok_and(|v| v == "1")
}

/// Query / output element types, with the conversions the tests need.
trait QElem: DecodeElement {
    fn from_f32(x: f32) -> Self;
    fn nan() -> Self;
    /// Half a unit in the last place of `x` in this type: the rounding of the result to the
    /// output type, which is not kernel error.
    fn half_ulp(x: f32) -> f64;
}
impl QElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn nan() -> Self {
        f16::NAN
    }
    fn half_ulp(x: f32) -> f64 {
        common::half_ulp_f16(x)
    }
}
impl QElem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn nan() -> Self {
        bf16::NAN
    }
    fn half_ulp(x: f32) -> f64 {
        common::half_ulp_bf16(x)
    }
}

// ---- one decode case --------------------------------------------------------------------------

/// K and V of one sequence, `[len, num_kv_heads, head_dim]` f32.
struct SeqKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

#[derive(Debug, Clone)]
struct Case {
    k: KvFormat,
    v: KvFormat,
    head_dim: usize,
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    q_len: usize,
    lens: Vec<usize>,
    q_bf16: bool,
    /// FP8 scales per KV head (else one per tensor).
    per_head: bool,
    /// Forced split count (else the plan's choice).
    splits: Option<usize>,
    /// Forced (warps per block, copy stages per warp) (else the plan's choice).
    launch: Option<(usize, usize)>,
    /// Sliding window, logits soft cap, per-head sinks.
    window: Option<usize>,
    cap: Option<f32>,
    sinks: bool,
    /// ALiBi slopes: this factor times the standard geometric series ([`alibi_slopes`]).
    alibi: Option<f32>,
}

/// ALiBi's slopes for `heads` query heads, `factor * 2^(-8 (h + 1) / heads)` (the standard
/// series at factor 1).
fn alibi_slopes(heads: usize, factor: f32) -> Vec<f32> {
    (0..heads)
        .map(|h| factor * 2f32.powf(-8.0 * (h + 1) as f32 / heads as f32))
        .collect()
}

impl Case {
    fn new(k: KvFormat, v: KvFormat, head_dim: usize, lens: Vec<usize>) -> Case {
        Case {
            k,
            v,
            head_dim,
            block_size: 16,
            num_kv_heads: 2,
            group: 4,
            q_len: 1,
            lens,
            q_bf16: k == KvFormat::Bf16,
            per_head: true,
            splits: None,
            launch: None,
            window: None,
            cap: None,
            sinks: false,
            alibi: None,
        }
    }
    fn name(&self) -> String {
        format!(
            "{}/{} d{} bs{} kv{} G{} q_len{} {} lens{:?} splits{:?} launch{:?} window{:?} cap{:?} \
             sinks{} alibi{:?}",
            self.k,
            self.v,
            self.head_dim,
            self.block_size,
            self.num_kv_heads,
            self.group,
            self.q_len,
            if self.q_bf16 { "bf16" } else { "f16" },
            if self.lens.len() > 6 {
                self.lens[..6].to_vec()
            } else {
                self.lens.clone()
            },
            self.splits,
            self.launch,
            self.window,
            self.cap,
            self.sinks,
            self.alibi
        )
    }
}

/// Random K/V for a sequence: normal values, keys with a few strong outlier channels (as real
/// keys have), values with a per-channel offset (so affine INT4 zeros matter).
fn random_kv(rng: &mut Rng, len: usize, heads: usize, d: usize) -> SeqKv {
    let outlier: Vec<f32> = (0..d)
        .map(|_| if rng.below(16) == 0 { 8.0 } else { 1.0 })
        .collect();
    let offset: Vec<f32> = (0..d).map(|_| rng.normal() * 0.5).collect();
    let n = len * heads * d;
    let k = (0..n).map(|i| rng.normal() * outlier[i % d]).collect();
    let v = (0..n).map(|i| rng.normal() + offset[i % d]).collect();
    SeqKv { k, v }
}

/// What a case measured.
#[derive(Debug)]
struct Outcome {
    rel: f64,
    worst_row: f64,
    worst_lse: f64,
    splits: usize,
}

/// Build the cache for `seqs`, run GPU and CPU, compare. `q` is `[batch, heads, q_len, d]`.
fn run_case(gpu: &Gpu, case: &Case, seqs: &[SeqKv], q: &[f32]) -> Outcome {
    if case.q_bf16 {
        run_typed::<bf16>(gpu, case, seqs, q)
    } else {
        run_typed::<f16>(gpu, case, seqs, q)
    }
}

fn run_typed<T: QElem>(gpu: &Gpu, case: &Case, seqs: &[SeqKv], q: &[f32]) -> Outcome {
    let name = case.name();
    let (d, bs, nkv) = (case.head_dim, case.block_size, case.num_kv_heads);
    let config = CacheConfig::new(nkv, d, bs, case.k, case.v).expect("config");
    // Blocks of all sequences, shuffled over a pool with spare blocks, so pages are scattered.
    let used: Vec<usize> = case.lens.iter().map(|l| l.div_ceil(bs)).collect();
    let num_blocks = used.iter().sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    let mut shuffle = Rng(num_blocks as u64 * 7919 + case.lens[0] as u64);
    for i in (1..ids.len()).rev() {
        ids.swap(i, shuffle.below(i + 1));
    }
    let mut rows: Vec<Vec<i32>> = Vec::new();
    let mut next = 0;
    for &u in &used {
        rows.push(ids[next..next + u].to_vec());
        next += u;
    }
    let mut host = HostCache::new(config, num_blocks).expect("host cache");
    if case.k.has_head_scale() || case.v.has_head_scale() {
        let all_k: Vec<f32> = seqs.iter().flat_map(|s| s.k.iter().copied()).collect();
        let all_v: Vec<f32> = seqs.iter().flat_map(|s| s.v.iter().copied()).collect();
        let g = if case.per_head {
            ScaleGranularity::PerHead
        } else {
            ScaleGranularity::PerTensor
        };
        host.calibrate_fp8_scales(&all_k, &all_v, g)
            .expect("calibrate");
    }
    for ((s, row), &len) in seqs.iter().zip(&rows).zip(&case.lens) {
        let slots: Vec<usize> = (0..len)
            .map(|t| row[t / bs] as usize * bs + t % bs)
            .collect();
        host.write(&slots, &s.k, &s.v).expect("write");
    }
    let row_refs: Vec<&[i32]> = rows.iter().map(|r| r.as_slice()).collect();
    let tables = BlockTables::from_rows(&row_refs, &case.lens).expect("tables");
    let heads = nkv * case.group;
    let shape = DecodeShape::new(heads, case.q_len);
    // The reference sees exactly the queries the GPU sees (rounded to T).
    let q_t: Vec<T> = q.iter().map(|&x| T::from_f32(x)).collect();
    let q_ref: Vec<f32> = q_t.iter().map(|x| x.to_f32()).collect();
    let opts = AttentionOptions {
        window_left: case.window,
        logits_soft_cap: case.cap,
        ..AttentionOptions::new(d)
    };
    // Sinks of about the size of the rows' logits, different per head.
    let sinks: Option<Vec<f32>> = case.sinks.then(|| {
        (0..heads)
            .map(|h| 1.0 + 2.0 * (h as f32 * 0.37).sin())
            .collect()
    });
    let slopes = case.alibi.map(|f| alibi_slopes(heads, f));
    let want = decode_attention_with(
        &host,
        &tables,
        &q_ref,
        &shape,
        &opts,
        HeadTerms {
            sinks: sinks.as_deref(),
            alibi_slopes: slopes.as_deref(),
        },
        Accum::F64,
    )
    .expect("cpu");

    let dcache = DeviceCache::from_host(gpu, &host).expect("device cache");
    let dtables = DeviceBlockTables::new(&dcache, &tables).expect("device tables");
    let max_len = *case.lens.iter().max().unwrap();
    let mut plan = DecodePlan::new(
        gpu,
        dcache.layout(),
        DecodeCapacity {
            max_batch: case.lens.len(),
            num_q_heads: heads,
            max_q_len: case.q_len,
            max_context_len: max_len,
        },
    )
    .and_then(|p| p.with_window_left(case.window))
    .and_then(|p| p.with_logits_soft_cap(case.cap))
    .unwrap_or_else(|e| panic!("{name}: plan: {e}"));
    if let Some(s) = case.splits {
        plan = plan.with_num_splits(s);
    }
    if let Some((w, n)) = case.launch {
        // A launch shape that does not fit is an error, not a wrong answer: skip it then.
        match plan.clone().with_launch(w, n) {
            Ok(p) => plan = p,
            Err(Error::Unsupported(_)) => {}
            Err(e) => panic!("{name}: with_launch: {e}"),
        }
    }
    let mut ws = DecodeWorkspace::new(&plan).expect("workspace");
    let s = gpu.stream();
    let q_dev = s.clone_htod(&q_t).expect("upload q");
    let mut out_dev = s.clone_htod(&vec![T::nan(); q.len()]).expect("out");
    let mut lse_dev = s.clone_htod(&vec![f32::NAN; want.lse.len()]).expect("lse");
    let sinks_dev = sinks.as_ref().map(|x| s.clone_htod(x).expect("sinks"));
    let slopes_dev = slopes.as_ref().map(|x| s.clone_htod(x).expect("slopes"));
    let rows = RowStrides::batch_head_token(heads, case.q_len, d);
    plan.decode_step(
        &mut ws,
        &dcache,
        &dtables,
        DecodeStep {
            q_len: case.q_len,
            q: &q_dev,
            q_rows: rows,
            out: &mut out_dev,
            out_rows: rows,
            lse: Some((
                &mut lse_dev,
                RowStrides::batch_head_token(heads, case.q_len, 1),
            )),
            sinks: sinks_dev.as_ref().map(|x| x as &dyn DevicePtr<f32>),
            alibi_slopes: slopes_dev.as_ref().map(|x| x as &dyn DevicePtr<f32>),
        },
    )
    .unwrap_or_else(|e| panic!("{name}: decode failed: {e}"));
    let out: Vec<f32> = s
        .clone_dtoh(&out_dev)
        .expect("download")
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let lse = s.clone_dtoh(&lse_dev).expect("download lse");
    gpu.synchronize().expect("sync");

    let unwritten = out.iter().filter(|x| !x.is_finite()).count();
    assert_eq!(
        unwritten, 0,
        "{name}: {unwritten} output elements not written (or NaN)"
    );
    let (mut num, mut den, mut worst_row) = (0f64, 0f64, 0f64);
    for (o_row, w_row) in out.chunks(d).zip(want.out.chunks(d)) {
        let (mut rn, mut rd) = (0f64, 0f64);
        for (&o, &w) in o_row.iter().zip(w_row) {
            let e = ((o as f64 - w as f64).abs() - T::half_ulp(w)).max(0.0);
            rn += e * e;
            rd += (w as f64) * (w as f64);
        }
        num += rn;
        den += rd;
        if rd > 0.0 {
            worst_row = worst_row.max((rn / rd).sqrt());
        }
    }
    let rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    // INT4 keys are dequantized to f16 (FORMATS.md allows it): q * s rounds to 11 bits, which
    // moves logits by ~1e-3 when keys carry outlier channels. Other key formats are exact.
    // A soft cap's tanh is the hardware approximation (2^-11 relative): up to cap * 2^-11.
    let lse_tol = if matches!(case.k, KvFormat::Int4Sym32 | KvFormat::Int4Kc) || case.cap.is_some()
    {
        5e-3
    } else {
        1e-3
    };
    let mut worst_lse = 0f64;
    for (i, (&g, &w)) in lse.iter().zip(&want.lse).enumerate() {
        assert!(g.is_finite(), "{name}: lse[{i}] = {g} (want {w})");
        let err = (g as f64 - w as f64).abs();
        assert!(
            err <= lse_tol * (1.0 + 0.1 * (w as f64).abs()),
            "{name}: lse[{i}] = {g}, want {w}"
        );
        worst_lse = worst_lse.max(err);
    }
    assert!(
        rel <= REL_TOL,
        "{name}: relative error {rel:.3e} > {REL_TOL:e}"
    );
    assert!(
        worst_row <= ROW_TOL,
        "{name}: worst row error {worst_row:.3e}"
    );
    Outcome {
        rel,
        worst_row,
        worst_lse,
        splits: plan.num_splits(),
    }
}

/// Draw the data of `case` and run it.
fn check(gpu: &Gpu, rng: &mut Rng, case: &Case) -> Outcome {
    let seqs: Vec<SeqKv> = case
        .lens
        .iter()
        .map(|&l| random_kv(rng, l, case.num_kv_heads, case.head_dim))
        .collect();
    let heads = case.num_kv_heads * case.group;
    let n = case.lens.len() * heads * case.q_len * case.head_dim;
    let q: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let o = run_case(gpu, case, &seqs, &q);
    eprintln!(
        "  {:<70} rel {:.2e} row {:.2e} lse {:.1e} splits {}",
        case.name(),
        o.rel,
        o.worst_row,
        o.worst_lse,
        o.splits
    );
    o
}

/// Every (K, V) pair with a kernel.
fn pairs() -> Vec<(KvFormat, KvFormat)> {
    let mut v = Vec::new();
    for k in KvFormat::ALL {
        for vv in KvFormat::ALL {
            if kernel_available(k, vv) {
                v.push((k, vv));
            }
        }
    }
    v
}

// ---- tests ------------------------------------------------------------------------------------

#[test]
fn every_format_pair() {
    let Some(gpu) = require_gpu_or_skip("every_format_pair") else {
        return;
    };
    let mut rng = rng("every_format_pair");
    let all = pairs();
    assert_eq!(
        all.len(),
        43,
        "6 x 6 freely mixed formats + e5m2 + int4-kc keys with the 6 mixed value formats"
    );
    for (k, v) in all {
        let lens = vec![1 + rng.below(40), 16 + rng.below(3), 200 + rng.below(600)];
        let mut c = Case::new(k, v, 128, lens);
        c.q_bf16 = k == KvFormat::Bf16 || rng.below(2) == 0;
        c.per_head = rng.below(2) == 0;
        check(&gpu, &mut rng, &c);
    }
}

/// Every pair at every warp count per block that fits (`WARPS`: 4 to 16), split so that each
/// warp of the largest blocks gets several steps and one gets a partial one.
#[test]
fn every_warp_count() {
    let Some(gpu) = require_gpu_or_skip("every_warp_count") else {
        return;
    };
    let mut rng = rng("every_warp_count");
    for (k, v) in pairs() {
        for w in WARPS {
            let lens = vec![3 + rng.below(30), 1500 + rng.below(600)];
            let mut c = Case::new(k, v, 128, lens);
            c.q_bf16 = k == KvFormat::Bf16 || rng.below(2) == 0;
            c.group = rng.pick(&[1, 4, 6]);
            c.splits = Some(1 + rng.below(3));
            c.launch = Some((w, 2 + rng.below(3)));
            check(&gpu, &mut rng, &c);
        }
    }
}

/// Every pair at every head_dim it has a kernel for (80, 96, 112 and 192 included: rows whose
/// per-lane chunks take 8-, 4- or 2-byte loads, odd k-step and INT4 group counts).
#[test]
fn every_head_dim() {
    let Some(gpu) = require_gpu_or_skip("every_head_dim") else {
        return;
    };
    let mut rng = rng("every_head_dim");
    for (k, v) in pairs() {
        for d in HEAD_DIMS {
            if !kernel_available_for(k, v, d) || (quick() && rng.below(4) != 0) {
                continue;
            }
            let lens = vec![2 + rng.below(40), 100 + rng.below(700)];
            let mut c = Case::new(k, v, d, lens);
            c.q_bf16 = k == KvFormat::Bf16 || rng.below(2) == 0;
            c.group = rng.pick(&[1, 4, 6]);
            c.q_len = 1 + rng.below(2);
            c.splits = if rng.below(2) == 0 { Some(3) } else { None };
            check(&gpu, &mut rng, &c);
        }
    }
}

#[test]
fn random_shapes_from_the_grid() {
    let Some(gpu) = require_gpu_or_skip("random_shapes_from_the_grid") else {
        return;
    };
    let mut rng = rng("random_shapes_from_the_grid");
    let all = pairs();
    let n = if quick() { 4 } else { 48 };
    for _ in 0..n {
        let (k, v) = rng.pick(&all);
        let dims: Vec<usize> = HEAD_DIMS
            .iter()
            .copied()
            .filter(|&d| kernel_available_for(k, v, d))
            .collect();
        let d = rng.pick(&dims);
        let bs = rng.pick(&[16, 32, 64]);
        let batch = 1 + rng.below(4);
        let lens: Vec<usize> = (0..batch)
            .map(|_| match rng.below(4) {
                0 => 1 + rng.below(8),
                1 => bs * (1 + rng.below(4)) + rng.below(3) - 1,
                _ => 8 + rng.below(if quick() { 300 } else { 1500 }),
            })
            .collect();
        let mut c = Case::new(k, v, d, lens);
        c.block_size = bs;
        c.num_kv_heads = 1 + rng.below(3);
        c.group = rng.pick(&[1, 2, 3, 4, 6, 8, 16]);
        c.q_len = if rng.below(3) == 0 {
            1 + rng.below(8)
        } else {
            1
        };
        let min_len = *c.lens.iter().min().unwrap();
        c.q_len = c.q_len.min(min_len);
        c.q_bf16 = k == KvFormat::Bf16 || rng.below(2) == 0;
        c.per_head = rng.below(2) == 0;
        c.splits = if rng.below(2) == 0 {
            Some(1 + rng.below(9))
        } else {
            None
        };
        c.launch = if rng.below(2) == 0 {
            Some((rng.pick(&WARPS), 2 + rng.below(7)))
        } else {
            None
        };
        check(&gpu, &mut rng, &c);
    }
}

#[test]
fn block_and_split_boundary_lengths() {
    let Some(gpu) = require_gpu_or_skip("block_and_split_boundary_lengths") else {
        return;
    };
    let mut rng = rng("block_and_split_boundary_lengths");
    for bs in [16, 32, 64] {
        let lens = vec![
            1,
            bs - 1,
            bs,
            bs + 1,
            2 * bs - 1,
            2 * bs,
            2 * bs + 1,
            255,
            256,
            257,
        ];
        for (k, v) in [
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::Int8Pth, KvFormat::Int8Pth),
            (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
            (KvFormat::Int4Kc, KvFormat::Int4Affine64),
            (KvFormat::Int4Kc, KvFormat::F16),
        ] {
            for splits in [None, Some(2), Some(7)] {
                let mut c = Case::new(k, v, 128, lens.clone());
                c.block_size = bs;
                c.splits = splits;
                check(&gpu, &mut rng, &c);
            }
        }
    }
}

#[test]
fn speculative_q_len_is_causal() {
    let Some(gpu) = require_gpu_or_skip("speculative_q_len_is_causal") else {
        return;
    };
    let mut rng = rng("speculative_q_len_is_causal");
    // G * q_len from 2 to 128 rows: one to sixteen 8-row query tiles per KV head.
    for (group, q_len) in [(1, 2), (4, 3), (6, 4), (8, 8), (16, 8), (3, 7)] {
        for (k, v) in [
            (KvFormat::Int4Sym32, KvFormat::Fp8E4m3),
            (KvFormat::Bf16, KvFormat::Bf16),
            (KvFormat::Int8Pth, KvFormat::Int4Affine64),
            (KvFormat::Fp4E2m1, KvFormat::Int8Pth),
            (KvFormat::Int4Kc, KvFormat::Bf16),
        ] {
            let mut c = Case::new(k, v, 64, vec![q_len, 40 + rng.below(100), 600]);
            c.group = group;
            c.q_len = q_len;
            c.splits = Some(1 + rng.below(3));
            check(&gpu, &mut rng, &c);
        }
    }
}

#[test]
fn long_context_with_split_kv() {
    let Some(gpu) = require_gpu_or_skip("long_context_with_split_kv") else {
        return;
    };
    let mut rng = rng("long_context_with_split_kv");
    let long = if quick() { 4096 + 7 } else { 131_072 + 7 };
    for (k, v) in [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Bf16, KvFormat::Bf16),
        (KvFormat::Int8Pth, KvFormat::Int8Pth),
        (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
        (KvFormat::Int4Kc, KvFormat::Int4Affine64),
    ] {
        let mut c = Case::new(k, v, 128, vec![long, 1000 + rng.below(1000)]);
        c.num_kv_heads = 1;
        let o = check(&gpu, &mut rng, &c);
        assert!(
            o.splits > 1,
            "a 2-sequence batch of {long} tokens should be split"
        );
    }
}

#[test]
fn split_count_does_not_change_the_result() {
    let Some(gpu) = require_gpu_or_skip("split_count_does_not_change_the_result") else {
        return;
    };
    let mut rng = rng("split_count_does_not_change_the_result");
    let c = Case::new(
        KvFormat::Fp8E4m3,
        KvFormat::Int4Affine64,
        128,
        vec![3000, 1777],
    );
    let seqs: Vec<SeqKv> = c
        .lens
        .iter()
        .map(|&l| random_kv(&mut rng, l, 2, 128))
        .collect();
    let q: Vec<f32> = (0..2 * 8 * 128).map(|_| rng.normal()).collect();
    let mut errs = Vec::new();
    for splits in [1, 2, 5, 40, 93] {
        let mut c = c.clone();
        c.splits = Some(splits);
        errs.push(run_case(&gpu, &c, &seqs, &q).rel);
    }
    let errs: Vec<String> = errs.iter().map(|e| format!("{e:.2e}")).collect();
    eprintln!(
        "  errors by split count 1, 2, 5, 40, 187: {}",
        errs.join(" ")
    );
}

/// INT8 rows whose scales span ten decades, in either order along the sequence: the kernel
/// rescales P by the largest V scale seen so far (f16's range), and the scores by each key
/// row's scale, so tiny and huge rows must both come out right, with mixed formats too.
#[test]
fn int8_row_scales_over_ten_decades() {
    let Some(gpu) = require_gpu_or_skip("int8_row_scales_over_ten_decades") else {
        return;
    };
    let mut rng = rng("int8_row_scales_over_ten_decades");
    for (k, v) in [
        (KvFormat::Int8Pth, KvFormat::Int8Pth),
        (KvFormat::Bf16, KvFormat::Int8Pth),
        (KvFormat::Int8Pth, KvFormat::Fp8E4m3),
    ] {
        for rising in [true, false] {
            let c = Case::new(k, v, 128, vec![700, 1 + rng.below(60), 333]);
            let seqs: Vec<SeqKv> = c
                .lens
                .iter()
                .map(|&l| {
                    let mut s = random_kv(&mut rng, l, c.num_kv_heads, c.head_dim);
                    let row = c.num_kv_heads * c.head_dim;
                    for (t, (kr, vr)) in s.k.chunks_mut(row).zip(s.v.chunks_mut(row)).enumerate() {
                        // 10^-6 .. 10^4 across the sequence (values), 10^-3 .. 10^1 (keys, so
                        // that scores stay in a range where softmax sees them all).
                        let x = t as f32 / l.max(2) as f32;
                        let x = if rising { x } else { 1.0 - x };
                        let (fv, fk) = (10f32.powf(-6.0 + 10.0 * x), 10f32.powf(-3.0 + 4.0 * x));
                        vr.iter_mut().for_each(|e| *e *= fv);
                        kr.iter_mut().for_each(|e| *e *= fk);
                    }
                    s
                })
                .collect();
            let n = c.lens.len() * c.num_kv_heads * c.group * c.head_dim;
            let q: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let o = run_case(&gpu, &c, &seqs, &q);
            eprintln!(
                "  {:<70} rising {rising} rel {:.2e} row {:.2e}",
                c.name(),
                o.rel,
                o.worst_row
            );
        }
    }
}

/// Sliding windows (none, 0, shorter and longer than the contexts), logits soft caps and
/// per-head sinks, with and without key splits (the sink joins once, in the merge), against
/// the CPU's `decode_attention_with`.
#[test]
fn windows_caps_and_sinks() {
    let Some(gpu) = require_gpu_or_skip("windows_caps_and_sinks") else {
        return;
    };
    let mut rng = rng("windows_caps_and_sinks");
    for (k, v) in OPTION_PAIRS {
        for (window, cap, sinks, splits) in [
            (Some(100), None, false, None),
            (Some(0), Some(5.0), true, Some(4)),
            (None, Some(8.0), false, Some(3)),
            (Some(17), None, true, None),
            (Some(5000), None, true, Some(7)),
            (Some(300), Some(5.0), true, Some(2)),
        ] {
            let c = option_case(&mut rng, k, v, window, cap, sinks, splits);
            check(&gpu, &mut rng, &c);
        }
    }
}

/// The format pairs the option tests run: 16-bit, FP8, INT4 (row groups and per-channel keys),
/// INT8 keys with FP4 values.
const OPTION_PAIRS: [(KvFormat, KvFormat); 6] = [
    (KvFormat::F16, KvFormat::F16),
    (KvFormat::Bf16, KvFormat::Bf16),
    (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
    (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    (KvFormat::Int4Kc, KvFormat::Int4Affine64),
    (KvFormat::Int8Pth, KvFormat::Fp4E2m1),
];

/// A case of three sequences (short, a few hundred tokens, about two thousand) at head_dim 128
/// with random q type, q_len 1-3, group and block size, and the given options.
fn option_case(
    rng: &mut Rng,
    k: KvFormat,
    v: KvFormat,
    window: Option<usize>,
    cap: Option<f32>,
    sinks: bool,
    splits: Option<usize>,
) -> Case {
    let lens = vec![
        3 + rng.below(30),
        300 + rng.below(100),
        1500 + rng.below(600),
    ];
    let mut c = Case::new(k, v, 128, lens);
    c.q_bf16 = k == KvFormat::Bf16 || rng.below(2) == 0;
    c.q_len = 1 + rng.below(3);
    c.group = rng.pick(&[1, 4, 6]);
    c.block_size = rng.pick(&[16, 32, 64]);
    c.window = window;
    c.cap = cap;
    c.sinks = sinks;
    c.splits = splits;
    c
}

/// ALiBi slopes (the standard geometric series and 4 or 16 times it), alone and with a window,
/// a soft cap and sinks, over six format pairs, 1-7 splits, q_len 1-3, GQA groups 1, 4, 6:
/// every step takes the masked path, which adds the bias.
#[test]
fn alibi_slopes_with_windows_caps_and_sinks() {
    let Some(gpu) = require_gpu_or_skip("alibi_slopes_with_windows_caps_and_sinks") else {
        return;
    };
    let mut rng = rng("alibi_slopes_with_windows_caps_and_sinks");
    for (k, v) in OPTION_PAIRS {
        for (alibi, window, cap, sinks, splits) in [
            (1.0, None, None, false, None),
            (16.0, None, None, false, Some(5)),
            (1.0, Some(100), Some(5.0), true, Some(3)),
            (4.0, Some(17), None, true, Some(7)),
            (16.0, None, Some(8.0), true, Some(1)),
            (1.0, Some(300), None, false, Some(2)),
        ] {
            let mut c = option_case(&mut rng, k, v, window, cap, sinks, splits);
            c.alibi = Some(alibi);
            check(&gpu, &mut rng, &c);
        }
    }
}

/// int4-kc keys whose channels span four decades, channels constant over a block (s = 0),
/// channels offset far from zero (z carries most of each score) and, with f16 values, a channel
/// spanning 40,000 (s > 2047: the kernel's scaled path for such blocks), at every block size,
/// with the open window and sealed blocks in one split or cut by several.
#[test]
fn int4_kc_channels_over_four_decades() {
    let Some(gpu) = require_gpu_or_skip("int4_kc_channels_over_four_decades") else {
        return;
    };
    let mut rng = rng("int4_kc_channels_over_four_decades");
    for bs in [16, 32, 64] {
        for v in [KvFormat::Int4Affine64, KvFormat::F16] {
            let mut c = Case::new(KvFormat::Int4Kc, v, 128, vec![bs * 5 - 3, 2 * bs, 300]);
            c.block_size = bs;
            c.splits = Some(1 + rng.below(4));
            c.q_len = 1 + rng.below(3);
            let d = c.head_dim;
            // Per channel: a scale 10^-2 .. 10^2, every 7th constant, every 5th offset by 30.
            let scale: Vec<f32> = (0..d)
                .map(|_| 10f32.powf(-2.0 + 4.0 * rng.uniform() as f32))
                .collect();
            let seqs: Vec<SeqKv> = c
                .lens
                .iter()
                .map(|&l| {
                    let mut s = random_kv(&mut rng, l, c.num_kv_heads, d);
                    for (i, x) in s.k.iter_mut().enumerate() {
                        let ch = i % d;
                        *x = if ch % 7 == 3 {
                            0.25
                        } else {
                            *x * scale[ch] * 0.1
                        };
                        if ch % 5 == 1 {
                            *x += 30.0;
                        }
                        if ch == 0 && v == KvFormat::F16 {
                            *x = (rng.uniform() as f32 * 2.0 - 1.0) * 20000.0;
                        }
                    }
                    s
                })
                .collect();
            let n = c.lens.len() * c.num_kv_heads * c.group * c.q_len * d;
            // The wide channel's query component small, so that it does not own every score.
            let q: Vec<f32> = (0..n)
                .map(|i| rng.normal() * if i % d == 0 { 1e-4 } else { 0.3 })
                .collect();
            let o = run_case(&gpu, &c, &seqs, &q);
            eprintln!(
                "  {:<70} rel {:.2e} row {:.2e} lse {:.1e}",
                c.name(),
                o.rel,
                o.worst_row,
                o.worst_lse
            );
        }
    }
}

/// Real attention data: MiniLM's K/V/Q (12 heads of 32 → 6 heads of 64 by pairing adjacent
/// heads), two layers as two sequences, the last q_len tokens' queries.
#[test]
fn real_minilm_data() {
    let Some(gpu) = require_gpu_or_skip("real_minilm_data") else {
        return;
    };
    let Some(path) = common::minilm_data("real_minilm_data") else {
        return;
    };
    let bytes = std::fs::read(&path).expect("read minilm");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse minilm");
    let tensor = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).expect("tensor");
        assert_eq!(t.shape(), &[512, 12, 32], "{name}");
        t.data()
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    };
    let mut rng = rng("real_minilm_data");
    let (la, lb) = (rng.below(6), rng.below(6));
    let lens = vec![512, 257 + rng.below(255)];
    // [512, 12, 32] is [512, 6, 64] with adjacent heads paired.
    let seqs: Vec<SeqKv> = [(la, lens[0]), (lb, lens[1])]
        .iter()
        .map(|&(l, len)| SeqKv {
            k: tensor(&format!("k.{l}"))[..len * 384].to_vec(),
            v: tensor(&format!("v.{l}"))[..len * 384].to_vec(),
        })
        .collect();
    for (k, v) in [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Fp8E4m3),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Bf16, KvFormat::Bf16),
        (KvFormat::Int8Pth, KvFormat::Int8Pth),
        (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
        (KvFormat::Int4Sym32, KvFormat::Fp4E2m1),
        (KvFormat::Int4Kc, KvFormat::Int4Affine64),
        (KvFormat::Int4Kc, KvFormat::Fp8E4m3),
    ] {
        for q_len in [1, 3] {
            let mut c = Case::new(k, v, 64, lens.clone());
            c.num_kv_heads = 6;
            c.group = 1;
            c.q_len = q_len;
            // q [batch, 6 heads, q_len, 64] from the last q_len positions of each sequence.
            let mut q = Vec::new();
            for (&l, &len) in [la, lb].iter().zip(&lens) {
                let qs = tensor(&format!("q.{l}"));
                for h in 0..6 {
                    for i in 0..q_len {
                        let p = len - q_len + i;
                        q.extend_from_slice(&qs[(p * 6 + h) * 64..][..64]);
                    }
                }
            }
            let o = run_case(&gpu, &c, &seqs, &q);
            eprintln!(
                "  minilm {:<60} rel {:.2e} lse {:.1e}",
                c.name(),
                o.rel,
                o.worst_lse
            );
        }
    }
}

#[test]
fn unsupported_and_bad_arguments_are_errors() {
    let Some(gpu) = require_gpu_or_skip("unsupported_and_bad_arguments_are_errors") else {
        return;
    };
    let layout = |k, v, d, bs| CacheConfig::new(2, d, bs, k, v).unwrap().layout();
    let (i4k, i4v) = (KvFormat::Int4Sym32, KvFormat::Int4Affine64);
    let unsupported = |r: Result<DecodePlan, Error>| matches!(r, Err(Error::Unsupported(_)));
    let f16l = layout(KvFormat::F16, KvFormat::F16, 72, 16);
    assert!(unsupported(DecodePlan::new(
        &gpu,
        &f16l,
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 2,
            max_q_len: 1,
            max_context_len: 10
        }
    )));
    assert!(unsupported(DecodePlan::new(
        &gpu,
        &layout(i4k, i4v, 128, 8),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 2,
            max_q_len: 1,
            max_context_len: 10
        }
    )));
    assert!(unsupported(DecodePlan::new(
        &gpu,
        &layout(KvFormat::Fp8E5m2, KvFormat::F16, 128, 16),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 2,
            max_q_len: 1,
            max_context_len: 10
        }
    )));
    assert!(
        DecodePlan::new(
            &gpu,
            &layout(i4k, i4v, 128, 16),
            DecodeCapacity {
                max_batch: 1,
                num_q_heads: 3,
                max_q_len: 1,
                max_context_len: 10
            }
        )
        .is_err()
    );
    assert!(
        DecodePlan::new(
            &gpu,
            &layout(i4k, i4v, 128, 16),
            DecodeCapacity {
                max_batch: 1,
                num_q_heads: 2,
                max_q_len: 4,
                max_context_len: 3
            }
        )
        .is_err()
    );
    assert!(
        DecodePlan::new(
            &gpu,
            &layout(i4k, i4v, 128, 16),
            DecodeCapacity {
                max_batch: 0,
                num_q_heads: 2,
                max_q_len: 1,
                max_context_len: 10
            }
        )
        .is_err()
    );

    // A valid plan, then buffers and tables that do not fit it.
    let config = CacheConfig::new(2, 64, 16, KvFormat::Bf16, KvFormat::Bf16).unwrap();
    let mut host = HostCache::new(config, 4).unwrap();
    let kv = vec![0.5f32; 20 * 2 * 64];
    host.write(&(0..20).collect::<Vec<_>>(), &kv, &kv).unwrap();
    let dcache = DeviceCache::from_host(&gpu, &host).unwrap();
    let plan = DecodePlan::new(
        &gpu,
        dcache.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 4,
            max_q_len: 1,
            max_context_len: 64,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let tables = BlockTables::from_rows(&[&[0, 1]], &[20]).unwrap();
    let dt = DeviceBlockTables::new(&dcache, &tables).unwrap();
    let s = gpu.stream();
    let q16 = s.clone_htod(&vec![f16::ONE; 4 * 64]).unwrap();
    let mut o16 = s.clone_htod(&vec![f16::ZERO; 4 * 64]).unwrap();
    assert!(matches!(
        plan.decode(&mut ws, &dcache, &dt, &q16, &mut o16, None),
        Err(Error::Unsupported(_))
    ));
    let q = s.clone_htod(&vec![bf16::ONE; 4 * 64]).unwrap();
    let mut short = s.clone_htod(&vec![bf16::ZERO; 4 * 64 - 1]).unwrap();
    assert!(matches!(
        plan.decode(&mut ws, &dcache, &dt, &q, &mut short, None),
        Err(Error::Length { .. })
    ));
    let mut out = s.clone_htod(&vec![bf16::ZERO; 4 * 64]).unwrap();
    let mut lse = s.clone_htod(&vec![0f32; 3]).unwrap();
    assert!(matches!(
        plan.decode(&mut ws, &dcache, &dt, &q, &mut out, Some(&mut lse)),
        Err(Error::Length { .. })
    ));
    // Tables outside the pool are refused on upload; longer than the plan, on decode.
    let bad = BlockTables::from_rows(&[&[0, 9]], &[20]).unwrap();
    assert!(matches!(
        DeviceBlockTables::new(&dcache, &bad),
        Err(Error::BlockIndex { .. })
    ));
    let long = BlockTables::from_rows(&[&[0, 1, 2, 3]], &[64]).unwrap();
    let dt_long = DeviceBlockTables::new(&dcache, &long).unwrap();
    let small = DecodePlan::new(
        &gpu,
        dcache.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 4,
            max_q_len: 1,
            max_context_len: 32,
        },
    )
    .unwrap();
    assert!(
        small
            .decode(&mut ws, &dcache, &dt_long, &q, &mut out, None)
            .is_err()
    );
    // decode() is one token per sequence: a plan with room for more says so instead of
    // guessing the step's q_len.
    let two = DecodePlan::new(
        &gpu,
        dcache.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: 4,
            max_q_len: 2,
            max_context_len: 32,
        },
    )
    .unwrap();
    let mut ws2 = DecodeWorkspace::new(&two).unwrap();
    assert!(matches!(
        two.decode(&mut ws2, &dcache, &dt, &q, &mut out, None),
        Err(Error::InvalidArgument(_))
    ));
    // And the valid call works: constant V of 0.5 gives 0.5 everywhere, lse = ln(20) + logit.
    plan.decode(&mut ws, &dcache, &dt, &q, &mut out, None)
        .unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    assert!(got.iter().all(|x| x.to_f32() == 0.5), "{got:?}");
}
