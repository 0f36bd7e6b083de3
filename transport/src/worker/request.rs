//! The completion callbacks that fill the slot ucxkit keeps inside every UCX request
//! ([`crate::slot::Slot`]), and [`Request`], the owner of one in-flight UCX request.
//!
//! UCX reserves [`crate::slot::SLOT_SIZE`] bytes in front of every request it hands out (the context's
//! `request_size`), so a pending operation needs no allocation of its own, and an
//! operation that completes immediately has no request at all.
//!
//! Life of a slot, always under the worker lock:
//! - `Pending`: posted; the owner may store a waker.
//! - `Done`: the callback ran; the owner reads the result, resets the slot and frees the
//!   request (`ucp_request_free`).
//! - `Parked`: the owner was dropped before completion. Its buffer (and anything else UCX
//!   may still touch) moved into the slot; unmatched tag receives were canceled. The
//!   callback moves the parked value to the worker's graveyard (dropped after the lock is
//!   released) and frees the request. `ucp_request_free` is never used as a cancel.
//!   A close request nobody waits for is parked the same way, with nothing to keep, and
//!   also listed in the worker ([`park_close`]), so that the worker's destruction can
//!   wait for it and give back ([`give_up_closes`]) one that never finishes.
//!
//! A request bound to an endpoint (whose failure must end it) is also linked, through
//! its slot, into the worker's list of bound requests: binding and unbinding cost a few
//! pointer writes and no lookup, and [`free`] always unlinks, so the list never holds a
//! request given back to UCX.

use std::any::Any;
use std::ffi::c_void;
use std::ptr;
use std::task::{Context, Poll};

use ucx_sys as sys;

use super::{State, WorkerShared};
use crate::error::Status;
use crate::slot::{OpKind, Slot, SlotState};

/// The result of a completed request.
///
/// Three whole words: the status is kept widened. A one-byte field followed by padding
/// made every move of a completion (through several futures, and of the enums that
/// carry one) a mix of 1- and 7-byte copies, which defeat store-to-load forwarding on
/// the way from UCX's callback to the awaiting code.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub(crate) len: usize,
    pub(crate) sender_tag: u64,
    raw_status: i64,
}

impl Completion {
    pub(crate) const OK: Completion = Completion::new(Status::OK, 0, 0);

    pub(crate) const fn new(status: Status, len: usize, sender_tag: u64) -> Completion {
        Completion { len, sender_tag, raw_status: status.0 .0 as i64 }
    }

    /// A success that transferred `len` bytes.
    pub(crate) const fn ok(len: usize) -> Completion {
        Completion::new(Status::OK, len, 0)
    }

    /// How the operation ended.
    #[inline]
    pub(crate) fn status(&self) -> Status {
        Status(sys::ucs_status_t(self.raw_status as i8))
    }
}

/// Send-type completion callback (`ucp_send_nbx_callback_t`); `user_data` is the worker
/// [`State`].
pub(crate) unsafe extern "C" fn send_cb(req: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    // SAFETY: UCX calls this with a request we posted with user_data = &State, inside a
    // UCX call made under the worker lock.
    unsafe { complete(req, status, 0, 0, user) }
}

/// Tag receive completion callback (`ucp_tag_recv_nbx_callback_t`).
pub(crate) unsafe extern "C" fn tag_recv_cb(
    req: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user: *mut c_void,
) {
    // SAFETY: UCX passes a valid info pointer for the duration of the callback (NULL only
    // in error paths of some versions, checked).
    let (len, tag) = unsafe { info.as_ref() }.map_or((0, 0), |i| (i.length, i.sender_tag));
    // SAFETY: as in send_cb.
    unsafe { complete(req, status, len, tag, user) }
}

/// Completion callback for operations that report a length: active-message data fetches
/// (`ucp_am_recv_data_nbx_callback_t`).
pub(crate) unsafe extern "C" fn len_cb(
    req: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user: *mut c_void,
) {
    // SAFETY: as in send_cb.
    unsafe { complete(req, status, length, 0, user) }
}

