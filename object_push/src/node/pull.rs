//! The puller's side: looks the object up at its holders at once, takes it inline or
//! fetches its chunks ([`super::fetch`]), and seals it once every chunk is verified.
//! Concurrent pulls of one object share one transfer.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;
use tokio::time::Instant;
use ucxkit_transport::{AmMessage, Endpoint};

use super::budget::Priority;
use super::fetch::Transfer;
use super::sink::Dest;
use super::{Inner, ObjectNode};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::{chunk_for, chunks, sum, Layout};
use crate::wire::{decode_sums, Msg};

impl ObjectNode {
    /// Pulls object `id` from `holder` into this node's store and returns it (see
    /// [`ObjectNode::pull_from`]).
    ///
    /// # Errors
    /// As for [`ObjectNode::pull_from`].
    pub async fn pull(&self, id: ObjectId, holder: &Endpoint) -> Result<Object> {
        self.pull_from(id, std::slice::from_ref(holder)).await
    }

    /// Pulls object `id` into this node's store and returns it: looked up at every
    /// holder at once, taken inline (a small object) or in chunks spread over the
    /// holders that have it; a holder that fails mid-transfer leaves its chunks to the
    /// others. Every chunk is checked against its checksum (a corrupt one is fetched
    /// again, from another holder where there is one, up to the node's `tries`) before
    /// the object is sealed. An object the store holds is returned at once; a pull of an
    /// object another pull is moving waits for that one (and goes on by itself if that
    /// one fails or is dropped).
    ///
    /// # Errors
    /// [`Error::NotFound`] when no holder has it; [`Error::DeadlineExceeded`] past the
    /// node's deadline; [`Error::Corrupt`] for a chunk corrupt on every try;
    /// [`Error::Protocol`] for a malformed answer; the store's refusal (no room); the
    /// last holder's failure when every holder failed.
    pub async fn pull_from(&self, id: ObjectId, holders: &[Endpoint]) -> Result<Object> {
        self.inner.pull_from(id, holders, Priority::Get).await
    }

    /// [`ObjectNode::pull_from`] ahead of need: its chunks use at most half of the
    /// node's room for bytes in flight ([`super::NodeOptions::in_flight`]), so blocking
    /// pulls always find room.
    ///
    /// # Errors
    /// As for [`ObjectNode::pull_from`].
    pub async fn prefetch_from(&self, id: ObjectId, holders: &[Endpoint]) -> Result<Object> {
        self.inner.pull_from(id, holders, Priority::Prefetch).await
    }
}

impl Inner {
    /// [`ObjectNode::pull_from`].
    pub(super) async fn pull_from(
        &self,
        id: ObjectId,
        holders: &[Endpoint],
        priority: Priority,
    ) -> Result<Object> {
        self.pull_with(id, holders, Choice::all(holders), priority).await
    }

    /// [`Inner::pull_from`] from `holders` in the order of `choice`.
    pub(super) async fn pull_with(
        &self,
        id: ObjectId,
        holders: &[Endpoint],
        choice: Choice,
        priority: Priority,
    ) -> Result<Object> {
        if holders.is_empty() && self.store.get(&id).is_none() {
            return Err(Error::InvalidArgument("a pull needs at least one holder".into()));
        }
        let node = self;
        let limit = node.opts.deadline;
        let end = Instant::now() + limit;
        let late = || Error::DeadlineExceeded { what: format!("pull of object {id}"), limit };
        loop {
            if let Some(o) = node.store.get(&id) {
                return Ok(o);
            }
            let other = {
                let mut p = node.pulling.lock().unwrap_or_else(PoisonError::into_inner);
                match p.get(&id) {
                    Some(tx) => Some(tx.subscribe()),
                    None => {
                        p.insert(id, watch::channel(()).0);
                        None
                    }
                }
            };
            let Some(mut other) = other else { break };
            // Ends (with an error) when that pull ends, either way.
            if tokio::time::timeout_at(end, other.changed()).await.is_err() {
                return Err(late());
            }
        }
        let _pulling = Pulling { node, id };
        tokio::time::timeout_at(end, transfer(node, id, holders, choice, priority))
            .await
            .unwrap_or_else(|_| Err(late()))
    }
}

/// Marks a transfer of an object under way; dropped, it lets the pulls waiting for it go.
struct Pulling<'a> {
    node: &'a Inner,
    id: ObjectId,
}

