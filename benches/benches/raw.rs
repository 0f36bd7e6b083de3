//! Raw UCX operations for the benchmarks that time ucxkit against plain `ucp_*` calls on
//! the same worker: tag, stream and active-message sends and receives, remote keys and
//! RMA, with their request parameters, callbacks, and waits that progress the worker
//! until a request finishes. Each benchmark binary includes this module and uses part of
//! it.

#![allow(dead_code)]

use std::cell::Cell;
use std::ffi::c_void;

use ucx_sys as sys;

/// Tag receive callback: sets the `Cell<bool>` passed as user data.
unsafe extern "C" fn recv_cb(
    _req: *mut c_void,
    _status: sys::ucs_status_t,
    _info: *const sys::ucp_tag_recv_info_t,
    user: *mut c_void,
) {
    // SAFETY: user is the flag given to `recv_param`, which outlives the request.
    unsafe { (*user.cast::<Cell<bool>>()).set(true) };
}

/// Send callback: nothing to do, the sender polls the request's status.
pub(crate) unsafe extern "C" fn send_cb(_req: *mut c_void, _status: sys::ucs_status_t, _user: *mut c_void) {}

/// Parameters of a send whose completion is polled ([`wait`]).
pub(crate) fn send_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK.0,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { send: Some(send_cb) },
        ..Default::default()
    }
}

/// Parameters of a tag receive whose callback sets `done` ([`wait_recv`]).
fn recv_param(done: &Cell<bool>) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { recv: Some(recv_cb) },
        user_data: (done as *const Cell<bool>).cast_mut().cast(),
        ..Default::default()
    }
}

/// Posts an active message with `id`, no header and the `len` bytes at `buf` as payload
/// on `ep`, its completion polled with [`wait`].
///
/// # Safety
/// As for [`post_tag_send`].
pub(crate) unsafe fn post_am_send(
    ep: sys::ucp_ep_h,
    id: u16,
    buf: *const u8,
    len: usize,
) -> sys::ucs_status_ptr_t {
    // SAFETY: per contract.
    unsafe { sys::ucp_am_send_nbx(ep, id.into(), std::ptr::null(), 0, buf.cast(), len, &send_param()) }
}

/// Posts a send of the `len` bytes at `buf` on `ep`'s stream, its completion polled with
/// [`wait`].
///
/// # Safety
/// As for [`post_tag_send`].
pub(crate) unsafe fn post_stream_send(
    ep: sys::ucp_ep_h,
    buf: *const u8,
    len: usize,
) -> sys::ucs_status_ptr_t {
    // SAFETY: per contract.
    unsafe { sys::ucp_stream_send_nbx(ep, buf.cast(), len, &send_param()) }
}

/// Posts a send of `len` bytes at `buf` with `tag` on `ep`, its completion polled with
/// [`wait`].
///
/// # Safety
/// `ep` is live, nothing else uses its worker during the call, and `buf` stays valid for
/// `len` bytes until the send completes.
pub(crate) unsafe fn post_tag_send(
    ep: sys::ucp_ep_h,
    buf: *const u8,
    len: usize,
    tag: u64,
) -> sys::ucs_status_ptr_t {
    // SAFETY: per contract.
    unsafe { sys::ucp_tag_send_nbx(ep, buf.cast(), len, tag, &send_param()) }
}

/// Posts a receive of a message with exactly `tag` into `len` bytes at `buf`. With `done`,
/// its callback sets the flag ([`wait_recv`]); without, its completion is polled
/// ([`wait`]).
///
/// # Safety
/// `w` is live, nothing else uses it during the call, and `buf` (and `done`) stay valid
/// until the receive completes.
pub(crate) unsafe fn post_tag_recv(
    w: sys::ucp_worker_h,
    buf: *mut u8,
    len: usize,
    tag: u64,
    done: Option<&Cell<bool>>,
) -> sys::ucs_status_ptr_t {
    let param = done.map_or_else(sys::ucp_request_param_t::default, recv_param);
    // SAFETY: per contract.
    unsafe { sys::ucp_tag_recv_nbx(w, buf.cast(), len, tag, u64::MAX, &param) }
}

