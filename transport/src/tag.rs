//! Tagged messaging: send and receive with a 64-bit tag and a mask
//! (`ucp_tag_send_nbx`, `ucp_tag_recv_nbx`, `ucp_tag_probe_nb`, `ucp_tag_msg_recv_nbx`).
//!
//! A receive matches a message when `(message_tag & mask) == (tag & mask)`. Messages
//! from one endpoint match in the order they were sent. The wire format is UCX's own, so
//! these calls interoperate with any UCX program using the tag API (turn the handshake
//! off with [`crate::EndpointOptions::handshake`] to talk to one).
//!
//! The application's tags are 63 bits: the top bit is 0, and a tag with it set is
//! refused. Tags with the top bit set belong to [`crate::namespace`]s, which let layers
//! such as collectives share a worker with the application without their messages
//! matching each other's receives.
//!
//! Every operation takes its buffer by value and returns it with the result, as
//! `(Result<T>, B)`, except [`Endpoint::try_tag_send`], which borrows its bytes for the
//! call only: UCX copies them during the call or sends nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::Endpoint;
use crate::error::{Error, ErrorKind, Result, Status};
use crate::op::{OpState, Owned, SendOp};
use crate::worker::param::{no_imm as no_imm_bit, param, Callback};
use crate::worker::request::{tag_recv_cb, Completion, Posted};
use crate::worker::{State, Worker, WorkerInner};

/// A tag: 63 bits for the application, [`crate::namespace::TAG_BITS`] in a namespace.
pub type Tag = u64;

/// The tag bits the application's own tags may use: the low 63 (see [`crate::namespace`]).
pub const APP_TAG_BITS: u32 = 63;

/// Where a tag operation's tags live on the wire: the application's space (top bit 0) or
/// a namespace's (top bit 1, the namespace's number in the next 7 bits). A tag given to
/// an operation is local to its space; [`Space::wire`] makes the tag UCX sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Space {
    /// The bits that select the space, set in every wire tag of it.
    prefix: u64,
    /// The bits that name the space: matched by every receive in it.
    pub(crate) fixed: u64,
}

impl Space {
    /// Every tag bit (for a receive refused before posting, which reports no tag).
    pub(crate) const APP_ALL: Space = Space { prefix: 0, fixed: 0 };

    /// The application's space on a worker with namespaces.
    #[cfg(test)]
    pub(crate) const APP: Space = Space { prefix: 0, fixed: 1 << APP_TAG_BITS };

    /// The application's space on `worker`: its tags below the namespaces', or all 64
    /// bits on a worker without namespaces.
    #[inline(always)]
    pub(crate) fn app(worker: &WorkerInner) -> Space {
        Space { prefix: 0, fixed: (worker.namespaces as u64) << APP_TAG_BITS }
    }

    /// The space of namespace `n` (1..=127), whose tags have `bits` bits.
    pub(crate) const fn namespace(n: u8, bits: u32) -> Space {
        Space { prefix: (0x80 | n as u64) << bits, fixed: u64::MAX << bits }
    }

    /// The wire tag of `tag`, None when `tag` does not fit the space.
    #[inline(always)]
    pub(crate) fn wire(self, tag: Tag) -> Option<Tag> {
        (tag & self.fixed == 0).then_some(tag | self.prefix)
    }

    /// The wire mask for a receive with `mask`: it always matches the space.
    #[inline(always)]
    pub(crate) fn wire_mask(self, mask: u64) -> u64 {
        mask | self.fixed
    }

    /// The tag local to the space of wire tag `tag`.
    #[inline(always)]
    pub(crate) fn local(self, tag: Tag) -> Tag {
        tag & !self.fixed
    }

    /// The wire tag and mask of a receive, or the error for a tag outside the space.
    #[inline(always)]
    pub(crate) fn wire_recv(self, tag: Tag, mask: u64) -> std::result::Result<(Tag, u64), Box<Error>> {
        match self.wire(tag & mask) {
            Some(t) => Ok((t, self.wire_mask(mask))),
            None => Err(Box::new(self.bad_tag(tag))),
        }
    }

