//! Ordered byte streams per endpoint (`ucp_stream_send_nbx`, `ucp_stream_recv_nbx`), and
//! [`UcxStream`], a `tokio::io::AsyncRead + AsyncWrite` adapter over one endpoint's
//! stream, so that tokio code (codecs, framed protocols, `tokio::io::copy`) runs over
//! UCX unchanged.
//!
//! A stream carries bytes, not messages: one send may arrive in several receives and
//! several sends in one. Bytes from one endpoint arrive in the order they were sent. The
//! wire format is UCX's own, so the raw calls interoperate with any UCX program using
//! streams.
//!
//! # End of stream
//! UCX streams have no end. ucxkit adds one for ucxkit peers: [`Endpoint::stream_shutdown`]
//! (called by [`UcxStream`]'s `poll_shutdown`) tells the peer, over the handshake's
//! control channel, how many bytes were written in all; the peer's reader reports end of
//! stream once it has received all of them. It needs the connection handshake (a peer
//! reached without it is not known to understand the notice).
//!
//! # Closing
//! What a ucxkit peer wrote before it closed (or dropped) its endpoint is not lost when
//! this side has not read it yet: the close goes through the peer (see
//! [`Endpoint::close`]), which moves the unread bytes out of UCX before the disconnect
//! would discard them. Reads return them after the close, then the end of stream if the
//! peer shut its stream down, [`Error::ConnectionReset`] otherwise.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::Endpoint;
use crate::error::{Error, ErrorKind, Result};
use crate::handshake::Kind;
use crate::op::{OpState, RecvOp, SendOp};
use crate::slot::OpKind;
use crate::worker::param::{param, Callback};
use crate::worker::request::{stream_recv_cb, Completion, Posted};
use crate::worker::{Leave, List, Place, State};

/// Future of [`Endpoint::stream_send`]: resolves to `(Result<()>, buffer)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer is kept until UCX has finished with it,
/// and the bytes are still sent.
pub type StreamSend<B> = SendOp<B>;

/// Future of [`Endpoint::stream_recv`] and [`Endpoint::stream_recv_exact`]: resolves to
/// `(Result<usize>, buffer)` with the number of bytes received; the buffer's length is
/// set to it. `Ok(0)` means end of stream.
///
/// # Cancel safety
/// Memory-safe to drop at any time, but **not** lossless: UCX cannot cancel a stream
/// receive, so the buffer stays with the worker and whatever bytes UCX puts there are
/// discarded. To read without losing bytes across cancellation, use [`UcxStream`], which
/// keeps its pending receive between reads.
pub type StreamRecv<B> = RecvOp<B>;

/// Bytes received on an endpoint's stream, still in UCX's receive buffer: read through
/// `Deref<Target = [u8]>` without a copy, and given back to UCX
/// (`ucp_stream_data_release`) when dropped. From [`Endpoint::stream_recv_data`].
///
/// Holding one keeps its endpoint from closing: [`Endpoint::close`] (or a failure) then
/// finishes the close once every piece is dropped. (Bytes that ucxkit took out of UCX
/// when the peer closed come as one piece of its own memory instead.)
pub struct StreamData {
    ep: Endpoint,
    /// UCX's endpoint handle, or NULL for a piece of ucxkit's own memory (`kept`).
    handle: sys::ucp_ep_h,
    data: *mut u8,
    len: usize,
    kept: Vec<u8>,
}

// SAFETY: the bytes are UCX's receive buffer, owned by this value until it is released,
// which happens under the worker lock (any thread may hold it); reading them needs no
// lock (UCX does not touch data handed out until it is released).
unsafe impl Send for StreamData {}
// SAFETY: as above; `&StreamData` only reads the bytes.
unsafe impl Sync for StreamData {}

impl std::ops::Deref for StreamData {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        if self.handle.is_null() {
            return &self.kept;
        }
        // SAFETY: UCX handed out `len` readable bytes at `data`, valid until released in
        // drop.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl std::fmt::Debug for StreamData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamData").field("len", &self.len()).finish()
    }
}

impl Drop for StreamData {
    fn drop(&mut self) {
        let (id, h, data) = (self.ep.inner.id, self.handle, self.data);
        if h.is_null() {
            return;
        }
        // SAFETY: handle and data come from one ucp_stream_recv_data_nb on this endpoint
        // and are released once, here, under the lock.
        self.ep.worker_inner().locked(|st| unsafe { st.release_stream_data(id, h, data.cast()) });
    }
}

