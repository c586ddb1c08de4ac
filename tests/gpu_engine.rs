//! The GPU path as an engine's step loop drives it, checked against the CPU reference on a host
//! cache that receives the same operations: continuous batching through one capacity plan (a
//! CUDA graph captured once and replayed over a changing batch with padding rows), block tables
//! updated in place, fork → reserve → copy-on-write → decode, swapping blocks out and back in
//! (one layer, or every layer in one call), block copies of every layer in one launch,
//! strided query / output views with independent output types, the engine's own streams
//! (ordering across streams, a raw context and stream), fault counting, and reuse of freed
//! blocks.
//!
//! Without a GPU every test prints `SKIPPED`; with `KVQ_REQUIRE_GPU=1` it fails instead.
#![cfg(feature = "cuda")]

mod common;

use common::{Rng, half_ulp_bf16, half_ulp_f16};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};
use kvq::cache::{BlockAllocator, BlockTables, CopyBlock, HostCache, SeqId};
use kvq::cpu::{Accum, AttentionOptions, DecodeShape, decode_attention};
use kvq::cuda::decode::{DecodeStep, RawDecodeArgs, RowStrides};
use kvq::cuda::ops::{self, DeviceElement, Dtype};
use kvq::cuda::{
    DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, Gpu, SwapMove,
    SwapSpace, TablesCapacity, TokenRows, require_gpu_or_skip,
};
use kvq::{CacheConfig, Error, KvFormat};

const KV_HEADS: usize = 2;
const GROUP: usize = 4;
const HEADS: usize = KV_HEADS * GROUP;
const D: usize = 128;
const BS: usize = 16;

/// One layer's cache on the host (the reference) and on the device, an allocator, and the
/// operations an engine applies to both.
struct Engine {
    gpu: Gpu,
    host: HostCache,
    dev: DeviceCache,
    alloc: BlockAllocator,
    rng: Rng,
}

impl Engine {
    fn new(gpu: &Gpu, k: KvFormat, v: KvFormat, num_blocks: usize, seed: u64) -> Engine {
        let config = CacheConfig::new(KV_HEADS, D, BS, k, v).expect("config");
        let mut host = HostCache::new(config, num_blocks).expect("host cache");
        if k.has_head_scale() || v.has_head_scale() {
            host.set_scales(&[0.02, 0.03], &[0.01, 0.015])
                .expect("scales");
        }
        let dev = DeviceCache::from_host(gpu, &host).expect("device cache");
        Engine {
            gpu: gpu.clone(),
            host,
            dev,
            alloc: BlockAllocator::new(num_blocks, BS).expect("allocator"),
            rng: Rng(seed),
        }
    }

    /// Reserve `n` tokens for `seq`, apply its copy-on-write copies to both caches, and write
    /// random K/V there (keys with outlier channels, values with an offset).
    fn append(&mut self, seq: SeqId, n: usize) {
        let r = self.alloc.reserve(seq, n).expect("reserve");
        self.host.apply_copies(&r.copies).expect("host copies");
        self.dev.copy_blocks(&r.copies).expect("device copies");
        let row = KV_HEADS * D;
        let k: Vec<f32> = (0..n * row)
            .map(|i| self.rng.normal() * if i % 13 == 0 { 6.0 } else { 1.0 })
            .collect();
        let v: Vec<f32> = (0..n * row)
            .map(|i| self.rng.normal() + (i % 7) as f32 * 0.1)
            .collect();
        self.host.write(&r.slots, &k, &v).expect("host write");
        let s = self.gpu.stream();
        let mut slots: Vec<i32> = Vec::new();
        r.extend_slots(&mut slots).expect("i32 slots");
        let slots = s.clone_htod(&slots).expect("slots");
        let (kd, vd) = (s.clone_htod(&k).expect("k"), s.clone_htod(&v).expect("v"));
        ops::append(&mut self.dev, &slots, &kd, &vd, n).expect("device append");
    }

    /// CPU reference for `seqs` with queries `q` ([batch, heads, q_len, D]).
    fn reference(&self, seqs: &[SeqId], q: &[f32], q_len: usize) -> (Vec<f32>, Vec<f32>) {
        let tables = self.alloc.block_tables(seqs).expect("tables");
        let out = decode_attention(
            &self.host,
            &tables,
            q,
            &DecodeShape::new(HEADS, q_len),
            &AttentionOptions::new(D),
            Accum::F64,
        )
        .expect("cpu decode");
        (out.out, out.lse)
    }

    /// Table row `b` of `tables` set to `seq`'s blocks and length.
    fn set_row(&self, tables: &mut DeviceBlockTables, b: usize, seq: SeqId) {
        let blocks = self.alloc.block_table(seq).expect("row");
        let len = self.alloc.len(seq).expect("len");
        tables.set_row(b, blocks, len).expect("set_row");
    }
}

/// ‖out − want‖ / ‖want‖ with half an ulp of the output type forgiven per element, and lse
/// within 1e-3 (+10 % per unit).
fn assert_close(what: &str, got: &[f32], want: &[f32], half_ulp: impl Fn(f32) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(g.is_finite(), "{what}: non-finite output {g}");
        let e = ((g as f64 - w as f64).abs() - half_ulp(w)).max(0.0);
        num += e * e;
        den += (w as f64) * (w as f64);
    }
    let rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    assert!(rel <= 2e-3, "{what}: relative error {rel:.3e}");
}

fn assert_lse(what: &str, got: &[f32], want: &[f32]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w as f64).abs();
        assert!(
            err <= 5e-3 * (1.0 + 0.1 * (w as f64).abs()),
            "{what}: lse[{i}] = {g}, want {w}"
        );
    }
}

