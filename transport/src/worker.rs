//! [`Worker`]: a UCX worker (`ucp_worker_h`), its lock, its in-flight bookkeeping and its
//! progress driver.
//!
//! # Thread model
//! Workers are created with `UCS_THREAD_MODE_SERIALIZED` and every UCX call on a worker,
//! its endpoints and its listeners is made while holding that worker's mutex. Completion
//! callbacks run inside those calls, so they too run under the lock; they only record
//! results and collect wakers, which are woken after the lock is released. Hence
//! [`Worker`] and everything made from it is `Send + Sync` and usable from a multi-thread
//! tokio runtime.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::address::WorkerAddress;
use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, Status};
use crate::handshake::{self, Kind, Message, NackReason};
use crate::identity::ProcessIdentity;
use crate::lock::RawLock;
use crate::progress::{self, ProgressMode};
use crate::request::{self, Slot};
use crate::ucx_log;

/// How endpoints handle a failed peer (`ucp_err_handling_mode_t`), applied on both sides
/// of a connection, accepted endpoints included.
///
/// UCX 1.13's shared-memory transports (posix, sysv, cma) have no peer-failure support:
/// with [`ErrorMode::Peer`], two processes on one host talk over TCP loopback instead
/// (about 3× the latency and a fraction of the bandwidth). [`ErrorMode::None`] keeps
/// shared memory; ucxkit then watches a same-host peer process itself (see
/// [`crate::liveness`]), so pending operations still fail when it dies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorMode {
    /// The default: [`ErrorMode::None`] when shared memory can carry the connection (the
    /// peer runs on this host, and both contexts have a shared-memory transport that
    /// carries messages, see [`crate::Context::has_shared_memory`]), [`ErrorMode::Peer`]
    /// otherwise: without a shared-memory lane, UCX's own failure handling loses
    /// nothing, and UCX 1.13 without it can abort a process whose peer dies during a
    /// transfer over TCP. Both sides reach the same choice. Through a listener and by
    /// worker address, "on this host" is what the peer says of itself (same boot id and
    /// pid namespace: two network namespaces of one machine share memory); connecting to
    /// a listener without the handshake, the IP decides (an address of this process's
    /// network namespace).
    #[default]
    Auto,
    /// `UCP_ERR_HANDLING_MODE_PEER`: UCX detects failed peers and fails their
    /// operations; transports without failure support (shared memory) are not used.
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: every transport is allowed. A failed peer on this
    /// host is detected by ucxkit's pidfd watch (needs the handshake); a failed remote
    /// peer is not detected, so use [`ErrorMode::Peer`] for remote peers.
    None,
}

impl ErrorMode {
    /// Resolves `Auto` given whether shared memory can carry the connection (the peer
    /// is on this host and both sides have a shared-memory transport); true means UCX
    /// peer mode.
    pub(crate) fn peer_mode(self, shared_memory: bool) -> bool {
        match self {
            ErrorMode::Auto => !shared_memory,
            ErrorMode::Peer => true,
            ErrorMode::None => false,
        }
    }
}

/// Options for connecting or accepting an endpoint.
#[derive(Clone, Debug)]
pub struct EndpointOptions {
    /// Error handling for the endpoint (default [`ErrorMode::Auto`]).
    pub error_mode: ErrorMode,
    /// Run ucxkit's connection handshake (default true). Turn it off to talk to plain UCX
    /// programs: tagged messages, active messages, streams and remote memory are then
    /// wire-compatible with any UCX application, but no liveness watch runs. Without it,
    /// connecting and accepting through a listener still return only once UCX has wired
    /// the endpoint up (a flush: the peer has to progress its worker), since UCX 1.13
    /// can abort on operations posted before that; connecting to a worker address
    /// returns at once, before the peer is known to exist.
    pub handshake: bool,
    /// How long connecting or accepting may take: the handshake, or without it the
    /// wire-up through a listener (default 10 s).
    pub timeout: Duration,
    /// Transports the endpoint must use (for example `["posix"]` or `["rc_mlx5"]`),
    /// checked once it is connected (see [`crate::Endpoint::transports`]): when UCX did
    /// not pick one of them, connecting or accepting fails with
    /// [`crate::Error::MissingTransport`] instead of silently running over something
    /// slower. Empty (the default) requires nothing.
    pub require_transports: Vec<String>,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            error_mode: ErrorMode::Auto,
            handshake: true,
            timeout: Duration::from_secs(10),
            require_transports: Vec::new(),
        }
    }
}

/// Builds a [`Worker`]. Obtained from [`Context::worker`].
#[derive(Clone, Debug)]
pub struct WorkerBuilder {
    ctx: Context,
    mode: ProgressMode,
    endpoint: EndpointOptions,
    no_imm: bool,
    linger: Duration,
}

impl WorkerBuilder {
    pub(crate) fn new(ctx: Context) -> Self {
        WorkerBuilder {
            ctx,
            mode: ProgressMode::Event,
            endpoint: EndpointOptions::default(),
            no_imm: false,
            linger: progress::DEFAULT_LINGER,
        }
    }

    /// Event mode: how long the driver keeps progressing the worker after the last event
    /// before it arms the event fd and sleeps (default [`crate::DEFAULT_LINGER`]; zero
    /// sleeps at once). An answer that arrives within the linger is picked up without a
    /// sleep and a wake-up, which cost several microseconds each; the price is at most
    /// this much CPU time after each burst of traffic. An idle worker uses no CPU.
    pub fn event_linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How the worker makes progress (default [`ProgressMode::Event`]).
    pub fn progress_mode(mut self, mode: ProgressMode) -> Self {
        self.mode = mode;
        self
    }

    /// Default options for endpoints this worker connects and accepts.
    pub fn endpoint_options(mut self, opts: EndpointOptions) -> Self {
        self.endpoint = opts;
        self
    }

    /// Default error mode for this worker's endpoints.
    pub fn error_mode(mut self, mode: ErrorMode) -> Self {
        self.endpoint.error_mode = mode;
        self
    }

    /// Diagnostics: make every operation take UCX's request path even when it could
    /// complete at once (`UCP_OP_ATTR_FLAG_NO_IMM_CMPL`). Slower; used by tests. The
    /// borrowing sends that only complete at once
    /// ([`crate::Endpoint::try_tag_send`], [`crate::Endpoint::try_am_send`],
    /// [`crate::Endpoint::try_put`]) then send nothing and return `Ok(false)`, so
    /// callers' fallback path runs.
    pub fn no_immediate_completion(mut self, on: bool) -> Self {
        self.no_imm = on;
        self
    }

    /// Creates the worker and spawns its progress driver on the current tokio runtime.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] outside a tokio runtime; [`Error::CreateWorker`] when UCX
    /// fails.
    pub fn build(self) -> Result<Worker> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::ApiMisuse("Worker::build must run inside a tokio runtime".into()))?;
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64,
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: the context is valid; params and out-pointer are valid for the call.
        Status(unsafe { sys::ucp_worker_create(self.ctx.inner.handle, &params, &mut handle) })
            .check()
            .map_err(Error::CreateWorker)?;
        let mut efd: libc::c_int = -1;
        // SAFETY: handle was just created; the context has UCP_FEATURE_WAKEUP.
        let st = Status(unsafe { sys::ucp_worker_get_efd(handle, &mut efd) });
        if let Err(e) = st.check() {
            // SAFETY: nothing else refers to the new worker.
            unsafe { sys::ucp_worker_destroy(handle) };
            return Err(Error::CreateWorker(e));
        }
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER.0 as u64,
            ..Default::default()
        };
        // SAFETY: handle is valid; attr is a valid out-parameter.
        let max_am_header = match Status(unsafe { sys::ucp_worker_query(handle, &mut attr) }).check() {
            Ok(()) => attr.max_am_header,
            Err(_) => 0,
        };
        let inner = Arc::new(WorkerInner {
            max_am_header,
            ctx: self.ctx.inner.clone(),
            lock: RawLock::new(),
            state: UnsafeCell::new(State::new(handle)),
            mode: self.mode,
            linger: self.linger,
            efd,
            no_imm: self.no_imm,
            signal: Arc::default(),
        });
        let state_ptr = inner.state.get().cast::<c_void>();
        let am = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID.0
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB.0
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG.0) as u64,
            id: handshake::AM_ID,
            cb: Some(handshake_am_cb),
            arg: state_ptr,
            ..Default::default()
        };
        // SAFETY: the worker is valid; arg points to the State owned by `inner`, which
        // outlives the worker handle.
        Status(unsafe { sys::ucp_worker_set_am_recv_handler(handle, &am) })
            .check()
            .map_err(Error::CreateWorker)?;
        // SAFETY: the worker is new and not yet shared; the State outlives it.
        let ids = unsafe { crate::am::register_catch_all(handle, state_ptr.cast()) }
            .map_err(Error::CreateWorker)?;
        inner.locked(|st| st.am_ids = ids);
        // Only now may another thread progress it (see `live_workers`).
        register_live(&inner);
        rt.spawn(progress::drive(inner.clone(), inner.signal.clone()));
        let id = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(worker = id, mode = ?self.mode, "worker created");
        let own_address = inner.locked(|st| ucx_address_of(st.handle))?;
        let uuid = crate::pairing::uuid_of(&own_address);
        if let Some(u) = uuid {
            own_workers().insert(u, own_address.clone());
        }
        Ok(Worker {
            shared: Arc::new(WorkerShared {
                inner,
                endpoint: self.endpoint,
                id,
                own_address,
                uuid,
                reference: std::sync::OnceLock::new(),
            }),
        })
    }
}

/// A worker's address in UCX's own form (`ucp_worker_get_address`).
fn ucx_address_of(handle: sys::ucp_worker_h) -> Result<Vec<u8>> {
    let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: the caller holds the worker's lock on a live worker; out-pointers are valid.
    Status(unsafe { sys::ucp_worker_get_address(handle, &mut addr, &mut len) })
        .check()
        .map_err(|source| Error::Worker { op: "ucp_worker_get_address", source })?;
    // SAFETY: UCX returned `len` readable bytes at `addr`.
    let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
    // SAFETY: releases the address UCX allocated above, once, after the copy.
    unsafe { sys::ucp_worker_release_address(handle, addr) };
    Ok(bytes)
}

/// The live workers of this process by UCX uuid, with their addresses in UCX's form: a
/// peer address naming one of them must be that worker's own (see
/// [`Worker::check_peer_address`]).
fn own_workers() -> std::sync::MutexGuard<'static, HashMap<u64, Vec<u8>>> {
    static OWN: std::sync::OnceLock<std::sync::Mutex<HashMap<u64, Vec<u8>>>> = std::sync::OnceLock::new();
    OWN.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `uuid` names a live worker of this process.
pub(crate) fn is_own_worker(uuid: u64) -> bool {
    own_workers().contains_key(&uuid)
}

