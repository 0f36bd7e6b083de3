//! The request parameters (`ucp_request_param_t`) of every operation ucxkit posts: a
//! completion callback with the worker's [`State`] as its user data, and the options an
//! operation adds. Built in one go, as one struct literal: this is on the path of every
//! operation.

use ucx_sys as sys;

use super::request;
use super::State;

/// The completion callback a request gets.
pub(crate) type Callback = sys::ucp_request_param_t__bindgen_ty_1;

/// `UCP_OP_ATTR_FLAG_NO_IMM_CMPL`: UCX runs the callback inside the posting call instead
/// of completing the operation at once.
pub(crate) const NO_IMM: u32 = sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL.0 as u32;
/// `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`: UCX completes the operation during the call or
/// posts nothing.
pub(crate) const FORCE_IMM: u32 = sys::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL.0 as u32;

/// Parameters with callback `cb`, called with `st` (the posting worker's state), the
/// attribute bits `attrs` (such as [`NO_IMM`]), the operation's `flags` (when nonzero,
/// `UCP_OP_ATTR_FIELD_FLAGS` is set) and, when given, a datatype other than contiguous
/// bytes (an iov list).
#[inline(always)]
pub(crate) fn param(
    st: &mut State,
    cb: Callback,
    attrs: u32,
    flags: u32,
    datatype: Option<sys::ucp_datatype_t>,
) -> sys::ucp_request_param_t {
    let mut mask = (sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0) as u32 | attrs;
    if flags != 0 {
        mask |= sys::UCP_OP_ATTR_FIELD_FLAGS.0 as u32;
    }
    if datatype.is_some() {
        mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE.0 as u32;
    }
    sys::ucp_request_param_t {
        op_attr_mask: mask,
        flags,
        cb,
        datatype: datatype.unwrap_or_default(),
        user_data: (st as *mut State).cast(),
        ..Default::default()
    }
}

/// Parameters of a send-type operation ([`request::send_cb`]), with the attribute bits
/// `attrs` and the operation's `flags`.
#[inline(always)]
pub(crate) fn send(st: &mut State, attrs: u32, flags: u32) -> sys::ucp_request_param_t {
    param(st, Callback { send: Some(request::send_cb) }, attrs, flags, None)
}

/// [`NO_IMM`] when `on`, else nothing.
#[inline(always)]
pub(crate) fn no_imm(on: bool) -> u32 {
    if on {
        NO_IMM
    } else {
        0
    }
}
