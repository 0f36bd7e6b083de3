//! Runs one rank's [`Schedule`] over the transport: per step, the copies, then every
//! transfer posted at once (tagged as `crate::tag` lays out) and awaited together, then
//! the combines. Buffers are [`SharedBuf`]s, so the transfers of a step work on parts of
//! one buffer at once without copying, and the local steps read and write them in place
//! once the transfers have let go.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use smallvec::SmallVec;
use ucxkit_transport::{tag::EXACT, Endpoint, Namespace, SharedBuf, SharedSlice, TagInfo, TagRecv, TagSend};

use crate::abort::AbortCell;
use crate::error::{Error, Result};
use crate::schedule::{Buf, Combine, Region, Schedule, Step, Xfer};
use crate::tag::{tag, MAX_STEPS};
use crate::{Element, ReduceOp};
pub(crate) use eager::Eager;

mod eager;
pub(crate) mod lane;
pub(crate) mod one;
mod pieces;
pub(crate) mod ready;
pub(crate) mod small;

/// What the executor needs of a communicator.
pub(crate) struct Wire<'a> {
    pub(crate) ns: &'a Namespace,
    /// Transfers longer than this many bytes move in pieces of this size.
    pub(crate) segment: usize,
    pub(crate) abort: &'a AbortCell,
    pub(crate) eps: &'a [Option<Endpoint>],
    pub(crate) rank: usize,
    pub(crate) comm: u16,
    /// The shared-memory lanes to the ranks of this host.
    pub(crate) lanes: &'a lane::Lanes,
    /// Per rank, whether the endpoint reaches it through shared memory, where mid-size
    /// sends go by UCX's eager protocol as `eager` says.
    pub(crate) eager_to: &'a [bool],
    /// Which mid-size sends go eagerly.
    pub(crate) eager: Eager,
    /// What small calls keep (one-step calls take their landing vectors there too).
    pub(crate) small: &'a std::sync::Mutex<small::SmallKept>,
}

impl Wire<'_> {
    #[inline]
    fn ep(&self, peer: usize) -> Result<&Endpoint> {
        self.eps
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Internal(format!("rank {} has no endpoint to rank {peer}", self.rank)))
    }
}

/// A rank's buffers for one call.
pub(crate) struct Bufs<T: Element> {
    pub(crate) data: SharedBuf<T>,
    pub(crate) input: Option<SharedBuf<T>>,
    pub(crate) scratch: Option<SharedBuf<T>>,
    /// The regions the call has written so far (received, copied or reduced into): their
    /// values sit in this core's cache, which decides how they are best sent (see
    /// `exchange`). Kept for calls of [`TRACK_FROM`] bytes or more only (all of a smaller
    /// call's messages are short).
    written: Option<SmallVec<[Region; 4]>>,
    /// An empty input shell kept for a later call (this one has no input).
    spare: Option<SharedBuf<T>>,
}

#[cold]
fn in_use() -> Error {
    Error::Internal("a buffer is still held by a transfer after its step".into())
}

#[cold]
pub(super) fn outside(r: &Region) -> Error {
    Error::Internal(format!("schedule region {r:?} is outside its buffer"))
}

/// An error unless `from` and `into` have the same length.
pub(super) fn same_length(from: &Region, into: &Region) -> Result<()> {
    if from.len() == into.len() {
        return Ok(());
    }
    Err(Error::Internal(format!("combining regions of two lengths: {from:?} {into:?}")))
}

/// `dst[into] = src[from]`, or `dst[into] op= src[from]`: regions of two buffers, given
/// as their values.
pub(super) fn combine<T: Element>(
    src: &[T],
    from: &Region,
    dst: &mut [T],
    into: &Region,
    op: Option<ReduceOp>,
) -> Result<()> {
    let src = src.get(from.range.clone()).ok_or_else(|| outside(from))?;
    let dst = dst.get_mut(into.range.clone()).ok_or_else(|| outside(into))?;
    match op {
        None => dst.copy_from_slice(src),
        Some(op) => T::reduce(op, dst, src),
    }
    Ok(())
}

