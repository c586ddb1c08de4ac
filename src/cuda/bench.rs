//! Decode benchmarking on the GPU: the shapes the crate is judged on, a CUDA-event timer that
//! flushes L2 between runs, the streaming-read ceiling, and a driver that turns them into a
//! [`DecodeBenchReport`]. Shared by `examples/decode_bench.rs`, `examples/moe_decode_budget.rs`
//! and `kvq bench`, so every figure the crate publishes is measured the same way.
//!
//! Method: each timed run is preceded by a streaming read of a buffer of twice the L2 size, so
//! the decode reads its cache from HBM (as it does in a real step, where every layer reads
//! different memory) and the host has queued the launch before the start event fires. The flush
//! reads rather than writes: a write would leave the L2 full of dirty lines whose write-back
//! would then be charged to the timed kernel (about 13 µs for 60 MB at 4.5 TB/s). Time is
//! the median over runs of the CUDA-event interval around the decode (main and merge kernels).
//! Bandwidth counts [`decode_bytes_to_read`] over that time. The ceiling ([`read_ceiling`]) is
//! the fastest of the streaming-read variants of `cuda/bandwidth.cu` over a 4 GiB buffer, each
//! checked to read every byte, timed the same way, in the same process.

use super::decode::{DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables};
use super::ops::append;
use super::probe::stream_read;
use super::{DeviceCache, Gpu, driver_err, probe};
use crate::cache::BlockTables;
use crate::error::{Error, Result};
use crate::format::KvFormat;
use crate::layout::CacheConfig;
use crate::report::{DecodeBenchReport, DecodeBenchRow, decode_bytes_to_read};
pub use crate::report::{DecodeCase, ProbeVariant, ReadCeiling};
use crate::synth::Synth;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice};
use half::{bf16, f16};
use std::time::Duration;

/// The grid of issue 5: Llama-3-8B over (B, L), the 8x22B per-GPU shape, MHA, and head_dim
/// 64 / 256.
pub fn standard_grid() -> Vec<DecodeCase> {
    let mut grid: Vec<DecodeCase> = [
        (1, 4096),
        (16, 4096),
        (64, 4096),
        (64, 16384),
        (128, 8192),
        (8, 65536),
        (1, 32768),
        (1, 131072),
    ]
    .into_iter()
    .map(|(b, l)| DecodeCase::llama3_8b(b, l))
    .collect();
    grid.push(DecodeCase::moe_8x22b_tp8(64, 16384));
    let base = DecodeCase::llama3_8b(32, 8192);
    grid.push(DecodeCase {
        case: "mha-32".into(),
        num_kv_heads: 32,
        ..base.clone()
    });
    grid.push(DecodeCase {
        case: "gqa-d64".into(),
        head_dim: 64,
        batch: 64,
        context_len: 16384,
        ..base.clone()
    });
    grid.push(DecodeCase {
        case: "gqa-d256".into(),
        head_dim: 256,
        num_q_heads: 16,
        num_kv_heads: 4,
        ..base
    });
    grid
}

/// The cases of `grid` named in `names` (all when empty); with `quick`, only those with at
/// least 256k tokens in the batch (where the bandwidth targets apply).
pub fn select(grid: Vec<DecodeCase>, names: &[String], quick: bool) -> Vec<DecodeCase> {
    grid.into_iter()
        .filter(|c| names.is_empty() || names.iter().any(|n| c.case == n.as_str()))
        .filter(|c| !quick || c.batch * c.context_len >= 64 * 4096)
        .collect()
}

/// The cache format pairs the benches compare: bf16 and f16 baselines, FP8, INT8 per
/// token-head, FP4 (E2M1), grouped INT4, and INT4 keys with FP8 values.
pub fn standard_pairs() -> Vec<(KvFormat, KvFormat)> {
    vec![
        (KvFormat::Bf16, KvFormat::Bf16),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int8Pth, KvFormat::Int8Pth),
        (KvFormat::Fp4E2m1, KvFormat::Fp4E2m1),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Int4Sym32, KvFormat::Fp8E4m3),
    ]
}