impl Drop for Pulling<'_> {
    fn drop(&mut self) {
        self.node.pulling.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// Stops waiting for a request's answers when dropped.
pub(super) struct Registered<'a> {
    pub(super) node: &'a Inner,
    pub(super) req: u32,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.node.forget(self.req);
    }
}

/// Gives back the store room of an object that did not arrive, when dropped armed.
struct Room<'a> {
    node: &'a Inner,
    id: ObjectId,
    size: u64,
    armed: bool,
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.node.store.unreserve(&self.id, self.size);
            self.node.room_freed.notify_waiters();
        }
    }
}

/// How often a transfer waiting for room looks again (a store the application releases
/// objects from directly does not tell the node).
const ROOM_POLL: Duration = Duration::from_millis(50);

impl Inner {
    /// Takes room in the store for object `id` of `size` bytes, waiting up to the node's
    /// `room_wait` for room given back.
    async fn admit(&self, id: &ObjectId, size: u64) -> Result<()> {
        let wait = self.opts.room_wait;
        let end = Instant::now() + wait;
        loop {
            // Made before the look, so that no release is missed.
            let freed = self.room_freed.notified();
            match self.store.reserve(id, size) {
                Err(Error::NoRoom(reason)) => {
                    let now = Instant::now();
                    if now >= end {
                        let waited =
                            if wait.is_zero() { String::new() } else { format!(", still after {wait:?}") };
                        return Err(Error::NoRoom(format!("{reason}{waited}")));
                    }
                    let _ = tokio::time::timeout_at(end.min(now + ROOM_POLL), freed).await;
                }
                r => return r,
            }
        }
    }
}

/// Which holders of a pull serve it first.
#[derive(Clone, Copy, Debug)]
pub(super) struct Choice {
    /// The first this many holders serve the pull; the others stand by until none of
    /// those does (their lookups answered, none serving).
    pub(super) first: usize,
    /// How long the first holders' lookups wait for the object to start arriving there
    /// (relays that may get their own offer later), in milliseconds.
    pub(super) wait_ms: u32,
    /// Whether chunks may pass through relays: the pull is a receiver's part of a
    /// broadcast, or has several holders (some may hold only part of the object yet).
    /// Then a holder reached over a network gets `NodeOptions::network_window` at most.
    pub(super) relayed: bool,
}

impl Choice {
    /// Every holder serves at once; none waits.
    pub(super) fn all(holders: &[Endpoint]) -> Choice {
        Choice { first: holders.len(), wait_ms: 0, relayed: holders.len() > 1 }
    }
}

/// What a holder answered to a lookup.
pub(super) enum Found {
    /// It does not have the object.
    Missing,
    /// The object itself, verified.
    Inline(Vec<u8>),
    /// Its layout, checked.
    Layout(Layout),
}

/// Looks `id` up at every holder; takes the first inline answer or the first layout and
/// fetches the chunks, with the holders that answer the same layout joining in (in the
/// order of `choice`).
async fn transfer(
    node: &Inner,
    id: ObjectId,
    holders: &[Endpoint],
    choice: Choice,
    priority: Priority,
) -> Result<Object> {
    let mut lookups: FuturesUnordered<_> = holders
        .iter()
        .enumerate()
        .map(|(i, h)| -> super::fetch::Boxed<'_, (usize, Result<Found>)> {
            let wait_ms = if i < choice.first { choice.wait_ms } else { 0 };
            Box::pin(async move { (i, lookup(node, id, h, wait_ms).await) })
        })
        .collect();
    let mut last = None;
    let mut unanswered = choice.first.min(holders.len());
    let (first, layout) = loop {
        let Some((i, found)) = lookups.next().await else {
            return Err(last.unwrap_or(Error::NotFound(id)));
        };
        if i < choice.first {
            unanswered -= 1;
        }
        match found {
            Ok(Found::Missing) => {}
            Err(e) => last = Some(e),
            Ok(Found::Layout(layout)) => break (i, layout),
            Ok(Found::Inline(data)) => {
                let layout = Layout::of(&data, chunk_for(data.len() as u64, node.opts.chunk))?;
                let object = match crate::device::dest(&*node.store, &id, data.len() as u64)? {
                    Some(d) => Object::in_device(crate::device::upload(d, &data)?, layout)?,
                    None => Object::new(Bytes::from(data), layout)?,
                };
                return seal(node, id, object);
            }
        }
    };
    node.admit(&id, layout.size()).await?;
    let mut room = Room { node, id, size: layout.size(), armed: true };
    let into = if let Some(buf) = crate::device::dest(&*node.store, &id, layout.size())? {
        Dest::Device(buf)
    } else if let Some(file) = node.store.file_for(&id, layout.size())? {
        Dest::File(file)
    } else {
        Dest::Memory(node.recycler.take(usize::try_from(layout.size()).map_err(|_| {
            Error::Store(format!("an object of {} bytes does not fit in memory", layout.size()))
        })?))
    };
    let mut t = Transfer::new(node, id, holders, layout, into, priority, choice.relayed);
    t.choose(choice.first, unanswered);
    t.found(first);
    let object = t.run(lookups).await?;
    // Sealed while the transfer still publishes its chunks: a relay waiting for one
    // finds the object in the store once the transfer ends. The room goes with the
    // object only when this seal put it in the store.
    let sealed = match node.seal(id, object.clone()) {
        Ok(()) => {
            room.armed = false;
            Ok(object)
        }
        Err(Error::Exists(_)) => node.store.get(&id).ok_or(Error::Exists(id)),
        Err(e) => Err(e),
    };
    drop(t);
    sealed
}

