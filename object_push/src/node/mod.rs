//! [`ObjectNode`]: one worker's objects, served to peers and pulled from them. Requests
//! and answers are active messages of the object namespace ([`crate::wire`]); chunks
//! are tagged messages of it, each received straight into its place in the new
//! object's buffer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use ucxkit_transport::namespace::OBJECT_PUSH;
use ucxkit_transport::{AmMessage, AmSendOptions, Endpoint, Namespace, Worker};

use crate::error::{Error, Result};
use crate::file::ObjectFile;
use crate::id::ObjectId;
use crate::store::{Object, ObjectStore};
use crate::sums::{chunk_for, Layout};
use crate::wire::Msg;

pub use broadcast::Broadcast;
pub use budget::Priority;

mod broadcast;
mod budget;
mod fetch;
mod partial;
mod pull;
mod push;
mod recycle;
mod relay;
mod serve;
mod sink;

/// The active-message id of requests (puller to holder).
const REQUEST: u16 = 0;
/// The active-message id of answers (holder to puller).
const ANSWER: u16 = 1;
/// How many failed offers a node remembers (see `Inner::gave_up`).
const GAVE_UP_KEPT: usize = 64;

/// How a node moves objects.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// The chunk size of the objects this node seals (`put`; larger for objects that
    /// would have over [`crate::sums::MAX_CHUNKS`] chunks); a pulled object keeps its
    /// holder's. Default [`crate::sums::AUTO_CHUNK`]: 1 MiB, doubled while an object
    /// would have over 64 chunks, up to 4 MiB (objects of over 128 MiB).
    pub chunk: u32,
    /// Chunks in flight per holder of a pull. Default 8.
    pub window: u32,
    /// Bytes of chunks in flight per holder that UCX reaches over a network only (no
    /// shared-memory lane), at most, in a transfer whose chunks may pass through relays
    /// (a receiver's part of a broadcast, or a pull from several holders): fewer than
    /// `window` chunks where chunks are large, never less than one. A relay passes a
    /// chunk on only once it arrived, and over TCP a window's chunks arrive together, so
    /// this is what each relay of a broadcast lags. A pull from one holder takes the
    /// whole `window`. Default 8 MiB.
    pub network_window: u64,
    /// Bytes of chunks in flight for all of the node's pulls together (a prefetch uses
    /// at most half). Default 256 MiB.
    pub in_flight: u64,
    /// Objects up to this size come inline in the answer to a lookup. Default 64 KiB.
    pub inline_max: u32,
    /// The deadline of each operation. Default 60 s.
    pub deadline: Duration,
    /// How many times a chunk is fetched before it counts as corrupt. Default 3.
    pub tries: u32,
    /// Bytes of released objects' memory kept for the next pulls (a buffer the kernel
    /// faults in page by page costs more than the transfer into it); allocations under
    /// 1 MiB are not kept. Default 512 MiB; 0 keeps none.
    pub recycle: u64,
    /// What the links to other hosts cost, for [`ObjectNode::broadcast_auto`]. Default
    /// 10 Gbit/s and 50 us, receivers ready at once.
    pub link: crate::LinkCost,
    /// Which chunks are checked against their checksums. Default
    /// [`Verify::OtherHosts`].
    pub verify: Verify,
    /// How long a transfer waits for room in the store (objects released, transfers
    /// failed) before it fails with [`crate::Error::NoRoom`]. Default 5 s.
    pub room_wait: Duration,
    /// Bytes of chunks this node sends at once, to all its pullers together (a chunk
    /// waits for room; one larger than this goes alone). Default 256 MiB.
    pub send_in_flight: u64,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            chunk: crate::sums::AUTO_CHUNK,
            window: 8,
            network_window: 8 << 20,
            in_flight: 256 << 20,
            inline_max: 64 << 10,
            deadline: Duration::from_secs(60),
            tries: 3,
            recycle: 512 << 20,
            room_wait: Duration::from_secs(5),
            verify: Verify::OtherHosts,
            link: crate::LinkCost::network(1.25e9, Duration::from_micros(50)),
            send_in_flight: 256 << 20,
        }
    }
}

/// Which chunks a node checks against the checksums their holder sealed them with
/// before it seals an object (inline objects are always checked). Measured here, the
/// check costs little against a network but a quarter of the time of two receivers
/// pulling one object over shared memory on two cores, where every receiver's copy and
/// check compete for the same cores (docs/objects.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Every chunk.
    Always,
    /// Chunks from holders on other hosts, and from holders whose host is unknown (an
    /// endpoint without ucxkit's handshake); chunks from a holder on this host (another
    /// kernel boot id is another host) are copied by this host's kernel and not checked.
    OtherHosts,
}

