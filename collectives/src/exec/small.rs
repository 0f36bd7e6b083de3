//! The executor for small calls (every buffer of the call together under [`SMALL`]
//! bytes): the values stay in the caller's vectors, each send goes out from them during
//! the call where UCX can (`try_tag_send`), and each receive lands in a small vector the
//! communicator keeps and is copied into place. Such a call makes no shared buffer, slice
//! or timer, which is most of what a call of a few bytes costs above its messages.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use smallvec::SmallVec;
use ucxkit_transport::{tag::EXACT, Endpoint, TagRecv, TagSend};

use super::{can_start, combine, combine_within, landed_bytes, outside, same_length, Watch, Wire};
use crate::error::{Error, Result};
use crate::schedule::{Buf, Combine, Region, Schedule, Step, Xfer};
use crate::tag::tag;
use crate::{Element, ReduceOp};

/// Calls whose data, input and scratch hold fewer bytes than this together run here.
pub(crate) const SMALL: usize = 1024;

/// What small calls keep from one to the next: the scratch (as 8-byte words, which any
/// element type can be viewed as) and the vectors receives land in.
#[derive(Default)]
pub(crate) struct SmallKept {
    scratch: Vec<u64>,
    landing: Vec<Vec<u8>>,
}

/// The most landing vectors one-step calls keep ([`SmallKept::give_landing`]; the step
/// loop keeps as many as a step of its calls receives).
const LANDINGS: usize = 4;

impl SmallKept {
    /// An empty vector with room for `bytes` for a one-step call's receive: one `kept`
    /// holds where it has one (none while a step-loop call has taken them all, and the
    /// call allocates).
    #[inline]
    pub(crate) fn take_landing(kept: &Mutex<SmallKept>, bytes: usize) -> Vec<u8> {
        let mut v = kept.lock().unwrap_or_else(PoisonError::into_inner).landing.pop().unwrap_or_default();
        v.clear();
        v.reserve(bytes);
        v
    }

    /// Gives a one-step call's landing vector back to `kept`, unless it is large or
    /// enough are kept.
    #[inline]
    pub(crate) fn give_landing(kept: &Mutex<SmallKept>, v: Vec<u8>) {
        if v.capacity() <= SMALL {
            let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
            if kept.landing.len() < LANDINGS {
                kept.landing.push(v);
            }
        }
    }
}

/// Whether a call of `elems` elements of `elem` bytes in all (data, input and scratch)
/// runs here, when transfers longer than `segment` bytes are cut in pieces (a small call
/// sends none of those).
pub(crate) fn fits(elems: usize, elem: usize, segment: usize) -> bool {
    let bytes = elems.saturating_mul(elem);
    bytes < SMALL && bytes <= segment
}

/// A small call's buffers, as the schedule names them.
pub(super) struct Views<'a, T> {
    pub(super) data: &'a mut [T],
    pub(super) input: &'a [T],
    pub(super) scratch: &'a mut [T],
}

impl<T: Element> Views<'_, T> {
    fn get(&self, r: &Region) -> Result<&[T]> {
        let b: &[T] = match r.buf {
            Buf::Data => self.data,
            Buf::Input => self.input,
            Buf::Scratch => self.scratch,
        };
        b.get(r.range.clone()).ok_or_else(|| outside(r))
    }

    fn get_mut(&mut self, r: &Region) -> Result<&mut [T]> {
        let b: &mut [T] = match r.buf {
            Buf::Data => self.data,
            Buf::Scratch => self.scratch,
            // The input is never written.
            Buf::Input => return Err(outside(r)),
        };
        b.get_mut(r.range.clone()).ok_or_else(|| outside(r))
    }

    /// `into = from`, or `into = into op from` when `op` is given.
    fn apply(&mut self, from: &Region, into: &Region, op: Option<ReduceOp>) -> Result<()> {
        same_length(from, into)?;
        let Views { data, input, scratch } = self;
        let (src, dst): (&[T], &mut [T]) = match (from.buf, into.buf) {
            (Buf::Data, Buf::Scratch) => (data, scratch),
            (Buf::Input, Buf::Scratch) => (input, scratch),
            (Buf::Scratch, Buf::Data) => (scratch, data),
            (Buf::Input, Buf::Data) => (input, data),
            (_, Buf::Input) => return Err(outside(into)),
            (_, Buf::Data) => return combine_within(data, from, into, op),
            (_, Buf::Scratch) => return combine_within(scratch, from, into, op),
        };
        combine(src, from, dst, into, op)
    }
}

