//! An engine's step loop on kvq, end to end: requests arrive with prompts and leave when their
//! generation is done; prompts are prefilled in chunks (each chunk is appended, then attends
//! to the cached prefix and to itself through `PrefillPlan`, in one ragged launch for every
//! prefilling request); one request is forked for parallel sampling (its shared last block is
//! copied on write) and one for a prefix-cache hit (the fork shares the prefix and prefills
//! only its own suffix); every step runs one decode of the whole batch through a CUDA graph
//! captured once at the capacity, with the free rows as padding. A host mirror of the cache
//! receives the same appends and copies, and a few steps of decode and prefill are checked
//! against the CPU reference.
//!
//! Printed: decode tokens per second (GPU time of the graph), prefill tokens per second (GPU
//! time of the prefill launches), the host time per step of the table updates + upload and of
//! the graph launch (kvq's per-step overhead), and, at the end, the capacity shape through the
//! graph against a plan made for exactly that batch.
//!
//! ```sh
//! cargo run --release --features cuda --example engine_step -- [--steps N] [--format int4|fp8|f16] \
//!     [--two-pass]
//! ```
//!
//! `--two-pass`: the prefill plan runs each step whose prefilling requests' contexts fit a
//! scratch of `TWO_PASS_SCRATCH` tokens in two passes (`PrefillPlan::with_two_pass`, from any
//! number of rows), the context decoded into the scratch first; checked against the CPU alike.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use half::f16;
use kvq::cache::{BlockAllocator, HostCache, Reservation, SeqId};
use kvq::cpu::{
    Accum, AttentionOptions, DecodeShape, HeadTerms, decode_attention, prefill_attention,
};
use kvq::cuda::decode::{DecodeStep, RowStrides};
use kvq::cuda::prefill::{
    PrefillCapacity, PrefillPlan, PrefillStep, PrefillWorkspace, QoIndptr, TokenRows, TwoPass,
};
use kvq::cuda::{
    DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, Gpu,
    TablesCapacity, ops,
};
use kvq::{CacheConfig, KvFormat, Result};
use std::collections::HashSet;
use std::time::Instant;

// One Llama-3-8B attention layer: 32 query heads over 8 KV heads of 128, pages of 16.
const KV_HEADS: usize = 8;
const HEADS: usize = 32;
const D: usize = 128;
const BS: usize = 16;
const CAPACITY: usize = 64;
const MAX_CTX: usize = 4096;
const NUM_BLOCKS: usize = CAPACITY * MAX_CTX / BS + 256;
/// Prompt tokens appended per step, over all prefilling requests.
const PREFILL_BUDGET: usize = 1024;
/// Requests that may prefill in one step (rows of the prefill tables).
const PREFILL_ROWS: usize = CAPACITY + 16;
const ROW: usize = KV_HEADS * D;
/// Context tokens of the two-pass scratch (`--two-pass`): 134 MB of f16 keys and values.
const TWO_PASS_SCRATCH: usize = 32768;

struct Request {
    seq: SeqId,
    prompt: usize,
    prefilled: usize,
    to_generate: usize,
    row: Option<usize>,
}

/// splitmix64, so runs repeat.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn normal(&mut self) -> f32 {
        let s: f64 = (0..4)
            .map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64)
            .sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
}

/// The engine's state: one layer's cache on the GPU and its host mirror, the allocator, the
/// requests, and the batch rows.
struct Engine {
    gpu: Gpu,
    dev: DeviceCache,
    host: HostCache,
    alloc: BlockAllocator,
    tables: DeviceBlockTables,
    requests: Vec<Request>,
    free_rows: Vec<usize>,
    /// Sequences whose table row must be rewritten (a new row, or a block replaced by a
    /// copy-on-write copy), not just extended.
    rewrite: HashSet<SeqId>,
    rng: Rng,
    // Per-step staging for appends (allocated once).
    reservation: Reservation,
    slots: Vec<i32>,
    k: Vec<f32>,
    v: Vec<f32>,
    slots_dev: cudarc::driver::CudaSlice<i32>,
    k_dev: cudarc::driver::CudaSlice<f32>,
    v_dev: cudarc::driver::CudaSlice<f32>,
}