static NEXT_WORKER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A UCX worker: the unit of progress, with its endpoints, listeners and tag queue.
///
/// Cheap to clone. The worker's progress driver runs on the tokio runtime that created
/// it until the last clone, endpoint, listener and pending operation are gone. The worker
/// is then destroyed once its in-flight requests, and the closes of endpoints dropped
/// without [`crate::Endpoint::close`], have finished, or after 2 s; while it waits, the thread
/// dropping it also progresses the other workers of the process, which may be the peers.
/// The buffers of operations UCX still has not completed then are leaked, not freed: the
/// peer may yet read them (a rendezvous send) or write them (a receive it is filling).
///
/// An endpoint dropped on the connecting side of a listener connection stays with its
/// worker for up to about a second after its last handle is gone, until its peer has
/// closed first (see [`crate::Endpoint::close`]); it counts in
/// [`Worker::parked_requests`]. A worker dropped meanwhile closes it at once, the
/// connecting side first.
///
/// **Several workers in one process, UCX before 1.18.** UCX keeps a socket event it could
/// not deliver at once under the socket's fd number, and before 1.18 removing the socket's
/// handler did not drop that event; when a connection dies in one worker while another
/// worker of the same process opens a socket, the fd can be reused before the event is
/// handled, and a UCX built with assertions (Debian's 1.13 is) aborts the process
/// (`async.c: handler->async == async`; without assertions, the other worker's handler
/// runs unsynchronized). UCX 1.18 and later purge the event on removal. One worker per
/// process, the usual layout, never meets it; on older UCX, workers in one process whose
/// connections may fail should not open connections at the same moment. (Accepted
/// endpoints are created on their listener's worker, so UCX never moves a socket between
/// workers, which would meet it too.)
#[derive(Clone)]
pub struct Worker {
    pub(crate) shared: Arc<WorkerShared>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.shared.id).field("mode", &self.shared.inner.mode).finish()
    }
}

/// The user-facing side of a worker: its drop stops the progress driver.
pub(crate) struct WorkerShared {
    pub(crate) inner: Arc<WorkerInner>,
    pub(crate) endpoint: EndpointOptions,
    pub(crate) id: u64,
    /// This worker's address in UCX's form, and the worker uuid in it.
    pub(crate) own_address: Vec<u8>,
    uuid: Option<u64>,
    /// What this worker's own address shows of its transports, read once, for checking
    /// peers' addresses ([`crate::ucx_address`]).
    reference: std::sync::OnceLock<std::result::Result<crate::ucx_address::Reference, String>>,
}

impl Drop for WorkerShared {
    fn drop(&mut self) {
        if let Some(u) = self.uuid {
            own_workers().remove(&u);
        }
        self.inner.signal.shutdown();
    }
}

impl Worker {
    /// This worker's address, to hand to peers for [`Worker::connect_address`]; sealed
    /// with a MAC when the context has a secret.
    pub fn address(&self) -> Result<WorkerAddress> {
        let bytes = self.shared.inner.locked(|st| ucx_address_of(st.handle))?;
        let ctx = self.context();
        let wa = WorkerAddress::wrap(&ProcessIdentity::current(), ctx.has_shared_memory(), &bytes);
        Ok(match ctx.secret() {
            Some(s) => wa.sealed(s),
            None => wa,
        })
    }

    /// This worker's UCX uuid (from its address).
    pub(crate) fn uuid(&self) -> Result<u64> {
        self.shared.uuid.ok_or_else(|| Error::Unsupported {
            what: "this UCX's worker addresses carry no worker uuid".into(),
        })
    }

    /// Checks a peer's worker address in UCX's own form against what this worker's
    /// transports read (see [`crate::ucx_address`]) before it is handed to UCX. An
    /// address that names this process (a worker of it by uuid, or this process's pid in
    /// its shared-memory parts) must be that worker's own: UCX would otherwise copy into
    /// this process's memory for whoever holds a key.
    pub(crate) fn check_peer_address(&self, ucx: &[u8]) -> Result<()> {
        let reference =
            self.shared.reference.get_or_init(|| crate::ucx_address::Reference::of(&self.shared.own_address));
        let bad = |reason: String| Error::BadAddress { reason };
        let walked = match reference {
            Ok(r) => r.check(ucx).map_err(bad)?,
            // UCX's unified mode, say: this worker cannot tell a good address.
            Err(e) => {
                return Err(bad(format!("addresses cannot be checked here ({e}): seal them with a secret")))
            }
        };
        let own = walked.uuid.and_then(|u| own_workers().get(&u).cloned());
        match own {
            Some(own) if own != ucx => {
                Err(bad("it names a worker of this process but is not that worker's address".into()))
            }
            None if crate::ucx_address::names_this_process(ucx, &walked) => {
                Err(bad("its shared-memory parts name this process, which has no such worker".into()))
            }
            _ => Ok(()),
        }
    }

    /// The context this worker belongs to.
    pub fn context(&self) -> Context {
        Context { inner: self.shared.inner.ctx.clone() }
    }

    /// The progress mode.
    pub fn progress_mode(&self) -> ProgressMode {
        self.shared.inner.mode
    }

    /// Progresses the worker once (`ucp_worker_progress`) and returns the number of events
    /// handled. The driver does this on its own; calling it is only useful for latency
    /// experiments.
    pub fn progress(&self) -> u32 {
        self.shared.inner.locked(|st| self.shared.inner.progress_locked(st))
    }

    /// Handshakes that arrived malformed on this worker (they are answered with a refusal
    /// and otherwise ignored).
    pub fn bad_handshakes(&self) -> u64 {
        self.shared.inner.locked(|st| st.bad_handshakes)
    }

    /// Operations whose futures were dropped while UCX still owned their buffers, and
    /// closes of endpoints dropped without [`crate::Endpoint::close`], still running
    /// (those still closing through their peer, and those waiting for operations still
    /// running on their endpoint, included).
    pub fn parked_requests(&self) -> usize {
        self.shared.inner.locked(|st| st.parked + st.lingering() + st.closes_waiting_ops)
    }

    /// The raw handle: valid while this worker (or a clone, endpoint or listener of it)
    /// is alive; do not destroy it, and hold no ucxkit call open on this worker while
    /// using it (UCX calls on a worker must be serialized).
    pub fn as_raw(&self) -> sys::ucp_worker_h {
        self.shared.inner.locked(|st| st.handle)
    }

    pub(crate) fn state_ptr(&self) -> *mut c_void {
        self.shared.inner.state.get().cast()
    }
}

/// Hasher for the integer keys of the worker's tables (endpoint ids, request and handle
/// addresses): a multiply-xorshift, much cheaper than SipHash on the per-operation path.
/// The keys are not attacker-chosen.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).rotate_left(5);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

/// `HashMap` keyed by integers, with [`IdHasher`].
pub(crate) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// `HashSet` of integers or addresses, with [`IdHasher`].
pub(crate) type IdSet<K> = std::collections::HashSet<K, std::hash::BuildHasherDefault<IdHasher>>;

/// The worker's endpoints by id. Each [`EpState`] has its own allocation, so the last one
/// looked up is remembered by address: the stream operations of one endpoint, which look
/// it up on every send, receive and completion, find it without hashing.
pub(crate) struct EpTable {
    map: IdMap<u64, NonNull<EpState>>,
    /// The last id looked up and its state (id 0, which no endpoint has, for none).
    last: Cell<(u64, Option<NonNull<EpState>>)>,
}

// SAFETY: the table owns its states (allocated by `insert`, freed by `remove` or drop)
// as a map of boxes would; it is only used under the worker lock.
unsafe impl Send for EpTable {}

impl Default for EpTable {
    fn default() -> Self {
        EpTable { map: IdMap::default(), last: Cell::new((0, None)) }
    }
}

impl EpTable {
    #[inline]
    fn find(&self, id: u64) -> Option<NonNull<EpState>> {
        match self.last.get() {
            (last, p @ Some(_)) if last == id => p,
            _ => {
                let p = self.map.get(&id).copied();
                if p.is_some() {
                    self.last.set((id, p));
                }
                p
            }
        }
    }

    /// The state of endpoint `id`.
    #[inline]
    pub(crate) fn get(&self, id: &u64) -> Option<&EpState> {
        // SAFETY: the pointer is one of the table's live allocations (removed ones are
        // forgotten by `remove`); `&self` keeps them from being freed or written.
        self.find(*id).map(|p| unsafe { p.as_ref() })
    }

    /// The state of endpoint `id`, to change.
    #[inline]
    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut EpState> {
        // SAFETY: as in `get`; `&mut self` makes the access exclusive.
        self.find(*id).map(|mut p| unsafe { p.as_mut() })
    }

    /// Adds endpoint `id` (a new id: ids are never reused).
    pub(crate) fn insert(&mut self, id: u64, e: EpState) {
        let p = NonNull::from(Box::leak(Box::new(e)));
        if let Some(old) = self.map.insert(id, p) {
            self.last.set((0, None));
            // SAFETY: the replaced allocation is the table's, no longer referenced.
            drop(unsafe { Box::from_raw(old.as_ptr()) });
        }
    }

