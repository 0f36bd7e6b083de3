//! Objects a node is still receiving, served to others chunk by chunk as the chunks
//! arrive and check out: a node relays an object while it pulls it, so receivers can
//! pull from one another (a chain, a tree, a late receiver taking what an earlier one
//! has) instead of all from the owner.
//!
//! A checked chunk is a piece split off the object's one buffer, to be joined back
//! without a copy when the transfer ends; pieces of one buffer share one reference
//! count, so a relay cannot hold a frozen copy of a piece. A relay borrows the piece
//! itself for its send and gives it back when the send ends: a slot per chunk is
//! missing, here, or lent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::BytesMut;
use tokio::sync::Notify;

use super::Inner;
use crate::id::ObjectId;
use crate::sums::Layout;

/// An object being received: its layout and its checked chunks.
pub(super) struct Partial {
    layout: Arc<Layout>,
    state: Mutex<State>,
    changed: Notify,
}

/// Where a checked chunk is.
enum Slot {
    Missing,
    Here(BytesMut),
    /// A relay's send has it.
    Lent,
}

struct State {
    slots: Vec<Slot>,
    /// The transfer is ending: nothing is lent until it reopens.
    closed: bool,
    /// The transfer ended (the object sealed first, when it arrived).
    gone: bool,
}

impl Partial {
    fn new(layout: Arc<Layout>) -> Partial {
        let slots = (0..layout.count()).map(|_| Slot::Missing).collect();
        Partial {
            layout,
            state: Mutex::new(State { slots, closed: false, gone: false }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The object's layout.
    pub(super) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Chunk `k`, lent for a send once it has arrived, checked out and is not lent to
    /// another, and the transfer is not collecting its pieces; give it back with
    /// [`Partial::give_back`]. `None` when the transfer ends first (the caller looks in
    /// the store: an object that arrived is sealed before its transfer ends).
    pub(super) async fn lend(&self, k: u64) -> Option<BytesMut> {
        loop {
            // Made before the look, so that no change is missed.
            let changed = self.changed.notified();
            {
                let mut s = self.lock();
                if s.gone {
                    return None;
                }
                let closed = s.closed;
                let slot = s.slots.get_mut(k as usize)?;
                if let (Slot::Here(_), false) = (&slot, closed) {
                    let Slot::Here(piece) = std::mem::replace(slot, Slot::Lent) else { unreachable!() };
                    return Some(piece);
                }
            }
            changed.await;
        }
    }

    /// Puts chunk `k` here: checked, or given back after a send.
    pub(super) fn give_back(&self, k: u64, piece: BytesMut) {
        if let Some(slot) = self.lock().slots.get_mut(k as usize) {
            *slot = Slot::Here(piece);
        }
        self.changed.notify_waiters();
    }

    /// Ends the lending and takes the pieces back, waiting at most `limit` for those
    /// lent; a piece still lent then is `None` (its transfer fetches it again).
    async fn collect(&self, limit: Duration) -> Vec<Option<BytesMut>> {
        let end = tokio::time::Instant::now() + limit;
        self.lock().closed = true;
        self.changed.notify_waiters();
        loop {
            let changed = self.changed.notified();
            {
                let mut s = self.lock();
                let lent = s.slots.iter().any(|x| matches!(x, Slot::Lent));
                if !lent || tokio::time::Instant::now() >= end {
                    return s
                        .slots
                        .iter_mut()
                        .map(|x| match std::mem::replace(x, Slot::Missing) {
                            Slot::Here(p) => Some(p),
                            _ => None,
                        })
                        .collect();
                }
            }
            let _ = tokio::time::timeout_at(end, changed).await;
        }
    }
}

/// The objects a node is receiving, by id.
pub(super) type Partials = Mutex<HashMap<ObjectId, Arc<Partial>>>;

/// A transfer's object, published for relaying while it lasts.
pub(super) struct Published<'a> {
    node: &'a Inner,
    id: ObjectId,
    partial: Arc<Partial>,
}

impl<'a> Published<'a> {
    pub(super) fn new(node: &'a Inner, id: ObjectId, layout: Arc<Layout>) -> Published<'a> {
        let partial = Arc::new(Partial::new(layout));
        node.partial.lock().unwrap_or_else(PoisonError::into_inner).insert(id, partial.clone());
        node.arrived.notify_waiters();
        Published { node, id, partial }
    }

    /// Chunk `k` arrived and checked out: here for relays until the transfer ends.
    pub(super) fn put(&self, k: u64, piece: BytesMut) {
        self.partial.give_back(k, piece);
    }

    /// Lends again after a [`Published::collect`] that came back short.
    pub(super) fn reopen(&self) {
        self.partial.lock().closed = false;
        self.partial.changed.notify_waiters();
    }

    /// The pieces back, at the transfer's end (see [`Partial::collect`]).
    pub(super) async fn collect(&self, limit: Duration) -> Vec<Option<BytesMut>> {
        self.partial.collect(limit).await
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let mut p = self.node.partial.lock().unwrap_or_else(PoisonError::into_inner);
        if p.get(&self.id).is_some_and(|q| Arc::ptr_eq(q, &self.partial)) {
            p.remove(&self.id);
        }
        drop(p);
        let mut s = self.partial.lock();
        (s.closed, s.gone) = (true, true);
        drop(s);
        self.partial.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pieces_are_lent_one_relay_at_a_time_and_collected_at_the_end() {
        let layout = Arc::new(Layout::of(&[7u8; 10_000], 4096).unwrap());
        let p = Arc::new(Partial::new(layout));
        let waiting = tokio::spawn({
            let p = p.clone();
            async move { p.lend(1).await }
        });
        tokio::task::yield_now().await;
        p.give_back(1, BytesMut::from(&b"one"[..]));
        let lent = waiting.await.unwrap().unwrap();
        assert_eq!(&lent[..], b"one");
        assert_eq!(p.lend(9).await, None, "no such chunk");
        // Lent: a second relay waits for it to come back.
        let second = tokio::spawn({
            let p = p.clone();
            async move { p.lend(1).await }
        });
        tokio::task::yield_now().await;
        assert!(!second.is_finished());
        p.give_back(1, lent);
        let again = second.await.unwrap().unwrap();
        // Collected while lent: waits for it, then gives up on it after the limit.
        let t = tokio::time::Instant::now();
        let got = p.collect(Duration::from_millis(50)).await;
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(got.iter().all(Option::is_none), "chunk 1 still lent, the rest missing");
        assert_eq!(&again[..], b"one");
        // While collecting, a relay waits: for the transfer to reopen, or to end.
        p.give_back(1, again);
        let third = tokio::spawn({
            let p = p.clone();
            async move { p.lend(1).await }
        });
        tokio::task::yield_now().await;
        assert!(!third.is_finished(), "nothing is lent while collecting");
        p.lock().closed = false;
        p.changed.notify_waiters();
        assert_eq!(&third.await.unwrap().unwrap()[..], b"one", "lent once reopened");
        p.lock().gone = true;
        p.changed.notify_waiters();
        assert_eq!(p.lend(2).await, None, "the transfer ended");
    }
}
