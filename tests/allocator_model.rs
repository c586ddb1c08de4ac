//! The block allocator against an executable model of its contract, through random sequences
//! of create / reserve / fork / free / truncate / reuse and every query, including ids and block indices
//! that do not exist. The model predicts every result exactly: which blocks a reservation
//! takes (most recently freed first, then the lowest never handed out), its slots and
//! copy-on-write copies, the errors (with their values), ref counts and block tables.
//!
//! Cases per property: `KVQ_FUZZ_CASES` × a weight (see tests/fuzz_api.rs).

use std::collections::BTreeMap;

use kvq::Error;
use kvq::cache::{BlockAllocator, BlockTables, CopyBlock, Reservation, SeqId};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestCaseError, TestRunner};

fn cases() -> u32 {
    std::env::var("KVQ_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256)
}

fn runner(weight: u32) -> TestRunner {
    TestRunner::new(ProptestConfig {
        cases: (cases() * weight).max(1),
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    })
}

/// What the allocator must do, written as plainly as possible.
#[derive(Debug, Clone)]
struct Model {
    num_blocks: usize,
    block_size: usize,
    /// Holders of each block handed out so far.
    refs: BTreeMap<usize, usize>,
    /// Blocks released, reused last-in first-out.
    released: Vec<usize>,
    /// Lowest block never handed out.
    fresh: usize,
    /// Live sequences: (blocks, tokens).
    seqs: BTreeMap<u64, (Vec<usize>, usize)>,
    next_id: u64,
}

impl Model {
    fn new(num_blocks: usize, block_size: usize) -> Self {
        Model {
            num_blocks,
            block_size,
            refs: BTreeMap::new(),
            released: Vec::new(),
            fresh: 0,
            seqs: BTreeMap::new(),
            next_id: 0,
        }
    }

    fn free_blocks(&self) -> usize {
        self.released.len() + (self.num_blocks - self.fresh)
    }

    fn take(&mut self) -> usize {
        let b = self.released.pop().unwrap_or_else(|| {
            self.fresh += 1;
            self.fresh - 1
        });
        self.refs.insert(b, 1);
        b
    }

    fn release(&mut self, b: usize) {
        let r = self.refs.get_mut(&b).unwrap();
        *r -= 1;
        if *r == 0 {
            self.refs.remove(&b);
            self.released.push(b);
        }
    }

    fn reserve(&mut self, id: u64, n: usize) -> Result<Reservation, Error> {
        let bs = self.block_size;
        let Some((blocks, len)) = self.seqs.get(&id).cloned() else {
            return Err(Error::UnknownSequence(id));
        };
        let new_len = len + n;
        if new_len > i32::MAX as usize {
            return Err(Error::InvalidArgument(String::new())); // compared by variant only
        }
        if n == 0 {
            return Ok(Reservation::default());
        }
        let cow = len % bs != 0 && self.refs[blocks.last().unwrap()] > 1;
        let needed = new_len.div_ceil(bs) - len.div_ceil(bs) + cow as usize;
        if needed > self.free_blocks() {
            return Err(Error::OutOfBlocks {
                needed,
                free: self.free_blocks(),
                total: self.num_blocks,
            });
        }
        let mut taken: Vec<usize> = (0..needed).map(|_| self.take()).collect();
        let mut blocks = blocks;
        let mut copies = Vec::new();
        if cow {
            let dst = taken.remove(0);
            let src = *blocks.last().unwrap();
            *self.refs.get_mut(&src).unwrap() -= 1;
            copies.push(CopyBlock { src, dst });
            *blocks.last_mut().unwrap() = dst;
        }
        blocks.extend(taken);
        let slots = (len..new_len)
            .map(|p| blocks[p / bs] * bs + p % bs)
            .collect();
        self.seqs.insert(id, (blocks, new_len));
        Ok(Reservation { slots, copies })
    }

    /// Keep the first `new_len` tokens; the blocks past them are released last to first.
    fn truncate(&mut self, id: u64, new_len: usize) -> Result<(), Error> {
        let Some((mut blocks, len)) = self.seqs.get(&id).cloned() else {
            return Err(Error::UnknownSequence(id));
        };
        if new_len > len {
            return Err(Error::InvalidArgument(String::new())); // compared by variant only
        }
        let keep = new_len.div_ceil(self.block_size);
        for &b in blocks[keep..].iter().rev() {
            self.release(b);
        }
        blocks.truncate(keep);
        self.seqs.insert(id, (blocks, new_len));
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create,
    Reserve {
        seq: u64,
        n: usize,
    },
    Fork(u64),
    Free(u64),
    /// Drop tokens: `cut` picks the new length (see `truncate_len`).
    Truncate {
        seq: u64,
        cut: usize,
    },
    Tables(Vec<u64>),
    RefCount(usize),
}

/// Sequence operands: usually a live id (picked by index), sometimes any id at all.
fn op(max_tokens: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Create),
        6 => (
            any::<u64>(),
            // Lengths past i32::MAX are refused; none in between (their slots are gigabytes).
            prop_oneof![8 => 0..max_tokens, 1 => (i32::MAX as usize + 1)..=usize::MAX]
        )
            .prop_map(|(seq, n)| Op::Reserve { seq, n }),
        2 => any::<u64>().prop_map(Op::Fork),
        3 => any::<u64>().prop_map(Op::Free),
        3 => (any::<u64>(), any::<usize>()).prop_map(|(seq, cut)| Op::Truncate { seq, cut }),
        1 => prop::collection::vec(any::<u64>(), 0..5).prop_map(Op::Tables),
        1 => any::<usize>().prop_map(Op::RefCount),
    ]
}

