//! The state machine every buffer-owning operation future shares; [`SendOp`], the future
//! of the operations that read an owned buffer and report only success (tag and stream
//! sends, active-message sends, puts); and [`RecvOp`], the future of those that write
//! into one and report a length (stream receives, gets, active-message fetches).

use std::any::Any;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::worker::request::{Completion, Posted, Request};
use crate::worker::{State, Worker, WorkerShared};

/// The error for a receive that completed with a failed `status`: named after its
/// endpoint when it has one (see [`Endpoint::recv_error_of`]), else after any peer (a
/// worker-level receive, see [`Error::from_unbound_recv`]).
pub(crate) fn op_error(ep: Option<&Endpoint>, op: &'static str, status: crate::error::Status) -> Error {
    match ep {
        Some(ep) => ep.recv_error_of(op, status),
        None => Error::from_unbound_recv(op, status),
    }
}

/// What else UCX reads or writes until an operation completes (a remote key, a header
/// copy, an iov array), kept with the operation. An `Arc` so that keeping a remote key is
/// a reference-count increment, not an allocation.
pub(crate) type Extra = Arc<dyn Any + Send + Sync>;

/// How an operation ended: its completion, or the error found when posting (boxed, as
/// it travels through every poll), each with the buffer.
pub(crate) type Finish<B> = std::result::Result<(Completion, B), (Box<Error>, B)>;

/// Where an operation stands. The buffer lives in every state, so it can be given back
/// (or parked) whatever happens.
pub(crate) enum OpState<B> {
    Pending(Request, B),
    Done(Completion, B),
    /// Refused before posting. Boxed: errors are rare and large, and every future
    /// carrying an `OpState` is moved on the hot path.
    Failed(Box<Error>, B),
    Finished,
}

impl<B: Send + 'static> OpState<B> {
    /// The state for what a posting call returned.
    pub(crate) fn from_posted(posted: std::result::Result<Posted, Box<Error>>, buf: B) -> OpState<B> {
        match posted {
            Ok(Posted::Done(c)) => OpState::Done(c, buf),
            Ok(Posted::Pending(r)) => OpState::Pending(r, buf),
            Err(e) => OpState::Failed(e, buf),
        }
    }

    /// Whether the operation is no longer in flight: it completed during the call that
    /// posted it (or was refused), or it has been awaited.
    #[inline]
    pub(crate) fn completed_immediately(&self) -> bool {
        !matches!(self, OpState::Pending(..))
    }

    /// The handles a receive-type future keeps for this state: while the operation may
    /// be pending, the endpoint it is bound to (which holds its worker), or else the
    /// worker; when it failed, the endpoint (if any), for the error. One that succeeded at
    /// once keeps neither and changes no reference count.
    #[inline]
    pub(crate) fn kept_handles(
        &self,
        worker: &Worker,
        ep: Option<&Endpoint>,
    ) -> (Option<Worker>, Option<Endpoint>) {
        match self {
            OpState::Pending(..) => match ep {
                Some(ep) => (None, Some(ep.clone())),
                None => (Some(worker.clone()), None),
            },
            OpState::Done(c, _) if c.status().is_ok() => (None, None),
            _ => (None, ep.cloned()),
        }
    }

    /// Whether dropping this state has nothing to do: the operation was awaited to its
    /// end, or it completed at once with a buffer that needs no drop (a borrowed slice).
    #[inline(always)]
    pub(crate) fn is_inert(&self) -> bool {
        match self {
            OpState::Finished => true,
            OpState::Done(..) => !std::mem::needs_drop::<B>(),
            _ => false,
        }
    }

    /// The state of an operation refused before posting.
    pub(crate) fn failed(e: Error, buf: B) -> OpState<B> {
        OpState::Failed(Box::new(e), buf)
    }

    /// Drives the operation to its completion. Returns, once, the completion (or the
    /// error found when posting) together with the buffer. `worker` is needed only while
    /// the operation is pending.
    #[inline(always)]
    pub(crate) fn poll(&mut self, worker: Option<&WorkerShared>, cx: &mut Context<'_>) -> Poll<Finish<B>> {
        let pending = match self {
            OpState::Pending(r, _) => {
                match r.poll(worker.expect("invariant: a pending operation keeps its worker"), cx) {
                    Poll::Ready(c) => Some(c),
                    Poll::Pending => return Poll::Pending,
                }
            }
            _ => None,
        };
        Poll::Ready(match std::mem::replace(self, OpState::Finished) {
            OpState::Done(c, b) => Ok((c, b)),
            OpState::Pending(_, b) => Ok((pending.expect("set above"), b)),
            OpState::Failed(e, b) => Err((e, b)),
            OpState::Finished => panic!("operation future polled after completion"),
        })
    }

    /// For the owning future's `Drop`: a pending operation's buffer, and `extra` (what
    /// else UCX reads or writes: a header, a remote key, an iov array), stay with the
    /// worker until UCX completes the request.
    #[inline(always)]
    pub(crate) fn park(&mut self, worker: Option<&WorkerShared>, extra: Option<Extra>) {
        // The common case, a finished operation, has nothing to move or drop.
        if matches!(self, OpState::Pending(..)) {
            self.park_pending(worker, extra);
        }
    }

    /// [`OpState::park`] for a pending operation.
    #[inline(never)]
    fn park_pending(&mut self, worker: Option<&WorkerShared>, extra: Option<Extra>) {
        if let OpState::Pending(r, b) = std::mem::replace(self, OpState::Finished) {
            let worker = worker.expect("invariant: a pending operation keeps its worker");
            let keep: Box<dyn Any + Send> = match extra {
                Some(x) => Box::new((b, x)),
                None => Box::new(b),
            };
            drop(r.park(worker, keep));
        }
    }
}

