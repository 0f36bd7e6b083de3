//! Pushes: the owner of an object offers it to a peer, which pulls it within its own
//! store's room (so a receiver never takes more than its budget), from the relays the
//! offer names first and from the owner otherwise, and answers once it holds it, or
//! says why not.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use ucxkit_transport::{AmMessage, Endpoint};

use super::pull::{payload, Choice};
use super::{Inner, ObjectNode};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::wire::{decode_addresses, encode_addresses, Msg};

/// How long a receiver waits for a relay's own transfer of the object to start before
/// it pulls from the owner instead (the relay's offer may come later than its own).
const RELAY_WAIT: Duration = Duration::from_secs(5);

impl ObjectNode {
    /// Pushes object `id`, held by this node, to `peer`: the peer pulls it from this node
    /// (checked chunk by chunk, as any pull) and answers once it holds it.
    ///
    /// # Errors
    /// [`Error::NotFound`] when this node does not hold `id`; [`Error::Remote`] with the
    /// peer's reason when it refused (no room in its store) or its pull failed;
    /// [`Error::DeadlineExceeded`] past the node's deadline; the transport's errors.
    pub async fn push(&self, id: ObjectId, peer: &Endpoint) -> Result<()> {
        let object = self.inner.store.get(&id).ok_or(Error::NotFound(id))?;
        self.inner.offer(id, object.len() as u64, peer, &[]).await
    }
}

impl Inner {
    /// Offers object `id` of `size` bytes to `peer`, to be pulled from `relays` first
    /// (then from this node), and waits for its answer.
    pub(super) async fn offer(
        &self,
        id: ObjectId,
        size: u64,
        peer: &Endpoint,
        relays: &[SocketAddr],
    ) -> Result<()> {
        let offer = |req| Msg::Offer { req, id, size, relays: relays.len() as u8 };
        let payload = Bytes::from(encode_addresses(relays));
        let limit = Some(self.opts.deadline);
        match self.ask(peer, offer, payload, limit, || format!("push of object {id}")).await?.0 {
            Msg::Done { .. } => Ok(()),
            Msg::Failed { reason, .. } => Err(Error::Remote(reason)),
            other => Err(Error::Protocol(format!("{other:?} in answer to an offer"))),
        }
    }
}

/// Takes an offer from the node at `ep`: pulls the object (from the relays the offer
/// names first) and answers `Done`, or `Failed` with the reason.
pub(super) async fn offered(node: Arc<Inner>, ep: Endpoint, msg: Msg, m: AmMessage) {
    let Msg::Offer { req, id, size, relays } = msg else { return };
    node.gave_up.lock().unwrap_or_else(PoisonError::into_inner).retain(|g| *g != id);
    let reply = match take(&node, &ep, id, size, relays, m).await {
        Ok(()) => Msg::Done { req },
        Err(e) => {
            // Receivers waiting for this node to relay it pull from others now.
            let mut g = node.gave_up.lock().unwrap_or_else(PoisonError::into_inner);
            if g.len() >= super::GAVE_UP_KEPT {
                g.pop_front();
            }
            g.push_back(id);
            drop(g);
            node.arrived.notify_waiters();
            if let Error::Protocol(_) = e {
                node.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Msg::Failed { req, reason: e.to_string() }
        }
    };
    super::serve::send_answer(&node, &ep, &reply, Bytes::new()).await;
}

/// Pulls an offered object of `size` bytes from the offer's relays and the offerer.
async fn take(node: &Inner, ep: &Endpoint, id: ObjectId, size: u64, relays: u8, m: AmMessage) -> Result<()> {
    let max = usize::from(relays) * (1 + crate::wire::MAX_ADDRESS);
    let addrs = decode_addresses(&payload(m, max).await?, relays)?;
    let mut holders = Vec::with_capacity(addrs.len() + 1);
    let mut seen = HashSet::new();
    for &a in &addrs {
        if seen.insert(a) {
            holders.extend(node.relay(a).await);
        }
    }
    let first = holders.len();
    holders.push(ep.clone());
    let wait_ms = RELAY_WAIT.min(node.opts.deadline).as_millis() as u32;
    let o =
        node.pull_with(id, &holders, Choice { first, wait_ms, relayed: true }, crate::Priority::Get).await?;
    if o.len() as u64 != size {
        return Err(Error::Remote(format!("offered {size} bytes, pulled {}", o.len())));
    }
    Ok(())
}
