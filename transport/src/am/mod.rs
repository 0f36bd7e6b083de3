//! Active messages (`ucp_am_send_nbx`, `ucp_worker_set_am_recv_handler`,
//! `ucp_am_recv_data_nbx`): a message is an id, a small header and a payload; the
//! receiving worker routes it by id.
//!
//! Receive messages of one id either as an async stream ([`Worker::am_recv`] gives an
//! [`AmReceiver`]) or through a closure ([`Worker::am_handler`]). A message whose header
//! and payload take 22 bytes or less (and that carries no reply endpoint) is kept whole
//! in three words, with no allocation, from UCX's callback to the application; any other
//! takes one allocation. Eager payloads arrive with the message (read them in place with
//! [`AmMessage::data`]: from 2 KiB on, where UCX allows it, the message keeps UCX's
//! receive buffer instead of copying it, and gives it back when dropped); rendezvous
//! payloads (large ones, or when the sender forces it) stay with the sender until
//! [`AmMessage::recv_data`] fetches them into an owned buffer, so the receiver decides
//! where they land. A message sent with [`AmSendOptions::reply`] can be answered with
//! [`AmMessage::reply`].
//!
//! Handlers run after the worker's lock is released, on the thread that progressed the
//! worker, one message at a time per id, in arrival order. They may call any ucxkit API.
//! A handler that panics never unwinds into UCX or into the task that happened to
//! progress the worker: the panic is caught, the message dropped, and the panic reported
//! as [`Error::HandlerPanicked`] by [`AmHandler::take_errors`].
//!
//! The application's ids are 0 to [`MAX_ID`] (2047); the ids above belong to
//! [`crate::namespace`]s, and 4095 carries ucxkit's connection handshake. A message for an id
//! nobody registered yet is held by the receiving worker (up to
//! [`UNCLAIMED_MAX_MESSAGES`] messages and [`UNCLAIMED_MAX_BYTES`] eager bytes; a held
//! rendezvous message keeps its sender waiting) and goes to the first receiver or handler
//! registered for it, so a peer that sends before this side registered loses nothing.
//! [`Worker::am_unclaimed`] lists what is held and [`Worker::am_discard_unclaimed`] lets
//! it go (releasing waiting senders); a message beyond those limits is dropped
//! and reported as [`Error::AmUnclaimed`] by [`Worker::take_am_errors`]. A message for an
//! id whose receiver was dropped is dropped and counted ([`Worker::am_dropped`]).

use std::any::Any;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::future::Future;
use std::num::NonZeroU64;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result, Status};
use crate::handshake;
use crate::op::{OpState, RecvOp, SendOp};
use crate::slot::OpKind;
use crate::worker::param::{no_imm as no_imm_bit, param, Callback};
use crate::worker::request::{len_cb, Completion, Posted};
use crate::worker::{AmPart, IdMap, RunAfter, State, Worker};

mod incoming;
mod message;
mod tables;
mod unclaimed;

use incoming::*;
pub(crate) use incoming::{AmReg, HandlerCell, Incoming, Long, Short};
use message::*;
pub use message::{AmMessage, AmRecvData};
pub(crate) use tables::install;
use tables::*;
use unclaimed::*;
pub(crate) use unclaimed::{IdTable, Unclaimed};
pub use unclaimed::{UNCLAIMED_MAX_BYTES, UNCLAIMED_MAX_MESSAGES};

/// Future of [`Endpoint::am_send`]: resolves to `(Result<()>, payload)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the payload and header are kept until UCX has
/// finished with them, and the message may still be delivered.
pub type AmSend<B> = SendOp<B>;

/// How an active message's payload travels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AmProto {
    /// UCX picks by size and transport (eager for small payloads, rendezvous for large).
    #[default]
    Auto,
    /// Force eager: the payload travels with the message (`UCP_AM_SEND_FLAG_EAGER`).
    Eager,
    /// Force rendezvous: the receiver fetches the payload (`UCP_AM_SEND_FLAG_RNDV`).
    Rendezvous,
}

