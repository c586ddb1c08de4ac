//! Decode bandwidth over the standard grid, against a read ceiling measured in the same run.
//!
//! ```sh
//! cargo run --release --features cuda,plot --example decode_bench -- [--out DIR] [--iters N]
//!     [--case NAME]... [--quick]
//! cargo run --release --features plot --example decode_bench -- --plot DIR/decode_bench.json
//! cargo run --release --features cuda --example decode_bench -- --ceiling-only
//! ```
//! Prints a markdown table (µs median, bytes, GB/s, % of ceiling, speedup vs bf16) and writes
//! `decode_bench.{md,csv,json}` plus, with feature `plot`, `decode_bench.png` (% of ceiling vs
//! B·L per format) into DIR (default `bench-out`). `--plot` re-renders the tables and the PNG
//! from a JSON report, beside it, on any machine (no GPU needed). `--ceiling-only` measures just
//! the read ceiling and prints every probe variant, ending with `BEST <variant> <GB/s>` as
//! `examples/read_ceiling.rs` does (exit status 3 if a variant read the wrong bytes). Method:
//! `kvq::cuda::bench`.

use std::path::{Path, PathBuf};

struct Args {
    out: PathBuf,
    iters: usize,
    cases: Vec<String>,
    quick: bool,
    plot_only: Option<PathBuf>,
    ceiling_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        out: PathBuf::from("bench-out"),
        iters: 30,
        cases: Vec::new(),
        quick: false,
        plot_only: None,
        ceiling_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--out" => a.out = value("--out")?.into(),
            "--iters" => {
                a.iters = value("--iters")?
                    .parse()
                    .map_err(|e| format!("--iters: {e}"))?
            }
            "--case" => a.cases.push(value("--case")?),
            "--quick" => a.quick = true,
            "--plot" => a.plot_only = Some(value("--plot")?.into()),
            "--ceiling-only" => a.ceiling_only = true,
            // Cargo's bench harness flag, when run through `cargo bench`.
            "--bench" => {}
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(a)
}

fn write_outputs(report: &kvq::report::DecodeBenchReport, dir: &Path) -> Result<(), String> {
    report.write_files(dir).map_err(|e| e.to_string())?;
    // A machine without a font still gets the tables; `--plot` redraws the PNG elsewhere.
    if let Err(e) = plot(report, dir) {
        eprintln!("decode_bench: no PNG: {e}");
    }
    Ok(())
}

#[cfg(feature = "plot")]
fn plot(report: &kvq::report::DecodeBenchReport, dir: &Path) -> Result<(), String> {
    let png = dir.join("decode_bench.png");
    let case = kvq::plot::chart_case(report).ok_or("an empty report")?;
    kvq::plot::percent_of_ceiling_png(report, case, &png).map_err(|e| e.to_string())?;
    eprintln!("wrote {}", png.display());
    Ok(())
}

#[cfg(not(feature = "plot"))]
fn plot(_: &kvq::report::DecodeBenchReport, _: &Path) -> Result<(), String> {
    eprintln!("(built without feature `plot`: no PNG)");
    Ok(())
}

#[cfg(feature = "cuda")]
fn measure(args: &Args) -> Result<kvq::report::DecodeBenchReport, String> {
    use kvq::cuda::{Gpu, bench};
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    eprintln!("{}", gpu.summary());
    let cases = bench::select(bench::standard_grid(), &args.cases, args.quick);
    let pairs = bench::standard_pairs();
    let bar = indicatif::ProgressBar::new((cases.len() * pairs.len()) as u64 + 1);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .expect("static template"),
    );
    let report = bench::run_grid(&gpu, &cases, &pairs, args.iters, |msg| {
        if msg.starts_with("read ceiling") || msg.starts_with("skipped") {
            bar.println(msg);
        } else {
            bar.inc(1);
            bar.set_message(msg.to_string());
        }
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    Ok(report)
}

#[cfg(not(feature = "cuda"))]
fn measure(_: &Args) -> Result<kvq::report::DecodeBenchReport, String> {
    Err("built without feature `cuda`: only --plot REPORT.json is available".into())
}

/// The read ceiling alone; false when a variant read the wrong bytes.
#[cfg(feature = "cuda")]
fn ceiling_only() -> Result<bool, String> {
    use kvq::cuda::{Gpu, bench};
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    println!("{}", gpu.summary());
    let mut timer = bench::EventTimer::new(&gpu).map_err(|e| e.to_string())?;
    let ceiling = bench::read_ceiling(&gpu, &mut timer).map_err(|e| e.to_string())?;
    println!("\n{}\n{ceiling}", ceiling.markdown());
    println!("BEST {} {:.1}", ceiling.variant, ceiling.gbps);
    Ok(!ceiling.any_wrong_checksum())
}

#[cfg(not(feature = "cuda"))]
fn ceiling_only() -> Result<bool, String> {
    Err("built without feature `cuda`: --ceiling-only needs a GPU build".into())
}

fn main() {
    let result = parse_args().and_then(|args| {
        if args.ceiling_only {
            if !ceiling_only()? {
                std::process::exit(3);
            }
            return Ok(());
        }
        let report = match &args.plot_only {
            Some(json) => {
                let text = std::fs::read_to_string(json)
                    .map_err(|e| format!("{}: {e}", json.display()))?;
                let report =
                    kvq::report::DecodeBenchReport::from_json(&text).map_err(|e| e.to_string())?;
                let dir = json.parent().unwrap_or(Path::new("."));
                return write_outputs(&report, dir);
            }
            None => measure(&args)?,
        };
        write_outputs(&report, &args.out)?;
        println!("{}", report.markdown());
        Ok(())
    });
    if let Err(e) = result {
        eprintln!("decode_bench: {e}");
        std::process::exit(1);
    }
}
