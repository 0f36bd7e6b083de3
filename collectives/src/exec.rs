//! Runs one rank's [`Schedule`] over the transport: per step, the copies, then every
//! transfer posted at once (tagged as `crate::tag` lays out) and awaited together, then
//! the combines. Buffers are [`SharedBuf`]s, so the transfers of a step work on parts of
//! one buffer at once without copying, and the local steps read and write them in place
//! once the transfers have let go.

use futures_util::future::join_all;
use ucxkit_transport::{tag::EXACT, Endpoint, Namespace, SharedBuf, SharedSlice};

use crate::error::{Error, Result};
use crate::schedule::{Buf, Combine, Region, Schedule, Xfer};
use crate::tag::{tag, MAX_STEPS};
use crate::{Element, ReduceOp};

/// What the executor needs of a communicator.
pub(crate) struct Wire<'a> {
    pub(crate) ns: &'a Namespace,
    pub(crate) eps: &'a [Option<Endpoint>],
    pub(crate) rank: usize,
    pub(crate) comm: u16,
}

impl Wire<'_> {
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
    pub(crate) input: SharedBuf<T>,
    pub(crate) scratch: SharedBuf<T>,
}

#[cold]
fn in_use() -> Error {
    Error::Internal("a buffer is still held by a transfer after its step".into())
}

#[cold]
fn outside(r: &Region) -> Error {
    Error::Internal(format!("schedule region {r:?} is outside its buffer"))
}

impl<T: Element> Bufs<T> {
    pub(crate) fn new(data: Vec<T>, input: Vec<T>, scratch: usize) -> Bufs<T> {
        Bufs { data: data.into(), input: input.into(), scratch: vec![T::zeroed(); scratch].into() }
    }

    fn buf(&self, b: Buf) -> &SharedBuf<T> {
        match b {
            Buf::Data => &self.data,
            Buf::Input => &self.input,
            Buf::Scratch => &self.scratch,
        }
    }

    fn slice(&self, r: &Region) -> Result<SharedSlice<T>> {
        self.buf(r.buf).slice(r.range.clone()).map_err(|_| outside(r))
    }

    fn view(&mut self, b: Buf) -> Result<&mut [T]> {
        match b {
            Buf::Data => self.data.view(),
            Buf::Input => self.input.view(),
            Buf::Scratch => self.scratch.view(),
        }
        .ok_or_else(in_use)
    }

    /// Views of two different buffers: `(from, into)`.
    fn two(&mut self, a: Buf, b: Buf) -> Result<(&mut [T], &mut [T])> {
        let Bufs { data, input, scratch } = self;
        let (x, y) = match (a, b) {
            (Buf::Data, Buf::Input) => (data.view(), input.view()),
            (Buf::Data, Buf::Scratch) => (data.view(), scratch.view()),
            (Buf::Input, Buf::Data) => (input.view(), data.view()),
            (Buf::Input, Buf::Scratch) => (input.view(), scratch.view()),
            (Buf::Scratch, Buf::Data) => (scratch.view(), data.view()),
            (Buf::Scratch, Buf::Input) => (scratch.view(), input.view()),
            _ => return Err(Error::Internal("two views of one buffer".into())),
        };
        Ok((x.ok_or_else(in_use)?, y.ok_or_else(in_use)?))
    }

    /// `into = from`, or `into = into op from` when `op` is given.
    fn apply(&mut self, from: &Region, into: &Region, op: Option<ReduceOp>) -> Result<()> {
        if from.len() != into.len() {
            return Err(Error::Internal(format!("combining regions of two lengths: {from:?} {into:?}")));
        }
        if from.buf == into.buf {
            let v = self.view(from.buf)?;
            if from.range.end > v.len() || into.range.end > v.len() {
                return Err(outside(into));
            }
            match op {
                None => v.copy_within(from.range.clone(), into.range.start),
                Some(op) => {
                    // Disjoint parts of one buffer (schedules never reduce a region into
                    // an overlapping one).
                    let operand = v[from.range.clone()].to_vec();
                    T::reduce(op, &mut v[into.range.clone()], &operand);
                }
            }
            return Ok(());
        }
        let (src, dst) = self.two(from.buf, into.buf)?;
        let src = src.get(from.range.clone()).ok_or_else(|| outside(from))?;
        let dst = dst.get_mut(into.range.clone()).ok_or_else(|| outside(into))?;
        match op {
            None => dst.copy_from_slice(src),
            Some(op) => T::reduce(op, dst, src),
        }
        Ok(())
    }

    /// Gives the data buffer back, if the transport let go of it.
    pub(crate) fn into_data(self) -> Option<Vec<T>> {
        self.data.try_into_vec().ok()
    }

    /// Gives the input buffer back, if the transport let go of it.
    pub(crate) fn take_input(&mut self) -> Option<Vec<T>> {
        let input = std::mem::replace(&mut self.input, Vec::new().into());
        match input.try_into_vec() {
            Ok(v) => Some(v),
            Err(b) => {
                self.input = b;
                None
            }
        }
    }
}

/// Runs `sched` for call `seq`, reducing with `op`.
pub(crate) async fn run<T: Element>(
    w: &Wire<'_>,
    seq: u16,
    sched: &Schedule,
    bufs: &mut Bufs<T>,
    op: ReduceOp,
) -> Result<()> {
    if sched.steps.len() > MAX_STEPS {
        return Err(Error::InvalidArgument(format!(
            "the schedule has {} steps, more than the tag layout's {MAX_STEPS}",
            sched.steps.len()
        )));
    }
    for (s, step) in sched.steps.iter().enumerate() {
        for (from, into) in &step.copies {
            bufs.apply(from, into, None)?;
        }
        if !step.xfers.is_empty() {
            exchange(w, seq, s as u16, &step.xfers, bufs).await?;
        }
        for c in &step.combines {
            match c {
                Combine::Copy { from, into } => bufs.apply(from, into, None)?,
                Combine::Reduce { from, into } => bufs.apply(from, into, Some(op))?,
            }
        }
    }
    Ok(())
}

/// Posts one step's transfers and waits for all of them. Receives are bound to their
/// peer's endpoint, so a peer's failure ends them.
async fn exchange<T: Element>(
    w: &Wire<'_>,
    seq: u16,
    step: u16,
    xfers: &[Xfer],
    bufs: &Bufs<T>,
) -> Result<()> {
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for x in xfers {
        match x {
            Xfer::Send { peer, from } => {
                let f = w.ns.tag_send(w.ep(*peer)?, tag(w.comm, seq, step, w.rank), bufs.slice(from)?);
                sends.push(async move { (*peer, f.await.0) });
            }
            Xfer::Recv { peer, into } => {
                let want = into.len() * std::mem::size_of::<T>();
                let f =
                    w.ns.tag_recv_from(w.ep(*peer)?, tag(w.comm, seq, step, *peer), EXACT, bufs.slice(into)?);
                recvs.push(async move { (*peer, want, f.await.0) });
            }
        }
    }
    let (sent, received) = futures_util::future::join(join_all(sends), join_all(recvs)).await;
    for (peer, r) in sent {
        r.map_err(|source| Error::Transport { rank: peer, source })?;
    }
    for (peer, want, r) in received {
        let info = r.map_err(|source| match source {
            ucxkit_transport::Error::Truncated { .. } => Error::Mismatch { rank: peer, got: None, want },
            source => Error::Transport { rank: peer, source },
        })?;
        if info.len != want {
            return Err(Error::Mismatch { rank: peer, got: Some(info.len), want });
        }
    }
    Ok(())
}