impl Verify {
    /// Whether chunks from the holder at `ep` are checked.
    fn checks(self, ep: &ucxkit_transport::Endpoint) -> bool {
        match self {
            Verify::Always => true,
            Verify::OtherHosts => !ep.peer_identity().is_some_and(|p| p.same_host()),
        }
    }
}

/// Whether UCX reaches `ep` without a network: one of its lanes is a transport within
/// one host (shared memory, the process itself, a device's IPC); false where the lanes
/// cannot be read. (The boot id says only that the peer shares this kernel: hosts in
/// network namespaces do, and may be reached over TCP only.)
fn without_network(ep: &Endpoint) -> bool {
    const LOCAL: [&str; 8] = ["posix", "sysv", "cma", "xpmem", "knem", "self", "cuda_ipc", "rocm_ipc"];
    ep.lanes().is_ok_and(|lanes| lanes.iter().any(|l| LOCAL.contains(&l.transport.as_str())))
}

/// How far a transfer has come ([`ObjectNode::progress`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes received and checked.
    pub done: u64,
    /// The object's size.
    pub size: u64,
}

/// What a node counted since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Malformed messages dropped (requests and answers).
    pub malformed: u64,
    /// Chunks that arrived corrupt and were fetched again.
    pub refetched: u64,
    /// Answers that came for no request waiting (late, after a deadline).
    pub stray: u64,
    /// Bytes of released objects' memory kept for the next pulls.
    pub kept: u64,
    /// Chunks sent to pullers.
    pub chunks_sent: u64,
    /// Holders that failed in the middle of a pull (their chunks went to others).
    pub holders_failed: u64,
    /// Bytes of chunks on the way to this node now.
    pub in_flight: u64,
    /// Requests whose chunks this node is sending now.
    pub serving: u64,
}

