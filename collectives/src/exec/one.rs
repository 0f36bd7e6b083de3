//! Small calls of one step with sends and at most one receive ([`OneStep`]: every 2-rank
//! small call but a barrier's, a tree's root and leaves where the tree is one level),
//! run without the step loop of [`super::small`], whose nested futures cost as much as
//! such a call's messages.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use smallvec::SmallVec;
use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{Either, IoBufMut, Slice, TagInfo, TagRecv};

use super::small::{poll_sends, send, Queued, SmallKept};
use super::{can_start, combine, landed_bytes, outside, received, Watch, Wire};
use crate::error::{Error, Result};
use crate::schedule::{Buf, Combine, Region, Schedule, Xfer};
use crate::tag::tag;
use crate::{Element, ReduceOp};

/// A small call of one step with sends (none from scratch) and at most one receive and
/// nothing but copies out of the input before them (two ranks' allreduce, allgather,
/// all-to-all and reduce-scatter; a one-level tree's root and leaves): run by
/// [`start_one`] and [`finish_one`] without the step loop, whose nested futures cost as
/// much as such a call's messages (2-rank broadcast of 8 B, busy: 0.21-0.25 -> 0.17-0.19
/// us). Found once per plan.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OneStep {
    sends: SmallVec<[(usize, Region); 2]>,
    recv: Option<(usize, Region)>,
    /// The receive may land straight in the caller's vector: it lands in the data and
    /// nothing combines it (the call's copies are made before it is posted).
    direct: bool,
}

impl OneStep {
    /// `sched` as such a call, if it is one.
    pub(crate) fn of(sched: &Schedule) -> Option<OneStep> {
        let [step] = &sched.steps[..] else { return None };
        if sched.sync
            || step.copies.iter().any(|(from, into)| from.buf != Buf::Input || into.buf != Buf::Data)
        {
            return None;
        }
        // Checked before anything is collected: the schedules of calls made on the spot
        // (the `_v` forms, scan) are asked every call, and most have several receives.
        let mut recv = None;
        for x in &step.xfers {
            match x {
                Xfer::Send { from, .. } if !from.is_empty() && from.buf != Buf::Scratch => {}
                Xfer::Recv { peer, into } if recv.is_none() && !into.is_empty() => recv = Some((*peer, into)),
                _ => return None,
            }
        }
        // What arrives is used as it is: it lands in the data and nothing combines it, or
        // it lands in scratch and every combine reads it whole, into the data (so no
        // combine changes what a later one reads).
        let whole =
            |from: &Region, into: &Region| recv.is_some_and(|(_, r)| r == from) && into.buf == Buf::Data;
        let combines_ok = step.combines.iter().all(|c| match c {
            Combine::Copy { from, into } | Combine::Reduce { from, into } => whole(from, into),
        });
        let lands = match recv {
            Some((_, r)) if r.buf == Buf::Data => step.combines.is_empty(),
            Some((_, r)) => r.buf == Buf::Scratch && !step.combines.is_empty(),
            None => step.combines.is_empty(),
        };
        let direct = recv.is_some_and(|(_, r)| r.buf == Buf::Data) && step.combines.is_empty();
        if !(combines_ok && lands) {
            return None;
        }
        let sends = step.xfers.iter().filter_map(|x| match x {
            Xfer::Send { peer, from } => Some((*peer, from.clone())),
            Xfer::Recv { .. } => None,
        });
        Some(OneStep { sends: sends.collect(), recv: recv.map(|(p, r)| (p, r.clone())), direct })
    }
}

/// Where a one-step call's receive lands: bytes, or its region of the caller's vector,
/// lent whole.
type Landing<T> = Either<Vec<u8>, Slice<Box<[T]>>>;

/// What a one-step call waits for once started: the sends UCX did not take during the
/// call (sent from copies), and its receive, where it had not landed (from whom, into
/// which region, and the transfer).
pub(crate) struct Waiting<T: Element> {
    queued: Queued,
    recv: Option<(usize, Region, TagRecv<Landing<T>>)>,
    /// The call's deadline: the limit it reports, and when it passes.
    end: Option<(Duration, tokio::time::Instant)>,
}

