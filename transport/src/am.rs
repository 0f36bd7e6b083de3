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
//! Ids are 0 to 4094 (4095 carries ucxkit's connection handshake). A message for an id
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
use crate::endpoint::{Endpoint, EndpointInner};
use crate::error::{Error, Result, Status};
use crate::handshake;
use crate::op::{OpState, RecvOp, SendOp};
use crate::request::{len_cb, Completion, Posted};
use crate::worker::{OpKind, State, Worker};

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

/// The highest id available to applications.
pub const MAX_ID: u16 = handshake::AM_ID as u16 - 1;

/// Whether `id` is one applications may use; the error is boxed so that the check stays
/// two words on the sending path.
#[inline]
fn check_id(id: u16) -> std::result::Result<(), Box<Error>> {
    if id > MAX_ID {
        return Err(Box::new(bad_id(id)));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn bad_id(id: u16) -> Error {
    Error::ApiMisuse(format!(
        "active-message id {id} is out of range (0..={MAX_ID}; {} is reserved for the handshake)",
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
    fn check_am_send(&self, id: u16, header: &[u8]) -> std::result::Result<(), Box<Error>> {
        check_id(id)?;
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
        if let Err(e) = self.check_am_send(id, header) {
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
        self.check_am_send(id, header).map_err(|e| *e)?;
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

/// Eager payloads at least this long stay in UCX's receive buffer (when UCX lets them,
/// `UCP_AM_RECV_ATTR_FLAG_DATA`) until the message is dropped or its payload copied out,
/// instead of being copied in the callback; shorter ones are copied, which costs less
/// than releasing a descriptor under the worker lock later.
const HOLD_MIN: usize = 2048;

/// A message whose header and payload together take at most this many bytes (and that
/// carries no reply endpoint) travels whole as a [`Short`]: three words.
const SHORT_MAX: usize = 22;

/// Up to [`SHORT_MAX`] bytes at `src` as three words, the bytes in order (little endian,
/// as numbers), the rest zero: at most three loads (the first bytes and the last ones,
/// which may overlap), shifted into place, never a read outside `src`. This runs for
/// every short active message, inside UCX's callback.
///
/// Built in registers, a message is then stored and moved as whole words: a byte array
/// filled by overlapping partial copies, then read back whole, would defeat the
/// processor's store-to-load forwarding at every move on its way from UCX's callback
/// through the receive queue and the futures to its receiver.
///
/// # Safety
/// `src` is readable for `len <= SHORT_MAX` bytes (it may be null when `len` is 0).
#[inline]
unsafe fn load_words(src: *const u8, len: usize) -> [u64; 3] {
    debug_assert!(len <= SHORT_MAX);
    /// `N` bytes at `src + at`, as a little-endian number.
    ///
    /// # Safety
    /// The range is readable.
    #[inline(always)]
    unsafe fn load<const N: usize>(src: *const u8, at: usize) -> u64 {
        // SAFETY: per contract.
        let b = unsafe { std::ptr::read_unaligned(src.add(at).cast::<[u8; N]>()) };
        let mut w = [0u8; 8];
        w[..N].copy_from_slice(&b);
        u64::from_le_bytes(w)
    }
    // The bytes [len - N, len) as loaded, moved up to their place in a word that starts
    // at `base`: byte len - N + i goes to byte len - N + i - base.
    let up = |v: u64, n: usize, base: usize| v << (8 * (len - n - base));
    let down = |v: u64, n: usize, base: usize| v >> (8 * (base + n - len));
    // SAFETY: per contract src has len readable bytes; each load reads within [0, len)
    // only.
    unsafe {
        match len {
            0 => [0, 0, 0],
            1 => [load::<1>(src, 0), 0, 0],
            2..=3 => [load::<2>(src, 0) | up(load::<2>(src, len - 2), 2, 0), 0, 0],
            4..=7 => [load::<4>(src, 0) | up(load::<4>(src, len - 4), 4, 0), 0, 0],
            8 => [load::<8>(src, 0), 0, 0],
            9..=16 => [load::<8>(src, 0), down(load::<8>(src, len - 8), 8, 8), 0],
            _ => [load::<8>(src, 0), load::<8>(src, 8), down(load::<8>(src, len - 8), 8, 16)],
        }
    }
}

/// A whole short message in place (see [`SHORT_MAX`]): the header's bytes, then the
/// payload's, in three words built by [`load_words`]; the header's length in byte 22,
/// the payload's in byte 23 with its top bit set, so that the last word is never zero
/// and [`Incoming`] tags its other variant with a zero there (three words in all).
/// Queued and handed out in three words, with no allocation, it keeps the hand-off from
/// UCX's callback to the receiver as short as a message can be.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Short {
    words: [u64; 2],
    last: NonZeroU64,
}

/// Set in a [`Short`]'s last byte, above the payload's length.
const SHORT_MARK: u64 = 0x80 << 56;

impl Short {
    /// A copy of `header` and `data` (`header_len + len <= SHORT_MAX`).
    ///
    /// # Safety
    /// `header` is readable for `header_len` bytes and `data` for `len` (either may be
    /// null when its length is 0).
    #[inline]
    unsafe fn new(header: *const u8, header_len: usize, data: *const u8, len: usize) -> Short {
        debug_assert!(header_len + len <= SHORT_MAX);
        // SAFETY: per contract.
        let p = unsafe { load_words(data, len) };
        let [w0, w1, w2] = if header_len == 0 {
            p
        } else {
            // SAFETY: per contract.
            let h = unsafe { load_words(header, header_len) };
            let p = shift_up(p, 8 * header_len as u32);
            [h[0] | p[0], h[1] | p[1], h[2] | p[2]]
        };
        let last = w2 | (header_len as u64) << 48 | (len as u64) << 56;
        Short { words: [w0.to_le(), w1.to_le()], last: Self::last(last) }
    }

    /// The last word as stored: little endian, never zero (it holds [`SHORT_MARK`]).
    const fn last(w: u64) -> NonZeroU64 {
        match NonZeroU64::new((w | SHORT_MARK).to_le()) {
            Some(v) => v,
            // Not reached: SHORT_MARK is set.
            None => NonZeroU64::MIN,
        }
    }

    fn header_len(&self) -> usize {
        (u64::from_le(self.last.get()) >> 48) as usize & 0xff
    }

    fn len(&self) -> usize {
        (u64::from_le(self.last.get()) >> 56) as usize & 0x7f
    }

    fn bytes(&self) -> &[u8; 24] {
        // SAFETY: `Short` is repr(C): two u64 and a non-zero u64, 24 initialized bytes
        // with no padding; u8 has no alignment to keep.
        unsafe { &*(self as *const Short).cast::<[u8; 24]>() }
    }

    fn header(&self) -> &[u8] {
        &self.bytes()[..self.header_len()]
    }

    fn data(&self) -> &[u8] {
        let h = self.header_len();
        &self.bytes()[h..h + self.len()]
    }
}

/// The 192-bit number `[w0, w1, w2]` (least significant word first) shifted up by `k`
/// bits (`k < 192`); bits shifted past the top are lost.
#[inline]
fn shift_up([a, b, c]: [u64; 3], k: u32) -> [u64; 3] {
    let [a, b, c] = match k / 64 {
        0 => [a, b, c],
        1 => [0, a, b],
        _ => [0, 0, a],
    };
    match k % 64 {
        0 => [a, b, c],
        r => [a << r, b << r | a >> (64 - r), c << r | b >> (64 - r)],
    }
}

/// Where a [`Long`] message's payload is.
enum Payload {
    /// Copied out of UCX's receive buffer into the message, after the header.
    Copied,
    /// Eager, still in UCX's receive buffer: `len` bytes at `desc`, released with
    /// `ucp_am_data_release`.
    Held { desc: *mut c_void, len: usize },
    /// Still at the sender: a UCX data descriptor to fetch or release.
    Rndv { desc: *mut c_void, len: usize },
    /// Fetched or released.
    Gone,
}

impl Payload {
    /// Whether UCX still holds the payload (a descriptor to give back).
    fn with_ucx(&self) -> bool {
        matches!(self, Payload::Held { .. } | Payload::Rndv { .. })
    }
}

/// What a [`Long`] message keeps beside its bytes.
struct Meta {
    /// How many bytes follow the Meta in the allocation.
    bytes_len: usize,
    header_len: usize,
    payload: Payload,
    /// The sender's endpoint as the callback found it, when the sender asked for replies
    /// and this worker has one; taken for `reply_ep` when the message is handed out.
    reply: Weak<EndpointInner>,
    /// Set when the message is handed out: the endpoint to reply on.
    reply_ep: Option<Endpoint>,
    /// Set when the message is handed out, if UCX holds the payload: the worker that
    /// takes it back.
    worker: Option<Worker>,
}

/// Any message that is not a [`Short`], in one allocation from UCX's callback to the
/// application, owned through one thin pointer (so that [`Incoming`] stays at three
/// words): its [`Meta`], then the header's bytes and, when the payload was copied out of
/// UCX's receive buffer, the payload's.
pub(crate) struct Long(NonNull<Meta>);

impl Long {
    /// The allocation of a message with `n` bytes after its Meta.
    fn layout(n: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(std::mem::size_of::<Meta>() + n, std::mem::align_of::<Meta>())
            .expect("an active message fits in memory")
    }

    /// A message of `meta` (whose lengths it sets) and the bytes `header` then `data`.
    fn new(mut meta: Meta, header: &[u8], data: &[u8]) -> Long {
        let n = header.len() + data.len();
        (meta.bytes_len, meta.header_len) = (n, header.len());
        let layout = Self::layout(n);
        // SAFETY: the layout has a non-zero size (a Meta is not empty).
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<Meta>()) else { std::alloc::handle_alloc_error(layout) };
        // SAFETY: raw is a fresh allocation of `layout`: room for the Meta at its start
        // (aligned for it) and n bytes right after it.
        unsafe {
            ptr.as_ptr().write(meta);
            let b = raw.add(std::mem::size_of::<Meta>());
            std::ptr::copy_nonoverlapping(header.as_ptr(), b, header.len());
            std::ptr::copy_nonoverlapping(data.as_ptr(), b.add(header.len()), data.len());
        }
        Long(ptr)
    }

    fn meta(&self) -> &Meta {
        // SAFETY: the Meta was written by `new` and lives until `drop`.
        unsafe { self.0.as_ref() }
    }

    fn meta_mut(&mut self) -> &mut Meta {
        // SAFETY: as above; `&mut self` is the only access.
        unsafe { self.0.as_mut() }
    }

    /// The header's bytes, then those of a copied payload.
    fn bytes(&self) -> &[u8] {
        // SAFETY: `new` wrote bytes_len bytes right after the Meta; they live until `drop`.
        unsafe {
            std::slice::from_raw_parts(
                self.0.as_ptr().cast::<u8>().add(std::mem::size_of::<Meta>()),
                self.meta().bytes_len,
            )
        }
    }

    fn header(&self) -> &[u8] {
        &self.bytes()[..self.meta().header_len]
    }

    fn len(&self) -> usize {
        match self.meta().payload {
            Payload::Copied => self.meta().bytes_len - self.meta().header_len,
            Payload::Held { len, .. } | Payload::Rndv { len, .. } => len,
            Payload::Gone => 0,
        }
    }

    /// The payload, when it came with the message (eager), read in place.
    fn data(&self) -> Option<&[u8]> {
        match self.meta().payload {
            Payload::Copied => Some(&self.bytes()[self.meta().header_len..]),
            Payload::Held { desc, len } => {
                // SAFETY: UCX keeps the held buffer readable until it is released, which
                // happens through `&mut self` (`release`) or by value.
                Some(unsafe { std::slice::from_raw_parts(desc.cast::<u8>(), len) })
            }
            Payload::Rndv { .. } | Payload::Gone => None,
        }
    }

    /// Gives a held or rendezvous payload back to UCX.
    #[inline(never)]
    fn release(&mut self) {
        let meta = self.meta_mut();
        if let Payload::Rndv { desc, .. } | Payload::Held { desc, .. } =
            std::mem::replace(&mut meta.payload, Payload::Gone)
        {
            release_data(meta.worker.as_ref(), desc);
        }
    }
}

impl Drop for Long {
    fn drop(&mut self) {
        let layout = Self::layout(self.meta().bytes_len);
        // SAFETY: the Meta was written by `new` and is dropped once, here; the allocation
        // was made with this layout (the same bytes_len).
        unsafe {
            std::ptr::drop_in_place(self.0.as_ptr());
            std::alloc::dealloc(self.0.as_ptr().cast(), layout);
        }
    }
}

/// A message as queued by the UCX callback: three words.
pub(crate) enum Incoming {
    Short(Short),
    Long(Long),
}

const _: () = assert!(std::mem::size_of::<Incoming>() == 24);

// SAFETY: a held or rendezvous descriptor is only handed back to UCX under the worker
// lock (`AmMessage::drop`, `recv_data`), whichever thread holds it.
unsafe impl Send for Incoming {}

/// One registered id, boxed so that UCX's callback argument stays put.
pub(crate) struct AmReg {
    state: *mut State,
    queue: VecDeque<Incoming>,
    waker: Option<Waker>,
    handler: Option<Arc<HandlerCell>>,
    /// No receiver or handler any more: drop arrivals.
    closed: bool,
}

/// A registered handler: its queue and the closure, run outside the worker lock.
pub(crate) struct HandlerCell {
    id: u16,
    worker: Worker,
    queue: Mutex<VecDeque<Incoming>>,
    f: Mutex<Box<dyn FnMut(AmMessage) + Send>>,
    errors: Mutex<Vec<Error>>,
}

impl HandlerCell {
    /// Runs the closure over queued messages until none is left. If another thread is
    /// running it already, that thread picks the messages up.
    pub(crate) fn run(&self) {
        loop {
            let Ok(mut f) = self.f.try_lock() else { return };
            loop {
                let next = self.queue.lock().unwrap_or_else(PoisonError::into_inner).pop_front();
                let Some(inc) = next else { break };
                let msg = AmMessage::new(&self.worker, self.id, inc);
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| (f)(msg))) {
                    let message = panic_message(&*p);
                    tracing::error!(id = self.id, %message, "active-message handler panicked");
                    self.errors
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Error::HandlerPanicked { id: self.id, message });
                }
            }
            drop(f);
            // A message queued while we were letting go would otherwise wait.
            if self.queue.lock().unwrap_or_else(PoisonError::into_inner).is_empty() {
                return;
            }
        }
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Whether an arriving message's payload is still at the sender, to be fetched
/// (rendezvous). An empty rendezvous payload is not: there is nothing to fetch, and
/// UCX 1.13 never frees the descriptor of one fetched after its callback, so such a
/// message is taken like an eager one (returning `UCS_OK` releases its sender).
#[inline(always)]
fn is_rndv(len: usize, param: &sys::ucp_am_recv_param_t) -> bool {
    len > 0 && param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0
}

/// Whether an arriving message travels as a [`Short`]: header and payload fit, and its
/// payload is not still at the sender nor does it carry the sender's endpoint.
#[inline(always)]
fn is_short(header_len: usize, len: usize, param: &sys::ucp_am_recv_param_t) -> bool {
    header_len <= SHORT_MAX
        && len <= SHORT_MAX - header_len
        && param.recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP.0 as u64 == 0
        && !is_rndv(len, param)
}

/// Builds the queued form of an arriving message and the status to return to UCX
/// (`UCS_INPROGRESS` keeps a rendezvous descriptor for a later fetch or release).
///
/// # Safety
/// Called from a UCX active-message callback with its arguments, under the worker lock.
unsafe fn incoming(
    st: &State,
    header: *const c_void,
    header_len: usize,
    data: *mut c_void,
    len: usize,
    param: &sys::ucp_am_recv_param_t,
) -> (Incoming, sys::ucs_status_t) {
    if is_short(header_len, len, param) {
        // SAFETY: UCX passes header_len and len readable bytes, valid during the call.
        let short = unsafe { Short::new(header.cast(), header_len, data.cast(), len) };
        return (Incoming::Short(short), sys::UCS_OK);
    }
    let header: &[u8] = if header_len == 0 {
        &[]
    } else {
        // SAFETY: UCX passes header_len readable bytes, valid during the callback.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_len) }
    };
    let reply = if param.recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP.0 as u64 != 0 {
        st.by_handle
            .get(&(param.reply_ep as usize))
            .and_then(|id| st.eps.get(id))
            .map_or_else(Weak::new, |e| e.endpoint.clone())
    } else {
        Weak::new()
    };
    let meta = |payload| Meta { bytes_len: 0, header_len: 0, payload, reply, reply_ep: None, worker: None };
    let (long, ret) = if is_rndv(len, param) {
        (Long::new(meta(Payload::Rndv { desc: data, len }), header, &[]), sys::UCS_INPROGRESS)
    } else if len >= HOLD_MIN && param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_DATA.0 as u64 != 0 {
        (Long::new(meta(Payload::Held { desc: data, len }), header, &[]), sys::UCS_INPROGRESS)
    } else {
        let d: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: eager data is readable for len bytes during the callback.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        };
        (Long::new(meta(Payload::Copied), header, d), sys::UCS_OK)
    };
    (Incoming::Long(long), ret)
}

impl AmReg {
    /// Takes an arriving message for this id: dropped and counted when the id was
    /// unregistered, else queued for the receiver or handler. Returns the status for UCX.
    ///
    /// # Safety
    /// Called from a UCX active-message callback with its arguments, under the worker
    /// lock; `self.state` is the worker's State.
    unsafe fn receive(
        &mut self,
        header: *const c_void,
        header_len: usize,
        data: *mut c_void,
        len: usize,
        param: &sys::ucp_am_recv_param_t,
    ) -> sys::ucs_status_t {
        // SAFETY: per contract.
        let st = unsafe { &mut *self.state };
        if self.closed {
            st.am_dropped += 1;
            // For a rendezvous message, UCS_OK tells UCX to drop it and release the sender.
            return sys::UCS_OK;
        }
        // The common case, a short message for a receiver, copied straight into its queue:
        // this runs between the message's arrival and whatever its receiver does with it
        // (a reply, say), so it stays short.
        if is_short(header_len, len, param) && self.handler.is_none() {
            // SAFETY: UCX passes header_len and len readable bytes, valid during the call.
            let short = unsafe { Short::new(header.cast(), header_len, data.cast(), len) };
            self.enqueue(st, Incoming::Short(short));
            return sys::UCS_OK;
        }
        // SAFETY: per contract.
        let (inc, ret) = unsafe { incoming(st, header, header_len, data, len, param) };
        self.deliver(st, inc);
        ret
    }

    /// Hands a message to the receiver's queue or the handler's.
    fn deliver(&mut self, st: &mut State, inc: Incoming) {
        match &self.handler {
            Some(h) => {
                h.queue.lock().unwrap_or_else(PoisonError::into_inner).push_back(inc);
                st.after.run_handler(h);
            }
            None => self.enqueue(st, inc),
        }
    }

    /// Queues a message for the receiver and wakes it.
    #[inline(always)]
    fn enqueue(&mut self, st: &mut State, inc: Incoming) {
        self.queue.push_back(inc);
        if let Some(w) = self.waker.take() {
            st.after.wake(w);
        }
    }
}

/// UCX's active-message callback for every registered id; `arg` is the id's [`AmReg`].
unsafe extern "C" fn am_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // Nothing below is expected to panic; if it did, the message is dropped rather than
    // unwinding into UCX.
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: UCX calls this inside progress, under the worker lock; arg is the boxed
        // AmReg registered with this callback (alive until the worker is destroyed), and
        // its state pointer is the worker's State; param is valid for the call.
        let (reg, param) = unsafe { (&mut *arg.cast::<AmReg>(), &*param) };
        // SAFETY: as above; forwarded from UCX.
        unsafe { reg.receive(header, header_len, data, len, param) }
    }))
    .unwrap_or(sys::UCS_OK)
}