/// The id an operand names: a live sequence for most values, a dead or unknown one otherwise.
fn pick(model: &Model, x: u64) -> u64 {
    let ids: Vec<u64> = model.seqs.keys().copied().collect();
    if x % 8 == 7 || ids.is_empty() {
        // Freed, never created, or far beyond any id handed out.
        [x % (model.next_id + 2), x][(x / 8 % 2) as usize]
    } else {
        ids[(x / 8) as usize % ids.len()]
    }
}

/// The length a truncate asks for: usually at most the sequence's (a draft of up to a few
/// blocks rejected, or all of it), sometimes longer (refused), sometimes any value.
fn truncate_len(model: &Model, id: u64, cut: usize) -> usize {
    let len = model.seqs.get(&id).map_or(0, |s| s.1);
    match cut % 16 {
        0 => len + 1 + cut / 16 % 3,
        1 => cut,
        2 => 0,
        3 => len,
        _ => len - (cut / 16) % (len.min(4 * model.block_size) + 1),
    }
}

fn same_error(got: &Error, want: &Error) -> bool {
    match (got, want) {
        (Error::InvalidArgument(_), Error::InvalidArgument(_)) => true,
        _ => got == want,
    }
}

fn check_state(a: &BlockAllocator, m: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.num_free_blocks(), m.free_blocks());
    prop_assert_eq!(a.num_sequences(), m.seqs.len());
    prop_assert_eq!(a.num_blocks(), m.num_blocks);
    prop_assert_eq!(a.block_size(), m.block_size);
    // Ref counts of every block handed out, and of a few never handed out.
    for b in (0..m.fresh).chain(m.fresh..m.num_blocks.min(m.fresh + 3)) {
        prop_assert_eq!(
            a.ref_count(b),
            Ok(m.refs.get(&b).copied().unwrap_or(0)),
            "block {}",
            b
        );
    }
    // Holders per block, counted from the tables, agree with the ref counts.
    let mut holders: BTreeMap<usize, usize> = BTreeMap::new();
    for (&id, (blocks, len)) in &m.seqs {
        let s = SeqId(id);
        prop_assert_eq!(a.len(s), Ok(*len));
        prop_assert_eq!(a.is_empty(s), Ok(*len == 0));
        let table: Vec<usize> = a
            .block_table(s)
            .unwrap()
            .iter()
            .map(|&b| b as usize)
            .collect();
        prop_assert_eq!(&table, blocks, "sequence {}", id);
        prop_assert_eq!(table.len(), len.div_ceil(m.block_size));
        for &b in blocks {
            *holders.entry(b).or_default() += 1;
        }
    }
    prop_assert_eq!(&holders, &m.refs);
    Ok(())
}