/// Options for [`Endpoint::am_send_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AmSendOptions {
    /// Eager, rendezvous, or UCX's choice (default).
    pub proto: AmProto,
    /// Let the receiver reply (`UCP_AM_SEND_FLAG_REPLY`, default false, as in UCX): the
    /// message carries the sender's endpoint id, which the receiver looks up on every
    /// arrival, so it costs a little on each message; without it,
    /// [`AmMessage::reply_endpoint`] is `None`.
    pub reply: bool,
}

impl Default for AmSendOptions {
    fn default() -> Self {
        AmSendOptions { proto: AmProto::Auto, reply: false }
    }
}

/// The highest id available to the application's own active messages. The ids above
/// it belong to [`crate::namespace`]s ([`NAMESPACE_IDS`] each), and the last one to
/// ucxkit's handshake; on a worker without namespaces
/// ([`crate::WorkerBuilder::namespaces`]) the application has them up to 4094.
pub const MAX_ID: u16 = 2047;

/// How many active-message ids each namespace has.
pub const NAMESPACE_IDS: u16 = 16;

/// The highest id the application's calls may use on `worker`.
#[inline(always)]
fn app_am_max(worker: &crate::worker::WorkerInner) -> u16 {
    if worker.namespaces {
        MAX_ID
    } else {
        LAST_WIRE_ID
    }
}

/// The highest id on the wire that a message may have (namespaces' included).
pub(crate) const LAST_WIRE_ID: u16 = handshake::AM_ID as u16 - 1;

/// The wire id of id `id` (below [`NAMESPACE_IDS`]) of namespace `ns` (1..=127).
pub(crate) const fn namespace_id(ns: u8, id: u16) -> u16 {
    MAX_ID + 1 + (ns as u16 - 1) * NAMESPACE_IDS + id
}

// Every namespace's ids lie below the handshake's.
const _: () = assert!(namespace_id(127, NAMESPACE_IDS - 1) <= LAST_WIRE_ID);