/// Receives a message with exactly `tag` into `buf`, progressing `w` until it arrives.
///
/// # Safety
/// `w` is live and nothing else uses it during the call.
pub(crate) unsafe fn tag_recv(w: sys::ucp_worker_h, buf: &mut [u8], tag: u64) {
    let done = Cell::new(false);
    // SAFETY: per contract; buf and `done` outlive the receive, waited for here.
    unsafe {
        let r = post_tag_recv(w, buf.as_mut_ptr(), buf.len(), tag, Some(&done));
        wait_recv(w, r, &done);
    }
}

/// Progresses `w` until the operation that returned `s` (a send posted with
/// [`send_param`], or any request without a callback that sets a flag) finishes, then
/// frees its request.
///
/// # Safety
/// `w` is live, `s` was returned by an operation on it, and nothing else uses the worker
/// during the call.
pub(crate) unsafe fn wait(w: sys::ucp_worker_h, s: sys::ucs_status_ptr_t) {
    assert!(!sys::UCS_PTR_IS_ERR(s), "raw operation failed");
    if sys::UCS_PTR_IS_PTR(s) {
        // SAFETY: per contract.
        unsafe {
            while sys::ucp_request_check_status(s) == sys::UCS_INPROGRESS {
                sys::ucp_worker_progress(w);
            }
            sys::ucp_request_free(s);
        }
    }
}

/// Progresses `w` until the receive that returned `r`, posted with [`recv_param`]`(done)`,
/// finishes, then frees its request.
///
/// # Safety
/// As for [`wait`].
pub(crate) unsafe fn wait_recv(w: sys::ucp_worker_h, r: sys::ucs_status_ptr_t, done: &Cell<bool>) {
    assert!(!sys::UCS_PTR_IS_ERR(r), "raw receive failed");
    if sys::UCS_PTR_IS_PTR(r) {
        // SAFETY: per contract. The progress call is opaque to the compiler and may set
        // `done` through the pointer UCX holds, so the flag is read again each time.
        unsafe {
            while !done.get() {
                sys::ucp_worker_progress(w);
            }
            sys::ucp_request_free(r);
        }
    }
}

/// Stream receive callback: sets the `Cell<bool>` passed as user data.
unsafe extern "C" fn stream_recv_cb(
    _req: *mut c_void,
    _status: sys::ucs_status_t,
    _len: usize,
    user: *mut c_void,
) {
    // SAFETY: user is the flag given to `stream_recv_param`, which outlives the request.
    unsafe { (*user.cast::<Cell<bool>>()).set(true) };
}

/// Parameters of a stream receive of exactly the buffer's length (`WAITALL`) whose
/// callback sets `done` ([`wait_recv`]).
fn stream_recv_param(done: &Cell<bool>) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK.0
            | sys::UCP_OP_ATTR_FIELD_USER_DATA.0
            | sys::UCP_OP_ATTR_FIELD_FLAGS.0,
        flags: sys::UCP_STREAM_RECV_FLAG_WAITALL.0,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { recv_stream: Some(stream_recv_cb) },
        user_data: (done as *const Cell<bool>).cast_mut().cast(),
        ..Default::default()
    }
}

/// Active-message callback: counts arrivals in the `Cell<u64>` registered as its
/// argument (payloads of the benchmarks' sizes arrive eager and need no other handling).
unsafe extern "C" fn am_count_cb(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    _data: *mut c_void,
    _len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes valid parameters for the call.
    if unsafe { (*param).recv_attr } & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0 {
        // A payload still at the sender would have to be fetched: the benchmarks keep
        // their active messages small enough to arrive eager.
        eprintln!("raw active-message handler: a rendezvous message arrived");
        std::process::abort();
    }
    // SAFETY: arg is the counter given to `count_am`, which lives for the whole program.
    let counter = unsafe { &*arg.cast::<Cell<u64>>() };
    counter.set(counter.get() + 1);
    sys::UCS_OK
}

/// Registers (`Some`) or removes (`None`) a handler for active-message `id` on `w` that
/// counts arrivals in `counter`.
///
/// The counter lives for the whole program, so that it outlives its registration even
/// when a benchmark panics before removing the handler.
///
/// # Safety
/// `w` is live and nothing else uses it during the call.
pub(crate) unsafe fn count_am(w: sys::ucp_worker_h, id: u16, counter: Option<&'static Cell<u64>>) {
    let arg = counter.map_or(std::ptr::null_mut(), |c| (c as *const Cell<u64>).cast_mut().cast());
    // SAFETY: per contract.
    unsafe { set_am_handler(w, id, counter.map(|_| am_count_cb as AmCallback), arg, 0) };
}

