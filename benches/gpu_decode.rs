//! Fused paged decode attention on the GPU, timed with CUDA events over CUDA-graph replays.
//!
//! Model shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, block 16,
//! q_len 1), bf16 queries (f16 for the f16 cache). For each cache format and (batch, context)
//! the pool is filled with random values through the append kernel, pages are scattered in a
//! random order, and small working sets are replicated (and cycled through) until they are at
//! least 4x the L2, so timings measure HBM, not cache.
//!
//! Bandwidth counts the bytes the kernel must read: K/V codes and metadata of every context
//! token, the used block-table entries, and q. The same run measures the streaming-read ceiling
//! (`bench::read_ceiling`: the fastest of the reads in `cuda/bandwidth.cu`, over 4 GiB) and
//! prints each decode as a fraction of it, plus the fp8 / int4 speed-up over bf16 at B=64,
//! L=16384.
//!
//! Run: `cargo bench --features cuda,bench --bench gpu_decode` (`KVQ_BENCH_QUICK=1`: fewer shapes).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use half::{bf16, f16};
use kvq::cache::BlockTables;
use kvq::cuda::decode::{
    DecodeCapacity, DecodeElement, DecodePlan, DecodeWorkspace, DeviceBlockTables,
};
use kvq::cuda::ops;
use kvq::cuda::{DeviceCache, Gpu, bench, require_gpu_or_skip};
use kvq::report::decode_bytes_to_read;
use kvq::{CacheConfig, KvFormat};
use std::time::Duration;

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;
/// Tokens appended per append launch while filling a pool.
const FILL_CHUNK: usize = 16384;

/// (batch, context length) shapes.
fn shapes() -> Vec<(usize, usize)> {
    if std::env::var("KVQ_BENCH_QUICK").is_ok_and(|v| v == "1") {
        vec![(1, 32768), (64, 16384)]
    } else {
        vec![
            (1, 32768),
            (1, 131072),
            (16, 4096),
            (64, 1024),
            (8, 16384),
            (64, 16384),
        ]
    }
}

/// (name, K, V, bf16 queries)
const FORMATS: [(&str, KvFormat, KvFormat, bool); 4] = [
    ("bf16", KvFormat::Bf16, KvFormat::Bf16, true),
    ("f16", KvFormat::F16, KvFormat::F16, false),
    ("fp8-e4m3", KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, true),
    ("int4", KvFormat::Int4Sym32, KvFormat::Int4Affine64, true),
];

/// Cheap deterministic pseudo-random f32 in about [-4, 4].
fn noise(i: usize, salt: u64) -> f32 {
    let mut z = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
}

/// (warps per block, stages per warp) swept (besides the plan's own) at these (batch, len).
const SWEEP_LAUNCH: [(usize, usize); 6] = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4)];
const SWEEP_SHAPES: [(usize, usize); 2] = [(1, 32768), (64, 16384)];

/// One measured configuration.
struct Row {
    format: &'static str,
    batch: usize,
    len: usize,
    splits: usize,
    warps: usize,
    stages: usize,
    ctas_per_sm: usize,
    bytes: u64,
    time: Duration,
}

/// A filled cache with `copies` disjoint sets of block tables for one (format, shape).
struct Setup {
    cache: DeviceCache,
    tables: Vec<DeviceBlockTables>,
    bytes: u64,
}

