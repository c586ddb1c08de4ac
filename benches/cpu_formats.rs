//! CPU throughput of the element formats (encode_row / decode_row per format) and of the
//! reference decode attention. Run with `cargo bench --bench cpu_formats`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvq::cache::{BlockAllocator, HostCache};
use kvq::cpu::{Accum, AttentionOptions, DecodeShape, decode_attention};
use kvq::{CacheConfig, KvFormat, ScaleGranularity};

const HEAD_DIM: usize = 128;
/// Rows per iteration of the row benches.
const ROWS: usize = 256;

/// Deterministic pseudo-random values in about [-4, 4).
fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) * 8.0 - 4.0
        })
        .collect()
}

fn rows(c: &mut Criterion) {
    let x = data(ROWS * HEAD_DIM, 1);
    let mut group = c.benchmark_group("encode_row");
    group.throughput(Throughput::Elements((ROWS * HEAD_DIM) as u64));
    // int4-kc has no row codec (its groups run along a block's tokens)
    for f in KvFormat::ALL.into_iter().filter(|f| !f.block_groups()) {
        let (cb, mb) = (f.code_bytes(HEAD_DIM), f.meta_bytes(HEAD_DIM));
        let mut codes = vec![0u8; ROWS * cb];
        let mut meta = vec![0u8; ROWS * mb];
        group.bench_function(f.name(), |b| {
            b.iter(|| {
                for r in 0..ROWS {
                    f.encode_row(
                        black_box(&x[r * HEAD_DIM..][..HEAD_DIM]),
                        0.01,
                        &mut codes[r * cb..][..cb],
                        &mut meta[r * mb..][..mb],
                    );
                }
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("decode_row");
    group.throughput(Throughput::Elements((ROWS * HEAD_DIM) as u64));
    // int4-kc has no row codec (its groups run along a block's tokens)
    for f in KvFormat::ALL.into_iter().filter(|f| !f.block_groups()) {
        let (cb, mb) = (f.code_bytes(HEAD_DIM), f.meta_bytes(HEAD_DIM));
        let mut codes = vec![0u8; ROWS * cb];
        let mut meta = vec![0u8; ROWS * mb];
        for r in 0..ROWS {
            f.encode_row(
                &x[r * HEAD_DIM..][..HEAD_DIM],
                0.01,
                &mut codes[r * cb..][..cb],
                &mut meta[r * mb..][..mb],
            );
        }
        let mut out = vec![0f32; HEAD_DIM];
        group.bench_function(f.name(), |b| {
            b.iter(|| {
                for r in 0..ROWS {
                    f.decode_row(
                        black_box(&codes[r * cb..][..cb]),
                        &meta[r * mb..][..mb],
                        0.01,
                        &mut out,
                    );
                }
                black_box(&out);
            })
        });
    }
    group.finish();
}

/// Reference decode attention, Llama-3-8B-like layer (32 q / 8 kv heads, d = 128, block 16),
/// batch 1, one new token, a 4096-token context.
fn decode(c: &mut Criterion) {
    let (nkv, nq, bs, len) = (8, 32, 16, 4096);
    let mut group = c.benchmark_group("cpu_decode_4k");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements(len as u64));
    let k = data(len * nkv * HEAD_DIM, 2);
    let v = data(len * nkv * HEAD_DIM, 3);
    let q = data(nq * HEAD_DIM, 4);
    for (kf, vf) in [
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E4m3),
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
    ] {
        let cfg = CacheConfig::new(nkv, HEAD_DIM, bs, kf, vf).unwrap();
        let blocks = len / bs;
        let mut alloc = BlockAllocator::new(blocks, bs).unwrap();
        let mut cache = HostCache::new(cfg, blocks).unwrap();
        cache
            .calibrate_fp8_scales(&k, &v, ScaleGranularity::PerHead)
            .unwrap();
        let seq = alloc.create_sequence();
        let r = alloc.reserve(seq, len).unwrap();
        cache.write(&r.slots, &k, &v).unwrap();
        let tables = alloc.block_tables(&[seq]).unwrap();
        let (shape, opts) = (DecodeShape::new(nq, 1), AttentionOptions::new(HEAD_DIM));
        for accum in [Accum::F32, Accum::F64] {
            let id = BenchmarkId::new(format!("{kf}/{vf}"), format!("{accum:?}"));
            group.bench_with_input(id, &accum, |b, &accum| {
                b.iter(|| {
                    decode_attention(&cache, &tables, black_box(&q), &shape, &opts, accum).unwrap()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, rows, decode);
criterion_main!(benches);