fn run_ops(num_blocks: usize, block_size: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut a = BlockAllocator::new(num_blocks, block_size).unwrap();
    let mut m = Model::new(num_blocks, block_size);
    for op in ops {
        match op {
            Op::Create => {
                let s = a.create_sequence();
                prop_assert_eq!(s, SeqId(m.next_id));
                m.seqs.insert(m.next_id, (Vec::new(), 0));
                m.next_id += 1;
            }
            Op::Reserve { seq, n } => {
                let id = pick(&m, *seq);
                let before = m.clone();
                let want = m.reserve(id, *n);
                let got = a.reserve(SeqId(id), *n);
                match (&got, &want) {
                    (Ok(g), Ok(w)) => prop_assert_eq!(g, w),
                    (Err(g), Err(w)) => {
                        prop_assert!(same_error(g, w), "got {:?}, model {:?}", g, w);
                        m = before; // all or nothing: the model's state is restored too
                    }
                    _ => prop_assert!(false, "got {:?}, model {:?}", got, want),
                }
            }
            Op::Fork(seq) => {
                let id = pick(&m, *seq);
                match (a.fork(SeqId(id)), m.seqs.get(&id).cloned()) {
                    (Ok(child), Some((blocks, len))) => {
                        prop_assert_eq!(child, SeqId(m.next_id));
                        for &b in &blocks {
                            *m.refs.get_mut(&b).unwrap() += 1;
                        }
                        m.seqs.insert(m.next_id, (blocks, len));
                        m.next_id += 1;
                    }
                    (Err(e), None) => prop_assert_eq!(e, Error::UnknownSequence(id)),
                    (got, want) => prop_assert!(false, "fork: {:?} vs model {:?}", got, want),
                }
            }
            Op::Free(seq) => {
                let id = pick(&m, *seq);
                match (a.free(SeqId(id)), m.seqs.remove(&id)) {
                    (Ok(()), Some((blocks, _))) => {
                        // Released in reverse, so the sequence's first block is reused first.
                        for &b in blocks.iter().rev() {
                            m.release(b);
                        }
                    }
                    (Err(e), None) => prop_assert_eq!(e, Error::UnknownSequence(id)),
                    (got, want) => prop_assert!(false, "free: {:?} vs model {:?}", got, want),
                }
            }
            Op::Truncate { seq, cut } => {
                let id = pick(&m, *seq);
                let new_len = truncate_len(&m, id, *cut);
                let before = m.clone();
                let old_tables = a.block_tables(&[SeqId(id)]);
                let want = m.truncate(id, new_len);
                let got = a.truncate(SeqId(id), new_len);
                match (&got, &want) {
                    (Ok(()), Ok(())) => {
                        // Truncating a row in place gives the rebuilt tables' row, padded.
                        let mut t = old_tables.unwrap();
                        t.truncate_row(0, new_len, block_size).unwrap();
                        let new = a.block_tables(&[SeqId(id)]).unwrap();
                        prop_assert_eq!(&t.context_lens, &new.context_lens);
                        let used = new_len.div_ceil(block_size);
                        prop_assert_eq!(&t.data[..used], &new.data[..used]);
                        prop_assert!(t.data[used..].iter().all(|&e| e == BlockTables::UNUSED));
                        let longer = t.truncate_row(0, new_len + 1, block_size);
                        prop_assert!(matches!(longer, Err(Error::InvalidArgument(_))));
                    }
                    (Err(g), Err(w)) => {
                        prop_assert!(same_error(g, w), "got {:?}, model {:?}", g, w);
                        m = before;
                    }
                    _ => prop_assert!(false, "truncate: {:?} vs model {:?}", got, want),
                }
            }
            Op::Tables(xs) => {
                let ids: Vec<u64> = xs.iter().map(|&x| pick(&m, x)).collect();
                let seqs: Vec<SeqId> = ids.iter().map(|&i| SeqId(i)).collect();
                let got = a.block_tables(&seqs);
                match ids.iter().find(|i| !m.seqs.contains_key(i)) {
                    Some(&bad) => prop_assert_eq!(got, Err(Error::UnknownSequence(bad))),
                    None => {
                        let t = got.unwrap();
                        let rows: Vec<&(Vec<usize>, usize)> =
                            ids.iter().map(|i| &m.seqs[i]).collect();
                        let max_blocks = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(1);
                        prop_assert_eq!(t.max_blocks, max_blocks);
                        prop_assert_eq!(t.batch(), ids.len());
                        for (b, (blocks, len)) in rows.iter().enumerate() {
                            let row = t.try_row(b).unwrap();
                            for (i, &e) in row.iter().enumerate() {
                                let want = blocks.get(i).map_or(BlockTables::UNUSED, |&x| x as i32);
                                prop_assert_eq!(e, want);
                            }
                            prop_assert_eq!(t.context_lens[b], *len as i32);
                        }
                        prop_assert_eq!(t.validate(num_blocks, block_size), Ok(()));
                    }
                }
            }
            Op::RefCount(b) => {
                let b = if b % 2 == 0 { b % (num_blocks + 2) } else { *b };
                let want = if b < num_blocks {
                    Ok(m.refs.get(&b).copied().unwrap_or(0))
                } else {
                    Err(Error::BlockIndex {
                        block: b,
                        num_blocks,
                    })
                };
                prop_assert_eq!(a.ref_count(b), want);
            }
        }
        check_state(&a, &m)?;
    }
    // Freeing everything returns every block.
    let ids: Vec<u64> = m.seqs.keys().copied().collect();
    for id in ids {
        a.free(SeqId(id)).unwrap();
    }
    prop_assert_eq!(a.num_free_blocks(), num_blocks);
    prop_assert_eq!(a.num_sequences(), 0);
    Ok(())
}

