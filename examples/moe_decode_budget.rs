//! Attention's share of one decode step of an 8x22B MoE served on 8 GPUs, per KV-cache format.
//!
//! Scenario: 56 layers, 48 query heads and 8 KV heads of head_dim 128, tensor-parallel over 8
//! GPUs, so each GPU holds 1 KV head and 6 query heads of every layer; 64 concurrent streams at
//! 16,384 tokens. One layer is timed on this GPU (CUDA events, L2 flushed, median) and multiplied
//! by 56; the floor is the step's KV bytes per GPU over the read ceiling measured in the same run.
//! The published column is the figure this answers (attention per token on 8×H100).
//!
//! ```sh
//! cargo run --release --features cuda,bench --example moe_decode_budget -- [--iters N]
//! ```

const LAYERS: usize = 56;
const BATCH: usize = 64;
const CONTEXT: usize = 16384;

fn run(iters: usize) -> kvq::Result<()> {
    use kvq::KvFormat;
    use kvq::cuda::{Gpu, bench};

    let gpu = Gpu::new(0)?;
    eprintln!("{}", gpu.summary());
    let mut timer = bench::EventTimer::new(&gpu)?;
    let probe = bench::read_ceiling(&gpu, &mut timer)?;
    eprintln!("{probe}");
    let ceiling = probe.gbps;
    let case = bench::DecodeCase::moe_8x22b_tp8(BATCH, CONTEXT);
    let rows = [
        ("f16", (KvFormat::F16, KvFormat::F16), 15.2),
        ("fp8-e4m3", (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3), 8.8),
        (
            "int4 (k32/v64)",
            (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
            6.1,
        ),
    ];
    println!(
        "8x22B decode step, per GPU (1 KV head, 6 q heads, d=128), B={BATCH}, L={CONTEXT}, \
         {LAYERS} layers; read ceiling {ceiling:.0} GB/s ({}) on {}\n",
        probe.variant,
        gpu.props().name
    );
    println!(
        "| KV format | KV bytes / step / GPU | floor (ms) | measured (ms) | % of ceiling | published 8×H100 (ms) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, pair, published_ms) in rows {
        let row = bench::measure(&gpu, &mut timer, &case, pair, ceiling, iters)?;
        let step_bytes = row.bytes as f64 * LAYERS as f64;
        let floor_ms = step_bytes / (ceiling * 1e9) * 1e3;
        let measured_ms = row.median_us * LAYERS as f64 / 1e3;
        println!(
            "| {name} | {:.2} GB | {floor_ms:.2} | {measured_ms:.2} | {:.1} | {published_ms:.1} |",
            step_bytes / 1e9,
            row.pct_of_ceiling
        );
    }
    Ok(())
}

fn main() {
    let mut iters = 30;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next().map(|v| v.parse::<usize>())) {
            ("--iters", Some(Ok(n))) => iters = n,
            _ => {
                eprintln!("usage: moe_decode_budget [--iters N]");
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = run(iters) {
        eprintln!("moe_decode_budget: {e}");
        std::process::exit(1);
    }
}
