//! Raw UCX tag operations for the benchmarks that time ucxkit against plain `ucp_*` calls
//! on the same worker: request parameters, callbacks, and waits that progress the worker
//! until a request finishes.

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
pub(crate) fn recv_param(done: &Cell<bool>) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { recv: Some(recv_cb) },
        user_data: (done as *const Cell<bool>).cast_mut().cast(),
        ..Default::default()
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
