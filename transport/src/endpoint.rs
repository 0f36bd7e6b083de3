//! [`Endpoint`]: a connection to one peer (`ucp_ep_h`), made by socket address
//! ([`Worker::connect`]), by worker address ([`Worker::connect_address`]) or accepted by
//! a [`crate::Listener`].

use std::future::poll_fn;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use ucx_sys as sys;

use crate::address::WorkerAddress;
use crate::error::{Error, Peer, Result, Status};
use crate::handshake::{Kind, Message};
use crate::identity::ProcessIdentity;
use crate::liveness::PidWatch;
use crate::request::{Completion, Posted, Request};
use crate::worker::{self, EndpointOptions, EpState, HsWait, State, Worker};

pub(crate) struct EndpointInner {
    pub(crate) worker: Worker,
    pub(crate) id: u64,
    pub(crate) peer: Peer,
    pub(crate) peer_mode: bool,
    /// The handle while usable, NULL once closed or failed (see `EpState::usable`).
    usable: Arc<AtomicPtr<sys::ucp_ep>>,
    identity: Mutex<Option<ProcessIdentity>>,
    watch: Mutex<Option<tokio::task::AbortHandle>>,
    /// The peer worker's UCX uuid, 0 while unknown (see [`Endpoint::reaches_this_process`]).
    peer_uuid: AtomicU64,
}

impl EndpointInner {
    /// The notice with which closing this endpoint goes through the peer (see
    /// [`Endpoint::close`]), if it does: a connection made through a listener, with the
    /// handshake (the peer is ucxkit). The connecting side asks the peer to close first,
    /// the accepting side tells it that it is closing.
    fn close_notice(&self) -> Option<Kind> {
        self.identity.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?;
        match self.peer {
            Peer::Socket(_) => Some(Kind::CloseFirst),
            Peer::Accepted(_) => Some(Kind::Closing),
            Peer::Address(_) | Peer::Any => None,
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        if let Some(w) = self.watch.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.abort();
        }
        let id = self.id;
        // As `Endpoint::close` does, but in the background.
        let notice = self.close_notice();
        let inner = &self.worker.shared.inner;
        let lingers = inner.locked(|st| {
            if st.lingers(id) || st.eps.get(&id).is_some_and(|e| e.hidden) {
                // A `close()` given up on while it closes through the peer: it goes on.
                // Or a hidden endpoint, kept for its peer (see `Endpoint::hide`).
                return false;
            }
            let open = st.eps.get(&id).is_some_and(|e| !e.handle.is_null());
            if open && notice.is_some_and(|k| st.linger(id, k)) {
                tracing::debug!(ep = id, "endpoint dropped without close(): closing through the peer");
                return true;
            }
            if open {
                tracing::debug!(ep = id, "endpoint dropped without close(): closing in the background");
                st.close_unwaited(id);
            }
            st.forget_ep(id);
            false
        });
        if lingers {
            // The driver moves it on (the flush, the peer's disconnect, the deadline).
            inner.signal.kick();
        }
    }
}

/// A connection to one peer.
///
/// Cheap to clone; clones share the connection. Dropping the last clone closes the
/// endpoint in the background (flushing what was sent; on a listener connection made
/// with the handshake, through the peer, as [`Endpoint::close`] describes);
/// [`Endpoint::close`] does it explicitly and waits.
#[derive(Clone)]
pub struct Endpoint {
    pub(crate) inner: Arc<EndpointInner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.inner.id)
            .field("peer", &self.inner.peer)
            .field("peer_mode", &self.inner.peer_mode)
            .finish()
    }
}

/// Whether `ip` is an address of this host (in this network namespace).
pub(crate) fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

pub(crate) fn sockaddr_of(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Reads a socket address UCX wrote into a `sockaddr_storage`.
pub(crate) fn socket_addr_from(ss: &sys::sockaddr_storage) -> Option<SocketAddr> {
    let p = (ss as *const sys::sockaddr_storage).cast::<libc::sockaddr_storage>();
    // SAFETY: both types are the same C struct; UCX filled it in.
    let ss = unsafe { &*p };
    match ss.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says sockaddr_in.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says sockaddr_in6.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port)))
        }
        _ => None,
    }
}

/// What a new UCX endpoint connects to.
pub(crate) enum Target<'a> {
    Socket(&'a SocketAddr),
    Address(&'a WorkerAddress),
    Request(sys::ucp_conn_request_h),
}

impl Endpoint {
    /// The handle of an endpoint already registered with `worker` (one the front took
    /// over, see [`crate::pairing`]).
    pub(crate) fn from_registered(worker: &Worker, id: u64, peer: Peer, peer_mode: bool) -> Endpoint {
        let usable = worker.shared.inner.locked(|st| st.eps.get(&id).map(|e| e.usable.clone()));
        let inner = Arc::new(EndpointInner {
            worker: worker.clone(),
            id,
            peer,
            peer_mode,
            usable: usable.unwrap_or_default(),
            identity: Mutex::new(None),
            watch: Mutex::new(None),
            peer_uuid: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        worker.shared.inner.locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.endpoint = weak;
            }
        });
        Endpoint { inner }
    }
}

impl Worker {
    /// Creates the UCX endpoint and registers it; no handshake yet.
    pub(crate) fn create_ep(&self, target: Target<'_>, peer: Peer, peer_mode: bool) -> Result<Endpoint> {
        self.create_ep_with(target, peer, peer_mode, None)
    }