/// An active-message callback (`ucp_am_recv_callback_t`).
type AmCallback = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// Sets (`Some`) or removes (`None`) the handler of active-message `id` on `w`
/// (`ucp_worker_set_am_recv_handler`), with `arg` and the `UCP_AM_FLAG_*` `flags`.
///
/// # Safety
/// `w` is live and nothing else uses it during the call; `arg` stays valid for `cb` as
/// long as the registration lasts.
// The flags' integer type differs between UCX releases: the cast is a no-op with some.
#[allow(clippy::unnecessary_cast)]
unsafe fn set_am_handler(
    w: sys::ucp_worker_h,
    id: u16,
    cb: Option<AmCallback>,
    arg: *mut c_void,
    flags: u32,
) {
    let param = sys::ucp_am_handler_param_t {
        field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS.0) as u64,
        id: id.into(),
        flags: flags as _,
        cb,
        arg,
    };
    // SAFETY: per contract.
    let status = unsafe { sys::ucp_worker_set_am_recv_handler(w, &param) };
    assert_eq!(status, sys::UCS_OK, "setting an active-message handler failed");
}

/// Progresses `w` until `counter` reaches `at_least`.
///
/// # Safety
/// As for [`wait`]; `counter` is registered with [`count_am`] on `w`.
pub(crate) unsafe fn wait_am(w: sys::ucp_worker_h, counter: &Cell<u64>, at_least: u64) {
    while counter.get() < at_least {
        // SAFETY: per contract.
        unsafe { sys::ucp_worker_progress(w) };
    }
}

/// The packed remote key of memory mapped on `ctx` as `memh` (`ucp_rkey_pack`).
///
/// # Safety
/// `ctx` and `memh` are live, `memh` mapped on `ctx`.
pub(crate) unsafe fn pack_rkey(ctx: sys::ucp_context_h, memh: sys::ucp_mem_h) -> Vec<u8> {
    let mut buf: *mut c_void = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: per contract; UCX returns a buffer of `size` bytes that is copied, then
    // released once.
    unsafe {
        assert_eq!(sys::ucp_rkey_pack(ctx, memh, &mut buf, &mut size), sys::UCS_OK, "rkey pack");
        let bytes = std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec();
        sys::ucp_rkey_buffer_release(buf);
        bytes
    }
}

/// A peer's remote key unpacked on an endpoint (`ucp_ep_rkey_unpack`); destroyed on drop,
/// which must come before the endpoint closes.
pub(crate) struct RawRkey(pub(crate) sys::ucp_rkey_h);

impl RawRkey {
    /// # Safety
    /// `ep` is live and nothing else uses its worker during the call.
    pub(crate) unsafe fn unpack(ep: sys::ucp_ep_h, packed: &[u8]) -> RawRkey {
        let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: per contract; `packed` came from `pack_rkey`.
        let status = unsafe { sys::ucp_ep_rkey_unpack(ep, packed.as_ptr().cast(), &mut rkey) };
        assert_eq!(status, sys::UCS_OK, "rkey unpack");
        RawRkey(rkey)
    }
}

impl Drop for RawRkey {
    fn drop(&mut self) {
        // SAFETY: unpacked once, destroyed once, after its last operation completed.
        unsafe { sys::ucp_rkey_destroy(self.0) };
    }
}

/// Posts a put of `len` bytes at `buf` to `remote` (`ucp_put_nbx`), or with `get` a get
/// from there into `buf` (`ucp_get_nbx`); completion polled with [`wait`].
///
/// # Safety
/// `ep` is live, nothing else uses its worker during the call, `rkey` belongs to `ep` and
/// covers the remote range, and `buf` stays valid until the operation completes.
pub(crate) unsafe fn post_rma(
    ep: sys::ucp_ep_h,
    get: bool,
    buf: *mut u8,
    len: usize,
    remote: u64,
    rkey: &RawRkey,
) -> sys::ucs_status_ptr_t {
    // SAFETY: per contract.
    unsafe {
        if get {
            sys::ucp_get_nbx(ep, buf.cast(), len, remote, rkey.0, &send_param())
        } else {
            sys::ucp_put_nbx(ep, buf.cast(), len, remote, rkey.0, &send_param())
        }
    }
}

