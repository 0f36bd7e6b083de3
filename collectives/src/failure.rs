//! How a communicator fails as a whole (see [`crate::abort`]): [`Call`], the guard every
//! collective call holds, which aborts the communicator when the call fails or is
//! dropped before it finished; [`Communicator::abort`]; and [`Communicator::shrink`],
//! which makes a communicator of the ranks still alive.

use std::borrow::Borrow;
use std::time::{Duration, Instant};

use ucxkit_transport::{tag::EXACT, SharedBuf};

use crate::abort::{self, Abort};
use crate::comm::Communicator;
use crate::error::{Error, Failed, Result};
use crate::tag::{tag, CONTROL_STEP};

/// A collective call in flight. Made when the call is (taking its sequence number);
/// [`Call::done`] ends it with its result. Dropped before that, it aborts the
/// communicator: the other ranks would wait for this call's messages for ever. `C` is
/// the communicator, owned by a call's future, or borrowed while the call runs in the
/// function that made it ([`Communicator::begin_here`]).
pub(crate) struct Call<C: Borrow<Communicator> = Communicator> {
    pub(crate) comm: C,
    pub(crate) seq: u16,
    armed: bool,
}

/// A call's result, as far as failure goes.
pub(crate) trait Outcome {
    /// The error, if it failed.
    fn error(&self) -> Option<&Error>;
}

impl<T> Outcome for Result<T> {
    fn error(&self) -> Option<&Error> {
        self.as_ref().err()
    }
}

impl<T, U> Outcome for std::result::Result<T, Box<Failed<U>>> {
    fn error(&self) -> Option<&Error> {
        self.as_ref().err().map(|f| &f.error)
    }
}

impl<C: Borrow<Communicator>> Call<C> {
    /// Ends the call with `r`: a failure aborts the communicator on every rank.
    #[inline]
    pub(crate) fn done<R: Outcome>(mut self, r: R) -> R {
        self.armed = false;
        if let Some(e) = r.error() {
            self.comm.borrow().fail(e);
        }
        r
    }
}

impl Call<&Communicator> {
    /// The call, for a future to finish: with a communicator of its own.
    pub(crate) fn owned(mut self) -> Call {
        self.armed = false;
        Call { comm: self.comm.clone(), seq: self.seq, armed: true }
    }
}

impl<C: Borrow<Communicator>> Drop for Call<C> {
    fn drop(&mut self) {
        if self.armed {
            let comm = self.comm.borrow();
            let reason =
                format!("rank {} dropped collective call {} before it finished", comm.rank(), self.seq);
            comm.abort_with(Abort { failed: None, by: comm.rank(), reason });
        }
    }
}

impl Communicator {
    /// Starts a collective call: takes its sequence number.
    pub(crate) fn begin(&self) -> Call {
        Call { comm: self.clone(), seq: self.next_seq(), armed: true }
    }

    /// [`Communicator::begin`] for a call that may end before its function returns (no
    /// reference count taken until [`Call::owned`]).
    pub(crate) fn begin_here(&self) -> Call<&Communicator> {
        Call { comm: self, seq: self.next_seq(), armed: true }
    }

    /// Aborts the communicator after `e` (unless `e` is itself the news of an abort,
    /// which goes on to the other ranks only when it came of a departure heard here; see
    /// [`crate::leave`]).
    pub(crate) fn fail(&self, e: &Error) {
        if let Error::Aborted(a) = e {
            if self.h.inner.abort.calls.take_untold() {
                abort::tell(&self.h.inner.ns, &self.h.inner.eps, self.id(), a);
            }
            return;
        }
        self.abort_with(Abort { failed: e.rank(), by: self.rank(), reason: e.to_string() });
    }

    /// Marks the communicator aborted and, the first time, tells every other rank.
    pub(crate) fn abort_with(&self, a: Abort) {
        if self.h.inner.abort.set(a.clone()) {
            tracing::warn!(comm = self.id(), rank = self.rank(), "collectives aborted: {}", a.reason);
            abort::tell(&self.h.inner.ns, &self.h.inner.eps, self.id(), &a);
        }
    }

    /// Aborts the communicator on every rank, with `reason`: their pending and later
    /// collectives on it fail with [`Error::Aborted`].
    pub fn abort(&self, reason: &str) {
        self.abort_with(Abort { failed: None, by: self.rank(), reason: reason.to_string() });
    }

    /// Why the communicator was aborted, if it was.
    pub fn aborted(&self) -> Option<Abort> {
        self.h.inner.abort.get()
    }