fn to_f32<T: DeviceElement>(gpu: &Gpu, x: &CudaSlice<T>) -> Vec<f32> {
    gpu.stream()
        .clone_dtoh(x)
        .expect("download")
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

// ---- tests ----------------------------------------------------------------------------------

/// A sequence forked mid-block, both branches grown: the shared partial block is copied on the
/// device exactly as on the host, and both branches decode as the CPU does.
#[test]
fn fork_reserve_copy_on_write_decode() {
    let Some(gpu) = require_gpu_or_skip("fork_reserve_copy_on_write_decode") else {
        return;
    };
    for (k, v) in [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::F16, KvFormat::F16),
    ] {
        let mut e = Engine::new(&gpu, k, v, 64, 7);
        let a = e.alloc.create_sequence();
        e.append(a, 37); // 3 blocks, the last one partial
        let b = e.alloc.fork(a).expect("fork");
        e.append(b, 5); // copies A's partial last block first
        e.append(a, 20);
        e.append(b, 30);
        let c = e.alloc.fork(b).expect("fork");
        e.append(c, 1);
        let dev_pool = e.dev.to_host().expect("download pool");
        assert!(
            dev_pool.pool() == e.host.pool(),
            "{k}/{v}: device pool bytes differ from the host's after copy-on-write"
        );
        let seqs = [a, b, c];
        let max = seqs.iter().map(|&s| e.alloc.len(s).unwrap()).max().unwrap();
        let q: Vec<f32> = e.rng.normals(seqs.len() * HEADS * D, 1.0);
        let plan = DecodePlan::new(
            &gpu,
            e.dev.layout(),
            DecodeCapacity {
                max_batch: seqs.len(),
                num_q_heads: HEADS,
                max_q_len: 1,
                max_context_len: max,
            },
        )
        .unwrap();
        let mut ws = DecodeWorkspace::new(&plan).unwrap();
        let tables = DeviceBlockTables::new(&e.dev, &e.alloc.block_tables(&seqs).unwrap()).unwrap();
        let s = gpu.stream();
        let qh: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
        let qh = s.clone_htod(&qh).unwrap();
        let mut out = s.alloc_zeros::<f32>(q.len()).unwrap();
        let rows = RowStrides::batch_head_token(HEADS, 1, D);
        plan.decode_step(
            &mut ws,
            &e.dev,
            &tables,
            DecodeStep {
                q_len: 1,
                q: &qh,
                q_rows: rows,
                out: &mut out,
                out_rows: rows,
                lse: None,
                sinks: None,
                alibi_slopes: None,
            },
        )
        .unwrap();
        // The reference saw f32 queries; the GPU f16 ones: compare against f16-rounded q.
        let q16: Vec<f32> = q.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        let (want16, _) = e.reference(&seqs, &q16, 1);
        assert_close(
            &format!("{k}/{v} fork"),
            &to_f32(&gpu, &out),
            &want16,
            |_| 0.0,
        );
        assert_eq!(e.dev.check_appends().unwrap(), 0);
    }
}

/// One plan at capacity, a graph captured once, replayed while sequences join and finish:
/// live rows match the CPU, padding rows give zeros and lse = -inf. Then the same plan serves
/// smaller batches and q_len 2 without the graph.
#[test]
fn continuous_batching_with_a_captured_graph() {
    let Some(gpu) = require_gpu_or_skip("continuous_batching_with_a_captured_graph") else {
        return;
    };
    const CAP: usize = 6;
    const MAX_CTX: usize = 1024;
    // Captured buffers must not carry cudarc's cross-stream events (see Gpu::check_capture);
    // first, that case is refused with a typed error rather than a broken capture.
    {
        let s = gpu.stream();
        let e = Engine::new(&gpu, KvFormat::F16, KvFormat::F16, 8, 1);
        let plan = DecodePlan::new(
            &gpu,
            e.dev.layout(),
            DecodeCapacity {
                max_batch: 1,
                num_q_heads: HEADS,
                max_q_len: 1,
                max_context_len: 16,
            },
        )
        .unwrap();
        let mut ws = DecodeWorkspace::new(&plan).unwrap();
        let t = DeviceBlockTables::new(&e.dev, &BlockTables::from_rows(&[&[0]], &[4]).unwrap())
            .unwrap();
        let q = s.alloc_zeros::<f16>(HEADS * D).unwrap();
        let mut out = s.alloc_zeros::<f16>(HEADS * D).unwrap();
        if gpu.context().is_managing_stream_synchronization() {
            gpu.synchronize().unwrap();
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            let r = plan.decode(&mut ws, &e.dev, &t, &q, &mut out, None);
            let _ = s.end_capture(CUgraphInstantiate_flags(0));
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        }
    }
    // SAFETY: from here on this process orders its streams itself (every test here queues each
    // buffer's uses on one stream, or on streams kvq orders).
    unsafe { gpu.context().disable_event_tracking() };
    let mut e = Engine::new(&gpu, KvFormat::Int4Sym32, KvFormat::Int4Affine64, 512, 11);
    let plan = DecodePlan::new(
        &gpu,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: CAP,
            num_q_heads: HEADS,
            max_q_len: 2,
            max_context_len: MAX_CTX,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let mut tables = DeviceBlockTables::with_capacity(
        &e.dev,
        TablesCapacity {
            max_batch: CAP,
            max_context_len: MAX_CTX,
        },
    )
    .unwrap();
    tables.set_batch(CAP).unwrap();
    let s = gpu.stream().clone();
    // Fixed buffers at the capacity, q_len 1: what the graph reads and writes.
    let rows = RowStrides::token_major(HEADS, 1, D);
    let mut q = s.alloc_zeros::<f16>(CAP * HEADS * D).unwrap();
    let mut out = s.alloc_zeros::<bf16>(CAP * HEADS * D).unwrap();
    let mut lse = s.alloc_zeros::<f32>(CAP * HEADS).unwrap();
    let lse_rows = RowStrides::token_major(HEADS, 1, 1);
    // Slot b of the batch holds sequence slots[b] (None: padding).
    let mut slots: [Option<SeqId>; CAP] = [None; CAP];
    let mut graph = None;
    for step in 0..12 {
        // Joins and finishes.
        for (b, slot) in slots.iter_mut().enumerate() {
            let join = slot.is_none() && (step + b) % 3 == 0;
            let finish = slot.is_some() && (step * 7 + b) % 5 == 0;
            if finish {
                e.alloc.free(slot.take().unwrap()).unwrap();
                tables.clear_row(b).unwrap();
            } else if join {
                let sq = e.alloc.create_sequence();
                let prompt = 1 + e.rng.below(300);
                e.append(sq, prompt);
                *slot = Some(sq);
            }
        }
        // One new token per live sequence, then the rows.
        for (b, slot) in slots.iter().enumerate() {
            if let Some(sq) = *slot {
                e.append(sq, 1);
                e.set_row(&mut tables, b, sq);
            }
        }
        tables.upload().unwrap();
        let qf: Vec<f32> = e.rng.normals(CAP * HEADS * D, 1.0);
        let qh: Vec<f16> = qf.iter().map(|&x| f16::from_f32(x)).collect();
        s.memcpy_htod(&qh, &mut q).unwrap();
        if graph.is_none() {
            gpu.synchronize().unwrap();
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &q,
                    q_rows: rows,
                    out: &mut out,
                    out_rows: rows,
                    lse: Some((&mut lse, lse_rows)),
                    sinks: None,
                    alibi_slopes: None,
                },
            )
            .unwrap();
            graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        }
        graph.as_ref().expect("captured").launch().unwrap();
        let got = to_f32(&gpu, &out);
        let got_lse = s.clone_dtoh(&lse).unwrap();
        let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
        for (b, slot) in slots.iter().enumerate() {
            let at = b * HEADS * D..(b + 1) * HEADS * D;
            match *slot {
                None => {
                    assert!(
                        got[at].iter().all(|&x| x == 0.0),
                        "step {step} padding row {b}"
                    );
                    assert!(
                        got_lse[b * HEADS..(b + 1) * HEADS]
                            .iter()
                            .all(|&x| x == f32::NEG_INFINITY),
                        "step {step} padding lse {b}"
                    );
                }
                Some(sq) => {
                    let (want, want_lse) = e.reference(&[sq], &q16[at.clone()], 1);
                    assert_close(
                        &format!("step {step} row {b}"),
                        &got[at],
                        &want,
                        half_ulp_bf16,
                    );
                    assert_lse(
                        &format!("step {step} row {b}"),
                        &got_lse[b * HEADS..(b + 1) * HEADS],
                        &want_lse,
                    );
                }
            }
        }
    }
    // Without the graph: the live sequences packed into a smaller batch, two new tokens each.
    let live: Vec<SeqId> = slots.iter().flatten().copied().collect();
    assert!(!live.is_empty());
    for (b, &sq) in live.iter().enumerate() {
        e.append(sq, 2);
        e.set_row(&mut tables, b, sq);
    }
    tables.set_batch(live.len()).unwrap();
    tables.upload().unwrap();
    let qf: Vec<f32> = e.rng.normals(live.len() * 2 * HEADS * D, 1.0);
    let qh: Vec<f16> = qf.iter().map(|&x| f16::from_f32(x)).collect();
    let q2 = s.clone_htod(&qh).unwrap();
    let mut out2 = s.alloc_zeros::<f16>(qh.len()).unwrap();
    let r2 = RowStrides::batch_head_token(HEADS, 2, D);
    plan.decode_step(
        &mut ws,
        &e.dev,
        &tables,
        DecodeStep {
            q_len: 2,
            q: &q2,
            q_rows: r2,
            out: &mut out2,
            out_rows: r2,
            lse: None,
            sinks: None,
            alibi_slopes: None,
        },
    )
    .unwrap();
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (want, _) = e.reference(&live, &q16, 2);
    assert_close("packed q_len 2", &to_f32(&gpu, &out2), &want, half_ulp_f16);
    // Beyond the capacity: typed errors.
    assert!(tables.set_batch(CAP + 1).is_err());
    let r3 = RowStrides::batch_head_token(HEADS, 3, D);
    let big = s.alloc_zeros::<f16>(CAP * 3 * HEADS * D).unwrap();
    let mut big_out = s.alloc_zeros::<f16>(CAP * 3 * HEADS * D).unwrap();
    let r = plan.decode_step(
        &mut ws,
        &e.dev,
        &tables,
        DecodeStep {
            q_len: 3,
            q: &big,
            q_rows: r3,
            out: &mut big_out,
            out_rows: r3,
            lse: None,
            sinks: None,
            alibi_slopes: None,
        },
    );
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(e.dev.check_appends().unwrap(), 0);
}