/// Stream receive completion callback (`ucp_stream_recv_nbx_callback_t`): also counts the
/// bytes against the endpoint the receive is bound to, for end-of-stream detection.
pub(crate) unsafe extern "C" fn stream_recv_cb(
    req: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user: *mut c_void,
) {
    // SAFETY: as in send_cb; the slot is read before `complete` may free it.
    let (ep, st) = unsafe { ((*req.cast::<Slot>()).bound_ep, &mut *user.cast::<State>()) };
    if status == sys::UCS_OK {
        st.stream_received(ep, length);
    }
    // SAFETY: as in send_cb.
    unsafe { complete(req, status, length, 0, user) }
}

/// Completion callback of the flush a parting endpoint posts before its close notice
/// ([`State::part`]): tells the worker, then completes as [`send_cb`] does. The
/// endpoint is the one the request is bound to.
pub(crate) unsafe extern "C" fn parting_flush_cb(
    req: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    // SAFETY: as in send_cb; the slot is read before `complete` may free it.
    let (ep, st) = unsafe { ((*req.cast::<Slot>()).bound_ep, &mut *user.cast::<State>()) };
    st.parting_flushed(ep);
    // SAFETY: as in send_cb.
    unsafe { complete(req, status, 0, 0, user) }
}

/// An operation of `kind` bound to endpoint `ep` (0: none) finished: a closing endpoint
/// may be waiting for it ([`State::op_done`]). One test of two counters while nothing
/// closes.
#[inline(always)]
fn finished_on(st: &mut State, ep: u64, kind: OpKind) {
    if (st.partings.live > 0 || st.closes_waiting_ops > 0) && ep != 0 && kind == OpKind::Finish {
        st.op_done(ep);
    }
}

/// Records a request's completion in its slot (or, for a parked one, lets its values go
/// and frees it). Inlined into each callback: one call less between UCX's progress and
/// the slot, on the path of every message that completes after posting.
#[inline(always)]
unsafe fn complete(req: *mut c_void, status: sys::ucs_status_t, len: usize, tag: u64, user: *mut c_void) {
    // SAFETY: the caller guarantees req is a live request of ours and user the worker's
    // State, accessed under the worker lock held by whoever called into UCX.
    let (slot, st) = unsafe { (&mut *req.cast::<Slot>(), &mut *user.cast::<State>()) };
    match slot.state {
        SlotState::Parked => {
            if let Some(p) = slot.parked.take() {
                st.after.bury(p);
            }
            st.parked -= 1;
            if slot.close {
                st.closes.remove(&req.cast::<Slot>());
            }
            let (ep, kind) = (slot.bound_ep, slot.kind);
            // SAFETY: req is ours, completed, and nothing refers to it any more.
            unsafe { free(st, req.cast()) };
            finished_on(st, ep, kind);
        }
        SlotState::Pending => {
            slot.state = SlotState::Done;
            slot.status = status;
            slot.len = len;
            slot.sender_tag = tag;
            if let Some(w) = slot.waker.take() {
                st.after.wake(w);
            }
            finished_on(st, slot.bound_ep, slot.kind);
        }
        // ucxkit already finished it (`fail_pending`: the peer process died); the owner
        // frees it when it polls.
        SlotState::Done => {}
    }
}

/// Unbinds a slot, resets it and releases its request to UCX.
///
/// # Safety
/// `slot` is a completed request of ours that nothing else refers to, and the worker lock
/// is held (`st` comes from it).
pub(crate) unsafe fn free(st: &mut State, slot: *mut Slot) {
    // SAFETY: per contract.
    unsafe {
        let s = &mut *slot;
        if s.bound_ep != 0 {
            unlink(st, slot);
            s.bound_ep = 0;
        }
        // Back to `Slot::EMPTY` where it matters: the fields not reset here are written
        // before they are read again (the result by the callback, the links by `bind`).
        s.state = SlotState::Pending;
        s.waker = None;
        s.parked = None;
        s.close = false;
        sys::ucp_request_free(slot.cast());
    }
}

/// Takes a bound slot out of the worker's list of bound requests.
///
/// # Safety
/// `slot` is a live request of ours in that list; the worker lock is held.
unsafe fn unlink(st: &mut State, slot: *mut Slot) {
    // SAFETY: per contract: the slot and its neighbours are live bound requests.
    unsafe {
        let (prev, next) = ((*slot).prev, (*slot).next);
        if prev.is_null() {
            st.bound = next;
        } else {
            (*prev).next = next;
        }
        if !next.is_null() {
            (*next).prev = prev;
        }
    }
}