impl Endpoint {
    /// Takes the bytes UCX has already received on this endpoint's stream, as much as one
    /// receive buffer holds, without copying them (`ucp_stream_recv_data_nb`); waits if
    /// none has arrived. Resolves to `Ok(None)` once the peer has ended its stream and
    /// everything it wrote was received.
    ///
    /// The fastest way to consume a stream: nothing is copied, and no receive buffer
    /// needs to be posted in advance. Drop the [`StreamData`] promptly: UCX's buffer is
    /// held until then.
    ///
    /// # Errors
    /// [`Error::ConnectionReset`] when the endpoint failed, [`Error::ApiMisuse`] when it
    /// was closed.
    ///
    /// # Cancel safety
    /// Cancel-safe: bytes are taken off the stream only when this resolves.
    pub async fn stream_recv_data(&self) -> Result<Option<StreamData>> {
        let id = self.inner.id;
        let inner = self.worker_inner();
        let leave = Leave::new(inner, id, List::Stream);
        std::future::poll_fn(|cx| {
            inner.poll_until(
                cx,
                |st| {
                    // (Not after this side's own close: using it is misuse then.)
                    let open = st.eps.get_mut(&id).filter(|e| !e.closing);
                    if let Some(e) = open.filter(|e| !e.kept().is_empty()) {
                        // Bytes taken in when the peer closed come first.
                        let kept = e.take_kept();
                        st.after.wake_waiters(&mut e.stream_waiters);
                        return Some(Ok(Some(StreamData {
                            ep: self.clone(),
                            handle: std::ptr::null_mut(),
                            data: std::ptr::null_mut(),
                            len: kept.len(),
                            kept,
                        })));
                    }
                    if st.eps.get(&id).is_some_and(|e| !e.closing && e.stream_ended()) {
                        return Some(Ok(None));
                    }
                    let h = match self.live_handle(st, "stream_recv_data") {
                        Ok(h) => h,
                        Err(e) => return Some(Err(e)),
                    };
                    let mut len = 0usize;
                    // SAFETY: h is live under the lock; len is a valid out-pointer.
                    let p = unsafe { sys::ucp_stream_recv_data_nb(h, &mut len) };
                    if sys::UCS_PTR_IS_ERR(p) {
                        return Some(Err(
                            self.error_of("stream_recv_data", crate::error::Status(sys::UCS_PTR_STATUS(p)))
                        ));
                    }
                    if !p.is_null() {
                        st.stream_received(id, len);
                        if let Some(e) = st.eps.get_mut(&id) {
                            e.data_out += 1;
                        }
                        return Some(Ok(Some(StreamData {
                            ep: self.clone(),
                            handle: h,
                            data: p.cast(),
                            len,
                            kept: Vec::new(),
                        })));
                    }
                    None
                },
                |st, waker| {
                    // Woken by any progress that handled events, and by the endpoint's
                    // failure or end of stream.
                    st.add_probe_waiter(waker);
                    leave.register(st, waker);
                },
            )
        })
        .await
    }

    /// Sends the bytes of `buf` on this endpoint's stream (`ucp_stream_send_nbx`). They
    /// are posted before this returns, so sends are ordered by call; await the future to
    /// learn when the buffer is free again. An empty buffer completes at once without
    /// reaching UCX (an empty stream message made UCX 1.13 abort the receiving process).
    ///
    /// # Cancel safety
    /// Dropping the returned future is memory-safe at any time; the bytes are still sent.
    #[inline]
    pub fn stream_send<B: IoBuf>(&self, buf: B) -> StreamSend<B> {
        if let Err(e) = crate::device::host_only("stream_send", buf.memory_type()) {
            return SendOp::failed(self, "stream_send", Box::new(e), buf);
        }
        let id = self.inner.id;
        SendOp::post(
            self,
            "stream_send",
            buf,
            || None,
            |st, h, ptr, len, param| {
                if len == 0 {
                    // Nothing to send: done (UCS_OK), and never an empty message on the
                    // wire, which UCX 1.13's receiving side asserts on.
                    return std::ptr::null_mut();
                }
                // SAFETY: h is live under the lock; the buffer stays valid and unmoved until
                // the request completes (IoBuf contract; parked on drop).
                let p = unsafe { sys::ucp_stream_send_nbx(h, ptr.cast(), len, param) };
                // Count what was accepted: the peer's end of stream waits for these bytes.
                if !sys::UCS_PTR_IS_ERR(p) {
                    if let Some(e) = st.eps.get_mut(&id) {
                        e.stream_tx += len as u64;
                    }
                }
                p
            },
        )
    }

