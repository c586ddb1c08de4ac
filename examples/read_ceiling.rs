//! The streaming-read ceiling on its own: every read variant of `cuda/bandwidth.cu`, checked to
//! read every byte once and timed exactly as the benches time it (`kvq::cuda::bench::
//! read_ceiling`), then the winner. Compare its last line with `scripts/read_ceiling.py`'s.
//!
//! ```sh
//! cargo run --release --features cuda --example read_ceiling -- [--gib N] [--rounds N]
//!     [--reps N] [--only NAME]... [--json PATH]
//! ```
//! Prints a table (median, slowest and fastest read per variant), the ceiling line the benches
//! print, and last `BEST <variant> <GB/s>`. Exit status 3 when a variant read the wrong bytes
//! (its checksum line says which); it is left out of the ceiling either way.

use kvq::cuda::bench::{self, CeilingOptions};
use kvq::cuda::{Gpu, probe};

struct Args {
    opts: CeilingOptions,
    json: Option<std::path::PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        opts: CeilingOptions::default(),
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |name: &str, v: String| v.parse::<usize>().map_err(|e| format!("{name}: {e}"));
        match arg.as_str() {
            "--gib" => {
                let g: f64 = value("--gib")?.parse().map_err(|e| format!("--gib: {e}"))?;
                if !(g > 0.0 && g < 1024.0) {
                    return Err(format!("--gib {g}: expected a size in (0, 1024)"));
                }
                a.opts.bytes = (g * (1u64 << 30) as f64) as usize;
            }
            "--rounds" => a.opts.rounds = num("--rounds", value("--rounds")?)?,
            "--reps" => a.opts.reps = num("--reps", value("--reps")?)?,
            "--only" => {
                let name = value("--only")?;
                if !probe::variant_names().contains(&name.as_str()) {
                    return Err(format!(
                        "--only {name}: no such variant ({})",
                        probe::variant_names().join(", ")
                    ));
                }
                a.opts.only.push(name);
            }
            "--json" => a.json = Some(value("--json")?.into()),
            "--bench" => {}
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(a)
}

fn run(args: &Args) -> Result<bool, String> {
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    println!("{}", gpu.summary());
    let o = &args.opts;
    println!(
        "each read: {:.2} GiB of varied non-zero words; {} rounds x {} timed reads per variant \
         (after 1 untimed), L2 flushed (read) before each, CUDA events, median",
        o.bytes as f64 / (1u64 << 30) as f64,
        o.rounds,
        o.reps
    );
    let mut timer = bench::EventTimer::new(&gpu).map_err(|e| e.to_string())?;
    let ceiling = bench::read_ceiling_with(&gpu, &mut timer, o).map_err(|e| e.to_string())?;

    println!("\n{}", ceiling.markdown());
    let bad = ceiling.any_wrong_checksum();
    if gpu.props().compute_capability.0 >= 9
        && ceiling
            .variants
            .iter()
            .any(|v| v.name.starts_with("bulk") && v.gbps.is_none())
    {
        println!("note: a bulk-copy variant did not run on an sm_90+ device (see its note)");
    }
    if bad {
        println!("CHECK FAILED: a variant read the wrong bytes (left out of the ceiling)");
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&ceiling).expect("ceiling serializes");
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    println!("\n{ceiling}");
    println!("BEST {} {:.1}", ceiling.variant, ceiling.gbps);
    Ok(!bad)
}

fn main() {
    match parse_args().and_then(|a| run(&a)) {
        Ok(true) => {}
        Ok(false) => std::process::exit(3),
        Err(e) => {
            eprintln!("read_ceiling: {e}");
            std::process::exit(1);
        }
    }
}
