//! Namespaces: how the application and the layers built on ucxkit (collectives, object
//! push, a library of your own) share one worker's tags and active-message ids without
//! one's messages matching another's receives.
//!
//! # Layout
//!
//! | who | tags on the wire | active-message ids |
//! |---|---|---|
//! | the application (the plain [`crate::Endpoint`] and [`crate::Worker`] calls) | top bit 0: 63 bits ([`crate::tag::APP_TAG_BITS`]) | 0..=2047 ([`crate::am::MAX_ID`]) |
//! | namespace `n` (1..=127), through a [`Namespace`] | top bit 1, `n` in the next 7 bits, 56 bits of the layer's own ([`TAG_BITS`]) | 16 ids ([`crate::am::NAMESPACE_IDS`]) from 2048 + 16 (`n` − 1) |
//! | ucxkit's handshake | none | 4095 |
//!
//! The application's calls refuse tags with the top bit set, and ids above 2047; a
//! [`Namespace`]'s calls take tags of [`TAG_BITS`] bits and ids below
//! [`crate::am::NAMESPACE_IDS`], put them in its own range, and receive only within it:
//! a receive with mask [`crate::tag::ANY`] matches any tag of its own space and none
//! other. So no convention is needed: a layer cannot match the application's messages
//! or another layer's, and the application cannot match a layer's. (A [`Discarder`],
//! which throws a namespace's messages away without holding its claim, is for a layer's
//! own use on its own number.)
//!
//! A namespace is claimed from a worker ([`crate::Worker::namespace`]), once at a time:
//! claiming a claimed one is an error, and dropping the last clone of the
//! [`Namespace`] gives it back. Both ends of a conversation use the same number, as they
//! use the same tags. ucxkit's own layers use [`COLLECTIVES`] and [`OBJECT_PUSH`];
//! numbers up to 15 are kept for ucxkit, [`FIRST_FREE`] and above are free for other
//! libraries.
//!
//! A worker built with [`crate::WorkerBuilder::namespaces`] off gives the application all
//! 64 tag bits and ids up to 4094 instead, for plain UCX peers whose tags or ids use
//! them; it has no namespaces.
//!
//! Streams and remote memory have no namespaces: a stream belongs to its endpoint, and
//! memory is reached by key.

use std::sync::Arc;

use crate::am::{self, AmHandler, AmMessage, AmReceiver, AmSend, AmSendOptions, NAMESPACE_IDS};
use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::iov::{TagRecvIov, TagSendIov};
use crate::op::SendOp;
use crate::tag::{Space, Tag, TagInfo, TagRecv, TagSend};
use crate::worker::Worker;

/// The bits of a namespace's own tags.
pub const TAG_BITS: u32 = 56;
/// The namespace of `ucxkit-collectives`.
pub const COLLECTIVES: u8 = 1;
/// The namespace of `ucxkit-object-push`.
pub const OBJECT_PUSH: u8 = 2;
/// The first namespace number not kept for ucxkit's own layers.
pub const FIRST_FREE: u8 = 16;
/// The highest namespace number.
pub const LAST: u8 = 127;

/// A claimed namespace of one worker: tags and active-message ids of a layer's own (see
/// the [module docs](self)). Cheap to clone; the claim ends with the last clone.
#[derive(Clone)]
pub struct Namespace {
    inner: Arc<Claim>,
}

struct Claim {
    worker: Worker,
    number: u8,
    space: Space,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.worker.release_namespace(self.number);
    }
}

/// Takes and throws away a namespace's messages ([`Namespace::tag_discard`]) without
/// holding its claim: for a task that clears what still arrives for a part of a layer
/// that has gone, while the layer may give the namespace back and claim it again. It
/// discards in that number's space whoever holds it, so it may only be used for tags
/// that no later claimant's receives can expect. Keeps the worker alive.
#[derive(Clone)]
pub struct Discarder {
    worker: Worker,
    space: Space,
}

