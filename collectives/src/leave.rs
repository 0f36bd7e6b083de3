//! Ranks that dropped their communicator. A rank that drops its communicator without an
//! abort has finished every collective call it made on it; it tells the other ranks how
//! many it made, with an active message in the collectives namespace (id [`LEAVE_AM`]).
//! A rank that hears of it fails the first collective call it makes beyond that count
//! with [`crate::Error::Aborted`] naming the rank that left (a call it had already made
//! aborts the communicator when the notice comes), and passes the abort on to the
//! others, so a program whose ranks disagree on the calls ends with an error instead of
//! waiting for a rank that is gone. The departure itself fails no call the departed rank
//! made too: ranks that end the same calls and drop their communicators at different
//! times see no error. (Once an abort came of it, every pending and later call on the
//! communicator fails, as after any abort.)
//!
//! Only communicators formed on every rank by ucxkit send and hear notices: those made
//! by `init`, `from_env`, `bootstrap`, `split`, `dup` and `shrink`, once formed. Each
//! carries a token its ranks agreed on when it formed (from a random word of every rank
//! for `bootstrap` and `split`; from the parent's token, id and survivors for `shrink`),
//! and a notice counts only for the communicator of its id and token: a rank that drops
//! a communicator long after the others, whose id a newer communicator took meanwhile,
//! does not end that one's calls. A try that did not form (a `split` whose id was taken
//! on another rank) sends nothing. A caller of `from_endpoints` may reuse its id at
//! once, and its communicators neither send nor hear notices.
//!
//! Best effort: a notice UCX does not take during the drop is not sent (nothing is left
//! pending behind a dropped communicator), and a rank passes the abort a notice caused
//! on only from a call that fails with it; a rank that missed it learns from another
//! abort, its deadline, or the transport when the process ends.
//!
//! The notice: communicator id (u16), the rank that left (u32), the number of collective
//! calls it made (u64), the communicator's token (u64), all little-endian. A malformed
//! one is ignored.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use ucxkit_transport::{Endpoint, Namespace};

use crate::abort::Abort;
use crate::tag::MAX_COMMS;

/// The collectives namespace's active-message id of departure notices.
pub const LEAVE_AM: u16 = 1;

/// The notice's length in bytes.
const NOTICE_LEN: usize = 22;

/// A rank's departure: the rank, how many collective calls it made, and the token of
/// the communicator it left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Leave {
    pub(crate) rank: usize,
    pub(crate) made: u64,
    pub(crate) token: u64,
}

impl Leave {
    fn encode(self, comm: u16) -> [u8; NOTICE_LEN] {
        let mut b = [0; NOTICE_LEN];
        b[..2].copy_from_slice(&comm.to_le_bytes());
        b[2..6].copy_from_slice(&u32::try_from(self.rank).unwrap_or(u32::MAX).to_le_bytes());
        b[6..14].copy_from_slice(&self.made.to_le_bytes());
        b[14..].copy_from_slice(&self.token.to_le_bytes());
        b
    }

    /// The communicator id and the departure `b` announces; None for a malformed one.
    pub(crate) fn decode(b: &[u8]) -> Option<(u16, Leave)> {
        let b: &[u8; NOTICE_LEN] = b.try_into().ok()?;
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let comm = u16::from_le_bytes([b[0], b[1]]);
        let rank = u32::from_le_bytes([b[2], b[3], b[4], b[5]]) as usize;
        (comm < MAX_COMMS).then_some((comm, Leave { rank, made: word(6), token: word(14) }))
    }

    /// The abort of a call beyond this departure.
    fn abort(self) -> Abort {
        Abort {
            failed: Some(self.rank),
            by: self.rank,
            reason: format!(
                "rank {} dropped its communicator: it made {} collective call{}, and later calls cannot complete",
                self.rank,
                self.made,
                if self.made == 1 { "" } else { "s" }
            ),
        }
    }
}