    /// Removes endpoint `id`.
    pub(crate) fn remove(&mut self, id: &u64) {
        if let Some(p) = self.map.remove(id) {
            if self.last.get().0 == *id {
                self.last.set((0, None));
            }
            // SAFETY: the table's allocation, out of the map and the cache.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }

    /// Every endpoint with its id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&u64, &EpState)> {
        // SAFETY: as in `get`.
        self.map.iter().map(|(id, p)| (id, unsafe { p.as_ref() }))
    }
}

impl Drop for EpTable {
    fn drop(&mut self) {
        for (_, p) in self.map.drain() {
            // SAFETY: the table's allocations, freed once.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }
}

/// How long a closing endpoint waits for its peer ([`State::linger`]) before it closes
/// anyway.
const CLOSE_FIRST_WAIT: Duration = Duration::from_secs(1);

/// An endpoint being closed through its peer ([`State::linger`]).
struct Linger {
    /// The notice sent once the flush is done and the endpoint's operations have
    /// finished: [`Kind::CloseFirst`] on the connecting side, [`Kind::Closing`] on the
    /// accepting side.
    notice: Kind,
    /// Whether the notice went out.
    sent: bool,
    /// Whether the peer refused the notice (it does not know it): close at once.
    refused: bool,
    /// The deadline in force (entries of [`Lingering::deadlines`] with another one are
    /// stale).
    deadline: Instant,
    /// The flush posted before the notice, while it runs.
    flush: Option<request::Request>,
    /// [`crate::Endpoint::close`] calls waiting for the end.
    waiters: Vec<Waker>,
}

/// Lingering endpoints, for the worker lock's holder to move on cheaply: the ones with
/// news (flush finished, endpoint failed) listed, the deadlines in order (all waits are
/// equal), the clock read only now and then.
#[derive(Default)]
pub(crate) struct Lingering {
    /// Endpoints still lingering.
    pub(crate) live: usize,
    /// (deadline, endpoint), oldest first; may name endpoints no longer lingering.
    deadlines: std::collections::VecDeque<(Instant, u64)>,
    /// Endpoints whose flush or one of whose operations finished, or which failed, since
    /// they were last looked at.
    pub(crate) news: Vec<u64>,
    /// Progress calls since the clock was last read for the deadlines.
    ticks: u32,
}

/// While endpoints linger: every how many progress calls the deadlines are checked (the
/// driver also checks before it sleeps).
const LINGER_CLOCK_EVERY: u32 = 64;

/// Per-endpoint bookkeeping, under the worker lock.
pub(crate) struct EpState {
    /// NULL once closed.
    pub(crate) handle: sys::ucp_ep_h,
    pub(crate) failed: Option<Status>,
    /// The handle while the endpoint is usable (open and not failed), NULL after; shared
    /// with the [`crate::Endpoint`] so that posting needs no table lookup. Written and
    /// read only under the worker lock.
    pub(crate) usable: Arc<AtomicPtr<sys::ucp_ep>>,
    /// Whether UCX peer error handling is on (UCX then purges requests on failure).
    pub(crate) peer_mode: bool,
    /// Stream bytes written (posted) on this endpoint.
    pub(crate) stream_tx: u64,
    /// Stream bytes received on this endpoint.
    pub(crate) stream_rx: u64,
    /// The peer's stream writer shut down after this many bytes.
    pub(crate) stream_end: Option<u64>,
    /// Stream bytes taken out of UCX because the peer closed (they would go with the
    /// endpoint), from `kept_at` on still unread ([`State::keep_stream`]). Counted in
    /// `stream_rx` already.
    kept: Vec<u8>,
    kept_at: usize,
    /// Tasks waiting for stream progress (end of stream, failure) or for the endpoint's
    /// failure ([`crate::Endpoint::failed`]).
    pub(crate) stream_waiters: Vec<Waker>,
    /// The endpoint's handle, for active-message replies.
    pub(crate) endpoint: std::sync::Weak<crate::endpoint::EndpointInner>,
    /// Zero-copy stream data ([`crate::StreamData`]) handed out and not yet released.
    pub(crate) data_out: usize,
    /// A close requested while stream data was out or operations still ran on the
    /// endpoint: the UCX handle and whether to force; done when the last piece is
    /// released and the operations have finished ([`State::run_deferred_close`]).
    pub(crate) deferred_close: Option<(sys::ucp_ep_h, bool)>,
    /// The deferred close waits for operations ([`State::ops_running`]).
    close_waits_ops: bool,
    /// Nothing refers to the entry any more: removed once its deferred close ran.
    orphan: bool,
    /// ucxkit ended operations that UCX still runs (the peer process died unseen by UCX,
    /// [`State::fail_ep`]): UCX must not close the endpoint until it fails it itself,
    /// which purges them.
    poisoned: bool,
    /// [`crate::Endpoint::close`] was called: later operations are misuse, even if the
    /// peer's disconnect (asked for by that close) failed the endpoint meanwhile.
    pub(crate) closing: bool,
    /// UCX reported the endpoint failed (its lanes are dead): closing it makes UCX log
    /// flush errors, which go to `tracing` ([`ucx_log::quietly`]).
    lanes_failed: bool,
    /// Failed because ucxkit saw the peer process exit, UCX not knowing.
    peer_exited: bool,
    /// Closed or dropped, closing through the peer ([`State::linger`]).
    linger: Option<Linger>,
    /// No [`crate::Endpoint`] stands for it: the peer of another connection's endpoint
    /// that UCX paired with this worker (see [`crate::pairing`]), kept open while that
    /// peer may use it, closed when it fails or the worker goes away.
    pub(crate) hidden: bool,
    /// Made from a worker address (or taken over from one, see [`crate::pairing`]), not
    /// through UCX's connection manager: UCX closes its TCP connection only when both
    /// sides close forcibly (see [`State::close_ep`]).
    pub(crate) by_address: bool,
}

impl EpState {
    pub(crate) fn new(
        handle: sys::ucp_ep_h,
        peer_mode: bool,
        usable: Arc<AtomicPtr<sys::ucp_ep>>,
    ) -> EpState {
        EpState {
            handle,
            failed: None,
            usable,
            peer_mode,
            stream_tx: 0,
            stream_rx: 0,
            stream_end: None,
            kept: Vec::new(),
            kept_at: 0,
            data_out: 0,
            deferred_close: None,
            close_waits_ops: false,
            orphan: false,
            poisoned: false,
            closing: false,
            lanes_failed: false,
            peer_exited: false,
            linger: None,
            hidden: false,
            by_address: false,
            stream_waiters: Vec::new(),
            endpoint: std::sync::Weak::new(),
        }
    }

    /// Whether the peer ended its stream and every byte it wrote has been received (and
    /// read).
    pub(crate) fn stream_ended(&self) -> bool {
        self.stream_end.is_some_and(|n| self.stream_rx >= n) && self.kept_at == self.kept.len()
    }

    /// Stream bytes kept from a closed peer and not read yet ([`State::keep_stream`]).
    pub(crate) fn kept(&self) -> &[u8] {
        &self.kept[self.kept_at..]
    }

    /// Marks the first `n` bytes of [`EpState::kept`] read.
    pub(crate) fn consume_kept(&mut self, n: usize) {
        self.kept_at += n;
        if self.kept_at == self.kept.len() {
            self.kept = Vec::new();
            self.kept_at = 0;
        }
    }

    /// Takes the rest of [`EpState::kept`].
    pub(crate) fn take_kept(&mut self) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.kept);
        v.drain(..self.kept_at);
        self.kept_at = 0;
        v
    }
}

/// What an endpoint's failure does to an operation bound to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// An unmatched tag receive: canceled (`ucp_request_cancel`).
    Cancel,
    /// Anything UCX cannot cancel (sends, RMA, fetches): UCX purges it when it learns of
    /// the failure; when only ucxkit knows (a dead same-host peer in error mode None),
    /// ucxkit finishes it (see [`State::fail_ep`]). A closing endpoint waits for these
    /// before it closes ([`State::linger`]).
    Finish,
    /// A stream receive: as [`OpKind::Finish`], but a closing endpoint does not wait for
    /// it (it ends only when the peer writes).
    StreamRecv,
    /// The flush a closing endpoint posts ([`State::linger`]): as [`OpKind::Finish`], but
    /// the close does not wait for it (UCX's own close flushes).
    LingerFlush,
}

/// A pending handshake.
pub(crate) struct HsWait {
    pub(crate) waker: Option<Waker>,
    pub(crate) result: Option<std::result::Result<ProcessIdentity, String>>,
    pub(crate) peer_mode: bool,
    pub(crate) ep: u64,
    /// An accept that takes only a hello with this nonce (the connection id a listener's
    /// front gave the client).
    pub(crate) expect: Option<u64>,
}

/// A connection accepted through a listener's front, waiting for the connecting side's
/// hello (by the connection id of its request on the front, the hello's nonce).
pub(crate) struct FrontWait {
    /// The hellos not taken yet (a collision makes the connecting side send another):
    /// the endpoint each came through (UCX's reply endpoint) and the error mode it says
    /// the connecting side uses.
    pub(crate) hellos: std::collections::VecDeque<(sys::ucp_ep_h, bool)>,
    pub(crate) waker: Option<Waker>,
}

/// A listener's queue of connection requests.
#[derive(Default)]
pub(crate) struct ListenerState {
    pub(crate) queue: std::collections::VecDeque<sys::ucp_conn_request_h>,
    pub(crate) waker: Option<Waker>,
}

/// Work collected under the worker lock and done by [`WorkerInner::locked`] after it
/// releases the lock: tasks to wake, values to drop (parked buffers whose drop may run
/// user code), a driver kick, active-message handlers to run. `any` says whether there
/// is something, so that the common case costs one test.
#[derive(Default)]
pub(crate) struct Deferred {
    any: bool,
    wake: Vec<Waker>,
    graveyard: Vec<Box<dyn Any + Send>>,
    kick: bool,
    handlers: Vec<Arc<crate::am::HandlerCell>>,
}

impl Deferred {
    /// Wakes `w` after the lock is released.
    pub(crate) fn wake(&mut self, w: Waker) {
        self.wake.push(w);
        self.any = true;
    }

    /// Wakes every waker in `ws` (emptied) after the lock is released.
    pub(crate) fn wake_all(&mut self, ws: &mut Vec<Waker>) {
        if !ws.is_empty() {
            self.wake.append(ws);
            self.any = true;
        }
    }

    /// Drops `v` after the lock is released.
    pub(crate) fn bury(&mut self, v: Box<dyn Any + Send>) {
        self.graveyard.push(v);
        self.any = true;
    }

    /// Kicks the progress driver after the lock is released: work was queued that no fd
    /// event will announce.
    pub(crate) fn kick(&mut self) {
        self.kick = true;
        self.any = true;
    }

    /// Runs handler `h` over its queued messages after the lock is released (once, however
    /// often it is asked).
    pub(crate) fn run_handler(&mut self, h: &Arc<crate::am::HandlerCell>) {
        if !self.handlers.iter().any(|c| Arc::ptr_eq(c, h)) {
            self.handlers.push(h.clone());
        }
        self.any = true;
    }
}

/// Everything under the worker lock.
pub(crate) struct State {
    pub(crate) handle: sys::ucp_worker_h,
    /// What to do once the lock is released.
    pub(crate) after: Deferred,
    pub(crate) parked: usize,
    /// Close requests of endpoints nobody waits for, parked until they finish
    /// ([`request::park_close`]), by address: thousands of endpoints dropped at once each
    /// leave one, and each is taken out as it finishes.
    pub(crate) closes: IdSet<*mut Slot>,
    /// Probes (`tag_recv_any`, stream data) waiting for any arrival.
    probe_waiters: Vec<Waker>,
    /// Whether `probe_waiters`, `outbox`, `failed`, `close_first`, `peer_closing`,
    /// `peer_closed` or `lingering` may hold something for [`WorkerInner::progress_locked`] to do after a
    /// progress call.
    chores: bool,
    pub(crate) eps: EpTable,
    pub(crate) by_handle: IdMap<usize, u64>,
    pub(crate) next_id: u64,
    failed: Vec<(u64, Status)>,
    /// Endpoints whose peer asked this side to close first (`CloseFirst`).
    close_first: Vec<u64>,
    /// Endpoints whose accepting peer is closing (`Closing`).
    peer_closing: Vec<u64>,
    /// Endpoints whose peer closed its end as asked (`Closed`).
    peer_closed: Vec<u64>,
    /// Endpoints closed or dropped, closing through their peer ([`State::linger`]).
    pub(crate) lingering: Lingering,
    /// Endpoints whose close waits for operations still running on them.
    pub(crate) closes_waiting_ops: usize,
    pub(crate) connects: IdMap<u64, HsWait>,
    pub(crate) accepts: IdMap<usize, HsWait>,
    /// Connections accepted through a listener's front, by connection id.
    pub(crate) front_accepts: IdMap<u64, FrontWait>,
    outbox: Vec<(sys::ucp_ep_h, Vec<u8>)>,
    pub(crate) listeners: IdMap<u64, ListenerState>,
    pub(crate) bad_handshakes: u64,
    /// Registered active-message ids.
    pub(crate) am: IdMap<u16, Box<crate::am::AmReg>>,
    /// Active messages dropped because their id was unregistered.
    pub(crate) am_dropped: u64,
    /// Active messages held for ids nobody registered yet.
    pub(crate) am_unclaimed: crate::am::Unclaimed,
    /// The catch-all routing table for unregistered ids (freed after the worker).
    pub(crate) am_ids: *mut crate::am::IdTable,
    /// Event mode: no waiting future spins before this (set after a spin found nothing).
    spin_quiet_until: Option<Instant>,
    /// Head of the list of pending requests bound to an endpoint (linked through their
    /// slots; see [`request::Request::bind`]).
    pub(crate) bound: *mut Slot,
}

