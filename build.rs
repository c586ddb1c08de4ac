//! Build script: compiles `cuda/*.cu` with nvcc when the `cuda` feature is on; does nothing
//! otherwise (no CUDA tool is needed for a CPU-only build).
//!
//! Environment:
//! - `DOCS_RS` (set by docs.rs, whose builders have no nvcc) or `KVQ_CHECK_ONLY=1`: skip the
//!   kernels and emit nothing to link, for builds that link nothing (`cargo doc`, `check`,
//!   `clippy`); a binary built this way fails to link.
//! - `NVCC`: the nvcc to use (else `nvcc` on `PATH`, else `$CUDA_HOME/bin/nvcc`).
//! - `CUDA_HOME` / `CUDA_PATH`: toolkit root, for `lib/` or `lib64/` (`libcudart_static.a`).
//! - `KVQ_CUDA_ARCHS`: comma list of targets, e.g. `90a` or `80,89,90a,compute_90`. A number
//!   builds SASS for that SM (`90a` → `sm_90a`), `compute_NN` embeds PTX for JIT on later GPUs.
//!   Default: `80,90a,compute_80`.
//! - `KVQ_PTXAS_VERBOSE=1`: register / spill report per kernel (`cargo build -vv` shows it).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    println!("cargo:rerun-if-env-changed=KVQ_CHECK_ONLY");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if env::var_os("DOCS_RS").is_some() || env::var("KVQ_CHECK_ONLY").is_ok_and(|v| v == "1") {
        println!("cargo:rustc-env=KVQ_CUDA_ARCHS_BUILT=none (a check-only build: no kernels)");
        if env::var_os("DOCS_RS").is_none() {
            // Said once here rather than as a wall of undefined kvq_* symbols at link time.
            println!(
                "cargo:warning=KVQ_CHECK_ONLY=1: the CUDA kernels are not built, so nothing built \
                 this way links (fine for check, clippy and doc)"
            );
        }
        return;
    }
    cuda::build();
}

mod cuda {
    use super::*;

    /// Targets built when `KVQ_CUDA_ARCHS` is unset: Ampere SASS (which Ada runs too: sm_8x
    /// runs sm_80 code), Hopper SASS with its `a` features, and compute_80 PTX so that newer
    /// GPUs can JIT the kernels (from the same front-end pass as the sm_80 SASS). `89` adds
    /// Ada's own SASS (its FP8 conversion instructions), at a third more build time.
    const DEFAULT_ARCHS: &str = "80,90a,compute_80";

    /// Per-file nvcc flags. Quantization math must round exactly as FORMATS.md says, so the
    /// append kernels never let nvcc contract `a * b + c` into an FMA.
    const FILE_FLAGS: &[(&str, &[&str])] = &[("append.cu", &["-fmad=false"])];

    const HELP: &str = "the `cuda` feature needs nvcc (CUDA 13.0). Install it with \
        `eval \"$(scripts/install-cuda-toolkit.sh)\"` (it prints the exports), or set \
        NVCC=/path/to/nvcc (or CUDA_HOME=/path/to/cuda), or build without `--features cuda` \
        (KVQ_CHECK_ONLY=1 skips the kernels for `cargo doc` / `check` / `clippy`, which link \
        nothing)";

