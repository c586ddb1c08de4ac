//! Attention over the paged cache for any query length (`kvq::cuda::prefill`) against the CPU
//! reference (`kvq::cpu::prefill_attention`, f64) on the same quantized cache: every K x V
//! format pair with a kernel, every head dim, ragged batches that mix whole prompts, chunks
//! after a cached prefix, decode rows and padding, GQA groups 1..8 (6 included), block sizes
//! 16 / 32 / 64, sliding windows, logit soft-capping, sinks, ALiBi slopes, forced key splits,
//! strided views and every output type, `int4-kc` keys in sealed blocks and in a sequence's open
//! last block, two-pass steps (the context decoded into a 16-bit scratch first), plus
//! `merge_states`.
//!
//! Each case: relative error ‖e‖ / ‖ref‖ over the whole output (e beyond half an ulp of the
//! output type) ≤ 2e-3 with f16 operands (4e-3 with bf16: P and decoded keys carry 8 bits), no
//! row worse than 2e-2, `lse` within 5e-3 (plus 10 % of that per unit of |lse|), and every
//! output element written (outputs are poisoned with NaN first). E4M3 operands are held against
//! the reference over the query rounded as the kernel rounds it: 2e-2 over all rows and 8e-2 a
//! row, for the probabilities' rounding. Inputs are fresh random draws
//! each run; the seed is printed and `KVQ_SEED=<n>` replays it. `KVQ_PREFILL_QUICK=1` shrinks
//! the suite (for compute-sanitizer runs). Without a GPU the tests print `SKIPPED`; with
//! `KVQ_REQUIRE_GPU=1` they fail instead.
#![cfg(feature = "cuda")]

mod common;

use common::{Rng, fresh_rng as rng};
use cudarc::driver::DevicePtr;
use half::{bf16, f16};
use kvq::cache::{BlockTables, HostCache};
use kvq::cpu::{Accum, AttentionOptions, HeadTerms, e4m3_operands, prefill_attention};
use kvq::cuda::decode::DeviceBlockTables;
use kvq::cuda::ops::{DeviceElement, Dtype};
use kvq::cuda::prefill::{
    HEAD_DIMS, PrefillCapacity, PrefillPlan, PrefillStep, PrefillWorkspace, QoIndptr,
    TWO_PASS_MIN_ROWS, TokenRows, TwoPass, kernel_available_for, merge_states,
};
use kvq::cuda::{DeviceCache, Gpu, require_gpu_or_skip};
use kvq::{CacheConfig, KvFormat, ScaleGranularity};

fn quick() -> bool {
    std::env::var("KVQ_PREFILL_QUICK").is_ok_and(|v| v == "1")
}

/// Query / output element types.
trait Elem: DeviceElement {
    fn from_f32(x: f32) -> Self;
    fn widen(self) -> f32;
    fn nan() -> Self;
    /// Half a unit in the last place of `x` in this type (the rounding to it).
    fn half_ulp(x: f32) -> f64;
}
impl Elem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn widen(self) -> f32 {
        f16::to_f32(self)
    }
    fn nan() -> Self {
        f16::NAN
    }
    fn half_ulp(x: f32) -> f64 {
        common::half_ulp_f16(x)
    }
}
impl Elem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn widen(self) -> f32 {
        bf16::to_f32(self)
    }
    fn nan() -> Self {
        bf16::NAN
    }
    fn half_ulp(x: f32) -> f64 {
        common::half_ulp_bf16(x)
    }
}
impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn widen(self) -> f32 {
        self
    }
    fn nan() -> Self {
        f32::NAN
    }
    fn half_ulp(x: f32) -> f64 {
        common::half_ulp(x, 23, -126)
    }
}

/// One ragged step: per sequence (new tokens, context length).
#[derive(Debug, Clone)]
struct Case {
    k: KvFormat,
    v: KvFormat,
    head_dim: usize,
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    /// (n_b, L_b) per sequence.
    seqs: Vec<(usize, usize)>,
    q_bf16: bool,
    window: Option<usize>,
    cap: Option<f32>,
    sinks: bool,
    /// ALiBi slopes: this factor times the standard geometric series
    /// (`factor * 2^(-8 (h + 1) / heads)`).
    alibi: Option<f32>,
    splits: Option<usize>,
    /// Extra elements between tokens of q (a fused-QKV view) and of out (an odd stride), and an
    /// f32 output.
    strided: bool,
    /// Leading one-token rows through the decode kernel (`with_decode_rows`).
    route: bool,
    /// E4M3 operands (`with_e4m3_operands`; fp8-e4m3 caches).
    e4m3: bool,
    /// Two passes (`with_two_pass`) with a scratch of this many tokens, from any row count.
    two_pass: Option<usize>,
}

impl Case {
    fn new(k: KvFormat, v: KvFormat, head_dim: usize, seqs: Vec<(usize, usize)>) -> Case {
        Case {
            k,
            v,
            head_dim,
            block_size: 16,
            num_kv_heads: 2,
            group: 4,
            seqs,
            q_bf16: k == KvFormat::Bf16 || v == KvFormat::Bf16,
            window: None,
            cap: None,
            sinks: false,
            alibi: None,
            splits: None,
            strided: false,
            route: false,
            e4m3: false,
            two_pass: None,
        }
    }
    fn name(&self) -> String {
        format!(
            "{}/{} d{} bs{} kv{} G{} {} seqs{:?} window{:?} cap{:?} sinks{} alibi{:?} \
             splits{:?}{}{}{}{}",
            self.k,
            self.v,
            self.head_dim,
            self.block_size,
            self.num_kv_heads,
            self.group,
            if self.q_bf16 { "bf16" } else { "f16" },
            self.seqs,
            self.window,
            self.cap,
            self.sinks,
            self.alibi,
            self.splits,
            if self.strided { " strided/f32" } else { "" },
            if self.route { " routed" } else { "" },
            if self.e4m3 { " e4m3-operands" } else { "" },
            match self.two_pass {
                Some(t) => format!(" two-pass {t}"),
                None => String::new(),
            }
        )
    }
}

/// Build the cache, run GPU and CPU, compare; returns the relative error.
fn check(gpu: &Gpu, rng: &mut Rng, case: &Case) -> f64 {
    match (case.q_bf16, case.strided) {
        (false, false) => run::<f16, f16>(gpu, rng, case),
        (true, false) => run::<bf16, bf16>(gpu, rng, case),
        (false, true) => run::<f16, f32>(gpu, rng, case),
        (true, true) => run::<bf16, f32>(gpu, rng, case),
    }
}

