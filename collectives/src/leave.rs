//! Ranks that dropped their communicator. A rank that drops its communicator without an
//! abort has finished every collective call it made on it; it tells the other ranks
//! which call was its last, with an active message in the collectives namespace (id
//! [`LEAVE_AM`]). A rank that hears of it fails every collective call it makes after
//! that one with [`crate::Error::Aborted`] naming the rank that left (a call it had
//! already made aborts the communicator at once), so a program whose ranks disagree on
//! the calls ends with an error instead of waiting for a rank that is gone. Calls up to
//! the departed rank's last are not affected, and point-to-point calls are not either.
//!
//! Only communicators whose id ucxkit picked send it (made by `init`, `from_env`,
//! `bootstrap`, `split`, `dup`, `shrink`): such an id is not taken again until hundreds
//! of others were, so a notice still on its way meets no newer communicator of that id.
//! A caller of `from_endpoints` may reuse its id at once, and its communicators send
//! none.
//!
//! Best effort: a notice UCX does not take during the drop is not sent (nothing is left
//! pending behind a dropped communicator); the other ranks then learn of it from their
//! deadline, or from the transport when the process ends. Call numbers are the tag's 16
//! bits: a rank more than 32,767 calls behind the one that left counts its calls as
//! earlier ones.
//!
//! The notice: communicator id (u16), the rank that left (u32), its last call's number
//! (u16, one before the first when it made none), all little-endian. A malformed one is
//! ignored.

use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Mutex, PoisonError};

use ucxkit_transport::{Endpoint, Namespace};

use crate::abort::Abort;
use crate::tag::MAX_COMMS;

/// The collectives namespace's active-message id of departure notices.
pub const LEAVE_AM: u16 = 1;

/// The notice's length in bytes.
const NOTICE_LEN: usize = 8;

/// A rank's departure: the rank, and the number of the last call it made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Leave {
    pub(crate) rank: usize,
    pub(crate) last: u16,
}

impl Leave {
    fn encode(self, comm: u16) -> [u8; NOTICE_LEN] {
        let mut b = [0; NOTICE_LEN];
        b[..2].copy_from_slice(&comm.to_le_bytes());
        b[2..6].copy_from_slice(&u32::try_from(self.rank).unwrap_or(u32::MAX).to_le_bytes());
        b[6..].copy_from_slice(&self.last.to_le_bytes());
        b
    }

    /// The communicator id and the departure `b` announces; None for a malformed one.
    pub(crate) fn decode(b: &[u8]) -> Option<(u16, Leave)> {
        let b: &[u8; NOTICE_LEN] = b.try_into().ok()?;
        let comm = u16::from_le_bytes([b[0], b[1]]);
        let rank = u32::from_le_bytes([b[2], b[3], b[4], b[5]]) as usize;
        let last = u16::from_le_bytes([b[6], b[7]]);
        (comm < MAX_COMMS).then_some((comm, Leave { rank, last }))
    }

    /// The abort of a call made after this departure.
    fn abort(self) -> Abort {
        Abort {
            failed: Some(self.rank),
            by: self.rank,
            reason: format!(
                "rank {} dropped its communicator after its collective call {}: later calls cannot complete",
                self.rank, self.last
            ),
        }
    }
}

/// Whether call `seq` comes after call `last` (within half the numbers' range).
pub(crate) fn after(seq: u16, last: u16) -> bool {
    (1..=i16::MAX as u16).contains(&seq.wrapping_sub(last))
}

/// A communicator's call numbers and the departures it heard of.
#[derive(Default)]
pub(crate) struct Calls {
    /// The group's size: notices of other ranks are ignored.
    size: usize,
    /// The next call's number.
    next: AtomicU16,
    /// Whether `left` holds anything (one load per call when it does not).
    any_left: AtomicBool,
    left: Mutex<Vec<Leave>>,
}

impl Calls {
    /// The calls of a communicator of `size` ranks.
    pub(crate) fn new(size: usize) -> Calls {
        Calls { size, ..Calls::default() }
    }

    /// Takes the next call's number: with the abort that call meets when a rank that
    /// left made no call that late.
    #[inline]
    pub(crate) fn begin(&self) -> (u16, Option<Abort>) {
        // SeqCst with `heard`'s: of a call begun and a departure heard at once, at least
        // one sees the other.
        let seq = self.next.fetch_add(1, Ordering::SeqCst);
        if !self.any_left.load(Ordering::SeqCst) {
            return (seq, None);
        }
        (seq, self.first_before(seq))
    }