/// Whether `id` is at most `limit` ([`MAX_ID`] for the application's ids); the error is
/// boxed so that the check stays two words on the sending path.
#[inline]
fn check_id(id: u16, limit: u16) -> std::result::Result<(), Box<Error>> {
    if id > limit {
        return Err(Box::new(bad_id(id, limit)));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn bad_id(id: u16, limit: u16) -> Error {
    let above = if limit < LAST_WIRE_ID { "the ids above belong to namespaces, " } else { "" };
    Error::ApiMisuse(format!(
        "active-message id {id} is out of range (0..={limit}; {above}{} to the handshake)",
        handshake::AM_ID
    ))
}

#[cold]
#[inline(never)]
fn header_too_long(len: usize, max: usize) -> Error {
    Error::ApiMisuse(format!("active-message header of {len} bytes exceeds this worker's limit of {max}"))
}

impl Endpoint {
    /// Whether an active message with `id` and `header` may be sent on this endpoint's
    /// worker; the error is boxed, as for [`check_id`].
    #[inline]
    fn check_am_send(&self, id: u16, limit: u16, header: &[u8]) -> std::result::Result<(), Box<Error>> {
        check_id(id, limit)?;
        // An empty header (the common case) needs no look at the worker's limit.
        if !header.is_empty() {
            let max = self.worker().max_am_header();
            if header.len() > max {
                return Err(Box::new(header_too_long(header.len(), max)));
            }
        }
        Ok(())
    }

    /// Sends an active message with `id`, `header` (copied; at most
    /// [`Worker::max_am_header`] bytes) and `payload`, with the default options.
    ///
    /// # Cancel safety
    /// Dropping the returned future is memory-safe at any time; the message may still be
    /// delivered.
    #[inline]
    pub fn am_send<B: IoBuf>(&self, id: u16, header: &[u8], payload: B) -> AmSend<B> {
        self.am_send_with(id, header, payload, AmSendOptions::default())
    }

    /// Sends an active message with explicit options.
    ///
    /// # Errors
    /// (in the future's result) [`Error::ApiMisuse`] for a reserved id or an oversized
    /// header; [`Error::ConnectionReset`] when the endpoint failed.
    ///
    /// # Cancel safety
    /// As for [`Endpoint::am_send`].
    #[inline]
    pub fn am_send_with<B: IoBuf>(
        &self,
        id: u16,
        header: &[u8],
        payload: B,
        opts: AmSendOptions,
    ) -> AmSend<B> {
        self.am_send_in(app_am_max(self.worker_inner()), id, header, payload, opts)
    }

    /// [`Endpoint::am_send_with`] with wire id `id`, which must be at most `limit`.
    #[inline(always)]
    pub(crate) fn am_send_in<B: IoBuf>(
        &self,
        limit: u16,
        id: u16,
        header: &[u8],
        payload: B,
        opts: AmSendOptions,
    ) -> AmSend<B> {
        if let Err(e) = self.check_am_send(id, limit, header) {
            return SendOp::failed(self, "am_send", e, payload);
        }
        let mut flags = match opts.proto {
            AmProto::Auto => 0,
            AmProto::Eager => sys::UCP_AM_SEND_FLAG_EAGER.0,
            AmProto::Rendezvous => sys::UCP_AM_SEND_FLAG_RNDV.0,
        };
        if opts.reply {
            flags |= sys::UCP_AM_SEND_FLAG_REPLY.0;
        }
        // UCX 1.14 and newer copy the header during the call (`COPY_HEADER`); 1.13 reads
        // it until the send completes, so a copy stays with an operation left pending (a
        // Vec: its heap buffer does not move with it; dropped after the call otherwise).
        #[cfg(ucx_ge_1_14)]
        let (hptr, hlen, copy): (*const u8, usize, Option<Vec<u8>>) = {
            flags |= sys::UCP_AM_SEND_FLAG_COPY_HEADER.0;
            (if header.is_empty() { std::ptr::null() } else { header.as_ptr() }, header.len(), None)
        };
        #[cfg(not(ucx_ge_1_14))]
        let (hptr, hlen, copy): (*const u8, usize, Option<Vec<u8>>) = if header.is_empty() {
            (std::ptr::null(), 0, None)
        } else {
            let copy = header.to_vec();
            (copy.as_ptr(), copy.len(), Some(copy))
        };
        let extra = move || copy.map(|c| Arc::new(c) as crate::op::Extra);
        SendOp::post(self, "am_send", payload, extra, |_, h, ptr, len, param| {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS.0 as u32;
            param.flags = flags as u32;
            // SAFETY: h is live under the lock; the payload, and on UCX 1.13 the header
            // copy, stay valid and unmoved until the request completes (kept by the
            // operation, parked on drop); with COPY_HEADER UCX reads the caller's header
            // during this call only.
            unsafe { sys::ucp_am_send_nbx(h, id as u32, hptr.cast(), hlen, ptr.cast(), len, param) }
        })
    }

    /// Sends an active message with `id`, `header` and `data`, with the default options,
    /// if UCX can finish with them during this call, and nothing otherwise
    /// (`ucp_am_send_nbx` with `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): `Ok(true)` when it went
    /// out (header and data may be reused at once), `Ok(false)` when UCX could not send it
    /// right away and posted nothing (the message is too long for UCX's short protocol, or
    /// the transport has no room just now): send it with [`Endpoint::am_send`] then. See
    /// [`Endpoint::try_tag_send`]. Unlike `am_send` on UCX 1.13, ucxkit makes no copy of
    /// the header.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a reserved id or an oversized header; otherwise as for
    /// [`Endpoint::try_tag_send`].
    #[inline]
    pub fn try_am_send(&self, id: u16, header: &[u8], data: &[u8]) -> Result<bool> {
        self.try_am_send_in(app_am_max(self.worker_inner()), id, header, data)
    }

    /// [`Endpoint::try_am_send`] with wire id `id`, which must be at most `limit`.
    #[inline(always)]
    pub(crate) fn try_am_send_in(&self, limit: u16, id: u16, header: &[u8], data: &[u8]) -> Result<bool> {
        self.check_am_send(id, limit, header).map_err(|e| *e)?;
        let hptr: *const u8 = if header.is_empty() { std::ptr::null() } else { header.as_ptr() };
        self.post_immediate("am_send", |h, param| {
            // SAFETY: h is live under the lock; header and data are valid for the call, and
            // UCX is done with both when the call returns (immediate completion only).
            unsafe {
                sys::ucp_am_send_nbx(
                    h,
                    id as u32,
                    hptr.cast(),
                    header.len(),
                    data.as_ptr().cast(),
                    data.len(),
                    param,
                )
            }
        })
    }
}

impl Worker {
    /// The largest active-message header this worker can send
    /// (`UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER`).
    pub fn max_am_header(&self) -> usize {
        self.shared.inner.max_am_header
    }

    /// Active messages dropped: their id's receiver or handler was gone, or nobody
    /// registered their id and the worker already held as many such messages as it
    /// keeps ([`UNCLAIMED_MAX_MESSAGES`], [`UNCLAIMED_MAX_BYTES`]).
    pub fn am_dropped(&self) -> u64 {
        self.shared.inner.locked(|st| tables(st).dropped)
    }

    /// Ids that received messages nobody registered for, with how many of them the worker
    /// holds for a later [`Worker::am_recv`] or [`Worker::am_handler`], by id. A worker
    /// destroyed while holding some gives their payloads back to UCX first, so that their
    /// rendezvous senders complete (as [`Worker::am_discard_unclaimed`] does).
    pub fn am_unclaimed(&self) -> Vec<(u16, usize)> {
        let mut v: Vec<(u16, usize)> = self
            .shared
            .inner
            .locked(|st| tables(st).unclaimed.queues.iter().map(|(&id, q)| (id, q.len())).collect());
        v.sort_unstable();
        v
    }

    /// Drops the messages held for `id` (see [`Worker::am_unclaimed`]) and returns how
    /// many there were. Their rendezvous payloads are released, so the senders' sends
    /// complete (successfully: UCX does not tell a sender that its payload was not
    /// fetched). They are counted in [`Worker::am_dropped`]. Messages that arrive later
    /// are held again.
    pub fn am_discard_unclaimed(&self, id: u16) -> usize {
        let held = self.shared.inner.locked(|st| {
            let t = tables(st);
            let q = t.unclaimed.take(id);
            t.dropped += q.len() as u64;
            q
        });
        let n = held.len();
        // Dropped as messages, outside the lock: a rendezvous descriptor is released
        // under the lock it takes.
        for inc in held {
            drop(AmMessage::new(self, id, inc));
        }
        n
    }

    /// Errors about arriving active messages so far, oldest first: [`Error::AmUnclaimed`]
    /// for each message dropped because nobody registered its id and the worker held too
    /// many such messages already (the first 1,024; later ones are only counted by
    /// [`Worker::am_dropped`]). Taking them clears the list.
    pub fn take_am_errors(&self) -> Vec<Error> {
        self.shared.inner.locked(|st| std::mem::take(&mut tables(st).unclaimed.errors))
    }

    /// Receives active messages with `id` as an async stream. Messages that arrived for
    /// `id` before anyone registered it come first, in arrival order (see
    /// [`Worker::am_unclaimed`]).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a reserved id or one already registered on this worker.
    pub fn am_recv(&self, id: u16) -> Result<AmReceiver> {
        check_id(id, app_am_max(&self.shared.inner)).map_err(|e| *e)?;
        self.am_recv_wire(id)
    }

    /// [`Worker::am_recv`] for wire id `id`, checked by the caller.
    pub(crate) fn am_recv_wire(&self, id: u16) -> Result<AmReceiver> {
        let reg = self.am_register(id, None)?;
        Ok(AmReceiver { worker: self.clone(), id, reg })
    }

    /// Calls `f` for each active message with `id`, after the worker's lock is released
    /// (see the module docs). Dropping the returned [`AmHandler`] unregisters it.
    ///
    /// # Errors
    /// As for [`Worker::am_recv`].
    pub fn am_handler<F>(&self, id: u16, f: F) -> Result<AmHandler>
    where
        F: FnMut(AmMessage) + Send + 'static,
    {
        check_id(id, app_am_max(&self.shared.inner)).map_err(|e| *e)?;
        self.am_handler_wire(id, f)
    }

    /// [`Worker::am_handler`] for wire id `id`, checked by the caller.
    pub(crate) fn am_handler_wire<F>(&self, id: u16, f: F) -> Result<AmHandler>
    where
        F: FnMut(AmMessage) + Send + 'static,
    {
        let cell = Arc::new(HandlerCell {
            id,
            worker: self.clone(),
            queue: Mutex::new(VecDeque::new()),
            f: Mutex::new(Box::new(f)),
            errors: Mutex::new(Vec::new()),
        });
        self.am_register(id, Some(cell.clone()))?;
        Ok(AmHandler { cell })
    }

    /// Registers `id`; returns its registration, which stays at the same address until
    /// the worker is destroyed (boxed, never removed from the worker's table).
    fn am_register(&self, id: u16, handler: Option<Arc<HandlerCell>>) -> Result<*mut AmReg> {
        check_id(id, LAST_WIRE_ID).map_err(|e| *e)?;
        let state = self.state_ptr().cast::<State>();
        self.shared.inner.locked(|st| {
            if let Some(reg) = tables(st).regs.get_mut(&id) {
                if !reg.closed {
                    return Err(Error::ApiMisuse(format!("active-message id {id} is already registered")));
                }
                // Reuse the UCX registration that drops arrivals.
                reg.closed = false;
                reg.handler = handler;
                return Ok(&mut **reg as *mut AmReg);
            }
            let mut reg =
                Box::new(AmReg { state, queue: VecDeque::new(), waker: None, handler, closed: false });
            // SAFETY: the worker is valid under the lock; arg points into a Box kept in
            // the worker's table until the worker is destroyed.
            unsafe { set_am_handler(st.handle, id, am_cb, (&mut *reg as *mut AmReg).cast()) }
                .check()
                .map_err(|source| Error::Worker { op: "ucp_worker_set_am_recv_handler", source })?;
            // Messages that arrived before the registration come first.
            for inc in tables(st).unclaimed.take(id) {
                reg.deliver(st, inc);
            }
            let ptr = &mut *reg as *mut AmReg;
            tables(st).regs.insert(id, reg);
            Ok(ptr)
        })
    }

    /// Marks `id` closed and returns its queued messages (dropped by the caller after
    /// the lock is released; rendezvous ones release their descriptors then).
    fn am_unregister(&self, id: u16) -> Vec<Incoming> {
        self.shared.inner.locked(|st| match tables(st).regs.get_mut(&id) {
            Some(reg) => {
                reg.closed = true;
                reg.handler = None;
                reg.waker = None;
                reg.queue.drain(..).collect()
            }
            None => Vec::new(),
        })
    }
}

/// The stream of active messages with one id, from [`Worker::am_recv`]. Dropping it
/// unregisters the id: later arrivals are dropped and counted.
pub struct AmReceiver {
    worker: Worker,
    id: u16,
    /// This id's registration in the worker's table (see `am_register`), read only under
    /// the worker lock: polling needs no table lookup.
    reg: *mut AmReg,
}

// SAFETY: `reg` is only dereferenced under the worker lock, and the worker (kept alive by
// `worker`) keeps the registration at that address until it is destroyed.
unsafe impl Send for AmReceiver {}
// SAFETY: as above; `&AmReceiver` only reads the queue length, under the lock.
unsafe impl Sync for AmReceiver {}

impl std::fmt::Debug for AmReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmReceiver").field("id", &self.id).finish()
    }
}