    /// The error for `tag`, outside the space.
    #[cold]
    #[inline(never)]
    pub(crate) fn bad_tag(self, tag: Tag) -> Error {
        let bits = self.fixed.trailing_zeros();
        Error::ApiMisuse(format!(
            "tag {tag:#x} does not fit in {bits} bits (the higher tag bits belong to namespaces; see ucxkit_transport::namespace)"
        ))
    }
}

/// The mask that matches only the exact tag.
pub const EXACT: u64 = u64::MAX;
/// The mask that matches any tag.
pub const ANY: u64 = 0;

/// What arrived: the sender's tag and the message length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagInfo {
    /// The tag the sender used.
    pub sender_tag: Tag,
    /// Message length in bytes.
    pub len: usize,
}

/// Future of [`Endpoint::tag_send`]: resolves to `(Result<()>, buffer)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer is kept until UCX has finished with it,
/// and the message may still be delivered.
pub type TagSend<B> = SendOp<B>;

/// Future of [`Endpoint::tag_recv`] and [`Worker::tag_recv`]: resolves to
/// `(Result<TagInfo>, buffer)`; on success the buffer's length is the message length.
///
/// # Cancel safety
/// Memory-safe to drop at any time. If no message matched yet, the receive is canceled
/// (`ucp_request_cancel`) and a later matching message goes to another receive. If one
/// already matched, the buffer is kept until UCX finishes writing it and that message is
/// consumed and discarded.
// The fields that own something are dropped by hand, as in `SendOp`.
#[must_use = "a receive future does nothing unless awaited"]
pub struct TagRecv<B: IoBufMut> {
    /// The state, with the worker while the receive may be pending and the endpoint it
    /// is bound to while it may be pending or when it failed (for the error).
    own: Owned<B>,
    /// The bits that name the tag space the receive was posted in ([`Space`]): sender
    /// tags are reported without them.
    fixed: u64,
    capacity: usize,
}

impl Endpoint {
    /// Sends `buf` with `tag` (`ucp_tag_send_nbx`). The message is posted before this
    /// returns, so sends on one endpoint are matched in call order; await the future to
    /// learn when the buffer is free again and whether the send succeeded.
    ///
    /// # Cancel safety
    /// Dropping the returned [`TagSend`] is memory-safe at any time: the buffer stays
    /// with the worker until UCX has finished with it, and the message may still be
    /// delivered.
    #[inline]
    pub fn tag_send<B: IoBuf>(&self, tag: Tag, buf: B) -> TagSend<B> {
        self.tag_send_in(Space::app(self.worker_inner()), tag, buf, false)
    }

    /// [`Endpoint::tag_send`] asking UCX to complete the send soon
    /// (`UCP_OP_ATTR_FLAG_FAST_CMPL`): with `UCX_RNDV_THRESH` left at `auto`, UCX then
    /// copies messages shorter than `UCX_RNDV_SEND_NBR_THRESH` (256 KiB by default)
    /// through its own buffers (eager) where it would otherwise use its rendezvous
    /// protocol (the receiver fetching the sender's memory), as MPI's blocking sends do.
    /// Over shared memory that is faster for data the sender has just written (a
    /// rendezvous reads it from the other core's cache), and slower for data it has not.
    pub fn tag_send_eager<B: IoBuf>(&self, tag: Tag, buf: B) -> TagSend<B> {
        self.tag_send_in(Space::app(self.worker_inner()), tag, buf, true)
    }