/// Queries read from a fused QKV projection buffer ([tokens, (H + 2 Hkv) * D], q first),
/// outputs written token-major as f32, and bf16 in / bf16 out for a bf16 key cache.
#[test]
fn strided_views_and_output_types() {
    let Some(gpu) = require_gpu_or_skip("strided_views_and_output_types") else {
        return;
    };
    for (k, v) in [
        (KvFormat::Int4Sym32, KvFormat::Fp8E4m3),
        (KvFormat::Bf16, KvFormat::Bf16),
    ] {
        let mut e = Engine::new(&gpu, k, v, 128, 5);
        let seqs: Vec<SeqId> = (0..3).map(|_| e.alloc.create_sequence()).collect();
        for (i, &sq) in seqs.iter().enumerate() {
            e.append(sq, 50 + 333 * i);
        }
        let batch = seqs.len();
        let max = seqs.iter().map(|&s| e.alloc.len(s).unwrap()).max().unwrap();
        let plan = DecodePlan::new(
            &gpu,
            e.dev.layout(),
            DecodeCapacity {
                max_batch: batch,
                num_q_heads: HEADS,
                max_q_len: 1,
                max_context_len: max,
            },
        )
        .unwrap();
        let mut ws = DecodeWorkspace::new(&plan).unwrap();
        let tables = DeviceBlockTables::new(&e.dev, &e.alloc.block_tables(&seqs).unwrap()).unwrap();
        let width = (HEADS + 2 * KV_HEADS) * D;
        let qkv: Vec<f32> = e.rng.normals(batch * width, 1.0);
        // q of token b, head h: qkv[b * width + h * D ..].
        let mut q_ref = Vec::new();
        for b in 0..batch {
            q_ref.extend_from_slice(&qkv[b * width..b * width + HEADS * D]);
        }
        let s = gpu.stream();
        let q_rows = TokenRows {
            token: width,
            head: D,
        }
        .with_q_len(1);
        let out_rows = RowStrides::token_major(HEADS, 1, D);
        if k == KvFormat::Bf16 {
            let qkv_d: Vec<bf16> = qkv.iter().map(|&x| bf16::from_f32(x)).collect();
            let qkv_d = s.clone_htod(&qkv_d).unwrap();
            let mut out = s.alloc_zeros::<bf16>(batch * HEADS * D).unwrap();
            plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &qkv_d,
                    q_rows,
                    out: &mut out,
                    out_rows,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            )
            .unwrap();
            let qr: Vec<f32> = q_ref.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            let (want, _) = e.reference(&seqs, &qr, 1);
            assert_close(
                &format!("{k}/{v} bf16 out"),
                &to_f32(&gpu, &out),
                &want,
                half_ulp_bf16,
            );
        } else {
            let qkv_d: Vec<f16> = qkv.iter().map(|&x| f16::from_f32(x)).collect();
            let qkv_d = s.clone_htod(&qkv_d).unwrap();
            // A view that starts at the q part (offset 0 here) of the fused buffer.
            let view = qkv_d.slice(0..);
            let mut out = s.alloc_zeros::<f32>(batch * HEADS * D).unwrap();
            plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &view,
                    q_rows,
                    out: &mut out,
                    out_rows,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            )
            .unwrap();
            let qr: Vec<f32> = q_ref.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
            let (want, want_lse) = e.reference(&seqs, &qr, 1);
            assert_close(
                &format!("{k}/{v} f32 out"),
                &to_f32(&gpu, &out),
                &want,
                |_| 0.0,
            );
            // lse into a view of a larger buffer (an engine's array for several layers).
            let mut lse_buf = s.alloc_zeros::<f32>(3 + batch * HEADS).unwrap();
            plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &view,
                    q_rows,
                    out: &mut out,
                    out_rows,
                    lse: Some((
                        &mut lse_buf.slice_mut(3..),
                        RowStrides::token_major(HEADS, 1, 1),
                    )),
                    sinks: None,
                    alibi_slopes: None,
                },
            )
            .unwrap();
            let got_lse = s.clone_dtoh(&lse_buf).unwrap();
            assert_eq!(got_lse[..3], [0.0; 3], "lse written before its view");
            assert_lse(&format!("{k}/{v} lse view"), &got_lse[3..], &want_lse);
            // A buffer one element short of the last row is refused.
            let mut short = s.alloc_zeros::<f32>(batch * HEADS * D - 1).unwrap();
            let r = plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &view,
                    q_rows,
                    out: &mut short,
                    out_rows,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            );
            assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
            // Overlapping output rows are refused.
            let overlap = RowStrides {
                seq: HEADS * D,
                token: 0,
                head: D / 2,
            };
            let r = plan.decode_step(
                &mut ws,
                &e.dev,
                &tables,
                DecodeStep {
                    q_len: 1,
                    q: &view,
                    q_rows,
                    out: &mut out,
                    out_rows: overlap,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            );
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        }
    }
}