impl Discarder {
    /// [`Namespace::tag_discard`].
    ///
    /// # Errors
    /// As for [`Namespace::tag_discard`].
    pub fn tag_discard(&self, tag: Tag, mask: u64) -> Result<usize> {
        self.worker.tag_discard_in(self.space, tag, mask)
    }
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespace").field("number", &self.inner.number).finish()
    }
}

impl Worker {
    /// Claims namespace `number` (1..=[`LAST`]) of this worker for a layer's traffic.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a number out of range or one claimed already on this
    /// worker.
    pub fn namespace(&self, number: u8) -> Result<Namespace> {
        if !(1..=LAST).contains(&number) {
            return Err(Error::ApiMisuse(format!("namespace {number} is out of range (1..={LAST})")));
        }
        if !self.shared.inner.namespaces {
            return Err(Error::ApiMisuse(
                "this worker gives the application all tag bits and has no namespaces (WorkerBuilder::namespaces)"
                    .into(),
            ));
        }
        if !self.claim_namespace(number) {
            return Err(Error::ApiMisuse(format!("namespace {number} is already claimed on this worker")));
        }
        Ok(Namespace {
            inner: Arc::new(Claim {
                worker: self.clone(),
                number,
                space: Space::namespace(number, TAG_BITS),
            }),
        })
    }
}

impl Namespace {
    /// The namespace's number.
    pub fn number(&self) -> u8 {
        self.inner.number
    }

    /// The worker it was claimed from.
    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    /// The wire id of this namespace's active-message id `id`, None when `id` is not
    /// below [`NAMESPACE_IDS`] (what [`AmMessage::id`] reports for its messages).
    pub fn am_wire_id(&self, id: u16) -> Option<u16> {
        (id < NAMESPACE_IDS).then(|| am::namespace_id(self.inner.number, id))
    }

    /// The error for an endpoint of another worker (the namespace is not claimed there).
    #[inline]
    fn foreign(&self, ep: &Endpoint) -> Option<Box<Error>> {
        if Arc::ptr_eq(&ep.worker().shared, &self.inner.worker.shared) {
            return None;
        }
        Some(self.not_the_workers())
    }

    /// The error for an endpoint of another worker.
    #[cold]
    #[inline(never)]
    fn not_the_workers(&self) -> Box<Error> {
        Box::new(Error::ApiMisuse(format!(
            "namespace {} belongs to another worker than the endpoint's",
            self.inner.number
        )))
    }

    /// The wire id for `id`, or the error for one out of range.
    fn wire_id(&self, id: u16) -> std::result::Result<u16, Box<Error>> {
        self.am_wire_id(id).ok_or_else(|| {
            Box::new(Error::ApiMisuse(format!(
                "active-message id {id} of namespace {} is out of range (0..{NAMESPACE_IDS})",
                self.inner.number
            )))
        })
    }

    /// [`Endpoint::tag_send`] in this namespace; `ep` must belong to its worker.
    ///
    /// # Errors
    /// (in the future's result) [`Error::ApiMisuse`] for a tag over [`TAG_BITS`] bits or
    /// an endpoint of another worker; otherwise as for `tag_send`.
    pub fn tag_send<B: IoBuf>(&self, ep: &Endpoint, tag: Tag, buf: B) -> TagSend<B> {
        self.tag_send_with(ep, tag, buf, false)
    }

    /// [`Endpoint::tag_send_eager`] in this namespace.
    ///
    /// # Errors
    /// As for [`Namespace::tag_send`].
    pub fn tag_send_eager<B: IoBuf>(&self, ep: &Endpoint, tag: Tag, buf: B) -> TagSend<B> {
        self.tag_send_with(ep, tag, buf, true)
    }

    #[inline(always)]
    fn tag_send_with<B: IoBuf>(&self, ep: &Endpoint, tag: Tag, buf: B, eager: bool) -> TagSend<B> {
        if let Some(e) = self.foreign(ep) {
            return SendOp::failed(ep, "tag_send", e, buf);
        }
        ep.tag_send_in(self.inner.space, tag, buf, eager)
    }