/// Flushes `ep` (`ucp_ep_flush_nbx`): every put and get posted on it is complete at the
/// target when this returns.
///
/// # Safety
/// As for [`wait`], with `ep` an endpoint of `w`.
pub(crate) unsafe fn flush(w: sys::ucp_worker_h, ep: sys::ucp_ep_h) {
    // SAFETY: per contract.
    unsafe { wait(w, sys::ucp_ep_flush_nbx(ep, &send_param())) }
}

/// Receives exactly `buf.len()` bytes of `ep`'s stream into `buf` (`WAITALL`),
/// progressing `w` until they are there.
///
/// # Safety
/// As for [`wait`], with `ep` an endpoint of `w`.
pub(crate) unsafe fn stream_recv_exact(w: sys::ucp_worker_h, ep: sys::ucp_ep_h, buf: *mut u8, len: usize) {
    let done = Cell::new(false);
    let mut got = 0usize;
    // SAFETY: per contract; buf, `got` and `done` outlive the receive, waited for here.
    unsafe {
        let r = sys::ucp_stream_recv_nbx(ep, buf.cast(), len, &mut got, &stream_recv_param(&done));
        wait_recv(w, r, &done);
    }
}

/// Where the raw `am_bw` handler ([`sink_am`]) puts payloads, and how many messages it
/// has taken whole: eager ones on arrival, rendezvous ones once fetched into `buf`.
pub(crate) struct AmSink {
    pub(crate) worker: sys::ucp_worker_h,
    pub(crate) buf: *mut u8,
    pub(crate) len: usize,
    pub(crate) done: Cell<u64>,
}

/// Rendezvous fetch callback: counts the message in the [`AmSink`] passed as user data.
unsafe extern "C" fn am_fetched_cb(
    _req: *mut c_void,
    status: sys::ucs_status_t,
    _len: usize,
    user: *mut c_void,
) {
    assert_eq!(status, sys::UCS_OK, "raw active-message fetch failed");
    // SAFETY: user is the sink registered with `sink_am`, which lives for the whole program.
    let sink = unsafe { &*user.cast::<AmSink>() };
    sink.done.set(sink.done.get() + 1);
}

/// Active-message callback of [`sink_am`]: counts an eager message (as `ucx_perftest`
/// does, without copying it) and fetches a rendezvous payload into the sink's buffer,
/// counting it once there.
unsafe extern "C" fn am_sink_cb(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: arg is the sink given to `sink_am`, which lives for the whole program; UCX
    // passes valid parameters for the call.
    let (sink, rndv) = unsafe {
        (&*arg.cast::<AmSink>(), (*param).recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0)
    };
    if !rndv {
        sink.done.set(sink.done.get() + 1);
        return sys::UCS_OK;
    }
    let fetch = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { recv_am: Some(am_fetched_cb) },
        user_data: arg,
        ..Default::default()
    };
    // SAFETY: `data` is the descriptor UCX just handed over; the buffer is the sink's,
    // which outlives the fetch. A request given back with `ucp_request_release` (unlike
    // `ucp_request_free`) still calls back when it completes, as `ucx_perftest` relies on.
    unsafe {
        assert!(len <= sink.len, "a {len}-byte payload does not fit the {}-byte sink", sink.len);
        let s = sys::ucp_am_recv_data_nbx(sink.worker, data, sink.buf.cast(), len, &fetch);
        assert!(!sys::UCS_PTR_IS_ERR(s), "raw active-message fetch failed");
        if sys::UCS_PTR_IS_PTR(s) {
            sys::ucp_request_release(s);
        } else {
            sink.done.set(sink.done.get() + 1);
        }
    }
    sys::UCS_INPROGRESS
}

/// Registers a handler for active-message `id` on `sink.worker` that takes every message
/// into `sink` (whole messages, as `ucx_perftest`'s `ucp_am_bw` asks for). Remove it with
/// [`count_am`]`(worker, id, None)`.
///
/// # Safety
/// The worker is live and nothing else uses it during the call; `sink.buf` stays valid
/// for `sink.len` bytes until the handler is removed.
// The flags' integer type differs between UCX releases: the cast is a no-op with some.
#[allow(clippy::unnecessary_cast)]
pub(crate) unsafe fn sink_am(id: u16, sink: &'static AmSink) {
    let arg = (sink as *const AmSink).cast_mut().cast();
    // SAFETY: per contract.
    unsafe { set_am_handler(sink.worker, id, Some(am_sink_cb), arg, sys::UCP_AM_FLAG_WHOLE_MSG.0 as u32) };
}
