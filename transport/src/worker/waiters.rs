//! The wakers of futures waiting for an endpoint's events (a failure, the end of its
//! stream, the end of its parting), one per future.
//!
//! Each future registers under a key of its own, replaces its waker when it is polled
//! again, and leaves when it is dropped ([`Place`], [`Leave`]). Telling wakers apart by
//! `Waker::will_wake` instead let the list grow by one on every poll of a future that
//! `block_on` runs: tokio polls it with a borrowed waker whose clone has another vtable,
//! so the stored clone never "will wake" the same task (a connection's waiting list
//! reached tens of thousands of wakers, and every poll walked it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Waker;

use super::{State, WorkerInner};

/// Wakers by key, at most one per key.
#[derive(Debug, Default)]
pub(crate) struct Waiters(Vec<(u64, Waker)>);

impl Waiters {
    /// Registers `waker` under `key`, replacing the one there.
    pub(crate) fn register(&mut self, key: u64, waker: &Waker) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, w)) => w.clone_from(waker),
            None => self.0.push((key, waker.clone())),
        }
    }

    /// Forgets the waker under `key`, if any.
    pub(crate) fn remove(&mut self, key: u64) {
        self.0.retain(|(k, _)| *k != key);
    }

    /// Moves every waker into `out` (to be woken), leaving none.
    pub(crate) fn drain_into(&mut self, out: &mut Vec<Waker>) {
        out.extend(self.0.drain(..).map(|(_, w)| w));
    }

    /// How many are registered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Which of an endpoint's waiting lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum List {
    /// Stream progress and the endpoint's failure.
    Stream,
    /// The end of the endpoint's parting.
    Parting,
}

impl State {
    /// Endpoint `ep`'s `list`, if the endpoint (and, for `Parting`, its parting) is there.
    pub(crate) fn waiters(&mut self, ep: u64, list: List) -> Option<&mut Waiters> {
        let e = self.eps.get_mut(&ep)?;
        match list {
            List::Stream => Some(&mut e.stream_waiters),
            List::Parting => e.parting_mut().map(|p| &mut p.waiters),
        }
    }
}

/// A future's place in one of an endpoint's waiting lists: a key of its own, taken
/// without the worker's lock, and whether the future registered there (only then is
/// the list looked at when it goes, so a future that never waited costs no lock).
#[derive(Debug)]
pub(crate) struct Place {
    ep: u64,
    list: List,
    key: u64,
    registered: AtomicBool,
}

impl Place {
    /// A new place in endpoint `ep`'s `list`.
    pub(crate) fn new(ep: u64, list: List) -> Place {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Place { ep, list, key: NEXT.fetch_add(1, Ordering::Relaxed), registered: AtomicBool::new(false) }
    }

    /// Registers `waker` here (the state's lock held: `st`), replacing the one before.
    pub(crate) fn register(&self, st: &mut State, waker: &Waker) {
        if let Some(w) = st.waiters(self.ep, self.list) {
            w.register(self.key, waker);
            self.registered.store(true, Ordering::Relaxed);
        }
    }

    /// Takes its waker out of the list, if it ever registered.
    pub(crate) fn leave(&self, inner: &WorkerInner) {
        if self.registered.load(Ordering::Relaxed) {
            inner.locked(|st| {
                if let Some(w) = st.waiters(self.ep, self.list) {
                    w.remove(self.key);
                }
            });
        }
    }
}

/// A [`Place`] for a future that borrows the worker, left when the future ends or is
/// dropped.
pub(crate) struct Leave<'a> {
    inner: &'a WorkerInner,
    place: Place,
}

impl<'a> Leave<'a> {
    /// A new place in endpoint `ep`'s `list` (registered when the future waits).
    pub(crate) fn new(inner: &'a WorkerInner, ep: u64, list: List) -> Leave<'a> {
        Leave { inner, place: Place::new(ep, list) }
    }

    /// Registers `waker` (the state's lock held: `st`).
    pub(crate) fn register(&self, st: &mut State, waker: &Waker) {
        self.place.register(st, waker);
    }
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.place.leave(self.inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn one_waker_per_key_however_often_it_registers() {
        let counts: Vec<Arc<Count>> = (0..3).map(|_| Arc::new(Count(AtomicUsize::new(0)))).collect();
        let wakers: Vec<Waker> = counts.iter().map(|c| Waker::from(c.clone())).collect();
        let mut ws = Waiters::default();
        // (key, waker index) registered in turn, and the count after.
        let steps = [(1, 0, 1), (1, 0, 1), (2, 1, 2), (1, 2, 2), (3, 2, 3), (2, 1, 3)];
        for (i, (key, w, len)) in steps.into_iter().enumerate() {
            ws.register(key, &wakers[w]);
            assert_eq!(ws.len(), len, "step {i}");
        }
        // Key 1 now holds waker 2 (replaced), key 2 waker 1, key 3 waker 2.
        ws.remove(3);
        ws.remove(9);
        assert_eq!(ws.len(), 2);
        let mut out = Vec::new();
        ws.drain_into(&mut out);
        assert_eq!(ws.len(), 0);
        out.into_iter().for_each(Waker::wake);
        let woken: Vec<usize> = counts.iter().map(|c| c.0.load(Ordering::Relaxed)).collect();
        assert_eq!(woken, [0, 1, 1]);
    }
}
