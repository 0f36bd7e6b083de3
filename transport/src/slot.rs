//! The slot ucxkit keeps inside every UCX request (UCX reserves [`SLOT_SIZE`] bytes in
//! front of each request it hands out: the context's `request_size`), and what an
//! endpoint's failure does to the request ([`OpKind`]). The callbacks that fill a slot,
//! and its life, are in [`crate::worker::request`].

use std::any::Any;
use std::ffi::c_void;
use std::ptr;
use std::task::Waker;

use ucx_sys as sys;

/// What an endpoint's failure does to an operation bound to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// An unmatched tag receive: canceled (`ucp_request_cancel`).
    Cancel,
    /// Anything UCX cannot cancel (sends, RMA, fetches): UCX purges it when it learns of
    /// the failure; when only ucxkit knows (a dead same-host peer in error mode None),
    /// ucxkit finishes it (see `State::fail_ep`). A closing endpoint waits for these
    /// before it closes (`State::part`).
    Finish,
    /// A stream receive: as [`OpKind::Finish`], but a closing endpoint does not wait for
    /// it (it ends only when the peer writes).
    StreamRecv,
    /// The flush a closing endpoint posts (`State::part`): as [`OpKind::Finish`], but
    /// the close does not wait for it (UCX's own close flushes).
    PartingFlush,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum SlotState {
    Pending,
    Done,
    Parked,
}

/// What ucxkit keeps inside each UCX request.
pub(crate) struct Slot {
    pub(crate) state: SlotState,
    /// What the failure of `bound_ep` does to this request.
    pub(crate) kind: OpKind,
    pub(crate) status: sys::ucs_status_t,
    pub(crate) len: usize,
    pub(crate) sender_tag: u64,
    /// Endpoint whose failure ends this request (0: none). A bound request is in the
    /// worker's list of bound requests (`State::bound`), linked through `prev` and
    /// `next`, from `Request::bind` until `request::free`.
    pub(crate) bound_ep: u64,
    pub(crate) prev: *mut Slot,
    pub(crate) next: *mut Slot,
    pub(crate) waker: Option<Waker>,
    pub(crate) parked: Option<Box<dyn Any + Send>>,
    /// A parked close request, listed in `State::closes`.
    pub(crate) close: bool,
}

impl Slot {
    pub(crate) const EMPTY: Slot = Slot {
        state: SlotState::Pending,
        kind: OpKind::Finish,
        status: sys::UCS_INPROGRESS,
        len: 0,
        sender_tag: 0,
        bound_ep: 0,
        prev: ptr::null_mut(),
        next: ptr::null_mut(),
        waker: None,
        parked: None,
        close: false,
    };
}

/// Bytes UCX reserves for a [`Slot`] in each request.
pub(crate) const SLOT_SIZE: usize = std::mem::size_of::<Slot>();

/// `request_init`: UCX calls this once per request when its pool first allocates it
/// (not on reuse; `request::free` resets the slot before each release).
pub(crate) unsafe extern "C" fn slot_init(request: *mut c_void) {
    // SAFETY: UCX passes a pointer to `request_size` writable bytes, aligned for any type
    // UCX itself stores (8 bytes), which covers Slot's alignment.
    unsafe { ptr::write(request.cast::<Slot>(), Slot::EMPTY) }
}