    /// [`Endpoint::tag_send`] with `tag` in `space`, as [`Endpoint::tag_send_eager`]
    /// when `eager`.
    #[inline(always)]
    pub(crate) fn tag_send_in<B: IoBuf>(&self, space: Space, tag: Tag, buf: B, eager: bool) -> TagSend<B> {
        let Some(tag) = space.wire(tag) else {
            return SendOp::failed(self, "tag_send", Box::new(space.bad_tag(tag)), buf);
        };
        SendOp::post(
            self,
            "tag_send",
            buf,
            || None,
            |_, h, ptr, len, param| {
                if eager {
                    param.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_FAST_CMPL.0 as u32;
                }
                // SAFETY: h is live under the lock; the buffer's memory stays valid and
                // unmoved until the request completes (IoBuf contract; parked on drop).
                unsafe { sys::ucp_tag_send_nbx(h, ptr.cast(), len, tag, param) }
            },
        )
    }

    /// Sends `data` with `tag` if UCX can finish with it during this call, and nothing
    /// otherwise (`ucp_tag_send_nbx` with `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): `Ok(true)`
    /// when the message went out (UCX copied it; `data` may be reused at once),
    /// `Ok(false)` when UCX could not send it right away and posted nothing (the message
    /// is too long for UCX's short protocol, or the transport has no room just now): send
    /// it with [`Endpoint::tag_send`] then, or try again after progressing the worker.
    ///
    /// No future, no buffer ownership and no allocation: the cheapest way to send a short
    /// message. Tag order with the other sends on this endpoint is kept: UCX tries the
    /// same short path first for every send, and its transports refuse it while earlier
    /// sends wait for room.
    ///
    /// Which sends UCX completes during the call depends on its version and transport:
    /// over shared memory short messages do; over TCP, UCX 1.13 completes them and UCX
    /// 1.22 never does, so there this always returns `Ok(false)`.
    ///
    /// # Errors
    /// [`Error::ConnectionReset`] when the endpoint failed, [`Error::ApiMisuse`] when it
    /// was closed, or what UCX reported.
    #[inline]
    pub fn try_tag_send(&self, tag: Tag, data: &[u8]) -> Result<bool> {
        self.try_tag_send_in(Space::app(self.worker_inner()), tag, data)
    }

    /// [`Endpoint::try_tag_send`] with `tag` in `space`.
    #[inline(always)]
    pub(crate) fn try_tag_send_in(&self, space: Space, tag: Tag, data: &[u8]) -> Result<bool> {
        let tag = space.wire(tag).ok_or_else(|| space.bad_tag(tag))?;
        self.post_immediate("tag_send", |h, param| {
            // SAFETY: h is live under the lock; data is valid for the call, and UCX is done
            // with it when the call returns (immediate completion only).
            unsafe { sys::ucp_tag_send_nbx(h, data.as_ptr().cast(), data.len(), tag, param) }
        })
    }

    /// Receives a message matching `tag`/`mask` into `buf`, bound to this endpoint: if
    /// the endpoint fails (or its peer closes it) before a message matches, the receive
    /// ends with [`Error::ConnectionReset`]. Posted after that, it still receives a
    /// matching message that had arrived (a peer may send its last message and close at
    /// once) and ends with [`Error::ConnectionReset`] only when there is none; as
    /// matching is by tag, that message may come from another peer sending the same tag.
    /// (Not when the peer was a process on this host, without peer error handling, that
    /// died: it may have left a message half sent, whose receive would never end.) After
    /// this side's own close it is [`Error::ApiMisuse`].
    ///
    /// Matching itself is by tag only (UCX tag queues are per worker): encode the peer in
    /// the tag when several peers may send the same tag.
    ///
    /// # Cancel safety
    /// Dropping the returned [`TagRecv`] is memory-safe at any time: an unmatched receive
    /// is canceled and its buffer never written; a matched one finishes into the buffer
    /// kept by the worker, and that message is discarded.
    #[inline]
    pub fn tag_recv<B: IoBufMut>(&self, tag: Tag, mask: u64, buf: B) -> TagRecv<B> {
        post_recv(self.worker(), Some(self), Space::app(self.worker_inner()), tag, mask, buf)
    }
}