    /// Receives at least one byte and at most the buffer's capacity from this endpoint's
    /// stream. Resolves to `Ok(0)` once the peer has ended its stream (see the module
    /// docs) and everything it wrote was received.
    ///
    /// A receive still pending when the peer ends its stream completes only when the
    /// endpoint closes or fails; check [`Endpoint::stream_ended`], or use [`UcxStream`],
    /// which reports end of stream on its own.
    ///
    /// # Cancel safety
    /// See [`StreamRecv`]: dropping is memory-safe, but bytes that land in the dropped
    /// receive are lost.
    #[inline]
    pub fn stream_recv<B: IoBufMut>(&self, buf: B) -> StreamRecv<B> {
        self.post_stream_recv(buf, false)
    }

    /// Receives exactly the buffer's capacity (`UCP_STREAM_RECV_FLAG_WAITALL`).
    ///
    /// After the peer closed, bytes it sent that this side had not read yet are served
    /// first; asking for more than is left fails with [`Error::ConnectionReset`] and
    /// takes none of them. An exact receive still pending when the peer closes (or the
    /// endpoint fails) fails the same way; the bytes it had gathered stay at the start of
    /// the returned buffer, whose length says how many (`Vec`, `BytesMut`; a boxed slice
    /// has no length to set: read a stream to its end with [`Endpoint::stream_recv`] or
    /// [`UcxStream`] instead). The exception is a peer process on this host, without peer
    /// error handling, that died: ucxkit ends the receive itself then, UCX not knowing,
    /// and cannot tell how many bytes had landed.
    ///
    /// # Cancel safety
    /// As for [`Endpoint::stream_recv`].
    #[inline]
    pub fn stream_recv_exact<B: IoBufMut>(&self, buf: B) -> StreamRecv<B> {
        self.post_stream_recv(buf, true)
    }

    #[inline]
    fn post_stream_recv<B: IoBufMut>(&self, mut buf: B, wait_all: bool) -> StreamRecv<B> {
        if let Err(e) = crate::device::host_only("stream_recv", buf.memory_type()) {
            return RecvOp::posted(self, "stream_recv", None, OpState::Failed(Box::new(e), buf), None);
        }
        let capacity = buf.bytes_total();
        let ptr = buf.stable_mut_ptr();
        let id = self.inner.id;
        let posted = self.worker_inner().locked(|st| {
            // (Not after this side's own close: using it is misuse then.)
            if let Some(e) = st.eps.get_mut(&id).filter(|e| !e.closing) {
                if !e.kept().is_empty() {
                    // Bytes taken in when the peer closed come first (nothing else can
                    // arrive after them).
                    let n = e.kept().len().min(capacity);
                    if wait_all && n < capacity {
                        return Err(Box::new(Error::ConnectionReset {
                            op: "stream_recv_exact",
                            peer: self.inner.peer.clone(),
                            source: crate::error::Status::CONNECTION_RESET,
                        }));
                    }
                    // SAFETY: the buffer is valid for `capacity` >= n bytes and not
                    // aliased (owned by this call).
                    unsafe { std::ptr::copy_nonoverlapping(e.kept().as_ptr(), ptr, n) };
                    e.consume_kept(n);
                    if e.stream_ended() {
                        st.after.wake_waiters(&mut e.stream_waiters);
                    }
                    return Ok(Posted::Done(Completion::ok(n)));
                }
                if capacity == 0 || e.stream_ended() {
                    return Ok(Posted::Done(Completion::OK));
                }
            }
            let h = self.live_handle(st, "stream_recv").map_err(Box::new)?;
            let mut length = 0usize;
            let param = stream_param(st, wait_all);
            // SAFETY: h is live under the lock; the buffer is valid for `capacity` bytes
            // and owned by the returned future until UCX completes (parked on drop).
            let p = unsafe { sys::ucp_stream_recv_nbx(h, ptr.cast(), capacity, &mut length, &param) };
            let posted = Posted::from_ptr(p, Completion::ok(length), false);
            match &posted {
                Posted::Done(c) if c.status().is_ok() => st.stream_received(id, length),
                Posted::Pending(r) => r.bind(st, id, OpKind::StreamRecv),
                Posted::Done(_) => {}
            }
            Ok(posted)
        });
        if matches!(posted, Ok(Posted::Pending(_))) {
            self.worker_inner().posted();
        }
        RecvOp::posted(self, "stream_recv", None, OpState::from_posted(posted, buf), None)
    }

