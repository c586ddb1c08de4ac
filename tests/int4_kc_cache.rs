//! `int4-kc` keys as a cache format: what a reader of the paged cache sees after appends of any
//! size, forks and truncation equals FORMATS.md's paged form (`int4_kc::quantize` in
//! `Mode::Paged` over the sequence's keys so far), and attention over the cache equals attention
//! over those values.

use kvq::cache::{PagedKvCache as PagedCache, SeqId};
use kvq::cpu::{Accum, AttentionOptions, DecodeShape, DenseKv, attention_dense, decode_attention};
use kvq::format::int4_kc::{self, KcShape, Mode};
use kvq::{CacheConfig, Error, KvFormat};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Keys with an outlier channel per head and a sometimes non-finite input.
    fn keys(&mut self, n: usize, d: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let u = (self.next() >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
                let scale = if i % d == 3 { 40.0 } else { 2.0 };
                match self.below(500) {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    _ => u * scale,
                }
            })
            .collect()
    }
}

/// The keys (and values) a reader of sequence `seq` gets back.
fn gathered(cache: &PagedCache, seq: SeqId) -> (Vec<f32>, Vec<f32>) {
    let c = cache.config();
    let len = cache.len(seq).unwrap();
    let n = len * c.num_kv_heads * c.head_dim;
    let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
    let tables = cache.block_tables(&[seq]).unwrap();
    cache.layers()[0]
        .gather(tables.row(0), len, &mut k, &mut v)
        .unwrap();
    (k, v)
}

/// FORMATS.md's paged form of `keys` (`[tokens, heads, d]`) with groups of `bs` tokens.
fn oracle(keys: &[f32], heads: usize, d: usize, bs: usize) -> Vec<f32> {
    let shape = KcShape::new(keys.len() / (heads * d), heads, d, bs).unwrap();
    int4_kc::quantize(keys, shape, Mode::Paged)
        .unwrap()
        .dequantize()
        .unwrap()
}

#[test]
fn appends_of_any_size_read_back_as_the_paged_form() {
    for (bs, d, heads, seed) in [
        (16, 64, 2, 1),
        (32, 128, 1, 2),
        (64, 32, 3, 3),
        (16, 256, 1, 4),
    ] {
        let cfg = CacheConfig::new(heads, d, bs, KvFormat::Int4Kc, KvFormat::Fp8E4m3).unwrap();
        let mut cache = PagedCache::new(cfg, 1, 64).unwrap();
        let mut rng = Rng(0x9e37_79b9 ^ seed);
        let seqs = [cache.create_sequence(), cache.create_sequence()];
        let mut keys = [Vec::new(), Vec::new()];
        let row = heads * d;
        for step in 0..12 {
            for (i, &s) in seqs.iter().enumerate() {
                let n = [1, 3, bs - 1, bs + 5, 2 * bs, 1][(step + i) % 6];
                let k = rng.keys(n * row, d);
                let v = rng.keys(n * row, d);
                cache.append(s, &[&k], &[&v]).unwrap();
                keys[i].extend_from_slice(&k);
                let (got, _) = gathered(&cache, s);
                let want = oracle(&keys[i], heads, d, bs);
                assert_eq!(got, want, "bs {bs} d {d} step {step} seq {i}");
            }
        }
    }
}

#[test]
fn a_fork_keeps_its_parents_window_and_seals_its_own() {
    let (bs, d) = (16, 64);
    let cfg = CacheConfig::new(1, d, bs, KvFormat::Int4Kc, KvFormat::Int4Affine64).unwrap();
    let mut cache = PagedCache::new(cfg, 1, 16).unwrap();
    let mut rng = Rng(77);
    let parent = cache.create_sequence();
    let prefix = rng.keys(21 * d, d);
    let pv = rng.keys(21 * d, d);
    cache.append(parent, &[&prefix], &[&pv]).unwrap();
    let child = cache.fork(parent).unwrap();
    let mut all = [prefix.clone(), prefix];
    for (i, s) in [parent, child].into_iter().enumerate() {
        // Both fill the shared, unsealed block differently (copy-on-write) and seal it.
        let k = rng.keys(13 * d, d);
        let v = rng.keys(13 * d, d);
        cache.append(s, &[&k], &[&v]).unwrap();
        all[i].extend_from_slice(&k);
    }
    for (i, s) in [parent, child].into_iter().enumerate() {
        assert_eq!(
            gathered(&cache, s).0,
            oracle(&all[i], 1, d, bs),
            "sequence {i}"
        );
    }
    assert_ne!(all[0], all[1]);
}

#[test]
fn truncation_stays_inside_the_unsealed_block() {
    let (bs, d) = (32, 64);
    let cfg = CacheConfig::new(1, d, bs, KvFormat::Int4Kc, KvFormat::F16).unwrap();
    let mut cache = PagedCache::new(cfg, 1, 8).unwrap();
    let mut rng = Rng(5);
    let s = cache.create_sequence();
    let mut keys = rng.keys(40 * d, d);
    let v = rng.keys(40 * d, d);
    cache.append(s, &[&keys], &[&v]).unwrap();
    // Rejected drafts inside the window: fine; into the sealed block: refused, nothing changes.
    cache.truncate(s, 35).unwrap();
    keys.truncate(35 * d);
    assert!(matches!(cache.truncate(s, 31), Err(Error::Unsupported(_))));
    assert_eq!(cache.len(s).unwrap(), 35);
    cache.truncate(s, 32).unwrap();
    keys.truncate(32 * d);
    let more = rng.keys(3 * d, d);
    let mv = rng.keys(3 * d, d);
    cache.append(s, &[&more], &[&mv]).unwrap();
    keys.extend_from_slice(&more);
    assert_eq!(gathered(&cache, s).0, oracle(&keys, 1, d, bs));
}

