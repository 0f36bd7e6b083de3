//! The sending side of a transfer that goes by lane: pieces staged into the lane's
//! slots as credits free them, or one plain message.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

use ucxkit_transport::{tag::EXACT, SharedSlice, TagRecv, TagSend};

use super::note::Note;
use super::{
    bad, piece_len, poll_pending, send_small, Choice, Held, LaneAt, OutSlot, Pending, SLOTS, SLOT_STRIDE,
};
use crate::error::{Error, Result};
use crate::exec::{landed_bytes, Bufs, Wire};
use crate::schedule::Region;
use crate::tag::{tag, Kind};
use crate::Element;

/// The sending side of one transfer that goes by lane.
pub(crate) struct LaneSend<'l, T: Element> {
    /// The transfer (its peer names who a deadline waited on).
    pub(crate) at: LaneAt,
    /// The bytes it sends.
    bytes: usize,
    stage: SendStage<'l, T>,
    pending: Pending,
    /// When it started, to time it.
    began: std::time::Instant,
}

enum SendStage<'l, T: Element> {
    /// The bytes go as one data message; its time counts in the slot's pace, where the
    /// way was chosen.
    Plain(Option<TagSend<SharedSlice<T>>>, Option<&'l Mutex<OutSlot>>),
    /// By the lane.
    Pieces(Pieces<'l, T>),
    Done,
}

impl<'l, T: Element> LaneSend<'l, T> {
    /// Starts sending region `from` to `at.peer`: by the lane when it is free, else as a
    /// data message after a note that says so.
    pub(crate) fn start(w: &Wire<'l>, at: LaneAt, from: &Region, bufs: &Bufs<T>) -> Result<LaneSend<'l, T>> {
        let ep = w.ep(at.peer)?;
        let src = bufs.slice(from)?;
        let bytes = src.len() * std::mem::size_of::<T>();
        let mut pending = Pending::new();
        let began = std::time::Instant::now();
        let stage = match w.lanes.choose(at.peer, ep) {
            Choice::Lane(lane) => SendStage::Pieces(Pieces {
                lane,
                src,
                staged: 0,
                pieces: 0,
                acked: 0,
                credit: None,
                spare: None,
            }),
            Choice::Plain(slot) => {
                let note = Note::Plain.encode();
                send_small(w, at.peer, at.tag(w, w.rank, Kind::Note), note, &mut pending)?;
                let data = w.ns.tag_send(ep, tag(w.comm, at.seq, at.step, w.rank), src);
                SendStage::Plain(Some(data), slot)
            }
        };
        Ok(LaneSend { at, bytes, stage, pending, began })
    }

    /// Moves the transfer on: ready once every piece was taken (or the data message
    /// sent) and every note is out.
    pub(crate) fn poll(&mut self, w: &Wire<'_>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let peer = self.at.peer;
        loop {
            let more = match &mut self.stage {
                SendStage::Done => false,
                SendStage::Plain(data, slot) => match data {
                    None => false,
                    Some(op) => {
                        let (r, _) = std::task::ready!(Pin::new(op).poll(cx));
                        r.map_err(|source| Error::Transport { rank: peer, source })?;
                        *data = None;
                        if let Some(slot) = slot.take() {
                            let took = self.began.elapsed();
                            slot.lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .pace
                                .note(false, self.bytes, took);
                        }
                        false
                    }
                },
                SendStage::Pieces(p) => {
                    std::task::ready!(p.poll(w, self.at, &mut self.pending, cx))?;
                    // Every piece was taken: the lane is free again.
                    let took = self.began.elapsed();
                    if let SendStage::Pieces(p) = std::mem::replace(&mut self.stage, SendStage::Done) {
                        p.lane.finish(self.bytes, took);
                    }
                    true
                }
            };
            if !more {
                return poll_pending(&mut self.pending, peer, cx);
            }
        }
    }
}

/// A transfer's pieces on their way through a lane.
struct Pieces<'l, T: Element> {
    lane: Held<'l>,
    /// The bytes to send.
    src: SharedSlice<T>,
    /// Bytes copied into slots so far.
    staged: usize,
    /// Pieces noted so far, and credited.
    pieces: u32,
    acked: u32,
    /// The receive of the next credit, and its buffer between credits.
    credit: Option<TagRecv<Vec<u8>>>,
    spare: Option<Vec<u8>>,
}

impl<T: Element> Pieces<'_, T> {
    /// Fills the free slots and takes the credits: ready once every piece was taken.
    fn poll(
        &mut self,
        w: &Wire<'_>,
        at: LaneAt,
        pending: &mut Pending,
        cx: &mut Context<'_>,
    ) -> Poll<Result<()>> {
        let peer = at.peer;
        let total = self.src.len() * std::mem::size_of::<T>();
        let piece = piece_len(total, std::mem::size_of::<T>());
        let Some(region) = &self.lane.region else {
            return Poll::Ready(Err(Error::Internal("a lane held without its region".into())));
        };
        loop {
            while self.staged < total && ((self.pieces - self.acked) as usize) < SLOTS {
                let len = piece.min(total - self.staged);
                let offset = (self.pieces as usize % SLOTS) * SLOT_STRIDE;
                region
                    .write_from(offset, &self.src, self.staged..self.staged + len)
                    .map_err(|e| Error::Internal(format!("staging a lane piece: {e}")))?;
                // The key rides on the lane's first piece.
                let packed;
                let key: &[u8] = if self.lane.key_sent || self.pieces > 0 {
                    &[]
                } else {
                    packed = region.pack_key().map_err(|source| Error::Transport { rank: peer, source })?;
                    &packed
                };
                let note = Note::Piece { len: len as u32, offset: offset as u64, key }.encode();
                send_small(w, peer, at.tag(w, w.rank, Kind::Note), note, pending)?;
                self.staged += len;
                self.pieces += 1;
            }
            if self.acked == self.pieces {
                return Poll::Ready(Ok(()));
            }
            let ep = w.ep(peer)?;
            let spare = &mut self.spare;
            let op = self.credit.get_or_insert_with(|| {
                let mut buf = spare.take().unwrap_or_else(|| Vec::with_capacity(4));
                buf.clear();
                w.ns.tag_recv_from(ep, at.tag(w, peer, Kind::Credit), EXACT, buf)
            });
            let (r, buf) = std::task::ready!(Pin::new(op).poll(cx));
            self.credit = None;
            if landed_bytes(peer, 4, r, &buf)? != self.acked.to_le_bytes() {
                return Poll::Ready(Err(bad(peer, "a lane credit out of order")));
            }
            self.spare = Some(buf);
            self.acked += 1;
        }
    }
}