impl Worker {
    /// Receives a message matching `tag`/`mask` from any peer into `buf`. Unlike
    /// [`Endpoint::tag_recv`] it is bound to no endpoint, so a failed peer does not end
    /// it.
    ///
    /// # Cancel safety
    /// As for [`Endpoint::tag_recv`].
    #[inline]
    pub fn tag_recv<B: IoBufMut>(&self, tag: Tag, mask: u64, buf: B) -> TagRecv<B> {
        post_recv(self, None, Space::app(&self.shared.inner), tag, mask, buf)
    }

    /// Checks, without receiving it, whether a message matching `tag`/`mask` has arrived
    /// (`ucp_tag_probe_nb`), progressing the worker once first.
    pub fn tag_probe(&self, tag: Tag, mask: u64) -> Option<TagInfo> {
        self.tag_probe_in(Space::app(&self.shared.inner), tag, mask).unwrap_or(None)
    }

    /// [`Worker::tag_probe`] in `space`; an error for a tag outside it.
    pub(crate) fn tag_probe_in(&self, space: Space, tag: Tag, mask: u64) -> Result<Option<TagInfo>> {
        let (tag, mask) = space.wire_recv(tag, mask).map_err(|e| *e)?;
        let inner = &self.shared.inner;
        inner.locked(|st| {
            inner.progress_locked(st);
            let mut info = sys::ucp_tag_recv_info_t::default();
            // SAFETY: the worker is valid under the lock; remove = 0 leaves the message.
            let m = unsafe { sys::ucp_tag_probe_nb(st.handle, tag, mask, 0, &mut info) };
            Ok((!m.is_null())
                .then_some(TagInfo { sender_tag: space.local(info.sender_tag), len: info.length }))
        })
    }

    /// Receives the next message matching `tag`/`mask`, whatever its size, into a new
    /// buffer of exactly its length (`ucp_tag_probe_nb` with remove, then
    /// `ucp_tag_msg_recv_nbx`).
    ///
    /// # Cancel safety
    /// Memory-safe to drop. Before a message is found, nothing is consumed; once found,
    /// it is received into a buffer kept until UCX completes, then discarded.
    pub async fn tag_recv_any(&self, tag: Tag, mask: u64) -> Result<(TagInfo, Vec<u8>)> {
        self.tag_recv_any_in(Space::app(&self.shared.inner), tag, mask).await
    }

    /// [`Worker::tag_recv_any`] in `space`.
    pub(crate) async fn tag_recv_any_in(
        &self,
        space: Space,
        tag: Tag,
        mask: u64,
    ) -> Result<(TagInfo, Vec<u8>)> {
        let (tag, mask) = space.wire_recv(tag, mask).map_err(|e| *e)?;
        let inner = &self.shared.inner;
        let no_imm = inner.no_imm;
        // Step 1: find and dequeue a matching message, receiving into a buffer of its size.
        let (info, posted, buf) = std::future::poll_fn(|cx| {
            inner.poll_until(
                cx,
                // SAFETY: the buffer goes with the receive into the `TagRecv` below.
                |st| unsafe { take_next(st, tag, mask, no_imm) },
                |st, waker| st.add_probe_waiter(waker),
            )
        })
        .await;
        let info = TagInfo { sender_tag: space.local(info.sender_tag), len: info.length };
        // Step 2: wait for the data.
        let state = match posted {
            Posted::Done(c) => OpState::Done(Completion::new(c.status(), info.len, info.sender_tag), buf),
            Posted::Pending(r) => {
                inner.posted();
                OpState::Pending(r, buf)
            }
        };
        let recv = TagRecv::new(self, None, space, info.len, state);
        let (r, buf) = recv.await;
        r.map(|_| (info, buf))
    }

    /// Throws away every message matching `tag`/`mask` that has arrived and waits in
    /// UCX's queue of unexpected messages, progressing the worker once first; returns how
    /// many. Each is received as [`Worker::tag_recv_any`] would, into a buffer the worker
    /// keeps until UCX completes, so that its sender's send ends as if it were taken: a
    /// rendezvous send left unreceived would otherwise keep its sender's buffer, and,
    /// without peer error handling, its sender's worker, for ever. For a layer that ends
    /// a conversation mid-way (an aborted collective) and must leave no sender stranded.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] after [`Worker::shutdown`].
    pub fn tag_discard(&self, tag: Tag, mask: u64) -> Result<usize> {
        self.tag_discard_in(Space::app(&self.shared.inner), tag, mask)
    }