impl AmReceiver {
    /// The id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// Messages queued for this receiver and not yet taken.
    pub fn queued(&self) -> usize {
        let reg = self.reg;
        // SAFETY: under the worker lock; see the field.
        self.worker.shared.inner.locked(|_| unsafe { (*reg).queue.len() })
    }

    /// Waits for the next message.
    ///
    /// # Cancel safety
    /// Cancel-safe: a message is taken off the queue only when this resolves.
    #[inline]
    pub fn recv(&mut self) -> AmRecv<'_> {
        AmRecv { rx: self }
    }

    /// Takes the next message if one is queued, progressing the worker once first.
    pub fn try_recv(&mut self) -> Option<AmMessage> {
        let (id, reg) = (self.id, self.reg);
        let inner = &self.worker.shared.inner;
        let inc = inner.locked(|st| {
            inner.progress_locked(st);
            // SAFETY: under the worker lock; see the field.
            unsafe { (*reg).queue.pop_front() }
        });
        inc.map(|inc| AmMessage::new(&self.worker, id, inc))
    }

    /// Polls for the next message.
    #[inline]
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<AmMessage> {
        let (id, reg) = (self.id, self.reg);
        let inc = self.worker.shared.inner.poll_until(
            cx,
            // SAFETY: run under the worker lock; see the field.
            |_| unsafe { (*reg).queue.pop_front() },
            |_, waker| {
                // SAFETY: as above.
                let r = unsafe { &mut *reg };
                match &r.waker {
                    Some(w) if w.will_wake(waker) => {}
                    _ => r.waker = Some(waker.clone()),
                }
            },
        );
        inc.map(|inc| AmMessage::new(&self.worker, id, inc))
    }
}