/// Starts call `seq` of `sched`, a one-step call of shape `one` (checked as the step
/// loop checks a call at its start), on `data` and `input`, in plain code: its copies,
/// its sends (those UCX takes during the call; the others from copies) and its receive,
/// posted. Done (None) where every send went and the receive found its message arrived;
/// else what [`finish_one`] awaits. A receive into the data that nothing combines lands
/// straight in the caller's vector, lent to the transport meanwhile: `data` is `None`
/// until it lands (and after an error, where the transport still holds it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_one<T: Element>(
    w: &Wire<'_>,
    seq: u16,
    sched: &Schedule,
    one: &OneStep,
    data: &mut Option<Vec<T>>,
    input: &[T],
    op: ReduceOp,
    limit: Option<Duration>,
) -> Result<Option<Waiting<T>>> {
    let end = || limit.map(|d| (d, tokio::time::Instant::now() + d));
    can_start(w, sched)?;
    let step = only_step(sched)?;
    let d = data.as_mut().ok_or_else(no_data)?;
    for (from, into) in &step.copies {
        combine(input, from, d, into, None)?;
    }
    // Sends UCX could not take during the call (rare: the vector allocates then only).
    let mut queued: Queued = Vec::new();
    for (peer, from) in &one.sends {
        let src: &[T] = if from.buf == Buf::Input { input } else { d };
        let bytes: &[u8] = bytemuck::cast_slice(src.get(from.range.clone()).ok_or_else(|| outside(from))?);
        send(w, *peer, tag(w.comm, seq, 0, w.rank), bytes, true, &mut queued)?;
    }
    let Some((peer, into)) = &one.recv else {
        // Sends only (a tree's root): done, unless some wait in the queue.
        return Ok((!queued.is_empty()).then(|| Waiting { queued, recv: None, end: end() }));
    };
    let ep = w.ep(*peer)?;
    // Lent as a boxed slice: a vector with room past its length is shrunk the first time
    // (one reallocation), and the vector the call gives back has none. Not while sends
    // wait in the queue: one of them failing would drop the receive, and with it the
    // caller's vector, where it may have landed already.
    let size = std::mem::size_of::<T>();
    let lend = |d: &Vec<T>| one.direct && queued.is_empty() && into.range.end <= d.len();
    let bytes = into.range.start * size..into.range.end * size;
    let landing = match data.take() {
        Some(d) if lend(&d) => match d.into_boxed_slice().into_slice_mut(bytes) {
            Ok(region) => Either::Right(region),
            Err((_, d)) => {
                *data = Some(d.into_vec());
                Either::Left(SmallKept::take_landing(w.small, into.len() * size))
            }
        },
        d => {
            *data = d;
            Either::Left(SmallKept::take_landing(w.small, into.len() * size))
        }
    };
    let mut op_recv = w.ns.tag_recv_from(ep, tag(w.comm, seq, 0, *peer), EXACT, landing);
    if queued.is_empty() {
        if let Some((r, got)) = op_recv.take_done() {
            return land(w, step, into, *peer, r, got, data, op).map(|()| None);
        }
    }
    Ok(Some(Waiting { queued, recv: Some((*peer, into.clone(), op_recv)), end: end() }))
}

/// Ends a one-step call that had to wait (see [`start_one`]): awaits its sends and its
/// receive (failing as the communicator's abort or the deadline says) and lands the
/// receive.
pub(crate) async fn finish_one<T: Element>(
    w: &Wire<'_>,
    sched: &Schedule,
    waiting: &mut Waiting<T>,
    data: &mut Option<Vec<T>>,
    op: ReduceOp,
) -> Result<()> {
    let Waiting { queued, recv, end } = waiting;
    let end = *end;
    let mut watch: Option<Watch<'_>> = None;
    if !queued.is_empty() {
        sent(w, queued, &mut watch, end).await?;
    }
    let Some((peer, into, op_recv)) = recv else {
        return Ok(());
    };
    let peer = *peer;
    let (r, got) = std::future::poll_fn(|cx| match Pin::new(&mut *op_recv).poll(cx) {
        Poll::Ready(done) => Poll::Ready(Ok(done)),
        Poll::Pending => {
            let watch = watch.get_or_insert_with(|| Watch::ending(w.abort, end));
            watch.poll_end(cx, || [peer]).map(Err)
        }
    })
    .await?;
    land(w, only_step(sched)?, into, peer, r, got, data, op)
}