    /// Tells the peer that this side's stream ends after the bytes sent so far, so that
    /// its reader reports end of stream once it has them all. Sending more afterwards
    /// is allowed by UCX but the peer may already have reported the end.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for an endpoint made without the connection handshake (the
    /// peer may be a plain UCX program); [`Error::ConnectionReset`] or
    /// [`Error::ApiMisuse`] when the endpoint failed or was closed.
    pub fn stream_shutdown(&self) -> Result<()> {
        if self.peer_identity().is_none() {
            return Err(Error::Unsupported {
                what: format!(
                    "stream end notice to {}: the endpoint was made without the handshake",
                    self.peer()
                ),
            });
        }
        let id = self.inner.id;
        // The nonce carries the total bytes written.
        self.send_notice("stream_shutdown", Kind::StreamEnd, |st| st.eps.get(&id).map_or(0, |e| e.stream_tx))
    }

    /// Whether the peer has ended its stream and every byte it wrote has been received
    /// and read.
    pub fn stream_ended(&self) -> bool {
        let id = self.inner.id;
        self.worker_inner().locked(|st| st.eps.get(&id).is_some_and(|e| e.stream_ended()))
    }

    /// Whether the peer's stream ended; if not, the task is woken when it does (or when
    /// the endpoint fails).
    /// The waker is registered at `place` (in this endpoint's stream waiters).
    fn poll_stream_end(&self, place: &Place, cx: &mut Context<'_>) -> bool {
        let id = self.inner.id;
        self.worker_inner().locked(|st| match st.eps.get(&id) {
            Some(e) if e.stream_ended() => true,
            Some(_) => {
                place.register(st, cx.waker());
                false
            }
            None => false,
        })
    }
}

fn stream_param(st: &mut State, wait_all: bool) -> sys::ucp_request_param_t {
    let flags = if wait_all { sys::UCP_STREAM_RECV_FLAG_WAITALL.0 as u32 } else { 0 };
    param(st, Callback { recv_stream: Some(stream_recv_cb) }, 0, flags, None)
}

/// Receive chunk of a [`UcxStream`] unless set otherwise.
const READ_CHUNK: usize = 256 * 1024;
/// Most bytes a [`UcxStream`] keeps in flight in sends before `poll_write` waits.
const WRITE_WINDOW: usize = 8 * 1024 * 1024;
/// Largest single send a [`UcxStream`] makes from one `poll_write`.
const WRITE_CHUNK: usize = 1024 * 1024;

/// A `tokio::io::AsyncRead + AsyncWrite` over one endpoint's stream.
///
/// Reads keep one stream receive posted into an internal buffer and copy out of it, so a
/// dropped read future loses nothing: the next read continues where the receive left
/// off. Writes copy the caller's bytes into owned buffers and keep up to 8 MiB in
/// flight; `poll_flush` waits until UCX has completed them all; `poll_shutdown` flushes
/// and sends the end-of-stream notice (see the module docs), after which the peer's
/// reads return 0 once they have every byte.
///
/// Split it with `tokio::io::split` to read and write from different tasks.
pub struct UcxStream {
    ep: Endpoint,
    read_chunk: usize,
    /// Received bytes not yet handed out, from `pos`.
    rbuf: Vec<u8>,
    pos: usize,
    pending: Option<StreamRecv<Vec<u8>>>,
    eof: bool,
    sends: VecDeque<(usize, StreamSend<Vec<u8>>)>,
    in_flight: usize,
    spare: Vec<Vec<u8>>,
    shut: bool,
    /// This adapter's place in the endpoint's stream waiters (while a read waits for
    /// the end of the stream).
    end: Place,
}