/// Future of [`AmReceiver::recv`]: the next message.
///
/// A named future rather than an `async fn` so that its poll, and the message it
/// returns, are inlined into the awaiting code: a message handed back through an
/// out-of-line poll is stored in pieces and reloaded whole, which stalls the processor.
///
/// # Cancel safety
/// Cancel-safe: a message is taken off the queue only when this resolves.
#[must_use = "futures do nothing unless polled"]
#[derive(Debug)]
pub struct AmRecv<'a> {
    rx: &'a mut AmReceiver,
}

impl Future for AmRecv<'_> {
    type Output = AmMessage;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<AmMessage> {
        self.get_mut().rx.poll_recv(cx)
    }
}

impl Drop for AmReceiver {
    fn drop(&mut self) {
        // As messages, so that unfetched rendezvous payloads are released and their
        // senders complete.
        for inc in self.worker.am_unregister(self.id) {
            drop(AmMessage::new(&self.worker, self.id, inc));
        }
    }
}

/// A registered handler, from [`Worker::am_handler`]. Dropping it unregisters the id.
pub struct AmHandler {
    cell: Arc<HandlerCell>,
}

impl std::fmt::Debug for AmHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmHandler").field("id", &self.cell.id).finish()
    }
}

impl AmHandler {
    /// The id.
    pub fn id(&self) -> u16 {
        self.cell.id
    }

    /// Errors the handler produced so far ([`Error::HandlerPanicked`]), oldest first;
    /// taking them clears the list.
    pub fn take_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.cell.errors.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Drop for AmHandler {
    fn drop(&mut self) {
        let queued = self.cell.worker.am_unregister(self.cell.id);
        let mut rest: Vec<Incoming> =
            self.cell.queue.lock().unwrap_or_else(PoisonError::into_inner).drain(..).collect();
        rest.extend(queued);
        for inc in rest {
            drop(AmMessage::new(&self.cell.worker, self.cell.id, inc));
        }
    }
}