fn run<Q: Elem, O: Elem>(gpu: &Gpu, rng: &mut Rng, case: &Case) -> f64 {
    let name = case.name();
    let (d, bs, nkv) = (case.head_dim, case.block_size, case.num_kv_heads);
    let heads = nkv * case.group;
    let config = CacheConfig::new(nkv, d, bs, case.k, case.v).expect("config");
    let lens: Vec<usize> = case.seqs.iter().map(|s| s.1).collect();
    let used: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let num_blocks = used.iter().sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut rows: Vec<Vec<i32>> = Vec::new();
    let mut next = 0;
    for &u in &used {
        rows.push(ids[next..next + u].to_vec());
        next += u;
    }
    // Keys with a few strong outlier channels, values with per-channel offsets.
    let outlier: Vec<f32> = (0..d)
        .map(|_| if rng.below(16) == 0 { 8.0 } else { 1.0 })
        .collect();
    let offset: Vec<f32> = (0..d).map(|_| rng.normal() * 0.5).collect();
    let kv: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&len| {
            let n = len * nkv * d;
            let k = (0..n).map(|i| rng.normal() * outlier[i % d]).collect();
            let v = (0..n).map(|i| rng.normal() + offset[i % d]).collect();
            (k, v)
        })
        .collect();
    let mut host = HostCache::new(config, num_blocks).expect("host cache");
    if case.k.has_head_scale() || case.v.has_head_scale() {
        let all_k: Vec<f32> = kv.iter().flat_map(|s| s.0.iter().copied()).collect();
        let all_v: Vec<f32> = kv.iter().flat_map(|s| s.1.iter().copied()).collect();
        host.calibrate_fp8_scales(&all_k, &all_v, ScaleGranularity::PerHead)
            .expect("calibrate");
    }
    for ((s, row), &len) in kv.iter().zip(&rows).zip(&lens) {
        let slots: Vec<usize> = (0..len)
            .map(|t| row[t / bs] as usize * bs + t % bs)
            .collect();
        host.write(&slots, &s.0, &s.1).expect("write");
    }
    let row_refs: Vec<&[i32]> = rows.iter().map(|r| r.as_slice()).collect();
    let tables = BlockTables::from_rows(&row_refs, &lens).expect("tables");
    let mut qo = vec![0u32];
    for s in &case.seqs {
        qo.push(qo.last().unwrap() + s.0 as u32);
    }
    let total = *qo.last().unwrap() as usize;
    // Queries scaled so that softmaxes are neither flat nor one-hot.
    let q: Vec<f32> = (0..total * heads * d).map(|_| rng.normal() * 0.5).collect();
    let q_t: Vec<Q> = q.iter().map(|&x| Q::from_f32(x)).collect();
    let q_ref: Vec<f32> = q_t.iter().map(|&x| x.widen()).collect();
    let sinks: Vec<f32> = (0..heads).map(|_| rng.normal() * 2.0).collect();
    let slopes: Vec<f32> = (0..heads)
        .map(|h| case.alibi.unwrap_or(0.0) * 2f32.powf(-8.0 * (h + 1) as f32 / heads as f32))
        .collect();
    let mut opts = AttentionOptions::new(d);
    opts.window_left = case.window;
    opts.logits_soft_cap = case.cap;
    let reference = |q: &[f32]| {
        prefill_attention(
            &host,
            &tables,
            &qo,
            q,
            heads,
            &opts,
            HeadTerms {
                sinks: case.sinks.then_some(sinks.as_slice()),
                alibi_slopes: case.alibi.is_some().then_some(slopes.as_slice()),
            },
            Accum::F64,
        )
        .unwrap_or_else(|e| panic!("{name}: cpu: {e}"))
    };
    // E4M3 operands: the reference takes the query rows as the kernel rounds them (the
    // probabilities' rounding is left to the tolerance); the exact query's too, to tell that
    // the E4M3 instance ran.
    let want = if case.e4m3 {
        reference(&e4m3_operands::quantize_rows(&q_ref, d))
    } else {
        reference(&q_ref)
    };
    let exact_q = case.e4m3.then(|| reference(&q_ref));

    let mut dcache = DeviceCache::from_host(gpu, &host).expect("device cache");
    let dtables = DeviceBlockTables::new(&dcache, &tables).expect("device tables");
    let max_len = *lens.iter().max().unwrap();
    let plan = PrefillPlan::new(
        gpu,
        dcache.layout(),
        PrefillCapacity {
            max_batch: case.seqs.len(),
            num_q_heads: heads,
            max_tokens: total.max(1),
            max_context_len: max_len,
        },
    )
    .unwrap_or_else(|e| panic!("{name}: plan: {e}"))
    .with_window_left(case.window)
    .expect("window")
    .with_logits_soft_cap(case.cap)
    .expect("cap")
    .with_num_splits(case.splits)
    .with_e4m3_operands(case.e4m3)
    .with_two_pass(case.two_pass.map(|scratch_tokens| TwoPass {
        scratch_tokens,
        min_rows: 0,
    }))
    .expect("two-pass");
    let plan = if case.route {
        let decode = kvq::cuda::DecodePlan::new(
            gpu,
            dcache.layout(),
            kvq::cuda::DecodeCapacity {
                max_batch: case.seqs.len(),
                num_q_heads: heads,
                max_q_len: 4,
                max_context_len: max_len,
            },
        )
        .unwrap_or_else(|e| panic!("{name}: decode plan: {e}"));
        plan.with_decode_rows(decode).expect("routing")
    } else {
        plan
    };
    let mut ws = PrefillWorkspace::new(&plan).expect("workspace");
    let s = gpu.stream();
    // A strided view: each token's q rows sit inside a wider row (as in a fused QKV buffer).
    let q_token = if case.strided {
        heads * d + 2 * 8 * d
    } else {
        heads * d
    };
    let mut q_host = vec![Q::from_f32(0.0); total.max(1) * q_token];
    for t in 0..total {
        q_host[t * q_token..][..heads * d].copy_from_slice(&q_t[t * heads * d..][..heads * d]);
    }
    let q_dev = s.clone_htod(&q_host).expect("upload q");
    // The offsets through QoIndptr (host and device together), set from the counts.
    let counts: Vec<usize> = qo.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
    let mut qo_both = QoIndptr::new(gpu, counts.len().max(1)).expect("qo_indptr");
    qo_both.set_counts(&counts).expect("set qo_indptr");
    assert_eq!(qo_both.host(), &qo[..]);
    // Strided: an odd token stride in out too, whose rows the kernel stores element by element.
    let out_token = if case.strided {
        heads * d + 1
    } else {
        heads * d
    };
    let mut out_dev = s
        .clone_htod(&vec![O::nan(); total.max(1) * out_token])
        .expect("out");
    let mut lse_dev = s
        .clone_htod(&vec![f32::NAN; total.max(1) * heads])
        .expect("lse");
    let sinks_dev = s.clone_htod(&sinks).expect("sinks");
    let slopes_dev = s.clone_htod(&slopes).expect("slopes");
    plan.prefill(
        &mut ws,
        &dcache,
        &dtables,
        PrefillStep {
            qo_indptr: qo_both.host(),
            qo_indptr_dev: qo_both.device(),
            q: &q_dev,
            q_rows: TokenRows {
                token: q_token,
                head: d,
            },
            out: &mut out_dev,
            out_rows: TokenRows {
                token: out_token,
                head: d,
            },
            lse: Some((&mut lse_dev, TokenRows::contiguous(heads, 1))),
            sinks: case.sinks.then_some(&sinks_dev),
            alibi_slopes: case.alibi.is_some().then_some(&slopes_dev),
        },
    )
    .unwrap_or_else(|e| panic!("{name}: prefill failed: {e}"));
    let out: Vec<f32> = s
        .clone_dtoh(&out_dev)
        .expect("download")
        .iter()
        .map(|&x| x.widen())
        .collect();
    let lse = s.clone_dtoh(&lse_dev).expect("download lse");
    gpu.synchronize().expect("sync");
    assert_eq!(
        ws.two_pass_last_step(),
        takes_two_pass(case),
        "{name}: the path taken"
    );
    if let Err(e) = dcache.check_appends() {
        panic!("{name}: {e}");
    }

    let pads_written = out
        .chunks(out_token)
        .take(total)
        .filter(|t| !t[heads * d..].iter().all(|x| x.is_nan()))
        .count();
    assert_eq!(
        pads_written, 0,
        "{name}: {pads_written} tokens' padding written"
    );
    let out: Vec<f32> = out
        .chunks(out_token)
        .take(total)
        .flat_map(|t| t[..heads * d].iter().copied())
        .collect();
    let unwritten = out.iter().filter(|x| !x.is_finite()).count();
    assert_eq!(
        unwritten, 0,
        "{name}: {unwritten} output elements not written (or NaN)"
    );
    let (rel, worst_row) = compare::<O>(&out, &want.out, d);
    for (i, (&g, &w)) in lse[..total * heads].iter().zip(&want.lse).enumerate() {
        assert!(g.is_finite(), "{name}: lse[{i}] = {g} (want {w})");
        let err = (g as f64 - w as f64).abs();
        assert!(
            err <= 5e-3 * (1.0 + 0.1 * (w as f64).abs()),
            "{name}: lse[{i}] = {g}, want {w}"
        );
    }
    // E4M3 operands: the probabilities' rounding (3 mantissa bits each) on top.
    let (tol, row_tol) = match (case.e4m3, case.q_bf16) {
        (true, _) => (E4M3_TOL, E4M3_ROW_TOL),
        (false, true) => (4e-3, 2e-2),
        (false, false) => (2e-3, 2e-2),
    };
    assert!(rel <= tol, "{name}: relative error {rel:.3e} > {tol:e}");
    assert!(
        worst_row <= row_tol,
        "{name}: worst row error {worst_row:.3e}"
    );
    if let Some(exact) = exact_q {
        let (rel_exact, _) = compare::<O>(&out, &exact.out, d);
        assert!(
            rel < rel_exact,
            "{name}: closer to the exact query's attention ({rel_exact:.3e}) than to the \
             E4M3 query's ({rel:.3e}): the decoded operands ran"
        );
    }
    eprintln!("{name}: rel {rel:.2e}, worst row {worst_row:.2e}");
    rel
}

