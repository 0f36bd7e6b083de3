//! Vectored operations: one tagged message sent from, or received into, several owned
//! buffers (UCX's iov datatype, `ucp_dt_make_iov`), and a put from several buffers to
//! consecutive remote addresses.
//!
//! On the wire a vectored tag message is an ordinary one: a peer may receive it into a
//! single buffer, and a single-buffer message may be received into several.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::{op_param, Endpoint};
use crate::error::{Error, Result, Status};
use crate::mem::RemoteKey;
use crate::op::{OpState, SendOp};
use crate::slot::OpKind;
use crate::tag::{Space, Tag, TagInfo};
use crate::worker::param::{param, Callback, NO_IMM};
use crate::worker::request::{tag_recv_cb, Completion, Posted};
use crate::worker::{State, Worker};

/// An iov array UCX reads while an operation is in flight.
struct IovArray(Box<[sys::ucp_dt_iov_t]>);

// SAFETY: the array only describes buffers owned by the same operation; it is read by
// UCX under the worker lock and never dereferenced by Rust.
unsafe impl Send for IovArray {}
// SAFETY: as above; `&IovArray` gives Rust code nothing to read or write through.
unsafe impl Sync for IovArray {}

impl IovArray {
    fn new(parts: impl Iterator<Item = (*mut u8, usize)>) -> IovArray {
        IovArray(parts.map(|(p, n)| sys::ucp_dt_iov_t { buffer: p.cast(), length: n }).collect())
    }
}

/// Future of [`Endpoint::tag_send_iov`]: resolves to `(Result<()>, buffers)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffers are kept until UCX has finished with
/// them, and the message may still be delivered.
pub type TagSendIov<B> = SendOp<Vec<B>>;

impl Endpoint {
    /// Sends one tagged message made of the bytes of `bufs`, in order, without copying
    /// them together first.
    ///
    /// # Cancel safety
    /// As for [`Endpoint::tag_send`].
    pub fn tag_send_iov<B: IoBuf>(&self, tag: Tag, bufs: Vec<B>) -> TagSendIov<B> {
        self.tag_send_iov_in(Space::app(self.worker_inner()), tag, bufs)
    }

    /// [`Endpoint::tag_send_iov`] with `tag` in `space`.
    pub(crate) fn tag_send_iov_in<B: IoBuf>(&self, space: Space, tag: Tag, bufs: Vec<B>) -> TagSendIov<B> {
        let Some(tag) = space.wire(tag) else {
            return SendOp::failed(self, "tag_send", Box::new(space.bad_tag(tag)), bufs);
        };
        let mem = match crate::device::op_memory_all(self.worker_inner(), "tag_send", &bufs) {
            Ok(m) => m,
            Err(e) => return SendOp::failed(self, "tag_send", e, bufs),
        };
        let iov = IovArray::new(bufs.iter().map(|b| (b.stable_ptr().cast_mut(), b.bytes_init())));
        let (ptr, count) = (iov.0.as_ptr().cast::<u8>(), iov.0.len());
        let posted = self.post_op("tag_send", false, |_, h, param| {
            crate::device::set(param, mem);
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE.0 as u32;
            param.datatype = sys::ucp_dt_make_iov();
            // SAFETY: h is live under the lock; ptr is an iov array of `count` entries
            // describing the buffers, all kept (with the array) until the request
            // completes, parked on drop.
            unsafe { sys::ucp_tag_send_nbx(h, ptr.cast(), count, tag, param) }
        });
        SendOp::wrap(self, "tag_send", posted, bufs, || Some(Arc::new(iov)))
    }

    /// Receives one tagged message matching `tag`/`mask`, scattered over `bufs` in order
    /// (each filled to its capacity before the next); bound to this endpoint as
    /// [`Endpoint::tag_recv`] is. On success each buffer's length is what landed in it.
    ///
    /// # Cancel safety
    /// As for [`Endpoint::tag_recv`].
    pub fn tag_recv_iov<B: IoBufMut>(&self, tag: Tag, mask: u64, bufs: Vec<B>) -> TagRecvIov<B> {
        post_recv_iov(
            self.worker().clone(),
            Some(self.clone()),
            Space::app(self.worker_inner()),
            tag,
            mask,
            bufs,
        )
    }

