//! One object from its owner to several receivers: each receiver gets an offer naming
//! the receiver it pulls from in the broadcast's [`Shape`] (its relay, asked first for
//! the address it listens on); a receiver whose relay does not listen, fails or never
//! starts pulls from the owner instead.

use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use futures_util::future::join_all;
use std::net::SocketAddr;

use ucxkit_transport::{Endpoint, Peer};

use super::pull::payload;
use super::{Inner, ObjectNode};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::shape::Shape;
use crate::wire::{decode_address, Msg};

/// What a broadcast did: its shape and each receiver's outcome, in the receivers' order.
#[derive(Debug)]
pub struct Broadcast {
    /// The shape it took.
    pub shape: Shape,
    /// Each receiver's outcome: it holds the object, or why not.
    pub results: Vec<Result<()>>,
}

impl Broadcast {
    /// Whether every receiver holds the object.
    pub fn is_ok(&self) -> bool {
        self.results.iter().all(Result::is_ok)
    }

    /// The first failure, with the receiver's index.
    pub fn first_error(&self) -> Option<(usize, &Error)> {
        self.results.iter().enumerate().find_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
    }
}

impl ObjectNode {
    /// [`ObjectNode::broadcast`] in the shape the cost model picks
    /// ([`ObjectNode::auto_shape`]); the shape taken is in [`Broadcast::shape`].
    ///
    /// # Errors
    /// As for [`ObjectNode::broadcast`].
    pub async fn broadcast_auto(&self, id: ObjectId, receivers: &[Endpoint]) -> Result<Broadcast> {
        let size = self.inner.store.get(&id).ok_or(Error::NotFound(id))?.len() as u64;
        self.broadcast(id, receivers, self.auto_shape(size, receivers)).await
    }

    /// The shape for an object of `size` bytes to `receivers`: direct sends where every
    /// receiver is on this host and reached through shared memory (each receiver copies
    /// the object itself whatever the shape, so relays would add only their lag:
    /// docs/objects.md measures it); otherwise the one [`Shape::choose`] picks with
    /// [`super::NodeOptions::link`], a relay lagging a window of chunks (TCP delivers a
    /// window together; `NodeOptions::network_window` bounds it).
    pub fn auto_shape(&self, size: u64, receivers: &[Endpoint]) -> Shape {
        let opts = &self.inner.opts;
        let shared_memory = self.inner.ns.worker().context().has_shared_memory();
        // The boot id first (no lookup), then the lanes.
        let local =
            |r: &Endpoint| r.peer_identity().is_some_and(|p| p.same_host()) && super::without_network(r);
        if shared_memory && receivers.iter().all(local) {
            return Shape::Direct;
        }
        let chunk = crate::sums::chunk_for(size, opts.chunk);
        let lag = u64::from(chunk) * super::fetch::window_for(opts.window, opts.network_window, chunk);
        Shape::choose(receivers.len(), size, lag, &opts.link)
    }

    /// Sends object `id`, held by this node, to every receiver in `shape`: each pulls it
    /// (checked chunk by chunk, within its store's room) from the receiver above it,
    /// which relays the chunks as they check out, or from this node; waits until every
    /// receiver holds it or failed.
    ///
    /// # Errors
    /// [`Error::NotFound`] when this node does not hold `id`. A receiver's failure (its
    /// refusal, a deadline) is its entry in [`Broadcast::results`].
    pub async fn broadcast(&self, id: ObjectId, receivers: &[Endpoint], shape: Shape) -> Result<Broadcast> {
        let node = &*self.inner;
        let size = node.store.get(&id).ok_or(Error::NotFound(id))?.len() as u64;
        let parents: BTreeSet<usize> = (0..receivers.len()).filter_map(|i| shape.parent(i)).collect();
        let found =
            join_all(parents.iter().map(|&p| async move { (p, node.hello(&receivers[p]).await) })).await;
        let mut addresses = HashMap::new();
        for (p, a) in found {
            match a {
                Ok(a) => {
                    addresses.insert(p, a);
                }
                // Those below it pull from this node instead.
                Err(e) => tracing::debug!(receiver = p, %e, "a relay's address is unknown"),
            }
        }
        let offers = receivers.iter().enumerate().map(|(i, r)| {
            let relays: Vec<SocketAddr> =
                shape.parent(i).and_then(|p| addresses.get(&p)).copied().into_iter().collect();
            async move { node.offer(id, size, r, &relays).await }
        });
        Ok(Broadcast { shape, results: join_all(offers).await })
    }
}

impl Inner {
    /// The address the node at `ep` listens on for receivers; a node listening on all of
    /// its addresses is given the one this node reaches it by.
    async fn hello(&self, ep: &Endpoint) -> Result<SocketAddr> {
        let limit = Some(self.opts.deadline);
        let hello = |req| Msg::Hello { req };
        match self.ask(ep, hello, Bytes::new(), limit, || "a receiver's address".into()).await? {
            (Msg::Address { .. }, m) => {
                let mut a = decode_address(&payload(m, crate::wire::MAX_ADDRESS).await?)?;
                if a.ip().is_unspecified() {
                    match ep.peer() {
                        Peer::Socket(s) | Peer::Accepted(Some(s)) => a.set_ip(s.ip()),
                        _ => return Err(Error::Remote("a receiver listening on an unknown address".into())),
                    }
                }
                Ok(a)
            }
            (Msg::Failed { reason, .. }, _) => Err(Error::Remote(reason)),
            (other, _) => Err(Error::Protocol(format!("{other:?} in answer to a hello"))),
        }
    }
}
