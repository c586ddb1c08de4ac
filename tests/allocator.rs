//! Block allocator, block tables and the host cache's copy-on-write plumbing.

use std::collections::HashMap;

use kvq::cache::{
    BlockAllocator, BlockTables, CopyBlock, HostCache, POISON, PagedKvCache, Reservation, SeqId,
};
use kvq::{CacheConfig, Error, KvFormat};
use proptest::prelude::*;

#[test]
fn new_validates() {
    assert!(matches!(
        BlockAllocator::new(0, 16),
        Err(Error::Config {
            what: "num_blocks",
            ..
        })
    ));
    assert!(matches!(
        BlockAllocator::new(4, 0),
        Err(Error::Config {
            what: "block_size",
            ..
        })
    ));
    assert!(BlockAllocator::new(4, 2048).is_err());
    assert!(BlockAllocator::new(i32::MAX as usize + 1, 1).is_err());
}

#[test]
fn append_across_blocks_gives_consecutive_slots() {
    let mut a = BlockAllocator::new(8, 4).unwrap();
    let s = a.create_sequence();
    assert!(a.is_empty(s).unwrap());
    assert_eq!(a.reserve(s, 0).unwrap(), Reservation::default());
    assert_eq!(a.block_table(s).unwrap(), &[] as &[i32]);
    let r = a.reserve(s, 3).unwrap();
    assert_eq!(r.slots, vec![0, 1, 2]);
    let r = a.reserve(s, 6).unwrap();
    assert_eq!(r.slots, vec![3, 4, 5, 6, 7, 8]);
    assert!(r.copies.is_empty());
    assert_eq!(a.block_table(s).unwrap(), &[0, 1, 2]);
    assert_eq!(a.len(s).unwrap(), 9);
    assert_eq!(a.num_free_blocks(), 5);
    // Two sequences growing in turn get interleaved, non-contiguous blocks.
    let t = a.create_sequence();
    a.reserve(t, 4).unwrap();
    a.reserve(s, 4).unwrap();
    a.reserve(t, 1).unwrap();
    assert_eq!(a.block_table(s).unwrap(), &[0, 1, 2, 4]);
    assert_eq!(a.block_table(t).unwrap(), &[3, 5]);
    assert_ne!(s, t);
    assert_eq!(format!("{s}"), s.0.to_string());
}

#[test]
fn freed_blocks_are_reused() {
    let mut a = BlockAllocator::new(4, 2).unwrap();
    let s = a.create_sequence();
    a.reserve(s, 6).unwrap();
    assert_eq!(a.num_free_blocks(), 1);
    a.free(s).unwrap();
    assert_eq!(a.num_free_blocks(), 4);
    assert_eq!(a.num_sequences(), 0);
    for b in 0..4 {
        assert_eq!(a.ref_count(b).unwrap(), 0);
    }
    let t = a.create_sequence();
    a.reserve(t, 8).unwrap();
    let mut blocks = a.block_table(t).unwrap().to_vec();
    blocks.sort();
    assert_eq!(blocks, vec![0, 1, 2, 3]);
    // Freed ids are gone for good.
    assert_eq!(a.len(s), Err(Error::UnknownSequence(s.0)));
    assert_eq!(a.reserve(s, 1), Err(Error::UnknownSequence(s.0)));
    assert_eq!(a.fork(s), Err(Error::UnknownSequence(s.0)));
    assert!(a.block_tables(&[t, s]).is_err());
    assert!(a.ref_count(4).is_err());
}

