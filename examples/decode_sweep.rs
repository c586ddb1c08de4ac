//! Launch-shape sweep of the decode kernel: for chosen cases of the standard grid and format
//! pairs, time every (warps, stages) that fits at several split counts, beside the plan's own
//! choice, with the method of `kvq::cuda::bench` (cold L2, CUDA events, median). This is the
//! data behind `DecodePlan`'s launch model (src/cuda/decode.rs, docs/PERFORMANCE.md).
//!
//! ```sh
//! cargo run --release --features cuda,bench --example decode_sweep -- \
//!     [--case NAME]... [--shape B:L]... [--format bf16|fp8|int4|int4-fp8|int8|fp4|int4-kc|int4-kc-fp8]...
//!     [--splits 1,2,3] [--block-size N] [--iters N] [--ceiling GBPS] [--plan-only]
//!     [--launch SPLITS:WARPS:STAGES]...
//! ```
//! `--case` names a shape family of the grid (`llama3-8b`, `8x22b-tp8`, `mha-32`, ...),
//! `--shape` a batch and context length in it, `--block-size` the cache's tokens per block
//! instead of the case's (int4-kc keys take 16, 32 or 64). Prints one markdown row per launch, `*` marking
//! the plan's choice. `--ceiling` takes the read ceiling as given instead of measuring it, and
//! `--plan-only` times the plan's choice alone: together they make a short run for a profiler
//! (`ncu --kernel-name regex:decode_kernel --launch-count 1 ...`). `--launch` times the plan's
//! choice and the launches given instead of the whole sweep (to compare two launch models in
//! one process).

use kvq::KvFormat;
use kvq::cuda::decode::{DecodeWorkspace, STAGES, WARPS};
use kvq::cuda::{Gpu, bench};

struct Args {
    cases: Vec<String>,
    shapes: Vec<(usize, usize)>,
    formats: Vec<(KvFormat, KvFormat)>,
    splits: Vec<usize>,
    iters: usize,
    ceiling: Option<f64>,
    plan_only: bool,
    launches: Vec<(usize, usize, usize)>,
    block_size: Option<usize>,
}