    /// [`Endpoint::try_tag_send`] in this namespace.
    ///
    /// # Errors
    /// As for [`Namespace::tag_send`] and [`Endpoint::try_tag_send`].
    pub fn try_tag_send(&self, ep: &Endpoint, tag: Tag, data: &[u8]) -> Result<bool> {
        if let Some(e) = self.foreign(ep) {
            return Err(*e);
        }
        ep.try_tag_send_in(self.inner.space, tag, data)
    }

    /// [`Endpoint::tag_send_iov`] in this namespace.
    pub fn tag_send_iov<B: IoBuf>(&self, ep: &Endpoint, tag: Tag, bufs: Vec<B>) -> TagSendIov<B> {
        if let Some(e) = self.foreign(ep) {
            return SendOp::failed(ep, "tag_send", e, bufs);
        }
        ep.tag_send_iov_in(self.inner.space, tag, bufs)
    }

    /// [`crate::Worker::tag_recv`] in this namespace: matches only its messages, and
    /// reports sender tags of [`TAG_BITS`] bits.
    pub fn tag_recv<B: IoBufMut>(&self, tag: Tag, mask: u64, buf: B) -> TagRecv<B> {
        crate::tag::post_recv(&self.inner.worker, None, self.inner.space, tag, mask, buf)
    }

    /// [`Endpoint::tag_recv`] (bound to `ep`) in this namespace.
    pub fn tag_recv_from<B: IoBufMut>(&self, ep: &Endpoint, tag: Tag, mask: u64, buf: B) -> TagRecv<B> {
        if let Some(e) = self.foreign(ep) {
            return TagRecv::refused(&self.inner.worker, Some(ep), e, buf);
        }
        crate::tag::post_recv(&self.inner.worker, Some(ep), self.inner.space, tag, mask, buf)
    }

    /// [`crate::Worker::tag_recv_iov`] in this namespace.
    pub fn tag_recv_iov<B: IoBufMut>(&self, tag: Tag, mask: u64, bufs: Vec<B>) -> TagRecvIov<B> {
        crate::iov::post_recv_iov(self.inner.worker.clone(), None, self.inner.space, tag, mask, bufs)
    }

    /// [`crate::Worker::tag_probe`] in this namespace.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a tag over [`TAG_BITS`] bits.
    pub fn tag_probe(&self, tag: Tag, mask: u64) -> Result<Option<TagInfo>> {
        self.inner.worker.tag_probe_in(self.inner.space, tag, mask)
    }

    /// [`crate::Worker::tag_recv_any`] in this namespace.
    pub async fn tag_recv_any(&self, tag: Tag, mask: u64) -> Result<(TagInfo, Vec<u8>)> {
        self.inner.worker.tag_recv_any_in(self.inner.space, tag, mask).await
    }

    /// [`crate::Worker::tag_discard`] in this namespace.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a tag over [`TAG_BITS`] bits, or after the worker's
    /// shutdown.
    pub fn tag_discard(&self, tag: Tag, mask: u64) -> Result<usize> {
        self.inner.worker.tag_discard_in(self.inner.space, tag, mask)
    }

    /// A [`Discarder`] of this namespace's messages, which does not hold its claim.
    pub fn discarder(&self) -> Discarder {
        Discarder { worker: self.inner.worker.clone(), space: self.inner.space }
    }

    /// [`Endpoint::am_send`] with this namespace's id `id` (below [`NAMESPACE_IDS`]).
    pub fn am_send<B: IoBuf>(&self, ep: &Endpoint, id: u16, header: &[u8], payload: B) -> AmSend<B> {
        self.am_send_with(ep, id, header, payload, AmSendOptions::default())
    }

    /// [`Endpoint::am_send_with`] with this namespace's id `id`.
    ///
    /// # Errors
    /// (in the future's result) [`Error::ApiMisuse`] for an id out of range or an
    /// endpoint of another worker; otherwise as for `am_send_with`.
    pub fn am_send_with<B: IoBuf>(
        &self,
        ep: &Endpoint,
        id: u16,
        header: &[u8],
        payload: B,
        opts: AmSendOptions,
    ) -> AmSend<B> {
        let wire = match self.foreign(ep).map_or_else(|| self.wire_id(id), Err) {
            Ok(w) => w,
            Err(e) => return SendOp::failed(ep, "am_send", e, payload),
        };
        ep.am_send_in(am::LAST_WIRE_ID, wire, header, payload, opts)
    }