/// The step of a one-step schedule.
#[inline(always)]
fn only_step(sched: &Schedule) -> Result<&crate::schedule::Step> {
    match &sched.steps[..] {
        [step] => Ok(step),
        _ => Err(Error::Internal("a one-step call of a schedule of several steps".into())),
    }
}

fn no_data() -> Error {
    Error::Internal("a one-step call without its data".into())
}

/// Lands what the receive from `peer` into region `into` got (`r`, `got`): the caller's
/// vector back into `data` where it was lent, else the bytes copied or combined into it
/// as `step` says.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn land<T: Element>(
    w: &Wire<'_>,
    step: &crate::schedule::Step,
    into: &Region,
    peer: usize,
    r: ucxkit_transport::Result<TagInfo>,
    got: Landing<T>,
    data: &mut Option<Vec<T>>,
    op: ReduceOp,
) -> Result<()> {
    let want = into.len() * std::mem::size_of::<T>();
    let got = match got {
        Either::Right(direct) => {
            *data = Some(direct.into_inner().into_vec());
            return received(peer, want, r);
        }
        Either::Left(got) => got,
    };
    let landed = match data.as_mut() {
        Some(data) => combine_landed(step, into, peer, r, &got, data, op),
        None => Err(no_data()),
    };
    SmallKept::give_landing(w.small, got);
    landed
}

/// Copies or combines what a receive from `peer` into region `into` got (`r`, `got`)
/// into `data`, as `step` says.
#[inline(always)]
fn combine_landed<T: Element>(
    step: &crate::schedule::Step,
    into: &Region,
    peer: usize,
    r: ucxkit_transport::Result<TagInfo>,
    got: &[u8],
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let want = into.len() * std::mem::size_of::<T>();
    let got = landed_bytes(peer, want, r, got)?;
    // The received values, as elements (copied where the bytes are not aligned for them).
    let owned: Vec<T>;
    let values: &[T] = match bytemuck::try_cast_slice(got) {
        Ok(v) => v,
        Err(_) => {
            let mut v = vec![T::zeroed(); want / std::mem::size_of::<T>().max(1)];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(got);
            owned = v;
            &owned
        }
    };
    let whole = Region { buf: Buf::Scratch, range: 0..values.len() };
    if step.combines.is_empty() {
        return combine(values, &whole, data, &Region { buf: Buf::Data, range: into.range.clone() }, None);
    }
    for c in &step.combines {
        let (Combine::Copy { into, .. } | Combine::Reduce { into, .. }) = c;
        let by = matches!(c, Combine::Reduce { .. }).then_some(op);
        combine(values, &whole, data, into, by)?;
    }
    Ok(())
}