impl Engine {
    /// Queue `n` new tokens of `seq` for this step's append (copies applied at once).
    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.alloc.reserve_into(seq, n, &mut self.reservation)?;
        let r = &self.reservation;
        if !r.copies.is_empty() {
            self.rewrite.insert(seq);
        }
        self.dev.copy_blocks(&r.copies)?;
        self.host.apply_copies(&r.copies)?;
        r.extend_slots(&mut self.slots)?; // checked: no slot wraps past i32
        for _token in &r.slots {
            for i in 0..ROW {
                let outlier = if i % 16 == 3 { 6.0 } else { 1.0 };
                self.k.push(self.rng.normal() * outlier);
                self.v.push(self.rng.normal());
            }
        }
        Ok(())
    }

    /// Append everything reserved this step, on both caches.
    fn flush_appends(&mut self) -> Result<()> {
        let n = self.slots.len();
        if n == 0 {
            return Ok(());
        }
        let s = self.gpu.stream();
        s.memcpy_htod(&self.slots, &mut self.slots_dev.slice_mut(..n))?;
        s.memcpy_htod(&self.k, &mut self.k_dev.slice_mut(..n * ROW))?;
        s.memcpy_htod(&self.v, &mut self.v_dev.slice_mut(..n * ROW))?;
        ops::append(&mut self.dev, &self.slots_dev, &self.k_dev, &self.v_dev, n)?;
        let host_slots: Vec<usize> = self.slots.iter().map(|&x| x as usize).collect();
        self.host.write(&host_slots, &self.k, &self.v)?;
        self.slots.clear();
        self.k.clear();
        self.v.clear();
        Ok(())
    }

    fn admit(&mut self) {
        let prompt = 64 + self.rng.below(1500);
        let to_generate = 32 + self.rng.below(400);
        let seq = self.alloc.create_sequence();
        self.requests.push(Request {
            seq,
            prompt,
            prefilled: 0,
            to_generate,
            row: None,
        });
    }

    /// Blocks a request may still need (so admission never runs the pool dry).
    fn blocks_needed(&self) -> usize {
        self.requests
            .iter()
            .map(|r| (r.prompt + r.to_generate).div_ceil(BS) + 1)
            .sum()
    }
}