impl State {
    fn new(handle: sys::ucp_worker_h) -> State {
        State {
            handle,
            after: Deferred::default(),
            parked: 0,
            closes: IdSet::default(),
            probe_waiters: Vec::new(),
            chores: false,
            eps: EpTable::default(),
            by_handle: IdMap::default(),
            next_id: 1,
            failed: Vec::new(),
            close_first: Vec::new(),
            peer_closing: Vec::new(),
            peer_closed: Vec::new(),
            closes_waiting_ops: 0,
            lingering: Lingering::default(),
            connects: IdMap::default(),
            accepts: IdMap::default(),
            front_accepts: IdMap::default(),
            outbox: Vec::new(),
            listeners: IdMap::default(),
            bad_handshakes: 0,
            am: IdMap::default(),
            am_dropped: 0,
            am_unclaimed: crate::am::Unclaimed::default(),
            am_ids: std::ptr::null_mut(),
            spin_quiet_until: None,
            bound: std::ptr::null_mut(),
        }
    }

    /// The pending requests bound to endpoint `id` ([`request::Request::bind`]), with
    /// what its failure does to each.
    fn bound_to(&self, id: u64) -> impl Iterator<Item = (*mut Slot, OpKind)> + '_ {
        let mut s = self.bound;
        std::iter::from_fn(move || {
            while !s.is_null() {
                // SAFETY: the list holds live bound requests (taken out before they are
                // freed); the lock is held (&self comes from it).
                let slot = unsafe { &*s };
                let this = s;
                s = slot.next;
                if slot.bound_ep == id {
                    return Some((this, slot.kind));
                }
            }
            None
        })
    }

    /// Wakes `waker` after the next progress call that finds an event (probes wait for
    /// any arrival).
    pub(crate) fn add_probe_waiter(&mut self, waker: &Waker) {
        self.probe_waiters.push(waker.clone());
        self.chores = true;
    }

    /// Wakes every waiting probe now (after the lock is released), whatever progress
    /// found: the driver does before it sleeps, as a message may have become visible in a
    /// progress call that reported no event.
    pub(crate) fn wake_probes(&mut self) {
        self.after.wake_all(&mut self.probe_waiters);
    }

    /// Counts `n` stream bytes received on endpoint `ep`.
    pub(crate) fn stream_received(&mut self, ep: u64, n: usize) {
        if let Some(e) = self.eps.get_mut(&ep) {
            e.stream_rx += n as u64;
            if e.stream_ended() {
                self.after.wake_all(&mut e.stream_waiters);
            }
        }
    }

    pub(crate) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Marks an endpoint failed and ends every operation pending on it:
    /// - bound receives are canceled (`ucp_request_cancel`);
    /// - in UCX peer mode, the endpoint is force-closed and UCX completes its sends with
    ///   an error;
    /// - without peer mode, when UCX itself reported the failure (`peer_exited` false), UCX
    ///   discards the endpoint's lanes and completes its sends with an error on its own;
    /// - without peer mode, when ucxkit's pidfd watch saw the peer process exit
    ///   (`peer_exited` true), UCX 1.13 knows nothing, can neither force-close nor purge
    ///   the endpoint, so its pending operations are finished here with
    ///   `UCS_ERR_CONNECTION_RESET`; their futures then release the requests
    ///   (`ucp_request_free`: UCX keeps them internally and calls back no more). The peer
    ///   process is gone, so nothing will read those buffers any more: on shared memory
    ///   the data waits for the peer's progress (rendezvous, read by the peer) or for room
    ///   in the peer's queue, neither of which can happen. Nothing will write them
    ///   either: the worker is first progressed until idle, which delivers whatever the
    ///   peer sent before it died (stream data, get replies, fetch fragments), and a dead
    ///   process sends nothing more.
    pub(crate) fn fail_ep(&mut self, id: u64, status: Status, peer_exited: bool) {
        if peer_exited
            && self.eps.get(&id).is_some_and(|e| !e.peer_mode)
            && self.bound_to(id).next().is_some()
        {
            // Everything the dead peer ever sent is already here (in our shared-memory
            // queues or socket buffers): let UCX deliver it now, so that no operation
            // finished below can be written into afterwards (a stream receive, a get
            // reply, a rendezvous fragment).
            for _ in 0..100_000 {
                // SAFETY: the worker is valid and the lock is held (st comes from it);
                // this is not inside a UCX callback.
                if unsafe { sys::ucp_worker_progress(self.handle) } == 0 {
                    break;
                }
            }
        }
        let Some(e) = self.eps.get_mut(&id) else { return };
        if e.failed.is_none() {
            e.failed = Some(status);
            e.peer_exited = peer_exited;
        }
        e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
        tracing::debug!(ep = id, %status, "endpoint failed");
        let peer_mode = e.peer_mode;
        self.after.wake_all(&mut e.stream_waiters);
        // Collected first: canceling one can complete and unlink it.
        let bound: Vec<_> = self.bound_to(id).collect();
        if !peer_mode && peer_exited && bound.iter().any(|&(_, kind)| kind != OpKind::Cancel) {
            if let Some(e) = self.eps.get_mut(&id) {
                e.poisoned = true;
            }
        }
        for (r, kind) in bound {
            if kind == OpKind::Cancel {
                // SAFETY: r is a live pending tag receive of this worker (bound requests
                // are unbound before they are freed, and canceling one completes only
                // that one); the lock is held.
                unsafe { sys::ucp_request_cancel(self.handle, r.cast()) };
            } else if !peer_mode && peer_exited {
                // SAFETY: as above, for a bound send.
                unsafe { request::fail_pending(r, Status::CONNECTION_RESET, self) };
            }
        }
        for w in self.connects.values_mut().filter(|w| w.ep == id) {
            if let Some(k) = w.waker.take() {
                self.after.wake(k);
            }
        }
        if peer_mode {
            // Failed in peer mode: closed forcibly.
            self.close_unwaited(id);
        }
        if self.eps.get(&id).is_some_and(|e| e.hidden) {
            // Nobody uses it but its peer, which failed.
            self.close_unwaited(id);
            self.forget_ep(id);
            return;
        }
        if self.eps.get(&id).is_some_and(|e| e.linger.is_some() || e.close_waits_ops) {
            // Most likely the peer closing, as asked; a deferred close waits no more for
            // operations UCX purges (or ucxkit finished above).
            self.lingering.news.push(id);
            self.chores = true;
        }
        self.after.kick();
    }

    /// Starts closing an endpoint (`ucp_ep_close_nbx`, forcibly if `force`) and returns
    /// the close request, if any, for the caller to wait for or hand to
    /// [`State::finish_close`]; None if it was closed already or the close waits for
    /// borrowed stream data (`release_stream_data` finishes it).
    pub(crate) fn close_ep(&mut self, id: u64, force: bool) -> Option<request::Posted> {
        let ops = !force && (self.ops_running(id) || self.eps.get(&id).is_some_and(|e| e.poisoned));
        let e = self.eps.get_mut(&id)?;
        let h = std::mem::replace(&mut e.handle, std::ptr::null_mut());
        e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
        if h.is_null() {
            return None;
        }
        if e.data_out > 0 || ops {
            // Borrowed stream data still points into UCX's buffers of this endpoint, or
            // operations still run on it (a send the peer has not taken yet): UCX must
            // not close an endpoint with sends running (1.13 asserts, or frees the
            // endpoint they point to). Closed once the data is released and the
            // operations have finished, or failed (UCX purges them when the endpoint
            // fails). The handle stays known for the endpoint's failure.
            e.deferred_close = Some((h, force));
            if ops {
                e.close_waits_ops = true;
                self.closes_waiting_ops += 1;
            }
            tracing::debug!(ep = id, ops, "close deferred");
            return None;
        }
        self.close_now(id, h, force)
    }

    /// Closes endpoint `id`'s handle `h`, already taken out of the endpoint: at once, or,
    /// for an endpoint made from a worker address in peer mode, after a flush, forcibly.
    /// UCX (1.13 and 1.22) keeps the TCP connection of such an endpoint unless both sides
    /// close it forcibly (a flushing close leaves two descriptors behind for every
    /// connection), which the peer's side does too. `None` while the flush runs (the
    /// close is deferred to its end).
    fn close_now(&mut self, id: u64, h: sys::ucp_ep_h, mut force: bool) -> Option<request::Posted> {
        let e = self.eps.get(&id)?;
        if !force && e.peer_mode && e.by_address && e.failed.is_none() {
            let param = self.flagged_param(0);
            // SAFETY: h is live; the lock is held; the request is bound and parked below,
            // before any progress call.
            let p = unsafe { sys::ucp_ep_flush_nbx(h, &param) };
            let posted = request::Posted::from_ptr(p, request::Completion::OK, false);
            if let request::Posted::Pending(r) = &posted {
                r.bind(self, id, OpKind::Finish);
                let e = self.eps.get_mut(&id)?;
                e.deferred_close = Some((h, true));
                e.close_waits_ops = true;
                self.closes_waiting_ops += 1;
                self.park(posted, Box::new(()));
                tracing::debug!(ep = id, "flushing, then closing forcibly");
                return None;
            }
            force = true;
        }
        let lanes_failed = self.eps.get(&id).is_some_and(|e| e.lanes_failed);
        self.by_handle.remove(&(h as usize));
        self.accepts.remove(&(h as usize));
        Some(self.close_handle(h, force, lanes_failed))
    }

    /// Runs endpoint `id`'s deferred close once nothing holds it any more (no stream data
    /// out, no operation running); forcibly if it failed in peer mode meanwhile. Removes
    /// an orphaned entry after.
    pub(crate) fn run_deferred_close(&mut self, id: u64) {
        let Some(e) = self.eps.get(&id) else { return };
        // (Operations ucxkit ended for a peer that died unseen by UCX still run in UCX
        // until UCX fails the endpoint itself, if it ever does.)
        let waits = e.close_waits_ops && ((e.poisoned && !e.lanes_failed) || self.ops_running(id));
        if e.deferred_close.is_none() || e.data_out > 0 || waits {
            return;
        }
        self.close_deferred(id, false);
    }

    /// Runs endpoint `id`'s deferred close now, forcibly if `force` (the worker is going
    /// away and the close cannot wait any more).
    fn close_deferred(&mut self, id: u64, force: bool) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        let Some((h, asked_force)) = e.deferred_close.take() else { return };
        if std::mem::take(&mut e.close_waits_ops) {
            self.closes_waiting_ops -= 1;
        }
        // Forced in peer mode once UCX found the lanes dead (not when ucxkit marked it
        // failed on the peer's request to close first: that close flushes).
        let force = force || asked_force || (e.peer_mode && (e.lanes_failed || e.peer_exited));
        tracing::debug!(ep = id, force, "deferred close runs");
        // (Deferred again while an endpoint made from an address is flushed first.)
        let Some(p) = self.close_now(id, h, force) else { return };
        self.finish_close(id, p);
        if self.eps.get(&id).is_some_and(|e| e.orphan) {
            self.eps.remove(&id);
        }
    }

    /// Fails the endpoints UCX reported failed ([`ep_err_cb`]), noting that their lanes are
    /// dead (closing them then makes UCX log flush errors, which go to `tracing`).
    fn fail_reported(&mut self) {
        for (id, status) in std::mem::take(&mut self.failed) {
            if let Some(e) = self.eps.get_mut(&id) {
                e.lanes_failed = true;
            }
            self.fail_ep(id, status, false);
        }
    }

    /// Forgets endpoint `id` (its last handle is gone, or it stopped lingering): removes
    /// its entry, or leaves that to its deferred close.
    pub(crate) fn forget_ep(&mut self, id: u64) {
        match self.eps.get_mut(&id) {
            Some(e) if e.deferred_close.is_some() => e.orphan = true,
            Some(_) => {
                self.eps.remove(&id);
            }
            None => {}
        }
    }

    /// `ucp_ep_close_nbx` on a handle already taken out of the tables. The flushing close
    /// of an endpoint whose `lanes_failed` (UCX reported it failed) makes UCX log an error
    /// for each of its dead lanes: those lines go to `tracing` ([`ucx_log::quietly`]).
    fn close_handle(&mut self, h: sys::ucp_ep_h, force: bool, lanes_failed: bool) -> request::Posted {
        let param = self.flagged_param(if force { sys::UCP_EP_CLOSE_FLAG_FORCE.0 as u32 } else { 0 });
        // SAFETY: h is a live endpoint of this worker, closed once (its handle was just
        // taken out of the table); the lock is held.
        let close = || unsafe { sys::ucp_ep_close_nbx(h, &param) };
        let p = if lanes_failed { ucx_log::quietly(close) } else { close() };
        request::Posted::from_ptr(p, request::Completion::OK, false)
    }

    /// Gives a piece of zero-copy stream data back to UCX (`ucp_stream_data_release`) and
    /// finishes a close that waited for it.
    ///
    /// # Safety
    /// `h` and `data` come from one `ucp_stream_recv_data_nb` on endpoint `id` of this
    /// worker, released once; the lock is held.
    pub(crate) unsafe fn release_stream_data(&mut self, id: u64, h: sys::ucp_ep_h, data: *mut c_void) {
        // SAFETY: per contract; the endpoint is not closed while data is out.
        unsafe { sys::ucp_stream_data_release(h, data) };
        let Some(e) = self.eps.get_mut(&id) else { return };
        e.data_out -= 1;
        if e.data_out == 0 {
            self.run_deferred_close(id);
        }
    }

    /// Takes every stream byte UCX holds for endpoint `id` into the endpoint's own buffer
    /// ([`EpState::kept`]), where receives find it first: the peer is closing, and UCX
    /// discards an endpoint's unread stream bytes when it fails or closes. Everything the
    /// peer sent before its close notice has arrived (the notice came after it), so
    /// nothing is left behind in UCX.
    pub(crate) fn keep_stream(&mut self, id: u64) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        let h = e.handle;
        if h.is_null() || e.closing || e.linger.is_some() {
            // (Closed by this side too: nobody reads any more.)
            return;
        }
        let mut took = false;
        loop {
            let mut len = 0usize;
            // SAFETY: h is a live endpoint of this worker; the lock is held; this is not
            // inside a UCX callback. Without the stream feature UCX returns an error or
            // nothing.
            let p = unsafe { sys::ucp_stream_recv_data_nb(h, &mut len) };
            if p.is_null() || sys::UCS_PTR_IS_ERR(p) {
                break;
            }
            // SAFETY: UCX handed out `len` readable bytes at p, valid until released.
            e.kept.extend_from_slice(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) });
            // SAFETY: p comes from the call above on h, released once.
            unsafe { sys::ucp_stream_data_release(h, p) };
            e.stream_rx += len as u64;
            took = true;
        }
        if took {
            tracing::debug!(ep = id, bytes = e.kept().len(), "stream bytes kept from a closing peer");
            self.after.wake_all(&mut e.stream_waiters);
        }
    }

    /// Releases a request that owns no memory and that nobody waits for.
    pub(crate) fn release(&mut self, posted: request::Posted) {
        if let request::Posted::Pending(r) = posted {
            // SAFETY: our request, nothing parked in it, under the lock.
            unsafe { request::release(self, r.raw().cast::<Slot>()) };
        }
    }

    /// Closes endpoint `id` for an owner that does not wait: flushing, or forcibly when
    /// the endpoint failed in peer mode (a dead peer will not answer a flush; UCX allows
    /// forcing only in peer mode). [`State::finish_close`] takes the close request.
    pub(crate) fn close_unwaited(&mut self, id: u64) {
        let Some(e) = self.eps.get(&id) else { return };
        let force = e.failed.is_some() && e.peer_mode;
        if let Some(p) = self.close_ep(id, force) {
            self.finish_close(id, p);
        }
    }

    /// Closes endpoint `id` of a listener connection made with the handshake through its
    /// peer, for [`crate::Endpoint::close`] and for the drop of its last handle, so that
    /// the accepting side disconnects first and each side takes in what the other sent
    /// before: flushes; once the flush is done, sends `notice` ([`Kind::CloseFirst`] on
    /// the connecting side: the peer takes in what arrived and closes; [`Kind::Closing`]
    /// on the accepting side: the peer takes in what arrived and answers `CloseFirst`,
    /// upon which this side closes); keeps the endpoint's entry until it fails (the
    /// peer's disconnect, or this side's close on `CloseFirst`) or [`CLOSE_FIRST_WAIT`]
    /// passes (checked after progress calls, within [`LINGER_CLOCK_EVERY`] of them or
    /// before the driver sleeps), and then closes it, waking the `close()` calls waiting
    /// ([`State::wait_linger`]). Returns false, having done nothing, for an endpoint that
    /// cannot take part (closed, failed, stream data out, or lingering already).
    pub(crate) fn linger(&mut self, id: u64, notice: Kind) -> bool {
        let Some(e) = self.eps.get(&id) else { return false };
        if e.handle.is_null() || e.failed.is_some() || e.data_out > 0 || e.linger.is_some() {
            return false;
        }
        let h = e.handle;
        let deadline = Instant::now() + CLOSE_FIRST_WAIT;
        let mut param = self.flagged_param(0);
        param.cb.send = Some(request::linger_flush_cb);
        // SAFETY: h is a live endpoint of this worker; the lock is held. The callback finds
        // the endpoint through the request's binding, made before any progress call.
        let p = unsafe { sys::ucp_ep_flush_nbx(h, &param) };
        let flush = match request::Posted::from_ptr(p, request::Completion::OK, false) {
            request::Posted::Pending(r) => {
                r.bind(self, id, OpKind::LingerFlush);
                Some(r)
            }
            request::Posted::Done(c) if c.status().is_ok() => None,
            request::Posted::Done(_) => return false,
        };
        if let Some(e) = self.eps.get_mut(&id) {
            // Other clones see it closed from now on (operations posted after the notice
            // would be lost); the handle stays for the flush, the notice and the close.
            e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
            e.linger =
                Some(Linger { notice, sent: false, refused: false, deadline, flush, waiters: Vec::new() });
        }
        self.lingering.live += 1;
        self.lingering.deadlines.push_back((deadline, id));
        self.lingering.news.push(id);
        self.chores = true;
        true
    }

    /// Whether endpoint `id` failed because its peer process died unseen by UCX (same
    /// host, no peer error handling): UCX then never ends what that peer left half sent.
    pub(crate) fn peer_died_unseen(&self, id: u64) -> bool {
        self.eps.get(&id).is_some_and(|e| e.peer_exited && !e.peer_mode)
    }

    /// Whether an operation that a closing endpoint waits for (a send, RMA, a fetch; not
    /// a receive) is still running on endpoint `id`.
    fn ops_running(&self, id: u64) -> bool {
        // SAFETY: bound_to yields live bound requests; the lock is held.
        self.bound_to(id).any(|(r, kind)| kind == OpKind::Finish && unsafe { request::is_running(r) })
    }

    /// Sends lingering endpoint `id`'s notice: its own, or [`Kind::CloseFirst`] when
    /// operations still run on it (then the peer must close first: UCX requires an
    /// endpoint that closes itself to have none, and purges them when the peer's
    /// disconnect fails it); the peer then has [`CLOSE_FIRST_WAIT`] from now.
    fn send_linger_notice(&mut self, id: u64) {
        let running = self.ops_running(id);
        let Some(e) = self.eps.get_mut(&id) else { return };
        let (h, peer_mode) = (e.handle, e.peer_mode);
        let Some(l) = e.linger.as_mut() else { return };
        if l.sent || h.is_null() {
            return;
        }
        l.sent = true;
        l.deadline = Instant::now() + CLOSE_FIRST_WAIT;
        let (notice, deadline) = (if running { Kind::CloseFirst } else { l.notice }, l.deadline);
        self.lingering.deadlines.push_back((deadline, id));
        self.send_notice(h, notice, peer_mode, 0);
    }

    /// The peer of lingering endpoint `id` refused its notice: closes it after this
    /// progress call.
    pub(crate) fn linger_refused(&mut self, id: u64) {
        if let Some(l) = self.eps.get_mut(&id).and_then(|e| e.linger.as_mut()).filter(|l| l.sent) {
            tracing::debug!(ep = id, "the peer refused the close notice");
            l.refused = true;
            self.lingering.news.push(id);
            self.chores = true;
        }
    }

    /// For [`request`]'s completion callbacks, while endpoints linger or closes wait for
    /// operations: an operation bound to endpoint `id` finished.
    pub(crate) fn op_done(&mut self, id: u64) {
        let waits = self
            .eps
            .get(&id)
            .is_some_and(|e| e.close_waits_ops || e.linger.as_ref().is_some_and(|l| !l.sent));
        if waits {
            self.lingering.news.push(id);
            self.chores = true;
        }
    }

    /// After a progress call while endpoints linger: moves on the ones with news, and
    /// now and then closes those whose time is up.
    fn tend_lingering(&mut self) {
        for id in std::mem::take(&mut self.lingering.news) {
            self.advance_linger(id);
            self.run_deferred_close(id);
        }
        self.lingering.ticks = self.lingering.ticks.wrapping_add(1);
        if self.lingering.ticks % LINGER_CLOCK_EVERY == 0 {
            self.end_overdue_lingering(Instant::now());
        }
    }

    /// A lingering endpoint whose flush and operations finished sends its notice; one
    /// that failed (the peer closed, as asked) or whose flush failed is closed.
    fn advance_linger(&mut self, id: u64) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        let Some(l) = e.linger.as_mut() else { return };
        if e.failed.is_some() || e.handle.is_null() || l.refused {
            self.end_linger(id);
            return;
        }
        if l.sent {
            return;
        }
        if let Some(r) = l.flush.take() {
            match r.take_if_done(self) {
                Ok(c) if c.status().is_ok() => {}
                Ok(_) => {
                    self.end_linger(id);
                    return;
                }
                Err(r) => {
                    if let Some(l) = self.eps.get_mut(&id).and_then(|e| e.linger.as_mut()) {
                        l.flush = Some(r);
                    }
                    return;
                }
            }
        }
        // Sends still running wait for the peer to take them (or for the deadline).
        if !self.ops_running(id) {
            self.send_linger_notice(id);
        }
    }

    /// Moves on the lingering endpoints whose deadline is before `now`: one still waiting
    /// for its flush or operations sends its notice anyway and waits once more; one
    /// whose peer did not answer is closed. Called by the driver before it sleeps, too.
    pub(crate) fn end_overdue_lingering(&mut self, now: Instant) {
        while let Some(&(until, id)) = self.lingering.deadlines.front() {
            if until > now {
                break;
            }
            self.lingering.deadlines.pop_front();
            let Some(e) = self.eps.get(&id) else { continue };
            let Some(l) = e.linger.as_ref().filter(|l| l.deadline == until) else { continue };
            if e.failed.is_some() || e.handle.is_null() {
                // (Its news is on the way; end it now all the same.)
                self.end_linger(id);
            } else if !l.sent {
                tracing::debug!(ep = id, "operations still run on the closing endpoint: notice sent anyway");
                self.send_linger_notice(id);
            } else if self.end_linger(id) {
                tracing::debug!(ep = id, "the peer did not answer in time: closing the endpoint");
            }
        }
    }

    /// Closes lingering endpoint `id` now and forgets it (its handle is gone); nothing
    /// (false) if it no longer lingers.
    fn end_linger(&mut self, id: u64) -> bool {
        let Some(l) = self.eps.get_mut(&id).and_then(|e| e.linger.take()) else { return false };
        self.lingering.live -= 1;
        let mut waiters = l.waiters;
        self.after.wake_all(&mut waiters);
        if let Some(r) = l.flush {
            // Parked with the closes, not given back: a worker being destroyed waits for
            // it (bounded) as UCX requires of every request it still runs, then gives it
            // up like a close that never finished.
            if let Err(r) = r.take_if_done(self) {
                // SAFETY: a pending request of ours that owns no memory, under the lock.
                unsafe { request::park_close(self, r.raw().cast::<Slot>()) }
            }
        }
        self.close_unwaited(id);
        self.forget_ep(id);
        true
    }

    /// Closes every lingering endpoint at once (the worker is going away).
    fn end_all_lingering(&mut self) {
        for (_, id) in std::mem::take(&mut self.lingering.deadlines) {
            self.end_linger(id);
        }
    }

    /// Endpoints still lingering.
    pub(crate) fn lingering(&self) -> usize {
        self.lingering.live
    }

    /// Whether endpoint `id` lingers.
    pub(crate) fn lingers(&self, id: u64) -> bool {
        self.eps.get(&id).is_some_and(|e| e.linger.is_some())
    }

    /// Until endpoint `id` stops lingering: Pending, with `waker` woken at the end.
    pub(crate) fn wait_linger(&mut self, id: u64, waker: &Waker) -> Poll<()> {
        match self.eps.get_mut(&id).and_then(|e| e.linger.as_mut()) {
            Some(l) => {
                if !l.waiters.iter().any(|w| w.will_wake(waker)) {
                    l.waiters.push(waker.clone());
                }
                Poll::Pending
            }
            None => Poll::Ready(()),
        }
    }

    /// For [`request::linger_flush_cb`]: the flush of lingering endpoint `id` finished.
    pub(crate) fn linger_flushed(&mut self, id: u64) {
        self.lingering.news.push(id);
        self.chores = true;
    }

    /// Sends a handshake notice of `kind` (after the handshake) on `ep`.
    pub(crate) fn send_notice(&mut self, ep: sys::ucp_ep_h, kind: Kind, peer_mode: bool, nonce: u64) {
        let m = Message { kind, peer_mode, nonce, identity: ProcessIdentity::current() };
        self.send_handshake(ep, m.encode(), true);
    }

    /// Lets the close request of endpoint `id` that nobody waits for finish in the
    /// background ([`request::park_close`]), so that destroying the worker does not cut
    /// it off inside UCX, which reports such a close as failed and its request as leaked.
    /// The flushing close of an endpoint whose peer process ucxkit saw exit, without peer
    /// error handling (UCX does not know), may never finish: that one is released to UCX
    /// at once instead. Other failed endpoints' closes finish: UCX discards lanes it
    /// found dead, and a peer that asked to be closed first waits for the disconnect.
    pub(crate) fn finish_close(&mut self, id: u64, posted: request::Posted) {
        let hopeless = self.eps.get(&id).is_some_and(|e| e.peer_exited && !e.peer_mode);
        match posted {
            request::Posted::Pending(r) if !hopeless && !r.is_done(self) => {
                // SAFETY: a pending close request of ours, under the lock.
                unsafe { request::park_close(self, r.raw().cast::<Slot>()) }
            }
            other => self.release(other),
        }
    }

    /// Parks a request whose owner does not wait for it.
    pub(crate) fn park(&mut self, posted: request::Posted, keep: Box<dyn Any + Send>) {
        match posted {
            request::Posted::Done(_) => self.after.bury(keep),
            request::Posted::Pending(r) => {
                let slot = r.raw().cast::<Slot>();
                // SAFETY: a pending request of ours, under the lock.
                unsafe { request::park_slot(slot, keep) };
                self.parked += 1;
            }
        }
    }

    /// Queues a handshake message to send on `ep` after the current progress call.
    fn reply(&mut self, ep: sys::ucp_ep_h, m: Message) {
        self.outbox.push((ep, m.encode()));
        self.chores = true;
    }

    /// Parameters for a send-type request of this worker with operation flags.
    fn flagged_param(&mut self, flags: u32) -> sys::ucp_request_param_t {
        sys::ucp_request_param_t {
            op_attr_mask: (sys::UCP_OP_ATTR_FIELD_CALLBACK.0
                | sys::UCP_OP_ATTR_FIELD_USER_DATA.0
                | sys::UCP_OP_ATTR_FIELD_FLAGS.0) as u32,
            flags,
            cb: sys::ucp_request_param_t__bindgen_ty_1 { send: Some(request::send_cb) },
            user_data: (self as *mut State).cast(),
            ..Default::default()
        }
    }

    /// Sends a handshake message now (outside any callback).
    pub(crate) fn send_handshake(&mut self, ep: sys::ucp_ep_h, bytes: Vec<u8>, reply: bool) {
        let param = self.flagged_param(if reply { sys::UCP_AM_SEND_FLAG_REPLY.0 as u32 } else { 0 });
        // SAFETY: ep is a live endpoint of this worker; the buffer stays alive until the
        // request completes (parked below); the lock is held.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                handshake::AM_ID,
                std::ptr::null(),
                0,
                bytes.as_ptr().cast(),
                bytes.len(),
                &param,
            )
        };
        let posted = request::Posted::from_ptr(p, request::Completion::OK, false);
        if let request::Posted::Done(c) = &posted {
            if !c.status().is_ok() {
                tracing::debug!(status = %c.status(), "handshake send failed");
            }
        }
        self.park(posted, Box::new(bytes));
    }
}

