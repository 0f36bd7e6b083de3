//! The serving side: answers lookups, sends the chunks pullers fetch, and takes the
//! objects peers offer (by pulling them).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use ucxkit_transport::{AmReceiver, Endpoint};

use super::partial::Partial;
use super::{chunk_tag, Inner, ANSWER};
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::Layout;
use crate::wire::{encode_sums, Msg, MAX_FETCH};

/// Serves requests until the node goes. Each request is handled in a task of its own,
/// so a slow puller holds up no other.
pub(super) async fn serve(inner: Weak<Inner>, mut requests: AmReceiver) {
    loop {
        let m = requests.recv().await;
        let Some(node) = inner.upgrade() else { return };
        let msg = match Msg::decode(m.header()) {
            Ok(Msg::Cancel { req }) => {
                if let Some(ep) = m.reply_endpoint() {
                    node.cancel(ep, req);
                }
                continue;
            }
            Ok(msg @ (Msg::Lookup { .. } | Msg::Fetch { .. } | Msg::Offer { .. } | Msg::Hello { .. })) => msg,
            other => {
                tracing::debug!(?other, "malformed request dropped");
                node.malformed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        let Some(ep) = m.reply_endpoint().cloned() else {
            tracing::debug!("a request without a way to answer; dropped");
            node.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        match msg {
            // Registered here, in arrival order, so that a cancel that follows it finds
            // it even before its task runs.
            Msg::Fetch { req, id, first, count, limit_ms } => {
                drop(m);
                let sending = Sending::start(&node, &ep, req);
                tokio::spawn(fetch(node, ep, sending, id, first, count, limit_ms));
            }
            // Its payload names the relays.
            msg @ Msg::Offer { .. } => {
                tokio::spawn(super::push::offered(node, ep, msg, m));
            }
            msg => {
                drop(m);
                tokio::spawn(answer(node, ep, msg));
            }
        }
    }
}

/// Answers a lookup (once the object is here or arriving, or its wait is over) or a
/// hello.
async fn answer(node: Arc<Inner>, ep: Endpoint, msg: Msg) {
    match msg {
        Msg::Lookup { req, id, inline_max, wait_ms } => {
            if wait_ms > 0 {
                node.arriving(&id, Duration::from_millis(u64::from(wait_ms)).min(node.opts.deadline)).await;
            }
            // Inline up to the smaller of the two nodes' limits.
            let inline_max = u64::from(inline_max.min(node.opts.inline_max));
            // Still arriving here: its chunks are relayed as they check out.
            let (reply, payload) = match node.find(&id) {
                Some(Chunks::Arriving(p)) => layout_answer(req, p.layout()),
                Some(Chunks::Sealed(o)) if o.len() as u64 <= inline_max => match read(&o, None).await {
                    Ok(b) => match o.layout().whole_sum(&b) {
                        Some(sum) => (Msg::Inline { req, sum }, b),
                        None => (
                            Msg::Failed { req, reason: format!("{id} changed since it was sealed") },
                            Bytes::new(),
                        ),
                    },
                    Err(reason) => (Msg::Failed { req, reason }, Bytes::new()),
                },
                Some(Chunks::Sealed(o)) => layout_answer(req, o.layout()),
                None => (Msg::Missing { req }, Bytes::new()),
            };
            send_answer(&node, &ep, &reply, payload).await;
        }
        Msg::Hello { req } => {
            let (reply, payload) = match node.listening() {
                Some(a) => (Msg::Address { req }, Bytes::from(a.to_string())),
                None => (
                    Msg::Failed { req, reason: "the node does not listen for receivers".into() },
                    Bytes::new(),
                ),
            };
            send_answer(&node, &ep, &reply, payload).await;
        }
        _ => {}
    }
}

/// Sends chunks `first..first + count` of `id` for the fetch `sending` registered, until
/// they are sent, its puller cancels it, or `limit_ms` passes; answers `Failed` when the
/// object is not here, the range is not in it, or its transfer here failed first.
async fn fetch(
    node: Arc<Inner>,
    ep: Endpoint,
    mut sending: Sending,
    id: ObjectId,
    first: u32,
    count: u32,
    limit_ms: u32,
) {
    let req = sending.key.1;
    let from = match node.find(&id) {
        Some(from) => from,
        None => {
            let reply = Msg::Failed { req, reason: format!("object {id} is no longer held") };
            return send_answer(&node, &ep, &reply, Bytes::new()).await;
        }
    };
    let end = u64::from(first) + u64::from(count);
    if count == 0 || count > MAX_FETCH || end > from.layout().count() {
        let reason = format!("chunks {first}..{end} of an object of {} chunks", from.layout().count());
        return send_answer(&node, &ep, &Msg::Failed { req, reason }, Bytes::new()).await;
    }
    let limit = Duration::from_millis(u64::from(limit_ms));
    let range = u64::from(first)..end;
    tracing::trace!(req, %id, ?range, "fetch");
    let failed = tokio::select! {
        r = tokio::time::timeout(limit, send_chunks(&node, &ep, req, id, &from, range)) => match r {
            Ok(r) => r.err(),
            Err(_) => {
                // The puller is stalled: the sends still pending are cancelled.
                tracing::debug!(req, %id, "chunks not taken within {limit:?}");
                None
            }
        },
        // The puller is done with the request: so are its sends.
        _ = sending.cancelled.wait_for(|c| *c) => None,
    };
    if let Some(reason) = failed {
        send_answer(&node, &ep, &Msg::Failed { req, reason }, Bytes::new()).await;
    }
}

/// Where a fetch's chunks come from: a sealed object, or one still arriving here.
enum Chunks {
    Sealed(Object),
    Arriving(Arc<Partial>),
}

impl Chunks {
    fn layout(&self) -> &Layout {
        match self {
            Chunks::Sealed(o) => o.layout(),
            Chunks::Arriving(p) => p.layout(),
        }
    }
}

/// Sends chunk `k` of `from` for request `req`: a slice of a sealed object; a chunk of
/// one still arriving once it checked out, borrowed for the send (which runs to its end
/// in a task of its own, so that the piece comes back to the transfer even when this
/// fetch is cancelled), or from the store when it was sealed meanwhile.
async fn send_chunk(
    node: &Inner,
    ep: &Endpoint,
    req: u32,
    id: ObjectId,
    from: &Chunks,
    k: u64,
) -> Result<(), String> {
    // A chunk larger than the whole room goes alone.
    let units = |len: usize| super::send_units(len as u64).min(node.send_room);
    let part = match from {
        Chunks::Sealed(o) => o.clone(),
        Chunks::Arriving(p) => match p.lend(k).await {
            Some(piece) => {
                let (p, ns, ep) = (p.clone(), node.ns.clone(), ep.clone());
                let room = node.sends.clone().acquire_many_owned(units(piece.len()));
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let room = room.await;
                    let (r, piece) = ns.tag_send(&ep, chunk_tag(req, k), piece).await;
                    drop(room);
                    p.give_back(k, piece);
                    let _ = tx.send(r);
                });
                return match rx.await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err("the relay's send was dropped".into()),
                };
            }
            None => match node.store.get(&id) {
                Some(o) => o,
                None => return Err(format!("object {id} did not arrive here")),
            },
        },
    };
    let range = part.layout().range(k);
    let room = node.sends.clone().acquire_many_owned(units(range.len())).await;
    if let Some(piece) = crate::device::chunk_of(&part, range) {
        // From device memory, as it is: UCX moves it with its CUDA transports.
        let r = node.ns.tag_send(ep, chunk_tag(req, k), piece.map_err(|e| e.to_string())?).await.0;
        drop(room);
        return r.map_err(|e| e.to_string());
    }
    let bytes = read(&part, k).await?;
    let r = node.ns.tag_send(ep, chunk_tag(req, k), bytes).await.0.map_err(|e| e.to_string());
    drop(room);
    r
}