/// How long past its wait a relay's answer to a lookup may take.
const RELAY_ANSWER: Duration = Duration::from_secs(5);

/// Asks `holder` for `id`, waiting up to `wait_ms` for it to start arriving there:
/// missing, inline (checked; fetched again when corrupt, up to the node's tries) or its
/// layout (checked).
async fn lookup(node: &Inner, id: ObjectId, holder: &Endpoint, wait_ms: u32) -> Result<Found> {
    for _ in 0..node.opts.tries {
        let lookup = |req| Msg::Lookup { req, id, inline_max: node.opts.inline_max, wait_ms };
        // A relay that never answers lets the pull turn to the others (the node's
        // deadline bounds the rest).
        let limit = (wait_ms > 0).then(|| Duration::from_millis(u64::from(wait_ms)) + RELAY_ANSWER);
        let what = || format!("a relay's answer about {id}");
        let (msg, m) = node.ask(holder, lookup, Bytes::new(), limit, what).await?;
        match msg {
            Msg::Missing { .. } => return Ok(Found::Missing),
            Msg::Failed { reason, .. } => return Err(Error::Remote(reason)),
            Msg::Inline { sum: want, .. } => {
                if m.len() > node.opts.inline_max as usize {
                    return Err(Error::Protocol(format!(
                        "an inline object of {} bytes, over the {} asked for",
                        m.len(),
                        node.opts.inline_max
                    )));
                }
                let data = payload(m, node.opts.inline_max as usize).await?;
                if sum(&data) == want {
                    return Ok(Found::Inline(data));
                }
                node.refetched.fetch_add(1, Ordering::Relaxed);
            }
            Msg::Layout { size, chunk, .. } => {
                // Checked before the checksums are read (and room made for them).
                let count = chunks(size, chunk).map_err(|e| Error::Protocol(e.to_string()))?;
                if m.len() as u64 != count * 8 {
                    return Err(Error::Protocol(format!("{} bytes of checksums for {size} bytes", m.len())));
                }
                let sums = decode_sums(&payload(m, count as usize * 8).await?)?;
                return Ok(Found::Layout(Layout::from_parts(size, chunk, sums)?));
            }
            other => return Err(Error::Protocol(format!("{other:?} in answer to a lookup"))),
        }
    }
    Err(Error::Corrupt { id, chunk: 0, tries: node.opts.tries })
}

/// A message's payload, read in place or fetched: at most `max` bytes (a longer one is
/// a protocol error, refused before anything is allocated for it).
pub(super) async fn payload(m: AmMessage, max: usize) -> Result<Vec<u8>> {
    let len = m.len();
    if len > max {
        return Err(Error::Protocol(format!("a payload of {len} bytes where at most {max} belong")));
    }
    if let Some(d) = m.data() {
        return Ok(d.to_vec());
    }
    let (r, buf) = m.recv_data(Vec::with_capacity(len)).await;
    r?;
    Ok(buf)
}

/// Seals a verified object in the node's store; one that arrived meanwhile by another
/// way is the one returned.
fn seal(node: &Inner, id: ObjectId, object: Object) -> Result<Object> {
    match node.seal(id, object.clone()) {
        Ok(()) => Ok(object),
        Err(Error::Exists(_)) => node.store.get(&id).ok_or(Error::Exists(id)),
        Err(e) => Err(e),
    }
}