/// The worker and its lock. Dropped after the driver, the last handle and the last
/// operation are gone.
pub(crate) struct WorkerInner {
    /// Keeps the context alive until the worker is destroyed.
    ctx: Arc<ContextInner>,
    lock: RawLock,
    state: UnsafeCell<State>,
    pub(crate) mode: ProgressMode,
    /// Event mode: how long the driver polls after the last event before sleeping.
    pub(crate) linger: Duration,
    pub(crate) efd: RawFd,
    pub(crate) no_imm: bool,
    pub(crate) signal: Arc<progress::Signal>,
    /// The largest active-message header this worker can send.
    pub(crate) max_am_header: usize,
}

// SAFETY: `state` is only accessed while `lock` is held (see `locked`), and the UCX
// worker it holds is in SERIALIZED mode, whose contract is exactly that: any thread,
// one at a time.
unsafe impl Send for WorkerInner {}
// SAFETY: as above.
unsafe impl Sync for WorkerInner {}

/// How many times a busy-poll future progresses the worker before yielding to tokio.
const SPIN: u32 = 512;
/// Progress calls per lock acquisition while spinning.
const SPIN_ROUND: u32 = 32;

impl WorkerInner {
    /// Runs `f` under the worker lock, then wakes the wakers and drops the parked values
    /// it collected, after releasing the lock.
    #[inline(always)]
    pub(crate) fn locked<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let guard = self.lock.lock();
        // SAFETY: the lock is held, so this is the only reference to the state.
        let st = unsafe { &mut *self.state.get() };
        let r = f(st);
        if !st.after.any {
            // The common case on the hot path: nothing to do after unlocking.
            drop(guard);
            return r;
        }
        let after = std::mem::take(&mut st.after);
        drop(guard);
        self.run_after(after);
        r
    }

    /// Does what was collected under the lock, once it is released.
    #[inline(never)]
    fn run_after(&self, after: Deferred) {
        if after.kick {
            self.signal.kick();
        }
        for w in after.wake {
            w.wake();
        }
        drop(after.graveyard);
        for h in after.handlers {
            h.run();
        }
    }

    /// Progresses the worker once if its lock is free, for another worker's drop (see
    /// `live_workers`). Wakes what the progress finished, but leaves active-message
    /// handlers, which run user code, to this worker's own driver, which it kicks.
    fn progress_if_free(&self) -> u32 {
        let Some(guard) = self.lock.try_lock() else { return 0 };
        // SAFETY: the lock is held, so this is the only reference to the state.
        let st = unsafe { &mut *self.state.get() };
        let n = self.progress_locked(st);
        if !st.after.any {
            return n;
        }
        let mut after = std::mem::take(&mut st.after);
        if !after.handlers.is_empty() {
            st.after.handlers = std::mem::take(&mut after.handlers);
            st.after.any = true;
            after.kick = true;
        }
        drop(guard);
        self.run_after(after);
        n
    }

    /// `ucp_worker_progress` plus the work that must happen outside UCX callbacks
    /// (handshake replies, failing endpoints).
    pub(crate) fn progress_locked(&self, st: &mut State) -> u32 {
        // SAFETY: the worker is valid and the lock is held.
        let n = unsafe { sys::ucp_worker_progress(st.handle) };
        if st.chores {
            self.chores(st, n);
        }
        n
    }

    /// After a progress call that found `n` events: wakes waiting probes (when `n > 0`),
    /// sends queued handshake replies, fails endpoints UCX reported.
    #[cold]
    fn chores(&self, st: &mut State, n: u32) {
        if n > 0 {
            st.after.wake_all(&mut st.probe_waiters);
        }
        if !st.outbox.is_empty() {
            for (ep, bytes) in std::mem::take(&mut st.outbox) {
                st.send_handshake(ep, bytes, false);
            }
        }
        if !st.failed.is_empty() {
            // (A failure UCX reports during a bare progress loop, such as the drain in
            // `fail_ep`, is marked here only at the next chores; a close in between prints
            // UCX's flush errors.)
            st.fail_reported();
        }
        if !st.close_first.is_empty() {
            // The peer is closing, or answers this side's `Closing`: what it sent stays
            // readable, this end closes (flushing what it sent) before the peer's own
            // close goes out, and fails as if the peer had disconnected.
            // With operations still running (sends the closing peer will not take), UCX
            // must not be asked to close: in peer mode the close is forced (UCX purges
            // them); otherwise this side asks the peer to close first in turn, and its
            // disconnect makes UCX purge them.
            for id in std::mem::take(&mut st.close_first) {
                st.keep_stream(id);
                let running = st.ops_running(id);
                let Some(e) = st.eps.get(&id) else { continue };
                let (h, peer_mode, lingers) = (e.handle, e.peer_mode, e.linger.is_some());
                if running && !peer_mode && !lingers && !h.is_null() && e.failed.is_none() {
                    st.send_notice(h, Kind::CloseFirst, false, 0);
                } else {
                    if !h.is_null() && e.failed.is_none() && e.by_address {
                        // The peer's end is done once this arrives: nothing else tells an
                        // endpoint made from a worker address that its peer closed. (Through
                        // UCX's connection manager the disconnect does, and the peer must
                        // wait for it: a connecting side that disconnects first over shared
                        // memory leaves one socket of its worker open.)
                        st.send_notice(h, Kind::Closed, peer_mode, 0);
                    }
                    if let Some(p) = st.close_ep(id, running && peer_mode) {
                        st.finish_close(id, p);
                    }
                }
                st.fail_ep(id, Status::CONNECTION_RESET, false);
            }
        }
        if !st.peer_closing.is_empty() {
            // The accepting peer is closing: what it sent stays readable after its
            // disconnect, which it sends once this side answers.
            for id in std::mem::take(&mut st.peer_closing) {
                st.keep_stream(id);
                if let Some(e) = st.eps.get(&id).filter(|e| !e.handle.is_null() && e.failed.is_none()) {
                    let (h, peer_mode) = (e.handle, e.peer_mode);
                    st.send_notice(h, Kind::CloseFirst, peer_mode, 0);
                }
            }
        }
        for id in std::mem::take(&mut st.peer_closed) {
            // The peer's end is gone: this end is done too.
            st.fail_ep(id, Status::CONNECTION_RESET, false);
        }
        if st.lingering.live > 0 || !st.lingering.news.is_empty() {
            // (News of an endpoint no longer lingering, its parked flush finishing, is
            // dropped here.)
            st.tend_lingering();
        }
        // Replies and failures are handled; probes wait for an event, lingering endpoints
        // for their flush, their peer's close or their deadline.
        st.chores = !st.probe_waiters.is_empty() || st.lingering.live > 0 || !st.lingering.news.is_empty();
    }

    /// Arms the worker's event fd (`ucp_worker_arm`). OK: armed, the fd signals the next
    /// event. `UCS_ERR_BUSY`: UCX cannot sleep yet (events arrived in between, or sends
    /// wait for the peer to make room): the caller must let other tasks run and try again,
    /// not spin under the lock.
    pub(crate) fn arm(&self, st: &mut State) -> Status {
        // SAFETY: the worker is valid under the lock and has UCP_FEATURE_WAKEUP.
        Status(unsafe { sys::ucp_worker_arm(st.handle) })
    }

    /// After posting an operation that is still pending: make sure it will be progressed
    /// even if no fd event announces its next step.
    #[inline]
    pub(crate) fn posted(&self) {
        // Both modes: a busy-poll driver also sleeps once the worker has been idle.
        self.signal.kick();
    }

    /// Polls for a result: `check` looks for it under the lock; if it is not there yet,
    /// the worker is progressed (a bounded spin in busy-poll mode; in event mode a spin of
    /// at most [`progress::EVENT_SPIN`], or one call during a quiet period) and
    /// `register` stores the task's waker.
    #[inline]
    pub(crate) fn poll_until<T>(
        &self,
        cx: &mut TaskContext<'_>,
        mut check: impl FnMut(&mut State) -> Option<T>,
        register: impl FnOnce(&mut State, &Waker),
    ) -> Poll<T> {
        match self.mode {
            ProgressMode::BusyPoll => {
                // Spin in rounds: each round holds the lock for up to SPIN_ROUND progress
                // calls (so arrival is noticed within one progress call), then releases it
                // so other threads can post.
                for _ in 0..SPIN / SPIN_ROUND {
                    let r = self.locked(|st| {
                        if let Some(t) = check(st) {
                            return Some(t);
                        }
                        for _ in 0..SPIN_ROUND {
                            if self.progress_locked(st) != 0 {
                                if let Some(t) = check(st) {
                                    return Some(t);
                                }
                            }
                        }
                        check(st)
                    });
                    if let Some(t) = r {
                        return Poll::Ready(t);
                    }
                }
                self.signal.future_yielded();
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            ProgressMode::Event => self.locked(|st| {
                if let Some(t) = check(st) {
                    return Poll::Ready(t);
                }
                // Progress, then sleep. Arming the worker is left to the driver, which
                // does it right before it sleeps: an armed worker makes every sender
                // signal it (a syscall on each side per message), so arming on every
                // poll, as the plain wakeup protocol would, costs several syscalls per
                // message. The driver's arm stays in force while it sleeps: whatever
                // arrives after it makes the event fd readable, whoever progresses it.
                //
                // A short spin catches a reply that is already on its way (a round trip
                // over shared memory is well under a microsecond) without a sleep and a
                // wake-up. After a spin that found nothing, the next ones are skipped for a
                // while, so that many futures polled in turn (a `join_all`) or a slow peer
                // cost one spin, not one each.
                let now = Instant::now();
                if st.spin_quiet_until.map_or(true, |q| now >= q) {
                    let end = now + progress::EVENT_SPIN;
                    loop {
                        for _ in 0..8 {
                            if self.progress_locked(st) != 0 {
                                if let Some(t) = check(st) {
                                    return Poll::Ready(t);
                                }
                            }
                        }
                        let now = Instant::now();
                        if now >= end {
                            st.spin_quiet_until = Some(now + progress::EVENT_SPIN_QUIET);
                            break;
                        }
                    }
                } else {
                    self.progress_locked(st);
                }
                // Checked again whatever the progress calls returned: one that reports no
                // event may still have finished what this future waits for, and no wake-up
                // would follow.
                if let Some(t) = check(st) {
                    return Poll::Ready(t);
                }
                register(st, cx.waker());
                Poll::Pending
            }),
        }
    }
}