    /// [`Worker::create_ep`]; with `await_hello` (`Some(expect)`: a hello with nonce
    /// `expect` only, or any), the endpoint is registered as waiting for the client's
    /// hello in the same critical section that creates it, so a hello that arrives
    /// before [`Endpoint::server_handshake`] runs is not missed.
    pub(crate) fn create_ep_with(
        &self,
        target: Target<'_>,
        peer: Peer,
        peer_mode: bool,
        await_hello: Option<Option<u64>>,
    ) -> Result<Endpoint> {
        let state_ptr = self.state_ptr();
        let mut params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE.0 | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER.0)
                as u64,
            err_mode: if peer_mode {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler_t { cb: Some(worker::ep_err_cb), arg: state_ptr },
            ..Default::default()
        };
        let storage;
        match target {
            Target::Socket(addr) => {
                storage = sockaddr_of(addr);
                params.field_mask |=
                    (sys::UCP_EP_PARAM_FIELD_SOCK_ADDR.0 | sys::UCP_EP_PARAM_FIELD_FLAGS.0) as u64;
                params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER.0 as u32;
                params.sockaddr = sys::ucs_sock_addr_t {
                    addr: (&storage.0 as *const libc::sockaddr_storage).cast(),
                    addrlen: storage.1,
                };
            }
            Target::Address(a) => {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 as u64;
                params.address = a.ucx_bytes().as_ptr().cast();
            }
            Target::Request(r) => {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST.0 as u64;
                params.conn_request = r;
            }
        }
        let by_address = matches!(target, Target::Address(_));
        let usable = Arc::new(AtomicPtr::new(std::ptr::null_mut()));
        let id = self.shared.inner.locked(|st| {
            let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
            // SAFETY: the worker is valid under the lock; params and what they point to
            // (sockaddr storage, address bytes) live until the call returns; the error
            // handler's arg is the worker State, which outlives every endpoint.
            let status = Status(unsafe { sys::ucp_ep_create(st.handle, &params, &mut ep) });
            status.check().map_err(|s| match s {
                s if s == Status::UNREACHABLE => Error::Unreachable { peer: peer.clone(), source: s },
                s => Error::Connect { peer: peer.clone(), source: s },
            })?;
            let id = st.new_id();
            usable.store(ep, Ordering::Relaxed);
            let mut e = EpState::new(ep, peer_mode, usable.clone());
            e.by_address = by_address;
            st.eps.insert(id, e);
            st.by_handle.insert(ep as usize, id);
            if let Some(expect) = await_hello {
                st.accepts
                    .insert(ep as usize, HsWait { waker: None, result: None, peer_mode, ep: id, expect });
            }
            Ok::<u64, Error>(id)
        })?;
        tracing::debug!(ep = id, %peer, peer_mode, "endpoint created");
        let inner = Arc::new(EndpointInner {
            worker: self.clone(),
            id,
            peer,
            peer_mode,
            usable,
            identity: Mutex::new(None),
            watch: Mutex::new(None),
            peer_uuid: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        self.shared.inner.locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.endpoint = weak;
            }
        });
        Ok(Endpoint { inner })
    }

    /// Connects to a [`crate::Listener`] at `addr` with this worker's default
    /// [`EndpointOptions`].
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Endpoint> {
        self.connect_with(addr, self.shared.endpoint.clone()).await
    }

    /// Connects to a [`crate::Listener`] at `addr`.
    ///
    /// With the handshake on (the default), goes through the listener's front (see
    /// [`crate::front`]) and returns once the peer has accepted the connection and
    /// answered; a closed port, an unreachable host, a refusal or a peer that never
    /// answers is an error ([`Error::Unreachable`], [`Error::Refused`],
    /// [`Error::Authentication`], [`Error::Timeout`]). With it off (a plain UCX server,
    /// reached through UCX's connection manager), returns once UCX has wired the
    /// endpoint up with the server, within `opts.timeout` as well.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_with(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Endpoint> {
        if opts.handshake {
            return crate::front::client::connect(self, addr, &opts).await;
        }
        let shm = is_local_ip(addr.ip()) && self.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let ep = self.create_ep(Target::Socket(&addr), Peer::Socket(addr), peer_mode)?;
        ep.await_wired(opts.timeout, "connect").await?;
        ep.check_required(&opts.require_transports)?;
        Ok(ep)
    }

    /// Connects to the worker whose address is `addr` with the default options.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_address(&self, addr: &WorkerAddress) -> Result<Endpoint> {
        self.connect_address_with(addr, self.shared.endpoint.clone()).await
    }

    /// Connects to the worker whose address is `addr`. The other side needs no listener:
    /// its worker answers the handshake by itself. A worker whose context has a secret
    /// connects only to addresses sealed with it ([`Error::Authentication`] otherwise);
    /// the UCX address inside is checked before UCX parses it ([`Error::BadAddress`]).
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_address_with(
        &self,
        addr: &WorkerAddress,
        opts: EndpointOptions,
    ) -> Result<Endpoint> {
        let peer = Peer::Address(addr.fingerprint());
        match self.context().secret() {
            // Sealed by a peer holding the secret: its header is checked (UCX aborts on
            // an unknown format), the rest is the peer's word.
            Some(secret) if addr.verify(secret) => {
                crate::address::check_ucx_address(addr.ucx_bytes())
                    .map_err(|reason| Error::BadAddress { reason })?;
            }
            Some(_) => {
                return Err(Error::Authentication {
                    peer,
                    reason: "the worker address carries no valid MAC under this context's secret".into(),
                })
            }
            None => self.check_peer_address(addr.ucx_bytes())?,
        }
        let shm = crate::front::shares_memory(&addr.identity())
            && addr.has_shared_memory()
            && self.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let ep = self.create_ep(Target::Address(addr), peer, peer_mode)?;
        ep.set_peer_uuid(crate::pairing::uuid_of(addr.ucx_bytes()));
        if opts.handshake {
            ep.client_handshake(opts.timeout).await?;
        }
        ep.check_required(&opts.require_transports)?;
        Ok(ep)
    }
}