/// The cache on one stream, plan, tables and workspace on another: the decode waits for the
/// appends (queued behind a long memset) instead of racing them.
#[test]
fn objects_on_different_streams_are_ordered() {
    let Some(gpu_a) = require_gpu_or_skip("objects_on_different_streams_are_ordered") else {
        return;
    };
    let stream_b = gpu_a.context().new_stream().unwrap();
    let gpu_b = Gpu::from_stream(stream_b).unwrap();
    assert!(!gpu_a.same_stream(&gpu_b));
    let mut e = Engine::new(&gpu_a, KvFormat::Fp8E4m3, KvFormat::Int4Affine64, 256, 3);
    let seqs: Vec<SeqId> = (0..4).map(|_| e.alloc.create_sequence()).collect();
    for &sq in &seqs {
        e.append(sq, 700);
    }
    let max = 701;
    let plan = DecodePlan::new(
        &gpu_b,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: seqs.len(),
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: max,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let mut tables = DeviceBlockTables::with_capacity_on(
        &gpu_b,
        &e.dev,
        TablesCapacity {
            max_batch: 4,
            max_context_len: max,
        },
    )
    .unwrap();
    tables.set_batch(4).unwrap();
    gpu_a.synchronize().unwrap();
    gpu_b.synchronize().unwrap();
    // Keep stream A busy for milliseconds (an 8 GiB memset), then append the last token.
    let busy = gpu_a.stream().alloc_zeros::<u8>(8 << 30).unwrap();
    for (b, &sq) in seqs.iter().enumerate() {
        e.append(sq, 1);
        e.set_row(&mut tables, b, sq);
    }
    tables.upload().unwrap();
    let qf: Vec<f32> = e.rng.normals(4 * HEADS * D, 1.0);
    let qh: Vec<f16> = qf.iter().map(|&x| f16::from_f32(x)).collect();
    let q = gpu_b.stream().clone_htod(&qh).unwrap();
    let mut out = gpu_b.stream().alloc_zeros::<f16>(qh.len()).unwrap();
    plan.decode(&mut ws, &e.dev, &tables, &q, &mut out, None)
        .unwrap();
    let got = to_f32(&gpu_b, &out);
    drop(busy);
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (want, _) = e.reference(&seqs, &q16, 1);
    assert_close(
        "decode on stream B after appends on A",
        &got,
        &want,
        half_ulp_f16,
    );
}

/// A handle on the engine's raw context and stream gives the same results as kvq's own.
#[test]
fn raw_context_and_stream() {
    let Some(gpu) = require_gpu_or_skip("raw_context_and_stream") else {
        return;
    };
    let engine_stream = gpu.context().new_stream().unwrap();
    // SAFETY: the primary context and a stream of it, both alive for the whole test.
    let raw = unsafe { Gpu::from_raw(gpu.context().cu_ctx(), engine_stream.cu_stream()) }.unwrap();
    assert_eq!(raw.stream().cu_stream(), engine_stream.cu_stream());
    assert_eq!(raw.context().cu_ctx(), gpu.context().cu_ctx());
    let mut e = Engine::new(&raw, KvFormat::F16, KvFormat::Int4Affine64, 64, 9);
    let sq = e.alloc.create_sequence();
    e.append(sq, 300);
    let plan = DecodePlan::new(
        &raw,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: 300,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let tables = DeviceBlockTables::new(&e.dev, &e.alloc.block_tables(&[sq]).unwrap()).unwrap();
    let qh: Vec<f16> = e
        .rng
        .normals(HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let q = raw.stream().clone_htod(&qh).unwrap();
    let mut out = raw.stream().alloc_zeros::<f16>(qh.len()).unwrap();
    plan.decode(&mut ws, &e.dev, &tables, &q, &mut out, None)
        .unwrap();
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (want, _) = e.reference(&[sq], &q16, 1);
    assert_close("raw stream", &to_f32(&raw, &out), &want, half_ulp_f16);
    // SAFETY: a null context is refused before it is used.
    assert!(unsafe { Gpu::from_raw(std::ptr::null_mut(), std::ptr::null_mut()) }.is_err());
}

/// A preempted sequence's blocks go to pinned host memory, another sequence overwrites them,
/// and they come back into other block ids byte for byte: the decode matches the CPU.
#[test]
fn swap_out_and_back_in() {
    let Some(gpu) = require_gpu_or_skip("swap_out_and_back_in") else {
        return;
    };
    let mut e = Engine::new(&gpu, KvFormat::Int4Sym32, KvFormat::Int4Affine64, 96, 13);
    let a = e.alloc.create_sequence();
    e.append(a, 200); // 13 blocks
    let blocks: Vec<usize> = e
        .alloc
        .block_table(a)
        .unwrap()
        .iter()
        .map(|&b| b as usize)
        .collect();
    let len = e.alloc.len(a).unwrap();
    let stride = e.host.layout().block_stride;
    let before = e.dev.to_host().unwrap();
    let mut space = SwapSpace::new(&e.dev, 16).unwrap();
    let moves: Vec<SwapMove> = blocks
        .iter()
        .enumerate()
        .map(|(slot, &block)| SwapMove { block, slot })
        .collect();
    e.dev.swap_out(&moves, &mut space).unwrap();
    // Preempted: its blocks go to a new sequence, which overwrites them.
    e.alloc.free(a).unwrap();
    let other = e.alloc.create_sequence();
    e.append(other, 200);
    // Resumed into blocks no one holds.
    let fresh: Vec<usize> = (0..blocks.len()).map(|i| 95 - i).collect();
    let back: Vec<SwapMove> = fresh
        .iter()
        .enumerate()
        .map(|(slot, &block)| SwapMove { block, slot })
        .collect();
    e.dev.swap_in(&back, &mut space).unwrap();
    let mut after = e.dev.to_host().unwrap();
    for (&old, &new) in blocks.iter().zip(&fresh) {
        assert!(
            after.pool()[new * stride..(new + 1) * stride]
                == before.pool()[old * stride..(old + 1) * stride],
            "block {old} came back into {new} changed"
        );
    }
    let rows: Vec<i32> = fresh.iter().map(|&b| b as i32).collect();
    let tables = BlockTables::from_rows(&[&rows], &[len]).unwrap();
    let plan = DecodePlan::new(
        &gpu,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: len,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let dt = DeviceBlockTables::new(&e.dev, &tables).unwrap();
    let qh: Vec<f16> = e
        .rng
        .normals(HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let q = gpu.stream().clone_htod(&qh).unwrap();
    let mut out = gpu.stream().alloc_zeros::<f16>(qh.len()).unwrap();
    plan.decode(&mut ws, &e.dev, &dt, &q, &mut out, None)
        .unwrap();
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    after
        .set_scales(e.host.k_scales(), e.host.v_scales())
        .unwrap();
    let want = decode_attention(
        &after,
        &tables,
        &q16,
        &DecodeShape::new(HEADS, 1),
        &AttentionOptions::new(D),
        Accum::F64,
    )
    .unwrap();
    assert_close("swapped in", &to_f32(&gpu, &out), &want.out, half_ulp_f16);
    // Moves outside the pool or the space are typed errors.
    let past_pool = SwapMove { block: 96, slot: 0 };
    let past_space = SwapMove { block: 0, slot: 16 };
    assert!(e.dev.swap_out(&[past_pool], &mut space).is_err());
    assert!(e.dev.swap_in(&[past_space], &mut space).is_err());
    assert_eq!(e.dev.check_appends().unwrap(), 0);
}

/// `copy_blocks` applies a list in order, as `HostCache::apply_copies` does: chains, `src ==
/// dst`, two copies into one block, a swap of two blocks, a long random list; a list naming a block outside the pool is refused before anything is copied.
#[test]
fn copy_lists_apply_in_order_as_on_the_host() {
    let Some(gpu) = require_gpu_or_skip("copy_lists_apply_in_order_as_on_the_host") else {
        return;
    };
    let mut rng = common::fresh_rng("copy_lists_apply_in_order_as_on_the_host");
    let nb = 12;
    let config = CacheConfig::new(KV_HEADS, D, BS, KvFormat::F16, KvFormat::Int4Affine64).unwrap();
    let mut host = HostCache::new(config, nb).unwrap();
    let slots: Vec<usize> = (0..nb * BS).collect();
    let n = slots.len() * KV_HEADS * D;
    host.write(&slots, &rng.normals(n, 1.0), &rng.normals(n, 1.0))
        .unwrap();
    let mut dev = DeviceCache::from_host(&gpu, &host).unwrap();
    let c = |src, dst| CopyBlock { src, dst };
    let random: Vec<CopyBlock> = (0..2000).map(|_| c(rng.below(nb), rng.below(nb))).collect();
    let lists = [
        vec![c(0, 1), c(1, 2), c(2, 3)],
        vec![c(4, 4)],
        vec![c(5, 6), c(7, 6), c(6, 8)],
        vec![c(9, 10), c(10, 9)],
        vec![c(11, 0), c(1, 11), c(0, 5), c(3, 3), c(5, 1)],
        random,
    ];
    for (i, list) in lists.iter().enumerate() {
        host.apply_copies(list).unwrap();
        dev.copy_blocks(list).unwrap();
        assert!(dev.to_host().unwrap().pool() == host.pool(), "list {i}");
    }
    let bad = [c(0, 1), c(2, nb)];
    let want = Err(Error::BlockIndex {
        block: nb,
        num_blocks: nb,
    });
    assert_eq!(host.apply_copies(&bad), want);
    assert_eq!(dev.copy_blocks(&bad), want);
    assert!(dev.to_host().unwrap().pool() == host.pool());
    assert_eq!(dev.check_appends().unwrap(), 0);
}

/// `layers` host caches of `nb` blocks with different random tokens in every slot, and their
/// device copies on `gpu`: layers of one allocation (`DeviceCache::new_per_layer`, as an engine
/// sizes its whole cache), each uploaded from its host cache.
fn random_layers(
    gpu: &Gpu,
    rng: &mut Rng,
    layers: usize,
    nb: usize,
) -> (Vec<HostCache>, Vec<DeviceCache>) {
    let config = CacheConfig::new(KV_HEADS, D, BS, KvFormat::F16, KvFormat::Int4Affine64).unwrap();
    let slots: Vec<usize> = (0..nb * BS).collect();
    let n = slots.len() * KV_HEADS * D;
    let hosts: Vec<HostCache> = (0..layers)
        .map(|_| {
            let mut h = HostCache::new(config, nb).unwrap();
            h.write(&slots, &rng.normals(n, 1.0), &rng.normals(n, 1.0))
                .unwrap();
            h
        })
        .collect();
    let mut devs = DeviceCache::new_per_layer(gpu, config, layers, nb).unwrap();
    for (d, h) in devs.iter_mut().zip(&hosts) {
        d.upload(h).unwrap();
    }
    (hosts, devs)
}

/// `copy_blocks_all` applies one list to every layer's cache (one launch per wave for all of
/// them) and leaves each layer the bytes `HostCache::apply_copies` leaves: chains, `src ==
/// dst`, two copies into one block, a swap of two blocks, a long random list. Bad ids, layers
/// of another shape or stream are typed errors before anything is copied.
#[test]
fn copy_lists_apply_to_every_layer_at_once() {
    let Some(gpu) = require_gpu_or_skip("copy_lists_apply_to_every_layer_at_once") else {
        return;
    };
    let mut rng = common::fresh_rng("copy_lists_apply_to_every_layer_at_once");
    let nb = 12;
    let (mut hosts, mut devs) = random_layers(&gpu, &mut rng, 5, nb);
    let c = |src, dst| CopyBlock { src, dst };
    let random: Vec<CopyBlock> = (0..2000).map(|_| c(rng.below(nb), rng.below(nb))).collect();
    let lists = [
        vec![c(0, 1), c(1, 2), c(2, 3)],
        vec![c(4, 4)],
        vec![c(5, 6), c(7, 6), c(6, 8)],
        vec![c(9, 10), c(10, 9)],
        vec![c(11, 0), c(1, 11), c(0, 5), c(3, 3), c(5, 1)],
        vec![c(0, 4), c(1, 5), c(2, 6), c(3, 7)],
        random,
        vec![],
    ];
    let same = |hosts: &[HostCache], devs: &[DeviceCache], what: &str| {
        for (l, (h, d)) in hosts.iter().zip(devs).enumerate() {
            assert!(d.to_host().unwrap().pool() == h.pool(), "{what}, layer {l}");
        }
    };
    for (i, list) in lists.iter().enumerate() {
        for h in &mut hosts {
            h.apply_copies(list).unwrap();
        }
        if i % 2 == 0 {
            kvq::cuda::copy_blocks_all(&mut devs, list).unwrap();
        } else {
            // Caches the engine holds elsewhere, by reference.
            let mut refs: Vec<&mut DeviceCache> = devs.iter_mut().collect();
            kvq::cuda::copy_blocks_all(&mut refs, list).unwrap();
        }
        same(&hosts, &devs, &format!("list {i}"));
    }
    // One layer is the one-layer path.
    hosts[2].apply_copies(&lists[0]).unwrap();
    kvq::cuda::copy_blocks_all(&mut devs[2..3], &lists[0]).unwrap();
    same(&hosts, &devs, "one layer");
    kvq::cuda::copy_blocks_all::<DeviceCache>(&mut [], &lists[0]).unwrap();

    let bad = [c(0, 1), c(2, nb)];
    assert_eq!(
        kvq::cuda::copy_blocks_all(&mut devs, &bad),
        Err(Error::BlockIndex {
            block: nb,
            num_blocks: nb
        })
    );
    // A layer of another pool size, or on another stream, is refused.
    let (_, mut bigger) = random_layers(&gpu, &mut rng, 1, nb + 1);
    let other = Gpu::from_stream(gpu.context().new_stream().unwrap()).unwrap();
    let mut elsewhere = DeviceCache::from_host(&other, &hosts[0]).unwrap();
    {
        let (a, b) = devs.split_at_mut(1);
        let mut mixed: Vec<&mut DeviceCache> = vec![&mut a[0], &mut b[0], &mut bigger[0]];
        let e = kvq::cuda::copy_blocks_all(&mut mixed, &lists[0]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LayerMismatch {
                    layer: 2,
                    what: "num_blocks",
                    ..
                }
            ),
            "{e}"
        );
        let mut mixed: Vec<&mut DeviceCache> = vec![&mut a[0], &mut elsewhere];
        let e = kvq::cuda::copy_blocks_all(&mut mixed, &lists[0]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LayerMismatch {
                    layer: 1,
                    what: "stream",
                    ..
                }
            ),
            "{e}"
        );
    }
    same(&hosts, &devs, "after refused lists");
    for d in &mut devs {
        assert_eq!(d.check_appends().unwrap(), 0);
    }
    // A layer outlives the others of its allocation, and a shape mismatch is refused.
    let last = devs.pop().unwrap();
    drop(devs);
    assert!(last.to_host().unwrap().pool() == hosts[4].pool());
    let other = HostCache::new(*last.config(), nb + 1).unwrap();
    let mut last = last;
    assert!(matches!(
        last.upload(&other),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        DeviceCache::new_per_layer(&gpu, *last.config(), 0, nb),
        Err(Error::Config {
            what: "num_layers",
            ..
        })
    ));
}

/// `swap_out_all` / `swap_in_all` move a block list of every layer through one swap space
/// (all-layer slot `s` of layer `l` is space slot `s * layers + l`) and back into other
/// blocks byte for byte, while the blocks are overwritten in between.
#[test]
fn swap_every_layer_out_and_back_in() {
    let Some(gpu) = require_gpu_or_skip("swap_every_layer_out_and_back_in") else {
        return;
    };
    let mut rng = common::fresh_rng("swap_every_layer_out_and_back_in");
    let (layers, nb) = (3, 16);
    let (mut hosts, mut devs) = random_layers(&gpu, &mut rng, layers, nb);
    let before: Vec<HostCache> = devs.iter().map(|d| d.to_host().unwrap()).collect();
    let mut space = SwapSpace::new(&devs[0], layers * 4).unwrap();
    let m = |block, slot| SwapMove { block, slot };
    let out = [m(3, 0), m(7, 1), m(1, 3)];
    kvq::cuda::swap_out_all(&devs, &out, &mut space).unwrap();
    // Preempted: the blocks are reused at once.
    let c = |src, dst| CopyBlock { src, dst };
    let overwrite = [c(0, 3), c(0, 7), c(0, 1)];
    kvq::cuda::copy_blocks_all(&mut devs, &overwrite).unwrap();
    let back = [m(10, 0), m(11, 1), m(12, 3)];
    kvq::cuda::swap_in_all(&mut devs, &back, &mut space).unwrap();
    for h in &mut hosts {
        h.apply_copies(&[c(3, 10), c(7, 11), c(1, 12)]).unwrap();
        h.apply_copies(&overwrite).unwrap();
    }
    for (l, (h, d)) in hosts.iter().zip(&devs).enumerate() {
        assert!(d.to_host().unwrap().pool() == h.pool(), "layer {l}");
    }
    // The documented slot layout: layer 2's copy of block 7 (all-layer slot 1) is slot 5.
    devs[2].swap_in(&[m(13, 5)], &mut space).unwrap();
    let stride = hosts[0].layout().block_stride;
    assert!(
        devs[2].to_host().unwrap().pool()[13 * stride..14 * stride]
            == before[2].pool()[7 * stride..8 * stride]
    );
    space.synchronize().unwrap();
    // Slots past the space (4 * 3 = 12), blocks past the pool, mixed layers: typed errors.
    assert!(kvq::cuda::swap_out_all(&devs, &[m(0, 4)], &mut space).is_err());
    assert!(kvq::cuda::swap_in_all(&mut devs, &[m(nb, 0)], &mut space).is_err());
    let (_, bigger) = random_layers(&gpu, &mut rng, 1, nb + 1);
    let mixed = [&devs[0], &bigger[0]];
    assert!(matches!(
        kvq::cuda::swap_out_all(&mixed, &[m(0, 0)], &mut space),
        Err(Error::LayerMismatch { layer: 1, .. })
    ));
    kvq::cuda::swap_out_all::<DeviceCache>(&[], &out, &mut space).unwrap();
    for d in &mut devs {
        assert_eq!(d.check_appends().unwrap(), 0);
    }
}

/// Padding rows (length 0) read nothing; a raw decode whose table names a block outside the
/// pool reads nothing there either and is reported by the next check.
#[test]
fn padding_and_faults() {
    let Some(gpu) = require_gpu_or_skip("padding_and_faults") else {
        return;
    };
    let mut e = Engine::new(&gpu, KvFormat::Fp8E4m3, KvFormat::Fp8E4m3, 32, 17);
    let sq = e.alloc.create_sequence();
    e.append(sq, 100);
    let plan = DecodePlan::new(
        &gpu,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: 2,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: 128,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let s = gpu.stream();
    // Row 0 padding, row 1 real; then a raw launch whose table row names block 999.
    let mut row = e.alloc.block_table(sq).unwrap().to_vec();
    row.resize(8, -1);
    let mut data = vec![-1i32; 8];
    data.extend_from_slice(&row);
    let table = s.clone_htod(&data).unwrap();
    let lens = s.clone_htod(&[0i32, 100]).unwrap();
    let qh: Vec<f16> = e
        .rng
        .normals(2 * HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let q = s.clone_htod(&qh).unwrap();
    let mut out = s.clone_htod(&vec![f16::NAN; qh.len()]).unwrap();
    let rows = RowStrides::batch_head_token(HEADS, 1, D);
    let lse_rows = RowStrides::batch_head_token(HEADS, 1, 1);
    let mut lse = s.alloc_zeros::<f32>(2 * HEADS).unwrap();
    let (ws_o, ws_l, ws_c) = {
        let w = ws.elems();
        assert!(w.0 > 0);
        // The workspace's own addresses are private; use a fresh one of the plan's sizes.
        (
            s.alloc_zeros::<f32>(w.0).unwrap(),
            s.alloc_zeros::<f32>(w.1).unwrap(),
            s.alloc_zeros::<u32>(w.2).unwrap(),
        )
    };
    let counters = s.alloc_zeros::<u64>(2).unwrap();
    let raw_args = |table_ptr, out_ptr, lse_ptr, counters_ptr| RawDecodeArgs {
        cache: e.dev.as_raw(),
        num_blocks: e.dev.num_blocks(),
        batch: 2,
        q_len: 1,
        q: q.device_ptr(s).0,
        q_dtype: Dtype::F16,
        q_rows: rows,
        out: out_ptr,
        out_dtype: Dtype::F16,
        out_rows: rows,
        lse: lse_ptr,
        lse_rows,
        block_tables: table_ptr,
        max_blocks: 8,
        context_lens: lens.device_ptr(s).0,
        workspace_o: ws_o.device_ptr(s).0,
        workspace_lse: ws_l.device_ptr(s).0,
        workspace_counters: ws_c.device_ptr(s).0,
        counters: counters_ptr,
        sinks: 0,
        alibi_slopes: 0,
    };
    let out_ptr = out.device_ptr(s).0;
    let lse_ptr = lse.device_ptr(s).0;
    let args = raw_args(
        table.device_ptr(s).0,
        out_ptr,
        lse_ptr,
        counters.device_ptr(s).0,
    );
    // SAFETY: every buffer above holds what the plan's capacity needs; lengths within tables.
    unsafe { plan.decode_raw(&args, s.cu_stream()) }.unwrap();
    let got = to_f32(&gpu, &out);
    let got_lse = s.clone_dtoh(&lse).unwrap();
    assert!(
        got[..HEADS * D].iter().all(|&x| x == 0.0),
        "padding row output"
    );
    assert!(
        got_lse[..HEADS].iter().all(|&x| x == f32::NEG_INFINITY),
        "padding row lse"
    );
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (want, _) = e.reference(&[sq], &q16[HEADS * D..], 1);
    assert_close("row after padding", &got[HEADS * D..], &want, half_ulp_f16);
    assert_eq!(s.clone_dtoh(&counters).unwrap()[1], 0, "no fault yet");
    // A block id outside the pool: counted, not read.
    let mut bad = data.clone();
    bad[8 + 2] = 999;
    let bad_table = s.clone_htod(&bad).unwrap();
    let args = raw_args(
        bad_table.device_ptr(s).0,
        out_ptr,
        lse_ptr,
        e.dev.counters_raw(),
    );
    // SAFETY: as above; the bad id is the point (the kernel stays inside the pool).
    unsafe { plan.decode_raw(&args, s.cu_stream()) }.unwrap();
    assert!(e.dev.check_appends().is_err(), "a fault must be reported");
    assert_eq!(e.dev.check_appends().unwrap(), 0, "and the counters reset");
    // Padding is also what a safe decode does with a cleared row.
    let mut t = DeviceBlockTables::with_capacity(
        &e.dev,
        TablesCapacity {
            max_batch: 2,
            max_context_len: 8 * BS,
        },
    )
    .unwrap();
    t.set_batch(2).unwrap();
    e.set_row(&mut t, 1, sq);
    t.upload().unwrap();
    plan.decode(&mut ws, &e.dev, &t, &q, &mut out, Some(&mut lse))
        .unwrap();
    let got = to_f32(&gpu, &out);
    assert!(got[..HEADS * D].iter().all(|&x| x == 0.0));
    assert_close(
        "safe decode after padding",
        &got[HEADS * D..],
        &want,
        half_ulp_f16,
    );
    // Changes not uploaded are refused.
    t.clear_row(1).unwrap();
    assert!(
        plan.decode(&mut ws, &e.dev, &t, &q, &mut out, None)
            .is_err()
    );
}

/// Blocks freed by a long sequence and reused by a short one: the short one's decode sees only
/// its own tokens (the old bytes past its length never leak in).
#[test]
fn reused_blocks_do_not_leak_old_tokens() {
    let Some(gpu) = require_gpu_or_skip("reused_blocks_do_not_leak_old_tokens") else {
        return;
    };
    let mut e = Engine::new(&gpu, KvFormat::Int4Sym32, KvFormat::Int4Affine64, 40, 19);
    let old = e.alloc.create_sequence();
    e.append(old, 600);
    e.alloc.free(old).unwrap();
    let new = e.alloc.create_sequence();
    e.append(new, 21); // 2 blocks: the second one mostly holds `old`'s tokens
    let plan = DecodePlan::new(
        &gpu,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: 1,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: 21,
        },
    )
    .unwrap();
    let mut ws = DecodeWorkspace::new(&plan).unwrap();
    let tables = DeviceBlockTables::new(&e.dev, &e.alloc.block_tables(&[new]).unwrap()).unwrap();
    let qh: Vec<f16> = e
        .rng
        .normals(HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let q = gpu.stream().clone_htod(&qh).unwrap();
    let mut out = gpu.stream().alloc_zeros::<f16>(qh.len()).unwrap();
    plan.decode(&mut ws, &e.dev, &tables, &q, &mut out, None)
        .unwrap();
    let q16: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (want, _) = e.reference(&[new], &q16, 1);
    assert_close("reused blocks", &to_f32(&gpu, &out), &want, half_ulp_f16);
}

/// KV heads sharded over the visible GPUs (two shards on one GPU when only one is there), one
/// cache per shard, decoded concurrently: the gathered output equals the whole layer's decode
/// bit for bit (same launch shape forced on every plan).
#[test]
fn tensor_parallel_shards_gather_to_the_whole() {
    let Some(gpu0) = require_gpu_or_skip("tensor_parallel_shards_gather_to_the_whole") else {
        return;
    };
    let mut devices = vec![gpu0.clone()];
    while let Ok(g) = Gpu::new(devices.len()) {
        devices.push(g);
    }
    let shards = devices.len().max(2);
    eprintln!(
        "tensor parallel: {shards} shards over {} device(s)",
        devices.len()
    );
    let mut e = Engine::new(&gpu0, KvFormat::Int4Sym32, KvFormat::Fp8E4m3, 128, 23);
    let seqs: Vec<SeqId> = (0..3).map(|_| e.alloc.create_sequence()).collect();
    for (i, &sq) in seqs.iter().enumerate() {
        e.append(sq, 400 + 250 * i);
    }
    let tables = e.alloc.block_tables(&seqs).unwrap();
    let max = *tables.context_lens.iter().max().unwrap() as usize;
    let pin = |p: DecodePlan| p.with_num_splits(2).with_launch(4, 3).unwrap();
    let qh: Vec<f16> = e
        .rng
        .normals(seqs.len() * HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let whole_plan = pin(DecodePlan::new(
        &gpu0,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: 3,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: max,
        },
    )
    .unwrap());
    let mut ws = DecodeWorkspace::new(&whole_plan).unwrap();
    let dt = DeviceBlockTables::new(&e.dev, &tables).unwrap();
    let q = gpu0.stream().clone_htod(&qh).unwrap();
    let mut out = gpu0.stream().alloc_zeros::<f16>(qh.len()).unwrap();
    whole_plan
        .decode(&mut ws, &e.dev, &dt, &q, &mut out, None)
        .unwrap();
    let want = gpu0.stream().clone_dtoh(&out).unwrap();

    // Each shard: KV heads [i * per, (i + 1) * per) of the host cache, copied byte for byte out
    // of its blocks into a cache of `per` heads (the layout keeps heads in sections).
    let per = KV_HEADS / shards;
    let whole_layout = *e.host.layout();
    let mut outs = Vec::new();
    for i in 0..shards {
        let dev = &devices[i % devices.len()];
        let gpu = Gpu::from_stream(dev.context().new_stream().unwrap()).unwrap();
        let config = CacheConfig::new(
            per,
            D,
            BS,
            e.host.config().k_format,
            e.host.config().v_format,
        )
        .unwrap();
        let mut part = HostCache::new(config, e.host.num_blocks()).unwrap();
        let pl = *part.layout();
        for blk in 0..e.host.num_blocks() {
            let src = blk * whole_layout.block_stride + i * per * whole_layout.head_stride;
            let dst = blk * pl.block_stride;
            let n = per * pl.head_stride;
            part.pool_mut()[dst..dst + n].copy_from_slice(&e.host.pool()[src..src + n]);
        }
        let hk = &e.host.k_scales()[i * per..(i + 1) * per];
        let hv = &e.host.v_scales()[i * per..(i + 1) * per];
        part.set_scales(hk, hv).unwrap();
        let cache = DeviceCache::from_host(&gpu, &part).unwrap();
        let plan = pin(DecodePlan::new(
            &gpu,
            cache.layout(),
            DecodeCapacity {
                max_batch: 3,
                num_q_heads: per * GROUP,
                max_q_len: 1,
                max_context_len: max,
            },
        )
        .unwrap());
        let ws = DecodeWorkspace::new(&plan).unwrap();
        let t = DeviceBlockTables::new(&cache, &tables).unwrap();
        let w = per * GROUP * D;
        let qs: Vec<f16> = qh
            .chunks(HEADS * D)
            .flat_map(|row| row[i * w..(i + 1) * w].to_vec())
            .collect();
        let q = gpu.stream().clone_htod(&qs).unwrap();
        let out = gpu.stream().alloc_zeros::<f16>(qs.len()).unwrap();
        outs.push((gpu, cache, plan, ws, t, q, out));
    }
    for (_, cache, plan, ws, t, q, out) in outs.iter_mut() {
        plan.decode(ws, cache, t, q, out, None).unwrap();
    }
    let mut gathered = vec![f16::ZERO; want.len()];
    let w = per * GROUP * D;
    for (i, (gpu, _, _, _, _, _, out)) in outs.iter().enumerate() {
        let part = gpu.stream().clone_dtoh(out).unwrap();
        for b in 0..seqs.len() {
            gathered[b * HEADS * D + i * w..b * HEADS * D + (i + 1) * w]
                .copy_from_slice(&part[b * w..(b + 1) * w]);
        }
    }
    let differ = gathered
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differ, 0,
        "{differ} gathered outputs differ from the one-GPU decode"
    );
}

/// Appends and decodes of different sequences of one pool, queued on two streams at once, give
/// the pool bytes and outputs the same work gives queued on one stream.
#[test]
fn two_streams_on_one_pool_match_one_stream() {
    let Some(gpu) = require_gpu_or_skip("two_streams_on_one_pool_match_one_stream") else {
        return;
    };
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Gpu>();
    assert_send_sync::<DeviceCache>();
    assert_send_sync::<DecodePlan>();
    assert_send_sync::<DecodeWorkspace>();
    assert_send_sync::<DeviceBlockTables>();
    assert_send_sync::<SwapSpace>();

    let (k, v) = (KvFormat::Int4Sym32, KvFormat::Fp8E4m3);
    let config = CacheConfig::new(KV_HEADS, D, BS, k, v).unwrap();
    let mut rng = Rng(29);
    let lens = [900usize, 700];
    let data: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&n| {
            (
                rng.normals(n * KV_HEADS * D, 1.0),
                rng.normals(n * KV_HEADS * D, 1.0),
            )
        })
        .collect();
    let qh: Vec<f16> = rng
        .normals(HEADS * D, 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    // Sequence i owns blocks [i * 64, (i + 1) * 64).
    let rows: Vec<Vec<i32>> = (0..2).map(|i| (i * 64..i * 64 + 64).collect()).collect();
    let run = |streams: [&Gpu; 2]| -> (Vec<u8>, Vec<Vec<f16>>) {
        let mut host = HostCache::new(config, 128).unwrap();
        host.set_scales(&[0.02, 0.03], &[0.01, 0.015]).unwrap();
        let cache = DeviceCache::from_host(&gpu, &host).unwrap();
        gpu.synchronize().unwrap();
        let mut outs = Vec::new();
        let mut keep = Vec::new();
        for i in 0..2 {
            let g = streams[i];
            let s = g.stream();
            let slots: Vec<i32> = (0..lens[i])
                .map(|t| rows[i][t / BS] * BS as i32 + (t % BS) as i32)
                .collect();
            let slots = s.clone_htod(&slots).unwrap();
            let (kd, vd) = (
                s.clone_htod(&data[i].0).unwrap(),
                s.clone_htod(&data[i].1).unwrap(),
            );
            let row = KV_HEADS * D;
            // SAFETY: the pool is alive for the whole closure; the slots of the two streams are
            // in disjoint blocks; k, v and slots live on stream `s` until it is synchronized.
            unsafe {
                ops::append_raw(
                    &ops::RawAppendArgs {
                        cache: cache.as_raw(),
                        num_blocks: cache.num_blocks(),
                        slots: slots.device_ptr(s).0,
                        slots_i64: false,
                        num_tokens: lens[i],
                        k: kd.device_ptr(s).0,
                        v: vd.device_ptr(s).0,
                        dtype: Dtype::F32,
                        k_token_stride: row,
                        v_token_stride: row,
                        counters: cache.counters_raw(),
                    },
                    s.cu_stream(),
                )
            }
            .unwrap();
            keep.push((slots, kd, vd));
        }
        for i in 0..2 {
            // Each decode on the stream that appended its sequence.
            let g = streams[i];
            let plan = DecodePlan::new(
                g,
                cache.layout(),
                DecodeCapacity {
                    max_batch: 1,
                    num_q_heads: HEADS,
                    max_q_len: 1,
                    max_context_len: lens[i],
                },
            )
            .unwrap();
            let mut ws = DecodeWorkspace::new(&plan).unwrap();
            let tables = BlockTables::from_rows(&[&rows[i]], &[lens[i]]).unwrap();
            let mut t = DeviceBlockTables::with_capacity_on(
                g,
                &cache,
                TablesCapacity {
                    max_batch: 1,
                    max_context_len: 64 * cache.config().block_size,
                },
            )
            .unwrap();
            t.update(&tables).unwrap();
            let q = g.stream().clone_htod(&qh).unwrap();
            let mut out = g.stream().alloc_zeros::<f16>(qh.len()).unwrap();
            // The cache is on `gpu`'s stream; for the decode only the appends on `g` matter,
            // and they are on g's own stream.
            let r = plan.decode(&mut ws, &cache, &t, &q, &mut out, None);
            r.unwrap();
            outs.push(g.stream().clone_dtoh(&out).unwrap());
        }
        for g in streams {
            g.synchronize().unwrap();
        }
        let bytes = cache.to_host().unwrap().pool().to_vec();
        (bytes, outs)
    };
    let other = Gpu::from_stream(gpu.context().new_stream().unwrap()).unwrap();
    let serial = run([&gpu, &gpu]);
    let concurrent = run([&gpu, &other]);
    assert!(
        serial.0 == concurrent.0,
        "pool bytes differ between one and two streams"
    );
    assert_eq!(
        serial.1, concurrent.1,
        "outputs differ between one and two streams"
    );
}