fn run(steps: usize, k: KvFormat, v: KvFormat, two_pass: bool) -> Result<()> {
    let gpu = Gpu::new(0)?;
    println!("{}", gpu.summary());
    // The decode is captured in a CUDA graph: cudarc must not make the captured stream wait on
    // buffer events recorded outside the capture. This loop queues everything on one stream.
    // SAFETY: every buffer below is used on `gpu`'s stream only.
    unsafe { gpu.context().disable_event_tracking() };
    let config = CacheConfig::new(KV_HEADS, D, BS, k, v)?;
    let mut host = HostCache::new(config, NUM_BLOCKS)?;
    if k.has_head_scale() || v.has_head_scale() {
        host.set_scales(&[0.03; KV_HEADS], &[0.01; KV_HEADS])?;
    }
    let dev = DeviceCache::from_host(&gpu, &host)?;
    let s = gpu.stream().clone();
    let max_step_tokens = PREFILL_BUDGET + 2 * CAPACITY;
    let mut e = Engine {
        tables: DeviceBlockTables::with_capacity(
            &dev,
            TablesCapacity {
                max_batch: CAPACITY,
                max_context_len: MAX_CTX,
            },
        )?,
        gpu: gpu.clone(),
        dev,
        host,
        alloc: BlockAllocator::for_config(&config, NUM_BLOCKS)?,
        requests: Vec::new(),
        free_rows: (0..CAPACITY).rev().collect(),
        rewrite: HashSet::new(),
        rng: Rng(2026),
        reservation: Reservation::default(),
        slots: Vec::new(),
        k: Vec::new(),
        v: Vec::new(),
        slots_dev: s.alloc_zeros(max_step_tokens)?,
        k_dev: s.alloc_zeros(max_step_tokens * ROW)?,
        v_dev: s.alloc_zeros(max_step_tokens * ROW)?,
    };
    e.tables.set_batch(CAPACITY)?;

    // Made once: the plan for the capacity, its workspace, the step's buffers, the graph.
    let plan = DecodePlan::new(
        &gpu,
        e.dev.layout(),
        DecodeCapacity {
            max_batch: CAPACITY,
            num_q_heads: HEADS,
            max_q_len: 1,
            max_context_len: MAX_CTX,
        },
    )?;
    let mut ws = DecodeWorkspace::new(&plan)?;
    let rows = RowStrides::token_major(HEADS, 1, D);
    let q_host: Vec<f16> = (0..CAPACITY * HEADS * D)
        .map(|_| f16::from_f32(e.rng.normal()))
        .collect();
    let q = s.clone_htod(&q_host)?;
    let mut out = s.alloc_zeros::<f16>(CAPACITY * HEADS * D)?;
    e.tables.upload()?;
    gpu.synchronize()?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    plan.decode_step(
        &mut ws,
        &e.dev,
        &e.tables,
        DecodeStep {
            q_len: 1,
            q: &q,
            q_rows: rows,
            out: &mut out,
            out_rows: rows,
            lse: None,
            sinks: None,
            alibi_slopes: None,
        },
    )?;
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))?
        .ok_or_else(|| kvq::Error::Cuda("empty capture".into()))?;
    graph.upload()?;

    // Prefill, made once too: a plan for the prefilling requests of one step (up to
    // PREFILL_BUDGET new tokens), its workspace, its tables, the queries of the chunk tokens
    // and their outputs, and the device copy of the step's qo_indptr.
    let pplan = PrefillPlan::new(
        &gpu,
        e.dev.layout(),
        PrefillCapacity {
            max_batch: PREFILL_ROWS,
            num_q_heads: HEADS,
            max_tokens: PREFILL_BUDGET,
            max_context_len: MAX_CTX,
        },
    )?
    .with_two_pass(two_pass.then_some(TwoPass {
        scratch_tokens: TWO_PASS_SCRATCH,
        min_rows: 0,
    }))?;
    let mut pws = PrefillWorkspace::new(&pplan)?;
    let mut ptables = DeviceBlockTables::with_capacity(
        &e.dev,
        TablesCapacity {
            max_batch: PREFILL_ROWS,
            max_context_len: MAX_CTX,
        },
    )?;
    let pq_host: Vec<f16> = (0..PREFILL_BUDGET * HEADS * D)
        .map(|_| f16::from_f32(e.rng.normal()))
        .collect();
    let pq = s.clone_htod(&pq_host)?;
    let mut pout = s.alloc_zeros::<f16>(PREFILL_BUDGET * HEADS * D)?;
    let mut qo = QoIndptr::new(&gpu, PREFILL_ROWS)?;
    let mut chunk_tokens: Vec<usize> = Vec::with_capacity(PREFILL_ROWS);
    let prow = TokenRows::contiguous(HEADS, D);
    let (mut prefilled_tokens, mut prefill_checked) = (0usize, 0usize);
    let (mut prefill_steps, mut two_pass_steps, mut two_pass_checked) = (0usize, 0usize, 0usize);
    let mut prefill_events = Vec::new();
    let mut prefix_hit: Option<SeqId> = None;
    let mut prefix_hit_checked = false;

    let ctx = gpu.context().clone();
    let mut events = Vec::new();
    let (mut host_rows_us, mut host_tables_us, mut host_launch_us) =
        (Vec::new(), Vec::new(), Vec::new());
    let (mut decoded, mut checked, mut forked) = (0usize, 0usize, false);
    let started = Instant::now();
    for step in 0..steps {
        // Arrivals, while the pool can hold every admitted request to its end.
        while e.requests.len() < CAPACITY + 8
            && e.blocks_needed() + 64 < NUM_BLOCKS
            && e.rng.below(3) != 0
        {
            e.admit();
        }
        // A fork once the batch is busy: parallel sampling of a running request.
        if !forked && step > 20 {
            if let Some(i) = e.requests.iter().position(|r| r.row.is_some()) {
                if let Some(row) = e.free_rows.pop() {
                    let parent = &e.requests[i];
                    let seq = e.alloc.fork(parent.seq)?;
                    let (prompt, to_generate) = (parent.prompt, parent.to_generate);
                    e.requests.push(Request {
                        seq,
                        prompt,
                        prefilled: prompt,
                        to_generate,
                        row: Some(row),
                    });
                    e.rewrite.insert(seq);
                    forked = true;
                    println!("step {step}: request {i} forked into row {row} (copy-on-write)");
                }
            }
        }
        // A prefix-cache hit once the batch is busy: a new request whose prompt starts with a
        // running request's tokens shares its blocks and prefills only its own suffix.
        if prefix_hit.is_none() && step > 30 {
            if let Some(i) = e.requests.iter().position(|r| r.row.is_some()) {
                let parent = e.requests[i].seq;
                let seq = e.alloc.fork(parent)?;
                let shared = e.alloc.len(seq)?;
                e.requests.push(Request {
                    seq,
                    prompt: shared + 300,
                    prefilled: shared,
                    to_generate: 40,
                    row: None,
                });
                prefix_hit = Some(seq);
                println!(
                    "step {step}: prefix hit on request {i}: {shared} cached tokens shared, a \
                     suffix of 300 to prefill"
                );
            }
        }
        // Prefill chunks (their rows of the prefill tables as appended: the chunk is the last
        // tokens of its sequence), then one new token per decoding request.
        let mut budget = PREFILL_BUDGET;
        let mut chunks: Vec<(SeqId, Vec<i32>, usize, usize)> = Vec::new(); // seq, blocks, len, n
        for i in 0..e.requests.len() {
            let r = &e.requests[i];
            if r.prefilled < r.prompt && budget > 0 {
                let n = (r.prompt - r.prefilled).min(budget);
                let seq = r.seq;
                e.reserve(seq, n)?;
                e.requests[i].prefilled += n;
                budget -= n;
                let blocks = e.alloc.block_table(seq)?.to_vec();
                chunks.push((seq, blocks, e.alloc.len(seq)?, n));
            }
        }
        for (row, (_, blocks, len, _)) in chunks.iter().enumerate() {
            ptables.set_row(row, blocks, *len)?;
        }
        for i in 0..e.requests.len() {
            let r = &e.requests[i];
            if r.prefilled == r.prompt && r.row.is_none() {
                if let Some(row) = e.free_rows.pop() {
                    e.requests[i].row = Some(row);
                    let seq = e.requests[i].seq;
                    e.rewrite.insert(seq);
                }
            }
            if e.requests[i].row.is_some() {
                let seq = e.requests[i].seq;
                e.reserve(seq, 1)?;
            }
        }
        e.flush_appends()?;

        // One ragged prefill launch for every chunk of the step: each chunk attends to its
        // sequence's cached tokens and causally to itself.
        if !chunks.is_empty() {
            ptables.set_batch(chunks.len())?;
            ptables.upload()?;
            chunk_tokens.clear();
            chunk_tokens.extend(chunks.iter().map(|c| c.3));
            qo.set_counts(&chunk_tokens)?; // the offsets, host and device together
            let (a, b) = (
                ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
                ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            );
            a.record(&s)?;
            pplan.prefill(
                &mut pws,
                &e.dev,
                &ptables,
                PrefillStep {
                    qo_indptr: qo.host(),
                    qo_indptr_dev: qo.device(),
                    q: &pq,
                    q_rows: prow,
                    out: &mut pout,
                    out_rows: prow,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            )?;
            b.record(&s)?;
            let total = *qo.host().last().unwrap() as usize;
            prefilled_tokens += total;
            prefill_steps += 1;
            let two_passes = pws.two_pass_last_step();
            two_pass_steps += usize::from(two_passes);
            let hit_now = prefix_hit.is_some_and(|h| chunks.iter().any(|c| c.0 == h));
            if step == 0 || step == steps / 2 || (hit_now && !prefix_hit_checked) {
                // Against the CPU reference over the host mirror, with the same tables.
                let got: Vec<f32> = s.clone_dtoh(&pout)?.iter().map(|x| x.to_f32()).collect();
                let rows: Vec<&[i32]> = chunks.iter().map(|c| c.1.as_slice()).collect();
                let lens: Vec<usize> = chunks.iter().map(|c| c.2).collect();
                let tables = kvq::cache::BlockTables::from_rows(&rows, &lens)?;
                let q: Vec<f32> = pq_host[..total * HEADS * D]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let want = prefill_attention(
                    &e.host,
                    &tables,
                    qo.host(),
                    &q,
                    HEADS,
                    &AttentionOptions::new(D),
                    HeadTerms::default(),
                    Accum::F64,
                )?;
                let (mut num, mut den) = (0f64, 0f64);
                for (g, &w) in got.iter().zip(&want.out) {
                    let d = *g as f64 - w as f64;
                    num += d * d;
                    den += (w as f64) * (w as f64);
                }
                let rel = (num / den).sqrt();
                if rel > 2e-3 {
                    return Err(kvq::Error::InvalidArgument(format!(
                        "step {step}: the prefill of {} chunks differs from the CPU by {rel:.2e}",
                        chunks.len()
                    )));
                }
                prefill_checked += 1;
                two_pass_checked += usize::from(two_passes);
                prefix_hit_checked |= hit_now;
                println!(
                    "step {step}: prefill of {} chunks ({total} tokens{}{}) matches the CPU \
                     reference (rel {rel:.1e})",
                    chunks.len(),
                    if hit_now {
                        ", the prefix hit's suffix among them"
                    } else {
                        ""
                    },
                    if two_passes { ", two passes" } else { "" }
                );
            }
            prefill_events.push((a, b));
        }

        // kvq's per-step host work: the rows that changed, one upload, one graph launch.
        let t0 = Instant::now();
        for r in &e.requests {
            if let Some(row) = r.row {
                let blocks = e.alloc.block_table(r.seq)?;
                let len = e.alloc.len(r.seq)?;
                if e.rewrite.contains(&r.seq) {
                    e.tables.set_row(row, blocks, len)?;
                } else {
                    // The common case: at most one new block, and a longer length.
                    for &b in &blocks[e.tables.row_blocks(row).unwrap_or(0)..] {
                        e.tables.push_block(row, b)?;
                    }
                    e.tables.set_len(row, len)?;
                }
            }
        }
        e.rewrite.clear();
        let t_rows = Instant::now();
        e.tables.upload()?;
        let t1 = Instant::now();
        let (start, end) = (
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        start.record(&s)?;
        let t2 = Instant::now();
        graph.launch()?;
        let t3 = Instant::now();
        end.record(&s)?;
        host_rows_us.push((t_rows - t0).as_secs_f64() * 1e6);
        host_tables_us.push((t1 - t_rows).as_secs_f64() * 1e6);
        host_launch_us.push((t3 - t2).as_secs_f64() * 1e6);
        let live: Vec<(usize, SeqId)> = e
            .requests
            .iter()
            .filter_map(|r| r.row.map(|row| (row, r.seq)))
            .collect();
        events.push((start, end, live.len()));
        decoded += live.len();

        // A few steps against the CPU reference (every live row).
        if !live.is_empty() && (step == 5 || step == steps / 2 || step + 1 == steps || step == 25) {
            let got = s.clone_dtoh(&out)?;
            for &(row, seq) in &live {
                let tables = e.alloc.block_tables(&[seq])?;
                let qr: Vec<f32> = q_host[row * HEADS * D..(row + 1) * HEADS * D]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let want = decode_attention(
                    &e.host,
                    &tables,
                    &qr,
                    &DecodeShape::new(HEADS, 1),
                    &AttentionOptions::new(D),
                    Accum::F64,
                )?;
                let g = &got[row * HEADS * D..(row + 1) * HEADS * D];
                let (mut num, mut den) = (0f64, 0f64);
                for (a, &b) in g.iter().zip(&want.out) {
                    let d = a.to_f32() as f64 - b as f64;
                    num += d * d;
                    den += (b as f64) * (b as f64);
                }
                let rel = (num / den).sqrt();
                if rel > 2e-3 {
                    return Err(kvq::Error::InvalidArgument(format!(
                        "step {step} row {row}: GPU differs from the CPU by {rel:.2e}"
                    )));
                }
            }
            checked += 1;
            println!(
                "step {step}: {} live rows match the CPU reference",
                live.len()
            );
        }

        // Finished requests free their blocks and rows (padding from the next step on).
        let mut i = 0;
        while i < e.requests.len() {
            let r = &mut e.requests[i];
            if r.row.is_some() {
                r.to_generate -= 1;
            }
            if r.to_generate == 0 {
                let r = e.requests.swap_remove(i);
                e.alloc.free(r.seq)?;
                if let Some(row) = r.row {
                    e.tables.clear_row(row)?;
                    e.free_rows.push(row);
                }
            } else {
                i += 1;
            }
        }
    }
    gpu.synchronize()?;
    let wall = started.elapsed().as_secs_f64();
    let mut gpu_ms = 0f64;
    for (a, b, _) in &events {
        gpu_ms += a.elapsed_ms(b)? as f64;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let avg_batch = decoded as f64 / steps as f64;
    println!(
        "\n{steps} steps ({k} keys, {v} values), capacity {CAPACITY}, mean batch {avg_batch:.1}, \
         {checked} steps checked against the CPU"
    );
    println!(
        "decode: {:.0} tokens/s of attention GPU time ({:.1} us per step); whole loop incl. \
         host appends and CPU mirror: {:.1} s",
        decoded as f64 / (gpu_ms / 1e3),
        gpu_ms * 1e3 / steps as f64,
        wall
    );
    let mut prefill_ms = 0f64;
    for (a, b) in &prefill_events {
        prefill_ms += a.elapsed_ms(b)? as f64;
    }
    println!(
        "prefill: {prefilled_tokens} prompt tokens in chunks of up to {PREFILL_BUDGET} per step, \
         {:.0} tokens/s of attention GPU time; {prefill_checked} steps checked against the CPU{}",
        prefilled_tokens as f64 / (prefill_ms / 1e3),
        if prefix_hit_checked {
            " (the prefix hit's suffix among them)"
        } else {
            ""
        }
    );
    if two_pass {
        println!(
            "two passes: {two_pass_steps} of {prefill_steps} prefill steps, {two_pass_checked} \
             of them checked"
        );
        if two_pass_checked == 0 {
            return Err(kvq::Error::InvalidArgument(
                "--two-pass: no two-pass step was checked against the CPU".into(),
            ));
        }
    }
    if prefix_hit.is_some() && !prefix_hit_checked {
        return Err(kvq::Error::InvalidArgument(
            "the prefix hit's suffix was never checked against the CPU".into(),
        ));
    }
    let (rows_us, upload_us, launch_us) = (
        median(&mut host_rows_us),
        median(&mut host_tables_us),
        median(&mut host_launch_us),
    );
    println!(
        "host per step (median): row updates (allocator lookups + set_len / push_block) \
         {rows_us:.1} us, upload {upload_us:.1} us, graph launch {launch_us:.1} us: \
         {:.1} us in all",
        rows_us + upload_us + launch_us
    );

    // kvq's host cost per step in isolation (no engine work in between, 2000 steps): every
    // row's length changes and 4 rows change a block, then one upload; a decode launched
    // directly (checks + launch) and through the graph.
    let per_row = MAX_CTX.div_ceil(BS);
    let row_blocks: Vec<Vec<i32>> = (0..CAPACITY)
        .map(|r| (0..per_row).map(|i| (r * per_row + i) as i32).collect())
        .collect();
    for (r, blocks) in row_blocks.iter().enumerate() {
        e.tables.set_row(r, blocks, MAX_CTX - 1)?;
    }
    e.tables.upload()?;
    gpu.synchronize()?;
    const N: usize = 2000;
    // The device idles before each timed step (synchronized outside the timing), as it does
    // when a step's host work starts: what is timed is the host's own cost.
    let mut updates_us = 0f64;
    let before = e.tables.upload_stats();
    for it in 0..N {
        gpu.synchronize()?;
        let t = Instant::now();
        for r in 0..CAPACITY {
            e.tables.set_len(r, MAX_CTX - 1 - it % 2)?;
        }
        for k in 0..4 {
            let r = (it * 4 + k) % CAPACITY;
            let last = per_row - 1;
            let b = row_blocks[r][last] + if it % 2 == 0 { 0 } else { 1 };
            let b = b.min(NUM_BLOCKS as i32 - 1);
            e.tables.set_block(r, last, b)?;
        }
        e.tables.upload()?;
        updates_us += t.elapsed().as_secs_f64() * 1e6 / N as f64;
    }
    let after = e.tables.upload_stats();
    let mut direct_us = 0f64;
    for _ in 0..N {
        gpu.synchronize()?;
        let t = Instant::now();
        plan.decode_step(
            &mut ws,
            &e.dev,
            &e.tables,
            DecodeStep {
                q_len: 1,
                q: &q,
                q_rows: rows,
                out: &mut out,
                out_rows: rows,
                lse: None,
                sinks: None,
                alibi_slopes: None,
            },
        )?;
        direct_us += t.elapsed().as_secs_f64() * 1e6 / N as f64;
    }
    let mut graph_us = 0f64;
    for _ in 0..N {
        gpu.synchronize()?;
        let t = Instant::now();
        graph.launch()?;
        graph_us += t.elapsed().as_secs_f64() * 1e6 / N as f64;
    }
    gpu.synchronize()?;
    println!(
        "host per step, kvq alone ({N} steps, B={CAPACITY}): 64 lengths + 4 block entries + \
         upload {updates_us:.1} us; decode launch {direct_us:.1} us direct, {graph_us:.1} us \
         through the graph: {:.1} us per step with the graph; uploads that waited for the \
         device: {} of {} (loop above: {} of {})",
        updates_us + graph_us,
        after.1 - before.1,
        after.0 - before.0,
        before.1,
        before.0
    );

    // Throughput at the capacity: the capacity plan (through its graph) against a plan made
    // for exactly the step's shape, every row full (B=64), then half the rows padding (B=32).
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..5 {
            f()?;
        }
        let (a, b) = (
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        a.record(&s)?;
        for _ in 0..50 {
            f()?;
        }
        b.record(&s)?;
        b.synchronize()?;
        Ok(a.elapsed_ms(&b)? as f64 * 1e3 / 50.0)
    };
    for live in [CAPACITY, CAPACITY / 2] {
        for (r, blocks) in row_blocks.iter().enumerate() {
            if r < live {
                e.tables.set_row(r, blocks, MAX_CTX)?;
            } else {
                e.tables.clear_row(r)?;
            }
        }
        e.tables.set_batch(CAPACITY)?;
        e.tables.upload()?;
        let via_graph = time(&mut || Ok(graph.launch()?))?;
        e.tables.set_batch(live)?;
        let exact = DecodePlan::new(
            &gpu,
            e.dev.layout(),
            DecodeCapacity {
                max_batch: live,
                num_q_heads: HEADS,
                max_q_len: 1,
                max_context_len: MAX_CTX,
            },
        )?;
        let mut ws2 = DecodeWorkspace::new(&exact)?;
        let via_exact = time(&mut || {
            exact.decode_step(
                &mut ws2,
                &e.dev,
                &e.tables,
                DecodeStep {
                    q_len: 1,
                    q: &q,
                    q_rows: rows,
                    out: &mut out,
                    out_rows: rows,
                    lse: None,
                    sinks: None,
                    alibi_slopes: None,
                },
            )
        })?;
        println!(
            "{live} of {CAPACITY} rows live, L={MAX_CTX} (back to back, L2 warm): capacity plan \
             through its graph {via_graph:.1} us, a plan for exactly {live} rows {via_exact:.1} us \
             ({:+.1} %)",
            (via_graph / via_exact - 1.0) * 100.0
        );
    }
    e.dev.check_appends()?;
    Ok(())
}

fn main() {
    let mut steps = 200;
    let mut format = "int4".to_string();
    let mut two_pass = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => steps = args.next().and_then(|s| s.parse().ok()).unwrap_or(steps),
            "--format" => format = args.next().unwrap_or(format),
            "--two-pass" => two_pass = true,
            other => {
                eprintln!(
                    "unknown argument {other}; use --steps N --format int4|fp8|f16 --two-pass"
                );
                std::process::exit(2);
            }
        }
    }
    let (k, v) = match format.as_str() {
        "int4" => (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        "fp8" => (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        "f16" => (KvFormat::F16, KvFormat::F16),
        other => {
            eprintln!("unknown format {other}");
            std::process::exit(2);
        }
    };
    if let Err(err) = run(steps, k, v, two_pass) {
        eprintln!("engine_step: {err}");
        std::process::exit(1);
    }
}
