//! UCX's log as ucxkit sees it: a handler, put ahead of UCX's own printing once per
//! process, that takes out of UCX's output the error lines UCX prints about something
//! ucxkit does on purpose and already knows the outcome of, and hands them to `tracing`
//! (target `ucxkit::ucx`, level debug) instead. Every other line goes to UCX's output as
//! before.
//!
//! Two such lines today. First, closing an endpoint UCX has already failed (its peer closed
//! first, or its connection broke) flushes its lanes, which UCX has replaced by stubs that fail, and
//! UCX logs `error during flush: Endpoint timeout` for each lane unless the endpoint uses
//! peer error handling (where UCX itself logs it at trace level). UCX 1.13 refuses a
//! forced close without peer error handling, so that flushing close is the only way to
//! release the endpoint: without this filter, the side that closes second printed two or
//! three UCX errors for every ordinary connection. Second, the listener front takes over
//! the endpoints UCX made for a connecting worker by creating endpoints from a bare
//! address ([`crate::pairing`]); a connection number whose endpoint is gone makes UCX
//! log `no active messages transport` for the attempt, which fails as expected.
//!
//! The filter applies only on a thread inside such a close ([`quietly`]), so that UCX
//! errors of anything else, other UCX users in the process included, still print. UCX's
//! log handlers are process-wide: this one is pushed at the first [`crate::Context`] and
//! stays for the life of the process; a handler another library pushes later runs before
//! it, and one pushed earlier does not see the lines it keeps back.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Once;

use ucx_sys as sys;

thread_local! {
    /// Set while this thread closes an endpoint UCX has failed.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// `ucs_log_func_t` with its `va_list` taken as a pointer. That is how a `va_list`
/// argument is passed on the 64-bit targets UCX supports: on x86-64 it is an array that
/// decays to a pointer to its first element; on AArch64 it is a 32-byte structure, which
/// the procedure call standard passes as a pointer to a copy; on POWER it is a pointer.
type Handler = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    *const c_char,
    sys::ucs_log_level_t,
    *const sys::ucs_log_component_config_t,
    *const c_char,
    *mut c_void,
) -> sys::ucs_log_func_rc_t;

extern "C" {
    /// C's `vsnprintf`, its `va_list` taken as a pointer as in [`Handler`].
    fn vsnprintf(buf: *mut c_char, len: usize, format: *const c_char, ap: *mut c_void) -> c_int;
}

/// Puts [`handler`] ahead of UCX's log handlers, once per process. UCX calls the handlers
/// pushed last first.
pub(crate) fn install() {
    static ONCE: Once = Once::new();
    // SAFETY: the two function pointer types differ only in how they spell the va_list
    // parameter, which both pass the same way ([`Handler`]).
    let f = unsafe { std::mem::transmute::<Option<Handler>, sys::ucs_log_func_t>(Some(handler)) };
    // SAFETY: `handler` lives as long as the process.
    ONCE.call_once(|| unsafe { sys::ucs_log_push_handler(f) });
}

/// Runs `f` (a close of an endpoint UCX failed, or an endpoint made from a bare address)
/// with the UCX errors it is expected to cause on this thread sent to `tracing` instead
/// of UCX's output.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            QUIET.set(self.0);
        }
    }
    let _reset = Reset(QUIET.replace(true));
    f()
}

/// Whether a UCX log line is one ucxkit expects inside [`quietly`]: the flush error of a
/// lane of a failed endpoint, or the "no transport" of an endpoint made from a bare
/// address for a connection number without an endpoint (see [`crate::pairing`]).
fn is_quieted(file: &CStr, level: sys::ucs_log_level_t, format: &CStr) -> bool {
    level == sys::UCS_LOG_LEVEL_ERROR
        && QUIETED.iter().any(|(f, text)| {
            file.to_bytes().ends_with(f) && format.to_bytes().windows(text.len()).any(|w| w == *text)
        })
}

/// The source files and the parts of UCX's format strings (1.13 to 1.22) that name the
/// quieted lines.
const QUIETED: [(&[u8], &[u8]); 2] =
    [(b"flush.c", b"error during flush"), (b"select.c", b"no active messages transport")];

