//! Attention over the paged cache for long queries (`kvq::cuda::prefill`): the compute-bound
//! prompt and chunk shapes and the memory-bound extend shapes of docs/PERFORMANCE.md, Llama-3-8B
//! heads (32 q / 8 KV, head_dim 128, pages of 16, bf16 queries), per cache format; fp8-e4m3 also
//! with E4M3 operands on FP8 tensor cores (`PrefillPlan::with_e4m3_operands`, "(e4m3 MMAs)").
//!
//! Times are CUDA-event medians with the L2 flushed before each run. TFLOP/s count causal FLOPs
//! once (4 · head_dim per visible (query, key) pair and query head); GB/s count the bytes the
//! kernel must read (codes, metadata, tables, q) against the streaming-read ceiling measured in
//! the same run.
//!
//! ```sh
//! cargo run --release --features cuda,bench --example prefill_bench -- [--iters N] \
//!     [--shape SUBSTRING] [--format bf16|fp8-e4m3|int4|int4-k32|int4-kc] [--json FILE] \
//!     [--splits N] [--route-q-len N] [--seqs SHAPES] [--f16] [--two-pass [--two-pass-rows N]]
//! ```
//!
//! `--f16` adds an f16 cache (bf16 queries, f16 operands) to the formats: the 16-bit kernel on
//! the operands the quantized sides decode to, i.e. the second pass of a step that decodes its
//! quantized context into an f16 scratch first (docs/PERFORMANCE.md, session 48). It also times,
//! per quantized format, the decode of the step's context to f16 by `ops::gather_dequantize`
//! (the first pass, over-counted by its allocations and table uploads): rows `... gathered to
//! f16`.
//! `--two-pass` adds, per quantized format (not with E4M3 operands), the plan with two passes
//! (`PrefillPlan::with_two_pass`, a scratch that holds the shape's contexts): rows `... (two
//! passes)`, or `... (two-pass plan, fused)` where the step stayed fused (too few query rows a
//! sequence: `--two-pass-rows N` sets that bound, 0 takes two passes at every shape).
//! `--splits N` forces the key splits of every shape; `--route-q-len N` sends, in every shape,
//! the leading sequences with the same 1 to N new tokens to the decode kernel
//! (`PrefillPlan::with_decode_rows` with a decode plan of `q_len` N). `--seqs` replaces the grid
//! by the shapes given, `;` between shapes, `+` between groups of sequences, a group
//! `NEW:CONTEXTxB` (B sequences of NEW tokens after CONTEXT - NEW cached ones): e.g.
//! `--seqs "1536:1536x1;1024:4096x2+1:16384x8"`.

use kvq::cuda::bench::{self, EventTimer};
use kvq::cuda::decode::{DeviceBlockTables, TablesCapacity};
use kvq::cuda::prefill::{
    PrefillCapacity, PrefillPlan, PrefillStep, PrefillWorkspace, TokenRows, TwoPass,
};
use kvq::cuda::{DeviceCache, Gpu, ops};
use kvq::{CacheConfig, KvFormat, Result};

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const D: usize = 128;
const BLOCK: usize = 16;

/// A step: per sequence (new tokens, context); `route`: its leading one-token rows through
/// the decode kernel (`PrefillPlan::with_decode_rows`).
struct Shape {
    name: String,
    seqs: Vec<(usize, usize)>,
    route: bool,
}

/// A mixed step: 63 decode rows after 16k tokens, then a 1k-token chunk after 3k.
fn mixed() -> Vec<(usize, usize)> {
    let mut seqs = vec![(1, 16384); 63];
    seqs.push((1024, 4096));
    seqs
}

/// The shapes of `--seqs` (see the module docs), or None where one does not parse.
fn parse_shapes(spec: &str) -> Option<Vec<Shape>> {
    let group = |g: &str| -> Option<Vec<(usize, usize)>> {
        let (n, rest) = g.trim().split_once(':')?;
        let (ctx, b) = rest.split_once('x').unwrap_or((rest, "1"));
        let (n, ctx, b): (usize, usize, usize) =
            (n.parse().ok()?, ctx.parse().ok()?, b.parse().ok()?);
        (n >= 1 && n <= ctx && b >= 1).then(|| vec![(n, ctx); b])
    };
    spec.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let seqs = s
                .split('+')
                .map(group)
                .collect::<Option<Vec<_>>>()?
                .concat();
            Some(Shape {
                name: s.trim().to_string(),
                seqs,
                route: false,
            })
        })
        .collect()
}

fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "prompt 4k, B=1".into(),
            seqs: vec![(4096, 4096)],
            route: false,
        },
        Shape {
            name: "prompt 4k, B=4".into(),
            seqs: vec![(4096, 4096); 4],
            route: false,
        },
        Shape {
            name: "2k chunk after 30k, B=1".into(),
            seqs: vec![(2048, 32768)],
            route: false,
        },
        Shape {
            name: "extend 16 after 16k, B=32".into(),
            seqs: vec![(16, 16384); 32],
            route: false,
        },
        Shape {
            name: "extend 64 after 16k, B=8".into(),
            seqs: vec![(64, 16384); 8],
            route: false,
        },
        Shape {
            name: "extend 16 after 128k, B=1".into(),
            seqs: vec![(16, 131072)],
            route: false,
        },
        Shape {
            name: "mixed: 63 decodes after 16k + 1k chunk".into(),
            seqs: mixed(),
            route: false,
        },
        Shape {
            name: "mixed, decode rows routed".into(),
            seqs: mixed(),
            route: true,
        },
    ]
}

/// Visible (query, key) pairs of a causal step.
fn pairs(seqs: &[(usize, usize)]) -> f64 {
    seqs.iter()
        .map(|&(n, l)| {
            let (n, l) = (n as f64, l as f64);
            n * (l - n) + n * (n + 1.0) / 2.0
        })
        .sum()
}

struct Row {
    shape: String,
    format: String,
    us: f64,
    tflops: f64,
    gbps: f64,
    pct: f64,
    /// With `--f16`, a quantized cache: the median time of decoding every sequence's context to
    /// f16 (`ops::gather_dequantize`, one call a sequence, its output allocation and table
    /// upload included: the first pass of a two-pass step, over-counted).
    gather_us: Option<f64>,
}

/// What every measurement shares: the read ceiling (GB/s), timed runs, forced key splits, and
/// the longest rows sent to the decode kernel in every shape (`with_decode_rows`).
#[derive(Clone, Copy)]
struct Opts {
    ceiling: f64,
    iters: usize,
    splits: Option<usize>,
    route_q_len: Option<usize>,
    gather: bool,
    /// `--two-pass-rows`: the two-pass plans' `min_rows`.
    two_pass_rows: Option<usize>,
}

/// How a format's attention runs: fused (decoded operands), fused with E4M3 operands
/// (`with_e4m3_operands`), or planned with two passes (`with_two_pass`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Fused,
    E4m3,
    TwoPass,
}