/// [`combine`] between two disjoint regions of one buffer's values `v` (schedules never
/// combine overlapping ones); a reduction's operand is copied out first.
pub(super) fn combine_within<T: Element>(
    v: &mut [T],
    from: &Region,
    into: &Region,
    op: Option<ReduceOp>,
) -> Result<()> {
    if from.range.end > v.len() || into.range.end > v.len() {
        return Err(outside(into));
    }
    match op {
        None => v.copy_within(from.range.clone(), into.range.start),
        Some(op) => {
            let operand: SmallVec<[T; 64]> = SmallVec::from_slice(&v[from.range.clone()]);
            T::reduce(op, &mut v[into.range.clone()], &operand);
        }
    }
    Ok(())
}

/// The values of a buffer the call may not have (none: no values).
fn view_of<T: Element>(b: Option<&mut SharedBuf<T>>) -> Result<&mut [T]> {
    match b {
        Some(b) => b.view().ok_or_else(in_use),
        None => Ok(&mut []),
    }
}

/// Two of a call's buffers (None for one it does not have).
type Pair<'a, T> = (Option<&'a mut SharedBuf<T>>, Option<&'a mut SharedBuf<T>>);

/// The buffers a communicator keeps from one call to the next (of one element type),
/// so that a call allocates none of its own: the shells the caller's vectors are put in
/// and taken out of ([`SharedBuf::replace`]), and the scratch.
pub(crate) struct Kept<T: Element> {
    data: Option<SharedBuf<T>>,
    input: Option<SharedBuf<T>>,
    scratch: Option<SharedBuf<T>>,
}

impl<T: Element> Default for Kept<T> {
    fn default() -> Self {
        Kept { data: None, input: None, scratch: None }
    }
}

/// A buffer of `values`, tracked (see [`SharedBuf::tracked`]) when `track`: `shell` when
/// it is free and of that kind, else a new one.
fn put<T: Element>(shell: Option<SharedBuf<T>>, values: Vec<T>, track: bool) -> SharedBuf<T> {
    let fresh = |values| if track { SharedBuf::tracked(values) } else { SharedBuf::new(values) };
    match shell {
        Some(mut b) if b.is_tracked() == track => match b.replace(values) {
            Ok(_) => b,
            Err(values) => fresh(values),
        },
        _ => fresh(values),
    }
}

/// The most regions a call notes as written (later ones go as not written: a cost in
/// speed only, see `Bufs::written`).
const WRITTEN_NOTES: usize = 64;

/// Calls whose data and scratch hold this many bytes or more get tracked buffers, whose
/// combines can run piece by piece (`pieces`); smaller ones save the cost per slice.
const TRACK_FROM: usize = 16 << 10;

impl<T: Element> Bufs<T> {
    /// Buffers for a call: `data`, the caller's `input` where the operation has one (an
    /// empty one counts as none), and `scratch` elements of room, in what `kept` holds
    /// where it can (scratch that is long enough and free).
    pub(crate) fn new(kept: Kept<T>, data: Vec<T>, input: Vec<T>, scratch: usize) -> Bufs<T> {
        let track = (data.len() + input.len() + scratch) * std::mem::size_of::<T>() >= TRACK_FROM;
        // With no input, the kept shell waits aside for a later call that has one.
        let (input, spare) = if input.capacity() > 0 {
            (Some(put(kept.input, input, track)), None)
        } else {
            (None, kept.input)
        };
        let scratch = match kept.scratch {
            // Unused by this call: kept as it is for the next.
            b if scratch == 0 => b,
            Some(b) if b.len() >= scratch && !b.in_use() && b.is_tracked() == track => Some(b),
            _ => Some(put(None, vec![T::zeroed(); scratch], track)),
        };
        let written = track.then(SmallVec::new);
        Bufs { data: put(kept.data, data, track), input, scratch, spare, written }
    }