/// A random 64-bit value, different at each call (handshake nonces, the process token of
/// packed memory keys).
pub(crate) fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// Removes a pending handshake entry when the waiting future goes away.
struct HsGuard<'a> {
    ep: &'a Endpoint,
    key: HsKey,
}

#[derive(Clone, Copy)]
enum HsKey {
    Connect(u64),
    Accept(usize),
}

impl HsKey {
    fn get<'s>(&self, st: &'s mut State) -> Option<&'s mut HsWait> {
        match self {
            HsKey::Connect(n) => st.connects.get_mut(n),
            HsKey::Accept(h) => st.accepts.get_mut(h),
        }
    }
    fn remove(&self, st: &mut State) -> Option<HsWait> {
        match self {
            HsKey::Connect(n) => st.connects.remove(n),
            HsKey::Accept(h) => st.accepts.remove(h),
        }
    }
}

impl Drop for HsGuard<'_> {
    fn drop(&mut self) {
        let key = self.key;
        self.ep.worker_inner().locked(|st| {
            key.remove(st);
        });
    }
}

impl Endpoint {
    pub(crate) fn worker_inner(&self) -> &crate::worker::WorkerInner {
        &self.inner.worker.shared.inner
    }

    /// The worker this endpoint belongs to.
    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    /// Who this endpoint talks to.
    pub fn peer(&self) -> &Peer {
        &self.inner.peer
    }

    /// Whether this endpoint uses UCX peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`)
    /// rather than `NONE` (after resolving [`crate::ErrorMode::Auto`]).
    pub fn uses_peer_error_mode(&self) -> bool {
        self.inner.peer_mode
    }

    /// Records the peer worker's UCX uuid, where known.
    pub(crate) fn set_peer_uuid(&self, uuid: Option<u64>) {
        self.inner.peer_uuid.store(uuid.unwrap_or(0), Ordering::Relaxed);
    }

    /// Whether this endpoint may reach a worker of this process: its peer's uuid is one
    /// of this process's workers', or, unknown (a connection without ucxkit's handshake),
    /// its peer is on this host. UCX then copies into this process's own memory for a
    /// key of the endpoint, so only keys of this process's regions are taken on it.
    pub(crate) fn reaches_this_process(&self) -> bool {
        match self.inner.peer_uuid.load(Ordering::Relaxed) {
            0 => match &self.inner.peer {
                Peer::Socket(a) | Peer::Accepted(Some(a)) => is_local_ip(a.ip()),
                _ => true,
            },
            uuid => crate::worker::is_own_worker(uuid),
        }
    }

    /// The peer's process identity, learned in the handshake (None without one).
    pub fn peer_identity(&self) -> Option<ProcessIdentity> {
        *self.inner.identity.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether ucxkit watches the peer process for exit (a same-host peer reached with
    /// the handshake on).
    pub fn is_watched(&self) -> bool {
        self.inner.watch.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The status the endpoint failed with, if it has.
    pub fn failure(&self) -> Option<Status> {
        let id = self.inner.id;
        self.worker_inner().locked(|st| st.eps.get(&id).and_then(|e| e.failed))
    }

    /// Waits until this endpoint fails (the peer died or the connection broke) and
    /// returns UCX's reason; stays pending while the endpoint works, and forever on one
    /// closed without failing. Useful to end work that waits on the peer through
    /// worker-level operations, which a failed endpoint does not end by itself.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn failed(&self) -> Status {
        let id = self.inner.id;
        let inner = self.worker_inner();
        std::future::poll_fn(|cx| {
            inner.locked(|st| match st.eps.get_mut(&id) {
                Some(e) => match e.failed {
                    Some(s) => Poll::Ready(s),
                    None => {
                        // Woken by the endpoint's failure (and by stream events; then
                        // this looks again).
                        if !e.stream_waiters.iter().any(|w| w.will_wake(cx.waker())) {
                            e.stream_waiters.push(cx.waker().clone());
                        }
                        Poll::Pending
                    }
                },
                None => Poll::Pending,
            })
        })
        .await
    }

    /// Runs `f` with the live UCX endpoint handle, or fails with the reason it is gone.
    pub(crate) fn with_handle<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State, sys::ucp_ep_h) -> Result<R>,
    ) -> Result<R> {
        self.worker_inner().locked(|st| {
            let h = self.live_handle(st, op)?;
            f(st, h)
        })
    }

