//! The listening side of the front: a TCP listener whose connections go through the
//! opening and the client's request before the application sees them, and the accept
//! that follows the application's decision.
//!
//! When both contexts have UCX's connection manager (tcp), the accept opens a UCX
//! listener for that one client on the address the client reached the front at, and
//! closes it once the client's endpoint is in (or the accept's timeout ran out);
//! otherwise the accepted endpoint comes from the client's worker address (see
//! [`crate::pairing`]). The connection manager is preferred for two reasons:
//! - UCX's connection manager tells an endpoint that its peer closed, in every error
//!   mode, so that UCX ends the operations still pending on it (a send the peer will
//!   never receive); an endpoint made from a worker address learns it only in peer
//!   mode.
//! - Made from a worker address, UCX's TCP transport carries each direction on a
//!   socket of its own, and when the peer dies during a zero-copy send on the sending
//!   socket, UCX (1.13 to 1.22 at least) completes that send twice
//!   (`uct_tcp_ep_sendv` after `uct_tcp_ep_handle_send_err`, which purges it first):
//!   an assertion that aborts the process in Debian's 1.13, a write into a released
//!   request in builds without assertions. Through the connection manager one socket
//!   carries both directions, and the peer's death is seen on the receiving side
//!   first.
//!
//! The one-shot port is open only after the front accepted the client (with a secret:
//! after both proved they hold it), and only a hello that carries the connection id of
//! that client's request is taken there. Whoever else reaches the port while it is
//! open reaches UCX's connection-manager parser, as with any UCX listener (see the
//! threat model in [`crate::front`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};

use super::conn::{Broken, Conn};
use super::wire::{Accept, Msg, Reason, Request};
use crate::auth::Secret;
use crate::endpoint::Endpoint;
use crate::error::{Error, Peer, Result};
use crate::handshake::{Kind, NackReason};
use crate::identity::ProcessIdentity;
use crate::liveness::KeepaliveAddr;
use crate::pairing::Adopt;
use crate::worker::{EndpointOptions, FrontWait, Worker};

/// Connections still in their opening (hellos, proofs, request) at once; more are
/// closed as they come, so that idle or slow clients cannot hold the listener's memory.
const MAX_OPENING: usize = 64;
/// How long a client may take over its opening and request.
const OPEN_LIMIT: Duration = Duration::from_secs(10);
/// Requests waiting for the application at once; more are refused as busy.
const MAX_QUEUED: usize = 128;

/// A client whose opening and request went through, waiting for the application.
pub(crate) struct Pending {
    pub(crate) conn: Conn,
    pub(crate) request: Request,
    pub(crate) client: Option<SocketAddr>,
}

impl Pending {
    /// Refuses the client, in the background (the connection ends either way).
    pub(crate) fn refuse_later(mut self, reason: Reason, text: &'static str) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { self.conn.refuse(reason, text).await });
        }
    }
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Pending>,
    closed: bool,
}

/// Requests waiting for [`crate::Listener::next`].
#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    notify: Notify,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `p`, or gives it back when the queue is full or closed.
    fn push(&self, p: Pending) -> std::result::Result<(), Box<(Pending, Reason)>> {
        let mut q = self.lock();
        if q.closed {
            return Err(Box::new((p, Reason::Closed)));
        }
        if q.items.len() >= MAX_QUEUED {
            return Err(Box::new((p, Reason::Busy)));
        }
        q.items.push_back(p);
        drop(q);
        self.notify.notify_one();
        Ok(())
    }
}

/// A listener's front: the TCP listener's accept loop, and the requests it queued.
pub(crate) struct FrontListener {
    queue: Arc<Queue>,
    task: tokio::task::AbortHandle,
}

