//! One-sided operations on a peer's registered memory: [`Endpoint::put`],
//! [`Endpoint::get`], 64-bit atomics, and the ordering calls [`Endpoint::flush`] (on the
//! endpoint), [`Worker::flush`] and [`Worker::fence`].
//!
//! A put completes locally when its buffer may be reused, not when the data is in the
//! peer's memory: flush the endpoint (or the worker) for that. Every access is checked
//! against the bounds of the region the [`RemoteKey`] describes before it is posted.
//!
//! Over TCP, UCX emulates RMA with messages that the target worker handles in its own
//! progress, so the target must be progressing (any pending operation or the event
//! driver does that). Put over TCP is slow for large transfers on UCX 1.13; prefer get,
//! or rendezvous tag and active messages, for bulk data there.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::{op_param, Endpoint};
use crate::error::{Result, Status};
use crate::mem::RemoteKey;
use crate::op::{OpState, RecvOp, SendOp};
use crate::worker::request::{Completion, Posted};
use crate::worker::Worker;

/// Future of [`Endpoint::put`]: resolves to `(Result<()>, buffer)` once the buffer may be
/// reused.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer and the remote key are kept until UCX is
/// done with them, and the data may still be written.
pub type Put<B> = SendOp<B>;

/// A 64-bit atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AtomicKind {
    Add,
    Swap,
    CompareSwap,
}

impl Endpoint {
    /// Writes `data` into the peer's region at `offset` if UCX can finish reading `data`
    /// during this call, and does nothing otherwise (`ucp_put_nbx` with
    /// `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): `Ok(true)` when the put was done
    /// locally (`data` may be reused at once; as for any put, [`Endpoint::flush`] tells
    /// when it reached the peer), `Ok(false)` when UCX could not do it right away and
    /// posted nothing (the put is too long for UCX's short protocol, or the transport has
    /// no room just now): use [`Endpoint::put`] then. As for any put, order with other
    /// puts needs a fence ([`crate::Worker::fence`]). See [`Endpoint::try_tag_send`].
    ///
    /// # Errors
    /// [`crate::Error::OutOfBounds`] when the bytes do not fit the region;
    /// [`crate::Error::ApiMisuse`] for a key unpacked on another endpoint; otherwise as
    /// for [`Endpoint::try_tag_send`].
    #[inline]
    pub fn try_put(&self, data: &[u8], key: &RemoteKey, offset: u64) -> Result<bool> {
        let remote = key.target(self, "put", offset, data.len() as u64, 1).map_err(|e| *e)?;
        let rkey = key.inner.rkey;
        self.post_immediate("put", |h, param| {
            // SAFETY: h is live under the lock; data is valid for the call, and UCX is done
            // with it when the call returns (immediate completion only); the rkey is kept
            // by `key`, borrowed for the call; the remote range was checked.
            unsafe { sys::ucp_put_nbx(h, data.as_ptr().cast(), data.len(), remote, rkey, param) }
        })
    }

    /// Writes `buf` into the peer's region at `offset` (`ucp_put_nbx`).
    ///
    /// # Errors
    /// (in the future's result) [`crate::Error::OutOfBounds`] when the bytes do not fit
    /// the region; [`crate::Error::ApiMisuse`] for a key unpacked on another endpoint.
    ///
    /// # Cancel safety
    /// Dropping the future is memory-safe at any time; the data may still be written.
    #[inline]
    pub fn put<B: IoBuf>(&self, buf: B, key: &RemoteKey, offset: u64) -> Put<B> {
        let checked = buf.bytes_init();
        let remote = match key.target(self, "put", offset, checked as u64, 1) {
            Ok(a) => a,
            Err(e) => return SendOp::failed(self, "put", e, buf),
        };
        let rkey = key.inner.rkey;
        SendOp::post(
            self,
            "put",
            buf,
            || Some(key.keep()),
            |_, h, ptr, len, param| {
                // SAFETY: h is live under the lock; the buffer and the rkey stay valid until
                // the request completes (kept by the operation, parked on drop); the remote
                // range was checked against the key's region for `checked` bytes (a
                // buffer is not bound to report the same length twice).
                unsafe { sys::ucp_put_nbx(h, ptr.cast(), len.min(checked), remote, rkey, param) }
            },
        )
    }