    /// [`Worker::tag_discard`] in `space`.
    pub(crate) fn tag_discard_in(&self, space: Space, tag: Tag, mask: u64) -> Result<usize> {
        self.check_open("tag_discard")?;
        let (tag, mask) = space.wire_recv(tag, mask).map_err(|e| *e)?;
        let inner = &self.shared.inner;
        let no_imm = inner.no_imm;
        // Under one lock: progress once, then take every matching message.
        let taken: Vec<_> = inner.locked(|st| {
            inner.progress_locked(st);
            // SAFETY: each buffer stays in `taken`, then a pending receive's is parked with
            // it below.
            std::iter::from_fn(|| unsafe { take_next(st, tag, mask, no_imm) }).collect()
        });
        let count = taken.len();
        for (info, posted, buf) in taken {
            if let Posted::Pending(r) = posted {
                inner.posted();
                // Dropped at once: the worker keeps the buffer until UCX completes.
                drop(TagRecv::new(self, None, space, info.length, OpState::Pending(r, buf)));
            }
        }
        Ok(count)
    }
}

/// Takes the next arrived message matching the wire `tag`/`mask` out of UCX's queue of
/// unexpected messages and posts its receive into a new buffer of its length
/// (`ucp_tag_probe_nb` with remove, then `ucp_tag_msg_recv_nbx`); `None` when there is
/// none.
///
/// # Safety
/// UCX writes into the returned buffer until the returned receive completes: the caller
/// keeps it until then (a pending receive parked with it when dropped).
unsafe fn take_next(
    st: &mut State,
    tag: Tag,
    mask: u64,
    no_imm: bool,
) -> Option<(sys::ucp_tag_recv_info_t, Posted, Vec<u8>)> {
    let mut info = sys::ucp_tag_recv_info_t::default();
    // SAFETY: the worker is valid under the lock (`st` is reached only under it); remove
    // = 1 hands the message to us, and we post its receive right away.
    let m = unsafe { sys::ucp_tag_probe_nb(st.handle, tag, mask, 1, &mut info) };
    if m.is_null() {
        return None;
    }
    let mut buf: Vec<u8> = Vec::with_capacity(info.length);
    let param = recv_param(st, no_imm);
    // SAFETY: m is a dequeued message of this worker; buf has room for info.length bytes
    // and is kept by the caller until completion (this function's contract).
    let p = unsafe { sys::ucp_tag_msg_recv_nbx(st.handle, buf.as_mut_ptr().cast(), info.length, m, &param) };
    let imm = Completion::new(Status::OK, info.length, info.sender_tag);
    Some((info, Posted::from_ptr(p, imm, false), buf))
}

/// For a receive bound to endpoint `ep` that can no longer be used (`refusal` says why):
/// a message matching `tag`/`mask` that arrived before the endpoint failed or its peer
/// closed it (a peer may send its last message and close at once), taken out of UCX's
/// queue of unexpected messages for the caller to receive (`ucp_tag_msg_recv_nbx`). With
/// no such message, or on an endpoint this side closed, the receive is refused; also
/// when the peer process died unseen by UCX, which would leave the receive of a message
/// it sent only in part (a rendezvous one, say) pending for ever.
#[cold]
#[inline(never)]
pub(crate) fn arrived_before_failure(
    inner: &WorkerInner,
    st: &mut State,
    ep: u64,
    tag: Tag,
    mask: u64,
    refusal: Error,
) -> Result<sys::ucp_tag_message_h> {
    if refusal.kind() != ErrorKind::ConnectionReset || st.peer_died_unseen(ep) {
        return Err(refusal);
    }
    // What is still in the transport's queues arrived before the failure too.
    inner.progress_locked(st);
    let mut info = sys::ucp_tag_recv_info_t::default();
    // SAFETY: the worker is valid under the lock; remove = 1 hands the message to the
    // caller, which posts its receive under the same lock.
    let m = unsafe { sys::ucp_tag_probe_nb(st.handle, tag, mask, 1, &mut info) };
    if m.is_null() {
        return Err(refusal);
    }
    Ok(m)
}