/// Runs `sched` for call `seq` on `data` (written) and `input` (read), with the scratch
/// and landing vectors of `kept`, reducing with `op`; fails with
/// [`Error::DeadlineExceeded`] once `limit` has passed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run<T: Element>(
    w: &Wire<'_>,
    seq: u16,
    sched: &Schedule,
    data: &mut [T],
    input: &[T],
    kept: &mut SmallKept,
    op: ReduceOp,
    limit: Option<Duration>,
) -> Result<()> {
    can_start(w, sched)?;
    // The deadline counts from here; its timer is made only if the call has to wait.
    let end = limit.map(|d| (d, tokio::time::Instant::now() + d));
    let words = (sched.scratch * std::mem::size_of::<T>()).div_ceil(8);
    if kept.scratch.len() < words {
        kept.scratch.resize(words, 0);
    }
    let scratch: &mut [T] = bytemuck::cast_slice_mut(&mut kept.scratch[..]);
    let scratch = scratch.get_mut(..sched.scratch).ok_or_else(|| Error::Internal("scratch".into()))?;
    let mut v = Views { data, input, scratch };
    let mut watch = None;
    for (s, step) in sched.steps.iter().enumerate() {
        for (from, into) in &step.copies {
            v.apply(from, into, None)?;
        }
        if !step.xfers.is_empty() {
            let at = (seq, s as u16, sched.sync);
            exchange(w, at, step, &mut v, &mut kept.landing, &mut watch, end, true).await?;
        }
        for c in &step.combines {
            match c {
                Combine::Copy { from, into } => v.apply(from, into, None)?,
                Combine::Reduce { from, into } => v.apply(from, into, Some(op))?,
            }
        }
    }
    Ok(())
}

/// Sends from copies still in flight, by peer (each taken once it ends).
pub(super) type Queued = Vec<(usize, Option<TagSend<Vec<u8>>>)>;

/// Sends `bytes` to rank `peer` with tag `t`: during the call, when `now` and nothing
/// is `queued` yet and UCX takes them; else from a copy, queued behind the others (the
/// endpoint is busy, so the later sends queue too).
pub(super) fn send(
    w: &Wire<'_>,
    peer: usize,
    t: u64,
    bytes: &[u8],
    now: bool,
    queued: &mut Queued,
) -> Result<()> {
    let ep = w.ep(peer)?;
    if now && queued.is_empty() {
        match w.ns.try_tag_send(ep, t, bytes) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(source) => return Err(Error::Transport { rank: peer, source }),
        }
    }
    queue(w, ep, peer, t, bytes, queued);
    Ok(())
}

/// Queues a send of a copy of `bytes` (out of line: rare, and its code would make every
/// send's frame larger).
#[cold]
#[inline(never)]
fn queue(w: &Wire<'_>, ep: &Endpoint, peer: usize, t: u64, bytes: &[u8], queued: &mut Queued) {
    queued.push((peer, Some(w.ns.tag_send(ep, t, bytes.to_vec()))));
}

/// Polls the sends of `queued` still in flight: whether one is still pending, and the
/// first error of those that ended now.
pub(super) fn poll_sends(queued: &mut Queued, cx: &mut std::task::Context<'_>) -> (bool, Option<Error>) {
    let (mut pending, mut failed) = (false, None);
    for (peer, send) in queued.iter_mut() {
        let Some(op) = send.as_mut() else { continue };
        match Pin::new(op).poll(cx) {
            Poll::Pending => pending = true,
            Poll::Ready((r, _)) => {
                *send = None;
                if let Err(source) = r {
                    failed.get_or_insert(Error::Transport { rank: *peer, source });
                }
            }
        }
    }
    (pending, failed)
}

/// A receive in flight: the peer, the region it fills and its length in bytes.
struct Landing<'s> {
    peer: usize,
    into: &'s Region,
    want: usize,
    op: Option<TagRecv<Vec<u8>>>,
}