/// Future of an operation that reads `buf` and reports only success:
/// [`Endpoint::tag_send`], [`Endpoint::stream_send`], [`Endpoint::am_send`],
/// [`Endpoint::put`]. Resolves to `(Result<()>, buffer)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer (and anything else the operation needs,
/// such as an active-message header or a remote key) is kept until UCX has finished with
/// it, and the operation may still take effect.
// The fields that own something are dropped by hand (`Drop`, `release`), so that dropping
// a future that holds nothing any more, the common case, is a check inlined where it is
// dropped rather than a call to the compiler's drop of every field.
#[must_use = "the operation is already posted; await the future to learn whether it succeeded"]
pub struct SendOp<B: Send + 'static> {
    /// Held only while the operation is pending or failed (a success at once needs
    /// nothing).
    ep: ManuallyDrop<Option<Endpoint>>,
    op: &'static str,
    state: ManuallyDrop<OpState<B>>,
    /// Only with `ep`.
    extra: ManuallyDrop<Option<Extra>>,
}

impl<B: IoBuf> SendOp<B> {
    /// Posts an operation on `ep` ([`Endpoint::post_op`]); `call` also gets the buffer's
    /// pointer and length. `extra` is called only if the operation is left pending (see
    /// [`SendOp::wrap`]). Always inlined: left a call, it no longer folds with the
    /// caller's constant arguments (about 70 instructions more per 8-byte active
    /// message, counted by `scripts/overhead-instructions`).
    #[inline(always)]
    pub(crate) fn post(
        ep: &Endpoint,
        op: &'static str,
        buf: B,
        extra: impl FnOnce() -> Option<Extra>,
        call: impl FnOnce(
            &mut State,
            sys::ucp_ep_h,
            *const u8,
            usize,
            &mut sys::ucp_request_param_t,
        ) -> sys::ucs_status_ptr_t,
    ) -> SendOp<B> {
        let mem = match crate::device::op_memory(ep.worker_inner(), op, &buf) {
            Ok(m) => m,
            Err(e) => return SendOp::failed(ep, op, e, buf),
        };
        let (ptr, len) = (buf.stable_ptr(), buf.bytes_init());
        let posted = ep.post_op(
            op,
            false,
            #[inline(always)]
            |st, h, param| {
                crate::device::set(param, mem);
                call(st, h, ptr, len, param)
            },
        );
        SendOp::wrap(ep, op, posted, buf, extra)
    }
}

