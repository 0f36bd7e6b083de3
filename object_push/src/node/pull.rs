//! The puller's side: looks the object up, then fetches its chunks a window at a time,
//! each received straight into its place in the object's buffer and checked against
//! the holder's checksum before the object is sealed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{AmMessage, Endpoint, SharedBuf};

use super::{chunk_tag, Inner, ObjectNode, REQUEST};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::{Layout, MAX_CHUNK, MAX_CHUNKS, MIN_CHUNK};
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
                if crc32c::crc32c(&data) != sum {
                    node.refetched.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let layout = Layout::of(&data, node.opts.chunk)?;
                return seal(node, id, Object::new(Bytes::from(data), layout)?);
            }
            Msg::Layout { size, chunk, .. } => {
                if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) || size.div_ceil(u64::from(chunk)) > MAX_CHUNKS {
                    return Err(Error::Protocol(format!("a layout of {size} bytes in chunks of {chunk}")));
                }
                if m.len() as u64 != size.div_ceil(u64::from(chunk)) * 4 {
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
/// a window at a time, and seals it.
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
    let mut buf = SharedBuf::tracked(vec![0u8; size]);
    let (count, window) = (layout.count(), u64::from(node.opts.window));
    let limit_ms = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
    let mut tries: HashMap<u64, u32> = HashMap::new();
    let mut inflight = FuturesUnordered::new();
    let (mut next, mut done) = (0u64, 0u64);
    let post = |k: u64, buf: &SharedBuf<u8>| -> Result<_> {
        let slice = buf.slice(layout.range(k))?;
        let recv = node.ns.tag_recv_from(holder, chunk_tag(req, k), EXACT, slice);
        Ok(async move { (k, recv.await) })
    };
    while done < count {
        // Refill the window once half of it is free (or the rest is less).
        let free = window - inflight.len() as u64;
        if next < count && (free * 2 >= window || count - next <= free) {
            let n = free.min(count - next);
            for k in next..next + n {
                inflight.push(post(k, &buf)?);
            }
            fetch(node, holder, req, id, next, n, limit_ms).await?;
            next += n;
        }
        let (k, (r, slice)) = tokio::select! {
            Some(landed) = inflight.next() => landed,
            answer = &mut failed => {
                return Err(match answer {
                    Ok((Msg::Failed { reason, .. }, _)) => Error::Remote(reason),
                    Ok((other, _)) => Error::Protocol(format!("{other:?} during a fetch")),
                    Err(_) => Error::Remote("the node is closing".into()),
                });
            }
        };
        drop(slice);
        let info = r.map_err(|e| match e.kind() {
            ucxkit_transport::ErrorKind::Truncated => {
                Error::Protocol(format!("chunk {k} longer than its layout"))
            }
            _ => Error::Transport(e),
        })?;
        let range = layout.range(k);
        if info.len != range.len() {
            return Err(Error::Protocol(format!("chunk {k} of {} bytes, not {}", info.len, range.len())));
        }
        let view = buf.view_range(range).ok_or_else(|| Error::Protocol(format!("chunk {k} twice")))?;
        if layout.verify(k, view) {
            done += 1;
            continue;
        }
        let t = tries.entry(k).or_insert(1);
        if *t >= node.opts.tries {
            return Err(Error::Corrupt { id, chunk: k, tries: *t });
        }
        *t += 1;
        node.refetched.fetch_add(1, Ordering::Relaxed);
        inflight.push(post(k, &buf)?);
        fetch(node, holder, req, id, k, 1, limit_ms).await?;
    }
    drop(inflight);
    let bytes = buf.try_into_vec().map_err(|_| Error::Protocol("a chunk still being received".into()))?;
    let object = Object::new(Bytes::from(bytes), layout)?;
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
