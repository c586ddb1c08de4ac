//! `Reservation::extend_slots` / `write_slots`: the allocator's slots in the integer type a
//! device slot mapping takes, checked (a slot that does not fit is an error, never a wrap).

use kvq::Error;
use kvq::cache::{BlockAllocator, Reservation};

/// A step's slot mapping built from several sequences' reservations in one reused buffer.
#[test]
fn extend_slots_appends_each_reservation() {
    let mut alloc = BlockAllocator::new(8, 4).unwrap();
    let (a, b) = (alloc.create_sequence(), alloc.create_sequence());
    let mut mapping: Vec<i32> = Vec::new();
    for step in 0..3 {
        mapping.clear();
        let mut want = Vec::new();
        for (seq, n) in [(a, 1), (b, 3)] {
            let r = alloc.reserve(seq, n).unwrap();
            r.extend_slots(&mut mapping).unwrap();
            want.extend(r.slots.iter().map(|&s| s as i32));
        }
        assert_eq!(mapping, want, "step {step}");
    }
    let r = alloc.reserve(a, 2).unwrap();
    let mut wide: Vec<i64> = vec![-1];
    r.extend_slots(&mut wide).unwrap();
    let want: Vec<i64> = r.slots.iter().map(|&s| s as i64).collect();
    assert_eq!(wide[1..], want[..]);
    assert_eq!(wide[0], -1, "extend_slots appends, it does not clear");
}

#[test]
fn slots_that_do_not_fit_are_errors() {
    let big = i32::MAX as usize + 1;
    let r = Reservation {
        slots: vec![5, big, 7],
        copies: vec![],
    };
    let mut mapping: Vec<i32> = vec![1, 2];
    let err = r.extend_slots(&mut mapping).unwrap_err();
    assert!(
        matches!(err, Error::Unsupported(ref m) if m.contains(&big.to_string())),
        "{err}"
    );
    assert_eq!(
        mapping,
        [1, 2],
        "a failed extend leaves the mapping as it was"
    );
    let mut buf = [0i32; 3];
    assert!(matches!(
        r.write_slots(&mut buf),
        Err(Error::Unsupported(_))
    ));

    // i64 holds every slot.
    let mut wide = [0i64; 4];
    r.write_slots(&mut wide).unwrap();
    assert_eq!(wide, [5, big as i64, 7, 0]);
    let mut wide: Vec<i64> = Vec::new();
    r.extend_slots(&mut wide).unwrap();
    assert_eq!(wide, [5, big as i64, 7]);
}

#[test]
fn write_slots_needs_room() {
    let r = Reservation {
        slots: vec![3, 4],
        copies: vec![],
    };
    let mut short = [0i64; 1];
    assert_eq!(
        r.write_slots(&mut short),
        Err(Error::Length {
            what: "slot mapping",
            expected: 2,
            actual: 1
        })
    );
    let mut row = [-1i32; 3];
    r.write_slots(&mut row).unwrap();
    assert_eq!(row, [3, 4, -1]);
}