impl FrontListener {
    /// Listens on `addr` for clients of the worker whose UCX uuid is `uuid`; with a
    /// secret, only clients that prove they hold it get through.
    pub(crate) fn bind(
        addr: SocketAddr,
        secret: Option<Secret>,
        uuid: u64,
    ) -> Result<(FrontListener, SocketAddr)> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::ApiMisuse("Worker::listen outside a tokio runtime".into()))?;
        let io = |op, source| Error::Io { op, source };
        let std_listener = std::net::TcpListener::bind(addr).map_err(|e| io("binding the listener", e))?;
        std_listener.set_nonblocking(true).map_err(|e| io("binding the listener", e))?;
        let bound = std_listener.local_addr().map_err(|e| io("binding the listener", e))?;
        // (Inside the runtime: `try_current` found it.)
        let listener =
            tokio::net::TcpListener::from_std(std_listener).map_err(|e| io("binding the listener", e))?;
        let queue = Arc::new(Queue::default());
        let task = rt.spawn(accept_loop(listener, queue.clone(), secret, uuid)).abort_handle();
        Ok((FrontListener { queue, task }, bound))
    }

    /// The next request that went through its opening.
    pub(crate) async fn next(&self) -> Option<Pending> {
        loop {
            let notified = self.queue.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut q = self.queue.lock();
                if let Some(p) = q.items.pop_front() {
                    return Some(p);
                }
                if q.closed {
                    return None;
                }
            }
            notified.await;
        }
    }
}

impl Drop for FrontListener {
    fn drop(&mut self) {
        self.close();
    }
}

impl FrontListener {
    /// Stops accepting and refuses the requests nobody took; idempotent.
    pub(crate) fn close(&self) {
        self.task.abort();
        let left: Vec<Pending> = {
            let mut q = self.queue.lock();
            q.closed = true;
            q.items.drain(..).collect()
        };
        self.queue.notify.notify_waiters();
        for p in left {
            p.refuse_later(Reason::Closed, "the listener was closed");
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    queue: Arc<Queue>,
    secret: Option<Secret>,
    uuid: u64,
) {
    let opening = Arc::new(Semaphore::new(MAX_OPENING));
    loop {
        let (stream, client) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, say: wait a little instead of spinning.
                tracing::warn!("listener accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = opening.clone().try_acquire_owned() else {
            tracing::debug!(%client, "too many connections in their opening: closed");
            continue;
        };
        let (queue, secret) = (queue.clone(), secret.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let mut conn = Conn::new(stream);
            match tokio::time::timeout(OPEN_LIMIT, opening_of(&mut conn, secret.as_ref(), uuid)).await {
                Ok(Ok(request)) => {
                    if let Err(back) = queue.push(Pending { conn, request, client: Some(client) }) {
                        let (p, reason) = *back;
                        p.refuse_later(reason, "the listener has too many requests waiting, or was closed");
                    }
                }
                Ok(Err(e)) => tracing::debug!(%client, "front connection refused: {e}"),
                Err(_) => tracing::debug!(%client, "front connection too slow: closed"),
            }
        });
    }
}

/// A client's opening and request.
async fn opening_of(
    conn: &mut Conn,
    secret: Option<&Secret>,
    uuid: u64,
) -> std::result::Result<Request, Broken> {
    conn.open_server(secret, OPEN_LIMIT).await?;
    match conn.recv().await? {
        Msg::Request(r) if r.uuid == uuid => {
            conn.refuse(
                Reason::SameWorker,
                "a worker cannot connect to its own listener: use another worker",
            )
            .await;
            Err(Broken::Refused(Reason::SameWorker, "the client is this worker".into()))
        }
        Msg::Request(r) => Ok(r),
        m => {
            conn.refuse(Reason::Protocol, "expected a request").await;
            Err(Broken::Protocol(format!("expected a request, got a {}", m.name())))
        }
    }
}

/// Removes a front accept's entry from the worker when the accept ends.
struct WaitGuard<'a> {
    worker: &'a Worker,
    conn: u64,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let conn = self.conn;
        self.worker.shared.inner.locked(|st| {
            st.front_accepts.remove(&conn);
        });
    }
}

/// Accepts `p` on `worker` with `opts`: agrees on the error mode, answers with this
/// worker's address, waits for the client's hello and takes its endpoint over.
pub(crate) async fn accept(worker: &Worker, mut p: Pending, opts: &EndpointOptions) -> Result<Endpoint> {
    let payload = std::mem::take(&mut p.request.payload);
    let ep = accept_pending(worker, p, opts).await?;
    ep.set_connect_payload(payload);
    Ok(ep)
}

