//! [`Endpoint`]: a connection to one peer (`ucp_ep_h`), made by socket address
//! ([`Worker::connect`]), by worker address ([`Worker::connect_address`]) or accepted by
//! a [`crate::Listener`].

use std::future::poll_fn;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use ucx_sys as sys;

use crate::error::{Error, Peer, Result, Status};
use crate::handshake::Kind;
use crate::identity::ProcessIdentity;
use crate::worker::param;
use crate::worker::request::{Completion, Posted, Request};
use crate::worker::{State, Worker};

mod connect;
#[cfg(test)]
mod keepalive_tests;
mod lanes;

pub(crate) use connect::{is_local_ip, sockaddr_of, socket_addr_from, Target};
pub use lanes::Lane;

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
    /// What the client sent with its connect (accepted endpoints; see
    /// [`Endpoint::connect_payload`]).
    connect_payload: std::sync::OnceLock<Box<[u8]>>,
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
        let parting = inner.locked(|st| {
            if st.is_parting(id) || st.eps.get(&id).is_some_and(|e| e.hidden) {
                // A `close()` given up on while it closes through the peer: it goes on.
                // Or a hidden endpoint, kept for its peer (see `Endpoint::hide`).
                return false;
            }
            let open = st.eps.get(&id).is_some_and(|e| !e.handle.is_null());
            if open && notice.is_some_and(|k| st.part(id, k)) {
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
        if parting {
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

impl Endpoint {
    pub(crate) fn worker_inner(&self) -> &crate::worker::WorkerInner {
        &self.inner.worker.shared.inner
    }

    /// The endpoint behind a worker's type-erased handle of it, if it is still alive.
    pub(crate) fn from_ref(r: &crate::worker::EndpointRef) -> Option<Endpoint> {
        r.upgrade()?.downcast::<EndpointInner>().ok().map(|inner| Endpoint { inner })
    }

    /// The worker this endpoint belongs to.
    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    /// Who this endpoint talks to.
    pub fn peer(&self) -> &Peer {
        &self.inner.peer
    }

    /// On an endpoint accepted through a [`crate::Listener`], the payload the client
    /// sent with its connect ([`crate::EndpointOptions::connect_payload`]): who it is, a
    /// rank, a node id. Empty when it sent none, and on every other endpoint.
    pub fn connect_payload(&self) -> &[u8] {
        self.inner.connect_payload.get().map_or(&[], |p| p)
    }

    /// Records the client's connect payload on an accepted endpoint.
    pub(crate) fn set_connect_payload(&self, payload: Vec<u8>) {
        if !payload.is_empty() {
            let _ = self.inner.connect_payload.set(payload.into_boxed_slice());
        }
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
        self.worker_inner().locked(|st| st.eps.get(&id).and_then(|e| e.failed).map(|f| f.status))
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
        let leave = crate::worker::Leave::new(inner, id, crate::worker::List::Stream);
        std::future::poll_fn(|cx| {
            inner.locked(|st| match st.eps.get(&id).map(|e| e.failed.map(|f| f.status)) {
                Some(Some(s)) => Poll::Ready(s),
                Some(None) => {
                    // Woken by the endpoint's failure (and by stream events; then this
                    // looks again).
                    leave.register(st, cx.waker());
                    Poll::Pending
                }
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
        self.worker_inner().locked(
            #[inline(always)]
            |st| match self.inner.usable.load(Ordering::Relaxed) {
                h if h.is_null() => Err(Box::new(self.unusable(st, op))),
                h => Ok(f(st, h)),
            },
        )
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
        match st.eps.get(&self.inner.id).filter(|e| !e.closing).and_then(|e| e.failed).map(|f| f.status) {
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
        let parting = inner.locked(|st| {
            if let Some(e) = st.eps.get_mut(&id) {
                e.closing = true;
            }
            // (A close from another clone while it parts waits for the same end.)
            st.is_parting(id) || notice.is_some_and(|k| st.part(id, k))
        });
        if parting {
            // The driver moves it on (the flush, the peer's disconnect, the deadline).
            inner.signal.kick();
            let leave = crate::worker::Leave::new(inner, id, crate::worker::List::Parting);
            std::future::poll_fn(|cx| inner.locked(|st| st.wait_parting(id, &leave, cx.waker()))).await;
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
        let posted = self.with_live(
            op,
            #[inline(always)]
            |st, h| {
                let mut param = op_param(st, no_imm);
                let p = call(st, h, &mut param);
                let posted = Posted::from_ptr(p, Completion::OK, false);
                if let Posted::Pending(r) = &posted {
                    r.bind(st, id, crate::slot::OpKind::Finish);
                }
                posted
            },
        );
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
            let mut param = param::send(st, param::FORCE_IMM, 0);
            match Posted::from_ptr(call(h, &mut param), Completion::OK, false) {
                Posted::Done(c) => c.status(),
                Posted::Pending(r) => left_pending(inner, st, op, r),
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

/// Waits, under the lock, for an operation UCX left pending despite
/// `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL` (out of line: it should not happen), and returns its
/// status once UCX is done with the buffer.
#[cold]
#[inline(never)]
fn left_pending(inner: &crate::worker::WorkerInner, st: &mut State, op: &'static str, r: Request) -> Status {
    tracing::error!(op, "UCX left an operation pending despite FORCE_IMM_CMPL; waiting for it");
    let c = r.finish_locked(st, |st| {
        inner.progress_locked(st);
    });
    debug_assert!(false, "UCX left {op} pending despite FORCE_IMM_CMPL");
    c.status()
}

/// Request parameters for a send-type operation on this worker.
#[inline(always)]
pub(crate) fn op_param(st: &mut State, no_imm: bool) -> sys::ucp_request_param_t {
    param::send(st, param::no_imm(no_imm), 0)
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
            let p = crate::worker::request::Posted::Pending(req);
            self.worker.shared.inner.locked(|st| match self.close {
                Some(id) => st.finish_close(id, p),
                None => st.release(p),
            });
        }
    }
}