/// Whether `case`'s step takes two passes: a quantized side, a scratch that holds the contexts
/// of the sequences past the routed decode rows (the leading run of the first row's count, 1
/// to 4), some of which have new tokens, no window, and no E4M3 operands over FP8 E4M3.
fn takes_two_pass(case: &Case) -> bool {
    let Some(scratch) = case.two_pass else {
        return false;
    };
    let n0 = case.seqs[0].0;
    let lead = if case.route && (1..=4).contains(&n0) {
        case.seqs.iter().take_while(|s| s.0 == n0).count()
    } else {
        0
    };
    let rest = &case.seqs[lead..];
    let blocks: usize = rest.iter().map(|s| s.1.div_ceil(case.block_size)).sum();
    let e4m3 = case.e4m3 && case.k == KvFormat::Fp8E4m3 && case.v == KvFormat::Fp8E4m3;
    (case.k.bits() < 16 || case.v.bits() < 16)
        && rest.iter().any(|s| s.0 > 0)
        && blocks <= scratch.div_ceil(case.block_size)
        && case.window.is_none()
        && !e4m3
}

/// Tokens of a scratch that holds every sequence of `case` in whole blocks.
fn scratch_for(case: &Case) -> usize {
    let bs = case.block_size;
    case.seqs.iter().map(|s| s.1.div_ceil(bs) * bs).sum()
}

/// E4M3 operands: bounds on the relative error against the reference over E4M3-rounded query
/// rows, all rows and the worst one (the probabilities' rounding: 2^-4 of each at most).
const E4M3_TOL: f64 = 2e-2;
const E4M3_ROW_TOL: f64 = 8e-2;
/// E4M3 operands over diffuse attention (independent normal keys and values, as the fault test
/// holds): the output is a near-cancelling mean, and the probabilities' rounding (2^-4 at most
/// each, about 2 % rms) leaves a relative error of that size whatever the context length (2.5e-2
/// measured on an H100).
const E4M3_DIFFUSE_TOL: f64 = 4e-2;

/// Relative error of `out` against `want` (rows of `d`), less half an ulp of O per element: over
/// all rows, and the worst row's.
fn compare<O: Elem>(out: &[f32], want: &[f32], d: usize) -> (f64, f64) {
    let (mut num, mut den, mut worst_row) = (0f64, 0f64, 0f64);
    for (o_row, w_row) in out.chunks(d).zip(want.chunks(d)) {
        let (mut rn, mut rd) = (0f64, 0f64);
        for (&o, &w) in o_row.iter().zip(w_row) {
            let e = ((o as f64 - w as f64).abs() - O::half_ulp(w)).max(0.0);
            rn += e * e;
            rd += (w as f64) * (w as f64);
        }
        num += rn;
        den += rd;
        if rd > 1e-12 {
            worst_row = worst_row.max((rn / rd).sqrt());
        }
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), worst_row)
}

/// A prompt, a chunk after a cached prefix, a decode row and padding, in one ragged step.
fn mixed() -> Vec<(usize, usize)> {
    if quick() {
        vec![(20, 20), (9, 90), (1, 17), (0, 0)]
    } else {
        vec![(130, 130), (37, 300), (1, 77), (0, 0), (64, 64)]
    }
}