    /// A communicator of the ranks still alive, in their old order, after this one was
    /// aborted (or at any time: with every rank alive it is a new communicator over the
    /// same ranks). Every live rank must call it. The ranks exchange what they know of
    /// failed ranks, in rounds, until they agree; a rank that does not answer a round
    /// within `deadline` counts as failed. The new communicator holds a barrier before
    /// it is returned.
    ///
    /// A rank failing while the ranks shrink may leave them disagreeing; the barrier
    /// then fails, and shrinking again (the new communicator is aborted) settles it.
    ///
    /// # Errors
    /// [`Error::DeadlineExceeded`] past `deadline`, [`Error::Bootstrap`] when this rank
    /// finds itself alone with nothing agreed, and what the final barrier reports.
    pub async fn shrink(&self, deadline: Duration) -> Result<Communicator> {
        let (n, me) = (self.size(), self.rank());
        let end = Instant::now() + deadline;
        let mut failed = vec![false; n];
        // (The failed rank came off the wire: one outside the group is ignored.)
        if let Some(f) = self.aborted().and_then(|a| a.failed).filter(|&f| f < n) {
            failed[f] = true;
        }
        let mut free = self.h.inner.registry.free_map();
        let mut agreed = false;
        for round in 0..n.max(2) as u16 {
            let mut msg: Vec<u64> = free.clone();
            msg.extend(failed.iter().map(|&f| u64::from(f)));
            let peers: Vec<usize> = (0..n).filter(|&p| p != me && !failed[p]).collect();
            let mut recvs = Vec::new();
            for &p in &peers {
                if let Some(ep) = self.endpoint(p) {
                    let t = tag(self.id(), round, CONTROL_STEP, p);
                    let mut into = SharedBuf::new(vec![0u64; msg.len()]);
                    let f = self.h.inner.ns.tag_recv_from(ep, t, EXACT, into.whole());
                    recvs.push((p, async move {
                        let (r, slice) = f.await;
                        drop(slice);
                        (r, into.view().map(|v| v.to_vec()).unwrap_or_default())
                    }));
                }
            }
            for &p in &peers {
                if let Some(ep) = self.endpoint(p) {
                    let send = self.h.inner.ns.tag_send(
                        ep,
                        tag(self.id(), round, CONTROL_STEP, me),
                        SharedBuf::new(msg.clone()).whole(),
                    );
                    // Sends finish on their own; a dead peer's fails, which says nothing new.
                    tokio::spawn(async move { drop(send.await) });
                }
            }
            let mut all_equal = true;
            let before = failed.clone();
            for (p, recv) in recvs {
                match tokio::time::timeout_at(end.into(), recv).await {
                    Ok((Ok(info), theirs)) if info.len == msg.len() * 8 => {
                        let (their_free, their_failed) = theirs.split_at(free.len());
                        if their_failed.iter().zip(&before).any(|(t, b)| (*t != 0) != *b) {
                            all_equal = false;
                        }
                        for (f, t) in failed.iter_mut().zip(their_failed) {
                            *f |= *t != 0;
                        }
                        for (f, t) in free.iter_mut().zip(their_free) {
                            *f &= *t;
                        }
                    }
                    _ => {
                        failed[p] = true;
                        all_equal = false;
                    }
                }
            }
            if all_equal && failed == before {
                agreed = true;
                break;
            }
            if Instant::now() >= end {
                break;
            }
        }
        if !agreed {
            return Err(Error::DeadlineExceeded { after: deadline, waiting_on: Vec::new() });
        }
        let members: Vec<usize> = (0..n).filter(|&p| !failed[p]).collect();
        let id = crate::abort::pick_id(&free, crate::abort::first_look(self.id(), 0))?;
        let rank = members
            .iter()
            .position(|&p| p == me)
            .ok_or_else(|| Error::Bootstrap("this rank was counted as failed".into()))?;
        let eps = members.iter().map(|&p| self.h.inner.eps[p].clone()).collect();
        let set = crate::comm::Settings::of(self);
        let c = Communicator::new(&self.h.inner.ns, id, rank, eps, set)?.with_options(self.h.opts.clone());
        c.put_hosts(self.hosts().restrict(&members));
        match tokio::time::timeout_at(end.into(), c.barrier()).await {
            Ok(Ok(())) => {
                // The same on every survivor: the parent's token and id, the new id, and
                // who survived.
                let words = [self.token(), u64::from(self.id()), u64::from(id)];
                c.formed(crate::leave::token_of(words.into_iter().chain(members.iter().map(|&m| m as u64))));
                Ok(c)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::DeadlineExceeded { after: deadline, waiting_on: Vec::new() }),
        }
    }
}
