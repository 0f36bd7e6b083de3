//! [`Listener`]: accepts connections on a socket address: through ucxkit's front (see
//! [`crate::front`]) when its endpoints use the handshake (the default), or through
//! UCX's own connection manager (`ucp_listener_create`) for plain UCX clients.

use std::ffi::c_void;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;

use ucx_sys as sys;

use crate::endpoint::{is_local_ip, socket_addr_from, Endpoint, Target};
use crate::error::{Error, Peer, Result, Status};
use crate::front::server::{FrontListener, Pending};
use crate::front::wire::Reason;
use crate::worker::{Closer, EndpointOptions, ListenerState, State, Worker};

/// What the connection callback needs: the worker state and which listener.
struct CbArg {
    state: *mut c_void,
    id: u64,
}

struct ListenerInner {
    worker: Worker,
    addr: SocketAddr,
    opts: EndpointOptions,
    kind: Kind,
}

/// How a listener takes connections.
enum Kind {
    /// ucxkit's front (the handshake on).
    Front(FrontListener),
    /// UCX's connection manager (plain UCX clients).
    Ucx(UcxListener),
}

/// A UCX listener (`ucp_listener_h`) of a worker.
struct UcxListener {
    worker: Worker,
    handle: sys::ucp_listener_h,
    id: u64,
    cb_arg: *mut CbArg,
}

// SAFETY: the listener handle and cb_arg are only used under the worker lock or in Drop.
unsafe impl Send for UcxListener {}
// SAFETY: as above.
unsafe impl Sync for UcxListener {}

impl Drop for UcxListener {
    fn drop(&mut self) {
        let (handle, cb_arg) = (self.handle, self.cb_arg);
        self.worker.shared.inner.locked(|st| {
            self.stop_locked(st);
            // SAFETY: the listener is live and destroyed once, under the worker lock (so
            // no connection callback runs concurrently); after this none refers to cb_arg.
            // No request taken from it is left: each holds the listener's handle.
            unsafe { sys::ucp_listener_destroy(handle) };
            // SAFETY: allocated by Box::into_raw in bind and no longer referenced.
            drop(unsafe { Box::from_raw(cb_arg) });
        });
    }
}

impl UcxListener {
    /// Stops taking requests, refusing the ones queued; idempotent. The UCX listener
    /// itself lives until its last handle goes, since a request taken from it may still
    /// be accepted or rejected; requests arriving meanwhile go unanswered (their clients
    /// time out).
    fn stop(&self) {
        self.worker.shared.inner.locked(|st| self.stop_locked(st));
    }

    fn stop_locked(&self, st: &mut State) {
        if let Some(ls) = st.listeners.remove(&self.id) {
            for r in ls.queue {
                reject_locked(st, self.handle, r);
            }
        }
    }
}

fn reject_locked(_st: &mut State, listener: sys::ucp_listener_h, r: sys::ucp_conn_request_h) {
    // SAFETY: r is a pending connection request of this listener.
    let s = Status(unsafe { sys::ucp_listener_reject(listener, r) });
    if !s.is_ok() {
        tracing::debug!(status = %s, "rejecting a connection request failed");
    }
}

/// Accepts connections on a socket address.
///
/// With the handshake on (the default endpoint options), the listener is ucxkit's
/// front: a TCP listener that checks every byte a client sends before anything reaches
/// UCX, optionally authenticates clients with the context's secret, and hands UCX only
/// addresses it made itself (see [`crate::front`] for the protocol and the threat
/// model). With it off, it is UCX's connection manager, for plain UCX clients: anyone
/// who reaches its port reaches UCX's parser, which UCX 1.13 lets a few bytes abort.
///
/// Dropping the listener stops listening and rejects connection requests nobody took.
pub struct Listener {
    inner: Arc<ListenerInner>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("addr", &self.inner.addr).finish()
    }
}

unsafe extern "C" fn conn_cb(req: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: UCX calls this inside progress under the worker lock; arg is our CbArg,
    // alive until the listener is destroyed.
    let (st, id) = unsafe {
        let a = &*arg.cast::<CbArg>();
        (&mut *a.state.cast::<State>(), a.id)
    };
    if let Some(ls) = st.listeners.get_mut(&id) {
        ls.queue.push_back(req);
        if let Some(w) = ls.waker.take() {
            st.after.wake(w);
        }
    }
}

impl Worker {
    /// Listens on `addr`; port 0 picks a free port, which [`Listener::local_addr`]
    /// reports. Accepted endpoints use this worker's default [`EndpointOptions`].
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener> {
        self.listen_with(addr, self.shared.endpoint.clone())
    }

