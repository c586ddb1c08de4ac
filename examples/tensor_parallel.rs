//! Tensor-parallel decode: the KV heads of one attention layer sharded over the visible GPUs,
//! one cache per device (each holding its shard's heads in every block), one block allocator
//! for all of them, the shards decoded concurrently, their outputs gathered (query heads in
//! order), and the result compared with the same layer decoded whole on one GPU.
//!
//! With the same launch shape on every shard (forced here), each shard runs the very arithmetic
//! the whole-layer launch runs for those heads, so the gathered output equals it bit for bit.
//! With fewer GPUs than shards, shards share devices (on their own streams).
//!
//! ```sh
//! cargo run --release --features cuda --example tensor_parallel -- [--shards N]
//! ```

use half::f16;
use kvq::cache::{BlockAllocator, HostCache};
use kvq::cuda::{
    DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, Gpu, is_available,
};
use kvq::{CacheConfig, KvFormat, Result};

const KV_HEADS: usize = 8;
const GROUP: usize = 4;
const D: usize = 128;
const BS: usize = 16;
const BATCH: usize = 16;
const LEN: usize = 3000;

fn gpus() -> Result<Vec<Gpu>> {
    let mut v = Vec::new();
    while let Ok(g) = Gpu::new(v.len()) {
        v.push(g);
    }
    if v.is_empty() {
        v.push(Gpu::new(0)?);
    }
    Ok(v)
}