/// Chunk `k` of sealed object `o` (`None`: all of it): a slice of it in memory, or read
/// from its file on the blocking pool.
async fn read(o: &Object, k: impl Into<Option<u64>>) -> Result<Bytes, String> {
    let range = match k.into() {
        Some(k) => {
            let r = o.layout().range(k);
            r.start as u64..r.end as u64
        }
        None => 0..o.layout().size(),
    };
    if o.bytes().is_some() {
        return o.read(range).map_err(|e| e.to_string());
    }
    let o = o.clone();
    match tokio::task::spawn_blocking(move || o.read(range)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("reading a chunk: {e}")),
    }
}

/// A lookup's answer for an object of layout `l`: the layout, its checksums as payload.
fn layout_answer(req: u32, l: &Layout) -> (Msg, Bytes) {
    (Msg::Layout { req, size: l.size(), chunk: l.chunk() }, encode_sums(l.sums()).into())
}

/// Sends chunks `range` of `from` for request `req`, all at once (the puller posted
/// their receives before it asked, and asks for no more than its window); a chunk still
/// arriving here goes once it checked out. The reason, when the object's transfer here
/// failed first.
async fn send_chunks(
    node: &Inner,
    ep: &Endpoint,
    req: u32,
    id: ObjectId,
    from: &Chunks,
    range: std::ops::Range<u64>,
) -> Result<(), String> {
    let sends = range.map(|k| send_chunk(node, ep, req, id, from, k));
    for r in futures_util::future::join_all(sends).await {
        match r {
            Ok(()) => {
                node.chunks_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(req, %e, "a chunk send failed");
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The key of a request being served: the puller's endpoint (its handle, unique while
/// the endpoint lives, which the serving task keeps) and its request number.
type Key = (usize, u32);

fn key(ep: &Endpoint, req: u32) -> Key {
    (ep.as_raw() as usize, req)
}

/// One fetch of a request being served, registered so that a `Cancel` ends it.
struct Sending {
    node: Arc<Inner>,
    key: Key,
    /// Becomes true when the request is cancelled.
    cancelled: tokio::sync::watch::Receiver<bool>,
}

impl Sending {
    fn start(node: &Arc<Inner>, ep: &Endpoint, req: u32) -> Sending {
        let key = key(ep, req);
        let mut s = node.sending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (tx, n) = s.entry(key).or_insert_with(|| (tokio::sync::watch::channel(false).0, 0));
        *n += 1;
        let cancelled = tx.subscribe();
        drop(s);
        Sending { node: node.clone(), key, cancelled }
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        let mut s = self.node.sending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, n)) = s.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                s.remove(&self.key);
            }
        }
    }
}