    /// Reads `len` bytes of the peer's region at `offset` into `buf` (`ucp_get_nbx`);
    /// on success the buffer's length is `len`.
    ///
    /// # Errors
    /// (in the future's result) [`crate::Error::OutOfBounds`],
    /// [`crate::Error::ApiMisuse`] for a key from another endpoint or a buffer smaller
    /// than `len`.
    ///
    /// # Cancel safety
    /// Memory-safe to drop at any time: the buffer is kept until UCX finishes writing it.
    pub fn get<B: IoBufMut>(&self, mut buf: B, len: usize, key: &RemoteKey, offset: u64) -> Get<B> {
        // Refused: the future keeps the endpoint for the error only (`kept_handles`).
        let fail = |e, buf| RecvOp::posted(self, "get", Some(len), OpState::Failed(e, buf), None);
        if buf.bytes_total() < len {
            let e = crate::Error::ApiMisuse(format!(
                "get of {len} bytes into a {} byte buffer",
                buf.bytes_total()
            ));
            return fail(Box::new(e), buf);
        }
        let remote = match key.target(self, "get", offset, len as u64, 1) {
            Ok(a) => a,
            Err(e) => return fail(e, buf),
        };
        let mem = match crate::device::op_memory(self.worker_inner(), "get", &buf) {
            Ok(m) => m,
            Err(e) => return fail(e, buf),
        };
        let rkey = key.inner.rkey;
        let ptr = buf.stable_mut_ptr();
        let posted = self.post_op("get", false, |_, h, param| {
            crate::device::set(param, mem);
            // SAFETY: h is live under the lock; buf is valid for len bytes and kept, with
            // the rkey, until the request completes (parked on drop); the remote range
            // was checked.
            unsafe { sys::ucp_get_nbx(h, ptr.cast(), len, remote, rkey, param) }
        });
        let state = OpState::from_posted(posted, buf);
        // The remote key is needed only while the get may still be reading through it.
        let keep = (!state.completed_immediately()).then(|| key.keep());
        RecvOp::posted(self, "get", Some(len), state, keep)
    }

    /// Adds `value` to the 64-bit word at `offset` (`UCP_ATOMIC_OP_ADD`, no fetch).
    pub fn atomic_add(&self, key: &RemoteKey, offset: u64, value: u64) -> Atomic {
        self.atomic(AtomicKind::Add, key, offset, value, 0, false)
    }

    /// Adds `value` to the 64-bit word at `offset` and resolves to its previous value.
    pub fn atomic_fetch_add(&self, key: &RemoteKey, offset: u64, value: u64) -> Atomic {
        self.atomic(AtomicKind::Add, key, offset, value, 0, true)
    }

    /// Stores `value` in the 64-bit word at `offset` and resolves to its previous value.
    pub fn atomic_swap(&self, key: &RemoteKey, offset: u64, value: u64) -> Atomic {
        self.atomic(AtomicKind::Swap, key, offset, value, 0, true)
    }

    /// Stores `new` in the 64-bit word at `offset` if it equals `expected`; resolves to
    /// the previous value either way (equal to `expected` when the swap happened).
    pub fn atomic_compare_swap(&self, key: &RemoteKey, offset: u64, expected: u64, new: u64) -> Atomic {
        self.atomic(AtomicKind::CompareSwap, key, offset, expected, new, true)
    }