#[test]
fn attention_over_the_cache_is_attention_over_what_it_reads() {
    let (bs, d, heads, group) = (16, 128, 2, 4);
    let cfg = CacheConfig::new(heads, d, bs, KvFormat::Int4Kc, KvFormat::Int4Affine64).unwrap();
    let mut cache = PagedCache::new(cfg, 1, 32).unwrap();
    let mut rng = Rng(11);
    let lens = [5, 16, 47];
    let seqs: Vec<_> = lens.iter().map(|_| cache.create_sequence()).collect();
    for (&s, &n) in seqs.iter().zip(&lens) {
        let (k, v) = (rng.keys(n * heads * d, d), rng.keys(n * heads * d, d));
        cache.append(s, &[&k], &[&v]).unwrap();
    }
    let (shape, opts) = (DecodeShape::new(heads * group, 2), AttentionOptions::new(d));
    let per_q = shape.num_q_heads * 2 * d;
    let q: Vec<f32> = (0..lens.len() * per_q)
        .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 50.0)
        .collect();
    let tables = cache.block_tables(&seqs).unwrap();
    let paged =
        decode_attention(&cache.layers()[0], &tables, &q, &shape, &opts, Accum::F64).unwrap();
    for (b, &s) in seqs.iter().enumerate() {
        let (k, v) = gathered(&cache, s);
        let kv = DenseKv {
            k: &k,
            v: &v,
            num_kv_heads: heads,
            head_dim: d,
        };
        let dense =
            attention_dense(&q[b * per_q..][..per_q], kv, &shape, &opts, Accum::F64).unwrap();
        assert_eq!(dense.out, paged.out[b * per_q..][..per_q], "sequence {b}");
    }
}

#[test]
fn slot_reads_of_kc_keys_are_refused() {
    let cfg = CacheConfig::new(1, 64, 16, KvFormat::Int4Kc, KvFormat::F16).unwrap();
    let cache = PagedCache::new(cfg, 1, 2).unwrap();
    let mut row = [0f32; 64];
    assert!(matches!(
        cache.layers()[0].read_k(0, 0, &mut row),
        Err(Error::Unsupported(_))
    ));
    // values are rows as usual (poison, but a row)
    cache.layers()[0].read_v(0, 0, &mut row).unwrap();
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// One step of an engine's use of a kc cache.
    #[derive(Debug, Clone)]
    enum Op {
        /// Append `n` tokens to sequence `seq % live`.
        Append { seq: usize, n: usize },
        /// Fork sequence `seq % live`.
        Fork { seq: usize },
        /// Drop up to `n` tokens of sequence `seq % live` (refused into a sealed block).
        Truncate { seq: usize, n: usize },
        /// Free sequence `seq % live` (when more than one is live).
        Free { seq: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (any::<usize>(), 1usize..40).prop_map(|(seq, n)| Op::Append { seq, n }),
            1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
            1 => (any::<usize>(), 1usize..9).prop_map(|(seq, n)| Op::Truncate { seq, n }),
            1 => any::<usize>().prop_map(|seq| Op::Free { seq }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Whatever an engine does (appends of any size, forks, rollbacks, frees, blocks
        /// reused), each live sequence reads back FORMATS.md's paged form of its own keys.
        #[test]
        fn every_sequence_reads_its_paged_form(
            bs in prop::sample::select(vec![16usize, 32]),
            ops in prop::collection::vec(op(), 1..30),
            seed in any::<u64>(),
        ) {
            let d = 32;
            let cfg = CacheConfig::new(1, d, bs, KvFormat::Int4Kc, KvFormat::Int8Pth).unwrap();
            let mut cache = PagedCache::new(cfg, 1, 64).unwrap();
            let mut rng = Rng(seed | 1);
            // (sequence, its keys so far)
            let mut live = vec![(cache.create_sequence(), Vec::<f32>::new())];
            for op in ops {
                match op {
                    Op::Append { seq, n } => {
                        let i = seq % live.len();
                        let (k, v) = (rng.keys(n * d, d), rng.keys(n * d, d));
                        match cache.append(live[i].0, &[&k], &[&v]) {
                            Ok(_) => live[i].1.extend_from_slice(&k),
                            Err(e) => prop_assert!(matches!(e, Error::OutOfBlocks { .. }), "{e}"),
                        }
                    }
                    Op::Fork { seq } => {
                        let i = seq % live.len();
                        let child = cache.fork(live[i].0).unwrap();
                        let keys = live[i].1.clone();
                        live.push((child, keys));
                    }
                    Op::Truncate { seq, n } => {
                        let i = seq % live.len();
                        let len = live[i].1.len() / d;
                        let new_len = len.saturating_sub(n);
                        match cache.truncate(live[i].0, new_len) {
                            Ok(()) => live[i].1.truncate(new_len * d),
                            Err(e) => {
                                prop_assert!(matches!(e, Error::Unsupported(_)), "{e}");
                                prop_assert!(new_len < len / bs * bs);
                            }
                        }
                    }
                    Op::Free { seq } => {
                        if live.len() > 1 {
                            let (s, _) = live.remove(seq % live.len());
                            cache.free(s).unwrap();
                        }
                    }
                }
                for (s, keys) in &live {
                    let (got, _) = gathered(&cache, *s);
                    prop_assert_eq!(got, oracle(keys, 1, d, bs));
                }
            }
        }
    }
}