fn pairs(head_dim: usize) -> Vec<(KvFormat, KvFormat, bool)> {
    let mut v = Vec::new();
    for k in KvFormat::ALL {
        for vf in KvFormat::ALL {
            for q_bf16 in [false, true] {
                if kernel_available_for(k, vf, head_dim, q_bf16) {
                    v.push((k, vf, q_bf16));
                }
            }
        }
    }
    v
}

#[test]
fn every_format_pair() {
    let Some(gpu) = require_gpu_or_skip("every_format_pair") else {
        return;
    };
    let mut rng = rng("every_format_pair");
    let all = pairs(128);
    assert!(
        all.len() >= 25,
        "pairs with a kernel at d128: {}",
        all.len()
    );
    for (k, v, q_bf16) in all {
        let mut c = Case::new(k, v, 128, mixed());
        c.q_bf16 = q_bf16;
        check(&gpu, &mut rng, &c);
    }
}

#[test]
fn every_head_dim() {
    let Some(gpu) = require_gpu_or_skip("every_head_dim") else {
        return;
    };
    let mut rng = rng("every_head_dim");
    for d in HEAD_DIMS {
        if quick() && d != 64 && d != 256 {
            continue;
        }
        for (k, v) in [
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::Bf16, KvFormat::Bf16),
            (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
            (KvFormat::Fp8E5m2, KvFormat::Int4Affine64),
            (KvFormat::Int4Kc, KvFormat::F16),
            (KvFormat::Int4Kc, KvFormat::Int4Affine64),
        ] {
            if !kernel_available_for(k, v, d, k == KvFormat::Bf16) {
                continue;
            }
            let mut c = Case::new(k, v, d, vec![(70, 70), (20, 150)]);
            check(&gpu, &mut rng, &c);
            // Forty key splits (most of them empty): the merge's widest rows at every width.
            c.splits = Some(40);
            check(&gpu, &mut rng, &c);
        }
    }
}

#[test]
fn groups_blocks_and_views() {
    let Some(gpu) = require_gpu_or_skip("groups_blocks_and_views") else {
        return;
    };
    let mut rng = rng("groups_blocks_and_views");
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[(6, 2, 32)]
    } else {
        &[(1, 4, 16), (6, 2, 32), (8, 1, 16), (3, 2, 64)]
    };
    for &(group, nkv, bs) in shapes {
        for (k, v) in [
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
            (KvFormat::Int4Kc, KvFormat::Int4Affine64),
        ] {
            let mut c = Case::new(k, v, 128, vec![(45, 45), (13, 200), (2, 33)]);
            c.group = group;
            c.num_kv_heads = nkv;
            c.block_size = bs;
            check(&gpu, &mut rng, &c);
            c.strided = true;
            check(&gpu, &mut rng, &c);
        }
    }
}

/// `base`, then `base` with each option the warp-specialized kernel's tests cover: pages of 32
/// tokens with a window, soft cap with sinks, ALiBi, key splits (empty ones among them) with
/// sinks, strided views.
fn check_options(gpu: &Gpu, rng: &mut Rng, base: &Case) {
    check(gpu, rng, base);
    let mut c = base.clone();
    c.block_size = 32;
    c.window = Some(70);
    check(gpu, rng, &c);
    let mut c = base.clone();
    c.cap = Some(5.0);
    c.sinks = true;
    check(gpu, rng, &c);
    let mut c = base.clone();
    c.alibi = Some(1.0);
    check(gpu, rng, &c);
    let mut c = base.clone();
    c.splits = Some(3);
    c.sinks = true;
    check(gpu, rng, &c);
    let mut c = base.clone();
    c.strided = true;
    check(gpu, rng, &c);
}

/// Test `name`: each (K, V, bf16 queries) at head_dim 128 over `seqs` (new tokens, length), with
/// every option of check_options.
fn check_pairs_with_options(
    name: &str,
    pairs: &[(KvFormat, KvFormat, bool)],
    seqs: &[(usize, usize)],
) {
    let Some(gpu) = require_gpu_or_skip(name) else {
        return;
    };
    let mut rng = rng(name);
    for &(k, v, q_bf16) in pairs {
        let mut base = Case::new(k, v, 128, seqs.to_vec());
        base.q_bf16 = q_bf16;
        check_options(&gpu, &mut rng, &base);
    }
}

/// Wide tiles at head_dim 128 (on sm_90a the warp-specialized kernel: a producer warpgroup
/// that copies, or copies raw and decodes, and two consumer warpgroups handing stages over
/// through mbarriers), in quick mode too so that the sanitizers see it: f16 and bf16 caches,
/// bf16 queries over f16 keys, FP8 and INT4 on both sides, ALiBi, windows, soft cap, sinks,
/// key splits (empty ones among them), ragged rows with one tile past a sequence's rows, and
/// pages of 32 tokens.
#[test]
fn wide_tiles_warp_specialized() {
    // 4 x (130 + 64 + 40) rows over 3 sequences: wide tiles (>= 128 rows a sequence; triple
    // tiles only for grids of several waves).
    check_pairs_with_options(
        "wide_tiles_warp_specialized",
        &[
            (KvFormat::F16, KvFormat::F16, false),
            (KvFormat::F16, KvFormat::F16, true),
            (KvFormat::Bf16, KvFormat::Bf16, true),
            (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, true),
            (KvFormat::Fp8E5m2, KvFormat::Int4Affine64, false),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64, true),
        ],
        &[(130, 130), (64, 600), (40, 41)],
    );
}

/// Triple tiles at head_dim 128 (on sm_90a the warp-specialized kernel with three consumer
/// warpgroups, Q read from its tile by descriptor). The launcher takes them for grids of
/// several waves, larger than a test's, so this test runs `triple_tiles_forced` in a child
/// process of this binary with `KVQ_PREFILL_TRIPLE=1` (read once a process), which forces them
/// wherever wide tiles would run, and checks that it passed.
#[test]
fn triple_tiles_warp_specialized() {
    if require_gpu_or_skip("triple_tiles_warp_specialized").is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([
            "triple_tiles_forced",
            "--exact",
            "--ignored",
            "--test-threads",
            "1",
        ])
        .env("KVQ_PREFILL_TRIPLE", "1")
        .output()
        .expect("run triple_tiles_forced");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "triple_tiles_forced:\n{text}"
    );
}