/// Sends one step's messages (from the buffers themselves where UCX takes them during
/// the call, else from a copy), posts its receives into landing vectors from `pool`,
/// and waits for all of them, copying each into place as it lands (its vector back to
/// `pool`). The first failure is returned at once (the transfers still pending are
/// dropped: their vectors stay with the transport until UCX lets go). `immediate`: try
/// the first send during the call (the calls' way; false queues them all, as when the
/// endpoint is busy).
#[allow(clippy::too_many_arguments)]
async fn exchange<'w, T: Element>(
    w: &Wire<'w>,
    (seq, step, sync): (u16, u16, bool),
    st: &Step,
    v: &mut Views<'_, T>,
    pool: &mut Vec<Vec<u8>>,
    watch: &mut Option<Watch<'w>>,
    end: Option<(Duration, tokio::time::Instant)>,
    immediate: bool,
) -> Result<()> {
    // Sends UCX could not take during the call (rare: the vector allocates then only).
    let mut sends: Queued = Vec::new();
    for x in &st.xfers {
        let Xfer::Send { peer, from } = x else { continue };
        if from.is_empty() && !sync {
            continue;
        }
        let bytes: &[u8] = bytemuck::cast_slice(v.get(from)?);
        send(w, *peer, tag(w.comm, seq, step, w.rank), bytes, immediate, &mut sends)?;
    }
    let mut recvs: SmallVec<[Landing<'_>; 2]> = SmallVec::new();
    for x in &st.xfers {
        let Xfer::Recv { peer, into } = x else { continue };
        if into.is_empty() && !sync {
            continue;
        }
        let want = into.len() * std::mem::size_of::<T>();
        let mut buf = pool.pop().unwrap_or_default();
        buf.clear();
        buf.reserve(want);
        let op = w.ns.tag_recv_from(w.ep(*peer)?, tag(w.comm, seq, step, *peer), EXACT, buf);
        recvs.push(Landing { peer: *peer, into, want, op: Some(op) });
    }
    // Boxed: errors are rare and large, and this future's room is every small call's.
    let mut first: Option<Box<Error>> = None;
    std::future::poll_fn(|cx| {
        let (mut pending, failed) = poll_sends(&mut sends, cx);
        if let Some(e) = failed {
            first.get_or_insert_with(|| Box::new(e));
        }
        for r in recvs.iter_mut() {
            let Some(op) = r.op.as_mut() else { continue };
            let (res, buf) = match Pin::new(op).poll(cx) {
                Poll::Pending => {
                    pending = true;
                    continue;
                }
                Poll::Ready(done) => done,
            };
            r.op = None;
            let landed = landed_bytes(r.peer, r.want, res, &buf).and_then(|got| {
                bytemuck::cast_slice_mut::<T, u8>(v.get_mut(r.into)?).copy_from_slice(got);
                Ok(())
            });
            pool.push(buf);
            if let Err(e) = landed {
                first.get_or_insert_with(|| Box::new(e));
            }
        }
        if !pending || first.is_some() {
            return Poll::Ready(());
        }
        let watch = watch.get_or_insert_with(|| Watch::ending(w.abort, end));
        let peers = || {
            let sending = sends.iter().filter(|(_, op)| op.is_some()).map(|(p, _)| *p);
            let receiving = recvs.iter().filter(|r| r.op.is_some()).map(|r| r.peer);
            sending.chain(receiving)
        };
        watch.poll_end(cx, peers).map(|e| {
            first.get_or_insert_with(|| Box::new(e));
        })
    })
    .await;
    first.map_or(Ok(()), |e| Err(*e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Landing vectors come back empty with the room asked for, reused; large ones and
    /// those beyond [`LANDINGS`] are let go.
    #[test]
    fn landings_are_reused_empty_and_bounded() {
        let kept = Mutex::new(SmallKept::default());
        let mut v = SmallKept::take_landing(&kept, 8);
        assert!(v.is_empty() && v.capacity() >= 8);
        v.extend_from_slice(&[1; 8]);
        let at = v.as_ptr();
        SmallKept::give_landing(&kept, v);
        let again = SmallKept::take_landing(&kept, 4);
        assert!(again.is_empty() && again.as_ptr() == at, "the kept vector, emptied");
        SmallKept::give_landing(&kept, Vec::with_capacity(SMALL + 1));
        assert_eq!(kept.lock().unwrap().landing.len(), 0, "a large vector is not kept");
        for _ in 0..LANDINGS + 2 {
            SmallKept::give_landing(&kept, Vec::with_capacity(16));
        }
        assert_eq!(kept.lock().unwrap().landing.len(), LANDINGS);
    }

    #[test]
    fn small_calls_are_those_under_the_limit_and_one_piece_each() {
        let table = [
            // (elements, element size, segment, fits)
            (0, 4, usize::MAX, true),
            (2, 4, usize::MAX, true),
            (255, 4, usize::MAX, true),
            (256, 4, usize::MAX, false),
            (usize::MAX, 8, usize::MAX, false),
            (16, 8, 64, false),
            (16, 8, 128, true),
        ];
        for (elems, elem, seg, want) in table {
            assert_eq!(fits(elems, elem, seg), want, "{elems} x {elem} B, segment {seg}");
        }
    }

    #[test]
    fn views_combine_across_and_within_buffers() {
        let mut data = [1u32, 2, 3, 4];
        let input = [10u32, 20, 30, 40];
        let mut scratch = [0u32; 2];
        let mut v = Views { data: &mut data, input: &input, scratch: &mut scratch };
        v.apply(&Region::input(2..4), &Region::scratch(0..2), None).unwrap();
        v.apply(&Region::scratch(0..2), &Region::data(0..2), Some(ReduceOp::Sum)).unwrap();
        v.apply(&Region::data(0..2), &Region::data(2..4), Some(ReduceOp::Max)).unwrap();
        assert!(v.apply(&Region::data(0..2), &Region::input(0..2), None).is_err());
        assert!(v.apply(&Region::data(0..2), &Region::data(3..5), None).is_err());
        assert!(v.apply(&Region::data(0..1), &Region::scratch(0..2), None).is_err());
        assert_eq!(data, [31, 42, 31, 42]);
        assert_eq!(scratch, [30, 40]);
    }

    /// One step between two ranks, each sending its data and receiving the other's into
    /// scratch: with rank 0's send queued (a copy, as when the endpoint is busy) and rank
    /// 1's made during the call, both land whole, and each landing vector goes back to
    /// its pool.
    #[tokio::test]
    async fn queued_and_immediate_sends_land_in_place() {
        use ucxkit_transport::namespace::COLLECTIVES;
        use ucxkit_transport::ProgressMode;

        let mesh = ucxkit_testkit::workers::mesh_with("posix,self", 2, ProgressMode::Event).await;
        let ns: Vec<_> = mesh.workers.iter().map(|w| w.namespace(COLLECTIVES).expect("namespace")).collect();
        let abort = crate::abort::AbortCell::default();
        let lanes = crate::exec::lane::Lanes::new(2, true);
        let small = Mutex::new(SmallKept::default());
        let wire = |r: usize| Wire {
            ns: &ns[r],
            segment: usize::MAX,
            abort: &abort,
            eps: &mesh.eps[r],
            rank: r,
            comm: 3,
            lanes: &lanes,
            eager_to: &[],
            eager: crate::exec::Eager::Off,
            small: &small,
        };
        let (w0, w1) = (wire(0), wire(1));
        let step = |peer| Step {
            xfers: vec![
                Xfer::Send { peer, from: Region::data(0..3) },
                Xfer::Recv { peer, into: Region::scratch(1..4) },
            ],
            ..Step::default()
        };
        let (s0, s1) = (step(1), step(0));
        let (mut d0, mut d1) = ([1u32, 2, 3], [10u32, 20, 30]);
        let (mut x0, mut x1) = ([0u32; 4], [0u32; 4]);
        let mut v0 = Views { data: &mut d0, input: &[], scratch: &mut x0 };
        let mut v1 = Views { data: &mut d1, input: &[], scratch: &mut x1 };
        let (mut pool0, mut pool1) = (Vec::new(), Vec::new());
        let (mut watch0, mut watch1) = (None, None);
        let queued = exchange(&w0, (9, 2, false), &s0, &mut v0, &mut pool0, &mut watch0, None, false);
        let immediate = exchange(&w1, (9, 2, false), &s1, &mut v1, &mut pool1, &mut watch1, None, true);
        let both = async { tokio::join!(queued, immediate) };
        let (a, b) = tokio::time::timeout(Duration::from_secs(10), both).await.expect("in time");
        a.and(b).expect("step");
        assert_eq!((x0, x1), ([0, 10, 20, 30], [0, 1, 2, 3]));
        assert_eq!((pool0.len(), pool1.len()), (1, 1));
    }
}