/// One worker's objects: serves the objects of its [`ObjectStore`] to the peers that ask
/// and pulls objects from peers into it. Made inside a tokio runtime (it runs two tasks,
/// which end when the node is dropped).
pub struct ObjectNode {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// A request being served: its cancel signal and how many of its fetches are under way.
type Serving = (tokio::sync::watch::Sender<bool>, usize);

/// What the node's tasks and calls share.
struct Inner {
    ns: Namespace,
    store: Arc<dyn ObjectStore>,
    opts: NodeOptions,
    recycler: recycle::Recycler,
    budget: budget::Budget,
    next_req: AtomicU32,
    /// Room for the chunks this node sends at once, in KiB ([`send_units`]).
    sends: Arc<tokio::sync::Semaphore>,
    /// The whole of that room, in the same units.
    send_room: u32,
    /// Woken whenever store room is given back through the node.
    room_freed: tokio::sync::Notify,
    /// The transfers into this node: bytes checked, and the object's size.
    progress: Mutex<HashMap<ObjectId, (Arc<AtomicU64>, u64)>>,
    /// Objects arriving into files now (not relayed while they arrive).
    unrelayed: Mutex<std::collections::HashSet<ObjectId>>,
    /// Woken whenever an object is sealed here or starts arriving.
    arrived: tokio::sync::Notify,
    /// The endpoints kept for relaying.
    links: Mutex<relay::Links>,
    /// Objects whose offer this node took and failed lately (so that receivers waiting
    /// for it to relay them stop waiting), the last [`GAVE_UP_KEPT`].
    gave_up: Mutex<std::collections::VecDeque<ObjectId>>,
    /// The address this node listens on for receivers ([`ObjectNode::listen`]).
    listening: std::sync::OnceLock<std::net::SocketAddr>,
    /// The objects this node is receiving, served to others as their chunks arrive.
    partial: partial::Partials,
    /// The objects a pull is moving now, each with the signal its waiting pulls watch.
    pulling: Mutex<HashMap<ObjectId, tokio::sync::watch::Sender<()>>>,
    /// The requests being served, by puller endpoint and number: their cancel signal and
    /// how many fetches of each are under way.
    sending: Mutex<HashMap<(usize, u32), Serving>>,
    /// Requests waiting for their answer, by number.
    waiting: Mutex<HashMap<u32, oneshot::Sender<(Msg, AmMessage)>>>,
    malformed: AtomicU64,
    refetched: AtomicU64,
    stray: AtomicU64,
    chunks_sent: AtomicU64,
    holders_failed: AtomicU64,
}

impl ObjectNode {
    /// A node on `worker` (claiming its object namespace) over `store`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for options out of range; the transport's error
    /// when the namespace is taken.
    pub fn new(worker: &Worker, store: Arc<dyn ObjectStore>, opts: NodeOptions) -> Result<ObjectNode> {
        if opts.chunk != crate::sums::AUTO_CHUNK {
            crate::sums::chunks(0, opts.chunk)?;
        }
        if opts.window == 0 || opts.tries == 0 {
            return Err(crate::Error::InvalidArgument("window and tries must be at least 1".into()));
        }
        if opts.send_in_flight == 0 {
            return Err(crate::Error::InvalidArgument("send_in_flight must be at least 1".into()));
        }
        let sends = send_units(opts.send_in_flight);
        let ns = worker.namespace(OBJECT_PUSH)?;
        let requests = ns.am_recv(REQUEST)?;
        let answers = ns.am_recv(ANSWER)?;
        let inner = Arc::new(Inner {
            ns,
            store,
            recycler: recycle::Recycler::new(opts.recycle, recycle::MIN_KEPT),
            budget: budget::Budget::new(opts.in_flight),
            opts,
            next_req: AtomicU32::new(rand_start()),
            pulling: Mutex::default(),
            partial: Mutex::default(),
            arrived: tokio::sync::Notify::new(),
            unrelayed: Mutex::default(),
            progress: Mutex::default(),
            sends: Arc::new(tokio::sync::Semaphore::new(sends as usize)),
            send_room: sends,
            room_freed: tokio::sync::Notify::new(),
            links: Mutex::default(),
            gave_up: Mutex::default(),
            listening: std::sync::OnceLock::new(),
            sending: Mutex::default(),
            waiting: Mutex::default(),
            malformed: AtomicU64::new(0),
            refetched: AtomicU64::new(0),
            stray: AtomicU64::new(0),
            chunks_sent: AtomicU64::new(0),
            holders_failed: AtomicU64::new(0),
        });
        let tasks = vec![
            tokio::spawn(serve::serve(Arc::downgrade(&inner), requests)),
            tokio::spawn(route(Arc::downgrade(&inner), answers)),
        ];
        Ok(ObjectNode { inner, tasks: Mutex::new(tasks) })
    }

    /// Seals `bytes` as object `id` in this node's store, cut in chunks of the node's
    /// chunk size; peers can pull it from now on.
    ///
    /// # Errors
    /// [`crate::Error::Exists`] when `id` is held; the store's refusal.
    pub fn put(&self, id: ObjectId, bytes: Bytes) -> Result<Object> {
        let layout = Layout::of(&bytes, chunk_for(bytes.len() as u64, self.inner.opts.chunk))?;
        let object = Object::new(bytes, layout)?;
        self.inner.seal_new(id, object.clone())?;
        Ok(object)
    }

    /// Seals the file at `path` as object `id`: its bytes stay in the file (read chunk
    /// by chunk when served; the file is kept when the object goes), its checksums are
    /// computed here, on the blocking pool.
    ///
    /// # Errors
    /// [`crate::Error::Store`] when the file cannot be read; [`crate::Error::Exists`]
    /// when `id` is held; the store's refusal.
    pub async fn put_file(&self, id: ObjectId, path: impl Into<std::path::PathBuf>) -> Result<Object> {
        let file = ObjectFile::open(path)?;
        let chunk = chunk_for(file.len(), self.inner.opts.chunk);
        let summed = tokio::task::spawn_blocking(move || -> Result<(ObjectFile, Layout)> {
            let (size, step) = (file.len(), u64::from(chunk));
            let sums = (0..crate::sums::chunks(size, chunk)?)
                .map(|k| file.read(k * step..size.min((k + 1) * step)).map(|b| crate::sums::sum(&b)))
                .collect::<Result<Vec<u64>>>()?;
            Ok((file, Layout::from_parts(size, chunk, sums)?))
        })
        .await
        .map_err(|e| crate::Error::Store(format!("summing a file: {e}")))?;
        let (file, layout) = summed?;
        let object = Object::in_file(file, layout)?;
        self.inner.seal_new(id, object.clone())?;
        Ok(object)
    }