impl UcxStream {
    /// An adapter over `ep`'s stream.
    pub fn new(ep: Endpoint) -> UcxStream {
        UcxStream {
            end: Place::new(ep.inner.id, List::Stream),
            ep,
            read_chunk: READ_CHUNK,
            rbuf: Vec::new(),
            pos: 0,
            pending: None,
            eof: false,
            sends: VecDeque::new(),
            in_flight: 0,
            spare: Vec::new(),
            shut: false,
        }
    }

    /// Sets the size of the internal receive buffer (default 256 KiB; at least 1).
    pub fn with_read_chunk(mut self, bytes: usize) -> UcxStream {
        self.read_chunk = bytes.max(1);
        self
    }

    /// The endpoint underneath.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// Completes finished sends at the front; `Ready` when none is left in flight.
    fn poll_sends(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((n, send)) = self.sends.front_mut() {
            let n = *n;
            match Pin::new(send).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready((r, mut buf)) => {
                    self.sends.pop_front();
                    self.in_flight -= n;
                    r?;
                    if self.spare.len() < 4 {
                        buf.clear();
                        self.spare.push(buf);
                    }
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for UcxStream {
    fn drop(&mut self) {
        self.end.leave(self.ep.worker_inner());
    }
}

impl std::fmt::Debug for UcxStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxStream")
            .field("ep", &self.ep)
            .field("buffered", &(self.rbuf.len() - self.pos))
            .field("in_flight", &self.in_flight)
            .field("eof", &self.eof)
            .finish()
    }
}

impl AsyncRead for UcxStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Set once the peer's end was seen while the receive was pending: it is polled
        // once more (it may have completed with the last bytes in between) before it is
        // given up.
        let mut end_seen = false;
        loop {
            if this.pos < this.rbuf.len() {
                let n = out.remaining().min(this.rbuf.len() - this.pos);
                out.put_slice(&this.rbuf[this.pos..this.pos + n]);
                this.pos += n;
                return Poll::Ready(Ok(()));
            }
            if this.eof || out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            match this.pending.as_mut() {
                None => {
                    let mut buf = std::mem::take(&mut this.rbuf);
                    buf.clear();
                    buf.reserve_exact(this.read_chunk);
                    this.pos = 0;
                    this.pending = Some(this.ep.stream_recv(buf));
                }
                Some(recv) => match Pin::new(recv).poll(cx) {
                    Poll::Ready((r, buf)) => {
                        this.pending = None;
                        end_seen = false;
                        this.rbuf = buf;
                        this.pos = 0;
                        match r {
                            Ok(0) => this.eof = true,
                            Ok(_) => {}
                            // The peer ended its stream and closed: the receive failed
                            // with the close, every byte having arrived before.
                            Err(e)
                                if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::Canceled)
                                    && this.ep.stream_ended() =>
                            {
                                this.eof = true
                            }
                            Err(e) => return Poll::Ready(Err(e.into())),
                        }
                    }
                    Poll::Pending if !end_seen => {
                        if !this.ep.poll_stream_end(&this.end, cx) {
                            return Poll::Pending;
                        }
                        end_seen = true;
                    }
                    Poll::Pending => {
                        // The peer's stream ended and every byte arrived, so the pending
                        // receive can only complete when the endpoint closes: leave it
                        // with the worker (its buffer parked) and report the end.
                        this.pending = None;
                        this.eof = true;
                    }
                },
            }
        }
    }
}

impl AsyncWrite for UcxStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.shut {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "write after shutdown")));
        }
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Reap what finished; wait only when the window is full.
        if let Poll::Ready(Err(e)) = this.poll_sends(cx) {
            return Poll::Ready(Err(e));
        }
        if this.in_flight >= WRITE_WINDOW {
            return Poll::Pending;
        }
        let n = data.len().min(WRITE_CHUNK).min(WRITE_WINDOW - this.in_flight);
        let mut buf = this.spare.pop().unwrap_or_default();
        buf.extend_from_slice(&data[..n]);
        let send = this.ep.stream_send(buf);
        this.in_flight += n;
        this.sends.push_back((n, send));
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_sends(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.shut {
            return Poll::Ready(Ok(()));
        }
        match this.poll_sends(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        this.ep.stream_shutdown()?;
        this.shut = true;
        Poll::Ready(Ok(()))
    }
}