fn run(shards: usize) -> Result<()> {
    let devices = gpus()?;
    println!(
        "{} GPU(s): {}",
        devices.len(),
        devices
            .iter()
            .map(|g| g.props().name.clone())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if KV_HEADS % shards != 0 {
        return Err(kvq::Error::InvalidArgument(format!(
            "{shards} shards do not divide {KV_HEADS} KV heads"
        )));
    }
    let (k, v) = (KvFormat::Int4Sym32, KvFormat::Int4Affine64);
    // The whole layer's K/V on the host, [tokens of all sequences, KV_HEADS, D].
    let num_blocks = BATCH * LEN.div_ceil(BS);
    let mut alloc = BlockAllocator::new(num_blocks, BS)?;
    let mut seed = 17u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
    };
    let mut slots = Vec::new();
    let mut seqs = Vec::new();
    for b in 0..BATCH {
        let s = alloc.create_sequence();
        slots.extend(alloc.reserve(s, LEN - 97 * b)?.slots);
        seqs.push(s);
    }
    let n = slots.len();
    let kv_k: Vec<f32> = (0..n * KV_HEADS * D).map(|_| rnd()).collect();
    let kv_v: Vec<f32> = (0..n * KV_HEADS * D).map(|_| rnd()).collect();
    let tables = alloc.block_tables(&seqs)?;
    let q: Vec<f16> = (0..BATCH * KV_HEADS * GROUP * D)
        .map(|_| f16::from_f32(rnd()))
        .collect();

    // Heads [h0, h1) of a [rows, KV_HEADS * width] tensor.
    let heads_of = |x: &[f32], h0: usize, h1: usize, width: usize| -> Vec<f32> {
        x.chunks(KV_HEADS * width)
            .flat_map(|row| row[h0 * width..h1 * width].iter().copied())
            .collect()
    };
    let layer = |gpu: &Gpu, heads: usize, kk: &[f32], vv: &[f32]| -> Result<DeviceCache> {
        let mut host = HostCache::new(CacheConfig::new(heads, D, BS, k, v)?, num_blocks)?;
        host.write(&slots, kk, vv)?;
        DeviceCache::from_host(gpu, &host)
    };
    let launch =
        |plan: DecodePlan| -> Result<DecodePlan> { plan.with_num_splits(2).with_launch(4, 2) };

    // One GPU, every head.
    let whole_gpu = &devices[0];
    let whole = layer(whole_gpu, KV_HEADS, &kv_k, &kv_v)?;
    let plan = launch(DecodePlan::new(
        whole_gpu,
        whole.layout(),
        DecodeCapacity {
            max_batch: BATCH,
            num_q_heads: KV_HEADS * GROUP,
            max_q_len: 1,
            max_context_len: LEN,
        },
    )?)?;
    let mut ws = DecodeWorkspace::new(&plan)?;
    let dt = DeviceBlockTables::new(&whole, &tables)?;
    let s0 = whole_gpu.stream();
    let qd = s0.clone_htod(&q)?;
    let mut out = s0.alloc_zeros::<f16>(q.len())?;
    plan.decode(&mut ws, &whole, &dt, &qd, &mut out, None)?;
    let want = s0.clone_dtoh(&out)?;

    // The shards: KV heads [i * per, (i + 1) * per) and their query heads on device i % GPUs,
    // each on a stream of its own.
    let per = KV_HEADS / shards;
    struct Shard {
        gpu: Gpu,
        cache: DeviceCache,
        plan: DecodePlan,
        ws: DecodeWorkspace,
        tables: DeviceBlockTables,
        q: cudarc::driver::CudaSlice<f16>,
        out: cudarc::driver::CudaSlice<f16>,
    }
    let mut parts = Vec::new();
    for i in 0..shards {
        let dev = &devices[i % devices.len()];
        let gpu = Gpu::from_stream(dev.context().new_stream()?)?;
        let cache = layer(
            &gpu,
            per,
            &heads_of(&kv_k, i * per, (i + 1) * per, D),
            &heads_of(&kv_v, i * per, (i + 1) * per, D),
        )?;
        let plan = launch(DecodePlan::new(
            &gpu,
            cache.layout(),
            DecodeCapacity {
                max_batch: BATCH,
                num_q_heads: per * GROUP,
                max_q_len: 1,
                max_context_len: LEN,
            },
        )?)?;
        let ws = DecodeWorkspace::new(&plan)?;
        let tables = DeviceBlockTables::new(&cache, &tables)?;
        // q [BATCH, heads, D]: this shard's query heads of every sequence.
        let qf: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
        let qs: Vec<f16> = qf
            .chunks(KV_HEADS * GROUP * D)
            .flat_map(|row| row[i * per * GROUP * D..(i + 1) * per * GROUP * D].to_vec())
            .map(f16::from_f32)
            .collect();
        let s = gpu.stream();
        let q = s.clone_htod(&qs)?;
        let out = s.alloc_zeros::<f16>(qs.len())?;
        parts.push(Shard {
            gpu,
            cache,
            plan,
            ws,
            tables,
            q,
            out,
        });
    }
    // Concurrently: every shard's launch is queued before any is waited for.
    let t = std::time::Instant::now();
    for p in parts.iter_mut() {
        p.plan
            .decode(&mut p.ws, &p.cache, &p.tables, &p.q, &mut p.out, None)?;
    }
    let mut gathered = vec![f16::ZERO; want.len()];
    let row = KV_HEADS * GROUP * D;
    for (i, p) in parts.iter().enumerate() {
        let part = p.gpu.stream().clone_dtoh(&p.out)?;
        let w = per * GROUP * D;
        for b in 0..BATCH {
            gathered[b * row + i * w..b * row + (i + 1) * w]
                .copy_from_slice(&part[b * w..(b + 1) * w]);
        }
    }
    let elapsed = t.elapsed();
    let differ = gathered
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    println!(
        "{shards} shard(s) of {per} KV head(s) on {} device(s), B={BATCH}, L<={LEN}: gathered in \
         {:.2} ms (incl. copies back); {differ} of {} outputs differ from the one-GPU decode",
        devices.len().min(shards),
        elapsed.as_secs_f64() * 1e3,
        want.len()
    );
    if differ != 0 {
        return Err(kvq::Error::InvalidArgument(format!(
            "{differ} gathered outputs differ from the whole-layer decode"
        )));
    }
    Ok(())
}

fn main() {
    if !is_available() {
        eprintln!("tensor_parallel: no CUDA device");
        std::process::exit(1);
    }
    let mut shards = 0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--shards" => shards = args.next().and_then(|s| s.parse().ok()).unwrap_or(0),
            other => {
                eprintln!("unknown argument {other}; use --shards N");
                std::process::exit(2);
            }
        }
    }
    let shards = if shards == 0 {
        gpus().map(|g| g.len().max(2)).unwrap_or(2)
    } else {
        shards
    };
    if let Err(e) = run(shards) {
        eprintln!("tensor_parallel: {e}");
        std::process::exit(1);
    }
}