    /// What to keep for the next call: the shells emptied (values not taken out are
    /// dropped here, never handed to a later call; a shell a transfer still holds is let
    /// go), and the scratch.
    pub(crate) fn into_kept(self) -> Kept<T> {
        let empty = |mut b: SharedBuf<T>| b.replace(Vec::new()).ok().map(|_| b);
        Kept {
            data: empty(self.data),
            input: self.input.and_then(empty).or(self.spare),
            scratch: self.scratch,
        }
    }

    fn slice(&self, r: &Region) -> Result<SharedSlice<T>> {
        let buf = match r.buf {
            Buf::Data => Some(&self.data),
            Buf::Input => self.input.as_ref(),
            Buf::Scratch => self.scratch.as_ref(),
        };
        match buf {
            Some(b) => b.slice(r.range.clone()).map_err(|_| outside(r)),
            // An empty region of a buffer the call does not have (a barrier's message).
            None if r.is_empty() => self.data.slice(0..0).map_err(|_| outside(r)),
            None => Err(outside(r)),
        }
    }

    /// The bytes of region `r`, when no transfer holds a part of its buffer.
    fn bytes(&mut self, r: &Region) -> Result<&[u8]> {
        let v = self.view(r.buf)?;
        let values = v.get(r.range.clone()).ok_or_else(|| outside(r))?;
        Ok(bytemuck::cast_slice(values))
    }

    fn view(&mut self, b: Buf) -> Result<&mut [T]> {
        let buf = match b {
            Buf::Data => Some(&mut self.data),
            Buf::Input => self.input.as_mut(),
            Buf::Scratch => self.scratch.as_mut(),
        };
        view_of(buf)
    }

    /// Two different buffers, `(a, b)`, each None where the call has none.
    fn pair(&mut self, a: Buf, b: Buf) -> Result<Pair<'_, T>> {
        let Bufs { data, input, scratch, .. } = self;
        let (data, input, scratch) = (Some(data), input.as_mut(), scratch.as_mut());
        Ok(match (a, b) {
            (Buf::Data, Buf::Input) => (data, input),
            (Buf::Data, Buf::Scratch) => (data, scratch),
            (Buf::Input, Buf::Data) => (input, data),
            (Buf::Input, Buf::Scratch) => (input, scratch),
            (Buf::Scratch, Buf::Data) => (scratch, data),
            (Buf::Scratch, Buf::Input) => (scratch, input),
            _ => return Err(Error::Internal("two views of one buffer".into())),
        })
    }

    /// Views of two different buffers: `(from, into)`.
    fn two(&mut self, a: Buf, b: Buf) -> Result<(&mut [T], &mut [T])> {
        let (a, b) = self.pair(a, b)?;
        Ok((view_of(a)?, view_of(b)?))
    }

    /// `into = from`, or `into = into op from` when `op` is given.
    fn apply(&mut self, from: &Region, into: &Region, op: Option<ReduceOp>) -> Result<()> {
        same_length(from, into)?;
        if from.buf == into.buf {
            return combine_within(self.view(from.buf)?, from, into, op);
        }
        let (src, dst) = self.two(from.buf, into.buf)?;
        combine(src, from, dst, into, op)
    }

    /// `into = from` (or `into op= from`) when both regions' values are free of the
    /// transfers in flight (`Ok(false)`, nothing done, otherwise); the regions lie in
    /// different buffers.
    fn try_apply_part(&mut self, from: &Region, into: &Region, op: Option<ReduceOp>) -> Result<bool> {
        // The input is never written.
        if from.len() != into.len() || from.buf == into.buf || into.buf == Buf::Input {
            return Ok(false);
        }
        let (Some(src), Some(dst)) = self.pair(from.buf, into.buf)? else { return Err(outside(from)) };
        let Some(a) = src.view_range(from.range.clone()) else { return Ok(false) };
        let Some(b) = dst.view_range(into.range.clone()) else { return Ok(false) };
        match op {
            None => b.copy_from_slice(a),
            Some(op) => T::reduce(op, b, a),
        }
        Ok(true)
    }

    /// Counts the data buffer's values as written by this call (see `written`): an
    /// allreduce's buffer holds what this core just computed, in practice (gradients,
    /// the previous call's result).
    pub(crate) fn data_just_written(&mut self) {
        let all = Region::data(0..self.data.len());
        self.wrote(&all);
    }

    /// Notes that the call wrote `r` (where it keeps such notes, and up to
    /// [`WRITTEN_NOTES`] of them: each send not made at once looks through them).
    fn wrote(&mut self, r: &Region) {
        if let Some(w) = &mut self.written {
            if !r.is_empty() && w.len() < WRITTEN_NOTES {
                w.push(r.clone());
            }
        }
    }

    /// Takes the data buffer out, if the transport let go of it.
    pub(crate) fn take_data(&mut self) -> Option<Vec<T>> {
        self.data.replace(Vec::new()).ok()
    }

    /// Takes the input buffer out, if the transport let go of it (an empty one when
    /// there was none).
    pub(crate) fn take_input(&mut self) -> Option<Vec<T>> {
        match &mut self.input {
            None => Some(Vec::new()),
            Some(b) => b.replace(Vec::new()).ok(),
        }
    }
}