/// Every worker of this process, for a worker being dropped to progress the others
/// while it waits for its last operations ([`WorkerInner`]'s `Drop`).
static LIVE: std::sync::Mutex<Vec<Weak<WorkerInner>>> = std::sync::Mutex::new(Vec::new());

/// Adds a new worker to [`LIVE`], forgetting the destroyed ones.
fn register_live(w: &Arc<WorkerInner>) {
    let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(w));
}

/// The workers of this process still alive (not the one being dropped, whose count is
/// already zero).
fn live_workers() -> Vec<Arc<WorkerInner>> {
    // Collected under the lock, dropped after it: dropping the last handle of a worker
    // runs its `Drop`, which takes this lock.
    LIVE.lock().unwrap_or_else(PoisonError::into_inner).iter().filter_map(Weak::upgrade).collect()
}

/// Idle rounds (nothing progressed) a worker being dropped spins, yielding, while it
/// waits for its last operations, before it sleeps [`DROP_IDLE_SLEEP`] between rounds.
const DROP_SPIN_ROUNDS: u32 = 1000;

/// The pause between idle rounds of a worker's drop, once [`DROP_SPIN_ROUNDS`] passed.
const DROP_IDLE_SLEEP: Duration = Duration::from_micros(200);

impl Drop for WorkerInner {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        // Active messages held for ids nobody registered give their payloads back first,
        // while the worker can still tell rendezvous senders (UCX sends that during the
        // release call, or during the wait below).
        // SAFETY: exclusive access (we are in drop); the worker is not destroyed yet.
        unsafe { st.am_unclaimed.release_all(st.handle) };
        // Endpoints still closing through their peer close now, and the hidden ones.
        st.end_all_lingering();
        st.close_hidden();
        // Let parked operations (sends to slow peers, closes of dropped endpoints)
        // finish, bounded. Their peer may be another worker of this process that only
        // this thread would progress (a single-thread runtime, blocked here): other live
        // workers are progressed too, when free.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        let others = if st.parked > 0 || st.closes_waiting_ops > 0 { live_workers() } else { Vec::new() };
        let mut idle = 0u32;
        while (st.parked > 0 || st.closes_waiting_ops > 0) && std::time::Instant::now() < deadline {
            // SAFETY: exclusive access (we are in drop); the worker is valid.
            let mut n = unsafe { sys::ucp_worker_progress(st.handle) };
            // Closes that waited for operations run once those finished (UCX purges them
            // when the endpoint fails: such a close is quiet, as in `chores`).
            st.fail_reported();
            for id in std::mem::take(&mut st.lingering.news) {
                st.run_deferred_close(id);
            }
            for w in &others {
                n += w.progress_if_free();
            }
            if n > 0 {
                idle = 0;
            } else if idle < DROP_SPIN_ROUNDS {
                idle += 1;
                std::thread::yield_now();
            } else {
                // A peer that does not answer (gone, or not progressing) would otherwise
                // cost a whole core for the rest of the wait.
                std::thread::sleep(DROP_IDLE_SLEEP);
            }
        }
        // Closes still waiting for operations: in peer mode forced now (UCX purges the
        // operations); without it UCX offers no way to end them, and destroying the worker
        // would destroy the endpoint with them (UCX 1.13 asserts; without assertions
        // they keep pointing at it), so the UCX worker is left as it is, never progressed
        // again, with its context (see `Worker`).
        let stuck: Vec<u64> = st.eps.iter().filter(|(_, e)| e.close_waits_ops).map(|(&id, _)| id).collect();
        let mut leak = false;
        for id in stuck {
            if st.eps.get(&id).is_some_and(|e| e.peer_mode) {
                st.close_deferred(id, true);
            } else {
                leak = true;
            }
        }
        if leak {
            tracing::warn!(
                "a worker dropped with sends its peer never took, on an endpoint without peer error \
                 handling: UCX cannot end them, so the UCX worker and its context are leaked instead of destroyed"
            );
            std::mem::forget(self.ctx.clone());
            drop(others);
            LIVE.lock().unwrap_or_else(PoisonError::into_inner).retain(|w| w.strong_count() > 0);
            drop(std::mem::take(&mut st.after));
            return;
        }
        // SAFETY: we are in drop, the worker not yet destroyed.
        unsafe { request::give_up_closes(st) };
        if st.parked > 0 {
            tracing::warn!(
                parked = st.parked,
                "destroying a worker with operations UCX never completed; their buffers are leaked, not freed"
            );
        }
        for (id, e) in st.eps.iter() {
            if !e.handle.is_null() {
                tracing::warn!(ep = id, "endpoint still open at worker destruction");
            }
        }
        // SAFETY: every endpoint, listener and operation holds the worker alive, so none is
        // left except parked requests, whose memory UCX reclaims here; the event fd's
        // AsyncFd was dropped with the driver before this runs.
        unsafe { sys::ucp_worker_destroy(st.handle) };
        if !st.am_ids.is_null() {
            // SAFETY: the worker that used the table is destroyed; freed once.
            unsafe { crate::am::free_id_table(st.am_ids) };
        }
        // Dropped only now: if one of them was the last handle of its worker, that
        // worker's drop runs here, with this worker gone, instead of inside the wait
        // above, where this worker could no longer be progressed for it.
        drop(others);
        // Forget this worker (and any other gone), so that its memory is freed.
        LIVE.lock().unwrap_or_else(PoisonError::into_inner).retain(|w| w.strong_count() > 0);
        drop(std::mem::take(&mut st.after));
    }
}