    /// Runs `f` with the live UCX endpoint handle under the worker lock, or fails with the
    /// reason it is gone. The error is boxed: this is the posting path of every
    /// operation, and a small `Result` keeps it cheap to return.
    #[inline(always)]
    pub(crate) fn with_live<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State, sys::ucp_ep_h) -> R,
    ) -> std::result::Result<R, Box<Error>> {
        self.worker_inner().locked(|st| match self.inner.usable.load(Ordering::Relaxed) {
            h if h.is_null() => Err(Box::new(self.unusable(st, op))),
            h => Ok(f(st, h)),
        })
    }

    /// The live UCX endpoint handle, or the reason it is gone (under the worker lock, so
    /// the answer holds for whatever the caller posts in the same critical section).
    pub(crate) fn live_handle(&self, st: &State, op: &'static str) -> Result<sys::ucp_ep_h> {
        // Written only under the worker lock, which the caller holds (`st`).
        let h = self.inner.usable.load(Ordering::Relaxed);
        if h.is_null() {
            return Err(self.unusable(st, op));
        }
        Ok(h)
    }

    /// Why `op` cannot run on this endpoint, whose handle is no longer usable: it failed,
    /// or it was closed.
    #[cold]
    fn unusable(&self, st: &State, op: &'static str) -> Error {
        match st.eps.get(&self.inner.id).filter(|e| !e.closing).and_then(|e| e.failed) {
            Some(s) => Error::ConnectionReset { op, peer: self.inner.peer.clone(), source: s },
            None => Error::ApiMisuse(format!("{op} on a closed endpoint ({})", self.inner.peer)),
        }
    }

    /// Maps a completion of an operation on this endpoint to a result; a cancellation
    /// caused by the endpoint's failure becomes [`Error::ConnectionReset`].
    pub(crate) fn result_of(&self, op: &'static str, c: Completion) -> Result<()> {
        if c.status().is_ok() {
            return Ok(());
        }
        Err(self.error_of(op, c.status()))
    }

    /// The error for a failed operation on this endpoint.
    #[cold]
    #[inline(never)]
    pub(crate) fn error_of(&self, op: &'static str, status: Status) -> Error {
        if let Some(f) = self.failure() {
            return Error::ConnectionReset { op, peer: self.inner.peer.clone(), source: f };
        }
        Error::from_op(op, &self.inner.peer, status)
    }

    /// The error for a failed receive bound to this endpoint. UCX cancels a receive
    /// whose sender failed, sometimes before it reports the endpoint's failure: a
    /// cancellation this side did not cause (the endpoint is not closed by it) is a
    /// reset too.
    #[cold]
    #[inline(never)]
    pub(crate) fn recv_error_of(&self, op: &'static str, status: Status) -> Error {
        if status == Status::CANCELED {
            let id = self.inner.id;
            let open = self.worker_inner().locked(|st| st.eps.get(&id).is_some_and(|e| !e.closing));
            if open {
                return Error::ConnectionReset { op, peer: self.inner.peer.clone(), source: status };
            }
        }
        self.error_of(op, status)
    }

    async fn client_handshake(&self, timeout: std::time::Duration) -> Result<()> {
        self.client_handshake_with(nonce(), false, timeout).await
    }

    /// Sends the hello with `nonce` (a front hello when `front`, whose nonce is the
    /// connection id of its request on the listener's front) and waits for the answer.
    pub(crate) async fn client_handshake_with(
        &self,
        nonce: u64,
        front: bool,
        timeout: std::time::Duration,
    ) -> Result<()> {
        let hello = Message {
            kind: if front { Kind::FrontHello } else { Kind::Hello },
            peer_mode: self.inner.peer_mode,
            nonce,
            identity: ProcessIdentity::current(),
        };
        let id = self.inner.id;
        let peer_mode = self.inner.peer_mode;
        self.with_handle("handshake", |st, h| {
            st.connects.insert(nonce, HsWait { waker: None, result: None, peer_mode, ep: id, expect: None });
            st.send_handshake(h, hello.encode(), true);
            Ok(())
        })?;
        let guard = HsGuard { ep: self, key: HsKey::Connect(nonce) };
        let identity = self.await_handshake(&guard, timeout, "connect").await?;
        drop(guard);
        self.start_watch(identity);
        Ok(())
    }

    /// Without the handshake, on an endpoint made through a listener (either side):
    /// waits until UCX has wired it up, as a flush completes only then. UCX 1.13 replays
    /// operations posted before that with the settings of the half-made endpoint, and over
    /// shared memory that aborts the process (a rendezvous key larger than the room
    /// reserved for it, a short message longer than the transport takes). The handshake's
    /// round trip waits for the same.
    pub(crate) async fn await_wired(&self, timeout: std::time::Duration, op: &'static str) -> Result<()> {
        let wired = async {
            let status = self.flush_completion(op).await?.status();
            if status.is_ok() {
                return Ok(());
            }
            let source = self.failure().unwrap_or(status);
            Err(match op {
                // Nobody accepted.
                "connect" => Error::Unreachable { peer: self.inner.peer.clone(), source },
                _ => Error::from_op(op, &self.inner.peer, source),
            })
        };
        match tokio::time::timeout(timeout, wired).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout { op, peer: self.inner.peer.clone(), after: timeout }),
        }
    }

    /// Server side: waits for the client's hello on this (accepted) endpoint.
    /// The endpoint was made with `create_ep_with(.., await_hello = true)`.
    pub(crate) async fn server_handshake(&self, timeout: std::time::Duration) -> Result<()> {
        let id = self.inner.id;
        let peer_mode = self.inner.peer_mode;
        let key = self.with_handle("accept", |st, h| {
            st.accepts.entry(h as usize).or_insert(HsWait {
                waker: None,
                result: None,
                peer_mode,
                ep: id,
                expect: None,
            });
            Ok(HsKey::Accept(h as usize))
        })?;
        let guard = HsGuard { ep: self, key };
        let identity = self.await_handshake(&guard, timeout, "accept").await?;
        drop(guard);
        self.start_watch(identity);
        Ok(())
    }

    async fn await_handshake(
        &self,
        guard: &HsGuard<'_>,
        timeout: std::time::Duration,
        op: &'static str,
    ) -> Result<ProcessIdentity> {
        let key = guard.key;
        let id = self.inner.id;
        let wait = poll_fn(|cx| {
            self.worker_inner().poll_until(
                cx,
                |st| {
                    if let Some(r) = key.get(st).and_then(|w| w.result.take()) {
                        return Some(
                            r.map_err(|reason| Error::Handshake { peer: self.inner.peer.clone(), reason }),
                        );
                    }
                    let failed = st.eps.get(&id).and_then(|e| e.failed);
                    // The endpoint failed before the peer answered: nobody accepted.
                    failed.map(|source| {
                        Err(match op {
                            "connect" => Error::Unreachable { peer: self.inner.peer.clone(), source },
                            _ => Error::from_op(op, &self.inner.peer, source),
                        })
                    })
                },
                |st, waker| {
                    if let Some(w) = key.get(st) {
                        w.waker = Some(waker.clone());
                    }
                },
            )
        });
        match tokio::time::timeout(timeout, wait).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout { op, peer: self.inner.peer.clone(), after: timeout }),
        }
    }

    #[cfg(test)]
    pub(crate) async fn await_hs_for_test(&self, nonce: u64) -> Result<ProcessIdentity> {
        let guard = HsGuard { ep: self, key: HsKey::Connect(nonce) };
        self.await_handshake(&guard, std::time::Duration::from_secs(5), "connect").await
    }

    /// Records the peer's identity and, for a peer process on this host, watches it.
    pub(crate) fn start_watch(&self, identity: ProcessIdentity) {
        *self.inner.identity.lock().unwrap_or_else(|e| e.into_inner()) = Some(identity);
        if !identity.watchable() {
            return;
        }
        let watch = match PidWatch::open(&identity) {
            Ok(w) => w,
            Err(e) => {
                tracing::debug!(pid = identity.pid, "cannot watch peer process: {e}");
                if e.kind() == std::io::ErrorKind::NotFound {
                    self.fail(Status::CONNECTION_RESET);
                }
                return;
            }
        };
        let weak = Arc::downgrade(&self.inner);
        let pid = identity.pid;
        let task = tokio::spawn(async move {
            watch.exited().await;
            if let Some(inner) = weak.upgrade() {
                tracing::debug!(pid, ep = inner.id, "peer process exited");
                Endpoint { inner }.fail(Status::CONNECTION_RESET);
            }
        });
        *self.inner.watch.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
    }

    /// Keeps the UCX endpoint open for its peer without this handle: it turned out to be
    /// UCX's pair of another connection's endpoint (see [`crate::pairing`]). Dropping
    /// the handle then leaves it to the worker, which closes it when it fails or goes.
    pub(crate) fn hide(self) {
        let id = self.inner.id;
        self.worker_inner().locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.hidden = true;
            }
        });
    }

    /// Fails this endpoint because the peer process exited: every pending operation on
    /// it ends with [`Error::ConnectionReset`].
    pub(crate) fn fail(&self, status: Status) {
        let id = self.inner.id;
        self.worker_inner().locked(|st| st.fail_ep(id, status, true));
    }

    /// Flushes every operation posted on this endpoint (`ucp_ep_flush_nbx`): when this
    /// returns, they have completed at the transport level.
    ///
    /// # Cancel safety
    /// Safe to drop; the flush still happens.
    pub async fn flush(&self) -> Result<()> {
        let c = self.flush_completion("flush").await?;
        self.result_of("flush", c)
    }

    /// Posts `ucp_ep_flush_nbx` (for `op`) and waits for its completion.
    async fn flush_completion(&self, op: &'static str) -> Result<Completion> {
        let posted = self.with_handle(op, |st, h| {
            let param = op_param(st, self.worker_inner().no_imm);
            // SAFETY: h is live under the lock; the callback and user_data are ours.
            let p = unsafe { sys::ucp_ep_flush_nbx(h, &param) };
            Ok(Posted::from_ptr(p, Completion::OK, false))
        })?;
        Ok(self.wait(posted).await)
    }

    /// Closes the endpoint gracefully: flushes outstanding operations and disconnects
    /// (`ucp_ep_close_nbx`). Other clones of this endpoint see it closed.
    ///
    /// A graceful close needs the peer's worker to answer. If the peer may already have
    /// destroyed its worker (its process still alive), bound the wait with
    /// `tokio::time::timeout`: in [`crate::ErrorMode::None`] UCX cannot tell such a peer
    /// from a slow one.
    ///
    /// A connection made through a listener with the handshake closes through the peer,
    /// in either error mode, so that nothing sent before the close is lost and the
    /// accepting side disconnects first. This side flushes what it sent and waits until
    /// its operations on the endpoint have finished (a large send finishes when the
    /// peer's receive takes it), then sends a notice, which arrives after all of it. On
    /// the connecting side the notice asks the peer to close: the peer takes in what
    /// arrived (see below) and disconnects, and this side then closes. On the accepting
    /// side it says that this side is closing: the peer takes in what arrived and
    /// answers, and this side then closes (the disconnect fails the peer's end). Each
    /// wait is bounded: after a second with operations still running, the notice goes
    /// anyway (asking the peer to close first, from either side: UCX purges what still
    /// runs on an endpoint whose peer disconnected, and must not be asked to close one
    /// itself), and those operations then end with [`Error::ConnectionReset`]; after a
    /// second more without the peer's part (a peer that does not progress its worker, or
    /// one that does not know the notice), this side closes anyway and returns without
    /// waiting for that close to finish (it goes on in the background). Other clones see
    /// the endpoint closed from the start. Dropping the last handle does the same in the
    /// background. (While a [`crate::StreamData`] piece of this endpoint is held, or once
    /// it failed, the close is UCX's own, as below.)
    ///
    /// Why: UCX discards the stream bytes an endpoint has received but not yet read when
    /// its peer disconnects, and a disconnect can overtake data still in flight; with the
    /// exchange, the peer's unread stream bytes are moved out of UCX first, and its reads
    /// return them after the close, then the end of stream (when this side called
    /// [`Endpoint::stream_shutdown`], as [`crate::UcxStream`]'s shutdown does) or
    /// [`Error::ConnectionReset`]. And when the connecting side disconnects first over
    /// shared memory, UCX (1.13 and 1.22 alike) keeps one socket of the connecting worker
    /// open until that worker is destroyed; a process that connects and closes again and
    /// again would run out of descriptors. Other operations the peer has pending on the
    /// endpoint end with [`Error::ConnectionReset`], as they do whenever the peer closes.
    ///
    /// Without the handshake (the peer may be a plain UCX program) or for an endpoint
    /// made from a worker address, the close is UCX's own: end the conversation with an
    /// acknowledgment before closing, as plain UCX programs do.
    ///
    /// UCX is never asked to close an endpoint while operations still run on it (a send
    /// its peer has not taken yet): UCX 1.13 asserts then, or leaves the send pointing
    /// at the freed endpoint. Such a close waits in the background until they finish or
    /// fail (the peer's disconnect fails them), and `close()` returns without waiting
    /// for it, as it does while a [`crate::StreamData`] piece is held. Without peer error
    /// handling, when both sides hold such sends (neither receiving the other's), neither
    /// side can close: the sends stay pending until received, and a worker dropped with
    /// them is left to the process (leaked, with a warning) rather than destroyed, which
    /// would make UCX 1.13 abort. [`crate::ErrorMode::Peer`] has no such case (the close
    /// is forced, and the sends end with [`Error::ConnectionReset`]).
    /// The same holds for sends that ucxkit ended itself because the peer process died
    /// without UCX noticing (a same-host peer without peer error handling): UCX still
    /// runs them, so the endpoint is closed only once UCX fails it too, and a worker
    /// dropped before that is left to the process.
    ///
    /// # Cancel safety
    /// Safe to drop; the close continues in the background.
    pub async fn close(self) -> Result<()> {
        let id = self.inner.id;
        let notice = self.inner.close_notice();
        let inner = self.worker_inner();
        let lingers = inner.locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.closing = true;
            }
            // (A close from another clone while it lingers waits for the same end.)
            st.lingers(id) || notice.is_some_and(|k| st.linger(id, k))
        });
        if lingers {
            // The driver moves it on (the flush, the peer's disconnect, the deadline).
            inner.signal.kick();
            std::future::poll_fn(|cx| inner.locked(|st| st.wait_linger(id, cx.waker()))).await;
            return Ok(());
        }
        let posted = self.worker_inner().locked(|st| {
            if st.eps.get(&id).is_some_and(|e| e.failed.is_some()) {
                // A failed peer will not answer: nothing to wait for.
                st.close_unwaited(id);
                return None;
            }
            st.close_ep(id, false)
        });
        match posted {
            None => Ok(()),
            Some(p) => {
                let c = wait_unbuffered(&self.inner.worker, p, Some(id)).await;
                if c.status().is_ok() || c.status().is_peer_failure() {
                    Ok(())
                } else {
                    Err(Error::from_op("close", &self.inner.peer, c.status()))
                }
            }
        }
    }

    /// Sends a handshake notice of `kind` on this endpoint (whose handshake is done), with
    /// the nonce `nonce` computes under the worker lock.
    pub(crate) fn send_notice(
        &self,
        op: &'static str,
        kind: Kind,
        nonce: impl FnOnce(&State) -> u64,
    ) -> Result<()> {
        self.with_handle(op, |st, h| {
            let nonce = nonce(st);
            st.send_notice(h, kind, self.inner.peer_mode, nonce);
            Ok(())
        })
    }

    /// Waits for a posted request that owns no buffer (not a close).
    pub(crate) async fn wait(&self, posted: Posted) -> Completion {
        wait_unbuffered(&self.inner.worker, posted, None).await
    }

    /// Prints which transports and devices UCX chose for this endpoint
    /// (`ucp_ep_print_info`).
    pub fn transport_info(&self) -> Result<String> {
        self.with_handle("transport_info", |_, h| {
            // SAFETY: h is live under the lock; f is an open stream for the call.
            crate::context::printed(|f| unsafe { sys::ucp_ep_print_info(h, f.cast()) })
                .ok_or_else(|| Error::Io { op: "open_memstream", source: std::io::Error::last_os_error() })
        })
    }

    /// The transport and device of each of this endpoint's lanes (deduplicated; the
    /// connection-manager lane left out): from `ucp_ep_query` on UCX 1.14 and newer, from
    /// [`Endpoint::transport_info`] on older UCX. Lanes can change until the connection is
    /// fully wired up, which `connect` and `accept` wait for when the handshake is on.
    pub fn lanes(&self) -> Result<Vec<Lane>> {
        #[cfg(ucx_ge_1_14)]
        {
            if let Some(l) = self.query_lanes()? {
                return Ok(l);
            }
        }
        Ok(parse_lanes(&self.transport_info()?))
    }

    #[cfg(ucx_ge_1_14)]
    fn query_lanes(&self) -> Result<Option<Vec<Lane>>> {
        self.with_handle("ucp_ep_query", |_, h| {
            let mut entries = vec![
                sys::ucp_transport_entry_t {
                    transport_name: std::ptr::null(),
                    device_name: std::ptr::null()
                };
                32
            ];
            let mut attr = sys::ucp_ep_attr_t {
                field_mask: sys::UCP_EP_ATTR_FIELD_TRANSPORTS.0 as u64,
                ..Default::default()
            };
            attr.transports.entries = entries.as_mut_ptr();
            attr.transports.num_entries = entries.len() as _;
            attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>() as _;
            // SAFETY: h is live under the lock; the entry array is valid for the count and
            // entry size given.
            if !Status(unsafe { sys::ucp_ep_query(h, &mut attr) }).is_ok() {
                return Ok(None);
            }
            let n = (attr.transports.num_entries as usize).min(entries.len());
            let mut out: Vec<Lane> = Vec::new();
            for e in &entries[..n] {
                if e.transport_name.is_null() {
                    continue;
                }
                // SAFETY: UCX fills NUL-terminated names valid until the endpoint closes;
                // they are copied here, under the lock.
                let (t, d) = unsafe {
                    (
                        std::ffi::CStr::from_ptr(e.transport_name).to_string_lossy().into_owned(),
                        if e.device_name.is_null() {
                            String::new()
                        } else {
                            std::ffi::CStr::from_ptr(e.device_name).to_string_lossy().into_owned()
                        },
                    )
                };
                // The connection-manager lane (UCX reports it by its component, "tcp",
                // with no device) carries no data: leave it out, as print_info's "cm".
                let lane = Lane { transport: t, device: d };
                if !lane.device.is_empty() && lane.transport != "cm" && !out.contains(&lane) {
                    out.push(lane);
                }
            }
            Ok(Some(out))
        })
    }

    /// The UCX transports this endpoint's lanes use (for example `["posix", "cma"]` or
    /// `["tcp"]`), from [`Endpoint::lanes`].
    pub fn transports(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        for l in self.lanes()? {
            if !out.contains(&l.transport) {
                out.push(l.transport);
            }
        }
        Ok(out)
    }

    /// Fails (and closes the endpoint) when a required transport is not in use.
    pub(crate) fn check_required(&self, required: &[String]) -> Result<()> {
        if required.is_empty() {
            return Ok(());
        }
        let selected = self.transports()?;
        if let Some(missing) = required.iter().find(|r| !selected.contains(r)) {
            let id = self.inner.id;
            self.worker_inner().locked(|st| {
                st.close_unwaited(id);
            });
            return Err(Error::MissingTransport {
                peer: self.inner.peer.clone(),
                required: missing.clone(),
                selected,
            });
        }
        Ok(())
    }

    /// The raw handle: valid while the endpoint is open and this handle (or a clone) is
    /// alive; do not close it, and make no other ucxkit call on its worker while using it.
    pub fn as_raw(&self) -> sys::ucp_ep_h {
        let id = self.inner.id;
        self.worker_inner().locked(|st| st.eps.get(&id).map_or(std::ptr::null_mut(), |e| e.handle))
    }
}