/// Waits for the `queued` sends of a one-step call (each taken once it ends), failing
/// with the first one's error, or as `watch` says (made on the first wait, with the
/// deadline `end`).
async fn sent<'w>(
    w: &Wire<'w>,
    queued: &mut Queued,
    watch: &mut Option<Watch<'w>>,
    end: Option<(Duration, tokio::time::Instant)>,
) -> Result<()> {
    std::future::poll_fn(|cx| {
        match poll_sends(queued, cx) {
            (_, Some(e)) => return Poll::Ready(Err(e)),
            (false, None) => return Poll::Ready(Ok(())),
            (true, None) => {}
        }
        let watch = watch.get_or_insert_with(|| Watch::ending(w.abort, end));
        let waiting = || queued.iter().filter(|(_, s)| s.is_some()).map(|(p, _)| *p).collect::<Vec<_>>();
        watch.poll_end(cx, waiting).map(Err)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Step;

    /// Which one-step receives may land straight in the caller's vector: those into the
    /// data that nothing combines (a broadcast leaf's; an allgather's or all-to-all's, past
    /// the start or behind a copy); not a 2-rank allreduce's (into scratch, then reduced).
    #[test]
    fn direct_receives_are_uncombined_data_ones() {
        use crate::schedule::{doubling, ring, tree};
        let direct = |s: &Schedule| OneStep::of(s).map(|o| o.direct);
        assert_eq!(direct(&tree::knomial_bcast(2, 1, 0, 4, 2)), Some(true));
        // The root sends only.
        assert_eq!(direct(&tree::knomial_bcast(2, 0, 0, 4, 2)), Some(false));
        assert_eq!(direct(&doubling::allreduce(2, 0, 4)), Some(false));
        let recv = |into| Xfer::Recv { peer: 1, into };
        let step = |xfers: Vec<Xfer>, copies| Schedule {
            steps: vec![Step { xfers, copies, ..Step::default() }],
            scratch: 0,
            sync: false,
        };
        assert_eq!(direct(&step(vec![recv(Region::data(2..4))], vec![])), Some(true));
        let copy = vec![(Region::input(0..2), Region::data(2..4))];
        assert_eq!(direct(&step(vec![recv(Region::data(0..2))], copy)), Some(true));
        // An allgather's receive lands in part of the data, beside this rank's block: on
        // rank 0 after it, on rank 1 before it.
        let blocks = crate::schedule::even_blocks(4, 2);
        assert_eq!(direct(&ring::allgather(2, 0, &blocks)), Some(true));
        assert_eq!(direct(&ring::allgather(2, 1, &blocks)), Some(true));
        assert_eq!(direct(&ring::reduce_scatter(2, 0, &blocks)), Some(false));
    }

    /// Which schedules run as one step: one step, sends (not from scratch) and at most
    /// one receive, copies only out of the input, combines reading the whole receive
    /// into the data; the real 2-rank schedules of five operations do, and a one-level
    /// tree's root and leaves.
    #[test]
    fn one_step_calls_are_recognised() {
        use crate::schedule::{doubling, even_blocks, linear, ring, tree};
        let one = |s: &Schedule| OneStep::of(s).is_some();
        for r in 0..2 {
            let b = even_blocks(8, 2);
            let yes = [
                doubling::allreduce(2, r, 4),
                ring::allgather(2, r, &b),
                ring::reduce_scatter(2, r, &b),
                linear::direct_alltoall(2, r, &b, &b),
                tree::knomial_bcast(2, r, 0, 4, 2),
            ];
            for s in &yes {
                assert!(one(s), "{s:?}");
            }
        }
        for r in 0..4 {
            // Radix 4 on four ranks: the root sends to three leaves in one step.
            assert!(one(&tree::knomial_bcast(4, r, 0, 4, 4)), "rank {r}");
        }
        // Radix 2: the middle rank receives, then sends.
        assert!(!one(&tree::knomial_bcast(4, 2, 0, 4, 2)));
        let step = |xfers: Vec<Xfer>, combines: Vec<Combine>| Schedule {
            steps: vec![Step { xfers, combines, ..Step::default() }],
            scratch: 4,
            sync: false,
        };
        let send = |from| Xfer::Send { peer: 1, from };
        let recv = |into| Xfer::Recv { peer: 1, into };
        let no = [
            // Two steps; two receives; a send of scratch; a receive into scratch left
            // there; a combine of part of the receive; a barrier; an empty receive.
            doubling::allreduce(4, 0, 4),
            step(vec![recv(Region::data(0..2)), Xfer::Recv { peer: 0, into: Region::data(2..4) }], vec![]),
            step(vec![send(Region::scratch(0..2))], vec![]),
            step(vec![recv(Region::scratch(0..2))], vec![]),
            step(
                vec![recv(Region::scratch(0..2))],
                vec![Combine::Reduce { from: Region::scratch(0..1), into: Region::data(0..1) }],
            ),
            Schedule { sync: true, ..step(vec![send(Region::data(0..0))], vec![]) },
            // A receive into the data that a combine then reads; combines with nothing
            // received.
            step(
                vec![recv(Region::data(0..2))],
                vec![Combine::Reduce { from: Region::data(0..2), into: Region::data(2..4) }],
            ),
            step(
                vec![send(Region::data(0..2))],
                vec![Combine::Copy { from: Region::data(0..2), into: Region::data(2..4) }],
            ),
            step(vec![recv(Region::data(0..0))], vec![]),
        ];
        for s in &no {
            assert!(!one(s), "{s:?}");
        }
    }
}