    fn atomic(&self, kind: AtomicKind, key: &RemoteKey, offset: u64, x: u64, z: u64, fetch: bool) -> Atomic {
        let op = match kind {
            AtomicKind::Add if fetch => "atomic_fetch_add",
            AtomicKind::Add => "atomic_add",
            AtomicKind::Swap => "atomic_swap",
            AtomicKind::CompareSwap => "atomic_compare_swap",
        };
        // [operand, reply]: both must stay put until the operation completes.
        let words = Words::new([x, z]);
        let remote = match key.target(self, op, offset, 8, 8) {
            Ok(a) => a,
            Err(e) => return Atomic { ep: self.clone(), op, state: OpState::Failed(e, words), key: None },
        };
        let rkey = key.inner.rkey;
        let opcode = match kind {
            AtomicKind::Add => sys::UCP_ATOMIC_OP_ADD,
            AtomicKind::Swap => sys::UCP_ATOMIC_OP_SWAP,
            AtomicKind::CompareSwap => sys::UCP_ATOMIC_OP_CSWAP,
        };
        let operand: *const u64 = words.0.cast::<u64>();
        // SAFETY: in bounds of the two-word allocation.
        let reply: *mut u64 = unsafe { words.0.cast::<u64>().add(1) };
        // Always through a request (`force_request`): UCX 1.13 reports a non-fetching
        // atomic complete at once while it may still sit in a pending queue using the key,
        // which the caller could then destroy.
        let posted = self.post_op(op, true, |_, h, param| {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE.0 as u32;
            param.datatype = sys::ucp_dt_make_contig(8);
            if fetch {
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_REPLY_BUFFER.0 as u32;
                param.reply_buffer = reply.cast();
            }
            // SAFETY: h is live under the lock; operand and reply point into a heap
            // allocation kept, with the rkey, until the request completes (parked on
            // drop); the remote word was checked for bounds and alignment.
            unsafe { sys::ucp_atomic_op_nbx(h, opcode, operand.cast(), 1, remote, rkey, param) }
        });
        Atomic { ep: self.clone(), op, state: OpState::from_posted(posted, words), key: Some(key.clone()) }
    }
}

impl Worker {
    /// Flushes every operation posted on this worker's endpoints
    /// (`ucp_worker_flush_nbx`): when this returns, puts and atomics are complete at
    /// their targets.
    ///
    /// # Cancel safety
    /// Safe to drop; the flush still happens.
    pub async fn flush(&self) -> Result<()> {
        let inner = &self.shared.inner;
        let posted = inner.locked(|st| {
            let param = op_param(st, inner.no_imm);
            // SAFETY: the worker is valid under the lock; the callback and user data are
            // ours.
            let p = unsafe { sys::ucp_worker_flush_nbx(st.handle, &param) };
            Posted::from_ptr(p, Completion::OK, false)
        });
        let c = crate::endpoint::wait_unbuffered(self, posted, None).await;
        c.status().check().map_err(|source| crate::Error::Worker { op: "flush", source })
    }

    /// Orders operations (`ucp_worker_fence`): those posted after this call take effect
    /// at their targets after those posted before it, without waiting for completion.
    pub fn fence(&self) -> Result<()> {
        self.shared.inner.locked(|st| {
            // SAFETY: the worker is valid under the lock.
            crate::Status(unsafe { sys::ucp_worker_fence(st.handle) })
                .check()
                .map_err(|source| crate::Error::Worker { op: "fence", source })
        })
    }
}

/// Future of [`Endpoint::get`]: resolves to `(Result<len>, buffer)`.
///
/// # Cancel safety
/// Memory-safe to drop at any time: the buffer and the key are kept until UCX finishes
/// writing the buffer.
pub type Get<B> = RecvOp<B>;