fn setup(gpu: &Gpu, k: KvFormat, v: KvFormat, batch: usize, len: usize) -> Setup {
    let config = CacheConfig::new(KV_HEADS, HEAD_DIM, BLOCK, k, v).expect("config");
    let layout = config.layout();
    let pages = len.div_ceil(BLOCK);
    let per_token = KV_HEADS
        * (layout.k_codes.row_bytes
            + layout.k_meta.row_bytes
            + layout.v_codes.row_bytes
            + layout.v_meta.row_bytes);
    let kv_bytes = batch * len * per_token;
    let l2 = gpu.props().l2_bytes.max(1 << 20);
    let copies = (4 * l2).div_ceil(kv_bytes).max(1);
    let num_blocks = copies * batch * pages;
    let mut cache = DeviceCache::new(gpu, config, num_blocks).expect("cache");
    let scale = vec![4.0 / 448.0; KV_HEADS];
    cache.set_scales(&scale, &scale).expect("scales");

    // Fill every slot with random values through the append kernel.
    let s = gpu.stream();
    let n = FILL_CHUNK * KV_HEADS * HEAD_DIM;
    let kh: Vec<f16> = (0..n).map(|i| f16::from_f32(noise(i, 1))).collect();
    let vh: Vec<f16> = (0..n).map(|i| f16::from_f32(noise(i, 2))).collect();
    let (kd, vd) = (s.clone_htod(&kh).expect("k"), s.clone_htod(&vh).expect("v"));
    let slots_total = num_blocks * BLOCK;
    let mut slots_dev = s.alloc_zeros::<i64>(FILL_CHUNK).expect("slots");
    for start in (0..slots_total).step_by(FILL_CHUNK) {
        let count = FILL_CHUNK.min(slots_total - start);
        let slots: Vec<i64> = (start..start + count).map(|x| x as i64).collect();
        s.memcpy_htod(&slots, &mut slots_dev).expect("slots");
        ops::append(&mut cache, &slots_dev, &kd, &vd, count).expect("append");
    }
    assert_eq!(cache.check_appends().expect("counters"), 0);

    // Scatter pages: copy c, sequence b, page i → a random block.
    let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
    let mut z = 0x2545_F491_4F6C_DD1Du64;
    for i in (1..perm.len()).rev() {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        perm.swap(i, (z % (i as u64 + 1)) as usize);
    }
    let tables = (0..copies)
        .map(|c| {
            let rows: Vec<&[i32]> = (0..batch)
                .map(|b| &perm[(c * batch + b) * pages..][..pages])
                .collect();
            let t = BlockTables::from_rows(&rows, &vec![len; batch]).expect("tables");
            DeviceBlockTables::new(&cache, &t).expect("device tables")
        })
        .collect();
    let bytes = decode_bytes_to_read(&layout, &vec![len; batch], Q_HEADS, 1, 2).expect("bytes");
    Setup {
        cache,
        tables,
        bytes,
    }
}

/// Capture one decode per table copy in a CUDA graph (this also proves the call captures:
/// no allocation, no synchronization), and return it with its plan; `launch` overrides the
/// plan's (warps, stages) (None if they do not fit).
#[allow(clippy::too_many_arguments)]
fn capture<T: BenchElem>(
    gpu: &Gpu,
    su: &Setup,
    batch: usize,
    len: usize,
    out: &mut CudaSlice<T>,
    q: &CudaSlice<T>,
    keep: &mut Vec<DecodeWorkspace>,
    launch: Option<(usize, usize)>,
) -> Option<(CudaGraph, DecodePlan)> {
    let mut plan = DecodePlan::new(
        gpu,
        su.cache.layout(),
        DecodeCapacity {
            max_batch: batch,
            num_q_heads: Q_HEADS,
            max_q_len: 1,
            max_context_len: len,
        },
    )
    .expect("plan");
    if let Some((w, n)) = launch {
        plan = plan.with_launch(w, n).ok()?;
    }
    let mut ws = DecodeWorkspace::new(&plan).expect("workspace");
    // One eager call first (module load, attribute setup), then the capture.
    plan.decode(&mut ws, &su.cache, &su.tables[0], q, out, None)
        .expect("decode");
    gpu.synchronize().expect("sync");
    let s = gpu.stream();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    for t in &su.tables {
        plan.decode(&mut ws, &su.cache, t, q, out, None)
            .expect("decode in capture");
    }
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("graph");
    graph.upload().expect("upload graph");
    keep.push(ws);
    Some((graph, plan))
}

/// Query element types of the bench: f16 and bf16.
trait BenchElem: DecodeElement {
    fn from_f32(x: f32) -> Self;
}
impl BenchElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl BenchElem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

