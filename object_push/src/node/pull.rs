//! The puller's side: looks the object up, then fetches its chunks a window at a time,
//! each received straight into its place in the object's buffer and checked against
//! the holder's checksum before the object is sealed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{AmMessage, Endpoint, ErrorKind};

use super::{chunk_tag, Inner, ObjectNode, REQUEST};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::{chunk_for, Layout, MAX_CHUNK, MAX_CHUNKS, MIN_CHUNK};
use crate::wire::{decode_sums, Msg};

impl ObjectNode {
    /// Pulls object `id` from `holder` into this node's store and returns it; an object
    /// the store holds already is returned at once. Every chunk is checked against the
    /// holder's checksum (a corrupt one is fetched again, up to the node's `tries`)
    /// before the object is sealed.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the holder does not have it; [`Error::DeadlineExceeded`]
    /// past the node's deadline; [`Error::Corrupt`] for a chunk corrupt on every try;
    /// [`Error::Protocol`] for a malformed answer; the store's refusal (no room); the
    /// transport's errors (the holder gone).
    pub async fn pull(&self, id: ObjectId, holder: &Endpoint) -> Result<Object> {
        if let Some(o) = self.inner.store.get(&id) {
            return Ok(o);
        }
        let limit = self.inner.opts.deadline;
        match tokio::time::timeout(limit, pull(&self.inner, id, holder, limit)).await {
            Ok(r) => r,
            Err(_) => Err(Error::DeadlineExceeded { what: format!("pull of object {id}"), limit }),
        }
    }
}

/// Stops waiting for a request's answers when dropped.
struct Registered<'a> {
    node: &'a Inner,
    req: u32,
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
        }
    }
}

async fn pull(node: &Inner, id: ObjectId, holder: &Endpoint, limit: Duration) -> Result<Object> {
    for _ in 0..node.opts.tries {
        let (req, answer) = node.register();
        let _registered = Registered { node, req };
        let lookup = Msg::Lookup { req, id, inline_max: node.opts.inline_max };
        let opts = AmSendOptions { reply: true, ..Default::default() };
        let (r, _) = node.ns.am_send_with(holder, REQUEST, &lookup.encode(), Bytes::new(), opts).await;
        r?;
        let (msg, m) = answer.await.map_err(|_| Error::Remote("the node is closing".into()))?;
        match msg {
            Msg::Missing { .. } => return Err(Error::NotFound(id)),
            Msg::Failed { reason, .. } => return Err(Error::Remote(reason)),
            Msg::Inline { sum, .. } => {
                if m.len() > node.opts.inline_max as usize {
                    return Err(Error::Protocol(format!(
                        "an inline object of {} bytes, over the {} asked for",
                        m.len(),
                        node.opts.inline_max
                    )));
                }
                let data = payload(m).await?;
                if crate::sums::sum(&data) != sum {
                    node.refetched.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let layout = Layout::of(&data, chunk_for(data.len() as u64, node.opts.chunk))?;
                return seal(node, id, Object::new(Bytes::from(data), layout)?);
            }
            Msg::Layout { size, chunk, .. } => {
                if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) || size.div_ceil(u64::from(chunk)) > MAX_CHUNKS {
                    return Err(Error::Protocol(format!("a layout of {size} bytes in chunks of {chunk}")));
                }
                if m.len() as u64 != size.div_ceil(u64::from(chunk)) * 8 {
                    return Err(Error::Protocol(format!("{} bytes of checksums for {size} bytes", m.len())));
                }
                let layout = Layout::from_parts(size, chunk, decode_sums(&payload(m).await?)?)?;
                return chunked(node, id, holder, layout, limit).await;
            }
            other => return Err(Error::Protocol(format!("{other:?} in answer to a lookup"))),
        }
    }
    Err(Error::Corrupt { id, chunk: 0, tries: node.opts.tries })
}

/// An answer's payload, read in place or fetched.
async fn payload(m: AmMessage) -> Result<Vec<u8>> {
    if let Some(d) = m.data() {
        return Ok(d.to_vec());
    }
    let len = m.len();
    let (r, buf) = m.recv_data(Vec::with_capacity(len)).await;
    r?;
    Ok(buf)
}

/// Seals a verified object in the node's store; one that arrived meanwhile by another
/// way is the one returned.
fn seal(node: &Inner, id: ObjectId, object: Object) -> Result<Object> {
    match node.store.seal(id, object.clone()) {
        Ok(()) => Ok(object),
        Err(Error::Exists(_)) => node.store.get(&id).ok_or(Error::Exists(id)),
        Err(e) => Err(e),
    }
}

