//! The request parameters (`ucp_request_param_t`) of every operation ucxkit posts: a
//! completion callback with the worker's [`State`] as its user data, and the options
//! an operation adds ([`Param`]'s builder methods).

use ucx_sys as sys;

use super::request;
use super::State;

/// The completion callback a request gets.
pub(crate) type Callback = sys::ucp_request_param_t__bindgen_ty_1;

/// Request parameters under construction.
#[derive(Clone, Copy)]
pub(crate) struct Param(pub(crate) sys::ucp_request_param_t);

impl Param {
    /// Parameters with callback `cb`, called with `st` (the posting worker's state).
    #[inline(always)]
    pub(crate) fn new(st: &mut State, cb: Callback) -> Param {
        Param(sys::ucp_request_param_t {
            op_attr_mask: (sys::UCP_OP_ATTR_FIELD_CALLBACK.0 | sys::UCP_OP_ATTR_FIELD_USER_DATA.0) as u32,
            cb,
            user_data: (st as *mut State).cast(),
            ..Default::default()
        })
    }

    /// Parameters of a send-type operation ([`request::send_cb`]).
    #[inline(always)]
    pub(crate) fn send(st: &mut State) -> Param {
        Param::new(st, Callback { send: Some(request::send_cb) })
    }

    /// With `UCP_OP_ATTR_FLAG_NO_IMM_CMPL` when `on`: UCX then runs the callback inside
    /// the posting call instead of completing the operation at once.
    #[inline(always)]
    pub(crate) fn no_imm(mut self, on: bool) -> Param {
        if on {
            self.0.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL.0 as u32;
        }
        self
    }

    /// With `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`: UCX completes the operation during the
    /// call or posts nothing.
    #[inline(always)]
    pub(crate) fn force_imm(mut self) -> Param {
        self.0.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL.0 as u32;
        self
    }

    /// With the operation's flags (`UCP_OP_ATTR_FIELD_FLAGS`).
    #[inline(always)]
    pub(crate) fn flags(mut self, flags: u32) -> Param {
        self.0.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS.0 as u32;
        self.0.flags = flags;
        self
    }

    /// With a datatype other than contiguous bytes (an iov list).
    #[inline(always)]
    pub(crate) fn datatype(mut self, dt: sys::ucp_datatype_t) -> Param {
        self.0.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE.0 as u32;
        self.0.datatype = dt;
        self
    }
}