/// Gives a request that owns no memory back to UCX at once, whatever its state
/// (`ucp_request_free`): the operation (a close, a flush) goes on inside UCX with no
/// further callback. Only for requests with nothing parked.
///
/// # Safety
/// `slot` is a request of ours (pending or done) that nothing else refers to, and the
/// worker lock is held (`st` comes from it).
pub(crate) unsafe fn release(st: &mut State, slot: *mut Slot) {
    // SAFETY: per contract; resetting first because UCX will reuse the memory without
    // calling request_init again and without calling our callback for this request.
    unsafe { free(st, slot) }
}

/// Hands `keep` to a pending request's slot; the completion callback drops it.
///
/// # Safety
/// `slot` is a pending request of ours and the worker lock is held. The caller counts it
/// in `State::parked`.
pub(crate) unsafe fn park_slot(slot: *mut Slot, keep: Box<dyn Any + Send>) {
    // SAFETY: per contract.
    let s = unsafe { &mut *slot };
    s.state = SlotState::Parked;
    s.waker = None;
    s.parked = Some(keep);
}

/// Parks a pending close request that nobody waits for (or another request that owns no
/// memory and may never finish: a parting endpoint's flush): it counts in
/// `State::parked` and is listed in `State::closes`, so that a worker being destroyed
/// lets it finish (bounded), then gives back any still running ([`give_up_closes`]).
///
/// # Safety
/// `slot` is a pending request of ours that owns no memory, with nothing parked; the
/// worker lock is held (`st` comes from it).
pub(crate) unsafe fn park_close(st: &mut State, slot: *mut Slot) {
    // SAFETY: per contract.
    unsafe {
        park_slot(slot, Box::new(()));
        (*slot).close = true;
    }
    st.parked += 1;
    st.closes.insert(slot);
}

/// Gives the close requests still running back to UCX ([`release`]), right before the
/// worker is destroyed: UCX requires that of a close request it finds pending when it
/// destroys the endpoint. A released request gets no more callbacks.
///
/// # Safety
/// The worker lock is held (`st` comes from it), or the worker is being dropped.
pub(crate) unsafe fn give_up_closes(st: &mut State) {
    for slot in std::mem::take(&mut st.closes) {
        st.parked -= 1;
        // SAFETY: listed slots are parked, pending close requests of ours, whose parked
        // value is a unit that needs no care.
        unsafe { release(st, slot) };
    }
}

/// Finishes a pending request with `status` on UCX's behalf (its endpoint failed and UCX
/// cannot purge it). The owner then frees it like any completed request; UCX keeps the
/// request until it finishes internally and calls back no more. Parked requests are left
/// alone.
///
/// # Safety
/// `slot` is a live request of ours; the worker lock is held (`st` comes from it).
pub(crate) unsafe fn fail_pending(slot: *mut Slot, status: Status, st: &mut State) {
    // SAFETY: per contract.
    let s = unsafe { &mut *slot };
    if s.state == SlotState::Pending {
        s.state = SlotState::Done;
        s.status = status.0;
        s.len = 0;
        s.sender_tag = 0;
        if let Some(w) = s.waker.take() {
            st.after.wake(w);
        }
    }
}

/// Whether the bound request `slot` is still running (its callback has not run).
///
/// # Safety
/// `slot` is a live bound request of ours; the worker lock is held.
pub(crate) unsafe fn is_running(slot: *mut Slot) -> bool {
    // SAFETY: per contract.
    unsafe { (*slot).state != SlotState::Done }
}

/// The completion of `slot` if its callback ran, releasing the request (`free`).
/// `slot` is a live request of ours that nothing else refers to once done; the worker
/// lock is held (`st` comes from it).
#[inline(always)]
fn take_done(st: &mut State, slot: *mut Slot) -> Option<Completion> {
    // SAFETY: per contract; the slot is ours until freed below.
    let s = unsafe { &mut *slot };
    if s.state != SlotState::Done {
        return None;
    }
    let c = Completion::new(Status(s.status), s.len, s.sender_tag);
    // SAFETY: completed and no longer referenced.
    unsafe { free_later(st, slot) };
    Some(c)
}