/// triple_tiles_warp_specialized's child: every option of check_options at triple tiles, in
/// quick mode too, for f16 and bf16 caches, bf16 queries over f16 keys, FP8, INT4, INT8 and FP4,
/// and the fault test's cases.
#[test]
#[ignore = "run by triple_tiles_warp_specialized, with KVQ_PREFILL_TRIPLE=1"]
fn triple_tiles_forced() {
    assert_eq!(
        std::env::var("KVQ_PREFILL_TRIPLE").as_deref(),
        Ok("1"),
        "run with KVQ_PREFILL_TRIPLE=1 (triple_tiles_warp_specialized does)"
    );
    // 4 x (130 + 64 + 40) rows over 3 sequences: a sequence of fewer rows than a tile, and one
    // whose last tile is partly past its rows.
    check_pairs_with_options(
        "triple_tiles_forced",
        &[
            (KvFormat::F16, KvFormat::F16, false),
            (KvFormat::F16, KvFormat::F16, true),
            (KvFormat::Bf16, KvFormat::Bf16, true),
            (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, true),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64, true),
            (KvFormat::Int8Pth, KvFormat::Fp4E2m1, true),
        ],
        &[(130, 130), (64, 600), (40, 41)],
    );
    let Some(gpu) = require_gpu_or_skip("triple_tiles_forced") else {
        return;
    };
    let mut rng = rng("triple_tiles_forced faults");
    fault_case::<bf16>(&gpu, &mut rng, KvFormat::Bf16, KvFormat::Bf16, 130, false);
    for (k, v) in [
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    ] {
        fault_case::<f16>(&gpu, &mut rng, k, v, 130, false);
    }
}

/// Narrow tiles at head_dim 128 (on sm_90a the warp-specialized kernel at 64 rows a block, two
/// blocks an SM; for quantized caches its Q tile over the staging areas): extend-like steps of a
/// few new tokens over longer contexts, f16 and bf16 caches, bf16 queries over f16 keys, FP8,
/// INT4, INT8 and FP4 on both sides, windows, soft cap, sinks, ALiBi, key splits, strided views
/// and pages of 32 tokens; in quick mode too, for the sanitizers.
#[test]
fn narrow_tiles_warp_specialized() {
    // 4 x (16 + 3 + 9) rows over 3 sequences: narrow tiles (< 128 rows a sequence).
    check_pairs_with_options(
        "narrow_tiles_warp_specialized",
        &[
            (KvFormat::F16, KvFormat::F16, false),
            (KvFormat::F16, KvFormat::F16, true),
            (KvFormat::Bf16, KvFormat::Bf16, true),
            (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, true),
            (KvFormat::Fp8E5m2, KvFormat::Int4Affine64, false),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64, true),
            (KvFormat::Int8Pth, KvFormat::Fp4E2m1, true),
        ],
        &[(16, 400), (3, 90), (9, 9)],
    );
}

/// E4M3 operands (fp8-e4m3 caches on FP8 tensor cores, `with_e4m3_operands`): on sm_90a the
/// warp-specialized kernel's E4M3 instances at wide and narrow tiles, bf16 and f16 queries, with
/// every option of check_options; in quick mode too, for the sanitizers. Elsewhere the decoded
/// operands run, and the check that the E4M3 instance ran fails: this test needs sm_90a.
#[test]
fn e4m3_operands_warp_specialized() {
    let name = "e4m3_operands_warp_specialized";
    let Some(gpu) = require_gpu_or_skip(name) else {
        return;
    };
    let mut rng = rng(name);
    for seqs in [
        vec![(130, 130), (64, 600), (40, 41)],
        vec![(16, 400), (3, 90), (9, 9)],
    ] {
        for q_bf16 in [true, false] {
            let mut base = Case::new(KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, 128, seqs.clone());
            base.q_bf16 = q_bf16;
            base.e4m3 = true;
            check_options(&gpu, &mut rng, &base);
        }
    }
}

/// A block-table entry outside the pool (which only a raw caller can pass: the safe tables refuse
/// it) is counted and its tokens read as zeros: the launch matches the CPU reference over a table
/// that names a spare block of zero bytes there (zeros in every format: INT4's scales and zeros
/// too). 16-bit, FP8 and INT4 caches at wide and narrow tiles (triple tiles: triple_tiles_forced):
/// on sm_90a the warp-specialized kernel's 16-bit copies (zero-filled) and its quantized
/// producers (which store the zeros themselves), at both tile widths.
#[test]
fn block_outside_the_pool_reads_as_zeros() {
    let Some(gpu) = require_gpu_or_skip("block_outside_the_pool_reads_as_zeros") else {
        return;
    };
    let mut rng = rng("block_outside_the_pool_reads_as_zeros");
    for (k, v) in [
        (KvFormat::Bf16, KvFormat::Bf16),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    ] {
        for new_tokens in [130, 16] {
            if k == KvFormat::Bf16 {
                fault_case::<bf16>(&gpu, &mut rng, k, v, new_tokens, false);
            } else {
                fault_case::<f16>(&gpu, &mut rng, k, v, new_tokens, false);
            }
            if k == KvFormat::Fp8E4m3 {
                fault_case::<f16>(&gpu, &mut rng, k, v, new_tokens, true);
            }
        }
    }
}