    /// Listens on `addr`, with options for the endpoints it accepts: through ucxkit's
    /// front when `opts.handshake` is on, through UCX's connection manager
    /// (`ucp_listener_create`) for plain UCX clients when it is off.
    pub fn listen_with(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Listener> {
        self.check_open("listen")?;
        let l = self.listen_any(addr, opts)?;
        let closer: Arc<dyn Closer> = l.inner.clone();
        self.add_closer(Arc::downgrade(&closer));
        Ok(l)
    }

    /// [`Worker::listen_with`], unregistered.
    fn listen_any(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Listener> {
        if opts.handshake {
            let uuid = self.uuid()?;
            let (front, bound) = FrontListener::bind(addr, self.context().secret().cloned(), uuid)?;
            tracing::debug!(%bound, "listening (front)");
            return Ok(Listener {
                inner: Arc::new(ListenerInner {
                    worker: self.clone(),
                    addr: bound,
                    opts,
                    kind: Kind::Front(front),
                }),
            });
        }
        self.listen_ucx(addr, opts)
    }

    /// A UCX listener on `addr` (with `opts.handshake` on too: [`ConnectionRequest::accept`]
    /// then waits for the client's hello).
    pub(crate) fn listen_ucx(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Listener> {
        let (storage, len) = crate::endpoint::sockaddr_of(&addr);
        let state = self.state_ptr();
        self.shared.inner.locked(|st| {
            let id = st.new_id();
            let cb_arg = Box::into_raw(Box::new(CbArg { state, id }));
            let params = sys::ucp_listener_params_t {
                field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR.0
                    | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER.0) as u64,
                sockaddr: sys::ucs_sock_addr_t {
                    addr: (&storage as *const libc::sockaddr_storage).cast(),
                    addrlen: len,
                },
                conn_handler: sys::ucp_listener_conn_handler_t { cb: Some(conn_cb), arg: cb_arg.cast() },
                ..Default::default()
            };
            let mut handle: sys::ucp_listener_h = std::ptr::null_mut();
            // SAFETY: the worker is valid under the lock; params live for the call; cb_arg
            // lives until the listener is destroyed.
            let s = Status(unsafe { sys::ucp_listener_create(st.handle, &params, &mut handle) });
            if let Err(source) = s.check() {
                // SAFETY: not handed to UCX successfully; freed once.
                drop(unsafe { Box::from_raw(cb_arg) });
                return Err(Error::Listen { addr, source });
            }
            let mut attr = sys::ucp_listener_attr_t {
                field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR.0 as u64,
                ..Default::default()
            };
            // SAFETY: handle is live; attr is a valid out-pointer.
            let q = Status(unsafe { sys::ucp_listener_query(handle, &mut attr) });
            let bound = if q.is_ok() { socket_addr_from(&attr.sockaddr).unwrap_or(addr) } else { addr };
            st.listeners.insert(id, ListenerState::default());
            tracing::debug!(listener = id, %bound, "listening (UCX)");
            let ucx = UcxListener { worker: self.clone(), handle, id, cb_arg };
            Ok(Listener {
                inner: Arc::new(ListenerInner {
                    worker: self.clone(),
                    addr: bound,
                    opts,
                    kind: Kind::Ucx(ucx),
                }),
            })
        })
    }
}

impl Closer for ListenerInner {
    fn close(&self) {
        match &self.kind {
            Kind::Front(f) => f.close(),
            Kind::Ucx(u) => u.stop(),
        }
    }
}

/// A client's request to connect, from [`Listener::next`]: accept or reject it.
///
/// Dropping it unanswered rejects it.
pub struct ConnectionRequest {
    listener: Arc<ListenerInner>,
    req: Option<Req>,
    client: Option<SocketAddr>,
}

/// A request of either kind of listener.
enum Req {
    Front(Box<Pending>),
    Ucx(sys::ucp_conn_request_h),
}

// SAFETY: a UCX request handle is only used under its worker's lock; the front's
// pending connection is Send.
unsafe impl Send for Req {}

// SAFETY: the request handle is only used under the worker lock.
unsafe impl Send for ConnectionRequest {}
// SAFETY: as above; &ConnectionRequest exposes no handle use.
unsafe impl Sync for ConnectionRequest {}

impl std::fmt::Debug for ConnectionRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionRequest").field("client", &self.client).finish()
    }
}

impl Listener {
    /// The address actually bound (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Waits for the next connection request.
    ///
    /// # Cancel safety
    /// Safe: a request that arrives after the drop waits in the queue for the next call.
    pub async fn next(&self) -> Result<ConnectionRequest> {
        let ucx = match &self.inner.kind {
            Kind::Front(front) => {
                let p =
                    front.next().await.ok_or_else(|| Error::ApiMisuse("the listener is closed".into()))?;
                let client = p.client;
                return Ok(ConnectionRequest {
                    listener: self.inner.clone(),
                    req: Some(Req::Front(Box::new(p))),
                    client,
                });
            }
            Kind::Ucx(ucx) => ucx,
        };
        let id = ucx.id;
        let inner = &self.inner.worker.shared.inner;
        let req = poll_fn(|cx| {
            inner.poll_until(
                cx,
                // A listener closed by the worker's shutdown has no entry any more.
                |st| match st.listeners.get_mut(&id) {
                    Some(l) => l.queue.pop_front().map(Some),
                    None => Some(None),
                },
                |st, waker| {
                    if let Some(l) = st.listeners.get_mut(&id) {
                        l.waker = Some(waker.clone());
                    }
                },
            )
        })
        .await
        .ok_or_else(|| Error::ApiMisuse("the listener is closed".into()))?;
        let client = inner.locked(|_| {
            let mut attr = sys::ucp_conn_request_attr_t {
                field_mask: sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR.0 as u64,
                ..Default::default()
            };
            // SAFETY: req is a pending connection request; attr is a valid out-pointer.
            let s = Status(unsafe { sys::ucp_conn_request_query(req, &mut attr) });
            if s.is_ok() {
                socket_addr_from(&attr.client_address)
            } else {
                None
            }
        });
        Ok(ConnectionRequest { listener: self.inner.clone(), req: Some(Req::Ucx(req)), client })
    }

