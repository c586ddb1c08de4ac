//! Attention's share of one decode step of an 8x22B MoE served on 8 GPUs, per KV-cache format.
//!
//! Scenario: 56 layers, 48 query heads and 8 KV heads of head_dim 128, tensor-parallel over 8
//! GPUs, so each GPU holds 1 KV head and 6 query heads of every layer; 64 concurrent streams at
//! 16,384 tokens. One layer is timed on this GPU (CUDA events, L2 flushed, median) and multiplied
//! by 56; the floor is the step's KV bytes per GPU over the read ceiling measured in the same run.
//! "In a row" times the 56 launches back to back (two caches taking turns, so that no launch
//! finds the last one's bytes in L2), as an engine's step issues them: on Hopper each launch
//! is placed while the one before finishes (programmatic dependent launch; `KVQ_DECODE_PDL=0`
//! turns it off). The published column is the figure this answers (attention per token on
//! 8×H100).
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
        "| KV format | KV bytes / step / GPU | floor (ms) | measured (ms) | % of ceiling | in a row (ms) | % of ceiling | published 8×H100 (ms) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, (k, v), published_ms) in rows {
        let seed = 0x5EED ^ CONTEXT as u64;
        let mut layers = [
            bench::PreparedDecode::new(&gpu, &case, k, v, seed)?,
            bench::PreparedDecode::new(&gpu, &case, k, v, seed ^ 1)?,
        ];
        let layer_us = timer.median_us(3, iters, true, || layers[0].run())?;
        let step_us = timer.median_us(1, iters.min(10), true, || {
            (0..LAYERS).try_for_each(|l| layers[l % 2].run())
        })?;
        let step_bytes = layers[0].bytes_to_read()? as f64 * LAYERS as f64;
        let floor_ms = step_bytes / (ceiling * 1e9) * 1e3;
        let pct = |ms: f64| 100.0 * floor_ms / ms;
        let (measured_ms, row_ms) = (layer_us * LAYERS as f64 / 1e3, step_us / 1e3);
        println!(
            "| {name} | {:.2} GB | {floor_ms:.2} | {measured_ms:.2} | {:.1} | {row_ms:.2} | {:.1} | \
             {published_ms:.1} |",
            step_bytes / 1e9,
            pct(measured_ms),
            pct(row_ms),
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