/// Runs `sched` for call `seq`, reducing with `op`; fails with
/// [`Error::DeadlineExceeded`] once `limit` has passed (the timer is made only when
/// there is a limit).
pub(crate) async fn run<T: Element>(
    w: &Wire<'_>,
    seq: u16,
    sched: &Schedule,
    bufs: &mut Bufs<T>,
    op: ReduceOp,
    limit: Option<Duration>,
) -> Result<()> {
    can_start(w, sched)?;
    let mut watch = Watch::new(w.abort, limit);
    let layout = w.lanes.layout();
    for (s, step) in sched.steps.iter().enumerate() {
        for (from, into) in &step.copies {
            bufs.apply(from, into, None)?;
            bufs.wrote(into);
        }
        let mut left = None;
        if !step.xfers.is_empty() {
            let at = At { seq, step: s as u16, sync: sched.sync, op };
            left = exchange(w, &layout, at, step, bufs, &mut watch).await?;
            for x in &step.xfers {
                if let Xfer::Recv { into, .. } = x {
                    bufs.wrote(into);
                }
            }
        }
        let op_of = |c: &Combine| match c {
            Combine::Copy { .. } => None,
            Combine::Reduce { .. } => Some(op),
        };
        match left {
            // Applied piece by piece during the transfers: the pieces that could not be.
            Some(parts) => {
                for (c, part) in parts {
                    let (from, into) = pieces::restrict(&step.combines[c], &part);
                    bufs.apply(&from, &into, op_of(&step.combines[c]))?;
                }
            }
            None => {
                for c in &step.combines {
                    let (Combine::Copy { from, into } | Combine::Reduce { from, into }) = c;
                    bufs.apply(from, into, op_of(c))?;
                }
            }
        }
        for c in &step.combines {
            let (Combine::Copy { into, .. } | Combine::Reduce { into, .. }) = c;
            bufs.wrote(into);
        }
    }
    Ok(())
}

/// Whether a call may start `sched`: not on an aborted communicator, and not with more
/// steps than the tag layout numbers.
#[inline]
pub(super) fn can_start(w: &Wire<'_>, sched: &Schedule) -> Result<()> {
    if let Some(a) = w.abort.get() {
        return Err(Error::Aborted(a));
    }
    if sched.steps.len() > MAX_STEPS {
        return Err(Error::InvalidArgument(format!(
            "the schedule has {} steps, more than the tag layout's {MAX_STEPS}",
            sched.steps.len()
        )));
    }
    Ok(())
}