    pub fn build() {
        for var in [
            "NVCC",
            "CUDA_HOME",
            "CUDA_PATH",
            "KVQ_CUDA_ARCHS",
            "KVQ_PTXAS_VERBOSE",
            "PATH",
        ] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        println!("cargo:rerun-if-changed=cuda");

        let nvcc = find_nvcc().unwrap_or_else(|| panic!("kvq build: {HELP}"));
        let cuda_home = cuda_home(&nvcc);
        let archs = env::var("KVQ_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
        let gencode = gencode_flags(&archs).unwrap_or_else(|e| panic!("kvq build: {e}"));
        println!(
            "cargo:rustc-env=KVQ_CUDA_ARCHS_BUILT={}",
            built_targets(&archs).join(",")
        );

        let sources = cu_sources(Path::new("cuda"));
        if sources.is_empty() {
            panic!("kvq build: no .cu files under cuda/");
        }
        // The .cu files compile on parallel threads, each whole-program (no relocatable device
        // code), and nvcc's own --threads spreads each file's -gencode targets.
        let jobs: usize = env::var("NUM_JOBS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(2);
        // Every file gets all the jobs: the long one (decode.cu, ~100 instances) then builds
        // its targets in parallel once the short ones are done.
        let nvcc_threads = jobs.max(1);
        let verbose_ptxas = env::var("KVQ_PTXAS_VERBOSE").is_ok_and(|v| v == "1");
        let objects: Vec<PathBuf> = std::thread::scope(|s| {
            let handles: Vec<_> = sources
                .iter()
                .map(|src| {
                    let (nvcc, gencode) = (&nvcc, &gencode);
                    s.spawn(move || compile_one(nvcc, src, gencode, nvcc_threads, verbose_ptxas))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| panic!("kvq build: nvcc failed"))
                })
                .collect()
        });
        // Archive (and let cc emit the link lines, libstdc++ included).
        cc::Build::new()
            .cpp(true)
            .objects(&objects)
            .compile("kvq_cuda");

        link_cudart(&cuda_home);
    }

    /// Compile one .cu file to an object with nvcc. Called directly (not through cc's CUDA
    /// support, which would add host-only flags and `-G` for debug profiles); cc only archives.
    fn compile_one(
        nvcc: &Path,
        src: &Path,
        gencode: &[String],
        threads: usize,
        ptxas_v: bool,
    ) -> PathBuf {
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
        let file = src.file_name().and_then(|f| f.to_str()).unwrap_or_default();
        let flags: Vec<&str> = FILE_FLAGS
            .iter()
            .filter(|(name, _)| *name == file)
            .flat_map(|(_, f)| f.iter().copied())
            .collect();
        // An object is reused while its source, every header it includes and the flags are
        // unchanged: a change to one .cu file (or to headers only it includes) rebuilds that
        // file alone.
        let key = object_key(src, nvcc, gencode, &flags);
        let obj = out_dir.join(format!("{file}.{key:016x}.o"));
        if obj.is_file() && !ptxas_v {
            return obj;
        }
        // Written under another name and renamed when complete: an interrupted build never
        // leaves a partial object under the name a later build would reuse.
        let partial = out_dir.join(format!("{file}.{key:016x}.partial.o"));
        let mut cmd = Command::new(nvcc);
        cmd.arg("-c")
            .arg(src)
            .arg("-o")
            .arg(&partial)
            .args(["-std=c++17", "-O3", "-Icuda", "-Xcompiler=-fPIC"])
            .arg(format!("--threads={threads}"))
            .args(gencode);
        cmd.args(&flags);
        if ptxas_v {
            cmd.arg("-Xptxas=-v");
        }
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("kvq build: running {}: {e}; {HELP}", nvcc.display()));
        // ptxas -v reports go to stderr; show them as build output (cargo build -vv).
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            panic!(
                "kvq build: nvcc failed on {} ({}):\n{}",
                src.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::rename(&partial, &obj)
            .unwrap_or_else(|e| panic!("kvq build: renaming {}: {e}", partial.display()));
        obj
    }

    /// A hash of what an object depends on: the source and, transitively, the local headers it
    /// includes (`#include "…"`, looked up beside the including file, then in `cuda/`), nvcc's
    /// path and the flags.
    fn object_key(src: &Path, nvcc: &Path, gencode: &[String], flags: &[&str]) -> u64 {
        use std::collections::BTreeMap;
        use std::hash::{Hash, Hasher};
        let mut files: BTreeMap<PathBuf, Vec<u8>> = BTreeMap::new();
        let mut todo = vec![src.to_path_buf()];
        while let Some(path) = todo.pop() {
            if files.contains_key(&path) {
                continue;
            }
            let text = std::fs::read(&path).unwrap_or_default();
            for line in String::from_utf8_lossy(&text).lines() {
                let Some(rest) = line.trim_start().strip_prefix("#include \"") else {
                    continue;
                };
                let Some(name) = rest.split('"').next() else {
                    continue;
                };
                let beside = path.parent().map(|d| d.join(name));
                let found = beside
                    .filter(|p| p.is_file())
                    .or_else(|| Some(Path::new("cuda").join(name)).filter(|p| p.is_file()));
                if let Some(p) = found {
                    todo.push(p);
                }
            }
            files.insert(path, text);
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        files.hash(&mut h);
        nvcc.hash(&mut h);
        gencode.hash(&mut h);
        flags.hash(&mut h);
        h.finish()
    }

    /// `NVCC`, else `nvcc` on `PATH`, else `$CUDA_HOME/bin/nvcc` / `$CUDA_PATH/bin/nvcc`.
    fn find_nvcc() -> Option<PathBuf> {
        if let Some(p) = env::var_os("NVCC") {
            let p = PathBuf::from(p);
            return p.is_file().then_some(p);
        }
        if let Some(path) = env::var_os("PATH") {
            if let Some(p) = env::split_paths(&path)
                .map(|d| d.join("nvcc"))
                .find(|p| p.is_file())
            {
                return Some(p);
            }
        }
        ["CUDA_HOME", "CUDA_PATH"]
            .iter()
            .filter_map(env::var_os)
            .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
            .find(|p| p.is_file())
    }

    /// Toolkit root: `CUDA_HOME` / `CUDA_PATH`, else the directory above nvcc's `bin/`.
    fn cuda_home(nvcc: &Path) -> PathBuf {
        ["CUDA_HOME", "CUDA_PATH"]
            .iter()
            .filter_map(env::var_os)
            .map(PathBuf::from)
            .find(|p| p.is_dir())
            .or_else(|| {
                let nvcc = nvcc.canonicalize().ok()?;
                Some(nvcc.parent()?.parent()?.to_path_buf())
            })
            .unwrap_or_else(|| panic!("kvq build: cannot locate the CUDA toolkit root; {HELP}"))
    }

    /// `-gencode` flags for a `KVQ_CUDA_ARCHS` list: one per virtual architecture, so that SASS
    /// and PTX of the same one (`80` and `compute_80`) share its front-end pass (cicc, about half
    /// of a target's compile time) instead of running it twice.
    fn gencode_flags(archs: &str) -> Result<Vec<String>, String> {
        // (virtual architecture, its codes), in the order first named.
        let mut groups: Vec<(String, Vec<String>)> = Vec::new();
        for a in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let (ptx, num) = match a.strip_prefix("compute_") {
                Some(n) => (true, n),
                None => (false, a.strip_prefix("sm_").unwrap_or(a)),
            };
            let digits = num.trim_end_matches(['a', 'f']);
            if digits.len() < 2 || !digits.bytes().all(|c| c.is_ascii_digit()) {
                return Err(format!(
                    "KVQ_CUDA_ARCHS entry '{a}' is not an SM number like 80, 90a or compute_80"
                ));
            }
            let code = if ptx {
                format!("compute_{num}")
            } else {
                format!("sm_{num}")
            };
            let arch = format!("compute_{num}");
            match groups.iter_mut().find(|(v, _)| *v == arch) {
                Some((_, codes)) if !codes.contains(&code) => codes.push(code),
                Some(_) => {}
                None => groups.push((arch, vec![code])),
            }
        }
        if groups.is_empty() {
            return Err("KVQ_CUDA_ARCHS names no target".into());
        }
        Ok(groups
            .into_iter()
            .map(|(arch, codes)| format!("-gencode=arch={arch},code=[{}]", codes.join(",")))
            .collect())
    }

    /// Human-readable names of what was built, for `kvq info`.
    fn built_targets(archs: &str) -> Vec<String> {
        archs
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| {
                if a.starts_with("compute_") || a.starts_with("sm_") {
                    a.to_string()
                } else {
                    format!("sm_{a}")
                }
            })
            .collect()
    }

    fn cu_sources(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|e| e == "cu"))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Link the static CUDA runtime (it loads libcuda at run time, so binaries still start on
    /// machines without a driver) and the system libraries it needs.
    fn link_cudart(cuda_home: &Path) {
        let candidates = [
            cuda_home.join("lib64"),
            cuda_home.join("lib"),
            cuda_home.join("targets/x86_64-linux/lib"),
            cuda_home.join("targets/sbsa-linux/lib"),
        ];
        let dir = candidates
            .iter()
            .find(|d| d.join("libcudart_static.a").is_file())
            .unwrap_or_else(|| {
                panic!(
                    "kvq build: libcudart_static.a not found under {}; {HELP}",
                    cuda_home.display()
                )
            });
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=static=cudart_static");
        for lib in ["dl", "rt", "pthread"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
}