impl<B: Send + 'static> SendOp<B> {
    /// Wraps what [`Endpoint::post_op`] returned. `extra` gives what else UCX uses until
    /// completion, kept with the buffer; it is called only for an operation left pending,
    /// so one that finished at once (a short put over shared memory, say) neither clones
    /// a remote key nor allocates.
    #[inline(always)]
    pub(crate) fn wrap(
        ep: &Endpoint,
        op: &'static str,
        posted: std::result::Result<Posted, Box<Error>>,
        buf: B,
        extra: impl FnOnce() -> Option<Extra>,
    ) -> SendOp<B> {
        let state = OpState::from_posted(posted, buf);
        let (ep, extra) = match state {
            OpState::Done(c, _) if c.status().is_ok() => (None, None),
            OpState::Pending(..) => (Some(ep.clone()), extra()),
            _ => (Some(ep.clone()), None),
        };
        SendOp {
            ep: ManuallyDrop::new(ep),
            op,
            state: ManuallyDrop::new(state),
            extra: ManuallyDrop::new(extra),
        }
    }

    /// Whether UCX completed the operation during the call that posted it (no request
    /// was left in flight), as it does for short messages and for puts into memory it
    /// maps directly; a refused operation counts too. Awaiting such an operation then
    /// returns at once, without progressing the worker. `false` means it was left in
    /// flight, though it may have finished since: only awaiting tells. (A future polled
    /// to its result also answers `true`.)
    ///
    /// This lets a sender keep a window of operations in flight the way UCX programs
    /// do, counting only those that did not complete immediately.
    pub fn completed_immediately(&self) -> bool {
        self.state.completed_immediately()
    }

    /// An operation refused before posting.
    #[inline]
    pub(crate) fn failed(ep: &Endpoint, op: &'static str, e: Box<Error>, buf: B) -> SendOp<B> {
        SendOp {
            ep: ManuallyDrop::new(Some(ep.clone())),
            op,
            state: ManuallyDrop::new(OpState::Failed(e, buf)),
            extra: ManuallyDrop::new(None),
        }
    }
}

// The future never pins its fields: the buffer is moved in and out by value.
impl<B: Send + 'static> Unpin for SendOp<B> {}

impl<B: Send + 'static> Future for SendOp<B> {
    type Output = (Result<()>, B);

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let worker = this.ep.as_ref().map(|e| &*e.worker().shared);
        match this.state.poll(worker, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err((e, b))) => Poll::Ready((Err(*e), b)),
            Poll::Ready(Ok((c, b))) => {
                *this.extra = None;
                let r = match &*this.ep {
                    Some(ep) if !c.status().is_ok() => Err(ep.error_of(this.op, c.status())),
                    _ => Ok(()),
                };
                Poll::Ready((r, b))
            }
        }
    }
}

impl<B: Send + 'static> Drop for SendOp<B> {
    #[inline(always)]
    fn drop(&mut self) {
        // Awaited (or done at once) and holding no endpoint: nothing to drop.
        if self.ep.is_none() && self.state.is_inert() {
            debug_assert!(self.extra.is_none(), "extra is only kept with the endpoint");
            return;
        }
        // SAFETY: from drop, once; the fields are not used afterwards.
        unsafe { self.release() };
    }
}

impl<B: Send + 'static> SendOp<B> {
    /// Drops the fields: a pending operation's buffer and extra are parked with the
    /// worker first. The buffer goes last, so that a buffer whose drop panics leaks no
    /// handle.
    ///
    /// # Safety
    /// Called once, from `drop`; the fields are not used afterwards.
    #[inline(never)]
    unsafe fn release(&mut self) {
        let worker = self.ep.as_ref().map(|e| &*e.worker().shared);
        let extra = self.extra.take();
        self.state.park(worker, extra);
        // SAFETY: per contract, each field is dropped once and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.extra);
            ManuallyDrop::drop(&mut self.ep);
            ManuallyDrop::drop(&mut self.state);
        }
    }
}

/// Future of an operation that writes into `buf` and reports how many bytes it wrote:
/// [`Endpoint::stream_recv`], [`Endpoint::get`], [`crate::AmMessage::recv_data`].
/// Resolves to `(Result<len>, buffer)`; on success the buffer's length is set to `len`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer (and anything else the operation needs,
/// such as a remote key) is kept until UCX has finished writing it. What lands there is
/// lost; see each operation for what that means.
#[must_use = "a receive-type operation does nothing useful unless awaited"]
pub struct RecvOp<B: IoBufMut> {
    own: Owned<B, Option<Extra>>,
    op: &'static str,
    /// The length on success: fixed (a get, a fetch) or, when None, what UCX reported.
    len: Option<usize>,
}