/// As [`free`], except that the request goes back to UCX at the worker's next progress
/// call ([`free_spare`]) rather than now: off the path from a completion to whatever
/// the awaiting task posts next (the reply of a ping-pong), which then runs about 50
/// instructions sooner. One request waits at a time; an earlier one is freed now.
///
/// # Safety
/// As for [`free`].
#[inline(always)]
unsafe fn free_later(st: &mut State, slot: *mut Slot) {
    // SAFETY: per contract.
    unsafe {
        if (*slot).bound_ep != 0 {
            unlink(st, slot);
            (*slot).bound_ep = 0;
        }
        let earlier = std::mem::replace(&mut st.spare, slot);
        if !earlier.is_null() {
            free(st, earlier);
        }
    }
}

/// Gives the request [`free_later`] kept back to UCX, if any (before a progress call,
/// and before the worker is destroyed).
///
/// # Safety
/// The worker lock is held (`st` comes from it).
#[inline]
pub(crate) unsafe fn free_spare(st: &mut State) {
    let slot = std::mem::replace(&mut st.spare, ptr::null_mut());
    if !slot.is_null() {
        // SAFETY: per contract; the spare is a completed, unbound request nothing
        // refers to.
        unsafe { free(st, slot) }
    }
}

/// Owner of one in-flight UCX request. Not a future itself: the operation futures hold
/// one and drive it with [`Request::poll`], and park their buffer with [`Request::park`]
/// when dropped early.
pub(crate) struct Request {
    /// The slot, with the lowest bit set for a tag receive that dropping cancels (slots
    /// are 8-byte aligned). One word, so that the enums and futures carrying a request
    /// move it as one.
    tagged: *mut Slot,
}

// SAFETY: the slot is only touched under the worker lock, whichever thread holds it.
unsafe impl Send for Request {}
// SAFETY: as above; &Request gives no access without the lock.
unsafe impl Sync for Request {}

/// What a posting call returned.
pub(crate) enum Posted {
    /// Completed at once (no request).
    Done(Completion),
    /// In flight.
    Pending(Request),
}

impl Posted {
    /// Interprets the `ucs_status_ptr_t` returned by a `*_nbx` call. `imm` is the completion
    /// to report for an immediate `UCS_OK`.
    pub(crate) fn from_ptr(ptr: sys::ucs_status_ptr_t, imm: Completion, cancelable: bool) -> Posted {
        if sys::UCS_PTR_IS_PTR(ptr) {
            let slot = ptr.cast::<Slot>();
            Posted::Pending(Request {
                tagged: slot.cast::<u8>().wrapping_add(usize::from(cancelable)).cast(),
            })
        } else {
            let status = Status(sys::UCS_PTR_RAW_STATUS(ptr));
            if status.is_ok() {
                Posted::Done(imm)
            } else {
                Posted::Done(Completion::new(status, 0, 0))
            }
        }
    }
}

impl Posted {
    /// For a tag receive just posted, under the lock `st` comes from. One that matched a
    /// message already arrived (eager) completed inside the posting call: its request is
    /// released here, in the same critical section, so that awaiting it takes no lock.
    /// One still pending is bound to endpoint `ep`, if any, whose failure then cancels it.
    #[inline(always)]
    pub(crate) fn settle_recv(self, st: &mut State, ep: Option<u64>) -> Posted {
        let Posted::Pending(r) = self else { return self };
        if let Some(c) = take_done(st, r.slot()) {
            return Posted::Done(c);
        }
        if let Some(ep) = ep {
            r.bind(st, ep, OpKind::Cancel);
        }
        Posted::Pending(r)
    }
}

impl Request {
    #[inline(always)]
    fn slot(&self) -> *mut Slot {
        self.tagged.cast::<u8>().wrapping_sub(self.tagged as usize & 1).cast()
    }

    /// Whether dropping the owner before completion cancels the request.
    fn cancelable(&self) -> bool {
        self.tagged as usize & 1 != 0
    }