/// Future of the atomic operations: resolves to the word's previous value (0 for
/// [`Endpoint::atomic_add`], which does not fetch).
///
/// # Errors
/// [`crate::Error::OutOfBounds`] for a word outside the key's region or not 8-byte
/// aligned; [`crate::Error::ConnectionReset`] when the endpoint failed;
/// [`crate::Error::Unsupported`] when UCX has no protocol for remote atomics over the
/// endpoint's transports. That is the case over TCP in peer error mode from UCX 1.16 on
/// (its protocol selection leaves out the software emulation there; measured with 1.22),
/// and UCX then fails the endpoint too, sometimes before it cancels the atomic, which
/// then ends with `ConnectionReset`: use [`crate::ErrorMode::None`] for atomics over TCP
/// with those versions.
///
/// # Cancel safety
/// Memory-safe to drop at any time; the operation still takes effect.
#[must_use = "an atomic operation's result is only known when awaited"]
pub struct Atomic {
    ep: Endpoint,
    op: &'static str,
    state: OpState<Words>,
    key: Option<RemoteKey>,
}

/// An atomic's operand and reply words, in a heap allocation held by raw pointer (UCX
/// reads and writes it while the operation is in flight; moving the owner must not
/// assert unique access to it).
struct Words(*mut [u64; 2]);

// SAFETY: the words are only touched by UCX under the worker lock and read by the owner
// after completion.
unsafe impl Send for Words {}

impl Words {
    fn new(w: [u64; 2]) -> Words {
        Words(Box::into_raw(Box::new(w)))
    }

    /// The reply word, once UCX has completed the operation.
    fn reply(&self) -> u64 {
        // SAFETY: the allocation lives as long as self; UCX finished writing it.
        unsafe { (*self.0)[1] }
    }
}

impl Drop for Words {
    fn drop(&mut self) {
        // SAFETY: from Box::into_raw in `new`, freed once.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

impl Atomic {
    /// Whether UCX completed the operation during the call that posted it, or refused
    /// it; as for [`SendOp::completed_immediately`].
    pub fn completed_immediately(&self) -> bool {
        self.state.completed_immediately()
    }
}

impl Future for Atomic {
    type Output = Result<u64>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match this.state.poll(Some(&this.ep.worker().shared), cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err((e, _))) => Poll::Ready(Err(*e)),
            Poll::Ready(Ok((c, words))) => {
                this.key = None;
                if !c.status().is_ok() {
                    return Poll::Ready(Err(this.failure(c.status())));
                }
                Poll::Ready(Ok(words.reply()))
            }
        }
    }
}

impl Atomic {
    /// The error for an atomic that completed with a failed `status`. UCX cancels an
    /// atomic only when its endpoint is closed forcibly or when it finds no protocol for
    /// remote atomics over the endpoint's transports (UCX 1.16 and later over TCP in peer
    /// error mode, where it does not emulate them). In that case UCX fails the endpoint
    /// as well; if ucxkit has recorded that failure by the time this future is polled,
    /// the endpoint counts as closed forcibly and the atomic ends with `ConnectionReset`,
    /// as the type's documentation says.
    #[cold]
    #[inline(never)]
    fn failure(&self, status: Status) -> crate::Error {
        // ucxkit closes an endpoint forcibly exactly when it failed in peer mode.
        let closed_forcibly = self.ep.inner.peer_mode && self.ep.failure().is_some();
        if status == Status::CANCELED && !closed_forcibly {
            let over = match self.ep.transports() {
                Ok(t) if !t.is_empty() => format!(" over {}", t.join(",")),
                _ => String::new(),
            };
            return crate::Error::Unsupported {
                what: format!(
                    "{} on an endpoint{over}: UCX canceled it, having no protocol for remote atomics \
                     there (UCX 1.16 and later do not emulate them over TCP in peer error mode)",
                    self.op,
                ),
            };
        }
        self.ep.error_of(self.op, status)
    }
}

impl Drop for Atomic {
    fn drop(&mut self) {
        let key = self.key.take().map(|k| k.keep());
        self.state.park(Some(&self.ep.worker().shared), key);
    }
}