/// How many messages for ids nobody registered a worker holds, at most, waiting for a
/// receiver or handler; later ones are dropped and reported ([`Worker::take_am_errors`]).
/// A held rendezvous message keeps its sender's send pending until the id is registered
/// or [`Worker::am_discard_unclaimed`] lets it go.
pub const UNCLAIMED_MAX_MESSAGES: usize = 4096;
/// How many payload bytes of eager messages for unregistered ids a worker holds, at most
/// (rendezvous payloads stay with their senders and count 0).
pub const UNCLAIMED_MAX_BYTES: usize = 64 << 20;
/// How many dropped-message errors a worker keeps until taken; later ones are only
/// counted ([`Worker::am_dropped`]).
const MAX_KEPT_ERRORS: usize = 1024;

/// The callback arguments that route messages for unregistered ids: one `u16` per id,
/// holding that id, so that UCX's argument for id `i` (`&ids[i]`) tells the callback both
/// the id and, by its offset, where this table (and the worker's State) is.
#[repr(C)]
pub(crate) struct IdTable {
    state: *mut State,
    ids: [u16; MAX_ID as usize + 1],
}

/// Messages for ids nobody registered yet, held for a later [`Worker::am_recv`] or
/// [`Worker::am_handler`].
#[derive(Default)]
pub(crate) struct Unclaimed {
    queues: crate::worker::IdMap<u16, VecDeque<Incoming>>,
    messages: usize,
    bytes: usize,
    errors: Vec<Error>,
}