    /// Writes the bytes of `bufs`, one after another, to the peer's region starting at
    /// `offset` (one `ucp_put_nbx` per buffer, posted together); resolves when all may be
    /// reused.
    ///
    /// # Cancel safety
    /// Memory-safe to drop at any time: the buffers and the key are kept until UCX is
    /// done with every part.
    pub fn put_iov<B: IoBuf>(&self, bufs: Vec<B>, key: &RemoteKey, offset: u64) -> PutIov<B> {
        // Each length read once: the range checked is the range written.
        let parts: Vec<(*const u8, usize)> = bufs.iter().map(|b| (b.stable_ptr(), b.bytes_init())).collect();
        let total: u64 = parts.iter().map(|&(_, len)| len as u64).sum();
        let keep: Shared<B> = Arc::new(Mutex::new(None));
        let fail = |e, bufs| PutIov {
            ep: self.clone(),
            parts: Vec::new(),
            keep: keep.clone(),
            failed: Some((e, bufs)),
            status: Status::OK,
        };
        let remote = match key.target(self, "put", offset, total, 1) {
            Ok(a) => a,
            Err(e) => return fail(*e, bufs),
        };
        let mem = match crate::device::op_memory_all(self.worker_inner(), "put", &bufs) {
            Ok(m) => m,
            Err(e) => return fail(*e, bufs),
        };
        let rkey = key.inner.rkey;
        let no_imm = self.worker_inner().no_imm;
        let id = self.inner.id;
        let posted = self.with_handle("put", |st, h| {
            let mut out: Vec<Posted> = Vec::with_capacity(parts.len());
            let mut at = remote;
            for &(ptr, len) in &parts {
                let mut param = op_param(st, no_imm);
                crate::device::set(&mut param, mem);
                // SAFETY: h is live under the lock; each buffer and the rkey are kept until
                // every part completes (parked on drop); the whole range was checked.
                let p = unsafe { sys::ucp_put_nbx(h, ptr.cast(), len, at, rkey, &param) };
                let posted = Posted::from_ptr(p, Completion::OK, false);
                if let Posted::Pending(r) = &posted {
                    r.bind(st, id, OpKind::Finish);
                }
                out.push(posted);
                at += len as u64;
            }
            Ok(out)
        });
        let posted = match posted {
            Ok(p) => p,
            Err(e) => return fail(e, bufs),
        };
        if posted.iter().any(|p| matches!(p, Posted::Pending(_))) {
            self.worker_inner().posted();
        }
        *keep.lock().unwrap_or_else(PoisonError::into_inner) = Some((bufs, key.keep()));
        let parts = posted.into_iter().map(|p| OpState::from_posted(Ok(p), ())).collect();
        PutIov { ep: self.clone(), parts, keep, failed: None, status: Status::OK }
    }
}

impl Worker {
    /// Receives one tagged message from any peer, scattered over `bufs` (see
    /// [`Endpoint::tag_recv_iov`]).
    ///
    /// # Cancel safety
    /// As for [`Endpoint::tag_recv`].
    pub fn tag_recv_iov<B: IoBufMut>(&self, tag: Tag, mask: u64, bufs: Vec<B>) -> TagRecvIov<B> {
        post_recv_iov(self.clone(), None, Space::app(&self.shared.inner), tag, mask, bufs)
    }
}

pub(crate) fn post_recv_iov<B: IoBufMut>(
    worker: Worker,
    ep: Option<Endpoint>,
    space: Space,
    tag: Tag,
    mask: u64,
    mut bufs: Vec<B>,
) -> TagRecvIov<B> {
    let iov = IovArray::new(bufs.iter_mut().map(|b| (b.stable_mut_ptr(), b.bytes_total())));
    let capacity: usize = iov.0.iter().map(|e| e.length).sum();
    let (tag, mask) = match space.wire_recv(tag, mask) {
        Ok(w) => w,
        Err(e) => return TagRecvIov { worker, ep, space, capacity, state: OpState::Failed(e, (bufs, iov)) },
    };
    let inner = &worker.shared.inner;
    let mem = match crate::device::op_memory_all(inner, "tag_recv", &bufs) {
        Ok(m) => m,
        Err(e) => return TagRecvIov { worker, ep, space, capacity, state: OpState::Failed(e, (bufs, iov)) },
    };
    let (ptr, count) = (iov.0.as_ptr(), iov.0.len());
    let posted = inner.locked(|st| {
        let mut param = recv_iov_param(st);
        crate::device::set(&mut param, mem);
        // SAFETY: ptr is an iov array of `count` entries describing the buffers, all kept
        // (with the array) until UCX completes the request, parked on drop.
        unsafe {
            crate::tag::post_tag_recv(inner, st, ep.as_ref(), ptr.cast_mut().cast(), count, tag, mask, &param)
        }
    });
    if matches!(posted, Ok(Posted::Pending(_))) {
        inner.posted();
    }
    TagRecvIov { worker, ep, space, capacity, state: OpState::from_posted(posted, (bufs, iov)) }
}