fn measure(
    gpu: &Gpu,
    timer: &mut EventTimer,
    shape: &Shape,
    k: KvFormat,
    v: KvFormat,
    mode: Mode,
    opts: &Opts,
) -> Result<Row> {
    let Opts {
        ceiling,
        iters,
        splits,
        route_q_len,
        gather,
        two_pass_rows,
    } = *opts;
    let e4m3 = mode == Mode::E4m3;
    let s = gpu.stream().clone();
    let config = CacheConfig::new(KV_HEADS, D, BLOCK, k, v)?;
    let blocks: Vec<usize> = shape.seqs.iter().map(|&(_, l)| l.div_ceil(BLOCK)).collect();
    let num_blocks: usize = blocks.iter().sum();
    let mut cache = DeviceCache::new(gpu, config, num_blocks)?;
    if k.has_head_scale() || v.has_head_scale() {
        cache.set_scales(&[0.01f32; KV_HEADS], &[0.01f32; KV_HEADS])?;
    }
    // Fill every block with random rows, 4096 tokens per append.
    const CHUNK: usize = 4096;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    };
    let kv: Vec<half::bf16> = (0..CHUNK * KV_HEADS * D)
        .map(|_| half::bf16::from_f32(rnd()))
        .collect();
    let kv_dev = s.clone_htod(&kv)?;
    let slots_total = num_blocks * BLOCK;
    for start in (0..slots_total).step_by(CHUNK) {
        let n = CHUNK.min(slots_total - start);
        let slots: Vec<i32> = (start..start + n).map(|x| x as i32).collect();
        let slots = s.clone_htod(&slots)?;
        ops::append(&mut cache, &slots, &kv_dev, &kv_dev, n)?;
    }
    let mut tables = DeviceBlockTables::with_capacity(
        &cache,
        TablesCapacity {
            max_batch: shape.seqs.len(),
            max_context_len: blocks.iter().copied().max().unwrap_or(1) * BLOCK,
        },
    )?;
    let mut next = 0i32;
    let mut table_rows = Vec::new();
    for (b, (&(_, l), &nb)) in shape.seqs.iter().zip(&blocks).enumerate() {
        let row: Vec<i32> = (next..next + nb as i32).collect();
        next += nb as i32;
        tables.set_row(b, &row, l)?;
        table_rows.push(row);
    }
    tables.set_batch(shape.seqs.len())?;
    tables.upload()?;
    let mut qo = vec![0u32];
    for &(n, _) in &shape.seqs {
        qo.push(qo.last().unwrap() + n as u32);
    }
    let total = *qo.last().unwrap() as usize;
    let max_len = shape.seqs.iter().map(|s| s.1).max().unwrap_or(1);
    let plan = PrefillPlan::new(
        gpu,
        cache.layout(),
        PrefillCapacity {
            max_batch: shape.seqs.len(),
            num_q_heads: Q_HEADS,
            max_tokens: total,
            max_context_len: max_len,
        },
    )?
    .with_num_splits(splits)
    .with_e4m3_operands(e4m3)
    .with_two_pass((mode == Mode::TwoPass).then(|| {
        let mut t = TwoPass::new(num_blocks * BLOCK);
        t.min_rows = two_pass_rows.unwrap_or(t.min_rows);
        t
    }))?;
    let route_q_len = route_q_len.filter(|_| kvq::cuda::decode::kernel_available(k, v));
    let plan = if shape.route || route_q_len.is_some() {
        let q_len = route_q_len.unwrap_or(1);
        let decode = kvq::cuda::DecodePlan::new(
            gpu,
            cache.layout(),
            kvq::cuda::DecodeCapacity {
                max_batch: shape.seqs.len(),
                num_q_heads: Q_HEADS,
                max_q_len: q_len,
                max_context_len: max_len,
            },
        )?;
        plan.with_decode_rows(decode)?
    } else {
        plan
    };
    let mut ws = PrefillWorkspace::new(&plan)?;
    let q: Vec<half::bf16> = (0..total * Q_HEADS * D)
        .map(|_| half::bf16::from_f32(rnd() * 0.25))
        .collect();
    let q_dev = s.clone_htod(&q)?;
    let qo_i32: Vec<i32> = qo.iter().map(|&x| x as i32).collect();
    let qo_dev = s.clone_htod(&qo_i32)?;
    let mut out = s.alloc_zeros::<half::bf16>(total * Q_HEADS * D)?;
    let rows = TokenRows::contiguous(Q_HEADS, D);
    let us = timer.median_us(3, iters, true, || {
        plan.prefill(
            &mut ws,
            &cache,
            &tables,
            PrefillStep {
                qo_indptr: &qo,
                qo_indptr_dev: &qo_dev,
                q: &q_dev,
                q_rows: rows,
                out: &mut out,
                out_rows: rows,
                lse: None,
                sinks: None,
                alibi_slopes: None,
            },
        )
    })?;
    let two_passes = ws.two_pass_last_step();
    // E4M3 operands and two passes read the same cache as decoded FP8: its gather is timed
    // once, there.
    let gather_us = if gather && mode == Mode::Fused && k.bits() < 16 {
        Some(timer.median_us(3, iters, true, || {
            for (row, &(_, l)) in table_rows.iter().zip(&shape.seqs) {
                ops::gather_dequantize::<half::f16>(&cache, row, l)?;
            }
            Ok(())
        })?)
    } else {
        None
    };
    cache.check_appends()?;
    let flops = 4.0 * D as f64 * Q_HEADS as f64 * pairs(&shape.seqs);
    // Codes and metadata per token (int4-kc: a block's s and z shared by its tokens).
    let row_bytes = (k.bytes_per_element_at(D, BLOCK) + v.bytes_per_element_at(D, BLOCK))
        * (D * KV_HEADS) as f64;
    let kv_bytes: f64 = shape.seqs.iter().map(|&(_, l)| l as f64 * row_bytes).sum();
    let bytes = kv_bytes + (total * Q_HEADS * D * 2) as f64 + (num_blocks * 4) as f64;
    let gbps = bytes / (us * 1e-6) / 1e9;
    Ok(Row {
        shape: shape.name.clone(),
        format: {
            let pair = if k == v {
                k.name().to_string()
            } else {
                format!("{}/{}", k.name(), v.name())
            };
            match (mode, two_passes) {
                (Mode::Fused, _) => pair,
                (Mode::E4m3, _) => format!("{pair} (e4m3 MMAs)"),
                (Mode::TwoPass, true) => format!("{pair} (two passes)"),
                (Mode::TwoPass, false) => format!("{pair} (two-pass plan, fused)"),
            }
        },
        us,
        tflops: flops / (us * 1e-6) / 1e12,
        gbps,
        pct: 100.0 * gbps / ceiling,
        gather_us,
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .and_then(|x| x.parse().ok())
        .unwrap_or(20);
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let (only_shape, only_format, json) = (arg("--shape"), arg("--format"), arg("--json"));
    let with_f16 = args.iter().any(|a| a == "--f16");
    let with_two_pass = args.iter().any(|a| a == "--two-pass");
    let mut rows = Vec::new();
    let gpu = Gpu::new(0)?;
    eprintln!("{}", gpu.summary());
    let mut timer = EventTimer::new(&gpu)?;
    let probe = bench::read_ceiling(&gpu, &mut timer)?;
    eprintln!("{probe}");
    let ceiling = probe.gbps;
    let opts = Opts {
        ceiling,
        iters,
        splits: arg("--splits").and_then(|x| x.parse().ok()),
        route_q_len: arg("--route-q-len").and_then(|x| x.parse().ok()),
        gather: with_f16,
        two_pass_rows: arg("--two-pass-rows").and_then(|x| x.parse().ok()),
    };
    println!(
        "prefill, Llama-3-8B heads (32 q / 8 KV, d=128, pages of 16, bf16 q and out) on {}; \
         read ceiling {ceiling:.0} GB/s ({})\n",
        gpu.props().name,
        probe.variant
    );
    println!("| shape | KV format | µs | TFLOP/s | GB/s | % of ceiling |");
    println!("|---|---|---:|---:|---:|---:|");
    let shapes = match arg("--seqs") {
        Some(spec) => parse_shapes(&spec).ok_or_else(|| {
            kvq::Error::InvalidArgument(format!("--seqs {spec:?}: want NEW:CONTEXTxB groups"))
        })?,
        None => shapes(),
    };
    for shape in shapes {
        if only_shape
            .as_ref()
            .is_some_and(|x| !shape.name.contains(x.as_str()))
        {
            continue;
        }
        let quantized = [
            (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
            (KvFormat::Int4Kc, KvFormat::Int4Affine64),
        ];
        let mut formats = vec![(KvFormat::Bf16, KvFormat::Bf16, Mode::Fused)];
        for (k, v) in quantized {
            formats.push((k, v, Mode::Fused));
            if k == KvFormat::Fp8E4m3 {
                formats.push((k, v, Mode::E4m3));
            }
            if with_two_pass {
                formats.push((k, v, Mode::TwoPass));
            }
        }
        if with_f16 {
            formats.push((KvFormat::F16, KvFormat::F16, Mode::Fused));
        }
        for (k, v, mode) in formats {
            if only_format
                .as_ref()
                .is_some_and(|x| !k.name().starts_with(x.as_str()))
            {
                continue;
            }
            // Routed decode rows need a decode kernel for the pair (int4-kc keys have none).
            if shape.route && !kvq::cuda::decode::kernel_available(k, v) {
                continue;
            }
            match measure(&gpu, &mut timer, &shape, k, v, mode, &opts) {
                Ok(r) => {
                    println!(
                        "| {} | {} | {:.1} | {:.1} | {:.0} | {:.1} |",
                        r.shape, r.format, r.us, r.tflops, r.gbps, r.pct
                    );
                    if let Some(g) = r.gather_us {
                        println!(
                            "| {} | {} gathered to f16 | {g:.1} | | | |",
                            r.shape, r.format
                        );
                    }
                    rows.push(serde_json::json!({
                        "shape": r.shape, "format": r.format, "median_us": r.us,
                        "tflops": r.tflops, "gbps": r.gbps, "pct_of_ceiling": r.pct,
                    }));
                }
                Err(e) => println!("| {} | {}/{} | error: {e} | | | |", shape.name, k, v),
            }
        }
    }
    if let Some(path) = json {
        let report = serde_json::json!({
            "gpu": gpu.props().name,
            "ceiling_gbps": ceiling,
            "ceiling_variant": probe.variant,
            "model": "Llama-3-8B heads: 32 q / 8 KV, head_dim 128, pages of 16, bf16 q and out",
            "iters": iters,
            "rows": rows,
        });
        let text = serde_json::to_string_pretty(&report).expect("report serializes");
        std::fs::write(&path, text)
            .map_err(|e| kvq::Error::InvalidArgument(format!("writing {path}: {e}")))?;
    }
    Ok(())
}
