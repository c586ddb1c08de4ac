//! Quantize-on-append throughput on the GPU, timed with CUDA events (not host clocks).
//!
//! Input: K and V `[tokens, 8 kv heads, 128]` f16, 1 GiB together (well past L2), appended into
//! pages in shuffled order as an engine would, with two kinds of values: `grid` (2001 values
//! 0.01 apart in [-10, 10]: many land exactly on rounding ties of x / scale, which the encoders'
//! fast paths cannot decide and redo by division) and `random` (uniform in [-10, 10), f16-rounded:
//! ties as rare as in real activations). Throughput counts every byte the kernel must move:
//! K/V read + slot mapping read + codes and metadata written. The same run measures a 2 GiB
//! device-to-device copy (read + write bytes) and prints each append as a fraction of it.
//!
//! Run: `cargo bench --features cuda,bench --bench gpu_append` (prints `SKIPPED: no GPU` without one).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::CudaSlice;
use half::f16;
use kvq::cuda::bench::EventTimer;
use kvq::cuda::ops;
use kvq::cuda::{DeviceCache, Gpu, require_gpu_or_skip};
use kvq::synth::Synth;
use kvq::{CacheConfig, KvFormat};
use std::time::Duration;

const HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK_SIZE: usize = 16;
/// 1 GiB of f16 K and V together.
const TOKENS: usize = (1 << 30) / (2 * HEADS * HEAD_DIM * 2);
const COPY_BYTES: usize = 2 << 30;