/// What a receive of `want` bytes from rank `peer` ended with, as the call's error.
pub(super) fn received(peer: usize, want: usize, r: ucxkit_transport::Result<TagInfo>) -> Result<()> {
    match r {
        Ok(info) if info.len == want => Ok(()),
        Ok(info) => Err(Error::Mismatch { rank: peer, got: Some(info.len), want }),
        Err(ucxkit_transport::Error::Truncated { .. }) => {
            Err(Error::Mismatch { rank: peer, got: None, want })
        }
        Err(source) => Err(Error::Transport { rank: peer, source }),
    }
}

/// The bytes a receive of `want` bytes from rank `peer` into a vector of its own
/// brought (`buf`, given how the receive `r` ended), or the call's error.
pub(super) fn landed_bytes(
    peer: usize,
    want: usize,
    r: ucxkit_transport::Result<TagInfo>,
    buf: &[u8],
) -> Result<&[u8]> {
    received(peer, want, r)?;
    buf.get(..want).filter(|_| buf.len() == want).ok_or(Error::Mismatch {
        rank: peer,
        got: Some(buf.len()),
        want,
    })
}

/// `r` cut into pieces of at most `seg` elements (one piece when it is shorter, or
/// empty). A large transfer moves as several messages with one tag, posted at once:
/// UCX matches messages of one tag between two endpoints in the order they were sent,
/// so the pieces land in order. (Off by default: see `DEFAULT_SEGMENT`.)
fn segments(r: &Region, seg: usize) -> impl Iterator<Item = Region> + '_ {
    let n = r.len().div_ceil(seg).max(1);
    let at = move |i: usize| r.range.start.saturating_add(i.saturating_mul(seg)).min(r.range.end);
    (0..n).map(move |i| Region { buf: r.buf, range: at(i)..at(i + 1) })
}

/// What ends a call's wait besides its transfers: an abort of the communicator and the
/// call's deadline (the timer made only when there is one, the abort's wake-up only once
/// the call has to wait).
pub(crate) struct Watch<'a> {
    abort: &'a AbortCell,
    aborted: Option<Pin<Box<tokio::sync::futures::Notified<'a>>>>,
    timer: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
}