/// Endpoint error callback (`ucp_err_handler_cb_t`): `arg` is the worker State.
pub(crate) unsafe extern "C" fn ep_err_cb(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: UCX invokes this inside a call made under the worker lock; arg is the State.
    let st = unsafe { &mut *arg.cast::<State>() };
    if let Some(&id) = st.by_handle.get(&(ep as usize)) {
        // Handled after the progress call returns: canceling and closing from inside a
        // UCX callback is not allowed.
        st.failed.push((id, Status(status)));
        st.chores = true;
    }
}

/// The handshake's active-message handler.
unsafe extern "C" fn handshake_am_cb(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX inside progress under the worker lock; arg is the State; param
    // is valid for the call.
    let (st, param) = unsafe { (&mut *arg.cast::<State>(), &*param) };
    let reply_ep = param.reply_ep;
    if param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0 || data.is_null() {
        st.bad_handshakes += 1;
        tracing::warn!(len, "oversized handshake message dropped");
        return sys::UCS_OK;
    }
    // SAFETY: eager data is readable for `len` bytes during the callback.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
    let me = ProcessIdentity::current();
    match Message::decode(bytes) {
        Err(reason) => {
            st.bad_handshakes += 1;
            tracing::warn!(%reason, "malformed handshake message");
            // Fail the handshake waiting on this connection, if any.
            let key = reply_ep as usize;
            let ep_id = st.by_handle.get(&key).copied();
            let waiting = st
                .accepts
                .get_mut(&key)
                .or_else(|| st.connects.values_mut().find(|w| Some(w.ep) == ep_id && w.result.is_none()));
            if let Some(w) = waiting {
                w.result = Some(Err(format!("the peer sent a malformed handshake: {reason}")));
                if let Some(k) = w.waker.take() {
                    st.after.wake(k);
                }
            }
            if !reply_ep.is_null() {
                let nack = Message {
                    kind: Kind::Nack(NackReason::Malformed),
                    peer_mode: false,
                    nonce: 0,
                    identity: me,
                };
                st.reply(reply_ep, nack);
            }
        }
        Ok(m) => match m.kind {
            Kind::FrontHello => {
                if reply_ep.is_null() {
                    st.bad_handshakes += 1;
                    return sys::UCS_OK;
                }
                match st.front_accepts.get_mut(&m.nonce) {
                    Some(w) => {
                        // Answered once the accept took the endpoint over (see `pairing`).
                        w.hellos.push_back((reply_ep, m.peer_mode));
                        if let Some(k) = w.waker.take() {
                            st.after.wake(k);
                        }
                    }
                    None => {
                        // No accept waits for this connection (it gave up, or never was).
                        st.bad_handshakes += 1;
                        let nack = Message {
                            kind: Kind::Nack(NackReason::Malformed),
                            peer_mode: m.peer_mode,
                            nonce: m.nonce,
                            identity: me,
                        };
                        st.reply(reply_ep, nack);
                    }
                }
            }
            Kind::Hello => {
                if reply_ep.is_null() {
                    st.bad_handshakes += 1;
                    return sys::UCS_OK;
                }
                let mut kind = Kind::Ack;
                if let Some(w) = st.accepts.get_mut(&(reply_ep as usize)) {
                    if w.expect.is_some_and(|n| n != m.nonce) {
                        kind = Kind::Nack(NackReason::Malformed);
                        w.result = Some(Err("a hello for another connection".into()));
                    } else if w.peer_mode != m.peer_mode {
                        kind = Kind::Nack(NackReason::ErrorModeMismatch);
                        w.result = Some(Err(format!(
                            "error mode mismatch: the client uses {}, this side {}",
                            mode_name(m.peer_mode),
                            mode_name(w.peer_mode)
                        )));
                    } else {
                        w.result = Some(Ok(m.identity));
                    }
                    if let Some(k) = w.waker.take() {
                        st.after.wake(k);
                    }
                }
                let peer_mode = m.peer_mode;
                st.reply(reply_ep, Message { kind, peer_mode, nonce: m.nonce, identity: me });
            }
            Kind::StreamEnd => {
                let id = st.by_handle.get(&(reply_ep as usize)).copied();
                match id.and_then(|id| st.eps.get_mut(&id)) {
                    Some(e) => {
                        e.stream_end = Some(m.nonce);
                        st.after.wake_all(&mut e.stream_waiters);
                    }
                    None => tracing::debug!("stream end notice for no known endpoint"),
                }
            }
            Kind::CloseFirst => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // Closed after the progress call: not from inside a UCX callback.
                    st.close_first.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("close-first notice for no known endpoint"),
            },
            Kind::Closing => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // Answered after the progress call: not from inside a UCX callback.
                    st.peer_closing.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("closing notice for no known endpoint"),
            },
            Kind::Closed => match st.by_handle.get(&(reply_ep as usize)).copied() {
                Some(id) => {
                    // The peer closed its end, as asked: this end is done, as if UCX had
                    // reported the peer's disconnect (handled after the progress call).
                    st.peer_closed.push(id);
                    st.chores = true;
                }
                None => tracing::debug!("closed notice for no known endpoint"),
            },
            Kind::Ack | Kind::Nack(_) => {
                if let Some(w) = st.connects.get_mut(&m.nonce) {
                    w.result = Some(match m.kind {
                        Kind::Nack(r) => Err(r.describe().to_string()),
                        _ if m.peer_mode != w.peer_mode => Err(format!(
                            "error mode mismatch: the peer uses {}, this side {}",
                            mode_name(m.peer_mode),
                            mode_name(w.peer_mode)
                        )),
                        _ => Ok(m.identity),
                    });
                    if let Some(k) = w.waker.take() {
                        st.after.wake(k);
                    }
                } else if let (Kind::Nack(_), Some(id)) =
                    (m.kind, st.by_handle.get(&(reply_ep as usize)).copied())
                {
                    // A peer that does not know the close notice (an older ucxkit)
                    // refused it: this side closes now instead of waiting for it.
                    st.linger_refused(id);
                } else {
                    tracing::debug!(nonce = m.nonce, "handshake reply for no pending connect");
                }
            }
        },
    }
    sys::UCS_OK
}