/// Times GPU work with CUDA events, reading a buffer of twice the L2 before every run.
pub struct EventTimer {
    gpu: Gpu,
    flush: CudaSlice<u8>,
    sink: CudaSlice<f32>,
    start: Vec<CudaEvent>,
    end: Vec<CudaEvent>,
}

impl EventTimer {
    /// A timer whose flush buffer is twice the device's L2 (at least 128 MiB).
    ///
    /// It turns off cudarc's per-buffer event tracking for the context: that bookkeeping costs
    /// host time on every launch, and if the host falls behind the GPU the gap would be timed
    /// as kernel time. Benchmarks order all work on the one stream of their [`Gpu`], which is
    /// what the tracking would otherwise guard.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        gpu.bind()?;
        // SAFETY: the bench process queues every launch and copy on `gpu`'s single stream, so
        // stream order alone keeps buffer uses ordered.
        unsafe { gpu.context().disable_event_tracking() };
        let bytes = (2 * gpu.props().l2_bytes)
            .max(128 << 20)
            .next_multiple_of(16);
        let flush = gpu
            .stream()
            .alloc_zeros::<u8>(bytes)
            .map_err(driver_err("allocating the L2 flush buffer"))?;
        let sink = gpu
            .stream()
            .alloc_zeros::<f32>(4096)
            .map_err(driver_err("allocating the L2 flush sink"))?;
        Ok(EventTimer {
            gpu: gpu.clone(),
            flush,
            sink,
            start: Vec::new(),
            end: Vec::new(),
        })
    }

    fn events(&mut self, n: usize) -> Result<()> {
        let ctx = self.gpu.context().clone();
        while self.start.len() < n {
            let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
            self.start.push(
                ctx.new_event(flags)
                    .map_err(driver_err("creating an event"))?,
            );
            self.end.push(
                ctx.new_event(flags)
                    .map_err(driver_err("creating an event"))?,
            );
        }
        Ok(())
    }

    /// Median GPU time in µs of `run` over `iters` runs after `warmup` untimed ones; with
    /// `flush_l2` the flush buffer is read before each run.
    pub fn median_us(
        &mut self,
        warmup: usize,
        iters: usize,
        flush_l2: bool,
        run: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let times = self.times_us(warmup, iters, flush_l2, run)?;
        Ok(times[times.len() / 2])
    }

    /// GPU times in µs of `run`, as [`median_us`](Self::median_us) measures them, sorted
    /// (at least one).
    pub fn times_us(
        &mut self,
        warmup: usize,
        iters: usize,
        flush_l2: bool,
        mut run: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let iters = iters.max(1);
        self.events(iters)?;
        let s = self.gpu.stream().clone();
        for _ in 0..warmup {
            run()?;
        }
        for i in 0..iters {
            if flush_l2 {
                stream_read(&self.gpu, &self.flush, self.flush.len(), &mut self.sink)?;
            }
            self.start[i]
                .record(&s)
                .map_err(driver_err("recording an event"))?;
            run()?;
            self.end[i]
                .record(&s)
                .map_err(driver_err("recording an event"))?;
        }
        self.gpu.synchronize()?;
        let mut times = (0..iters)
            .map(|i| {
                self.start[i]
                    .elapsed_ms(&self.end[i])
                    .map(|ms| ms as f64 * 1e3)
                    .map_err(driver_err("reading an event"))
            })
            .collect::<Result<Vec<f64>>>()?;
        times.sort_by(f64::total_cmp);
        Ok(times)
    }
}

impl EventTimer {
    /// GPU time of `iters` back-to-back runs of `run` between one pair of events (criterion's
    /// `iter_custom`); no L2 flush.
    pub fn total(&mut self, iters: u64, mut run: impl FnMut() -> Result<()>) -> Result<Duration> {
        self.events(1)?;
        let s = self.gpu.stream().clone();
        self.start[0]
            .record(&s)
            .map_err(driver_err("recording an event"))?;
        for _ in 0..iters {
            run()?;
        }
        self.end[0]
            .record(&s)
            .map_err(driver_err("recording an event"))?;
        let ms = self.start[0]
            .elapsed_ms(&self.end[0])
            .map_err(driver_err("reading an event"))?;
        Ok(Duration::from_secs_f64(ms as f64 / 1e3))
    }
}