/// Posts a tag receive into `count` units at `ptr` (bytes, or iov entries, as `param`'s
/// datatype says), under the worker lock: bound to `ep` when given, whose state is
/// checked in the same critical section, so a receive is never posted on an endpoint that
/// already failed (its failure would not cancel it); on one that did, a matching message
/// that arrived before is received instead ([`arrived_before_failure`]).
///
/// # Safety
/// `ptr` must describe memory valid for writes of `count` units (and an iov array the
/// buffers it names) until UCX completes the request, kept by the caller's future and
/// parked when it is dropped; `param` must come from `st`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn post_tag_recv(
    inner: &WorkerInner,
    st: &mut State,
    ep: Option<&Endpoint>,
    ptr: *mut std::ffi::c_void,
    count: usize,
    tag: Tag,
    mask: u64,
    param: &sys::ucp_request_param_t,
) -> std::result::Result<Posted, Box<Error>> {
    if let Some(ep) = ep {
        if let Err(e) = ep.live_handle(st, "tag_recv") {
            let m = arrived_before_failure(inner, st, ep.inner.id, tag, mask, e).map_err(Box::new)?;
            // SAFETY: m was just taken from this worker's queue; the memory per contract.
            let p = unsafe { sys::ucp_tag_msg_recv_nbx(st.handle, ptr, count, m, param) };
            return Ok(Posted::from_ptr(p, Completion::OK, false).settle_recv(st, None));
        }
    }
    // SAFETY: the worker is valid under the lock; the memory per contract.
    let p = unsafe { sys::ucp_tag_recv_nbx(st.handle, ptr, count, tag, mask, param) };
    Ok(Posted::from_ptr(p, Completion::OK, true).settle_recv(st, ep.map(|e| e.inner.id)))
}

/// Parameters for a tag receive. `no_imm` turns immediate completion off
/// (`UCP_OP_ATTR_FLAG_NO_IMM_CMPL`): UCX then runs the callback inside the call instead of
/// returning `UCS_OK`. Plain tag receives always need that, because UCX (1.13 to at least
/// 1.15) does not fill `recv_info` when a tag receive completes at once, so the length
/// and sender tag would be lost.
#[inline(always)]
fn recv_param(st: &mut State, no_imm: bool) -> sys::ucp_request_param_t {
    param(st, Callback { recv: Some(tag_recv_cb) }, no_imm_bit(no_imm), 0, None)
}

/// Posts a tag receive; when `ep` is given, the receive is bound to it, and its state is
/// checked in the same critical section, so a receive is never posted on an endpoint
/// that already failed (its failure would not cancel it).
#[inline]
pub(crate) fn post_recv<B: IoBufMut>(
    worker: &Worker,
    ep: Option<&Endpoint>,
    space: Space,
    tag: Tag,
    mask: u64,
    mut buf: B,
) -> TagRecv<B> {
    let capacity = buf.bytes_total();
    let (tag, mask) = match space.wire_recv(tag, mask) {
        Ok(w) => w,
        Err(e) => return TagRecv::new(worker, ep, space, capacity, OpState::Failed(e, buf)),
    };
    let inner = &worker.shared.inner;
    let mem = match crate::device::op_memory(inner, "tag_recv", &buf) {
        Ok(m) => m,
        Err(e) => return TagRecv::new(worker, ep, space, capacity, OpState::Failed(e, buf)),
    };
    let ptr = buf.stable_mut_ptr();
    let posted = inner.locked(|st| {
        let mut param = recv_param(st, true);
        crate::device::set(&mut param, mem);
        // SAFETY: buf's memory is valid for `capacity` bytes and owned by the returned
        // future until UCX completes (parked on drop).
        unsafe { post_tag_recv(inner, st, ep, ptr.cast(), capacity, tag, mask, &param) }
    });
    if matches!(posted, Ok(Posted::Pending(_))) {
        inner.posted();
    }
    TagRecv::new(worker, ep, space, capacity, OpState::from_posted(posted, buf))
}