/// What a receive-type future owns ([`RecvOp`], [`crate::TagRecv`]): the operation's
/// state, the handles that state needs ([`OpState::kept_handles`]) and what else UCX
/// reads or writes until the operation completes. Dropping it parks a pending
/// operation's buffer and extra with the worker.
///
/// `X` is what else the operation keeps: [`Extra`] where there may be some, nothing
/// (`()`, no room in the future) where there never is.
// The fields that own something are dropped by hand, as in `SendOp`.
pub(crate) struct Owned<B: Send + 'static, X: Kept = ()> {
    /// Needed only while the operation may be pending and bound to no endpoint (None
    /// for one finished at once).
    worker: ManuallyDrop<Option<Worker>>,
    /// For error messages (a failed endpoint becomes `ConnectionReset`), and, while the
    /// operation may be pending, for its worker.
    ep: ManuallyDrop<Option<Endpoint>>,
    state: ManuallyDrop<OpState<B>>,
    extra: ManuallyDrop<X>,
}

/// What else an operation keeps until UCX completes it (see [`Owned`]).
pub(crate) trait Kept {
    /// Whether nothing is kept.
    fn is_empty(&self) -> bool;
    /// Takes what is kept, for parking.
    fn take(&mut self) -> Option<Extra>;
}

impl Kept for () {
    #[inline(always)]
    fn is_empty(&self) -> bool {
        true
    }
    #[inline(always)]
    fn take(&mut self) -> Option<Extra> {
        None
    }
}

impl Kept for Option<Extra> {
    #[inline(always)]
    fn is_empty(&self) -> bool {
        self.is_none()
    }
    #[inline(always)]
    fn take(&mut self) -> Option<Extra> {
        Option::take(self)
    }
}

impl<B: Send + 'static, X: Kept> Owned<B, X> {
    #[inline(always)]
    pub(crate) fn new(
        worker: Option<Worker>,
        ep: Option<Endpoint>,
        state: OpState<B>,
        extra: X,
    ) -> Owned<B, X> {
        Owned {
            worker: ManuallyDrop::new(worker),
            ep: ManuallyDrop::new(ep),
            state: ManuallyDrop::new(state),
            extra: ManuallyDrop::new(extra),
        }
    }

    /// As for [`OpState::completed_immediately`].
    #[inline(always)]
    pub(crate) fn completed_immediately(&self) -> bool {
        self.state.completed_immediately()
    }

    /// The worker of a pending operation: its own handle, or its endpoint's.
    #[inline(always)]
    fn worker_of<'a>(worker: &'a Option<Worker>, ep: &'a Option<Endpoint>) -> Option<&'a WorkerShared> {
        match (worker, ep) {
            (Some(w), _) => Some(&w.shared),
            (None, Some(ep)) => Some(&ep.worker().shared),
            (None, None) => None,
        }
    }

    /// Drives the operation (see [`OpState::poll`]); once it is done, UCX needs the extra
    /// no more.
    #[inline(always)]
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Finish<B>> {
        let r = self.state.poll(Self::worker_of(&self.worker, &self.ep), cx);
        if r.is_ready() && !self.extra.is_empty() {
            drop(self.extra.take());
        }
        r
    }

    /// Drives the operation to its end: the error found when posting, or what `done`
    /// makes of the completion (with the buffer and the endpoint kept), each with the
    /// buffer.
    #[inline(always)]
    pub(crate) fn poll_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        done: impl FnOnce(Completion, &mut B, Option<&Endpoint>) -> Result<T>,
    ) -> Poll<(Result<T>, B)> {
        match self.poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err((e, b))) => Poll::Ready((Err(*e), b)),
            Poll::Ready(Ok((c, mut b))) => {
                let r = done(c, &mut b, self.ep.as_ref());
                Poll::Ready((r, b))
            }
        }
    }

    /// [`Owned::poll_with`] without a task, for an operation that is not pending: its
    /// outcome, taken (None while it is pending, or once taken).
    #[inline(always)]
    pub(crate) fn take_done<T>(
        &mut self,
        done: impl FnOnce(Completion, &mut B, Option<&Endpoint>) -> Result<T>,
    ) -> Option<(Result<T>, B)> {
        match std::mem::replace(&mut *self.state, OpState::Finished) {
            OpState::Done(c, mut b) => {
                let r = done(c, &mut b, self.ep.as_ref());
                Some((r, b))
            }
            OpState::Failed(e, b) => Some((Err(*e), b)),
            OpState::Finished => None,
            pending @ OpState::Pending(..) => {
                *self.state = pending;
                None
            }
        }
    }

    /// Drops the fields: a pending operation's buffer and extra are parked with the
    /// worker first. The buffer goes last, as in `SendOp`.
    ///
    /// # Safety
    /// Called once, from `drop`; the fields are not used afterwards.
    #[inline(never)]
    unsafe fn release(&mut self) {
        let extra = self.extra.take();
        self.state.park(Self::worker_of(&self.worker, &self.ep), extra);
        // SAFETY: per contract, each field is dropped once and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.extra);
            ManuallyDrop::drop(&mut self.ep);
            ManuallyDrop::drop(&mut self.worker);
            ManuallyDrop::drop(&mut self.state);
        }
    }
}

