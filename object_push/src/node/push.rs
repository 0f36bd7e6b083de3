//! Pushes: the owner of an object offers it to a peer, which pulls it from the owner
//! within its own store's room (so a receiver never takes more than its budget) and
//! answers once it holds it, or says why not.

use bytes::Bytes;
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::Endpoint;

use super::pull::Registered;
use super::{ObjectNode, REQUEST};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::wire::Msg;

impl ObjectNode {
    /// Pushes object `id`, held by this node, to `peer`: the peer pulls it from this node
    /// (checked chunk by chunk, as any pull) and answers once it holds it.
    ///
    /// # Errors
    /// [`Error::NotFound`] when this node does not hold `id`; [`Error::Remote`] with the
    /// peer's reason when it refused (no room in its store) or its pull failed;
    /// [`Error::DeadlineExceeded`] past the node's deadline; the transport's errors.
    pub async fn push(&self, id: ObjectId, peer: &Endpoint) -> Result<()> {
        let node = &*self.inner;
        let object = node.store.get(&id).ok_or(Error::NotFound(id))?;
        let limit = node.opts.deadline;
        let (req, answer) = node.register();
        let _registered = Registered { node, req };
        let offer = Msg::Offer { req, id, size: object.len() as u64 };
        let opts = AmSendOptions { reply: true, ..Default::default() };
        let (r, _) = node.ns.am_send_with(peer, REQUEST, &offer.encode(), Bytes::new(), opts).await;
        r?;
        match tokio::time::timeout(limit, answer).await {
            Err(_) => Err(Error::DeadlineExceeded { what: format!("push of object {id}"), limit }),
            Ok(Err(_)) => Err(Error::Remote("the node is closing".into())),
            Ok(Ok((Msg::Done { .. }, _))) => Ok(()),
            Ok(Ok((Msg::Failed { reason, .. }, _))) => Err(Error::Remote(reason)),
            Ok(Ok((other, _))) => Err(Error::Protocol(format!("{other:?} in answer to an offer"))),
        }
    }
}