fn run_format<T: BenchElem>(
    gpu: &Gpu,
    timer: &mut bench::EventTimer,
    c: &mut Criterion,
    (name, kf, vf): (&'static str, KvFormat, KvFormat),
    rows: &mut Vec<Row>,
    sweep: &mut Vec<Row>,
) {
    let s = gpu.stream().clone();
    let mut group = c.benchmark_group(format!("gpu_decode_{name}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500));
    for (batch, len) in shapes() {
        let su = setup(gpu, kf, vf, batch, len);
        let n = batch * Q_HEADS * HEAD_DIM;
        let qh: Vec<T> = (0..n).map(|i| T::from_f32(noise(i, 3))).collect();
        let q = s.clone_htod(&qh).expect("q");
        let mut out = s.clone_htod(&vec![T::from_f32(0.0); n]).expect("out");
        let mut keep = Vec::new();
        let copies = su.tables.len() as u32;
        let row = |timer: &mut bench::EventTimer, graph: &CudaGraph, plan: &DecodePlan| Row {
            format: name,
            batch,
            len,
            splits: plan.num_splits(),
            warps: plan.warps(),
            stages: plan.stages(),
            ctas_per_sm: plan.ctas_per_sm(),
            bytes: su.bytes,
            time: Duration::from_secs_f64(
                timer
                    .median_us(1, 15, false, || {
                        graph.launch().expect("launch");
                        Ok(())
                    })
                    .expect("timing")
                    / 1e6,
            ) / copies,
        };
        if SWEEP_SHAPES.contains(&(batch, len)) {
            for launch in SWEEP_LAUNCH {
                if let Some((g, p)) =
                    capture(gpu, &su, batch, len, &mut out, &q, &mut keep, Some(launch))
                {
                    sweep.push(row(timer, &g, &p));
                }
            }
        }
        let (graph, plan) =
            capture(gpu, &su, batch, len, &mut out, &q, &mut keep, None).expect("default plan");
        rows.push(row(timer, &graph, &plan));
        group.throughput(Throughput::Bytes(su.bytes * copies as u64));
        group.bench_function(format!("B{batch}_L{len}"), |b| {
            b.iter_custom(|iters| {
                timer
                    .total(iters, || {
                        graph.launch().expect("launch");
                        Ok(())
                    })
                    .expect("timing")
            })
        });
        drop(graph);
        gpu.synchronize().expect("sync");
    }
    group.finish();
}

fn bench(c: &mut Criterion) {
    let Some(gpu) = require_gpu_or_skip("gpu_decode bench") else {
        return;
    };
    // The timer also turns off cudarc's event tracking (one stream only), so graph capture
    // sees no cross-stream event waits.
    let mut timer = bench::EventTimer::new(&gpu).expect("timer");
    eprintln!("{}", gpu.summary());
    // Streaming-read ceiling of this device, this run (the crate's own probe and timer).
    let probe = bench::read_ceiling(&gpu, &mut timer).expect("read ceiling");
    let ceiling = probe.gbps;

    let (mut rows, mut sweep) = (Vec::new(), Vec::new());
    for (name, kf, vf, q_bf16) in FORMATS {
        if q_bf16 {
            run_format::<bf16>(&gpu, &mut timer, c, (name, kf, vf), &mut rows, &mut sweep);
        } else {
            run_format::<f16>(&gpu, &mut timer, c, (name, kf, vf), &mut rows, &mut sweep);
        }
    }

    eprintln!("\n== gpu_decode summary: Llama-3-8B shape (32 q / 8 kv heads, d 128, block 16) ==");
    eprintln!("{probe} (4 GiB reads)");
    let print = |title: &str, rows: &[Row]| {
        eprintln!("{title}");
        eprintln!(
            "{:<9} {:>4} {:>7} {:>6} {:>3} {:>3} {:>3} {:>8} {:>8} {:>6} {:>6}",
            "format",
            "B",
            "L",
            "splits",
            "wrp",
            "stg",
            "cta",
            "MB read",
            "time us",
            "GB/s",
            "%ceil"
        );
        for r in rows {
            let gbs = r.bytes as f64 / r.time.as_secs_f64() / 1e9;
            eprintln!(
                "{:<9} {:>4} {:>7} {:>6} {:>3} {:>3} {:>3} {:>8.1} {:>8.1} {:>6.0} {:>5.1}%",
                r.format,
                r.batch,
                r.len,
                r.splits,
                r.warps,
                r.stages,
                r.ctas_per_sm,
                r.bytes as f64 / 1e6,
                r.time.as_secs_f64() * 1e6,
                gbs,
                100.0 * gbs / ceiling
            );
        }
    };
    print(
        "launch sweep (plan's splits, other warps x stages):",
        &sweep,
    );
    print("plan defaults:", &rows);
    let at = |f: &str| {
        rows.iter()
            .find(|r| r.format == f && r.batch == 64 && r.len == 16384)
            .map(|r| r.time.as_secs_f64())
    };
    if let (Some(b), Some(f8), Some(i4)) = (at("bf16"), at("fp8-e4m3"), at("int4")) {
        eprintln!(
            "B=64 L=16384 speed-up over bf16: fp8 {:.2}x, int4 {:.2}x",
            b / f8,
            b / i4
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