fn recv_iov_param(st: &mut State) -> sys::ucp_request_param_t {
    param(st, Callback { recv: Some(tag_recv_cb) }, NO_IMM, 0, Some(sys::ucp_dt_make_iov()))
}

/// Future of [`Endpoint::tag_recv_iov`] and [`Worker::tag_recv_iov`]: resolves to
/// `(Result<TagInfo>, buffers)`.
///
/// # Cancel safety
/// As for [`crate::TagRecv`].
#[must_use = "a receive future does nothing unless awaited"]
pub struct TagRecvIov<B: IoBufMut> {
    worker: Worker,
    ep: Option<Endpoint>,
    /// The tag space the receive was posted in: sender tags are reported local to it.
    space: Space,
    capacity: usize,
    state: OpState<(Vec<B>, IovArray)>,
}

impl<B: IoBufMut> Unpin for TagRecvIov<B> {}

impl<B: IoBufMut> Future for TagRecvIov<B> {
    type Output = (Result<TagInfo>, Vec<B>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let (c, mut bufs) = match this.state.poll(Some(&this.worker.shared), cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err((e, (b, _)))) => return Poll::Ready((Err(*e), b)),
            Poll::Ready(Ok((c, (b, _)))) => (c, b),
        };
        let c = Completion::new(c.status(), c.len, this.space.local(c.sender_tag));
        if c.status().is_ok() {
            let mut left = c.len;
            for b in &mut bufs {
                let n = left.min(b.bytes_total());
                // SAFETY: UCX filled the buffers in order, each to capacity before the
                // next, c.len bytes in all.
                unsafe { b.set_init(n) };
                left -= n;
            }
            return Poll::Ready((Ok(TagInfo { sender_tag: c.sender_tag, len: c.len }), bufs));
        }
        Poll::Ready((Err(crate::tag::recv_failure(c, this.capacity, this.ep.as_ref())), bufs))
    }
}

impl<B: IoBufMut> Drop for TagRecvIov<B> {
    fn drop(&mut self) {
        self.state.park(Some(&self.worker.shared), None);
    }
}

/// The buffers of a [`PutIov`] and its key, shared by its pending parts.
type Shared<B> = Arc<Mutex<Option<(Vec<B>, crate::op::Extra)>>>;

/// Future of [`Endpoint::put_iov`]: resolves to `(Result<()>, buffers)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: every part still pending keeps the buffers and the
/// key alive until UCX completes it.
#[must_use = "the puts are already posted; await the future to learn whether they succeeded"]
pub struct PutIov<B: IoBuf> {
    ep: Endpoint,
    parts: Vec<OpState<()>>,
    /// The buffers and the key, shared by every pending part until all are done.
    keep: Shared<B>,
    failed: Option<(Error, Vec<B>)>,
    /// The first failure among the parts, kept across polls.
    status: Status,
}

impl<B: IoBuf> Unpin for PutIov<B> {}

impl<B: IoBuf> Future for PutIov<B> {
    type Output = (Result<()>, Vec<B>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some((e, b)) = this.failed.take() {
            return Poll::Ready((Err(e), b));
        }
        let mut pending = false;
        for part in &mut this.parts {
            if matches!(part, OpState::Finished) {
                continue;
            }
            match part.poll(Some(&this.ep.worker().shared), cx) {
                Poll::Pending => pending = true,
                Poll::Ready(Ok((c, ()))) if !c.status().is_ok() && this.status.is_ok() => {
                    this.status = c.status()
                }
                Poll::Ready(_) => {}
            }
        }
        if pending {
            return Poll::Pending;
        }
        this.parts.clear();
        let Some((bufs, _key)) = this.keep.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            panic!("PutIov polled after completion");
        };
        let r = if this.status.is_ok() { Ok(()) } else { Err(this.ep.error_of("put", this.status)) };
        Poll::Ready((r, bufs))
    }
}

impl<B: IoBuf> Drop for PutIov<B> {
    fn drop(&mut self) {
        let worker = &self.ep.worker().shared;
        for part in &mut self.parts {
            if let OpState::Pending(..) = part {
                part.park(Some(worker), Some(self.keep.clone()));
            }
        }
    }
}