    /// Seals device buffer `buf` as object `id` (feature `cuda`): served from device
    /// memory (see [`crate::device`]); its checksums are computed here, chunk by chunk
    /// from copies on the host, on the blocking pool.
    ///
    /// # Errors
    /// [`crate::Error::Store`] when the device memory cannot be read;
    /// [`crate::Error::Exists`] when `id` is held; the store's refusal.
    #[cfg(feature = "cuda")]
    pub async fn put_device(&self, id: ObjectId, buf: crate::device::DeviceBuf) -> Result<Object> {
        let chunk = chunk_for(buf.len() as u64, self.inner.opts.chunk);
        let b = buf.clone();
        let layout = tokio::task::spawn_blocking(move || -> Result<Layout> {
            let (size, step) = (b.len() as u64, u64::from(chunk));
            let sums = (0..crate::sums::chunks(size, chunk)?)
                .map(|k| {
                    let range = (k * step) as usize..size.min((k + 1) * step) as usize;
                    let bytes = crate::device::host_copy(&crate::device::piece_of(&b, range)?)?;
                    Ok(crate::sums::sum(&bytes))
                })
                .collect::<Result<Vec<u64>>>()?;
            Layout::from_parts(size, chunk, sums)
        })
        .await
        .map_err(|e| crate::Error::Store(format!("summing a device buffer: {e}")))??;
        let object = Object::on_device(buf, layout)?;
        self.inner.seal_new(id, object.clone())?;
        Ok(object)
    }

    /// Waits until object `id` is in this node's store (sealed by a pull, a peer's
    /// push or `put`), at most `limit`.
    ///
    /// # Errors
    /// [`crate::Error::DeadlineExceeded`] when it has not arrived within `limit`.
    pub async fn wait(&self, id: ObjectId, limit: Duration) -> Result<Object> {
        let end = tokio::time::Instant::now() + limit;
        loop {
            // Made before the look, so that no seal is missed.
            let sealed = self.inner.arrived.notified();
            if let Some(o) = self.inner.store.get(&id) {
                return Ok(o);
            }
            if tokio::time::timeout_at(end, sealed).await.is_err() {
                return Err(crate::Error::DeadlineExceeded { what: format!("wait for object {id}"), limit });
            }
        }
    }

    /// The sealed object `id`, if this node holds it.
    pub fn get(&self, id: &ObjectId) -> Option<Object> {
        self.inner.store.get(id)
    }

    /// Forgets object `id`; whether it was held. Its memory is kept for the next pulls
    /// (see [`NodeOptions::recycle`]) once nothing else holds its bytes.
    pub fn release(&self, id: &ObjectId) -> bool {
        match self.inner.store.release(id) {
            Some(o) => {
                if let Some(bytes) = o.into_bytes() {
                    self.inner.recycler.give(bytes);
                }
                self.inner.room_freed.notify_waiters();
                true
            }
            None => false,
        }
    }

    /// The node's options.
    pub fn options(&self) -> &NodeOptions {
        &self.inner.opts
    }

    /// How far the transfer of object `id` into this node has come, while one is under
    /// way: bytes received and checked, of the object's size.
    pub fn progress(&self, id: &ObjectId) -> Option<Progress> {
        let p = self.inner.progress.lock().unwrap_or_else(PoisonError::into_inner);
        p.get(id).map(|(done, size)| Progress { done: done.load(Ordering::Relaxed), size: *size })
    }

    /// What the node counted.
    pub fn stats(&self) -> NodeStats {
        let i = &self.inner;
        NodeStats {
            malformed: i.malformed.load(Ordering::Relaxed),
            refetched: i.refetched.load(Ordering::Relaxed),
            stray: i.stray.load(Ordering::Relaxed),
            kept: i.recycler.held(),
            chunks_sent: i.chunks_sent.load(Ordering::Relaxed),
            holders_failed: i.holders_failed.load(Ordering::Relaxed),
            in_flight: i.budget.used(),
            serving: i.sending.lock().unwrap_or_else(PoisonError::into_inner).len() as u64,
        }
    }
}

impl Drop for ObjectNode {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().unwrap_or_else(PoisonError::into_inner).iter() {
            t.abort();
        }
    }
}

impl Inner {
    /// Seals an object the application gives (`put`, `put_file`): in room of its own,
    /// so that it never takes the room a transfer of the same id reserved (the store
    /// refuses it while one is under way).
    fn seal_new(&self, id: ObjectId, object: Object) -> Result<()> {
        let size = object.len() as u64;
        self.store.reserve(&id, size).map_err(|e| match e {
            crate::Error::NoRoom(r) => crate::Error::Store(r),
            e => e,
        })?;
        self.seal(id, object).inspect_err(|_| self.store.unreserve(&id, size))
    }

