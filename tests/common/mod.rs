//! Helpers shared by the integration tests (each test binary includes this with `mod common;`).

#![allow(dead_code)] // each test binary uses a different part

/// A generator with a fresh seed per call (time-based unless `KVQ_SEED` is set), printed with
/// the test's name so that a failure replays with `KVQ_SEED=<n>`.
pub fn fresh_rng(test: &str) -> Rng {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SALT: AtomicU64 = AtomicU64::new(0);
    let seed = std::env::var("KVQ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ SALT.fetch_add(0x1234_5678_9ABC, Ordering::Relaxed)
        });
    eprintln!("{test}: seed {seed}");
    Rng(seed)
}

/// splitmix64: a small deterministic generator, so every failure reproduces from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.uniform()).sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }

    /// `n` roughly normal values times `scale`.
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// One element of `xs`, uniformly.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// The real MiniLM dump the real-data tests read: `minilm_kv.safetensors`, q/k/v of 6 layers,
/// `[512, 12, 32]` f16 each. It is this repository's dev data (`../shared/data` beside the
/// checkout), not part of the crate.
///
/// `KVQ_DATA_DIR` names its folder; CI sets it wherever it has the data, so a file missing
/// there fails the test instead of skipping it silently. Unset, the default folders are
/// searched, and a missing file skips the test with a note on stderr (past the harness's
/// capture), or fails it with `KVQ_REQUIRE_DATA=1`.
pub fn minilm_data(test: &str) -> Option<std::path::PathBuf> {
    use std::io::Write;
    use std::path::{Path, PathBuf};
    const FILE: &str = "minilm_kv.safetensors";
    if let Some(dir) = std::env::var_os("KVQ_DATA_DIR") {
        let file = PathBuf::from(dir).join(FILE);
        assert!(
            file.is_file(),
            "{test}: KVQ_DATA_DIR is set but {} does not exist",
            file.display()
        );
        return Some(file);
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    // `.device/data`: where the GPU machine's copy of the tree keeps it.
    let found = [
        manifest.join("../shared/data"),
        manifest.join(".device/data"),
        PathBuf::from(".device/data"),
    ]
    .into_iter()
    .map(|d| d.join(FILE))
    .find(|f| f.is_file());
    if found.is_none() {
        assert!(
            std::env::var("KVQ_REQUIRE_DATA").map_or(true, |v| v != "1"),
            "{test}: KVQ_REQUIRE_DATA=1 but {FILE} was not found (KVQ_DATA_DIR is unset and \
             ../shared/data lacks it)"
        );
        let _ = writeln!(
            std::io::stderr(),
            "note: {test} SKIPPED: {FILE} not found; set KVQ_DATA_DIR to the folder that holds it"
        );
    }
    found
}

/// Input element types of the GPU tests, built from f32 with round-to-nearest-even.
#[cfg(feature = "cuda")]
pub trait Input: kvq::cuda::ops::DeviceElement + std::fmt::Debug {
    fn from_f32(x: f32) -> Self;
}
#[cfg(feature = "cuda")]
impl Input for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}
#[cfg(feature = "cuda")]
impl Input for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}
#[cfg(feature = "cuda")]
impl Input for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

/// Half a unit in the last place of `x` in a float type of `mantissa` bits (without the
/// implicit one) whose smallest normal exponent is `min_exp`: the rounding of a result to that
/// type, which is no kernel's error. Below the normals the step stays that of the smallest
/// binade (f16's subnormals are 2^-24 apart, whatever their size).
pub fn half_ulp(x: f32, mantissa: i32, min_exp: i32) -> f64 {
    let x = (x as f64).abs().max(f64::MIN_POSITIVE);
    2f64.powi((x.log2().floor() as i32).max(min_exp) - mantissa - 1)
}

/// [`half_ulp`] of f16 (10 mantissa bits, normals from 2^-14).
pub fn half_ulp_f16(x: f32) -> f64 {
    half_ulp(x, 10, -14)
}

/// [`half_ulp`] of bf16 (7 mantissa bits, normals from 2^-126).
pub fn half_ulp_bf16(x: f32) -> f64 {
    half_ulp(x, 7, -126)
}