impl Endpoint {
    /// Posts one operation on this endpoint: under the worker lock, with the endpoint
    /// checked live in the same critical section, `call` gets the handle and send-type
    /// request parameters (callback and user data set; `force_request` adds
    /// `NO_IMM_CMPL`) it may extend, and returns what the `*_nbx` call returned. A pending
    /// request is bound to the endpoint, so that its failure ends it, and the driver is
    /// kicked.
    #[inline(always)]
    pub(crate) fn post_op(
        &self,
        op: &'static str,
        force_request: bool,
        call: impl FnOnce(&mut State, sys::ucp_ep_h, &mut sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
    ) -> std::result::Result<Posted, Box<Error>> {
        let no_imm = force_request || self.worker_inner().no_imm;
        let id = self.inner.id;
        let posted = self.with_live(op, |st, h| {
            let mut param = op_param(st, no_imm);
            let p = call(st, h, &mut param);
            let posted = Posted::from_ptr(p, Completion::OK, false);
            if let Posted::Pending(r) = &posted {
                r.bind(st, id, crate::worker::OpKind::Finish);
            }
            posted
        });
        if matches!(posted, Ok(Posted::Pending(_))) {
            self.worker_inner().posted();
        }
        posted
    }

    /// Runs a send-type call that reads a buffer borrowed for this call only, asking UCX to
    /// complete it during the call or not at all (`UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): `true`
    /// when it completed, `false` when UCX could not (`UCS_ERR_NO_RESOURCE`: the message
    /// does not fit the short protocol, or the transport has no room right now) and posted
    /// nothing.
    ///
    /// This is what makes the borrowing `try_*` calls safe without `unsafe`: UCX checks the
    /// flag before it takes a request, so the only way through is its short path, which
    /// copies the bytes during the call, and nothing of the call outlives it. Should UCX
    /// leave a request anyway, this waits for it under the worker lock (which would hang
    /// the worker if that request never completed) rather than let UCX read the buffer
    /// after the call; debug builds then stop. On a worker built with
    /// [`crate::WorkerBuilder::no_immediate_completion`] it posts nothing and returns `false`.
    #[inline]
    pub(crate) fn post_immediate(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ucp_ep_h, &mut sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
    ) -> Result<bool> {
        let inner = self.worker_inner();
        let status = self.with_live(op, |st, h| {
            if inner.no_imm {
                // Every operation takes the request path, which these calls cannot.
                return Status::NO_RESOURCE;
            }
            let mut param = op_param(st, false);
            param.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL.0 as u32;
            match Posted::from_ptr(call(h, &mut param), Completion::OK, false) {
                Posted::Done(c) => c.status(),
                Posted::Pending(r) => {
                    tracing::error!(
                        op,
                        "UCX left an operation pending despite FORCE_IMM_CMPL; waiting for it"
                    );
                    let c = r.finish_locked(st, |st| {
                        inner.progress_locked(st);
                    });
                    // Only once UCX is done with the buffer.
                    debug_assert!(false, "UCX left {op} pending despite FORCE_IMM_CMPL");
                    c.status()
                }
            }
        });
        match status {
            Ok(s) if s.is_ok() => Ok(true),
            Ok(s) if s == Status::NO_RESOURCE => Ok(false),
            Ok(s) => Err(self.error_of(op, s)),
            Err(e) => Err(*e),
        }
    }
}

/// Request parameters for a send-type operation on this worker.
pub(crate) fn op_param(st: &mut State, no_imm: bool) -> sys::ucp_request_param_t {
    let mut mask = sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0;
    if no_imm {
        mask |= sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL.0;
    }
    sys::ucp_request_param_t {
        op_attr_mask: mask as u32,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { send: Some(crate::request::send_cb) },
        user_data: (st as *mut State).cast(),
        ..Default::default()
    }
}

/// Waits for a posted request of `worker` that owns no buffer: a flush, or the close of
/// endpoint `close`, which goes on in the background if the wait is dropped.
pub(crate) async fn wait_unbuffered(worker: &Worker, posted: Posted, close: Option<u64>) -> Completion {
    match posted {
        Posted::Done(c) => c,
        Posted::Pending(req) => {
            worker.shared.inner.posted();
            let mut op = Unbuffered { req: Some(req), worker: worker.clone(), close };
            poll_fn(|cx| op.poll(cx)).await
        }
    }
}

/// A pending request that owns no buffer (flush, close).
struct Unbuffered {
    req: Option<Request>,
    worker: Worker,
    /// A close, of this endpoint: finished in the background when dropped, so that the
    /// worker's destruction does not cut it off.
    close: Option<u64>,
}

impl Unbuffered {
    fn poll(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Completion> {
        let Some(req) = self.req.as_mut() else {
            return Poll::Ready(Completion::OK);
        };
        match req.poll(&self.worker.shared, cx) {
            Poll::Ready(c) => {
                self.req = None;
                Poll::Ready(c)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Unbuffered {
    fn drop(&mut self) {
        if let Some(req) = self.req.take() {
            let p = crate::request::Posted::Pending(req);
            self.worker.shared.inner.locked(|st| match self.close {
                Some(id) => st.finish_close(id, p),
                None => st.release(p),
            });
        }
    }
}

/// One lane of an endpoint: a UCX transport on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Transport name (`posix`, `cma`, `tcp`, `rc_mlx5`, …).
    pub transport: String,
    /// Device name (`memory`, `lo`, `mlx5_0:1`, …).
    pub device: String,
}

/// Lanes from `ucp_ep_print_info` output: lines like
/// `#                 lane[0]:  8:posix/memory.0 md[4]  ...`.
pub(crate) fn parse_lanes(info: &str) -> Vec<Lane> {
    let mut out: Vec<Lane> = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.split("lane[").nth(1) else {
            continue;
        };
        let Some(after) = rest.split_once(':').map(|x| x.1) else {
            continue;
        };
        let Some(tl) = after.split_whitespace().next() else {
            continue;
        };
        let tl = tl.split_once(':').map_or(tl, |x| x.1);
        let (transport, device) = tl.split_once('/').unwrap_or((tl, ""));
        // "memory.0": the trailing ".N" is the path index, not part of the device.
        let device = match device.rsplit_once('.') {
            Some((d, idx)) if idx.chars().all(|c| c.is_ascii_digit()) => d,
            _ => device,
        };
        let lane = Lane { transport: transport.to_string(), device: device.to_string() };
        if !lane.transport.is_empty() && lane.transport != "cm" && !out.contains(&lane) {
            out.push(lane);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lanes() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  8:posix/memory.0 md[4]      -> md[4]/posix/sysdev[255] rma_bw#0 am am_bw#0\n#                 lane[1]:  3:cma/memory.0 md[1]        -> md[1]/cma/sysdev[255] rma_bw#1\n#                 lane[2]:  1:tcp/lo.0 md[0]  -> am\n";
        let lanes = parse_lanes(info);
        let t: Vec<&str> = lanes.iter().map(|l| l.transport.as_str()).collect();
        assert_eq!(t, vec!["posix", "cma", "tcp"]);
        assert_eq!(lanes[0].device, "memory");
        assert_eq!(lanes[2].device, "lo");
        assert!(parse_lanes("nothing here").is_empty());
    }

    #[test]
    fn locality() {
        assert!(is_local_ip("127.0.0.1".parse().unwrap()));
        assert!(is_local_ip("::1".parse().unwrap()));
        assert!(!is_local_ip("192.0.2.1".parse().unwrap()));
    }

    #[test]
    fn sockaddr_roundtrip() {
        for a in ["127.0.0.1:4242", "[::1]:80"] {
            let a: SocketAddr = a.parse().unwrap();
            let (ss, _) = sockaddr_of(&a);
            // SAFETY: same C layout.
            let ss2: &sys::sockaddr_storage = unsafe { &*(&ss as *const libc::sockaddr_storage).cast() };
            assert_eq!(socket_addr_from(ss2), Some(a));
        }
    }
}