    /// Seals `object` as `id` in the store and wakes the node's waiters ([`ObjectNode::wait`]).
    fn seal(&self, id: ObjectId, object: Object) -> Result<()> {
        self.store.seal(id, object)?;
        self.arrived.notify_waiters();
        Ok(())
    }

    /// The object `id` as it arrives here, while it does.
    fn partial_of(&self, id: &ObjectId) -> Option<Arc<partial::Partial>> {
        self.partial.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }

    /// A fresh request number, registered to receive its answers.
    fn register(&self) -> (u32, oneshot::Receiver<(Msg, AmMessage)>) {
        let mut w = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let req = self.next_req.fetch_add(1, Ordering::Relaxed);
            if let std::collections::hash_map::Entry::Vacant(e) = w.entry(req) {
                let (tx, rx) = oneshot::channel();
                e.insert(tx);
                return (req, rx);
            }
        }
    }

    /// Stops waiting for request `req`'s answer.
    fn forget(&self, req: u32) {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).remove(&req);
    }

    /// Sends the request `msg(req)` with `payload` to `peer` and waits for its answer:
    /// up to `limit` where one is given (`what` then names the wait in the error), and
    /// only while `peer`'s endpoint works (a peer that died or went silent answers
    /// nothing: its failure ends the wait).
    pub(super) async fn ask(
        &self,
        peer: &Endpoint,
        msg: impl FnOnce(u32) -> Msg,
        payload: Bytes,
        limit: Option<Duration>,
        what: impl FnOnce() -> String,
    ) -> Result<(Msg, AmMessage)> {
        let (req, answer) = self.register();
        let _registered = pull::Registered { node: self, req };
        let opts = AmSendOptions { reply: true, ..Default::default() };
        let (r, _) = self.ns.am_send_with(peer, REQUEST, &msg(req).encode(), payload, opts).await;
        r?;
        let answer = async {
            tokio::select! {
                a = answer => a.map_err(|_| Error::Remote("the node is closing".into())),
                source = peer.failed() => Err(Error::Transport(ucxkit_transport::Error::ConnectionReset {
                    op: "an object request",
                    peer: peer.peer().clone(),
                    source,
                })),
            }
        };
        match limit {
            None => answer.await,
            Some(limit) => tokio::time::timeout(limit, answer)
                .await
                .map_err(|_| Error::DeadlineExceeded { what: what(), limit })?,
        }
    }
}

/// The send room's units (KiB) for `bytes`: at least one, at most `u32::MAX` (what one
/// acquisition of a semaphore takes, and well within what it holds).
fn send_units(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).max(1)
}

/// A request numbering that starts somewhere else in every process, so a peer's late
/// answer to a process that came before rarely meets a new request.
fn rand_start() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (t.subsec_nanos() ^ std::process::id().rotate_left(16)).wrapping_mul(0x9e37_79b9)
}

/// Hands each answer to the request waiting for it; drops malformed and stray ones.
async fn route(inner: std::sync::Weak<Inner>, mut answers: ucxkit_transport::AmReceiver) {
    loop {
        let m = answers.recv().await;
        let Some(inner) = inner.upgrade() else { return };
        let msg = match Msg::decode(m.header()) {
            Ok(
                msg @ (Msg::Missing { .. }
                | Msg::Inline { .. }
                | Msg::Layout { .. }
                | Msg::Done { .. }
                | Msg::Address { .. }
                | Msg::Failed { .. }),
            ) => msg,
            Ok(other) => {
                tracing::debug!(?other, "a request where an answer belongs; dropped");
                inner.malformed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(e) => {
                tracing::debug!(%e, "malformed answer dropped");
                inner.malformed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        let waiter = inner.waiting.lock().unwrap_or_else(PoisonError::into_inner).remove(&msg.req());
        match waiter {
            Some(tx) => {
                let _ = tx.send((msg, m));
            }
            None => {
                inner.stray.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The tag of chunk `k` of request `req` (request in the high 32 of the namespace's 56
/// bits, chunk index in the low 24).
fn chunk_tag(req: u32, k: u64) -> u64 {
    (u64::from(req) << 24) | (k & 0xff_ffff)
}
