//! `kvq bench`: the decode bandwidth grid of `examples/decode_bench.rs`, from the installed tool.

use crate::CliError;
use std::path::PathBuf;

/// Arguments of `kvq bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Directory for decode_bench.{md,csv,json,png}.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Only these cases (llama3-8b, 8x22b-tp8, mha-32, gqa-d64, gqa-d256); repeatable.
    #[arg(long = "case")]
    cases: Vec<String>,
    /// Only shapes with at least 256k tokens in the batch.
    #[arg(long)]
    quick: bool,
}

#[cfg(feature = "cuda")]
pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    use kvq::cuda::{Gpu, bench};
    let grid = bench::standard_grid();
    if let Some(name) = args
        .cases
        .iter()
        .find(|n| !grid.iter().any(|c| c.case == n.as_str()))
    {
        let mut known: Vec<&str> = Vec::new();
        for c in &grid {
            if !known.contains(&&*c.case) {
                known.push(&c.case);
            }
        }
        return Err(CliError::new(format!(
            "--case '{name}' is not a bench case (the cases: {})",
            known.join(", ")
        )));
    }
    // Found unwritable now rather than after the GPU run.
    std::fs::create_dir_all(&args.out)
        .map_err(|e| CliError::new(format!("cannot create '{}': {e}", args.out.display())))?;
    let gpu = Gpu::new(0)?;
    eprintln!("{}", gpu.summary());
    let cases = bench::select(grid, &args.cases, args.quick);
    if cases.is_empty() {
        return Err(CliError::new("no bench case matches the --case filter"));
    }
    let pairs = bench::standard_pairs();
    let bar = crate::progress(cases.len() * pairs.len() + 1, "decode bench");
    let report = bench::run_grid(&gpu, &cases, &pairs, args.iters as usize, |msg| {
        if msg.starts_with("read ceiling") || msg.starts_with("skipped") {
            bar.println(msg);
        } else {
            bar.inc(1);
        }
    })?;
    bar.finish_and_clear();
    report.write_files(&args.out)?;
    crate::print_out(&report.markdown())?;
    // The tables are written: a chart that cannot be drawn (no font) costs a note, not them.
    if let Some(case) = kvq::plot::chart_case(&report) {
        let png = args.out.join("decode_bench.png");
        if let Err(e) = kvq::plot::percent_of_ceiling_png(&report, case, &png) {
            eprintln!("kvq: note: no chart: {e}");
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: &BenchArgs) -> Result<(), CliError> {
    Err(CliError::new(
        "this kvq was built without CUDA support: rebuild with --features cli,cuda to benchmark",
    ))
}