    /// Waits for the next connection and accepts it with the listener's options.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping it after a request arrived rejects (or closes) that
    /// connection.
    pub async fn accept(&self) -> Result<Endpoint> {
        self.next().await?.accept().await
    }
}

impl ConnectionRequest {
    /// The client's socket address, when UCX reports it.
    pub fn client_addr(&self) -> Option<SocketAddr> {
        self.client
    }

    /// The payload the client sent with its connect
    /// ([`crate::EndpointOptions::connect_payload`]), to decide on the request by who is
    /// asking; empty when it sent none or came through UCX's connection manager.
    pub fn connect_payload(&self) -> &[u8] {
        match &self.req {
            Some(Req::Front(p)) => &p.request.payload,
            _ => &[],
        }
    }

    /// Accepts with the listener's endpoint options.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-accepted endpoint is closed.
    pub async fn accept(self) -> Result<Endpoint> {
        let opts = self.listener.opts.clone();
        self.accept_with(opts).await
    }

    /// Accepts the connection. Through the front (a listener made with the handshake,
    /// which `opts.handshake` cannot turn off), agrees with the client on the error mode,
    /// answers with this worker's address and waits for the client's hello on the
    /// endpoint it creates from it (bounded by `opts.timeout`), so the endpoint returned
    /// is ready for traffic. Through UCX's connection manager (a plain UCX client),
    /// creates the endpoint from the request and waits until UCX has wired it up (with
    /// the handshake on, for the client's hello), within the same bound.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-accepted endpoint is closed.
    pub async fn accept_with(mut self, opts: EndpointOptions) -> Result<Endpoint> {
        let req = match self.req.take() {
            Some(Req::Front(p)) => {
                return crate::front::server::accept(&self.listener.worker, *p, &opts).await
            }
            Some(Req::Ucx(r)) => r,
            None => return Err(Error::ApiMisuse("connection request already used".into())),
        };
        let worker = &self.listener.worker;
        let shm = self.client.is_some_and(|a| is_local_ip(a.ip())) && worker.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let peer = Peer::Accepted(self.client);
        let ep = self
            .listener
            .worker
            .create_ep_with(Target::Request(req), peer.clone(), peer_mode, opts.handshake.then_some(None))
            .map_err(|e| {
                match e.status() {
                    // UCX refuses endpoints whose error handling differs from the client's.
                    Some(s) if s == Status::UNSUPPORTED => Error::Handshake {
                        peer,
                        reason: format!(
                            "the client's error mode differs from this side's ({}); UCX refuses asymmetric \
                         error handling: use the same ErrorMode on both sides",
                            if peer_mode { "ErrorMode::Peer" } else { "ErrorMode::None" }
                        ),
                    },
                    _ => e,
                }
            })?;
        if opts.handshake {
            ep.server_handshake(opts.timeout).await?;
        } else {
            ep.await_wired(opts.timeout, "accept").await?;
        }
        ep.check_required(&opts.require_transports)?;
        Ok(ep)
    }

    /// Accepts a request of the one-shot UCX listener a front accept opened (see [`crate::front::server`]), in UCX's peer error mode or not as the
    /// front agreed; the client's hello must carry its front request's connection id
    /// `conn`; the
    /// endpoint names the front's client as `peer`.
    pub(crate) async fn accept_for_front(
        mut self,
        conn: u64,
        peer: Peer,
        peer_mode: bool,
        timeout: std::time::Duration,
    ) -> Result<Endpoint> {
        let Some(Req::Ucx(req)) = self.req.take() else {
            return Err(Error::ApiMisuse("not a request of a UCX listener".into()));
        };
        let ep =
            self.listener.worker.create_ep_with(Target::Request(req), peer, peer_mode, Some(Some(conn)))?;
        ep.server_handshake(timeout).await?;
        Ok(ep)
    }

    /// Refuses the connection; the client's connect fails ([`Error::Refused`] through
    /// the front, `ucp_listener_reject` through UCX's connection manager).
    pub fn reject(mut self) {
        self.reject_now();
    }

    fn reject_now(&mut self) {
        match (self.req.take(), &self.listener.kind) {
            (Some(Req::Front(p)), _) => {
                p.refuse_later(Reason::Rejected, "the application rejected the connection")
            }
            (Some(Req::Ucx(r)), Kind::Ucx(ucx)) => {
                let handle = ucx.handle;
                self.listener.worker.shared.inner.locked(|st| reject_locked(st, handle, r));
            }
            _ => {}
        }
    }
}

impl Drop for ConnectionRequest {
    fn drop(&mut self) {
        self.reject_now();
    }
}