impl Unclaimed {
    fn take(&mut self, id: u16) -> VecDeque<Incoming> {
        let q = self.queues.remove(&id).unwrap_or_default();
        self.messages -= q.len();
        self.bytes -= q.iter().map(Incoming::eager_len).sum::<usize>();
        q
    }

    /// Gives every payload UCX still holds for these messages back to it (eager payloads
    /// in its receive buffers, rendezvous payloads not fetched), for a worker about to be
    /// destroyed, and lets the messages go. Without it UCX would find its receive buffers
    /// not returned, and a rendezvous sender would not be told that its payload was let go.
    ///
    /// # Safety
    /// `worker` received these messages and is not destroyed yet; the caller has
    /// exclusive access to it and calls no UCX function from a callback.
    pub(crate) unsafe fn release_all(&mut self, worker: sys::ucp_worker_h) {
        for (_, q) in self.queues.drain() {
            for mut inc in q {
                if let Incoming::Long(l) = &mut inc {
                    if let Payload::Held { desc, .. } | Payload::Rndv { desc, .. } =
                        std::mem::replace(&mut l.meta_mut().payload, Payload::Gone)
                    {
                        // SAFETY: per contract; the descriptor was kept by this worker's
                        // callback and not released yet (the payload is now Gone).
                        unsafe { sys::ucp_am_data_release(worker, desc) };
                    }
                }
            }
        }
        (self.messages, self.bytes) = (0, 0);
    }
}