/// Fetches the chunks of an object of `layout` from `holder` into a buffer of its size,
/// a window at a time, and seals it. Each chunk lands in its own piece of the buffer
/// (split off in order, joined back without a copy) and is checked on the blocking
/// pool while the next chunks arrive: the receiving thread also does the copy (the
/// transports on one host copy in the receiver's kernel call), so a check there would
/// delay the transfer by its own time.
async fn chunked(
    node: &Inner,
    id: ObjectId,
    holder: &Endpoint,
    layout: Layout,
    limit: Duration,
) -> Result<Object> {
    let size = usize::try_from(layout.size())
        .map_err(|_| Error::Store(format!("an object of {} bytes does not fit in memory", layout.size())))?;
    node.store.reserve(&id, layout.size())?;
    let mut room = Room { node, id, size: layout.size(), armed: true };
    let (req, mut failed) = node.register();
    let _registered = Registered { node, req };
    let layout = Arc::new(layout);
    // A new Bytes has no other owner: it becomes mutable without a copy.
    let whole = Bytes::from(node.recycler.take(size));
    let mut rest = whole.try_into_mut().unwrap_or_else(|b| BytesMut::from(&b[..]));
    let (count, window) = (layout.count(), u64::from(node.opts.window));
    let limit_ms = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
    let mut pieces: Vec<Option<BytesMut>> = (0..count).map(|_| None).collect();
    let mut tries: HashMap<u64, u32> = HashMap::new();
    let (mut receiving, mut checking) = (FuturesUnordered::new(), FuturesUnordered::new());
    let (mut next, mut done) = (0u64, 0u64);
    let post = |k: u64, piece: BytesMut| {
        let recv = node.ns.tag_recv_from(holder, chunk_tag(req, k), EXACT, piece);
        async move { (k, recv.await) }
    };
    while done < count {
        // Refill the window once half of it is free (or the rest is less).
        let free = window.saturating_sub((receiving.len() + checking.len()) as u64);
        if next < count && (free * 2 >= window || count - next <= free) && free > 0 {
            let n = free.min(count - next);
            for k in next..next + n {
                receiving.push(post(k, rest.split_to(layout.range(k).len())));
            }
            fetch(node, holder, req, id, next, n, limit_ms).await?;
            next += n;
        }
        tokio::select! {
            Some((k, (r, piece))) = receiving.next() => {
                let info = r.map_err(|e| match e.kind() {
                    ErrorKind::Truncated => Error::Protocol(format!("chunk {k} longer than its layout")),
                    _ => Error::Transport(e),
                })?;
                if info.len != layout.range(k).len() {
                    return Err(Error::Protocol(format!("chunk {k} of {} bytes, not {}", info.len, layout.range(k).len())));
                }
                let layout = layout.clone();
                checking.push(tokio::task::spawn_blocking(move || (k, layout.verify(k, &piece), piece)));
            }
            Some(checked) = checking.next() => {
                let (k, good, piece) = checked.map_err(|e| Error::Store(format!("checking a chunk: {e}")))?;
                if good {
                    pieces[k as usize] = Some(piece);
                    done += 1;
                    continue;
                }
                let t = tries.entry(k).or_insert(1);
                if *t >= node.opts.tries {
                    return Err(Error::Corrupt { id, chunk: k, tries: *t });
                }
                *t += 1;
                node.refetched.fetch_add(1, Ordering::Relaxed);
                receiving.push(post(k, piece));
                fetch(node, holder, req, id, k, 1, limit_ms).await?;
            }
            answer = &mut failed => {
                return Err(match answer {
                    Ok((Msg::Failed { reason, .. }, _)) => Error::Remote(reason),
                    Ok((other, _)) => Error::Protocol(format!("{other:?} during a fetch")),
                    Err(_) => Error::Remote("the node is closing".into()),
                });
            }
        }
    }
    drop(rest);
    // The pieces, joined in order: adjacent parts of one buffer, so no copy.
    let mut whole = BytesMut::new();
    for p in pieces.into_iter().flatten() {
        whole.unsplit(p);
    }
    let object = Object::new(whole.freeze(), Arc::unwrap_or_clone(layout))?;
    room.armed = false;
    seal(node, id, object)
}

/// Asks `holder` for chunks `first..first + n` of request `req`.
async fn fetch(
    node: &Inner,
    holder: &Endpoint,
    req: u32,
    id: ObjectId,
    first: u64,
    n: u64,
    limit_ms: u32,
) -> Result<()> {
    // Both fit: indexes stay below MAX_CHUNKS (2^24).
    let msg = Msg::Fetch { req, id, first: first as u32, count: n as u32, limit_ms };
    let opts = AmSendOptions { reply: true, ..Default::default() };
    let (r, _) = node.ns.am_send_with(holder, REQUEST, &msg.encode(), Bytes::new(), opts).await;
    Ok(r?)
}
