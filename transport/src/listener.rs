//! [`Listener`]: accepts connections on a socket address (UCX's connection manager,
//! `ucp_listener_create`).

use std::ffi::c_void;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;

use ucx_sys as sys;

use crate::endpoint::{is_local_ip, socket_addr_from, Endpoint, Target};
use crate::error::{Error, Peer, Result, Status};
use crate::worker::{EndpointOptions, ListenerState, State, Worker};

/// What the connection callback needs: the worker state and which listener.
struct CbArg {
    state: *mut c_void,
    id: u64,
}

struct ListenerInner {
    worker: Worker,
    handle: sys::ucp_listener_h,
    id: u64,
    addr: SocketAddr,
    opts: EndpointOptions,
    cb_arg: *mut CbArg,
}

// SAFETY: the listener handle and cb_arg are only used under the worker lock or in Drop.
unsafe impl Send for ListenerInner {}
// SAFETY: as above.
unsafe impl Sync for ListenerInner {}

impl Drop for ListenerInner {
    fn drop(&mut self) {
        let (id, handle, cb_arg) = (self.id, self.handle, self.cb_arg);
        self.worker.shared.inner.locked(|st| {
            // Refuse the requests nobody took while the listener still exists.
            if let Some(ls) = st.listeners.remove(&id) {
                for r in ls.queue {
                    reject_locked(st, handle, r);
                }
            }
            // SAFETY: the listener is live and destroyed once, under the worker lock (so
            // no connection callback runs concurrently); after this none refers to cb_arg.
            unsafe { sys::ucp_listener_destroy(handle) };
            // SAFETY: allocated by Box::into_raw in bind and no longer referenced.
            drop(unsafe { Box::from_raw(cb_arg) });
        });
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
    /// Listens on `addr` (`ucp_listener_create`); port 0 picks a free port, which
    /// [`Listener::local_addr`] reports. Accepted endpoints use this worker's default
    /// [`EndpointOptions`].
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener> {
        self.listen_with(addr, self.shared.endpoint.clone())
    }

    /// Listens on `addr`, with options for the endpoints it accepts.
    pub fn listen_with(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Listener> {
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
            tracing::debug!(listener = id, %bound, "listening");
            Ok(Listener {
                inner: Arc::new(ListenerInner {
                    worker: self.clone(),
                    handle,
                    id,
                    addr: bound,
                    opts,
                    cb_arg,
                }),
            })
        })
    }
}

/// A client's request to connect, from [`Listener::next`]: accept or reject it.
///
/// Dropping it unanswered rejects it.
pub struct ConnectionRequest {
    listener: Arc<ListenerInner>,
    req: Option<sys::ucp_conn_request_h>,
    client: Option<SocketAddr>,
}

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
        let id = self.inner.id;
        let inner = &self.inner.worker.shared.inner;
        let req = poll_fn(|cx| {
            inner.poll_until(
                cx,
                |st| st.listeners.get_mut(&id).and_then(|l| l.queue.pop_front()),
                |st, waker| {
                    if let Some(l) = st.listeners.get_mut(&id) {
                        l.waker = Some(waker.clone());
                    }
                },
            )
        })
        .await;
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
        Ok(ConnectionRequest { listener: self.inner.clone(), req: Some(req), client })
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

    /// Accepts with the listener's endpoint options.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-accepted endpoint is closed.
    pub async fn accept(self) -> Result<Endpoint> {
        let opts = self.listener.opts.clone();
        self.accept_with(opts).await
    }

    /// Accepts the connection. With the handshake on, waits for the client's hello
    /// (bounded by `opts.timeout`), so the endpoint returned is ready for traffic; with
    /// it off (a plain UCX client), waits until UCX has wired the endpoint up, within the
    /// same bound.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-accepted endpoint is closed.
    pub async fn accept_with(mut self, opts: EndpointOptions) -> Result<Endpoint> {
        let req =
            self.req.take().ok_or_else(|| Error::ApiMisuse("connection request already used".into()))?;
        let worker = &self.listener.worker;
        let shm = self.client.is_some_and(|a| is_local_ip(a.ip())) && worker.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let peer = Peer::Accepted(self.client);
        let ep = self
            .listener
            .worker
            .create_ep_with(Target::Request(req), peer.clone(), peer_mode, opts.handshake)
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

    /// Refuses the connection (`ucp_listener_reject`); the client's connect fails.
    pub fn reject(mut self) {
        self.reject_now();
    }

    fn reject_now(&mut self) {
        if let Some(r) = self.req.take() {
            let handle = self.listener.handle;
            self.listener.worker.shared.inner.locked(|st| reject_locked(st, handle, r));
        }
    }
}

impl Drop for ConnectionRequest {
    fn drop(&mut self) {
        self.reject_now();
    }
}
