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

use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, Status};
use crate::handshake::{self, Kind, Message, NackReason};
use crate::identity::ProcessIdentity;
use crate::liveness::{Keepalive, KeepaliveAddr, KeepaliveLane};
use crate::lock::RawLock;

use crate::slot::{OpKind, Slot};
use crate::ucx_log;

mod crowding;
mod eps;
mod handshake_dispatch;
mod inner;
mod options;
pub(crate) mod param;
mod parting;
pub(crate) mod progress;
pub(crate) mod request;
mod state;
mod waiters;

pub(crate) use eps::*;
use handshake_dispatch::*;
pub(crate) use inner::*;
pub use options::{EndpointOptions, ErrorMode, MAX_CONNECT_PAYLOAD};
pub(crate) use parting::*;
pub use progress::{
    ProgressMode, BUSY_IDLE, CROWDED_SPIN, CROWDED_YIELD, DEFAULT_BUSY_SPIN, DEFAULT_LINGER, EVENT_SPIN,
    EVENT_SPIN_QUIET,
};
pub(crate) use state::*;
pub(crate) use waiters::{Leave, List, Place, Waiters};

impl Context {
    /// A builder for a worker on this context.
    pub fn worker(&self) -> WorkerBuilder {
        WorkerBuilder::new(self.clone())
    }

    /// Creates a worker with default settings. Must be called inside a tokio runtime.
    pub fn create_worker(&self) -> Result<Worker> {
        self.worker().build()
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
    namespaces: bool,
    busy_spin: u32,
    busy_yield: Duration,
    keepalive: Option<Keepalive>,
}

impl WorkerBuilder {
    pub(crate) fn new(ctx: Context) -> Self {
        WorkerBuilder {
            ctx,
            mode: ProgressMode::Event,
            endpoint: EndpointOptions::default(),
            no_imm: false,
            linger: progress::DEFAULT_LINGER,
            namespaces: true,
            busy_spin: DEFAULT_BUSY_SPIN,
            busy_yield: Duration::ZERO,
            keepalive: Some(Keepalive::default()),
        }
    }

    /// The keepalive that fails an endpoint whose peer across the network went silent
    /// (its link down, its host frozen or gone), within `timeout` plus one `interval`
    /// (see [`crate::liveness`]; default [`Keepalive::default`]: 1 s, 10 s). `None` turns
    /// it off: the worker then opens no UDP socket and starts no thread, and such a peer
    /// is found only by UCX (UCX 1.22's TCP user timeout) or the application's deadlines.
    /// The settings are checked when the worker is built ([`Error::ApiMisuse`]).
    pub fn keepalive(mut self, keepalive: Option<Keepalive>) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Busy-poll mode: how many times a waiting future progresses the worker without
    /// result (for at most 20 µs, however slow the calls) before it yields the processor
    /// (`sched_yield`) and lets tokio run other tasks, or spins again within
    /// [`WorkerBuilder::busy_yield`] (default [`DEFAULT_BUSY_SPIN`]; at least 1). Lower it where more
    /// busy-polling processes than processors share the machine, so that the one a
    /// message waits for gets to run sooner; see also [`Worker::set_busy_spin`]. Where
    /// the worker's driver finds the host crowded, [`CROWDED_SPIN`] and
    /// [`CROWDED_YIELD`] hold at the most.
    pub fn busy_spin(mut self, progress_calls: u32) -> Self {
        self.busy_spin = progress_calls.max(1);
        self
    }

    /// Busy-poll mode: how long a waiting future keeps spinning within one poll after
    /// its first fruitless spin, yielding the processor (`sched_yield`) between spins,
    /// before it lets tokio run other tasks (default zero: at once; at most a second;
    /// counted in whole microseconds, a nonzero time at least one).
    /// Where busy ranks outnumber the processors, tens of microseconds save the turn
    /// through the runtime that each yield costs otherwise (a future run by `block_on`
    /// is polled again only after the runtime polled its I/O driver, a system call);
    /// the runtime's other tasks wait that long. See also [`Worker::set_busy_yield`].
    pub fn busy_yield(mut self, time: Duration) -> Self {
        self.busy_yield = time;
        self
    }