fn fault_case<Q: Elem>(gpu: &Gpu, rng: &mut Rng, k: KvFormat, v: KvFormat, n: usize, e4m3: bool) {
    use kvq::cuda::sys;
    let name = format!(
        "{k}/{v} {n} new tokens, a block outside the pool{}",
        if e4m3 { ", e4m3 operands" } else { "" }
    );
    let (d, bs, nkv, heads, len): (usize, usize, usize, usize, usize) = (128, 16, 2, 8, 300);
    let used = len.div_ceil(bs);
    let num_blocks = used + 1; // block `used`: the CPU's stand-in for the one outside the pool
    let config = CacheConfig::new(nkv, d, bs, k, v).expect("config");
    let mut host = HostCache::new(config, num_blocks).expect("host cache");
    let (keys, values) = (
        rng.normals(len * nkv * d, 1.0),
        rng.normals(len * nkv * d, 1.0),
    );
    if k.has_head_scale() || v.has_head_scale() {
        host.calibrate_fp8_scales(&keys, &values, ScaleGranularity::PerHead)
            .expect("calibrate");
    }
    let slots: Vec<usize> = (0..len).collect(); // block i holds tokens 16 i ..
    host.write(&slots, &keys, &values).expect("write");
    let block_bytes = host.layout().block_stride;
    host.pool_mut()[used * block_bytes..num_blocks * block_bytes].fill(0);
    let row: Vec<i32> = (0..used as i32).collect();
    let (faulted, outside) = (5, num_blocks as i32 + 7);
    let mut cpu_row = row.clone();
    cpu_row[faulted] = used as i32;
    let tables = BlockTables::from_rows(&[cpu_row.as_slice()], &[len]).expect("tables");
    let qo = [0u32, n as u32];
    let q: Vec<Q> = (0..n * heads * d)
        .map(|_| Q::from_f32(rng.normal() * 0.5))
        .collect();
    let mut q_ref: Vec<f32> = q.iter().map(|&x| x.widen()).collect();
    if e4m3 {
        q_ref = e4m3_operands::quantize_rows(&q_ref, d);
    }
    let opts = AttentionOptions::new(d);
    let want = prefill_attention(
        &host,
        &tables,
        &qo,
        &q_ref,
        heads,
        &opts,
        HeadTerms::default(),
        Accum::F64,
    )
    .unwrap_or_else(|e| panic!("{name}: cpu: {e}"));

    let mut dcache = DeviceCache::from_host(gpu, &host).expect("device cache");
    // The plan prepares the kernels for this layout and query type.
    let _plan = PrefillPlan::new(
        gpu,
        dcache.layout(),
        PrefillCapacity {
            max_batch: 1,
            num_q_heads: heads,
            max_tokens: n,
            max_context_len: len,
        },
    )
    .expect("plan");
    let s = gpu.stream();
    let mut gpu_row = row;
    gpu_row[faulted] = outside;
    let table = s.clone_htod(&gpu_row).expect("table");
    let lens = s.clone_htod(&[len as i32]).expect("lens");
    let qo_dev = s.clone_htod(&[0i32, n as i32]).expect("qo");
    let q_dev = s.clone_htod(&q).expect("q");
    let out_dev = s.clone_htod(&vec![Q::nan(); n * heads * d]).expect("out");
    let dtype = Q::DTYPE.raw();
    let tile = sys::KVQ_PREFILL_TILE_TOKENS as usize;
    let ptr = |x: u64| x as usize;
    let args = sys::kvq_prefill_args {
        cache: dcache.as_raw(),
        num_blocks: num_blocks as i64,
        q: ptr(q_dev.device_ptr(s).0) as *const std::ffi::c_void,
        out: ptr(out_dev.device_ptr(s).0) as *mut std::ffi::c_void,
        lse: std::ptr::null_mut(),
        q_token_stride: (heads * d) as i64,
        q_head_stride: d as i64,
        out_token_stride: (heads * d) as i64,
        out_head_stride: d as i64,
        lse_token_stride: 0,
        lse_head_stride: 0,
        qo_indptr: ptr(qo_dev.device_ptr(s).0) as *const i32,
        block_tables: ptr(table.device_ptr(s).0) as *const i32,
        context_lens: ptr(lens.device_ptr(s).0) as *const i32,
        sinks: std::ptr::null(),
        ws_o: std::ptr::null_mut(),
        ws_lse: std::ptr::null_mut(),
        counters: ptr(dcache.counters_raw()) as *mut std::os::raw::c_ulonglong,
        q_dtype: dtype,
        out_dtype: dtype,
        batch: 1,
        num_q_heads: heads as i32,
        max_blocks: used as i32,
        max_tokens: n as i32,
        num_splits: 1,
        split_tokens: len.div_ceil(tile) as i32 * tile as i32,
        window_left: -1,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        logits_soft_cap: 0.0,
        alibi_slopes: std::ptr::null(),
        e4m3_operands: i32::from(e4m3),
        wide_tile_rows: 0,
    };
    // SAFETY: every buffer holds what the strides and lengths address; the one table entry
    // outside the pool is the point (the kernel reads no memory for it and counts it).
    let status = unsafe { sys::kvq_prefill_attention(&args, s.cu_stream() as *mut _) };
    assert_eq!(status, 0, "{name}: launch");
    let out: Vec<f32> = s
        .clone_dtoh(&out_dev)
        .expect("download")
        .iter()
        .map(|&x| x.widen())
        .collect();
    assert!(
        dcache.check_appends().is_err(),
        "{name}: the fault must be counted"
    );
    assert!(
        out.iter().all(|o| o.is_finite()),
        "{name}: an output element not written (or NaN)"
    );
    let (rel, _) = compare::<Q>(&out, &want.out, d);
    let tol = match (e4m3, Q::DTYPE == Dtype::Bf16) {
        (true, _) => E4M3_DIFFUSE_TOL,
        (false, true) => 4e-3,
        (false, false) => 2e-3,
    };
    assert!(rel <= tol, "{name}: relative error {rel:.3e} > {tol:e}");
    eprintln!("{name}: rel {rel:.2e}");
}

#[test]
fn windows_caps_sinks_and_splits() {
    let Some(gpu) = require_gpu_or_skip("windows_caps_sinks_and_splits") else {
        return;
    };
    let mut rng = rng("windows_caps_sinks_and_splits");
    for (k, v) in [
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Int4Kc, KvFormat::Int4Affine64),
    ] {
        let seqs = if quick() {
            vec![(30, 30), (12, 200), (1, 150)]
        } else {
            vec![(100, 100), (40, 700), (1, 500)]
        };
        let base = Case::new(k, v, 128, seqs);
        let mut c = base.clone();
        c.window = Some(50);
        check(&gpu, &mut rng, &c);
        c.window = Some(0);
        check(&gpu, &mut rng, &c);
        let mut c = base.clone();
        c.cap = Some(5.0);
        check(&gpu, &mut rng, &c);
        let mut c = base.clone();
        c.sinks = true;
        check(&gpu, &mut rng, &c);
        // Key splits merged by the second kernel, with and without sinks and windows.
        // 2, 5, 12 and 24 splits: one, two and four warps a row in the merge.
        for splits in [2, 5, 12, 24] {
            let mut c = base.clone();
            c.splits = Some(splits);
            check(&gpu, &mut rng, &c);
            c.sinks = true;
            c.window = Some(300);
            check(&gpu, &mut rng, &c);
        }
    }
    // A long context: a chunk of 32 tokens after 20k cached, split by the plan's own choice.
    let c = Case::new(
        KvFormat::Fp8E4m3,
        KvFormat::Int4Affine64,
        128,
        vec![(32, 20_000)],
    );
    check(&gpu, &mut rng, &c);
}