    /// [`Endpoint::try_am_send`] with this namespace's id `id`.
    ///
    /// # Errors
    /// As for [`Namespace::am_send_with`] and [`Endpoint::try_am_send`].
    pub fn try_am_send(&self, ep: &Endpoint, id: u16, header: &[u8], data: &[u8]) -> Result<bool> {
        let wire = self.foreign(ep).map_or_else(|| self.wire_id(id), Err).map_err(|e| *e)?;
        ep.try_am_send_in(am::LAST_WIRE_ID, wire, header, data)
    }

    /// Replies to `msg` (see [`AmMessage::reply`]) with this namespace's id `id`.
    ///
    /// # Errors
    /// As for [`AmMessage::reply`].
    pub fn reply<B: IoBuf>(
        &self,
        msg: &AmMessage,
        id: u16,
        header: &[u8],
        payload: B,
    ) -> std::result::Result<AmSend<B>, (Error, B)> {
        match msg.reply_endpoint() {
            Some(ep) => Ok(self.am_send(ep, id, header, payload)),
            None => msg.reply(0, header, payload),
        }
    }

    /// [`crate::Worker::am_recv`] for this namespace's id `id`.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for an id out of range or registered already.
    pub fn am_recv(&self, id: u16) -> Result<AmReceiver> {
        self.inner.worker.am_recv_wire(self.wire_id(id).map_err(|e| *e)?)
    }

    /// [`crate::Worker::am_handler`] for this namespace's id `id`.
    ///
    /// # Errors
    /// As for [`Namespace::am_recv`].
    pub fn am_handler<F>(&self, id: u16, f: F) -> Result<AmHandler>
    where
        F: FnMut(AmMessage) + Send + 'static,
    {
        self.inner.worker.am_handler_wire(self.wire_id(id).map_err(|e| *e)?, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every space's tags stay in it, and a receive in one space never matches a tag
    /// of another (UCX's rule: `(sent & mask) == (posted & mask)`).
    #[test]
    fn spaces_do_not_overlap() {
        let spaces: Vec<Space> =
            std::iter::once(Space::APP).chain((1..=LAST).map(|n| Space::namespace(n, TAG_BITS))).collect();
        let tags = [0u64, 1, 0x55, (1 << TAG_BITS) - 1];
        for (i, a) in spaces.iter().enumerate() {
            for (j, b) in spaces.iter().enumerate() {
                for &t in &tags {
                    let sent = b.wire(t).unwrap();
                    assert_eq!(b.local(sent), t);
                    for mask in [crate::tag::ANY, crate::tag::EXACT, 0xff] {
                        let (posted, m) = a.wire_recv(t, mask).unwrap();
                        let matches = sent & m == posted & m;
                        assert_eq!(
                            matches,
                            i == j,
                            "space {i} receive vs space {j} tag {t:#x} mask {mask:#x}"
                        );
                    }
                }
            }
        }
        assert!(Space::APP.wire((1 << 63) - 1).is_some());
        assert!(Space::APP.wire(1 << 63).is_none());
        assert!(Space::namespace(5, TAG_BITS).wire(1 << TAG_BITS).is_none());
        // Tag bits outside the mask do not count.
        assert!(Space::APP.wire_recv(u64::MAX, crate::tag::ANY).is_ok());
        assert!(Space::APP.wire_recv(u64::MAX, crate::tag::EXACT).is_err());
    }

    #[test]
    fn active_message_ids_do_not_overlap() {
        let mut seen = std::collections::HashSet::new();
        for n in 1..=LAST {
            for id in 0..NAMESPACE_IDS {
                let w = am::namespace_id(n, id);
                assert!(w > am::MAX_ID && w <= am::LAST_WIRE_ID);
                assert!(seen.insert(w));
            }
        }
    }
}