/// `ucs_log_func_t`: keeps the quieted lines from UCX's output.
unsafe extern "C" fn handler(
    file: *const c_char,
    _line: c_uint,
    _function: *const c_char,
    level: sys::ucs_log_level_t,
    _comp: *const sys::ucs_log_component_config_t,
    format: *const c_char,
    ap: *mut c_void,
) -> sys::ucs_log_func_rc_t {
    if !QUIET.try_with(Cell::get).unwrap_or(false) || file.is_null() || format.is_null() {
        return sys::UCS_LOG_FUNC_RC_CONTINUE;
    }
    // SAFETY: UCX passes NUL-terminated strings valid for the call.
    let (file, fmt) = unsafe { (CStr::from_ptr(file), CStr::from_ptr(format)) };
    if !is_quieted(file, level, fmt) {
        return sys::UCS_LOG_FUNC_RC_CONTINUE;
    }
    let mut buf = [0 as c_char; 256];
    // SAFETY: `format` and `ap` are the message UCX logs (UCX starts `ap` afresh for each
    // handler); vsnprintf writes at most buf.len() bytes, NUL included.
    let n = unsafe { vsnprintf(buf.as_mut_ptr(), buf.len(), format, ap) };
    let text = if n < 0 {
        fmt.to_string_lossy()
    } else {
        // SAFETY: vsnprintf NUL-terminated the buffer.
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy()
    };
    // A panicking subscriber must not unwind into UCX.
    let _ = std::panic::catch_unwind(|| {
        tracing::debug!(target: "ucxkit::ucx", "expected UCX error: {text}");
    });
    sys::UCS_LOG_FUNC_RC_STOP
}

/// What `print` writes to a C stream, as text; `None` when no stream could be made.
pub(crate) fn printed(print: impl FnOnce(*mut libc::FILE)) -> Option<String> {
    let mut buf: *mut libc::c_char = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: valid out-pointers; the stream is closed below.
    let f = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if f.is_null() {
        tracing::debug!("open_memstream failed");
        return None;
    }
    print(f);
    // SAFETY: f is open, closed once; this also finalizes buf and size.
    unsafe { libc::fclose(f) };
    if buf.is_null() {
        return None;
    }
    // SAFETY: after fclose, buf holds `size` bytes written by the stream.
    let text =
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }).into_owned();
    // SAFETY: open_memstream's buffer is the caller's to free, once.
    unsafe { libc::free(buf.cast()) };
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_flush_errors_are_quieted() {
        let fmt13 = c"req %p: error during flush: %s, flush comp %p count reduced to %d";
        let fmt22 = c"req %p: error during flush: %s";
        let flush = c"/build/ucx/src/ucp/rma/flush.c";
        assert!(is_quieted(flush, sys::UCS_LOG_LEVEL_ERROR, fmt13));
        assert!(is_quieted(flush, sys::UCS_LOG_LEVEL_ERROR, fmt22));
        assert!(!is_quieted(flush, sys::UCS_LOG_LEVEL_WARN, fmt22));
        assert!(!is_quieted(c"ucp_ep.c", sys::UCS_LOG_LEVEL_ERROR, fmt22));
        assert!(!is_quieted(flush, sys::UCS_LOG_LEVEL_ERROR, c"flush failed: %s"));
        let select = c"/build/ucx/src/ucp/wireup/select.c";
        assert!(is_quieted(select, sys::UCS_LOG_LEVEL_ERROR, c"  no active messages transport to %s: %s"));
        assert!(!is_quieted(select, sys::UCS_LOG_LEVEL_ERROR, c"no remote registered memory access"));
    }

    #[test]
    fn quietly_restores_the_flag() {
        assert!(!QUIET.get());
        quietly(|| {
            assert!(QUIET.get());
            quietly(|| assert!(QUIET.get()));
            assert!(QUIET.get());
        });
        assert!(!QUIET.get());
        let r = std::panic::catch_unwind(|| quietly(|| panic!("inside")));
        assert!(r.is_err());
        assert!(!QUIET.get());
    }
}