    #[cold]
    fn first_before(&self, seq: u16) -> Option<Abort> {
        let left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        left.iter().find(|l| after(seq, l.last)).map(|l| l.abort())
    }

    /// Notes that `l` left: the abort it means now when a call made already comes after
    /// its last one. A rank outside the group, or heard of before, changes nothing.
    pub(crate) fn heard(&self, l: Leave) -> Option<Abort> {
        if l.rank >= self.size {
            return None;
        }
        {
            let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
            if left.iter().any(|o| o.rank == l.rank) {
                return None;
            }
            left.push(l);
        }
        self.any_left.store(true, Ordering::SeqCst);
        let made = self.next.load(Ordering::SeqCst).wrapping_sub(1);
        // Nothing was made when `next` is 0; a wrapped counter made calls up to 65,535.
        (after(made, l.last) && self.next.load(Ordering::SeqCst) != 0).then(|| l.abort())
    }

    /// The last call's number (one before the first when none was made).
    pub(crate) fn last(&self) -> u16 {
        self.next.load(Ordering::SeqCst).wrapping_sub(1)
    }
}

/// Tells every rank in `eps` (None for this rank) that `rank` dropped communicator
/// `comm` after call `last`, where UCX takes the notice during the call.
pub(crate) fn tell(ns: &Namespace, eps: &[Option<Endpoint>], comm: u16, rank: usize, last: u16) {
    let notice = Leave { rank, last }.encode(comm);
    for ep in eps.iter().flatten() {
        let _ = ns.try_am_send(ep, LEAVE_AM, &notice, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_junk_is_ignored() {
        let l = Leave { rank: 3, last: 65535 };
        assert_eq!(Leave::decode(&l.encode(7)), Some((7, l)));
        assert!(Leave::decode(&[0; 7]).is_none());
        assert!(Leave::decode(&[0; 9]).is_none());
        assert!(Leave::decode(&[0xff, 0xff, 0, 0, 0, 0, 0, 0]).is_none(), "comm id out of range");
    }

    /// Call order across the 16-bit wrap: later within half the range, else earlier.
    #[test]
    fn calls_are_ordered_across_the_wrap() {
        let cases = [
            (1, 0, true),
            (0, 0, false),
            (0, 1, false),
            (0, 65535, true),
            (5, 65530, true),
            (65530, 5, false),
            (32767, 0, true),
            (32768, 0, false),
        ];
        for (seq, last, later) in cases {
            assert_eq!(after(seq, last), later, "call {seq} after {last}");
        }
    }

    /// A departure fails the calls made after the rank's last, whether heard before they
    /// begin or after; calls up to its last go on; a rank that made no call fails every
    /// call; a second notice of the same rank changes nothing.
    #[test]
    fn departures_fail_only_later_calls() {
        // Heard first: calls 0 and 1 go on, call 2 fails.
        let c = Calls::new(3);
        assert_eq!(c.heard(Leave { rank: 1, last: 1 }), None);
        assert_eq!(c.begin().1, None);
        assert_eq!(c.begin().1, None);
        let (seq, abort) = c.begin();
        assert_eq!(seq, 2);
        let a = abort.expect("call 2 comes after rank 1's last");
        assert_eq!(a.failed, Some(1));
        assert!(
            a.reason.contains("rank 1 dropped its communicator after its collective call 1"),
            "{}",
            a.reason
        );

        // Heard after a later call began: an abort at once.
        let c = Calls::new(3);
        for _ in 0..3 {
            assert_eq!(c.begin().1, None);
        }
        assert_eq!(c.heard(Leave { rank: 2, last: 2 }), None, "calls 0-2 were all rank 2's too");
        let c = Calls::new(3);
        for _ in 0..3 {
            c.begin();
        }
        assert!(c.heard(Leave { rank: 2, last: 1 }).is_some(), "call 2 was made after rank 2's last");
        assert_eq!(c.heard(Leave { rank: 2, last: 0 }), None, "rank 2 already left");
        assert_eq!(c.heard(Leave { rank: 3, last: 0 }), None, "no rank 3 in a group of 3");

        // A rank that made no call: its last is 65535, and no call of this rank was
        // made yet, so nothing aborts until the first.
        let c = Calls::new(3);
        assert_eq!(c.heard(Leave { rank: 0, last: u16::MAX }), None);
        assert!(c.begin().1.is_some());
        assert_eq!(c.last(), 0);
    }
}
