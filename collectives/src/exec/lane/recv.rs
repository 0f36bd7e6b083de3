//! The receiving side of a transfer that goes by lane: each note's piece got from the
//! sender's slot into the buffer, a credit back for it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use smallvec::SmallVec;
use ucxkit_transport::{tag::EXACT, Get, SharedSlice, TagRecv};

use super::note::{Note, NOTE_MAX};
use super::{bad, poll_pending, send_small, LaneAt, Pending};
use crate::error::{Error, Result};
use crate::exec::{received, Bufs, Wire};
use crate::schedule::Region;
use crate::tag::{tag, Kind};
use crate::Element;

/// What a receive does with each piece that landed (elements of its buffer).
pub(crate) type Landed<'a, T> = dyn FnMut(&mut Bufs<T>, std::ops::Range<usize>) -> Result<()> + 'a;

/// The receiving side of one transfer that goes by lane.
pub(crate) struct LaneRecv<T: Element> {
    /// The transfer (its peer names who a deadline waited on).
    pub(crate) at: LaneAt,
    /// Where the bytes land.
    into: Region,
    /// Bytes landed so far, and pieces.
    got: usize,
    pieces: u32,
    stage: RecvStage<T>,
    /// The note buffer, between notes.
    spare: Option<Vec<u8>>,
    pending: Pending,
}

enum RecvStage<T: Element> {
    /// Waiting for a note.
    Note(TagRecv<Vec<u8>>),
    /// Getting a piece of `len` bytes.
    Get(Get<SharedSlice<T>>, usize),
    /// Receiving the bytes as one data message.
    Data(TagRecv<SharedSlice<T>>),
    Done,
}

impl<T: Element> LaneRecv<T> {
    /// Starts receiving region `into` from `at.peer`: waits for its first note.
    pub(crate) fn start(w: &Wire<'_>, at: LaneAt, into: Region) -> Result<LaneRecv<T>> {
        let mut r = LaneRecv {
            at,
            into,
            got: 0,
            pieces: 0,
            stage: RecvStage::Done,
            spare: None,
            pending: Pending::new(),
        };
        r.stage = RecvStage::Note(r.post_note(w)?);
        Ok(r)
    }

    fn post_note(&mut self, w: &Wire<'_>) -> Result<TagRecv<Vec<u8>>> {
        let mut buf = self.spare.take().unwrap_or_else(|| Vec::with_capacity(NOTE_MAX));
        buf.clear();
        Ok(w.ns.tag_recv_from(w.ep(self.at.peer)?, self.at.tag(w, self.at.peer, Kind::Note), EXACT, buf))
    }

    /// Moves the transfer on, handing each piece that landed (its elements of the
    /// buffer) to `landed`: ready once every piece landed and every credit is out.
    pub(crate) fn poll(
        &mut self,
        w: &Wire<'_>,
        bufs: &mut Bufs<T>,
        cx: &mut Context<'_>,
        landed: &mut Landed<'_, T>,
    ) -> Poll<Result<()>> {
        let peer = self.at.peer;
        let elem = std::mem::size_of::<T>().max(1);
        let want = self.into.len() * elem;
        loop {
            match &mut self.stage {
                RecvStage::Done => return poll_pending(&mut self.pending, peer, cx),
                RecvStage::Note(op) => {
                    let (r, buf) = std::task::ready!(Pin::new(op).poll(cx));
                    received(peer, buf.len(), r)?;
                    let note = Note::decode(&buf).map_err(|e| bad(peer, &e))?;
                    self.stage = match note {
                        Note::Plain if self.got == 0 => {
                            let slice = bufs.slice(&self.into)?;
                            let t = tag(w.comm, self.at.seq, self.at.step, peer);
                            RecvStage::Data(w.ns.tag_recv_from(w.ep(peer)?, t, EXACT, slice))
                        }
                        Note::Plain => return Poll::Ready(Err(bad(peer, "a plain lane note after pieces"))),
                        Note::Piece { len, offset, key } => {
                            let len = len as usize;
                            if len % elem != 0 || len > want - self.got {
                                return Poll::Ready(Err(bad(
                                    peer,
                                    &format!("a lane piece of {len} bytes after {} of {want}", self.got),
                                )));
                            }
                            let ep = w.ep(peer)?;
                            let key = w.lanes.key(peer, ep, key)?;
                            let start = self.into.range.start + self.got / elem;
                            let part = Region { buf: self.into.buf, range: start..start + len / elem };
                            RecvStage::Get(ep.get(bufs.slice(&part)?, len, &key, offset), len)
                        }
                    };
                    self.spare = Some(buf);
                }
                RecvStage::Get(op, len) => {
                    let len = *len;
                    let (r, slice) = std::task::ready!(Pin::new(op).poll(cx));
                    match r {
                        Ok(n) if n == len => {}
                        Ok(n) => {
                            return Poll::Ready(Err(bad(
                                peer,
                                &format!("a lane get of {n} bytes, not {len}"),
                            )))
                        }
                        Err(source) => return Poll::Ready(Err(Error::Transport { rank: peer, source })),
                    }
                    let at = slice.range();
                    // The piece's buffer let go first: its values are free.
                    drop(slice);
                    let credit = SmallVec::from_slice(&self.pieces.to_le_bytes());
                    send_small(w, peer, self.at.tag(w, w.rank, Kind::Credit), credit, &mut self.pending)?;
                    self.got += len;
                    self.pieces += 1;
                    landed(bufs, at)?;
                    self.stage =
                        if self.got == want { RecvStage::Done } else { RecvStage::Note(self.post_note(w)?) };
                }
                RecvStage::Data(op) => {
                    let (r, slice) = std::task::ready!(Pin::new(op).poll(cx));
                    received(peer, want, r)?;
                    let at = slice.range();
                    drop(slice);
                    self.stage = RecvStage::Done;
                    landed(bufs, at)?;
                }
            }
        }
    }
}