fn mode_name(peer: bool) -> &'static str {
    if peer {
        "ErrorMode::Peer"
    } else {
        "ErrorMode::None"
    }
}

/// `Worker` must stay usable from multi-thread runtimes.
const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<Worker>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use crate::error::ErrorKind;

    fn ctx() -> Context {
        Context::builder().transports("tcp,self").config("NET_DEVICES", "lo").build().unwrap()
    }

    fn send_garbage(ep: &Endpoint, bytes: &[u8]) {
        ep.with_handle("test", |st, h| {
            st.send_handshake(h, bytes.to_vec(), true);
            Ok(())
        })
        .unwrap();
    }

    fn no_handshake() -> EndpointOptions {
        EndpointOptions { handshake: false, ..Default::default() }
    }

    #[tokio::test]
    async fn garbage_hello_fails_the_accept_not_the_process() {
        let c = ctx();
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        // UCX's own listener, its accepts waiting for the client's hello (as the front's
        // one-shot accepts do).
        let l = server.listen_ucx("127.0.0.1:0".parse().unwrap(), EndpointOptions::default()).unwrap();
        let addr = l.local_addr();
        let accept = tokio::spawn(async move {
            let r = l.accept().await;
            (r, l)
        });
        let ep = client.connect_with(addr, no_handshake()).await.unwrap();
        send_garbage(&ep, b"GET / HTTP/1.1\r\n\r\n");
        let (r, _l) = accept.await.unwrap();
        let err = r.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("malformed"), "{err}");
        assert_eq!(server.bad_handshakes(), 1);
        // Both workers still work: a fresh connection succeeds.
        let l2 = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let (a, b) = tokio::join!(l2.accept(), client.connect(l2.local_addr()));
        a.unwrap();
        b.unwrap();
    }

    #[tokio::test]
    async fn garbage_reply_fails_the_connect() {
        let c = ctx();
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        let l = server.listen_with("127.0.0.1:0".parse().unwrap(), no_handshake()).unwrap();
        let (s, ep) = tokio::join!(l.accept(), client.connect_with(l.local_addr(), no_handshake()));
        let (s, ep) = (s.unwrap(), ep.unwrap());
        // The client waits for a handshake answer; the server answers with garbage.
        let id = ep.inner.id;
        ep.with_handle("test", |st, _| {
            st.connects.insert(
                77,
                HsWait { waker: None, result: None, peer_mode: ep.inner.peer_mode, ep: id, expect: None },
            );
            Ok(())
        })
        .unwrap();
        let mut junk = crate::handshake::Message {
            kind: Kind::Ack,
            peer_mode: false,
            nonce: 77,
            identity: ProcessIdentity::current(),
        }
        .encode();
        junk[4] = 200; // unknown version
        send_garbage(&s, &junk);
        let err = ep.await_hs_for_test(77).await.unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
        assert_eq!(client.bad_handshakes(), 1);
    }
}