#[test]
fn fork_shares_blocks_and_copies_on_write() {
    let mut a = BlockAllocator::new(8, 4).unwrap();
    let p = a.create_sequence();
    a.reserve(p, 6).unwrap(); // blocks [0, 1], block 1 half full
    let c = a.fork(p).unwrap();
    assert_eq!(a.block_table(c).unwrap(), a.block_table(p).unwrap());
    assert_eq!(a.len(c).unwrap(), 6);
    assert_eq!((a.ref_count(0).unwrap(), a.ref_count(1).unwrap()), (2, 2));
    assert_eq!(a.num_free_blocks(), 6);

    // The parent appends 3: the shared partial block 1 is copied to a fresh block first.
    let r = a.reserve(p, 3).unwrap();
    assert_eq!(r.copies, vec![CopyBlock { src: 1, dst: 2 }]);
    assert_eq!(r.slots, vec![2 * 4 + 2, 2 * 4 + 3, 3 * 4]);
    assert_eq!(a.block_table(p).unwrap(), &[0, 2, 3]);
    assert_eq!(a.block_table(c).unwrap(), &[0, 1]);
    assert_eq!(a.ref_count(1).unwrap(), 1);
    assert_eq!(a.ref_count(0).unwrap(), 2);

    // The child now owns block 1 alone and appends in place; full block 0 stays shared.
    let r = a.reserve(c, 2).unwrap();
    assert!(r.copies.is_empty());
    assert_eq!(r.slots, vec![6, 7]);

    // Forking at a block boundary needs no copy.
    let g = a.fork(c).unwrap();
    let r = a.reserve(g, 1).unwrap();
    assert!(r.copies.is_empty());
    assert_eq!(a.block_table(g).unwrap(), &[0, 1, 4]);
    assert_eq!(a.ref_count(1).unwrap(), 2);

    for s in [p, c, g] {
        a.free(s).unwrap();
    }
    assert_eq!(a.num_free_blocks(), 8);
}

#[test]
fn out_of_blocks_is_all_or_nothing() {
    let mut a = BlockAllocator::new(3, 4).unwrap();
    let s = a.create_sequence();
    a.reserve(s, 5).unwrap(); // 2 blocks
    let before = (a.block_table(s).unwrap().to_vec(), a.num_free_blocks());
    assert_eq!(
        a.reserve(s, 8),
        Err(Error::OutOfBlocks {
            needed: 2,
            free: 1,
            total: 3
        })
    );
    assert_eq!(
        (a.block_table(s).unwrap().to_vec(), a.num_free_blocks()),
        before
    );
    assert_eq!(a.len(s).unwrap(), 5);

    // Copy-on-write needs a block too: a fork appending into the shared partial block, plus a
    // new block, does not fit in the one free block.
    let c = a.fork(s).unwrap();
    assert_eq!(
        a.reserve(c, 4),
        Err(Error::OutOfBlocks {
            needed: 2,
            free: 1,
            total: 3
        })
    );
    assert_eq!(a.ref_count(1).unwrap(), 2);
    assert_eq!(a.len(c).unwrap(), 5);
    // Exactly the copy fits.
    let r = a.reserve(c, 3).unwrap();
    assert_eq!(r.copies, vec![CopyBlock { src: 1, dst: 2 }]);
    assert_eq!(a.num_free_blocks(), 0);
}