impl Inner {
    /// Object `id` as this node has it: arriving, else sealed. The arriving one is
    /// looked at first (a transfer seals before it stops publishing), and the store only
    /// when there is none.
    fn find(&self, id: &ObjectId) -> Option<Chunks> {
        match self.partial_of(id) {
            Some(p) => Some(Chunks::Arriving(p)),
            None => self.store.get(id).map(Chunks::Sealed),
        }
    }

    /// Waits up to `limit` for object `id` to be sealed here or to start arriving, or
    /// until this node gave up on an offer of it.
    async fn arriving(&self, id: &ObjectId, limit: Duration) {
        let end = tokio::time::Instant::now() + limit;
        loop {
            // Made before the look, so that no arrival is missed.
            let arrived = self.arrived.notified();
            if self.store.get(id).is_some() || self.partial_of(id).is_some() {
                return;
            }
            if self.gave_up.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(id)
                || self.unrelayed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(id)
            {
                return;
            }
            if tokio::time::timeout_at(end, arrived).await.is_err() {
                return;
            }
        }
    }

    /// Ends the fetches of request `req` from the puller at `ep`, and any that come for
    /// it later (until the last of them ends).
    fn cancel(&self, ep: &Endpoint, req: u32) {
        let s = self.sending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((tx, _)) = s.get(&key(ep, req)) {
            tx.send_replace(true);
        }
    }
}

/// Sends `reply` (with `payload`) to `ep`; a failure is only logged (the asker's
/// deadline covers it).
pub(super) async fn send_answer(node: &Inner, ep: &Endpoint, reply: &Msg, payload: Bytes) {
    let (r, _) = node.ns.am_send(ep, ANSWER, &reply.encode(), payload).await;
    if let Err(e) = r {
        tracing::debug!(req = reply.req(), %e, "an answer could not be sent");
    }
}
