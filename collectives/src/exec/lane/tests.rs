//! Table tests of the lane's choices: piece sizes and the pace that picks the way.

use std::time::Duration;

use super::*;

#[test]
fn pieces_are_whole_elements_within_bounds() {
    let k = 1024;
    // (total, element, piece)
    let table = [
        (1 << 20, 4, 256 * k),
        (1 << 20, 8, 256 * k),
        ((1 << 20) + 12, 4, 256 * k),
        (2 << 20, 1, PIECE_MAX),
        (16 << 20, 4, PIECE_MAX),
        (100, 4, 100),
        (3, 2, 2),
        (1, 8, 8),
        (200 * k, 8, 64 * k),
    ];
    for (total, elem, want) in table {
        let got = piece_len(total, elem);
        assert_eq!(got, want, "{total} bytes of {elem}");
        assert!(got % elem == 0 && got <= PIECE_MAX);
    }
}

#[test]
fn the_pace_tries_both_ways_then_keeps_the_faster() {
    let ms = Duration::from_millis;
    let mut p = Pace::default();
    // No measure yet: the lane, then (with the lane's) the plain way.
    assert!(p.pick_lane());
    p.note(true, 1000, ms(1));
    assert!(!p.pick_lane());
    p.note(false, 1000, ms(3));
    // The lane is faster: taken, but for one transfer in EXPLORE.
    let picks: Vec<bool> = (0..EXPLORE).map(|_| p.pick_lane()).collect();
    assert_eq!(picks.iter().filter(|&&l| !l).count(), 1);
    assert!(!picks[EXPLORE as usize - 1], "the last of the round tries the other way");
    // The lane slows down for good: the plain way takes over.
    for _ in 0..8 {
        p.note(true, 1000, ms(10));
    }
    assert!(!p.pick_lane());
    // A faster transfer counts more than a slower one.
    let mut q = Pace::default();
    q.note(true, 1, ms(4));
    q.note(true, 1, ms(2));
    let down = q.lane;
    q.note(true, 1, ms(4));
    assert!(down < 4e6 * 0.76 && q.lane - down < (4e6 - down) / 2.0);
}