impl Incoming {
    /// Payload bytes this message holds on this side (0 for a rendezvous payload).
    fn eager_len(&self) -> usize {
        match self {
            Incoming::Short(s) => s.len(),
            Incoming::Long(l) if matches!(l.meta().payload, Payload::Rndv { .. }) => 0,
            Incoming::Long(l) => l.len(),
        }
    }
}

/// The callback type UCX calls for an active message.
type AmCallback = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// Routes active-message id `id` of worker `handle` to `cb` with `arg`
/// (`ucp_worker_set_am_recv_handler`, whole messages).
///
/// # Safety
/// `handle` is a valid worker used by no other thread during the call; `arg` stays valid
/// for `cb` as long as the registration lasts.
unsafe fn set_am_handler(handle: sys::ucp_worker_h, id: u16, cb: AmCallback, arg: *mut c_void) -> Status {
    let param = sys::ucp_am_handler_param_t {
        field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS.0) as u64,
        id: id as u32,
        flags: sys::UCP_AM_FLAG_WHOLE_MSG.0 as u32,
        cb: Some(cb),
        arg,
    };
    // SAFETY: per contract.
    Status(unsafe { sys::ucp_worker_set_am_recv_handler(handle, &param) })
}

/// Registers ucxkit's catch-all callback for every application id on a new worker, so
/// that no message is dropped by UCX unseen. Returns the table to free with
/// [`free_id_table`] after the worker is destroyed.
///
/// # Safety
/// `handle` is a new worker whose State is at `state`, which outlives it.
pub(crate) unsafe fn register_catch_all(
    handle: sys::ucp_worker_h,
    state: *mut State,
) -> std::result::Result<*mut IdTable, Status> {
    let table = Box::into_raw(Box::new(IdTable { state, ids: std::array::from_fn(|i| i as u16) }));
    for id in 0..=MAX_ID {
        // SAFETY: id is within the array; the pointer keeps the whole table's provenance
        // (derived from the raw Box pointer); the worker is new and the table lives until
        // after it.
        let st = unsafe {
            let arg = std::ptr::addr_of_mut!((*table).ids[id as usize]).cast();
            set_am_handler(handle, id, unclaimed_cb, arg)
        };
        if let Err(e) = st.check() {
            // SAFETY: the worker is destroyed by the caller on error; the table was never
            // handed out otherwise.
            unsafe { free_id_table(table) };
            return Err(e);
        }
    }
    Ok(table)
}