/// A token made of `words` (the same words, in the same order, on every rank): a
/// fixed mix, the same in every build, never 0 (which means "not formed").
pub(crate) fn token_of(words: impl IntoIterator<Item = u64>) -> u64 {
    // splitmix64's finaliser over a running sum.
    let t = words.into_iter().fold(0x9e37_79b9_7f4a_7c15_u64, |acc, w| {
        let mut z = acc.wrapping_add(w).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    });
    t.max(1)
}

/// A word no other process picks alike, in practice: this rank's share of a token.
pub(crate) fn random_word() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A communicator's calls and the departures it heard of.
#[derive(Default)]
pub(crate) struct Calls {
    /// The group's size: notices of other ranks are ignored.
    size: usize,
    /// The calls begun so far (the next call's index).
    begun: AtomicU64,
    /// The token its ranks agreed on when it formed on every rank (0 until then): a
    /// formed communicator tells of its drop and hears of the others'.
    token: AtomicU64,
    /// Whether `left` holds anything (one load per call when it does not).
    any_left: AtomicBool,
    left: Mutex<Vec<Leave>>,
    /// Whether a departure heard while a call was running aborted the communicator, and
    /// no call has told the other ranks yet.
    untold: AtomicBool,
}

impl Calls {
    /// The calls of a communicator of `size` ranks.
    pub(crate) fn new(size: usize) -> Calls {
        Calls { size, ..Calls::default() }
    }

    /// Begins a call: its sequence number (its index, wrapping at 2^16 as the tag's
    /// field does), with the abort it meets when a rank that left made fewer calls.
    #[inline]
    pub(crate) fn begin(&self) -> (u16, Option<Abort>) {
        // SeqCst with `heard`'s: of a call begun and a departure heard at once, at least
        // one sees the other.
        let i = self.begun.fetch_add(1, Ordering::SeqCst);
        if !self.any_left.load(Ordering::SeqCst) {
            return (i as u16, None);
        }
        (i as u16, self.beyond(i))
    }

    /// The abort of call `i` when a rank that left made no more than `i` calls.
    #[cold]
    fn beyond(&self, i: u64) -> Option<Abort> {
        let left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        left.iter().find(|l| i >= l.made).map(|l| l.abort())
    }