/// How [`read_ceiling_with`] measures.
#[derive(Debug, Clone)]
pub struct CeilingOptions {
    /// Bytes each read covers: many times any L2, so that every read comes from DRAM.
    pub bytes: usize,
    /// Rounds over all variants; each round times every variant `reps` times. Interleaving the
    /// variants spreads slow drift (clocks, temperature) over all of them.
    pub rounds: usize,
    /// Timed reads per variant and round (after one untimed), each after an L2 flush.
    pub reps: usize,
    /// Only the variants with these names (all when empty).
    pub only: Vec<String>,
}

impl Default for CeilingOptions {
    fn default() -> Self {
        CeilingOptions {
            bytes: 4 << 30,
            rounds: 3,
            reps: 11,
            only: Vec::new(),
        }
    }
}

/// The streaming-read ceiling: every read variant of `cuda/bandwidth.cu` that this device runs
/// reads a 4 GiB buffer of varied non-zero words, is checked to have read every byte once (its
/// word sum), and is timed ([`CeilingOptions::default`]); the ceiling is the best median.
pub fn read_ceiling(gpu: &Gpu, timer: &mut EventTimer) -> Result<ReadCeiling> {
    read_ceiling_with(gpu, timer, &CeilingOptions::default())
}

/// [`read_ceiling`] with explicit options.
pub fn read_ceiling_with(
    gpu: &Gpu,
    timer: &mut EventTimer,
    opts: &CeilingOptions,
) -> Result<ReadCeiling> {
    const SEED: u32 = 0x6B76_7121;
    let bytes = opts.bytes.next_multiple_of(16).max(16);
    gpu.bind()?;
    let s = gpu.stream();
    let mut src = s
        .alloc_zeros::<u8>(bytes)
        .map_err(driver_err("allocating the read-ceiling buffer"))?;
    probe::stream_fill(gpu, &mut src, bytes, SEED)?;
    let expected = probe::fill_word_sum(bytes, SEED);
    let mut sink = s
        .alloc_zeros::<u32>(probe::SINK_WORDS)
        .map_err(driver_err("allocating the read-ceiling sink"))?;

    let mut variants = Vec::new();
    let mut timed: Vec<(usize, usize)> = Vec::new(); // (variant index, position in `variants`)
    for (i, name) in probe::variant_names().into_iter().enumerate() {
        if !opts.only.is_empty() && !opts.only.iter().any(|o| o == name) {
            continue;
        }
        s.memset_zeros(&mut sink)
            .map_err(driver_err("zeroing the read-ceiling sink"))?;
        let note = match probe::stream_read_variant(gpu, i, &src, bytes, &mut sink) {
            Err(Error::Unsupported(why)) => Some(format!("unavailable: {why}")),
            Err(e) => return Err(e),
            Ok(()) => {
                let words = s
                    .clone_dtoh(&sink)
                    .map_err(driver_err("reading the read-ceiling sink"))?;
                let got = probe::sink_sum(&words);
                (got != expected)
                    .then(|| format!("wrong checksum: {got:#010x}, expected {expected:#010x}"))
            }
        };
        if note.is_none() {
            timed.push((i, variants.len()));
        }
        variants.push(ProbeVariant {
            name: name.to_string(),
            gbps: None,
            range_gbps: None,
            note,
        });
    }

    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..opts.rounds.max(1) {
        for &(i, at) in &timed {
            let t = timer.times_us(1, opts.reps.max(1), true, || {
                probe::stream_read_variant(gpu, i, &src, bytes, &mut sink)
            })?;
            times[at].extend(t);
        }
    }
    let gbps = |us: f64| bytes as f64 / us / 1e3;
    for (v, t) in variants.iter_mut().zip(&mut times) {
        if t.is_empty() {
            continue;
        }
        t.sort_by(f64::total_cmp);
        v.gbps = Some(gbps(t[t.len() / 2]));
        v.range_gbps = Some((gbps(t[t.len() - 1]), gbps(t[0])));
    }
    let (best_gbps, best_name) = variants
        .iter()
        .filter_map(|v| v.gbps.map(|g| (g, v.name.clone())))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .ok_or_else(|| {
            Error::Cuda(format!(
                "no streaming-read variant measured: {}",
                variants
                    .iter()
                    .map(|v| format!("{}: {}", v.name, v.note.as_deref().unwrap_or("not run")))
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        })?;
    Ok(ReadCeiling {
        gbps: best_gbps,
        variant: best_name,
        bytes: bytes as u64,
        variants,
    })
}

/// A cache filled with synthetic data and everything one decode call of a case needs.
pub struct PreparedDecode {
    /// The shape.
    pub case: DecodeCase,
    /// The pool, filled by the append kernel.
    pub cache: DeviceCache,
    /// One table row per sequence, pages in random order.
    pub tables: DeviceBlockTables,
    /// The plan of the case's capacity.
    pub plan: DecodePlan,
    /// The plan's workspace.
    pub workspace: DecodeWorkspace,
    q: Query,
}

enum Query {
    F16(CudaSlice<f16>, CudaSlice<f16>),
    Bf16(CudaSlice<bf16>, CudaSlice<bf16>),
}

/// Tokens appended per launch while filling a bench cache.
const FILL_CHUNK: usize = 4096;

impl PreparedDecode {
    /// Build a pool of exactly the blocks the batch needs, fill every slot with synthetic K/V
    /// (normal, with outlier key channels; FP8 scales calibrated from it) through the GPU
    /// append kernel, and give each sequence a random permutation of blocks, as a long-running
    /// server's allocator would.
    pub fn new(gpu: &Gpu, case: &DecodeCase, k: KvFormat, v: KvFormat, seed: u64) -> Result<Self> {
        let config = CacheConfig::new(case.num_kv_heads, case.head_dim, case.block_size, k, v)?;
        let blocks_per_seq = case.context_len.div_ceil(case.block_size);
        let num_blocks = case.batch * blocks_per_seq;
        let mut cache = DeviceCache::new(gpu, config, num_blocks)?;

        let mut synth = Synth::new(seed);
        let row = case.num_kv_heads * case.head_dim;
        let kh = synth.with_outlier_channels(FILL_CHUNK, case.num_kv_heads, case.head_dim, 4, 8.0);
        let vh = synth.normal(FILL_CHUNK * row, 1.0);
        let amax = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale =
            |f: KvFormat, x: &[f32]| f.head_scale().map_or(1.0, |h| h.scale_from_amax(amax(x)));
        cache.set_scales(
            &vec![scale(k, &kh); case.num_kv_heads],
            &vec![scale(v, &vh); case.num_kv_heads],
        )?;
        let s = gpu.stream();
        let to_f16 = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>();
        let kd = s
            .clone_htod(&to_f16(&kh))
            .map_err(driver_err("uploading bench keys"))?;
        let vd = s
            .clone_htod(&to_f16(&vh))
            .map_err(driver_err("uploading bench values"))?;
        let num_slots = num_blocks * case.block_size;
        let mut slots_d = s
            .alloc_zeros::<i32>(FILL_CHUNK)
            .map_err(driver_err("allocating bench slots"))?;
        for first in (0..num_slots).step_by(FILL_CHUNK) {
            let n = FILL_CHUNK.min(num_slots - first);
            let slots: Vec<i32> = (first..first + n).map(|x| x as i32).collect();
            s.memcpy_htod(&slots, &mut slots_d)
                .map_err(driver_err("uploading bench slots"))?;
            append(&mut cache, &slots_d, &kd, &vd, n)?;
        }
        gpu.synchronize()?;

        let mut blocks: Vec<i32> = (0..num_blocks as i32).collect();
        Synth::new(seed ^ 0x9E37).shuffle(&mut blocks);
        let rows: Vec<&[i32]> = blocks.chunks(blocks_per_seq).collect();
        let host_tables = BlockTables::from_rows(&rows, &vec![case.context_len; case.batch])?;
        let tables = DeviceBlockTables::new(&cache, &host_tables)?;
        let plan = DecodePlan::new(
            gpu,
            cache.layout(),
            DecodeCapacity {
                max_batch: case.batch,
                num_q_heads: case.num_q_heads,
                max_q_len: case.q_len,
                max_context_len: case.context_len,
            },
        )?;
        let workspace = DecodeWorkspace::new(&plan)?;
        let qh = synth.normal(plan.q_elems(), 1.0);
        let q = if k == KvFormat::F16 {
            let q = s
                .clone_htod(&to_f16(&qh))
                .map_err(driver_err("uploading q"))?;
            let out = s
                .alloc_zeros(plan.q_elems())
                .map_err(driver_err("allocating out"))?;
            Query::F16(q, out)
        } else {
            let qb: Vec<bf16> = qh.iter().map(|&v| bf16::from_f32(v)).collect();
            let q = s.clone_htod(&qb).map_err(driver_err("uploading q"))?;
            let out = s
                .alloc_zeros(plan.q_elems())
                .map_err(driver_err("allocating out"))?;
            Query::Bf16(q, out)
        };
        Ok(PreparedDecode {
            case: case.clone(),
            cache,
            tables,
            plan,
            workspace,
            q,
        })
    }

    /// Enqueue one decode step.
    pub fn run(&mut self) -> Result<()> {
        let (p, ws, c, t) = (&self.plan, &mut self.workspace, &self.cache, &self.tables);
        match &mut self.q {
            Query::F16(q, out) => p.decode(ws, c, t, q, out, None),
            Query::Bf16(q, out) => p.decode(ws, c, t, q, out, None),
        }
    }

    /// Bytes the step must read ([`decode_bytes_to_read`]).
    pub fn bytes_to_read(&self) -> Result<u64> {
        let q_bytes = 2;
        decode_bytes_to_read(
            self.cache.layout(),
            &vec![self.case.context_len; self.case.batch],
            self.case.num_q_heads,
            self.case.q_len,
            q_bytes,
        )
    }
}

/// Measure one case and format pair into a report row.
pub fn measure(
    gpu: &Gpu,
    timer: &mut EventTimer,
    case: &DecodeCase,
    (k, v): (KvFormat, KvFormat),
    ceiling_gbps: f64,
    iters: usize,
) -> Result<DecodeBenchRow> {
    let mut prepared = PreparedDecode::new(gpu, case, k, v, 0x5EED ^ case.context_len as u64)?;
    let us = timer.median_us(3, iters, true, || prepared.run())?;
    let bytes = prepared.bytes_to_read()?;
    let gbps = bytes as f64 / us / 1e3;
    Ok(DecodeBenchRow {
        shape: case.clone(),
        k_format: k.name().to_string(),
        v_format: v.name().to_string(),
        splits: prepared.plan.num_splits(),
        median_us: us,
        bytes,
        gbps,
        pct_of_ceiling: 100.0 * gbps / ceiling_gbps,
        speedup_vs_bf16: None,
    })
}

/// Measure the read ceiling, then every case × pair; `progress` hears about each step (the
/// ceiling's own line starts with `read ceiling:`).
pub fn run_grid(
    gpu: &Gpu,
    cases: &[DecodeCase],
    pairs: &[(KvFormat, KvFormat)],
    iters: usize,
    mut progress: impl FnMut(&str),
) -> Result<DecodeBenchReport> {
    let mut timer = EventTimer::new(gpu)?;
    progress("measuring the streaming-read ceiling");
    let probe = read_ceiling(gpu, &mut timer)?;
    progress(&probe.summary());
    let ceiling = probe.gbps;
    let mut report = DecodeBenchReport::new(gpu.props().name.clone(), ceiling);
    report.ceiling_probe = Some(probe);
    for case in cases {
        for &pair in pairs {
            progress(&format!(
                "{} B={} L={} K={} V={}",
                case.case, case.batch, case.context_len, pair.0, pair.1
            ));
            match measure(gpu, &mut timer, case, pair, ceiling, iters) {
                Ok(row) => report.rows.push(row),
                Err(Error::Unsupported(why)) => progress(&format!("skipped: {why}")),
                Err(e) => return Err(e),
            }
        }
    }
    report.fill_speedups();
    Ok(report)
}
