//! [`AmMessage`]: one received active message, its header and payload, its reply
//! endpoint, and the fetch of its payload.

use super::*;

/// One received active message.
///
/// Dropping a message whose rendezvous payload was not fetched releases it (the sender's
/// send then completes); dropping one whose eager payload is still in UCX's receive
/// buffer gives that buffer back.
pub struct AmMessage {
    pub(super) id: u16,
    pub(super) body: Body,
}

/// What an [`AmMessage`] holds: the same as [`Incoming`], in a type of its own (with the
/// queued type reused here, the receive path measured 3–5 % slower).
pub(super) enum Body {
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
    pub(super) fn new(worker: &Worker, id: u16, inc: Incoming) -> AmMessage {
        let body = match inc {
            Incoming::Short(s) => Body::Short(s),
            Incoming::Long(mut long) => {
                let meta = long.meta_mut();
                if meta.payload.with_ucx() {
                    meta.worker = Some(worker.clone());
                }
                meta.reply_ep = Endpoint::from_ref(&std::mem::replace(&mut meta.reply, Weak::<()>::new()));
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
            // buf has room for `capacity >= len` bytes (checked above); data holds len
            // bytes (clipped all the same: what is reported is what was copied).
            let data = &data[..len.min(data.len())];
            let state = match crate::device::copy_in("am_recv_data", &mut buf, data) {
                Ok(()) => OpState::Done(Completion::ok(data.len()), buf),
                Err(e) => OpState::failed(e, buf),
            };
            RecvOp::new(None, reply, "am_recv_data", Some(len), state, None)
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
                let mem = match crate::device::op_memory(inner, "am_recv_data", &buf) {
                    Ok(m) => m,
                    Err(e) => {
                        // SAFETY: an unfetched rendezvous descriptor of this worker,
                        // released once; the lock is held.
                        inner.locked(|st| unsafe { sys::ucp_am_data_release(st.handle, desc) });
                        return RecvOp::new(
                            None,
                            reply,
                            "am_recv_data",
                            Some(len),
                            OpState::Failed(e, buf),
                            None,
                        );
                    }
                };
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
                    let mut param =
                        param(st, Callback { recv_am: Some(len_cb) }, no_imm_bit(no_imm), 0, None);
                    crate::device::set(&mut param, mem);
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
pub(super) fn release_data(worker: Option<&Worker>, desc: *mut c_void) {
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