/// `int4-kc` keys (`BlockLayout::sealed`): full blocks decoded from their codes, a sequence's open
/// last block read from its f16 window, for blocks of 16, 32 and 64 tokens. Contexts that end
/// inside a block (its window holding 1, 5 or G - 4 tokens, or the whole sequence) and at a
/// block's end (no open block), in one ragged step and apart; values of several formats at
/// several head dims, bf16 queries; sliding windows (whose first step starts inside a block when
/// G is 32 or 64), key splits and sinks.
#[test]
fn int4_kc_sealed_and_open_blocks() {
    let Some(gpu) = require_gpu_or_skip("int4_kc_sealed_and_open_blocks") else {
        return;
    };
    let mut rng = rng("int4_kc_sealed_and_open_blocks");
    let kc = KvFormat::Int4Kc;
    for bs in [16, 32, 64] {
        // (new tokens, context): open blocks of 5, G - 1 (the whole sequence), 1 and G - 4
        // tokens, contexts of whole blocks, padding.
        let ragged = vec![
            (bs + 5, 2 * bs + 5),
            (3, bs - 1),
            (1, 4 * bs + 1),
            (2 * bs, 3 * bs),
            (1, 4 * bs),
            (0, 0),
            (40, 7 * bs - 4),
        ];
        let whole = vec![(bs, bs), (2 * bs, 5 * bs), (1, 3 * bs)];
        for (v, d, q_bf16) in [
            (KvFormat::Int4Affine64, 128, false),
            (KvFormat::F16, 64, true),
            (KvFormat::Fp8E4m3, 256, false),
            (KvFormat::Int8Pth, 96, true),
            (KvFormat::Bf16, 192, true),
        ] {
            if quick() && d != 128 {
                continue;
            }
            assert!(kernel_available_for(kc, v, d, q_bf16), "{v} d{d}");
            for seqs in [&ragged, &whole] {
                let mut c = Case::new(kc, v, d, seqs.clone());
                c.block_size = bs;
                c.q_bf16 = q_bf16;
                check(&gpu, &mut rng, &c);
            }
        }
        let mut c = Case::new(kc, KvFormat::Int4Affine64, 128, ragged.clone());
        c.block_size = bs;
        c.window = Some(bs + 3);
        check(&gpu, &mut rng, &c);
        c.window = None;
        c.splits = Some(3);
        check(&gpu, &mut rng, &c);
        c.sinks = true;
        c.window = Some(2 * bs + 7);
        check(&gpu, &mut rng, &c);
    }
}

/// Two passes (`with_two_pass`: the step's context decoded once into a 16-bit scratch, then the
/// 16-bit kernel over it): every format pair with a quantized side at d128 with f16 and bf16
/// queries; head dims 64 and 256; GQA 6 over blocks of 32 with strided views; a soft cap with
/// sinks, ALiBi, key splits; routed decode rows before the prefill rows; E4M3 operands and a
/// window (which stay fused); and a scratch one block short (fused too). Each case also checks
/// which path ran.
#[test]
fn two_pass_decoded_context() {
    let Some(gpu) = require_gpu_or_skip("two_pass_decoded_context") else {
        return;
    };
    let mut rng = rng("two_pass_decoded_context");
    // The plan's checks and the scratch the workspace holds: 100 tokens in blocks of 16 are 7
    // blocks of 2 KV heads x 128 x 2 sides x 2 bytes.
    let config =
        CacheConfig::new(2, 128, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).expect("config");
    let plan = PrefillPlan::new(
        &gpu,
        &config.layout(),
        PrefillCapacity {
            max_batch: 2,
            num_q_heads: 8,
            max_tokens: 64,
            max_context_len: 256,
        },
    )
    .expect("plan");
    let err = plan
        .clone()
        .with_two_pass(Some(TwoPass::new(0)))
        .unwrap_err();
    assert!(matches!(err, kvq::Error::Config { .. }), "{err}");
    let plan = plan
        .with_two_pass(Some(TwoPass::new(100)))
        .expect("two-pass");
    assert_eq!(plan.two_pass().map(|t| t.min_rows), Some(TWO_PASS_MIN_ROWS));
    let ws = PrefillWorkspace::new(&plan).expect("workspace");
    assert_eq!(ws.scratch_bytes(), 7 * 16 * 2 * 128 * 2 * 2);
    assert!(!ws.two_pass_last_step());
    let quantized = |k: KvFormat, v: KvFormat| k.bits() < 16 || v.bits() < 16;
    for (k, v, q_bf16) in pairs(128) {
        if !quantized(k, v) || (quick() && q_bf16 && k != KvFormat::Int4Kc) {
            continue;
        }
        let mut c = Case::new(k, v, 128, mixed());
        c.q_bf16 = q_bf16;
        c.two_pass = Some(scratch_for(&c));
        check(&gpu, &mut rng, &c);
    }
    for (k, v) in [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Kc, KvFormat::Fp8E5m2),
    ] {
        for d in [64, 256] {
            let mut c = Case::new(k, v, d, vec![(70, 70), (20, 150)]);
            c.two_pass = Some(scratch_for(&c));
            check(&gpu, &mut rng, &c);
        }
        let mut c = Case::new(k, v, 128, vec![(45, 45), (13, 200), (2, 33)]);
        c.group = 6;
        c.block_size = 32;
        c.strided = true;
        c.two_pass = Some(scratch_for(&c));
        check(&gpu, &mut rng, &c);
        let base = Case::new(k, v, 128, mixed());
        let fit = scratch_for(&base);
        let changes: [fn(&mut Case); 5] = [
            |c: &mut Case| {
                c.cap = Some(5.0);
                c.sinks = true;
            },
            |c: &mut Case| c.alibi = Some(1.0),
            |c: &mut Case| c.splits = Some(3),
            |c: &mut Case| c.window = Some(40),
            |c: &mut Case| c.e4m3 = c.k == KvFormat::Fp8E4m3,
        ];
        for change in changes {
            let mut c = base.clone();
            c.two_pass = Some(fit);
            change(&mut c);
            check(&gpu, &mut rng, &c);
        }
        // One block short: the fused path.
        let mut c = base.clone();
        c.two_pass = Some(fit - c.block_size);
        check(&gpu, &mut rng, &c);
        // Routed decode rows first: the scratch holds the prefill rows' contexts only (3 and
        // 38 blocks).
        if kvq::cuda::decode::kernel_available_for(k, v, 128) {
            let mut c = Case::new(k, v, 128, vec![(1, 77), (1, 300), (40, 40), (25, 600)]);
            c.route = true;
            c.two_pass = Some(48 + 608);
            check(&gpu, &mut rng, &c);
        }
    }
}

/// `int4-kc` keys have a kernel with every value format f16 keys have one with, at the head dims
/// its layout takes (multiples of 32), and are no value format. Host functions: no GPU needed.
#[test]
fn int4_kc_pairs_with_a_kernel() {
    for d in HEAD_DIMS.into_iter().chain([32, 48, 160]) {
        for v in KvFormat::ALL {
            for q_bf16 in [false, true] {
                assert_eq!(
                    kernel_available_for(KvFormat::Int4Kc, v, d, q_bf16),
                    d % 32 == 0 && kernel_available_for(KvFormat::F16, v, d, q_bf16),
                    "int4-kc / {v} d{d} bf16 {q_bf16}"
                );
                assert!(!kernel_available_for(v, KvFormat::Int4Kc, d, q_bf16));
            }
        }
    }
    assert!(kernel_available_for(
        KvFormat::Int4Kc,
        KvFormat::Int4Affine64,
        128,
        false
    ));
}