impl<'a> Watch<'a> {
    /// Watches `abort`, and a deadline `limit` from now.
    pub(crate) fn new(abort: &'a AbortCell, limit: Option<Duration>) -> Watch<'a> {
        Watch { abort, aborted: None, timer: limit.map(|d| (d, Box::pin(tokio::time::sleep(d)))) }
    }

    /// Watches `abort`, and a deadline `end`: (the limit it reports, when it passes).
    pub(crate) fn ending(abort: &'a AbortCell, end: Option<(Duration, tokio::time::Instant)>) -> Watch<'a> {
        Watch { abort, aborted: None, timer: end.map(|(d, at)| (d, Box::pin(tokio::time::sleep_until(at)))) }
    }

    /// The error that ends the wait, if the communicator was aborted or the deadline
    /// passed (naming the ranks `pending` gives, whose transfers are still pending);
    /// otherwise pending, with the task woken when either happens.
    pub(crate) fn poll_end<P: IntoIterator<Item = usize>>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        pending: impl FnOnce() -> P,
    ) -> Poll<Error> {
        let abort = self.abort;
        // Registered before the check, so an abort between the two wakes the task.
        let wake = self.aborted.get_or_insert_with(|| {
            let mut n = Box::pin(abort.notify.notified());
            n.as_mut().enable();
            n
        });
        if abort.is_set() || wake.as_mut().poll(cx).is_ready() {
            if let Some(a) = abort.get() {
                return Poll::Ready(Error::Aborted(a));
            }
        }
        if let Some((d, sleep)) = self.timer.as_mut() {
            if sleep.as_mut().poll(cx).is_ready() {
                let mut waiting_on: Vec<usize> = pending().into_iter().collect();
                waiting_on.sort_unstable();
                waiting_on.dedup();
                return Poll::Ready(Error::DeadlineExceeded { after: *d, waiting_on });
            }
        }
        Poll::Pending
    }
}

/// Transfers shorter than this many bytes are short: their step posts its sends first.
const SHORT: usize = 1024;

/// One transfer of a step in flight.
enum InFlight<'w, T: Element> {
    Send {
        peer: usize,
        op: TagSend<SharedSlice<T>>,
    },
    /// `then`: the combine to apply to this piece's elements once it has landed.
    Recv {
        peer: usize,
        want: usize,
        then: Option<u16>,
        op: TagRecv<SharedSlice<T>>,
    },
    /// A transfer through a shared-memory lane (see `lane`); `then` as for `Recv`.
    LaneSend(Box<lane::LaneSend<'w, T>>),
    LaneRecv {
        then: Option<u16>,
        op: Box<lane::LaneRecv<T>>,
    },
    Done,
}

/// Empty transfers are left out on both sides (every rank knows the sizes), except in
/// a schedule that synchronises (`sync`: a barrier), where they are the point.
/// Posts one step's transfers and waits for all of them, polling them in place (no
/// allocation for the few transfers a step has). Receives are bound to their peer's
/// endpoint, so a peer's failure ends them. The first failure is returned at once.
/// Transfers that `layout` (the call's) says go by lane do (see `lane`).
async fn exchange<'w, T: Element>(
    w: &Wire<'w>,
    layout: &lane::Layout,
    at: At,
    st: &Step,
    bufs: &mut Bufs<T>,
    watch: &mut Watch<'_>,
) -> Result<Parts> {
    let At { seq, step, sync, op: reduce } = at;
    let xfers = &st.xfers[..];
    let mut flight: SmallVec<[InFlight<'w, T>; 2]> = SmallVec::with_capacity(xfers.len());
    let elem = std::mem::size_of::<T>().max(1);
    let seg = (w.segment / elem).max(1);
    // Large messages: receives first, so that the data lands in place where it would
    // otherwise wait for its receive in UCX's buffers and be copied again. Short ones
    // (all under SHORT bytes): sends first, as their receivers wait for them and an early
    // short message costs UCX one small copy.
    let short = xfers.iter().all(|x| match x {
        Xfer::Send { from: r, .. } | Xfer::Recv { into: r, .. } => r.len() * elem < SHORT,
    });
    let mut immediate = short;
    let one_way = !xfers.iter().any(|x| matches!(x, Xfer::Recv { .. }));
    let eager_max = w.eager.max_send(st.bytes_sent(elem), one_way);
    // Combines that run piece by piece as their receives' pieces land (see `pieces`; not
    // worth it for short messages), and the pieces of them that could not run early.
    let piecewise = if short { None } else { pieces::plan(st) };
    let mut left: Vec<(usize, Range<usize>)> = Vec::new();
    for sends in [short, !short] {
        for (i, x) in xfers.iter().enumerate() {
            match x {
                Xfer::Recv { peer, into } if !sends => {
                    if into.is_empty() && !sync {
                        continue;
                    }
                    let combine = piecewise.as_ref().and_then(|m| m.iter().position(|&x| x == i));
                    let combine = combine.and_then(|c| u16::try_from(c).ok());
                    if !sync && layout.takes(*peer, into.len() * elem) {
                        let at = lane::LaneAt { seq, step, peer: *peer };
                        let op = Box::new(lane::LaneRecv::start(w, at, into.clone())?);
                        flight.push(InFlight::LaneRecv { then: combine, op });
                        continue;
                    }
                    for part in segments(into, seg) {
                        flight.push(InFlight::Recv {
                            peer: *peer,
                            want: part.len() * elem,
                            then: combine,
                            op: w.ns.tag_recv_from(
                                w.ep(*peer)?,
                                tag(w.comm, seq, step, *peer),
                                EXACT,
                                bufs.slice(&part)?,
                            ),
                        });
                    }
                }
                Xfer::Send { peer, from } if sends => {
                    if from.is_empty() && !sync {
                        continue;
                    }
                    if !sync && layout.takes(*peer, from.len() * elem) {
                        let at = lane::LaneAt { seq, step, peer: *peer };
                        flight.push(InFlight::LaneSend(Box::new(lane::LaneSend::start(w, at, from, bufs)?)));
                        continue;
                    }
                    // A short message goes out from the buffer itself when UCX can send
                    // it during the call (no slice, future or request). Sends come before
                    // any receive holds a slice, so the buffer can be viewed until a send
                    // UCX could not finish at once holds one. (One piece only: the
                    // receiver expects the transfer in pieces of `seg`.)
                    if immediate && from.len() <= seg {
                        let t = tag(w.comm, seq, step, w.rank);
                        if let Ok(bytes) = bufs.bytes(from) {
                            let sent = w.ns.try_tag_send(w.ep(*peer)?, t, bytes);
                            if sent.map_err(|source| Error::Transport { rank: *peer, source })? {
                                continue;
                            }
                        }
                        immediate = false;
                    }
                    // Values this call wrote (received or reduced) sit modified in this
                    // core's cache, where a rendezvous has the receiver's core read them
                    // line by line across cores; UCX's eager protocol copies them out
                    // here instead (up to UCX_RNDV_SEND_NBR_THRESH, 256 KiB). 2-rank
                    // allreduce of 256 KiB: 154 -> 101 us. Other sends go eagerly up to
                    // the lengths `eager` allows only.
                    let to_mapped = w.eager_to.get(*peer).copied().unwrap_or(false);
                    let eager = (to_mapped && from.len() * elem <= eager_max)
                        || bufs.written.as_ref().is_some_and(|w| w.iter().any(|r| r.overlaps(from)));
                    for part in segments(from, seg) {
                        let (ep, t, b) = (w.ep(*peer)?, tag(w.comm, seq, step, w.rank), bufs.slice(&part)?);
                        let op = if eager { w.ns.tag_send_eager(ep, t, b) } else { w.ns.tag_send(ep, t, b) };
                        flight.push(InFlight::Send { peer: *peer, op });
                    }
                }
                _ => {}
            }
        }
    }
    let mut first: Option<Error> = None;
    // A lane's pieces wait on this task's own handling of notes and credits, so the
    // step's futures are polled together (`Worker::poll_joined`), not each spinning for
    // its own result.
    let joined = flight.iter().any(|f| matches!(f, InFlight::LaneSend(_) | InFlight::LaneRecv { .. }));
    let mut poll_all = |cx: &mut std::task::Context<'_>| {
        let mut pending = false;
        for f in flight.iter_mut() {
            let r = match f {
                InFlight::Send { peer, op } => match Pin::new(op).poll(cx) {
                    Poll::Pending => {
                        pending = true;
                        continue;
                    }
                    Poll::Ready((r, _)) => r.map_err(|source| Error::Transport { rank: *peer, source }),
                },
                InFlight::Recv { peer, want, then, op } => match Pin::new(op).poll(cx) {
                    Poll::Pending => {
                        pending = true;
                        continue;
                    }
                    Poll::Ready((r, piece)) => received(*peer, *want, r).and_then(|()| {
                        let at = piece.range();
                        // The piece's buffer let go first: its values are free.
                        drop(piece);
                        landed(bufs, st, then.take(), at, reduce, &mut left)
                    }),
                },
                InFlight::LaneSend(op) => match op.poll(w, cx) {
                    Poll::Pending => {
                        pending = true;
                        continue;
                    }
                    Poll::Ready(r) => r,
                },
                InFlight::LaneRecv { then, op } => {
                    let then = *then;
                    let mut on_piece = |b: &mut Bufs<T>, at| landed(b, st, then, at, reduce, &mut left);
                    match op.poll(w, bufs, cx, &mut on_piece) {
                        Poll::Pending => {
                            pending = true;
                            continue;
                        }
                        Poll::Ready(r) => r,
                    }
                }
                InFlight::Done => continue,
            };
            *f = InFlight::Done;
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        // Done, or failed: the transfers still pending may never end (a receive whose
        // sender sent something else), so the failure is returned at once and the call's
        // abort ends the peers' waits. Dropping the pending transfers leaves their
        // buffers with the transport until UCX lets go.
        if !pending || first.is_some() {
            return Poll::Ready(());
        }
        let peers = || {
            flight.iter().filter_map(|f| match f {
                InFlight::Send { peer, .. } | InFlight::Recv { peer, .. } => Some(*peer),
                InFlight::LaneSend(op) => Some(op.at.peer),
                InFlight::LaneRecv { op, .. } => Some(op.at.peer),
                InFlight::Done => None,
            })
        };
        watch.poll_end(cx, peers).map(|e| {
            first.get_or_insert(e);
        })
    };
    let worker = w.ns.worker();
    std::future::poll_fn(|cx| if joined { worker.poll_joined(cx, &mut poll_all) } else { poll_all(cx) })
        .await;
    match first {
        Some(e) => Err(e),
        None => Ok(piecewise.map(|_| left)),
    }
}

/// After a piece of a receive landed (elements `at` of its buffer, which no transfer
/// holds any more): applies the part of the step's combine `then` that it feeds, or,
/// where a transfer still holds the combine's other region, notes the part in `left`.
fn landed<T: Element>(
    bufs: &mut Bufs<T>,
    st: &Step,
    then: Option<u16>,
    at: Range<usize>,
    reduce: ReduceOp,
    left: &mut Vec<(usize, Range<usize>)>,
) -> Result<()> {
    let Some(c) = then else { return Ok(()) };
    let c = usize::from(c);
    let combine = st.combines.get(c).ok_or_else(|| Error::Internal(format!("no combine {c} in the step")))?;
    let (Combine::Copy { from, .. } | Combine::Reduce { from, .. }) = combine;
    let part = match (at.start.checked_sub(from.range.start), at.end.checked_sub(from.range.start)) {
        (Some(a), Some(b)) => a..b,
        _ => return Err(Error::Internal(format!("a piece {at:?} before its combine's region {from:?}"))),
    };
    let (from, into) = pieces::restrict(combine, &part);
    let r = matches!(combine, Combine::Reduce { .. }).then_some(reduce);
    if !bufs.try_apply_part(&from, &into, r)? {
        left.push((c, part));
    }
    Ok(())
}

/// Where a step stands: its call, its number, whether its empty messages count (a
/// barrier's) and the call's reduction.
#[derive(Clone, Copy)]
struct At {
    seq: u16,
    step: u16,
    sync: bool,
    op: ReduceOp,
}

/// For a step whose combines ran piece by piece, the pieces (combine, elements) left to
/// apply after its transfers; None for a step whose combines all wait for them.
type Parts = Option<Vec<(usize, Range<usize>)>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_region_without_overflow() {
        let r = Region::data(3..13);
        let parts: Vec<_> = segments(&r, 4).map(|p| p.range).collect();
        assert_eq!(parts, vec![3..7, 7..11, 11..13]);
        assert_eq!(segments(&r, usize::MAX).map(|p| p.range).collect::<Vec<_>>(), vec![3..13]);
        assert_eq!(segments(&Region::data(5..5), 4).map(|p| p.range).collect::<Vec<_>>(), vec![5..5]);
    }
}
