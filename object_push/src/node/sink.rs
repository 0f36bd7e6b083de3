//! Where a transfer's chunks go: pieces of one buffer in memory (each published for
//! relays once checked, all joined without a copy at the end), or positioned writes
//! into the file the store gave for the object (each piece a buffer of its own, freed
//! once written; the object is not relayed while it arrives).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use ucxkit_transport::Either;

use super::partial::Published;
use super::Inner;
use crate::device::{self, DeviceBuf, DevicePiece, Piece};
use crate::error::{Error, Result};
use crate::file::ObjectFile;
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::Layout;

/// How long a transfer at its end waits for relays to give back the pieces they send.
const RELAY_GIVE_BACK: Duration = Duration::from_secs(2);

/// Where a transfer is to put the object: a file or device buffer the store gave, or a
/// buffer of the object's size.
pub(super) enum Dest {
    File(ObjectFile),
    Memory(Vec<u8>),
    Device(DeviceBuf),
}

/// A transfer's destination.
pub(super) enum Sink<'a> {
    Memory {
        /// The part of the buffer not yet split off for a chunk.
        rest: BytesMut,
        /// The chunks checked are here, lent to relays meanwhile.
        published: Published<'a>,
    },
    File {
        file: Arc<ObjectFile>,
        /// Held while the transfer lasts.
        _unrelayed: Unrelayed<'a>,
    },
    /// Chunks land in their places in a device buffer (see [`crate::device`]).
    Device {
        buf: DeviceBuf,
        /// Chunks received apart from their places (see `device::place`).
        apart: Vec<(usize, DevicePiece)>,
        /// Held while the transfer lasts.
        _unrelayed: Unrelayed<'a>,
    },
}

/// Marks an object arriving into a file while its transfer lasts (see `Inner::unrelayed`).
pub(super) struct Unrelayed<'a> {
    node: &'a Inner,
    id: ObjectId,
}

impl Drop for Unrelayed<'_> {
    fn drop(&mut self) {
        self.node.unrelayed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.id);
    }
}

/// How a transfer ended at its sink.
pub(super) enum Finish {
    /// The object, whole.
    Whole(Object),
    /// These chunks did not come back from relays in time: fetch them again.
    Missing(Vec<u64>),
}

impl<'a> Sink<'a> {
    /// Object `id` of `layout` received into `buf` (its size, contents unspecified).
    pub(super) fn memory(node: &'a Inner, id: ObjectId, layout: Arc<Layout>, buf: Vec<u8>) -> Sink<'a> {
        // A new Bytes has no other owner: it becomes mutable without a copy.
        let rest = Bytes::from(buf).try_into_mut().unwrap_or_else(|b| BytesMut::from(&b[..]));
        Sink::Memory { rest, published: Published::new(node, id, layout) }
    }

    /// A piece to receive the next chunk, bytes `range` of the object, into: the
    /// buffer's next part, its place in the device buffer, or a fresh one.
    pub(super) fn piece(&mut self, range: std::ops::Range<usize>) -> Result<Piece> {
        Ok(match self {
            Sink::Memory { rest, .. } => Either::Left(rest.split_to(range.len())),
            Sink::File { .. } => Either::Left(BytesMut::zeroed(range.len())),
            Sink::Device { buf, .. } => Either::Right(device::piece_of(buf, range)?),
        })
    }

    /// A piece of `len` bytes of its own, for a chunk whose place a receive abandoned
    /// may still write.
    pub(super) fn fresh(&self, len: usize) -> Result<Piece> {
        Ok(match self {
            Sink::Device { buf, .. } => Either::Right(device::fresh(buf, len)?),
            _ => Either::Left(BytesMut::zeroed(len)),
        })
    }

    /// The file chunks are written to, where they are.
    pub(super) fn target(&self) -> Option<Arc<ObjectFile>> {
        match self {
            Sink::File { file, .. } => Some(file.clone()),
            _ => None,
        }
    }

    /// Chunk `k` (bytes `at..` of the object) checked out (and was written, for a file):
    /// kept for relays and the end, or in its place in device memory (or kept apart).
    pub(super) fn keep(&mut self, k: u64, at: usize, piece: Piece) -> Result<()> {
        match (self, piece) {
            (Sink::Memory { published, .. }, Either::Left(p)) => published.put(k, p),
            (Sink::Device { buf, apart, .. }, Either::Right(d)) => device::place(buf, at, d, apart),
            (Sink::File { .. }, _) => {}
            _ => {
                return Err(Error::Store(format!(
                    "chunk {k} arrived in memory of another kind than its object's"
                )))
            }
        }
        Ok(())
    }

    /// Every chunk checked out: the object, or the chunks to fetch again.
    pub(super) async fn finish(&mut self, layout: &Layout) -> Result<Finish> {
        let published = match self {
            Sink::File { file, .. } => {
                return Ok(Finish::Whole(Object::in_shared_file(file.clone(), layout.clone())?))
            }
            Sink::Device { buf, apart, .. } => {
                return Ok(Finish::Whole(Object::in_device(device::sealed(buf, apart)?, layout.clone())?))
            }
            Sink::Memory { published, .. } => published,
        };
        let pieces = published.collect(RELAY_GIVE_BACK).await;
        if pieces.iter().any(Option::is_none) {
            let missing =
                pieces.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(k, _)| k as u64).collect();
            // Whatever came back stays for the relays while the rest is fetched again.
            for (k, p) in pieces.into_iter().enumerate() {
                if let Some(p) = p {
                    published.put(k as u64, p);
                }
            }
            published.reopen();
            return Ok(Finish::Missing(missing));
        }
        let mut whole = BytesMut::new();
        for p in pieces.into_iter().flatten() {
            whole.unsplit(p);
        }
        Ok(Finish::Whole(Object::new(whole.freeze(), layout.clone())?))
    }
}

/// Checks chunk `k` of `layout` (blocking; unless `verify` is off; a device piece is
/// copied to the host for it) and writes it to `file` when it checks out: whether it
/// did.
pub(super) fn check(
    layout: &Layout,
    k: u64,
    piece: &Piece,
    verify: bool,
    file: Option<&ObjectFile>,
) -> Result<bool> {
    if !device::verify_piece(layout, k, piece, verify)? {
        return Ok(false);
    }
    if let (Some(f), Either::Left(p)) = (file, piece) {
        f.write_at(layout.range(k).start as u64, p)?;
    }
    Ok(true)
}

impl<'a> Sink<'a> {
    /// Object `id` received into device buffer `buf` (not relayed while it arrives, as
    /// for a file).
    pub(super) fn device(node: &'a Inner, id: ObjectId, buf: DeviceBuf) -> Sink<'a> {
        node.unrelayed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id);
        node.arrived.notify_waiters();
        Sink::Device { buf, apart: Vec::new(), _unrelayed: Unrelayed { node, id } }
    }

    /// Object `id` received into `file`; lookups at this node waiting for it to arrive
    /// end at once (it is not relayed while it arrives).
    pub(super) fn file(node: &'a Inner, id: ObjectId, file: ObjectFile) -> Sink<'a> {
        node.unrelayed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id);
        node.arrived.notify_waiters();
        Sink::File { file: Arc::new(file), _unrelayed: Unrelayed { node, id } }
    }
}