/// Decode rows batched first go to the decode kernel, the rest of the step to the prefill
/// kernel, in one call: every format pair the decode kernel serves, with and without split
/// prefill partials, f16 / bf16 queries, strided views; a step of decode rows only, rows of 3
/// draft tokens, and a step whose decode rows are not first (all of it through the prefill
/// kernel).
#[test]
fn decode_rows_routed_to_the_decode_kernel() {
    let Some(gpu) = require_gpu_or_skip("decode_rows_routed_to_the_decode_kernel") else {
        return;
    };
    let mut rng = rng("decode_rows_routed_to_the_decode_kernel");
    let seqs = vec![(1, 77), (1, 300), (1, 1), (40, 40), (0, 0), (25, 600)];
    for (k, v, q_bf16) in pairs(128) {
        if !kvq::cuda::decode::kernel_available_for(k, v, 128) {
            continue;
        }
        let mut c = Case::new(k, v, 128, seqs.clone());
        c.q_bf16 = q_bf16;
        c.route = true;
        check(&gpu, &mut rng, &c);
    }
    for (k, v) in [
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    ] {
        let mut c = Case::new(k, v, 128, seqs.clone());
        c.route = true;
        c.splits = Some(3);
        check(&gpu, &mut rng, &c);
        c.strided = true;
        check(&gpu, &mut rng, &c);
        c.splits = None;
        c.strided = false;
        c.seqs = vec![(1, 90), (1, 2000), (1, 5)];
        check(&gpu, &mut rng, &c);
        c.seqs = vec![(30, 30), (1, 90), (1, 200)];
        check(&gpu, &mut rng, &c);
        // Speculative verification: 3 tokens a row (the decode plan's q_len is 4), then a 5.
        c.seqs = vec![(3, 50), (3, 400), (3, 3), (5, 70), (20, 100)];
        check(&gpu, &mut rng, &c);
        c.seqs = seqs.clone();
        c.window = Some(20);
        check(&gpu, &mut rng, &c);
        // Routed rows take the window, the cap and the sinks too, split or not.
        c.cap = Some(5.0);
        c.sinks = true;
        check(&gpu, &mut rng, &c);
        c.splits = Some(3);
        check(&gpu, &mut rng, &c);
    }
}

/// ALiBi slopes (the standard geometric series, and 16 times it) in ragged steps that mix
/// prompts, chunks after a cached prefix, decode rows and padding: alone, with a window, a soft
/// cap and sinks, with key splits, over f16, FP8, INT4 and int4-kc keys and bf16 queries; then
/// with the leading decode rows (and 3-token drafts) routed to the decode kernel.
#[test]
fn alibi_slopes_ragged_and_routed() {
    let Some(gpu) = require_gpu_or_skip("alibi_slopes_ragged_and_routed") else {
        return;
    };
    let mut rng = rng("alibi_slopes_ragged_and_routed");
    for (k, v, q_bf16) in [
        (KvFormat::F16, KvFormat::F16, false),
        (KvFormat::Bf16, KvFormat::Bf16, true),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, false),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64, true),
        (KvFormat::Int4Kc, KvFormat::Int4Affine64, false),
    ] {
        let mut c = Case::new(k, v, 128, mixed());
        c.q_bf16 = q_bf16;
        c.alibi = Some(1.0);
        check(&gpu, &mut rng, &c);
        c.alibi = Some(16.0);
        c.window = Some(50);
        c.cap = Some(5.0);
        c.sinks = true;
        check(&gpu, &mut rng, &c);
        c.alibi = Some(1.0);
        c.window = None;
        c.cap = None;
        c.splits = Some(3);
        check(&gpu, &mut rng, &c);
        // Routed: decode rows first, then drafts of 3 tokens, with and without the options.
        let mut c = Case::new(
            k,
            v,
            128,
            vec![(1, 77), (1, 300), (1, 1), (40, 40), (0, 0), (25, 600)],
        );
        c.q_bf16 = q_bf16;
        c.route = true;
        c.alibi = Some(1.0);
        check(&gpu, &mut rng, &c);
        c.alibi = Some(16.0);
        c.cap = Some(5.0);
        c.sinks = true;
        c.window = Some(20);
        c.splits = Some(3);
        check(&gpu, &mut rng, &c);
        c.seqs = vec![(3, 50), (3, 400), (3, 3), (5, 70), (20, 100)];
        c.alibi = Some(4.0);
        c.window = None;
        c.splits = None;
        check(&gpu, &mut rng, &c);
    }
    // Other head dims (64: wide tiles), a GQA group of 6.
    let (k, v) = (KvFormat::Int4Sym32, KvFormat::Fp8E4m3);
    for d in [64, 96, 256] {
        assert!(kernel_available_for(k, v, d, false), "d{d}");
        let mut c = Case::new(k, v, d, vec![(130, 130), (9, 90), (1, 17)]);
        c.group = 6;
        c.num_kv_heads = 1;
        c.alibi = Some(1.0);
        check(&gpu, &mut rng, &c);
    }
}

#[test]
fn merge_states_matches_cpu() {
    let Some(gpu) = require_gpu_or_skip("merge_states_matches_cpu") else {
        return;
    };
    let mut rng = rng("merge_states_matches_cpu");
    let (rows, d) = (300, 128);
    let a: Vec<f32> = (0..rows * d).map(|_| rng.normal()).collect();
    let b: Vec<f32> = (0..rows * d).map(|_| rng.normal()).collect();
    let mut la: Vec<f32> = (0..rows).map(|_| rng.normal() * 3.0).collect();
    let mut lb: Vec<f32> = (0..rows).map(|_| rng.normal() * 3.0).collect();
    la[0] = f32::NEG_INFINITY;
    lb[1] = f32::NEG_INFINITY;
    la[2] = f32::NEG_INFINITY;
    lb[2] = f32::NEG_INFINITY;
    let (want, want_lse) = kvq::cpu::merge_states(&a, &la, &b, &lb, d).expect("cpu merge");
    let s = gpu.stream();
    let (ad, bd) = (s.clone_htod(&a).unwrap(), s.clone_htod(&b).unwrap());
    let (lad, lbd) = (s.clone_htod(&la).unwrap(), s.clone_htod(&lb).unwrap());
    let mut od = s.clone_htod(&vec![f32::NAN; rows * d]).unwrap();
    let mut old = s.clone_htod(&vec![f32::NAN; rows]).unwrap();
    merge_states(&gpu, &ad, &lad, &bd, &lbd, &mut od, &mut old, d).expect("merge");
    let out = s.clone_dtoh(&od).unwrap();
    let lse = s.clone_dtoh(&old).unwrap();
    for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "out[{i}] = {g}, want {w}"
        );
    }
    for (i, (&g, &w)) in lse.iter().zip(&want_lse).enumerate() {
        assert!(
            g == w || (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "lse[{i}] = {g}, want {w}"
        );
    }
}
