//! A freed sequence's blocks, reused by a new sequence, never leak old data into the new
//! sequence's reads (gather and decode attention), in every format pair; the same holds across
//! copy-on-write forks. And decode attention over one shared cache gives the same bits from many
//! threads at once as from one.

use kvq::cache::{HostCache, PagedKvCache, SeqId};
use kvq::cpu::{self, Accum, AttentionOptions, AttentionOutput, DecodeShape, DenseKv};
use kvq::{CacheConfig, KvFormat};

const HEADS: usize = 2;
const D: usize = 64;
const BS: usize = 4;

/// Rows `[n, HEADS, D]` whose values all lie in `[base, base + 1)`: a sequence's tag.
fn tagged(n: usize, base: f32, salt: usize) -> Vec<f32> {
    (0..n * HEADS * D)
        .map(|i| base + ((i * 37 + salt * 11) % 97) as f32 / 97.0)
        .collect()
}

fn gathered(p: &PagedKvCache, layer: usize, s: SeqId) -> (Vec<f32>, Vec<f32>) {
    let len = p.len(s).unwrap();
    let t = p.block_tables(&[s]).unwrap();
    let (mut k, mut v) = (vec![0f32; len * HEADS * D], vec![0f32; len * HEADS * D]);
    p.layers()[layer]
        .gather(t.row(0), len, &mut k, &mut v)
        .unwrap();
    (k, v)
}

/// Decode of `s` over the paged cache, and over its own gathered tokens as a dense tensor: the
/// two read the same rows only if no other sequence's data is reachable from `s`'s table.
fn decode_both(p: &PagedKvCache, s: SeqId, q_len: usize) -> (AttentionOutput, AttentionOutput) {
    let (shape, opts) = (DecodeShape::new(2 * HEADS, q_len), AttentionOptions::new(D));
    let q: Vec<f32> = (0..2 * HEADS * q_len * D)
        .map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.5)
        .collect();
    let t = p.block_tables(&[s]).unwrap();
    let paged = cpu::decode_attention(&p.layers()[0], &t, &q, &shape, &opts, Accum::F64).unwrap();
    let (k, v) = gathered(p, 0, s);
    let kv = DenseKv {
        k: &k,
        v: &v,
        num_kv_heads: HEADS,
        head_dim: D,
    };
    let dense = cpu::attention_dense(&q, kv, &shape, &opts, Accum::F64).unwrap();
    (paged, dense)
}

/// Every value of `x` lies in the tag range `[base, base + 1)` up to the format's error.
fn all_tagged(x: &[f32], base: f32, slack: f32) -> bool {
    x.iter()
        .all(|&v| v >= base - slack && v < base + 1.0 + slack)
}

#[test]
fn reused_blocks_never_leak_old_data() {
    for k_format in KvFormat::ALL {
        for v_format in KvFormat::ALL.into_iter().filter(|f| !f.block_groups()) {
            // int4-kc's group is its block: 16 tokens at least
            let bs = if k_format.block_groups() { 16 } else { BS };
            let c = CacheConfig::new(HEADS, D, bs, k_format, v_format).unwrap();
            let mut p = PagedKvCache::new(c, 2, 6).unwrap();
            // A fills the pool with values near 1000.
            let old = p.create_sequence();
            let x = tagged(6 * bs, 1000.0, 0);
            p.append(old, &[&x, &x], &[&x, &x]).unwrap();
            assert_eq!(p.allocator().num_free_blocks(), 0);
            p.free(old).unwrap();
            // B reuses A's blocks with values near 0, filling the last block only partly: its
            // slots past B's length still hold A's rows.
            let new = p.create_sequence();
            let n = 2 * bs + 1;
            let (k, v) = (tagged(n, 0.0, 1), tagged(n, 0.0, 2));
            p.append(new, &[&k, &k], &[&v, &v]).unwrap();
            // INT4 groups span 32+ values of one row: their error stays well under 0.2 here.
            let slack = 0.2;
            for layer in 0..2 {
                let (gk, gv) = gathered(&p, layer, new);
                assert!(
                    all_tagged(&gk, 0.0, slack),
                    "{k_format}/{v_format} layer {layer}: K leaked"
                );
                assert!(
                    all_tagged(&gv, 0.0, slack),
                    "{k_format}/{v_format} layer {layer}: V leaked"
                );
            }
            for q_len in [1, 2, n] {
                let (paged, dense) = decode_both(&p, new, q_len);
                assert_eq!(paged, dense, "{k_format}/{v_format} q_len {q_len}");
                assert!(
                    all_tagged(&paged.out, 0.0, slack),
                    "{k_format}/{v_format}: output leaked"
                );
            }

            // A fork of B that appends copies B's partial block (A's stale rows included)
            // and must still read only its own tokens.
            let child = p.fork(new).unwrap();
            let more = tagged(1, 0.0, 3);
            p.append(child, &[&more, &more], &[&more, &more]).unwrap();
            let (ck, _) = gathered(&p, 1, child);
            assert!(
                all_tagged(&ck, 0.0, slack),
                "{k_format}/{v_format}: fork leaked"
            );
            let (paged, dense) = decode_both(&p, child, 2);
            assert_eq!(paged, dense);
            p.free(new).unwrap();
            // C reuses B's freed blocks while the child still holds the shared ones.
            let c2 = p.create_sequence();
            let y = tagged(bs + 2, -50.0, 4);
            p.append(c2, &[&y, &y], &[&y, &y]).unwrap();
            let (k2, _) = gathered(&p, 0, c2);
            assert!(
                all_tagged(&k2, -50.0, 10.0),
                "{k_format}/{v_format}: C leaked"
            );
            let (ck2, _) = gathered(&p, 1, child);
            assert_eq!(
                ck, ck2,
                "{k_format}/{v_format}: C's writes reached the child"
            );
        }
    }
}

/// Decode attention reads a shared cache from many threads at once with the same bits as one
/// thread, both for calls that stay on one thread and for calls large enough to use several.
#[test]
fn concurrent_decodes_of_a_shared_cache_agree() {
    fn shared<T: Send + Sync>(_: &T) {}
    let c = CacheConfig::new(HEADS, D, 16, KvFormat::Int4Sym32, KvFormat::Fp8E4m3).unwrap();
    // 4 sequences × 2 KV heads × 8,200+ positions: past the size where the reference splits
    // its work over threads.
    let mut p = PagedKvCache::new(c, 1, 2100).unwrap();
    shared(&p);
    shared(&p.layers()[0] as &HostCache);
    let seqs: Vec<SeqId> = (0..4).map(|_| p.create_sequence()).collect();
    for (i, &s) in seqs.iter().enumerate() {
        let x = tagged(8200 + 37 * i, i as f32, i);
        p.append(s, &[&x], &[&x]).unwrap();
    }
    let tables = p.block_tables(&seqs).unwrap();
    let (shape, opts) = (DecodeShape::new(2 * HEADS, 3), AttentionOptions::new(D));
    let q: Vec<f32> = (0..seqs.len() * 2 * HEADS * 3 * D)
        .map(|i| ((i * 7) % 23) as f32 / 23.0 - 0.5)
        .collect();
    let cache = &p.layers()[0];
    let serial = cpu::decode_attention(cache, &tables, &q, &shape, &opts, Accum::F32).unwrap();
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| cpu::decode_attention(cache, &tables, &q, &shape, &opts, Accum::F32))
            })
            .collect();
        for r in runs {
            assert_eq!(r.join().unwrap().unwrap(), serial);
        }
    });
}
