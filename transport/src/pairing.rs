//! How two endpoints made from worker addresses become each other's peer.
//!
//! UCX pairs endpoints created from worker addresses by creation order: the n-th
//! endpoint a worker creates to a given peer worker (its *connection number*) pairs with
//! the n-th endpoint that peer creates back to it, or, if the peer has none, with an
//! internal endpoint UCX makes on the peer when the first wire-up message arrives. The
//! peer's next `ucp_ep_create` to this worker then takes that internal endpoint over
//! (matched by number, whatever the address it is given).
//!
//! The listener front relies on this where either side has no UCX connection manager
//! (no tcp transport; see `front::server`): the connecting side creates its endpoint from the
//! accepting side's address and sends its hello; when the hello arrives (its reply
//! endpoint is UCX's internal endpoint), the accepting side takes that endpoint over by
//! creating one from a *bare address*, which names the connecting worker and no
//! transport, so that no byte the client sent reaches UCX's address parser. When the
//! two sides' numbers disagree (the connecting side has made endpoints by address to
//! this worker that this side never took over, or both sides connected to each other at
//! once) this side takes the intervening internal endpoints over too and keeps them,
//! hidden, as the peers of the connections they belong to, until one of them turns out
//! to be the endpoint its hello arrived on. A hello that arrives on an endpoint this
//! side already uses is a collision: both sides' numbers are spent on another
//! connection, and the connecting side tries again with its next number.

use std::sync::atomic::AtomicPtr;
use std::sync::Arc;

use ucx_sys as sys;

use crate::error::Status;
use crate::ucx_address::{FLAG_WORKER_UUID, NO_DEVICE};
use crate::worker::{self, EpState, State};

/// The most endpoints taken over while looking for the one a hello arrived on.
const MAX_GAP: usize = 256;

/// A worker address in UCX's form (version 1) naming the worker `uuid` and no
/// transport: creating an endpoint from it only takes over an internal endpoint UCX
/// made for that worker's next connection, or fails ("unreachable").
pub(crate) fn bare_address(uuid: u64) -> [u8; 10] {
    let mut a = [0u8; 10];
    a[0] = FLAG_WORKER_UUID << 4;
    a[1..9].copy_from_slice(&uuid.to_ne_bytes());
    a[9] = NO_DEVICE;
    a
}

/// Why taking over a hello's endpoint failed.
#[derive(Debug)]
pub(crate) enum Adopt {
    /// The hello came through an endpoint this side already uses for another connection.
    Collision,
    /// No internal endpoint up to [`MAX_GAP`] numbers on was the hello's.
    NotFound,
}

impl State {
    /// Takes over `target`, the internal endpoint a hello from worker `uuid` arrived on
    /// (its reply endpoint), as an endpoint of this worker with error mode `peer_mode`;
    /// returns its id. Internal endpoints of that worker met on the way are taken over
    /// and kept hidden (see the module docs).
    pub(crate) fn adopt(&mut self, uuid: u64, target: sys::ucp_ep_h, peer_mode: bool) -> Result<u64, Adopt> {
        if let Some(&id) = self.by_handle.get(&(target as usize)) {
            // Taken over earlier, while looking for another hello's endpoint: claimed now.
            return match self.eps.get_mut(&id) {
                Some(e) if e.hidden => {
                    e.hidden = false;
                    e.peer_mode = peer_mode;
                    Ok(id)
                }
                _ => Err(Adopt::Collision),
            };
        }
        let bare = bare_address(uuid);
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER.0)
                as u64,
            address: bare.as_ptr().cast(),
            err_handler: sys::ucp_err_handler_t {
                cb: Some(worker::ep_err_cb),
                arg: (self as *mut State).cast(),
            },
            ..Default::default()
        };
        for _ in 0..MAX_GAP {
            let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
            let handle = self.handle;
            // UCX's error line for a number with no internal endpoint goes to `tracing`.
            let s = crate::ucx_log::quietly(|| {
                // SAFETY: the worker is valid under the lock (self comes from it); the bare
                // address lives for the call; the handler's arg is this State, which
                // outlives the worker's endpoints.
                Status(unsafe { sys::ucp_ep_create(handle, &params, &mut ep) })
            });
            if !s.is_ok() {
                // That number had no internal endpoint (its endpoint was closed): spent.
                tracing::debug!(status = %s, "a connection number without an endpoint skipped");
                continue;
            }
            let found = ep == target;
            let id = self.register_ep(ep, if found { peer_mode } else { false }, !found);
            if found {
                return Ok(id);
            }
            tracing::debug!(ep = id, "an earlier connection's endpoint taken over and kept");
        }
        Err(Adopt::NotFound)
    }

    /// Registers a UCX endpoint of this worker in the tables; a `hidden` one has no
    /// [`crate::Endpoint`] (yet).
    pub(crate) fn register_ep(&mut self, ep: sys::ucp_ep_h, peer_mode: bool, hidden: bool) -> u64 {
        let id = self.new_id();
        let usable = Arc::new(AtomicPtr::new(ep));
        let mut e = EpState::new(ep, peer_mode, usable);
        e.hidden = hidden;
        e.by_address = true;
        self.eps.insert(id, e);
        self.by_handle.insert(ep as usize, id);
        id
    }

    /// Closes every hidden endpoint (the worker is going away).
    pub(crate) fn close_hidden(&mut self) {
        let hidden: Vec<u64> = self.eps.iter().filter(|(_, e)| e.hidden).map(|(&id, _)| id).collect();
        for id in hidden {
            self.close_unwaited(id);
            self.forget_ep(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_read_from_both_address_versions() {
        let uuid = 0x0123_4567_89ab_cdefu64;
        let mut v1 = vec![0x20];
        v1.extend_from_slice(&uuid.to_ne_bytes());
        v1.push(0xff);
        assert_eq!(crate::ucx_address::uuid_of(&v1), Some(uuid));
        // Version 1 carries the uuid even without the flag (UCX before 1.12).
        v1[0] = 0x00;
        assert_eq!(crate::ucx_address::uuid_of(&v1), Some(uuid));
        let mut v2 = vec![0x01, FLAG_WORKER_UUID];
        v2.extend_from_slice(&uuid.to_ne_bytes());
        assert_eq!(crate::ucx_address::uuid_of(&v2), Some(uuid));
        v2[1] = 0;
        assert_eq!(crate::ucx_address::uuid_of(&v2), None, "version 2 without the uuid flag");
        assert_eq!(crate::ucx_address::uuid_of(&[0x02; 12]), None, "unknown version");
        assert_eq!(crate::ucx_address::uuid_of(&[0x20, 1, 2]), None, "too short");
        assert_eq!(crate::ucx_address::uuid_of(&[]), None);
        assert_eq!(crate::ucx_address::uuid_of(&bare_address(uuid)), Some(uuid));
    }
}