    /// Event mode: how long the driver keeps progressing the worker after the last event
    /// before it arms the event fd and sleeps (default [`crate::DEFAULT_LINGER`]; zero
    /// sleeps at once). An answer that arrives within the linger is picked up without a
    /// sleep and a wake-up, which cost several microseconds each; the price is at most
    /// this much CPU time after each burst of traffic. An idle worker uses no CPU; on a
    /// crowded host (more threads ready to run than cores, or the driver's thread waits
    /// for a core over a tenth of the time) the linger yields the processor between its
    /// polls.
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

    /// Whether layers may claim [`crate::namespace`]s on this worker (default true).
    /// Off, the application's calls take all 64 tag bits and active-message ids up to
    /// 4094, as plain UCX peers may use them, and [`Worker::namespace`] is refused.
    pub fn namespaces(mut self, on: bool) -> Self {
        self.namespaces = on;
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

    /// Creates the worker, with the active-message layer's tables that `install_am` makes
    /// installed before anything can progress it, and spawns its progress driver on the
    /// current tokio runtime (see [`WorkerBuilder::build`]).
    pub(crate) fn build_with(
        self,
        install_am: impl FnOnce(sys::ucp_worker_h, *mut State) -> std::result::Result<Box<dyn AmPart>, Status>,
    ) -> Result<Worker> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::ApiMisuse("Worker::build must run inside a tokio runtime".into()))?;
        if let Some(k) = &self.keepalive {
            k.check().map_err(Error::ApiMisuse)?;
        }
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
            namespaces: self.namespaces,
            busy_spin: std::sync::atomic::AtomicU32::new(self.busy_spin),
            busy_yield_us: std::sync::atomic::AtomicU32::new(progress::busy_yield_us(self.busy_yield)),
            crowded: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "cuda")]
            device: std::sync::OnceLock::new(),
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
        let tables = install_am(handle, state_ptr.cast()).map_err(Error::CreateWorker)?;
        inner.locked(|st| st.am = Some(tables));
        // Before the driver starts: a failure here drops the worker whole.
        let own_address = inner.locked(|st| ucx_address_of(st.handle))?;
        // A worker without its keepalive still works: its peers are then found as before.
        let lane = self.keepalive.and_then(|k| match KeepaliveLane::start(k, rt.clone()) {
            Ok(lane) => Some(lane),
            Err(e) => {
                tracing::warn!("no keepalive for this worker: {e}");
                None
            }
        });
        inner.locked(|st| st.lane = lane.as_ref().map(|l| l.addr()));
        // Only now may another thread progress it (see `live_workers`).
        register_live(&inner);
        rt.spawn(progress::drive(inner.clone(), inner.signal.clone()));
        let id = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(worker = id, mode = ?self.mode, "worker created");
        let uuid = crate::ucx_address::uuid_of(&own_address);
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
                namespaces: std::sync::Mutex::new(0),
                closers: std::sync::Mutex::new(Vec::new()),
                shut: std::sync::atomic::AtomicBool::new(false),
                lane,
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
    /// The namespaces claimed (bit n: namespace n; see [`crate::namespace`]).
    namespaces: std::sync::Mutex<u128>,
    /// What [`Worker::shutdown`] closes besides endpoints: the listeners.
    pub(crate) closers: std::sync::Mutex<Vec<std::sync::Weak<dyn Closer>>>,
    /// [`Worker::shutdown`] ran: no new listener or connection.
    pub(crate) shut: std::sync::atomic::AtomicBool,
    /// The keepalive lane, where it is on.
    pub(crate) lane: Option<Arc<KeepaliveLane>>,
}

/// Something of a worker that [`Worker::shutdown`] closes while handles to it may live
/// on (a listener).
pub(crate) trait Closer: Send + Sync {
    /// Stops it; idempotent.
    fn close(&self);
}

impl Drop for WorkerShared {
    fn drop(&mut self) {
        if let Some(u) = self.uuid {
            own_workers().remove(&u);
        }
        self.inner.signal.shutdown();
        if let Some(lane) = &self.lane {
            lane.stop();
        }
    }
}

impl Worker {
    /// This worker's address in UCX's own form (`ucp_worker_get_address`).
    pub(crate) fn ucx_address(&self) -> Result<Vec<u8>> {
        self.shared.inner.locked(|st| ucx_address_of(st.handle))
    }

    /// The UDP port of this worker's keepalive lane (on every address of the host), for
    /// firewalls between hosts; `None` where the keepalive is off (see
    /// [`WorkerBuilder::keepalive`]).
    pub fn keepalive_port(&self) -> Option<u16> {
        self.shared.lane.as_ref().map(|l| l.addr().port)
    }

