//! The node's room for chunks in flight: every chunk a pull has asked for and not yet
//! received holds its size of it, so all the node's pulls together never have more
//! than [`NodeOptions::in_flight`](super::NodeOptions::in_flight) bytes on the way. A
//! prefetch takes room only while at most half of it is used: a blocking get always
//! finds room.

use std::sync::{Mutex, PoisonError};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// How urgent a pull is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Priority {
    /// Someone waits for the object: it may use all of the node's room.
    #[default]
    Get,
    /// The object is fetched ahead of need: it uses at most half of the room.
    Prefetch,
}

/// Room for bytes in flight.
pub(super) struct Budget {
    cap: u64,
    used: Mutex<u64>,
    freed: Notify,
}

/// Room taken; given back when dropped.
pub(super) struct Held<'a> {
    budget: &'a Budget,
    n: u64,
}

impl Budget {
    pub(super) fn new(cap: u64) -> Budget {
        Budget { cap, used: Mutex::new(0), freed: Notify::new() }
    }

    /// `n` bytes of room for a pull of priority `p`, if there is room: a get may fill the
    /// room, a prefetch half of it; one chunk larger than the limit goes alone.
    pub(super) fn try_take(&self, n: u64, p: Priority) -> Option<Held<'_>> {
        let limit = match p {
            Priority::Get => self.cap,
            Priority::Prefetch => self.cap / 2,
        };
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        if *used > 0 && *used + n > limit {
            return None;
        }
        *used += n;
        Some(Held { budget: self, n })
    }

    /// A future that ends when room is given back (made before a [`Budget::try_take`]
    /// that may fail, so that no release is missed).
    pub(super) fn freed(&self) -> Notified<'_> {
        self.freed.notified()
    }

    /// Bytes in flight.
    pub(super) fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        *self.budget.used.lock().unwrap_or_else(PoisonError::into_inner) -= self.n;
        self.budget.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gets_fill_the_room_and_prefetches_half() {
        let b = Budget::new(100);
        let a = b.try_take(40, Priority::Prefetch).unwrap();
        assert!(b.try_take(20, Priority::Prefetch).is_none(), "over half for a prefetch");
        let g = b.try_take(60, Priority::Get).unwrap();
        assert!(b.try_take(1, Priority::Get).is_none());
        assert_eq!(b.used(), 100);
        drop(a);
        assert!(b.try_take(40, Priority::Get).is_some());
        drop(g);
        assert_eq!(b.used(), 0);
        let big = b.try_take(500, Priority::Prefetch).expect("a chunk over the limit goes alone");
        assert!(b.try_take(1, Priority::Get).is_none());
        drop(big);
    }

    #[tokio::test]
    async fn a_release_wakes_a_waiter_that_looked_before_it() {
        let b = Budget::new(10);
        let held = b.try_take(10, Priority::Get).unwrap();
        let freed = b.freed();
        assert!(b.try_take(5, Priority::Get).is_none());
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), freed).await.expect("woken");
        assert!(b.try_take(5, Priority::Get).is_some());
    }
}