fn parse_format(name: &str) -> Result<(KvFormat, KvFormat), String> {
    Ok(match name {
        "bf16" => (KvFormat::Bf16, KvFormat::Bf16),
        "fp8" => (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        "int4" => (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        "int4-fp8" => (KvFormat::Int4Sym32, KvFormat::Fp8E4m3),
        "int8" => (KvFormat::Int8Pth, KvFormat::Int8Pth),
        "fp4" => (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
        "int4-kc" => (KvFormat::Int4Kc, KvFormat::Int4Affine64),
        "int4-kc-fp8" => (KvFormat::Int4Kc, KvFormat::Fp8E4m3),
        other => {
            return Err(format!(
                "unknown format '{other}' (bf16, fp8, int4, int4-fp8, int8, fp4, int4-kc, \
                 int4-kc-fp8)"
            ));
        }
    })
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        cases: Vec::new(),
        shapes: Vec::new(),
        formats: Vec::new(),
        splits: vec![1, 2, 3, 4],
        iters: 20,
        ceiling: None,
        plan_only: false,
        launches: Vec::new(),
        block_size: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--case" => a.cases.push(value("--case")?),
            "--shape" => {
                let v = value("--shape")?;
                let (b, l) = v
                    .split_once(':')
                    .ok_or(format!("--shape {v}: expected B:L"))?;
                let num = |x: &str| x.parse::<usize>().map_err(|e| format!("--shape {v}: {e}"));
                a.shapes.push((num(b)?, num(l)?));
            }
            "--format" => a.formats.push(parse_format(&value("--format")?)?),
            "--splits" => {
                a.splits = value("--splits")?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|e| format!("--splits: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--ceiling" => {
                let v = value("--ceiling")?;
                let gbps: f64 = v.parse().map_err(|e| format!("--ceiling {v}: {e}"))?;
                if !(gbps.is_finite() && gbps > 0.0) {
                    return Err(format!("--ceiling {v}: expected GB/s > 0"));
                }
                a.ceiling = Some(gbps);
            }
            "--plan-only" => a.plan_only = true,
            "--launch" => {
                let v = value("--launch")?;
                let n: Vec<usize> = v
                    .split(':')
                    .map(|x| x.parse().map_err(|e| format!("--launch {v}: {e}")))
                    .collect::<Result<_, _>>()?;
                match n[..] {
                    [s, w, st] => a.launches.push((s, w, st)),
                    _ => return Err(format!("--launch {v}: expected SPLITS:WARPS:STAGES")),
                }
            }
            "--iters" => {
                a.iters = value("--iters")?
                    .parse()
                    .map_err(|e| format!("--iters: {e}"))?
            }
            "--block-size" => {
                let v = value("--block-size")?;
                a.block_size = Some(v.parse().map_err(|e| format!("--block-size {v}: {e}"))?);
            }
            "--bench" => {}
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    if a.formats.is_empty() {
        a.formats = vec![
            parse_format("bf16")?,
            parse_format("fp8")?,
            parse_format("int4")?,
        ];
    }
    Ok(a)
}

fn run(args: &Args) -> kvq::Result<()> {
    let gpu = Gpu::new(0)?;
    // On stdout: scripts/launch_fit.py reads the device's bytes per SM cycle from it.
    println!("{}", gpu.summary());
    let mut timer = bench::EventTimer::new(&gpu)?;
    let ceiling = match args.ceiling {
        Some(gbps) => {
            println!("read ceiling: {gbps:.0} GB/s (given, not measured)\n");
            gbps
        }
        None => {
            let probe = bench::read_ceiling(&gpu, &mut timer)?;
            println!("{probe}\n");
            probe.gbps
        }
    };
    println!(
        "| case | B | L | K | V | splits | warps | stages | blocks/SM | stage bytes | µs | % ceiling |"
    );
    println!("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let cases = bench::select(bench::standard_grid(), &args.cases, false)
        .into_iter()
        .filter(|c| args.shapes.is_empty() || args.shapes.contains(&(c.batch, c.context_len)));
    for mut case in cases {
        if let Some(bs) = args.block_size {
            case.block_size = bs;
        }
        for &(k, v) in &args.formats {
            let mut p = bench::PreparedDecode::new(&gpu, &case, k, v, 0x5EED)?;
            let bytes = p.bytes_to_read()? as f64;
            let default = p.plan.clone();
            let mut shapes = vec![(default.clone(), true)];
            for &(n, w, s) in &args.launches {
                shapes.push((default.clone().with_num_splits(n).with_launch(w, s)?, false));
            }
            let sweep = !args.plan_only && args.launches.is_empty();
            let splits: &[usize] = if sweep { &args.splits } else { &[] };
            for &n in splits {
                for w in WARPS {
                    for s in STAGES {
                        if let Ok(plan) = default.clone().with_num_splits(n).with_launch(w, s) {
                            shapes.push((plan, false));
                        }
                    }
                }
            }
            for (plan, is_default) in shapes {
                p.workspace = DecodeWorkspace::new(&plan)?;
                p.plan = plan;
                let us = timer.median_us(2, args.iters, true, || p.run())?;
                let pct = 100.0 * bytes / us / 1e3 / ceiling;
                println!(
                    "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {us:.1} | {pct:.1} |",
                    if is_default { "*" } else { "" },
                    case.case,
                    case.batch,
                    case.context_len,
                    k,
                    v,
                    p.plan.num_splits(),
                    p.plan.warps(),
                    p.plan.stages(),
                    p.plan.ctas_per_sm(),
                    p.plan.stage_bytes(),
                );
            }
        }
    }
    Ok(())
}

fn main() {
    let result = parse_args().and_then(|a| run(&a).map_err(|e| e.to_string()));
    if let Err(e) = result {
        eprintln!("decode_sweep: {e}");
        std::process::exit(1);
    }
}