    /// Notes that `l` left: the abort it means now when a call beyond its count was made
    /// already. A rank outside the group, one heard of before, a communicator not formed
    /// or one of another token changes nothing.
    pub(crate) fn heard(&self, l: Leave) -> Option<Abort> {
        if l.rank >= self.size || l.token == 0 || l.token != self.token() {
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
        if self.begun.load(Ordering::SeqCst) <= l.made {
            return None;
        }
        self.untold.store(true, Ordering::SeqCst);
        Some(l.abort())
    }

    /// Whether an abort from a departure heard here still has to be passed on (true
    /// once).
    pub(crate) fn take_untold(&self) -> bool {
        self.untold.swap(false, Ordering::SeqCst)
    }

    /// How many calls were begun.
    pub(crate) fn made(&self) -> u64 {
        self.begun.load(Ordering::SeqCst)
    }

    /// Marks the communicator formed on every rank, with the (nonzero) token they agreed
    /// on.
    pub(crate) fn set_formed(&self, token: u64) {
        debug_assert_ne!(token, 0, "tokens come from token_of");
        self.token.store(token, Ordering::SeqCst);
    }

    /// The token its ranks agreed on (0 before it formed).
    pub(crate) fn token(&self) -> u64 {
        self.token.load(Ordering::SeqCst)
    }
}

/// Tells every rank in `eps` (None for this rank) that `l.rank` dropped communicator
/// `comm`, where UCX takes the notice during the call.
pub(crate) fn tell(ns: &Namespace, eps: &[Option<Endpoint>], comm: u16, l: Leave) {
    crate::abort::to_every_rank(ns, eps, LEAVE_AM, &l.encode(comm), false);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_junk_is_ignored() {
        let l = Leave { rank: 3, made: u64::MAX - 1, token: 0x0123_4567_89ab_cdef };
        assert_eq!(Leave::decode(&l.encode(7)), Some((7, l)));
        assert!(Leave::decode(&[0; NOTICE_LEN - 1]).is_none());
        assert!(Leave::decode(&[0; NOTICE_LEN + 1]).is_none());
        let mut far = [0; NOTICE_LEN];
        far[..2].copy_from_slice(&MAX_COMMS.to_le_bytes());
        assert!(Leave::decode(&far).is_none(), "comm id out of range");
    }

    const TOKEN: u64 = 77;

    /// A departure from the communicator of [`TOKEN`].
    fn leave(rank: usize, made: u64) -> Leave {
        Leave { rank, made, token: TOKEN }
    }

    /// A formed group of three whose calls 0..`begun` were begun.
    fn calls(begun: u64) -> Calls {
        let c = Calls::new(3);
        c.set_formed(TOKEN);
        for _ in 0..begun {
            assert_eq!(c.begin().1, None);
        }
        c
    }

    /// What a departure of a rank that made `made` calls does to a communicator that
    /// began `begun`: the abort now (passed on later), and then whether its next call
    /// fails. Call numbers wrap in the tag, not here: a rank 40,000 calls behind is
    /// still behind.
    #[test]
    fn departures_fail_only_calls_beyond_the_count() {
        // (begun, made, aborts now, next call fails)
        let cases = [
            (0, 0, false, true),
            (0, 2, false, false),
            (1, 2, false, false),
            (2, 2, false, true),
            (3, 2, true, true),
            (100, 40_100, false, false),
            (70_000, 70_000, false, true),
        ];
        for (begun, made, now, next) in cases {
            let c = calls(begun);
            let a = c.heard(leave(1, made));
            assert_eq!(a.is_some(), now, "begun {begun}, made {made}");
            assert_eq!(c.take_untold(), now, "passed on once");
            assert!(!c.take_untold());
            let (seq, fails) = c.begin();
            assert_eq!(seq, begun as u16);
            assert_eq!(fails.is_some(), next, "begun {begun}, made {made}: call {begun}");
        }
        let a = calls(1).heard(leave(2, 0)).expect("call 0 was beyond");
        assert_eq!(a.failed, Some(2));
        assert!(
            a.reason.contains("rank 2 dropped its communicator: it made 0 collective calls,"),
            "{}",
            a.reason
        );
    }

    /// Notices that change nothing: a rank outside the group, a second one of a rank, one
    /// of another communicator's token, and any before the communicator was formed on
    /// every rank.
    #[test]
    fn notices_that_are_ignored() {
        let c = calls(5);
        assert_eq!(c.heard(leave(3, 0)), None, "no rank 3 in a group of 3");
        assert_eq!(c.heard(Leave { token: TOKEN + 1, ..leave(2, 0) }), None, "another communicator's");
        assert!(c.heard(leave(1, 9)).is_none());
        assert_eq!(c.heard(leave(1, 0)), None, "rank 1 already left");
        assert!(c.heard(leave(2, 0)).is_some(), "rank 2's notice of this token counts");
        let unformed = Calls::new(3);
        unformed.begin();
        assert_eq!(unformed.heard(Leave { token: 0, ..leave(1, 0) }), None);
        assert_eq!(unformed.begin().1, None);
    }

    /// Tokens: the same words give the same token, any change another; random words
    /// differ.
    #[test]
    fn tokens_follow_their_words() {
        assert_eq!(token_of([1, 2, 3]), token_of([1, 2, 3]));
        let others = [token_of([1, 2, 4]), token_of([2, 1, 3]), token_of([1, 2]), token_of([1, 2, 3, 0])];
        assert!(others.iter().all(|&t| t != token_of([1, 2, 3])), "{others:?}");
        assert_ne!(random_word(), random_word());
    }
}