    /// Refuses `op` after [`Worker::shutdown`].
    pub(crate) fn check_open(&self, op: &str) -> Result<()> {
        if self.shared.shut.load(Ordering::Acquire) {
            return Err(Error::ApiMisuse(format!("{op} on a worker that was shut down")));
        }
        Ok(())
    }

    /// Registers `c` to be closed by [`Worker::shutdown`].
    pub(crate) fn add_closer(&self, c: std::sync::Weak<dyn Closer>) {
        let mut v = self.shared.closers.lock().unwrap_or_else(PoisonError::into_inner);
        v.retain(|w| w.strong_count() > 0);
        v.push(c);
    }

    /// Claims namespace `n` (see [`crate::Worker::namespace`]); false when it is claimed.
    pub(crate) fn claim_namespace(&self, n: u8) -> bool {
        let mut claimed = self.shared.namespaces.lock().unwrap_or_else(PoisonError::into_inner);
        let bit = 1u128 << n;
        let free = *claimed & bit == 0;
        *claimed |= bit;
        free
    }

    /// Gives namespace `n` back.
    pub(crate) fn release_namespace(&self, n: u8) {
        *self.shared.namespaces.lock().unwrap_or_else(PoisonError::into_inner) &= !(1u128 << n);
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

    /// Whether `other` is a handle of this same worker.
    pub fn same_as(&self, other: &Worker) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// The context this worker belongs to.
    pub fn context(&self) -> Context {
        Context { inner: self.shared.inner.ctx.clone() }
    }

    /// The progress mode.
    pub fn progress_mode(&self) -> ProgressMode {
        self.shared.inner.mode
    }

    /// Sets [`WorkerBuilder::busy_spin`] from now on (for futures that start waiting
    /// afterwards, and the next round of those waiting).
    pub fn set_busy_spin(&self, progress_calls: u32) {
        self.shared.inner.busy_spin.store(progress_calls.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The current [`WorkerBuilder::busy_spin`].
    pub fn busy_spin(&self) -> u32 {
        self.shared.inner.busy_spin.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets [`WorkerBuilder::busy_yield`] from now on.
    pub fn set_busy_yield(&self, time: Duration) {
        self.shared
            .inner
            .busy_yield_us
            .store(progress::busy_yield_us(time), std::sync::atomic::Ordering::Relaxed);
    }

    /// The current [`WorkerBuilder::busy_yield`].
    pub fn busy_yield(&self) -> Duration {
        let us = self.shared.inner.busy_yield_us.load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_micros(u64::from(us))
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
        self.shared.inner.locked(|st| st.parked + st.parting_count() + st.closes_waiting_ops)
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

    /// A waker whose clones have another vtable than itself, as tokio's `block_on`
    /// waker has in a release build (a borrowed one and its owned clones): `will_wake`
    /// tells the two apart although they wake the same task.
    fn two_faced_waker() -> std::task::Waker {
        use std::task::{RawWaker, RawWakerVTable, Waker};
        fn clone(d: *const ()) -> RawWaker {
            RawWaker::new(d, &OWNED)
        }
        fn noop(_: *const ()) {}
        static OWNED: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
        static BORROWED: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
        static TASK: u8 = 0;
        // SAFETY: the vtable's functions do nothing with the pointer, which stays valid.
        unsafe { Waker::from_raw(RawWaker::new(std::ptr::addr_of!(TASK).cast(), &BORROWED)) }
    }

    /// Futures polled again and again with such a waker keep one waker each in the
    /// endpoint's list, and dropped ones none.
    #[test]
    fn waiting_futures_keep_one_waker_each_however_often_polled() {
        use std::future::Future;
        use tokio::io::AsyncRead;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _in_rt = rt.enter();
        let c = ctx();
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        let (_s, ep) = rt.block_on(async {
            let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
            let (s, ep) = tokio::join!(l.accept(), client.connect(l.local_addr()));
            (s.unwrap(), ep.unwrap())
        });
        let id = ep.inner.id;
        let waiting =
            || client.shared.inner.locked(|st| st.eps.get(&id).map_or(0, |e| e.stream_waiters.len()));
        let waker = two_faced_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let mut failed = std::pin::pin!(ep.failed());
        let mut stream = crate::stream::UcxStream::new(ep.clone());
        for _ in 0..1000 {
            assert!(failed.as_mut().poll(&mut cx).is_pending());
            let mut buf = [0u8; 8];
            let mut rb = tokio::io::ReadBuf::new(&mut buf);
            assert!(std::pin::Pin::new(&mut stream).poll_read(&mut cx, &mut rb).is_pending());
        }
        assert_eq!(waiting(), 2, "one waker for each of two futures");
        drop(stream);
        assert_eq!(waiting(), 1, "one waker for the one future left");
        // Futures made, polled and dropped one after another leave nothing behind.
        for _ in 0..100 {
            assert!(std::pin::pin!(ep.failed()).poll(&mut cx).is_pending());
        }
        assert_eq!(waiting(), 1);
    }

    /// Hellos for a waiting front accept beyond what collisions explain are dropped and
    /// counted: the queue stays bounded whatever a client sends.
    #[tokio::test]
    async fn a_flood_of_hellos_is_bounded() {
        let c = ctx();
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        let l = server.listen_with("127.0.0.1:0".parse().unwrap(), no_handshake()).unwrap();
        let (s, ep) = tokio::join!(l.accept(), client.connect_with(l.local_addr(), no_handshake()));
        let (_s, ep) = (s.unwrap(), ep.unwrap());
        server.shared.inner.locked(|st| {
            st.front_accepts.insert(55, FrontWait { hellos: Default::default(), waker: None });
        });
        let hello = crate::handshake::Message {
            kind: Kind::FrontHello,
            peer_mode: false,
            nonce: 55,
            identity: ProcessIdentity::current(),
            lane: None,
        };
        let sent = 100u64;
        for _ in 0..sent {
            send_garbage(&ep, &hello.encode());
        }
        let cap = handshake::MAX_COLLISIONS as usize + 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let queued = server.shared.inner.locked(|st| st.front_accepts[&55].hellos.len());
            assert!(queued <= cap, "{queued} hellos queued");
            if queued as u64 + server.bad_handshakes() == sent {
                assert_eq!(queued, cap);
                break;
            }
            assert!(Instant::now() < deadline, "hellos lost: {queued} queued");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A client endpoint that waits for the answer to its hello `nonce` gets `answer`
    /// from the server: the error its connect ends with, and the client's count of bad
    /// handshake messages.
    async fn connect_answered(nonce: u64, answer: Vec<u8>) -> (Error, u64) {
        let c = ctx();
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        let l = server.listen_with("127.0.0.1:0".parse().unwrap(), no_handshake()).unwrap();
        let (s, ep) = tokio::join!(l.accept(), client.connect_with(l.local_addr(), no_handshake()));
        let (s, ep) = (s.unwrap(), ep.unwrap());
        let id = ep.inner.id;
        ep.with_handle("test", |st, _| {
            st.connects.insert(
                nonce,
                HsWait { waker: None, result: None, peer_mode: ep.inner.peer_mode, ep: id, expect: None },
            );
            Ok(())
        })
        .unwrap();
        send_garbage(&s, &answer);
        let err = ep.await_hs_for_test(nonce).await.unwrap_err();
        (err, client.bad_handshakes())
    }

    fn message(kind: Kind, nonce: u64) -> crate::handshake::Message {
        crate::handshake::Message {
            kind,
            peer_mode: false,
            nonce,
            identity: ProcessIdentity::current(),
            lane: None,
        }
    }

    /// An older ucxkit, which reads handshake version 1 only, refuses a hello with a
    /// keepalive lane without its nonce: the connect waiting on that endpoint fails at
    /// once, saying so, instead of at its timeout.
    #[tokio::test]
    async fn a_refusal_from_an_older_peer_fails_the_connect_at_once() {
        let (err, _) = connect_answered(78, message(Kind::Nack(NackReason::Malformed), 0).encode()).await;
        assert!(err.to_string().contains("older ucxkit"), "{err}");
    }

    #[tokio::test]
    async fn garbage_reply_fails_the_connect() {
        let mut junk = message(Kind::Ack, 77).encode();
        junk[4] = 200; // unknown version
        let (err, bad) = connect_answered(77, junk).await;
        assert!(err.to_string().contains("malformed"), "{err}");
        assert_eq!(bad, 1);
    }
}