#[test]
fn reserve_rejects_lengths_beyond_i32() {
    let mut a = BlockAllocator::new(1, 1).unwrap();
    let s = a.create_sequence();
    assert!(matches!(
        a.reserve(s, i32::MAX as usize + 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        a.reserve(s, usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn block_tables_are_padded_rows() {
    let mut a = BlockAllocator::new(16, 4).unwrap();
    let (s, t, e) = (
        a.create_sequence(),
        a.create_sequence(),
        a.create_sequence(),
    );
    a.reserve(s, 9).unwrap();
    a.reserve(t, 1).unwrap();
    let bt = a.block_tables(&[s, t, e]).unwrap();
    assert_eq!(bt.max_blocks, 3);
    assert_eq!(bt.batch(), 3);
    assert_eq!(bt.context_lens, vec![9, 1, 0]);
    assert_eq!(bt.data, vec![0, 1, 2, 3, -1, -1, -1, -1, -1]);
    assert_eq!(bt.row(1), &[3, -1, -1]);
    assert_eq!(bt.max_context_len(), 9);
    bt.validate(16, 4).unwrap();
    // A pool too small for the ids, or a block size that needs more entries, is caught.
    assert_eq!(
        bt.validate(3, 4),
        Err(Error::BlockIndex {
            block: 3,
            num_blocks: 3
        })
    );
    assert!(matches!(bt.validate(16, 2), Err(Error::InvalidArgument(_))));

    // Empty sequences still give a one-column table.
    let bt = a.block_tables(&[e]).unwrap();
    assert_eq!((bt.max_blocks, bt.data.clone()), (1, vec![-1]));
    let empty = a.block_tables(&[]).unwrap();
    assert_eq!(
        (empty.batch(), empty.max_blocks, empty.data.len()),
        (0, 1, 0)
    );

    // Hand-built tables.
    let bt = BlockTables::from_rows(&[&[5, 6], &[7]], &[5, 2]).unwrap();
    assert_eq!(bt.data, vec![5, 6, 7, -1]);
    bt.validate(8, 4).unwrap();
    assert!(BlockTables::from_rows(&[&[5]], &[]).is_err());
    let mut bad = bt.clone();
    bad.data[1] = -1; // used entry
    assert!(matches!(bad.validate(8, 4), Err(Error::InvalidArgument(_))));
    let mut bad = bt.clone();
    bad.context_lens[0] = -3;
    assert!(matches!(bad.validate(8, 4), Err(Error::InvalidArgument(_))));
    let mut bad = bt;
    bad.data.pop();
    assert!(matches!(bad.validate(8, 4), Err(Error::Length { .. })));
}

fn config(k: KvFormat, v: KvFormat) -> CacheConfig {
    CacheConfig::new(2, 64, 4, k, v).unwrap()
}

/// `n` tokens of K and V, `[n, 2, 64]`, distinct per `tag`.
fn tokens(n: usize, tag: f32) -> (Vec<f32>, Vec<f32>) {
    let k = (0..n * 128)
        .map(|i| tag + (i % 97) as f32 * 0.125)
        .collect();
    let v = (0..n * 128)
        .map(|i| -tag - (i % 89) as f32 * 0.25)
        .collect();
    (k, v)
}

#[test]
fn host_cache_validates_and_poisons() {
    let c = config(KvFormat::Int4Sym32, KvFormat::Fp8E4m3);
    assert!(HostCache::new(c, 0).is_err());
    let mut h = HostCache::new(c, 2).unwrap();
    assert_eq!(h.pool().len(), c.layout().pool_bytes(2));
    assert!(h.pool().iter().all(|&b| b == POISON));
    assert_eq!(h.num_slots(), 8);
    assert_eq!(h.k_scales(), &[1.0, 1.0]);

    let (k, v) = tokens(2, 1.0);
    assert!(matches!(h.write(&[0], &k, &v), Err(Error::Length { .. })));
    assert!(matches!(
        h.write(&[0, 8], &k, &v),
        Err(Error::BlockIndex {
            block: 2,
            num_blocks: 2
        })
    ));
    assert!(h.pool().iter().all(|&b| b == POISON), "failed writes wrote");
    let mut row = vec![0f32; 64];
    assert!(h.read_k(8, 0, &mut row).is_err());
    assert!(h.read_k(0, 0, &mut row[..32]).is_err());
    assert!(h.copy_block(0, 2).is_err());

    assert!(matches!(
        h.set_scales(&[1.0], &[1.0, 1.0]),
        Err(Error::Length { .. })
    ));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            h.set_scales(&[1.0, 1.0], &[1.0, bad]),
            Err(Error::Scale { .. })
        ));
    }
    h.set_scales(&[0.5, 2.0], &[3.0, 4.0]).unwrap();
    assert_eq!(h.v_scales(), &[3.0, 4.0]);
}

#[test]
fn a_side_without_a_head_scale_may_take_no_scales() {
    // FP8 keys over INT4 values: the values' side takes `&[]` and keeps its scales; the keys'
    // side still needs one per KV head.
    let c = CacheConfig::new(2, 64, 16, KvFormat::Fp8E4m3, KvFormat::Int4Affine64).unwrap();
    let mut h = HostCache::new(c, 1).unwrap();
    h.set_scales(&[0.5, 2.0], &[]).unwrap();
    assert_eq!(
        (h.k_scales(), h.v_scales()),
        (&[0.5, 2.0][..], &[1.0, 1.0][..])
    );
    assert!(matches!(
        h.set_scales(&[], &[]),
        Err(Error::Length {
            what: "k_scales",
            expected: 2,
            actual: 0
        })
    ));
    assert!(matches!(
        h.set_scales(&[1.0], &[]),
        Err(Error::Length { .. })
    ));
    assert_eq!(h.k_scales(), &[0.5, 2.0], "a refused call changes nothing");
}

#[test]
fn calibrate_fp8_scales_per_tensor_and_per_head() {
    let c = CacheConfig::new(2, 16, 4, KvFormat::Fp8E4m3, KvFormat::Fp8E5m2).unwrap();
    let mut h = HostCache::new(c, 1).unwrap();
    // [3 tokens, 2 heads, 16]: head 0 amax 8, head 1 amax 224 (Inf counts as 65504).
    let mut k = vec![0f32; 3 * 2 * 16];
    k[5] = -8.0;
    k[16 + 3] = 224.0;
    let mut v = k.clone();
    v[2 * 32 + 16] = f32::INFINITY;
    h.calibrate_fp8_scales(&k, &v, kvq::ScaleGranularity::PerHead)
        .unwrap();
    assert_eq!(h.k_scales(), &[8.0 / 448.0, 224.0 / 448.0]);
    assert_eq!(h.v_scales(), &[8.0 / 57344.0, 65504.0 / 57344.0]);
    h.calibrate_fp8_scales(&k, &v, kvq::ScaleGranularity::PerTensor)
        .unwrap();
    assert_eq!(h.k_scales(), &[0.5, 0.5]);
    // All-zero samples give scale 1; a non-FP8 side keeps 1.
    let c2 = CacheConfig::new(2, 32, 4, KvFormat::Int4Sym32, KvFormat::Fp8E4m3).unwrap();
    let mut h2 = HostCache::new(c2, 1).unwrap();
    h2.calibrate_fp8_scales(&[7.0f32; 64], &[0.0f32; 64], kvq::ScaleGranularity::PerHead)
        .unwrap();
    assert_eq!(
        (h2.k_scales(), h2.v_scales()),
        (&[1.0, 1.0][..], &[1.0, 1.0][..])
    );
    assert!(
        h2.calibrate_fp8_scales(&[0f32; 65], &[0f32; 64], kvq::ScaleGranularity::PerHead)
            .is_err()
    );
}

#[test]
fn copy_block_and_gather() {
    let c = config(KvFormat::Fp8E4m3, KvFormat::Int4Affine64);
    let mut h = HostCache::new(c, 4).unwrap();
    let (k, v) = tokens(4, 3.0);
    assert_eq!(h.write(&[4, 5, 6, 7], &k, &v).unwrap(), 0);
    h.copy_block(1, 3).unwrap();
    h.copy_block(2, 2).unwrap();
    let n = c.layout().block_stride;
    assert_eq!(h.pool()[n..2 * n], h.pool()[3 * n..4 * n]);
    h.apply_copies(&[CopyBlock { src: 3, dst: 0 }]).unwrap();
    assert!(h.apply_copies(&[CopyBlock { src: 3, dst: 9 }]).is_err());
    let (mut gk, mut gv) = (vec![0f32; 3 * 128], vec![0f32; 3 * 128]);
    h.gather(&[0, -1], 3, &mut gk, &mut gv).unwrap();
    let mut row = vec![0f32; 64];
    for t in 0..3 {
        for head in 0..2 {
            h.read_k(4 + t, head, &mut row).unwrap();
            assert_eq!(gk[(t * 2 + head) * 64..][..64], row[..]);
            h.read_v(4 + t, head, &mut row).unwrap();
            assert_eq!(gv[(t * 2 + head) * 64..][..64], row[..]);
        }
    }
    assert!(
        h.gather(&[0], 5, &mut vec![0.0; 640], &mut vec![0.0; 640])
            .is_err()
    );
    assert!(h.gather(&[-1], 1, &mut gk[..128], &mut gv[..128]).is_err());
    assert!(h.gather(&[4], 1, &mut gk[..128], &mut gv[..128]).is_err());
    assert!(h.gather(&[0], 1, &mut gk[..127], &mut gv[..128]).is_err());
}

/// Dequantized tokens of `seq`, `[len, heads, d]` K then V.
fn gathered(c: &PagedKvCache, layer: usize, seq: SeqId) -> (Vec<f32>, Vec<f32>) {
    let len = c.len(seq).unwrap();
    let table = c.allocator().block_table(seq).unwrap().to_vec();
    let (mut k, mut v) = (vec![0f32; len * 128], vec![0f32; len * 128]);
    c.layers()[layer]
        .gather(&table, len, &mut k, &mut v)
        .unwrap();
    (k, v)
}

#[test]
fn paged_cache_copy_on_write_keeps_both_histories() {
    let cfg = config(KvFormat::F16, KvFormat::F16); // exact for these inputs
    let mut c = PagedKvCache::new(cfg, 2, 6).unwrap();
    let p = c.create_sequence();
    let (k0, v0) = tokens(6, 1.0);
    let (k1, v1) = tokens(6, 100.0);
    assert_eq!(c.append(p, &[&k0, &k1], &[&v0, &v1]).unwrap(), 0);
    let child = c.fork(p).unwrap();
    let (ka, va) = tokens(3, 7.0);
    let (kb, vb) = tokens(3, 9.0);
    c.append(p, &[&ka, &ka], &[&va, &va]).unwrap();
    c.append(child, &[&kb, &kb], &[&vb, &vb]).unwrap();
    for (layer, (k_prefix, v_prefix)) in [(&k0, &v0), (&k1, &v1)].into_iter().enumerate() {
        for (seq, (kn, vn)) in [(p, (&ka, &va)), (child, (&kb, &vb))] {
            let (k, v) = gathered(&c, layer, seq);
            let want_k: Vec<f32> = k_prefix.iter().chain(kn.iter()).copied().collect();
            let want_v: Vec<f32> = v_prefix.iter().chain(vn.iter()).copied().collect();
            assert_eq!(k, want_k, "layer {layer} seq {seq} keys");
            assert_eq!(v, want_v, "layer {layer} seq {seq} values");
        }
    }
    // Bad shapes change nothing.
    assert!(c.append(p, &[&ka], &[&va]).is_err());
    assert!(c.append(p, &[&ka, &ka[..128]], &[&va, &va]).is_err());
    assert_eq!(c.len(p).unwrap(), 9);
    c.free(p).unwrap();
    c.free(child).unwrap();
    assert_eq!(c.allocator().num_free_blocks(), 6);
    assert!(PagedKvCache::new(cfg, 0, 6).is_err());
}

/// One random allocator operation; sequence operands index the live sequences.
#[derive(Debug, Clone)]
enum Op {
    Create,
    Reserve(usize, usize),
    Fork(usize),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Create),
        5 => (any::<usize>(), 0usize..11).prop_map(|(s, n)| Op::Reserve(s, n)),
        2 => any::<usize>().prop_map(Op::Fork),
        2 => any::<usize>().prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random operations against a model in which every sequence is a list of token tags and the
    /// pool is simulated slot by slot (copies included). Checks that every sequence reads back
    /// exactly its tokens, ref counts equal the number of holders, and no block leaks.
    #[test]
    fn random_ops_match_model(
        num_blocks in 1usize..12,
        block_size in 1usize..6,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut a = BlockAllocator::new(num_blocks, block_size).unwrap();
        let mut pool: Vec<Option<u64>> = vec![None; num_blocks * block_size];
        let mut model: HashMap<SeqId, Vec<u64>> = HashMap::new();
        let mut live: Vec<SeqId> = Vec::new();
        let mut next_tag = 0u64;
        for op in ops {
            match op {
                Op::Create => {
                    let s = a.create_sequence();
                    prop_assert!(!model.contains_key(&s));
                    model.insert(s, Vec::new());
                    live.push(s);
                }
                Op::Reserve(i, n) if !live.is_empty() => {
                    let s = live[i % live.len()];
                    let len = model[&s].len();
                    let table = a.block_table(s).unwrap().to_vec();
                    // Copy-on-write only when something is written into a shared partial block.
                    let shared_partial = n > 0
                        && len % block_size != 0
                        && a.ref_count(*table.last().unwrap() as usize).unwrap() > 1;
                    let needed = (len + n).div_ceil(block_size) - len.div_ceil(block_size)
                        + shared_partial as usize;
                    let free = a.num_free_blocks();
                    match a.reserve(s, n) {
                        Ok(r) => {
                            prop_assert!(needed <= free);
                            prop_assert_eq!(a.num_free_blocks(), free - needed);
                            prop_assert_eq!(r.copies.len(), shared_partial as usize);
                            for cb in &r.copies {
                                for o in 0..block_size {
                                    pool[cb.dst * block_size + o] = pool[cb.src * block_size + o];
                                }
                            }
                            prop_assert_eq!(r.slots.len(), n);
                            for slot in r.slots {
                                pool[slot] = Some(next_tag);
                                model.get_mut(&s).unwrap().push(next_tag);
                                next_tag += 1;
                            }
                        }
                        Err(Error::OutOfBlocks { needed: e_needed, free: e_free, total }) => {
                            prop_assert!(needed > free);
                            prop_assert_eq!((e_needed, e_free, total), (needed, free, num_blocks));
                            prop_assert_eq!(a.block_table(s).unwrap(), &table[..]);
                            prop_assert_eq!(a.len(s).unwrap(), len);
                            prop_assert_eq!(a.num_free_blocks(), free);
                        }
                        Err(e) => prop_assert!(false, "unexpected error {e}"),
                    }
                }
                Op::Fork(i) if !live.is_empty() => {
                    let s = live[i % live.len()];
                    let c = a.fork(s).unwrap();
                    let tokens = model[&s].clone();
                    model.insert(c, tokens);
                    live.push(c);
                }
                Op::Free(i) if !live.is_empty() => {
                    let s = live.swap_remove(i % live.len());
                    a.free(s).unwrap();
                    model.remove(&s);
                    prop_assert_eq!(a.free(s), Err(Error::UnknownSequence(s.0)));
                }
                _ => {}
            }

            // Invariants after every step.
            let mut holders = vec![0usize; num_blocks];
            for (&s, tokens) in &model {
                let table = a.block_table(s).unwrap();
                prop_assert_eq!(a.len(s).unwrap(), tokens.len());
                prop_assert_eq!(table.len(), tokens.len().div_ceil(block_size));
                for (p, tag) in tokens.iter().enumerate() {
                    let slot = table[p / block_size] as usize * block_size + p % block_size;
                    prop_assert_eq!(pool[slot], Some(*tag), "seq {} pos {}", s, p);
                }
                for &b in table {
                    holders[b as usize] += 1;
                }
            }
            for (b, &h) in holders.iter().enumerate() {
                prop_assert_eq!(a.ref_count(b).unwrap(), h, "block {}", b);
            }
            let free = holders.iter().filter(|&&h| h == 0).count();
            prop_assert_eq!(a.num_free_blocks(), free);
            prop_assert_eq!(a.num_sequences(), model.len());
        }
        for s in live {
            a.free(s).unwrap();
        }
        prop_assert_eq!(a.num_free_blocks(), num_blocks);
    }
}
