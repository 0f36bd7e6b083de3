//! What UCX hands an active-message callback, kept as a message: short ones inline,
//! longer ones in one allocation, rendezvous and held eager payloads by UCX descriptor;
//! and the callback that routes each to its receiver or handler.

use super::*;

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
pub(super) unsafe fn load_words(src: *const u8, len: usize) -> [u64; 3] {
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
    pub(super) words: [u64; 2],
    pub(super) last: NonZeroU64,
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
    pub(super) unsafe fn new(header: *const u8, header_len: usize, data: *const u8, len: usize) -> Short {
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

    pub(super) fn header_len(&self) -> usize {
        (u64::from_le(self.last.get()) >> 48) as usize & 0xff
    }

    pub(super) fn len(&self) -> usize {
        (u64::from_le(self.last.get()) >> 56) as usize & 0x7f
    }

    pub(super) fn bytes(&self) -> &[u8; 24] {
        // SAFETY: `Short` is repr(C): two u64 and a non-zero u64, 24 initialized bytes
        // with no padding; u8 has no alignment to keep.
        unsafe { &*(self as *const Short).cast::<[u8; 24]>() }
    }

    pub(super) fn header(&self) -> &[u8] {
        &self.bytes()[..self.header_len()]
    }

    pub(super) fn data(&self) -> &[u8] {
        let h = self.header_len();
        &self.bytes()[h..h + self.len()]
    }
}

/// The 192-bit number `[w0, w1, w2]` (least significant word first) shifted up by `k`
/// bits (`k < 192`); bits shifted past the top are lost.
#[inline]
pub(super) fn shift_up([a, b, c]: [u64; 3], k: u32) -> [u64; 3] {
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
pub(super) enum Payload {
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
    pub(super) fn with_ucx(&self) -> bool {
        matches!(self, Payload::Held { .. } | Payload::Rndv { .. })
    }
}

/// What a [`Long`] message keeps beside its bytes.
pub(super) struct Meta {
    /// How many bytes follow the Meta in the allocation.
    pub(super) bytes_len: usize,
    pub(super) header_len: usize,
    pub(super) payload: Payload,
    /// The sender's endpoint as the callback found it, when the sender asked for replies
    /// and this worker has one; taken for `reply_ep` when the message is handed out.
    pub(super) reply: crate::worker::EndpointRef,
    /// Set when the message is handed out: the endpoint to reply on.
    pub(super) reply_ep: Option<Endpoint>,
    /// Set when the message is handed out, if UCX holds the payload: the worker that
    /// takes it back.
    pub(super) worker: Option<Worker>,
}

/// Any message that is not a [`Short`], in one allocation from UCX's callback to the
/// application, owned through one thin pointer (so that [`Incoming`] stays at three
/// words): its [`Meta`], then the header's bytes and, when the payload was copied out of
/// UCX's receive buffer, the payload's.
pub(crate) struct Long(NonNull<Meta>);

impl Long {
    /// The allocation of a message with `n` bytes after its Meta.
    pub(super) fn layout(n: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(std::mem::size_of::<Meta>() + n, std::mem::align_of::<Meta>())
            .expect("an active message fits in memory")
    }

    /// A message of `meta` (whose lengths it sets) and the bytes `header` then `data`.
    pub(super) fn new(mut meta: Meta, header: &[u8], data: &[u8]) -> Long {
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

    pub(super) fn meta(&self) -> &Meta {
        // SAFETY: the Meta was written by `new` and lives until `drop`.
        unsafe { self.0.as_ref() }
    }

    pub(super) fn meta_mut(&mut self) -> &mut Meta {
        // SAFETY: as above; `&mut self` is the only access.
        unsafe { self.0.as_mut() }
    }

    /// The header's bytes, then those of a copied payload.
    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: `new` wrote bytes_len bytes right after the Meta; they live until `drop`.
        unsafe {
            std::slice::from_raw_parts(
                self.0.as_ptr().cast::<u8>().add(std::mem::size_of::<Meta>()),
                self.meta().bytes_len,
            )
        }
    }

    pub(super) fn header(&self) -> &[u8] {
        &self.bytes()[..self.meta().header_len]
    }

    pub(super) fn len(&self) -> usize {
        match self.meta().payload {
            Payload::Copied => self.meta().bytes_len - self.meta().header_len,
            Payload::Held { len, .. } | Payload::Rndv { len, .. } => len,
            Payload::Gone => 0,
        }
    }

    /// The payload, when it came with the message (eager), read in place.
    pub(super) fn data(&self) -> Option<&[u8]> {
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
    pub(super) fn release(&mut self) {
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
    pub(super) state: *mut State,
    pub(super) queue: VecDeque<Incoming>,
    pub(super) waker: Option<Waker>,
    pub(super) handler: Option<Arc<HandlerCell>>,
    /// No receiver or handler any more: drop arrivals.
    pub(super) closed: bool,
}

/// A registered handler: its queue and the closure, run outside the worker lock.
pub(crate) struct HandlerCell {
    pub(super) id: u16,
    pub(super) worker: Worker,
    pub(super) queue: Mutex<VecDeque<Incoming>>,
    pub(super) f: Mutex<Box<dyn FnMut(AmMessage) + Send>>,
    pub(super) errors: Mutex<Vec<Error>>,
}

impl RunAfter for HandlerCell {
    fn run(&self) {
        HandlerCell::run(self)
    }
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

pub(super) fn panic_message(p: &(dyn Any + Send)) -> String {
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
pub(super) fn is_rndv(len: usize, param: &sys::ucp_am_recv_param_t) -> bool {
    len > 0 && param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0
}

/// Whether an arriving message travels as a [`Short`]: header and payload fit, and its
/// payload is not still at the sender nor does it carry the sender's endpoint.
#[inline(always)]
pub(super) fn is_short(header_len: usize, len: usize, param: &sys::ucp_am_recv_param_t) -> bool {
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
pub(super) unsafe fn incoming(
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
            .map_or_else(|| Weak::<()>::new() as crate::worker::EndpointRef, |e| e.endpoint.clone())
    } else {
        Weak::<()>::new()
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
    pub(super) unsafe fn receive(
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
            tables(st).dropped += 1;
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
    pub(super) fn deliver(&mut self, st: &mut State, inc: Incoming) {
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
    pub(super) fn enqueue(&mut self, st: &mut State, inc: Incoming) {
        self.queue.push_back(inc);
        if let Some(w) = self.waker.take() {
            st.after.wake(w);
        }
    }
}

/// UCX's active-message callback for every registered id; `arg` is the id's [`AmReg`].
pub(super) unsafe extern "C" fn am_cb(
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