impl<B: IoBufMut> Unpin for TagRecv<B> {}

impl<B: IoBufMut> TagRecv<B> {
    /// A receive of `capacity` bytes in `state`, keeping the handles that state needs
    /// ([`OpState::kept_handles`]): one that matched at once keeps none, and no reference
    /// count changes.
    #[inline]
    fn new(
        worker: &Worker,
        ep: Option<&Endpoint>,
        space: Space,
        capacity: usize,
        state: OpState<B>,
    ) -> TagRecv<B> {
        let (worker, ep) = state.kept_handles(worker, ep);
        TagRecv { own: Owned::new(worker, ep, state, ()), fixed: space.fixed, capacity }
    }

    /// A receive refused before posting, with `e`.
    pub(crate) fn refused(worker: &Worker, ep: Option<&Endpoint>, e: Box<Error>, buf: B) -> TagRecv<B> {
        let capacity = buf.bytes_total();
        TagRecv::new(worker, ep, Space::APP_ALL, capacity, OpState::Failed(e, buf))
    }

    /// Whether the receive matched a message that had already arrived during the call
    /// that posted it (or was refused): awaiting it then returns at once. As for
    /// [`crate::SendOp::completed_immediately`].
    pub fn completed_immediately(&self) -> bool {
        self.own.completed_immediately()
    }

    /// The outcome of a receive that [completed when it was
    /// posted](TagRecv::completed_immediately), taken without awaiting it (so without a
    /// task or a waker); None while it is pending (await it then) or once taken. Once it
    /// gave the outcome, the receive is spent: awaiting it panics, as any future polled
    /// after it completed may.
    #[inline]
    pub fn take_done(&mut self) -> Option<(Result<TagInfo>, B)> {
        let (fixed, capacity) = (self.fixed, self.capacity);
        self.own.take_done(|c, b, ep| finish(fixed, capacity, c, b, ep))
    }
}

/// The outcome of a tag receive of `capacity` bytes posted in the space named by the
/// bits `fixed`: the buffer's length set to what arrived, the sender's tag local to the
/// space.
#[inline(always)]
fn finish<B: IoBufMut>(
    fixed: u64,
    capacity: usize,
    c: Completion,
    buf: &mut B,
    ep: Option<&Endpoint>,
) -> Result<TagInfo> {
    let c = Completion::new(c.status(), c.len, c.sender_tag & !fixed);
    if c.status().is_ok() {
        // SAFETY: UCX wrote c.len <= capacity bytes at the start of buf.
        unsafe { buf.set_init(c.len.min(capacity)) };
        return Ok(TagInfo { sender_tag: c.sender_tag, len: c.len });
    }
    Err(recv_failure(c, capacity, ep))
}

/// The error for a tag receive (plain or vectored) of `capacity` bytes, bound to `ep`
/// if any, that completed with a failed status.
#[cold]
#[inline(never)]
pub(crate) fn recv_failure(c: Completion, capacity: usize, ep: Option<&Endpoint>) -> Error {
    if c.status() == Status::TRUNCATED {
        return Error::Truncated { capacity, len: c.len.max(capacity), tag: c.sender_tag };
    }
    crate::op::op_error(ep, "tag_recv", c.status())
}

impl<B: IoBufMut> Future for TagRecv<B> {
    type Output = (Result<TagInfo>, B);

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (fixed, capacity) = (self.fixed, self.capacity);
        self.get_mut().own.poll_with(cx, |c, b, ep| finish(fixed, capacity, c, b, ep))
    }
}