impl<B: Send + 'static, X: Kept> Drop for Owned<B, X> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.extra.is_empty() && self.state.is_inert() {
            // Awaited to its end (or done at once with a buffer that needs no drop): at
            // most the handles to let go, inline.
            // SAFETY: from drop, once; the fields are not used afterwards.
            unsafe {
                ManuallyDrop::drop(&mut self.ep);
                ManuallyDrop::drop(&mut self.worker);
            }
            return;
        }
        // SAFETY: from drop, once; the fields are not used afterwards.
        unsafe { self.release() };
    }
}

impl<B: IoBufMut> RecvOp<B> {
    #[inline]
    pub(crate) fn new(
        worker: Option<Worker>,
        ep: Option<Endpoint>,
        op: &'static str,
        len: Option<usize>,
        state: OpState<B>,
        extra: Option<Extra>,
    ) -> RecvOp<B> {
        RecvOp { own: Owned::new(worker, ep, state, extra), op, len }
    }

    /// The future of an operation just posted on `ep`, keeping only the handles its
    /// state needs ([`OpState::kept_handles`]: none for one that succeeded at once, a
    /// short get over shared memory say).
    #[inline]
    pub(crate) fn posted(
        ep: &Endpoint,
        op: &'static str,
        len: Option<usize>,
        state: OpState<B>,
        extra: Option<Extra>,
    ) -> RecvOp<B> {
        let (worker, ep) = state.kept_handles(ep.worker(), Some(ep));
        RecvOp::new(worker, ep, op, len, state, extra)
    }

    /// Whether UCX completed the operation during the call that posted it (a get from
    /// memory it maps directly, say), or refused it; as for
    /// [`SendOp::completed_immediately`].
    pub fn completed_immediately(&self) -> bool {
        self.own.completed_immediately()
    }
}

impl<B: IoBufMut> Unpin for RecvOp<B> {}

impl<B: IoBufMut> Future for RecvOp<B> {
    type Output = (Result<usize>, B);

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (len, op) = (self.len, self.op);
        self.get_mut().own.poll_with(cx, |c, b, ep| {
            if !c.status().is_ok() {
                if len.is_none() && c.len > 0 {
                    // A stream receive that gathered some bytes before the endpoint
                    // failed (or closed): they stay readable in the buffer.
                    // SAFETY: UCX wrote c.len bytes at the start of the buffer.
                    unsafe { b.set_init(c.len.min(b.bytes_total())) };
                }
                return Err(failure(ep, op, c.status()));
            }
            let n = len.unwrap_or(c.len).min(b.bytes_total());
            // SAFETY: UCX wrote n bytes at the start of the buffer.
            unsafe { b.set_init(n) };
            Ok(n)
        })
    }
}

/// The error for a receive-type operation that completed with a failed status.
#[cold]
#[inline(never)]
fn failure(ep: Option<&Endpoint>, op: &'static str, status: crate::error::Status) -> Error {
    op_error(ep, op, status)
}