/// Small pools, where running out, sharing and reuse happen all the time.
#[test]
fn small_pools_match_the_model() {
    let strategy = (1usize..16, 1usize..6, prop::collection::vec(op(12), 1..80));
    let result = runner(8).run(&strategy, |(num_blocks, block_size, ops)| {
        run_ops(num_blocks, block_size, &ops)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Pools up to the largest allowed, with block sizes up to 1024: bookkeeping must not depend on
/// the pool size, and lengths near i32::MAX must be refused, not wrapped.
#[test]
fn large_pools_match_the_model() {
    let strategy = (
        prop_oneof![1 => 1usize..64, 1 => Just(i32::MAX as usize), 1 => 1usize..=i32::MAX as usize],
        prop_oneof![1 => 1usize..=16, 1 => Just(1024usize)],
        prop::collection::vec(op(3000), 1..40),
    );
    let result = runner(4).run(&strategy, |(num_blocks, block_size, ops)| {
        run_ops(num_blocks, block_size, &ops)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Reuse order, spelled out: a freed sequence's blocks go to the next reservation, most
/// recently freed first, before any block never handed out.
#[test]
fn freed_blocks_are_reused_last_in_first_out() {
    let mut a = BlockAllocator::new(8, 2).unwrap();
    let s = a.create_sequence();
    assert_eq!(a.reserve(s, 6).unwrap().slots, vec![0, 1, 2, 3, 4, 5]); // blocks 0, 1, 2
    let t = a.create_sequence();
    assert_eq!(a.reserve(t, 1).unwrap().slots, vec![6]); // block 3
    a.free(s).unwrap(); // releases 2, 1, 0: block 0 is on top
    let u = a.create_sequence();
    let r = a.reserve(u, 8).unwrap();
    assert_eq!(a.block_table(u).unwrap(), &[0, 1, 2, 4]);
    assert_eq!(r.slots, vec![0, 1, 2, 3, 4, 5, 8, 9]);
    assert_eq!(a.num_free_blocks(), 3);
}
