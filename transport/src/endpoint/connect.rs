//! How endpoints are made: by socket address (through a listener's front, or UCX's
//! connection manager), by worker address, or accepted; ucxkit's handshake on them; and
//! the socket-address helpers they share.

use std::future::poll_fn;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ucx_sys as sys;

use super::{Endpoint, EndpointInner};
use crate::error::{Error, Peer, Result, Status};
use crate::handshake::{Kind, Message};
use crate::identity::ProcessIdentity;
use crate::liveness::{KeepaliveAddr, KeepaliveTarget, PidWatch};
use crate::worker::{self, EpState, HsWait, State, Worker};

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
    /// A worker address in UCX's form.
    Address(&'a [u8]),
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
            connect_payload: std::sync::OnceLock::new(),
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
                params.address = a.as_ptr().cast();
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
            connect_payload: std::sync::OnceLock::new(),
        });
        let weak = Arc::downgrade(&inner);
        self.shared.inner.locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.endpoint = weak;
            }
        });
        Ok(Endpoint { inner })
    }
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
    /// Sends the hello and waits for the answer; returns the peer's keepalive lane.
    pub(crate) async fn client_handshake(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<KeepaliveAddr>> {
        self.client_handshake_with(crate::auth::nonce(), false, timeout).await
    }

    /// Sends the hello with `nonce` (a front hello when `front`, whose nonce is the
    /// connection id of its request on the listener's front) and waits for the answer;
    /// returns the peer's keepalive lane (watched already where the peer's address is
    /// known: see [`Endpoint::start_watch`]).
    pub(crate) async fn client_handshake_with(
        &self,
        nonce: u64,
        front: bool,
        timeout: std::time::Duration,
    ) -> Result<Option<KeepaliveAddr>> {
        let hello = Message {
            kind: if front { Kind::FrontHello } else { Kind::Hello },
            peer_mode: self.inner.peer_mode,
            nonce,
            identity: ProcessIdentity::current(),
            lane: self.inner.worker.shared.lane.as_ref().map(|l| l.addr()),
        };
        let id = self.inner.id;
        let peer_mode = self.inner.peer_mode;
        self.with_handle("handshake", |st, h| {
            st.connects.insert(nonce, HsWait { waker: None, result: None, peer_mode, ep: id, expect: None });
            st.send_handshake(h, hello.encode(), true);
            Ok(())
        })?;
        let guard = HsGuard { ep: self, key: HsKey::Connect(nonce) };
        let (identity, lane) = self.await_handshake(&guard, timeout, "connect").await?;
        drop(guard);
        self.start_watch(identity, lane);
        Ok(lane)
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
        let (identity, lane) = self.await_handshake(&guard, timeout, "accept").await?;
        drop(guard);
        self.start_watch(identity, lane);
        Ok(())
    }

    async fn await_handshake(
        &self,
        guard: &HsGuard<'_>,
        timeout: std::time::Duration,
        op: &'static str,
    ) -> Result<(ProcessIdentity, Option<KeepaliveAddr>)> {
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
                    let failed = st.eps.get(&id).and_then(|e| e.failed).map(|f| f.status);
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
    pub(crate) async fn await_hs_for_test(
        &self,
        nonce: u64,
    ) -> Result<(ProcessIdentity, Option<KeepaliveAddr>)> {
        let guard = HsGuard { ep: self, key: HsKey::Connect(nonce) };
        self.await_handshake(&guard, std::time::Duration::from_secs(5), "connect").await
    }

    /// Records the peer's identity; for a peer process on this host, watches it; where
    /// the peer's address is known (a connect through a listener, an accepted
    /// endpoint), watches its keepalive `lane` (see [`crate::liveness`]).
    pub(crate) fn start_watch(&self, identity: ProcessIdentity, lane: Option<KeepaliveAddr>) {
        *self.inner.identity.lock().unwrap_or_else(|e| e.into_inner()) = Some(identity);
        if let Peer::Socket(a) | Peer::Accepted(Some(a)) = &self.inner.peer {
            self.start_keepalive(lane, &[a.ip()]);
        }
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
}

impl Endpoint {
    /// Has the worker's keepalive lane watch this endpoint's peer, whose lane is `lane`
    /// at one of `ips`: only in UCX's peer error mode (the pidfd watches the others) and
    /// when both sides have a lane.
    pub(crate) fn start_keepalive(&self, lane: Option<KeepaliveAddr>, ips: &[IpAddr]) {
        let (Some(peer), Some(own)) = (lane, self.inner.worker.shared.lane.as_ref()) else { return };
        if self.inner.peer_mode {
            let target: std::sync::Weak<EndpointInner> = Arc::downgrade(&self.inner);
            own.watch(ips, peer, target);
        }
    }
}

impl KeepaliveTarget for EndpointInner {
    fn usable(&self) -> bool {
        !self.usable.load(Ordering::Relaxed).is_null()
    }

    fn silent(self: Arc<Self>, silent: std::time::Duration) {
        tracing::warn!(
            ep = self.id,
            peer = %self.peer,
            "the peer did not answer the keepalive for {silent:?}: endpoint failed"
        );
        Endpoint { inner: self }.fail(Status::ENDPOINT_TIMEOUT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