const PAIRS: [(KvFormat, KvFormat); 7] = [
    (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    (KvFormat::Int4Kc, KvFormat::Int4Affine64),
    (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
    (KvFormat::Fp8E5m2, KvFormat::Fp8E5m2),
    (KvFormat::Int8Pth, KvFormat::Int8Pth),
    (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
    (KvFormat::F16, KvFormat::F16),
];

/// Inputs shared by every measurement.
struct Inputs {
    gpu: Gpu,
    k: CudaSlice<f16>,
    v: CudaSlice<f16>,
    slots: CudaSlice<i64>,
}

/// The input values of K (and of V).
#[derive(Clone, Copy)]
enum Values {
    Grid,
    Random,
}

impl Values {
    fn name(self) -> &'static str {
        match self {
            Values::Grid => "grid",
            Values::Random => "random",
        }
    }

    /// `n` values, f16-rounded.
    fn host(self, n: usize) -> Vec<f16> {
        match self {
            Values::Grid => (0..n)
                .map(|i| f16::from_f32(((i * 2_654_435_761) % 2001) as f32 / 100.0 - 10.0))
                .collect(),
            Values::Random => Synth::new(1)
                .uniform(n, -10.0, 10.0)
                .into_iter()
                .map(f16::from_f32)
                .collect(),
        }
    }
}

impl Inputs {
    fn new(gpu: Gpu, values: Values) -> Inputs {
        let n = TOKENS * HEADS * HEAD_DIM;
        let host = values.host(n);
        // Pages in a scrambled order, slots contiguous within a page (as paged engines do).
        let pages = TOKENS / BLOCK_SIZE;
        let slots: Vec<i64> = (0..TOKENS)
            .map(|t| {
                let page = (t / BLOCK_SIZE * 7919) % pages;
                (page * BLOCK_SIZE + t % BLOCK_SIZE) as i64
            })
            .collect();
        let s = gpu.stream();
        Inputs {
            k: s.clone_htod(&host).expect("upload k"),
            v: s.clone_htod(&host).expect("upload v"),
            slots: s.clone_htod(&slots).expect("upload slots"),
            gpu,
        }
    }

    /// A fresh cache for a format pair, FP8 (FP4) head scales set so the data uses the range.
    fn cache(&self, k: KvFormat, v: KvFormat) -> DeviceCache {
        let c = CacheConfig::new(HEADS, HEAD_DIM, BLOCK_SIZE, k, v).expect("config");
        let mut d = DeviceCache::new(&self.gpu, c, TOKENS / BLOCK_SIZE).expect("device cache");
        let max = if k == KvFormat::Fp4E2m1 {
            2688.0
        } else {
            448.0
        };
        let s = vec![10.0 / max; HEADS];
        d.set_scales(&s, &s).expect("scales");
        d
    }

    /// Bytes one append moves: inputs and slot mapping read, codes and metadata written; for
    /// int4-kc keys also the f16 window written and read back by the seal, and the sealed
    /// block's s and z.
    fn append_bytes(&self, cache: &DeviceCache) -> u64 {
        let l = cache.layout();
        let written = TOKENS
            * HEADS
            * (l.k_codes.row_bytes + l.k_meta.row_bytes + l.v_codes.row_bytes + l.v_meta.row_bytes);
        let read = 2 * TOKENS * HEADS * HEAD_DIM * 2 + TOKENS * 8;
        let kc = l.config.k_format.block_groups();
        let window = if kc {
            // written, then read by the seal; s and z once per block
            2 * TOKENS * HEADS * l.k_window.row_bytes
                + TOKENS / BLOCK_SIZE * HEADS * l.config.k_format.block_meta_bytes(HEAD_DIM)
        } else {
            0
        };
        (read + written + window) as u64
    }
}

/// Median GB/s of `reps` runs of `f` moving `bytes` each (the crate's CUDA-event timer).
fn gbps(timer: &mut EventTimer, bytes: u64, reps: usize, mut f: impl FnMut()) -> f64 {
    let us = timer
        .median_us(1, reps, false, || {
            f();
            Ok(())
        })
        .expect("timing");
    bytes as f64 / us / 1e3
}

fn bench(c: &mut Criterion) {
    let Some(gpu) = require_gpu_or_skip("gpu_append bench") else {
        return;
    };
    let mut timer = EventTimer::new(&gpu).expect("timer");
    eprintln!("{}", gpu.summary());
    let s = gpu.stream().clone();

    // Reference: device-to-device copy of 2 GiB (read + write bytes).
    let src = s.alloc_zeros::<u8>(COPY_BYTES).expect("alloc");
    let mut dst = s.alloc_zeros::<u8>(COPY_BYTES).expect("alloc");
    let copy_bytes = 2 * COPY_BYTES as u64;
    let copy_gbps = gbps(&mut timer, copy_bytes, 9, || {
        s.memcpy_dtod(&src, &mut dst).expect("copy")
    });

    let mut summary = vec![format!(
        "dtod copy ({} GiB, read+write): {copy_gbps:.0} GB/s",
        COPY_BYTES >> 30
    )];
    let mut group = c.benchmark_group("gpu_append");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    group.throughput(Throughput::Bytes(copy_bytes));
    group.bench_function("dtod_copy_2GiB", |b| {
        b.iter_custom(|iters| {
            timer
                .total(iters, || {
                    s.memcpy_dtod(&src, &mut dst).expect("copy");
                    Ok(())
                })
                .expect("timing")
        })
    });
    drop((src, dst));

    for values in [Values::Grid, Values::Random] {
        let inputs = Inputs::new(gpu.clone(), values);
        for (kf, vf) in PAIRS {
            let mut cache = inputs.cache(kf, vf);
            let bytes = inputs.append_bytes(&cache);
            let mut run = || {
                ops::append(&mut cache, &inputs.slots, &inputs.k, &inputs.v, TOKENS)
                    .expect("append")
            };
            let g = gbps(&mut timer, bytes, 9, &mut run);
            summary.push(format!(
                "append K {kf} / V {vf}, f16 {} values in, {TOKENS} tokens: {:.0} MB moved, {g:.0} GB/s = {:.0}% of dtod copy",
                values.name(),
                bytes as f64 / 1e6,
                100.0 * g / copy_gbps
            ));
            group.throughput(Throughput::Bytes(bytes));
            group.bench_function(format!("append_{kf}_{vf}_f16_{}", values.name()), |b| {
                b.iter_custom(|iters| {
                    timer
                        .total(iters, || {
                            run();
                            Ok(())
                        })
                        .expect("timing")
                })
            });
            assert_eq!(cache.check_appends().expect("counters"), 0);
        }
    }
    group.finish();
    eprintln!("\n== gpu_append summary ==");
    for line in summary {
        eprintln!("{line}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