    /// The raw request pointer (for `ucp_request_cancel` and bookkeeping).
    pub(crate) fn raw(&self) -> *mut c_void {
        self.slot().cast()
    }

    /// Whether the callback already ran (under the lock `st` comes from).
    pub(crate) fn is_done(&self, _st: &mut State) -> bool {
        // SAFETY: under the worker lock; the slot is live.
        unsafe { (*self.slot()).state == SlotState::Done }
    }

    /// The completion, the request released, if the callback already ran (under the
    /// lock `st` comes from); else the request back.
    pub(crate) fn take_if_done(self, st: &mut State) -> Result<Completion, Request> {
        take_done(st, self.slot()).ok_or(self)
    }

    /// Binds this request to endpoint `ep`: the endpoint's failure ends it as `kind`
    /// says ([`State::fail_ep`]). Puts it at the head of the worker's list of bound
    /// requests, which [`free`] takes it out of.
    pub(crate) fn bind(&self, st: &mut State, ep: u64, kind: OpKind) {
        let slot = self.slot();
        // SAFETY: under the worker lock (st is borrowed from it); the slot is live and
        // not bound yet (bound once, right after posting), and the list's head is a live
        // bound request.
        unsafe {
            let s = &mut *slot;
            s.bound_ep = ep;
            s.kind = kind;
            s.prev = ptr::null_mut();
            s.next = st.bound;
            if !st.bound.is_null() {
                (*st.bound).prev = slot;
            }
        }
        st.bound = slot;
    }

    /// Checks for completion; in busy-poll mode progresses the worker a bounded number of
    /// times first. Returns `Ready` once, after which the request is released.
    ///
    /// Always inlined, as is [`crate::op::OpState::poll`]: a completion then reaches the
    /// awaiting code in registers instead of being stored and reloaded at every layer.
    /// Over shared memory this cut the time from a tag receive's completion callback to
    /// its `await` returning from about 200 to 165 cycles (TSC-stamped ping-pong).
    #[inline(always)]
    pub(crate) fn poll(&mut self, worker: &WorkerShared, cx: &mut Context<'_>) -> Poll<Completion> {
        let slot = self.slot();
        worker.inner.poll_until(
            cx,
            |st| take_done(st, slot),
            |_, waker| {
                // SAFETY: still pending, under the lock.
                let s = unsafe { &mut *slot };
                match &s.waker {
                    Some(w) if w.will_wake(waker) => {}
                    _ => s.waker = Some(waker.clone()),
                }
            },
        )
    }

    /// Progresses the worker with `progress`, under the lock `st` comes from, until the
    /// request completes, then releases it: for a call whose buffer is only borrowed for
    /// its own duration, so that nothing can outlive it.
    #[cold]
    #[inline(never)]
    pub(crate) fn finish_locked(self, st: &mut State, progress: impl Fn(&mut State)) -> Completion {
        loop {
            if let Some(c) = take_done(st, self.slot()) {
                return c;
            }
            progress(st);
        }
    }

    /// Called from the owning future's `Drop` while the request may still be pending:
    /// keeps `keep` alive until UCX completes the request (and cancels it where UCX can).
    /// If the request had already completed, frees it and returns `keep` to be dropped by
    /// the caller after the lock is gone.
    pub(crate) fn park(
        self,
        worker: &WorkerShared,
        keep: Box<dyn Any + Send>,
    ) -> Option<Box<dyn Any + Send>> {
        let slot = self.slot();
        let cancelable = self.cancelable();
        worker.inner.locked(|st| {
            // SAFETY: under the worker lock; the slot is ours.
            let s = unsafe { &mut *slot };
            if s.state == SlotState::Done {
                // SAFETY: completed, unreferenced.
                unsafe { free(st, slot) };
                return Some(keep);
            }
            // SAFETY: pending, ours, under the lock.
            unsafe { park_slot(slot, keep) };
            st.parked += 1;
            if cancelable {
                // SAFETY: the worker handle is valid (lock held); the request is a pending
                // tag receive of this worker. The callback may run inside this call.
                unsafe { sys::ucp_request_cancel(st.handle, slot.cast()) };
            }
            None
        })
    }
}