/// [`accept`], the payload aside.
async fn accept_pending(worker: &Worker, p: Pending, opts: &EndpointOptions) -> Result<Endpoint> {
    let Pending { mut conn, request, client } = p;
    let peer = Peer::Accepted(client);
    let shm = crate::identity::shares_memory(&request.identity)
        && request.shared_memory
        && worker.context().has_shared_memory();
    let Some(peer_mode) = super::resolve_mode(request.error_mode, opts.error_mode, shm) else {
        let text = format!(
            "error mode mismatch: the client asks for {:?}, this side uses {:?} (set the same ErrorMode on \
             both sides, or Auto on one)",
            request.error_mode, opts.error_mode
        );
        conn.refuse(Reason::ErrorMode, text.clone()).await;
        return Err(Error::Handshake { peer, reason: text });
    };
    let uuid = worker.uuid()?;
    let conn_id = request.conn;
    let via_cm = request.connection_manager && super::has_connection_manager(&worker.context());
    let accept = Accept {
        identity: ProcessIdentity::current(),
        uuid,
        shared_memory: worker.context().has_shared_memory(),
        peer_mode,
        cm_port: 0,
        address: worker.shared.own_address.clone(),
    };
    if via_cm {
        return accept_through_cm(worker, conn, accept, &request, peer, opts).await;
    }
    let fresh = worker.shared.inner.locked(|st| {
        if st.front_accepts.contains_key(&conn_id) {
            return false;
        }
        st.front_accepts.insert(conn_id, FrontWait { hellos: Default::default(), waker: None });
        true
    });
    if !fresh {
        conn.refuse(Reason::Protocol, "connection id in use").await;
        return Err(Error::Handshake { peer, reason: "the client reused a connection id".into() });
    }
    let _guard = WaitGuard { worker, conn: conn_id };
    let accept = Msg::Accept(accept);
    let broken = |e: Broken| front_error(&peer, e);
    conn.send(&accept).await.map_err(broken)?;
    let adopt = async {
        let mut seen = 0u32;
        loop {
            let (reply_ep, hello_mode, lane) = next_hello(worker, conn_id).await;
            seen += 1;
            let outcome = worker.shared.inner.locked(|st| {
                if hello_mode != peer_mode {
                    st.send_notice(reply_ep, Kind::Nack(NackReason::ErrorModeMismatch), peer_mode, conn_id);
                    return Err(Some(format!(
                        "the client's hello uses {} error mode, agreed was {}",
                        mode(hello_mode),
                        mode(peer_mode)
                    )));
                }
                match st.adopt(request.uuid, reply_ep, peer_mode) {
                    Ok(id) => {
                        st.send_ack(reply_ep, peer_mode, conn_id, lane.is_some());
                        Ok(id)
                    }
                    Err(Adopt::Collision) => {
                        st.send_notice(reply_ep, Kind::Nack(NackReason::Collision), peer_mode, conn_id);
                        Err(None)
                    }
                    Err(Adopt::NotFound) => {
                        st.send_notice(reply_ep, Kind::Nack(NackReason::Malformed), peer_mode, conn_id);
                        Err(Some(
                            "the endpoint the client's hello came through could not be taken over".into(),
                        ))
                    }
                }
            });
            match outcome {
                Ok(id) => return Ok((id, lane)),
                Err(Some(reason)) => return Err(Error::Handshake { peer: peer.clone(), reason }),
                Err(None) if seen > super::MAX_COLLISIONS => {
                    return Err(Error::Handshake {
                        peer: peer.clone(),
                        reason: "the connection collided with others between the same workers too often"
                            .into(),
                    })
                }
                Err(None) => tracing::debug!(conn = conn_id, "hello through an endpoint in use: collision"),
            }
        }
    };
    let (id, lane) = tokio::select! {
        r = tokio::time::timeout(opts.timeout, adopt) => match r {
            Ok(r) => r?,
            Err(_) => return Err(Error::Timeout { op: "accept", peer, after: opts.timeout }),
        },
        e = gave_up(&mut conn, &peer) => return Err(e),
    };
    let ep = Endpoint::from_registered(worker, id, peer, peer_mode);
    ep.set_peer_uuid(Some(request.uuid));
    ep.start_watch(request.identity, lane);
    ep.check_required(&opts.require_transports)?;
    tracing::debug!(ep = id, "accepted through the front");
    Ok(ep)
}

/// Connections to an accept's one-shot port that are not its client's taken before the
/// port takes no more.
const MAX_STRAYS: u32 = 8;