/// Frees a table from [`register_catch_all`].
///
/// # Safety
/// The worker it was registered on is destroyed (or never used it), and this runs once.
pub(crate) unsafe fn free_id_table(table: *mut IdTable) {
    // SAFETY: per contract, the Box from register_catch_all, no longer referenced.
    drop(unsafe { Box::from_raw(table) });
}

/// UCX's callback for ids no application code registered: holds the message (bounded)
/// until a receiver or handler for its id appears; `arg` points at the id's entry of the
/// worker's [`IdTable`].
unsafe extern "C" fn unclaimed_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    catch_unwind(AssertUnwindSafe(|| {
        let entry = arg.cast::<u16>();
        // SAFETY: entry points into the ids array of a live IdTable (registered by
        // register_catch_all, freed only after the worker); entry i holds i, so stepping
        // back i entries and then over the table's first field finds the table.
        let st = unsafe {
            let id = *entry;
            let ids = entry.sub(id as usize);
            let table = ids.cast::<u8>().sub(std::mem::offset_of!(IdTable, ids)).cast::<IdTable>();
            &mut *(*table).state
        };
        // SAFETY: as above.
        let (id, param) = unsafe { (*entry, &*param) };
        let held = if is_rndv(len, param) { 0 } else { len };
        if let Some(reg) = st.am.get_mut(&id).map(|r| &mut **r as *mut AmReg) {
            // Registered since (a registration replaces this callback; should UCX still
            // route a message here, it goes to the registration all the same).
            // SAFETY: forwarded from UCX, under the lock; the registration is boxed (its
            // own allocation, not part of `st`) and its state is this worker's State.
            return unsafe { (*reg).receive(header, header_len, data, len, param) };
        }
        let u = &mut st.am_unclaimed;
        if u.messages >= UNCLAIMED_MAX_MESSAGES || u.bytes + held > UNCLAIMED_MAX_BYTES {
            st.am_dropped += 1;
            if u.errors.len() < MAX_KEPT_ERRORS {
                u.errors.push(Error::AmUnclaimed { id, len });
            }
            tracing::warn!(id, len, "active message for an id nobody registered dropped: too many held");
            // Releases a rendezvous sender.
            return sys::UCS_OK;
        }
        if !u.queues.contains_key(&id) {
            tracing::debug!(id, "holding active messages for an id nobody registered yet");
        }
        // SAFETY: forwarded from UCX, under the lock.
        let (inc, ret) = unsafe { incoming(st, header, header_len, data, len, param) };
        let u = &mut st.am_unclaimed;
        u.messages += 1;
        u.bytes += held;
        u.queues.entry(id).or_default().push_back(inc);
        ret
    }))
    .unwrap_or(sys::UCS_OK)
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
        self.shared.inner.locked(|st| st.am_dropped)
    }

    /// Ids that received messages nobody registered for, with how many of them the worker
    /// holds for a later [`Worker::am_recv`] or [`Worker::am_handler`], by id. A worker
    /// destroyed while holding some gives their payloads back to UCX first, so that their
    /// rendezvous senders complete (as [`Worker::am_discard_unclaimed`] does).
    pub fn am_unclaimed(&self) -> Vec<(u16, usize)> {
        let mut v: Vec<(u16, usize)> = self
            .shared
            .inner
            .locked(|st| st.am_unclaimed.queues.iter().map(|(&id, q)| (id, q.len())).collect());
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
            let q = st.am_unclaimed.take(id);
            st.am_dropped += q.len() as u64;
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
        self.shared.inner.locked(|st| std::mem::take(&mut st.am_unclaimed.errors))
    }

    /// Receives active messages with `id` as an async stream. Messages that arrived for
    /// `id` before anyone registered it come first, in arrival order (see
    /// [`Worker::am_unclaimed`]).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a reserved id or one already registered on this worker.
    pub fn am_recv(&self, id: u16) -> Result<AmReceiver> {
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
        check_id(id).map_err(|e| *e)?;
        let state = self.state_ptr().cast::<State>();
        self.shared.inner.locked(|st| {
            if let Some(reg) = st.am.get_mut(&id) {
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
            for inc in st.am_unclaimed.take(id) {
                reg.deliver(st, inc);
            }
            let ptr = &mut *reg as *mut AmReg;
            st.am.insert(id, reg);
            Ok(ptr)
        })
    }

    /// Marks `id` closed and returns its queued messages (dropped by the caller after
    /// the lock is released; rendezvous ones release their descriptors then).
    fn am_unregister(&self, id: u16) -> Vec<Incoming> {
        self.shared.inner.locked(|st| match st.am.get_mut(&id) {
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

/// One received active message.
///
/// Dropping a message whose rendezvous payload was not fetched releases it (the sender's
/// send then completes); dropping one whose eager payload is still in UCX's receive
/// buffer gives that buffer back.
pub struct AmMessage {
    id: u16,
    body: Body,
}

/// What an [`AmMessage`] holds: the same as [`Incoming`], in a type of its own (with the
/// queued type reused here, the receive path measured 3–5 % slower).
enum Body {
    Short(Short),
    Long(Long),
}

const _: () = assert!(std::mem::size_of::<Body>() == 24);

// SAFETY: a held or rendezvous descriptor is only handed back to UCX under the worker
// lock (`recv_data`, `drop`), which take the message by value; `&AmMessage` only reads a
// held buffer, which UCX leaves alone until it is released.
unsafe impl Send for AmMessage {}
// SAFETY: as above.
unsafe impl Sync for AmMessage {}

/// The public handles must stay usable from multi-thread runtimes.
const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<AmMessage>();
    is_send_sync::<AmReceiver>();
    is_send_sync::<AmHandler>();
    is_send_sync::<AmRecvData<Vec<u8>>>();
};

impl std::fmt::Debug for AmMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmMessage")
            .field("id", &self.id)
            .field("header_len", &self.header().len())
            .field("len", &self.len())
            .field("rendezvous", &self.is_rendezvous())
            .finish()
    }
}

impl AmMessage {
    #[inline]
    fn new(worker: &Worker, id: u16, inc: Incoming) -> AmMessage {
        let body = match inc {
            Incoming::Short(s) => Body::Short(s),
            Incoming::Long(mut long) => {
                let meta = long.meta_mut();
                if meta.payload.with_ucx() {
                    meta.worker = Some(worker.clone());
                }
                meta.reply_ep = std::mem::take(&mut meta.reply).upgrade().map(|inner| Endpoint { inner });
                Body::Long(long)
            }
        };
        AmMessage { id, body }
    }

    /// The id it was sent with.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The header.
    pub fn header(&self) -> &[u8] {
        match &self.body {
            Body::Short(s) => s.header(),
            Body::Long(l) => l.header(),
        }
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        match &self.body {
            Body::Short(s) => s.len(),
            Body::Long(l) => l.len(),
        }
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the payload is still at the sender (fetch it with
    /// [`AmMessage::recv_data`]).
    pub fn is_rendezvous(&self) -> bool {
        matches!(&self.body, Body::Long(l) if matches!(l.meta().payload, Payload::Rndv { .. }))
    }

    /// The payload, when it arrived with the message (eager), read in place.
    pub fn data(&self) -> Option<&[u8]> {
        match &self.body {
            Body::Short(s) => Some(s.data()),
            Body::Long(l) => l.data(),
        }
    }

    /// The endpoint to the sender, when the sender asked for replies and this worker
    /// has an endpoint to it (an accepted or connected one).
    pub fn reply_endpoint(&self) -> Option<&Endpoint> {
        match &self.body {
            Body::Short(_) => None,
            Body::Long(l) => l.meta().reply_ep.as_ref(),
        }
    }

    /// Sends an active message back to the sender on [`AmMessage::reply_endpoint`].
    ///
    /// # Errors
    /// (in the future's result) [`Error::ApiMisuse`] when there is no endpoint to the
    /// sender.
    pub fn reply<B: IoBuf>(&self, id: u16, header: &[u8], payload: B) -> Result<AmSend<B>, (Error, B)> {
        match self.reply_endpoint() {
            Some(ep) => Ok(ep.am_send(id, header, payload)),
            None => Err((
                Error::ApiMisuse(format!(
                    "reply to active message {}: the sender did not ask for replies or this worker has no endpoint to it",
                    self.id
                )),
                payload,
            )),
        }
    }

    /// Moves the payload into `buf` (copying an eager one, fetching a rendezvous one with
    /// `ucp_am_recv_data_nbx`) and resolves to `(Result<len>, buf)`; the buffer's length
    /// is set to the payload's.
    ///
    /// # Errors
    /// [`Error::Truncated`] when `buf` is smaller than [`AmMessage::len`] (the payload is
    /// then dropped); [`Error::ConnectionReset`] when the sender's endpoint failed (a
    /// fetch from a sender this worker has no endpoint to ends when UCX notices the
    /// failure itself).
    ///
    /// # Cancel safety
    /// Memory-safe to drop at any time: a fetch in flight keeps `buf` until UCX finishes
    /// writing it, and the payload is lost.
    pub fn recv_data<B: IoBufMut>(mut self, mut buf: B) -> AmRecvData<B> {
        let len = self.len();
        let capacity = buf.bytes_total();
        if capacity < len {
            let e = Error::Truncated { capacity, len, tag: self.id as u64 };
            let reply = self.reply_endpoint().cloned();
            // Dropped: a payload UCX holds goes back to it.
            drop(self);
            return RecvOp::new(None, reply, "am_recv_data", Some(len), OpState::failed(e, buf), None);
        }
        // A payload in hand, copied into `buf` (which has room for it).
        let copied = |data: &[u8], mut buf: B, reply: Option<Endpoint>| {
            // SAFETY: buf has room for `capacity >= len` bytes; data is the message's.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.stable_mut_ptr(), len) };
            RecvOp::new(None, reply, "am_recv_data", Some(len), OpState::Done(Completion::ok(len), buf), None)
        };
        let long = match &mut self.body {
            Body::Short(s) => return copied(s.data(), buf, None),
            Body::Long(l) => l,
        };
        let reply = long.meta_mut().reply_ep.take();
        // Taken out of the message, whose drop then has nothing left to give back.
        match std::mem::replace(&mut long.meta_mut().payload, Payload::Gone) {
            Payload::Copied => copied(&long.bytes()[long.meta().header_len..], buf, reply),
            Payload::Gone => copied(&[], buf, reply),
            Payload::Held { desc, len } => {
                // SAFETY: the held buffer is UCX's, readable for len bytes until released
                // just below.
                let op = copied(unsafe { std::slice::from_raw_parts(desc.cast::<u8>(), len) }, buf, reply);
                release_data(long.meta().worker.as_ref(), desc);
                op
            }
            Payload::Rndv { desc, len } => {
                let ptr = buf.stable_mut_ptr();
                let Some(owner) = long.meta_mut().worker.take() else {
                    // AmMessage::new gives every message whose payload UCX holds its
                    // worker.
                    debug_assert!(false, "a rendezvous payload without its worker");
                    let e = Error::ApiMisuse("active-message payload without its worker".into());
                    return RecvOp::new(
                        None,
                        reply,
                        "am_recv_data",
                        Some(len),
                        OpState::failed(e, buf),
                        None,
                    );
                };
                let inner = &owner.shared.inner;
                let bind = reply.as_ref().map(|e| e.inner.id);
                let no_imm = inner.no_imm;
                let posted = inner.locked(|st| {
                    if let Some(ep) = &reply {
                        // A sender already known failed: its fetch would never end.
                        if let Err(e) = ep.live_handle(st, "am_recv_data") {
                            // SAFETY: an unfetched rendezvous descriptor of this
                            // worker, released once; the lock is held.
                            unsafe { sys::ucp_am_data_release(st.handle, desc) };
                            return Err(e);
                        }
                    }
                    let mut mask = sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0;
                    if no_imm {
                        mask |= sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL.0;
                    }
                    let param = sys::ucp_request_param_t {
                        op_attr_mask: mask as u32,
                        cb: sys::ucp_request_param_t__bindgen_ty_1 { recv_am: Some(len_cb) },
                        user_data: (st as *mut State).cast(),
                        ..Default::default()
                    };
                    // SAFETY: desc is an unfetched rendezvous descriptor of this
                    // worker (consumed here, once); buf is valid for len bytes and
                    // owned by the future until UCX completes (parked on drop).
                    let p = unsafe { sys::ucp_am_recv_data_nbx(st.handle, desc, ptr.cast(), len, &param) };
                    let posted = Posted::from_ptr(p, Completion::ok(len), false);
                    if let (Posted::Pending(r), Some(ep)) = (&posted, bind) {
                        r.bind(st, ep, OpKind::Finish);
                    }
                    Ok(posted)
                });
                if matches!(posted, Ok(Posted::Pending(_))) {
                    inner.posted();
                }
                let state = OpState::from_posted(posted.map_err(Box::new), buf);
                // The worker is kept by the operation while the fetch may be pending.
                RecvOp::new(Some(owner), reply, "am_recv_data", Some(len), state, None)
            }
        }
    }

    /// [`AmMessage::recv_data`] into a new `Vec` of exactly the payload's length.
    pub fn into_vec(self) -> AmRecvData<Vec<u8>> {
        let len = self.len();
        self.recv_data(Vec::with_capacity(len))
    }
}

impl Drop for AmMessage {
    #[inline(always)]
    fn drop(&mut self) {
        // Only a payload still in UCX's hands has anything to give back; a short message
        // is dropped without being copied anywhere.
        if let Body::Long(long) = &mut self.body {
            if long.meta().payload.with_ucx() {
                long.release();
            }
        }
    }
}

/// Hands a held eager buffer or an unfetched rendezvous descriptor back to UCX, through
/// the worker a message holding one always keeps.
fn release_data(worker: Option<&Worker>, desc: *mut c_void) {
    let Some(worker) = worker else {
        // AmMessage::new gives every message whose payload UCX holds its worker.
        debug_assert!(false, "a UCX descriptor without its worker");
        return;
    };
    worker.shared.inner.locked(|st| {
        // SAFETY: callers pass a descriptor this worker's callback kept (returned
        // UCS_INPROGRESS for) and that was not released or fetched yet; the lock is held.
        unsafe { sys::ucp_am_data_release(st.handle, desc) }
    });
}

/// Future of [`AmMessage::recv_data`]: resolves to `(Result<usize>, buffer)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time; a fetch in flight keeps the buffer until UCX is done
/// with it, and the payload is lost.
pub type AmRecvData<B> = RecvOp<B>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_words_every_length() {
        let src: Vec<u8> = (1..=SHORT_MAX as u8).collect();
        for len in 0..=SHORT_MAX {
            // A source of exactly `len` bytes, so that a read past it shows under valgrind.
            let exact: Box<[u8]> = src[..len].into();
            // SAFETY: exact has len readable bytes.
            let w = unsafe { load_words(exact.as_ptr(), len) };
            let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(&bytes[..len], &src[..len], "length {len}");
            assert!(bytes[len..].iter().all(|&b| b == 0), "length {len}: bytes past the end");
        }
        // SAFETY: length 0 reads nothing, even from null.
        assert_eq!(unsafe { load_words(std::ptr::null(), 0) }, [0; 3]);
    }

    #[test]
    fn short_keeps_every_split() {
        let src: Vec<u8> = (1..=SHORT_MAX as u8).collect();
        let other: Vec<u8> = (101..=100 + SHORT_MAX as u8).collect();
        for total in 0..=SHORT_MAX {
            for hlen in 0..=total {
                let len = total - hlen;
                // Sources of exactly their length, so that a read past one shows under
                // valgrind.
                let (h, d): (Box<[u8]>, Box<[u8]>) = (src[..hlen].into(), other[..len].into());
                // SAFETY: h and d have hlen and len readable bytes.
                let s = unsafe { Short::new(h.as_ptr(), hlen, d.as_ptr(), len) };
                assert_eq!(s.header(), &src[..hlen], "header {hlen}, payload {len}");
                assert_eq!(s.data(), &other[..len], "header {hlen}, payload {len}");
                assert_eq!((s.header_len(), s.len()), (hlen, len));
                assert!(s.bytes()[total..SHORT_MAX].iter().all(|&b| b == 0), "bytes past the end");
            }
        }
        // SAFETY: lengths 0 read nothing, even from null.
        let e = unsafe { Short::new(std::ptr::null(), 0, std::ptr::null(), 0) };
        assert!(e.header().is_empty() && e.data().is_empty());
    }

    #[test]
    fn shift_up_moves_every_byte() {
        let w = [0x0807_0605_0403_0201u64, 0x100f_0e0d_0c0b_0a09, 0x1817_1615_1413_1211];
        let as_bytes = |w: [u64; 3]| -> Vec<u8> { w.iter().flat_map(|x| x.to_le_bytes()).collect() };
        for k in 0..24 {
            let mut want = vec![0u8; k];
            want.extend_from_slice(&as_bytes(w)[..24 - k]);
            assert_eq!(as_bytes(shift_up(w, 8 * k as u32)), want, "shift by {k} bytes");
        }
    }
}