/// The accept through UCX's connection manager: a UCX listener on the address the
/// client reached, for this client only (see the module docs).
async fn accept_through_cm(
    worker: &Worker,
    mut conn: Conn,
    mut accept: Accept,
    request: &Request,
    peer: Peer,
    opts: &EndpointOptions,
) -> Result<Endpoint> {
    let here = conn.local_addr().map_err(|e| Error::Handshake {
        peer: peer.clone(),
        reason: format!("the front connection's address: {e}"),
    })?;
    let listener = worker.listen_ucx(SocketAddr::new(here.ip(), 0), opts.clone())?;
    accept.cm_port = listener.local_addr().port();
    let peer_mode = accept.peer_mode;
    conn.send(&Msg::Accept(accept)).await.map_err(|e| front_error(&peer, e))?;
    let conn_id = request.conn;
    let accepted = async {
        // Every connection to the port is heard at once, so that one that never says
        // hello does not hold up the client's; only the client's hello is taken, and
        // after [`MAX_STRAYS`] others the port takes no more.
        let mut accepts = tokio::task::JoinSet::new();
        let mut taken = 0;
        loop {
            tokio::select! {
                r = listener.next(), if taken <= MAX_STRAYS => {
                    taken += 1;
                    let (peer, timeout) = (peer.clone(), opts.timeout);
                    accepts.spawn(r?.accept_for_front(conn_id, peer, peer_mode, timeout));
                }
                Some(done) = accepts.join_next() => match done {
                    Ok(Ok(ep)) => return Ok(ep),
                    Ok(Err(e)) => tracing::debug!("a connection to the one-shot port not the client's: {e}"),
                    Err(e) => tracing::debug!("an accept on the one-shot port ended: {e}"),
                },
                else => {
                    return Err(Error::Handshake {
                        peer: peer.clone(),
                        reason: "the client did not connect to the one-shot port".into(),
                    })
                }
            }
        }
    };
    let ep = tokio::select! {
        r = tokio::time::timeout(opts.timeout, accepted) => match r {
            Ok(r) => r?,
            Err(_) => return Err(Error::Timeout { op: "accept", peer, after: opts.timeout }),
        },
        e = gave_up(&mut conn, &peer) => return Err(e),
    };
    drop(listener);
    ep.set_peer_uuid(Some(request.uuid));
    ep.check_required(&opts.require_transports)?;
    tracing::debug!("accepted through the front and UCX's connection manager");
    Ok(ep)
}

/// Resolves when the other side of a front connection gives up after the accept: it
/// writes nothing else. Its end of file is no news (a client closes the front once its
/// connect is done, which may be seen before the accept completes); the accept's
/// deadline bounds the wait.
pub(crate) async fn gave_up(conn: &mut Conn, peer: &Peer) -> Error {
    match conn.recv().await {
        Ok(m) => {
            Error::Handshake { peer: peer.clone(), reason: format!("the other side sent a {}", m.name()) }
        }
        Err(Broken::Io(_)) => std::future::pending().await,
        Err(e) => front_error(peer, e),
    }
}

fn mode(peer_mode: bool) -> &'static str {
    if peer_mode {
        "peer"
    } else {
        "no"
    }
}

/// Takes connection `conn`'s next hello, once one came: the endpoint it came through and
/// the error mode it says the connecting side uses, and its keepalive lane.
async fn next_hello(worker: &Worker, conn: u64) -> (ucx_sys::ucp_ep_h, bool, Option<KeepaliveAddr>) {
    let inner = &worker.shared.inner;
    std::future::poll_fn(|cx| {
        inner.poll_until(
            cx,
            |st| st.front_accepts.get_mut(&conn).and_then(|w| w.hellos.pop_front()),
            |st, waker| {
                if let Some(w) = st.front_accepts.get_mut(&conn) {
                    w.waker = Some(waker.clone());
                }
            },
        )
    })
    .await
}

/// The error for a front connection that broke.
pub(crate) fn front_error(peer: &Peer, e: Broken) -> Error {
    let peer = peer.clone();
    match e {
        Broken::Io(source) => match source.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => Error::ConnectionReset {
                op: "the listener's front",
                peer,
                source: crate::error::Status::CONNECTION_RESET,
            },
            _ => Error::Io { op: "talking over the listener's front", source },
        },
        Broken::Protocol(reason) => Error::Handshake { peer, reason },
        Broken::Refused(reason, text) => Error::Refused { peer, reason: format!("{text} ({reason:?})") },
        Broken::Aborted(text) => Error::Handshake { peer, reason: format!("the other side gave up: {text}") },
        Broken::Authentication(reason) => Error::Authentication { peer, reason },
        Broken::Timeout => Error::Timeout { op: "the listener's front", peer, after: OPEN_LIMIT },
    }
}
