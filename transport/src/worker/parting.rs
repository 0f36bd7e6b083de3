//! Closing an endpoint through its peer (parting): the protocol's state machine, free
//! of I/O ([`step`], tested case by case below), and the worker state's side of it
//! ([`State::part`] and the calls that move a parting endpoint on).

use super::*;

/// How long a closing endpoint waits for its peer ([`State::part`]) before it closes
/// anyway.
pub(super) const CLOSE_FIRST_WAIT: Duration = Duration::from_secs(1);

/// An endpoint being closed through its peer ([`State::part`]).
pub(super) struct Parting {
    /// The notice sent once the flush is done and the endpoint's operations have
    /// finished: [`Kind::CloseFirst`] on the connecting side, [`Kind::Closing`] on the
    /// accepting side.
    pub(super) notice: Kind,
    /// Where it stands.
    pub(super) phase: Phase,
    /// Whether the peer refused the notice (it does not know it): close at once.
    pub(super) refused: bool,
    /// The deadline in force (entries of [`Partings::deadlines`] with another one are
    /// stale).
    pub(super) deadline: Instant,
    /// The flush posted before the notice, while it runs.
    pub(super) flush: Option<request::Request>,
    /// [`crate::Endpoint::close`] calls waiting for the end.
    pub(super) waiters: Waiters,
}

/// Parting endpoints, for the worker lock's holder to move on cheaply: the ones with
/// news (flush finished, endpoint failed) listed, the deadlines in order (all waits are
/// equal), the clock read only now and then.
#[derive(Default)]
pub(crate) struct Partings {
    /// Endpoints still parting.
    pub(crate) live: usize,
    /// (deadline, endpoint), oldest first; may name endpoints no longer parting.
    pub(super) deadlines: std::collections::VecDeque<(Instant, u64)>,
    /// Endpoints whose flush or one of whose operations finished, or which failed, since
    /// they were last looked at.
    pub(crate) news: Vec<u64>,
    /// Progress calls since the clock was last read for the deadlines.
    pub(super) ticks: u32,
}

/// While endpoints part: every how many progress calls the deadlines are checked (the
/// driver also checks before it sleeps).
pub(super) const PARTING_CLOCK_EVERY: u32 = 64;

/// Where a parting endpoint stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Its flush, posted when the close began, runs (or has just finished).
    Flushing,
    /// Flushed; operations that the peer must take first still run on it.
    WaitingOps,
    /// The notice went out; the peer's answer (its disconnect) is awaited.
    NoticeSent,
}

/// How a parting endpoint's flush stands when the worker looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flush {
    Running,
    Done,
    Failed,
}

/// What the worker sees of a parting endpoint when it looks: after news of it, or at
/// its deadline.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seen {
    /// The endpoint failed (the peer disconnected, as asked) or its handle is gone.
    pub(super) failed: bool,
    /// The peer refused the notice (it does not know it).
    pub(super) refused: bool,
    pub(super) flush: Flush,
    /// Operations that the peer must take first still run on the endpoint.
    pub(super) ops_running: bool,
    /// The deadline in force passed.
    pub(super) overdue: bool,
}

/// What to do with a parting endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Nothing yet.
    Wait,
    /// Send the notice: [`Kind::CloseFirst`] when `close_first`, the endpoint's own
    /// otherwise; the peer then has a new deadline.
    Notice { close_first: bool },
    /// Close the endpoint now and forget it.
    End,
}

/// The parting protocol: from `phase` and what was `seen`, the next phase and the step.
/// An endpoint that failed, or whose notice was refused, ends; after the notice it waits
/// for the peer until the deadline; before it, the notice goes out once the flush is done
/// and nothing the peer must take runs, or at the deadline whatever runs (the peer then
/// closes first).
pub(super) fn step(phase: Phase, seen: Seen) -> (Phase, Step) {
    if seen.failed || seen.refused {
        return (phase, Step::End);
    }
    match phase {
        Phase::NoticeSent if seen.overdue => (phase, Step::End),
        Phase::NoticeSent => (phase, Step::Wait),
        _ if seen.overdue => (Phase::NoticeSent, Step::Notice { close_first: seen.ops_running }),
        _ => match seen.flush {
            Flush::Failed => (phase, Step::End),
            Flush::Running => (Phase::Flushing, Step::Wait),
            Flush::Done if seen.ops_running => (Phase::WaitingOps, Step::Wait),
            Flush::Done => (Phase::NoticeSent, Step::Notice { close_first: false }),
        },
    }
}

impl State {
    /// Closes endpoint `id` of a listener connection made with the handshake through its
    /// peer, for [`crate::Endpoint::close`] and for the drop of its last handle, so that
    /// the accepting side disconnects first and each side takes in what the other sent
    /// before: flushes; once the flush is done, sends `notice` ([`Kind::CloseFirst`] on
    /// the connecting side: the peer takes in what arrived and closes; [`Kind::Closing`]
    /// on the accepting side: the peer takes in what arrived and answers `CloseFirst`,
    /// upon which this side closes); keeps the endpoint's entry until it fails (the
    /// peer's disconnect, or this side's close on `CloseFirst`) or [`CLOSE_FIRST_WAIT`]
    /// passes (checked after progress calls, within [`PARTING_CLOCK_EVERY`] of them or
    /// before the driver sleeps), and then closes it, waking the `close()` calls waiting
    /// ([`State::wait_parting`]). Returns false, having done nothing, for an endpoint that
    /// cannot take part (closed, failed, stream data out, or parting already).
    pub(crate) fn part(&mut self, id: u64, notice: Kind) -> bool {
        let Some(e) = self.eps.get(&id) else { return false };
        if e.handle.is_null() || e.failed.is_some() || e.data_out > 0 || e.parting().is_some() {
            return false;
        }
        let h = e.handle;
        let deadline = Instant::now() + CLOSE_FIRST_WAIT;
        let param = super::param::param(
            self,
            super::param::Callback { send: Some(request::parting_flush_cb) },
            0,
            0,
            None,
        );
        // SAFETY: h is a live endpoint of this worker; the lock is held. The callback finds
        // the endpoint through the request's binding, made before any progress call.
        let p = unsafe { sys::ucp_ep_flush_nbx(h, &param) };
        let flush = match request::Posted::from_ptr(p, request::Completion::OK, false) {
            request::Posted::Pending(r) => {
                r.bind(self, id, OpKind::PartingFlush);
                Some(r)
            }
            request::Posted::Done(c) if c.status().is_ok() => None,
            request::Posted::Done(_) => return false,
        };
        if let Some(e) = self.eps.get_mut(&id) {
            // Other clones see it closed from now on (operations posted after the notice
            // would be lost); the handle stays for the flush, the notice and the close.
            e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
            e.parting = Some(Parting {
                notice,
                phase: Phase::Flushing,
                refused: false,
                deadline,
                flush,
                waiters: Waiters::default(),
            });
        }
        self.partings.live += 1;
        self.partings.deadlines.push_back((deadline, id));
        self.partings.news.push(id);
        self.chores = true;
        true
    }

    /// Sends parting endpoint `id`'s notice: [`Kind::CloseFirst`] when `close_first`
    /// (operations still run on it: UCX requires an endpoint that closes itself to have
    /// none, and purges them when the peer's disconnect fails it), its own otherwise; the
    /// peer then has [`CLOSE_FIRST_WAIT`] from now.
    fn send_parting_notice(&mut self, id: u64, close_first: bool) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        let (h, peer_mode) = (e.handle, e.peer_mode);
        let Some(l) = e.parting_mut() else { return };
        if l.phase == Phase::NoticeSent || h.is_null() {
            return;
        }
        l.phase = Phase::NoticeSent;
        l.deadline = Instant::now() + CLOSE_FIRST_WAIT;
        let (notice, deadline) = (if close_first { Kind::CloseFirst } else { l.notice }, l.deadline);
        self.partings.deadlines.push_back((deadline, id));
        self.send_notice(h, notice, peer_mode, 0);
    }

    /// The peer of parting endpoint `id` refused its notice: closes it after this
    /// progress call.
    pub(crate) fn parting_refused(&mut self, id: u64) {
        if let Some(l) =
            self.eps.get_mut(&id).and_then(|e| e.parting_mut()).filter(|l| l.phase == Phase::NoticeSent)
        {
            tracing::debug!(ep = id, "the peer refused the close notice");
            l.refused = true;
            self.partings.news.push(id);
            self.chores = true;
        }
    }

    /// For [`request`]'s completion callbacks, while endpoints part or closes wait for
    /// operations: an operation bound to endpoint `id` finished.
    pub(crate) fn op_done(&mut self, id: u64) {
        let waits = self.eps.get(&id).is_some_and(|e| {
            e.close_waits_ops() || e.parting().is_some_and(|l| l.phase != Phase::NoticeSent)
        });
        if waits {
            self.partings.news.push(id);
            self.chores = true;
        }
    }

    /// After a progress call while endpoints part: moves on the ones with news, and
    /// now and then closes those whose time is up.
    pub(super) fn tend_partings(&mut self) {
        for id in std::mem::take(&mut self.partings.news) {
            self.advance_parting(id);
            self.run_deferred_close(id);
        }
        self.partings.ticks = self.partings.ticks.wrapping_add(1);
        if self.partings.ticks % PARTING_CLOCK_EVERY == 0 {
            self.end_overdue_partings(Instant::now());
        }
    }

    /// Looks at parting endpoint `id` after news of it (its flush or an operation
    /// finished, it failed, its notice was refused) and takes the protocol's [`step`].
    pub(super) fn advance_parting(&mut self, id: u64) {
        let Some(e) = self.eps.get(&id) else { return };
        let Some(l) = e.parting() else { return };
        let (phase, refused) = (l.phase, l.refused);
        let failed = e.failed.is_some() || e.handle.is_null();
        // Only what the step reads is looked at: the flush and the operations matter
        // before the notice, to an endpoint still usable.
        let before_notice = !failed && !refused && phase != Phase::NoticeSent;
        let flush = if before_notice { self.parting_flush(id) } else { Flush::Done };
        let ops_running = before_notice && flush == Flush::Done && self.ops_running(id);
        let (next, s) = step(phase, Seen { failed, refused, flush, ops_running, overdue: false });
        self.take_step(id, next, s);
    }

    /// How parting endpoint `id`'s flush stands; a finished one is given back to UCX.
    fn parting_flush(&mut self, id: u64) -> Flush {
        let Some(r) = self.eps.get_mut(&id).and_then(|e| e.parting_mut()).and_then(|l| l.flush.take()) else {
            return Flush::Done;
        };
        match r.take_if_done(self) {
            Ok(c) if c.status().is_ok() => Flush::Done,
            Ok(_) => Flush::Failed,
            Err(r) => {
                if let Some(l) = self.eps.get_mut(&id).and_then(|e| e.parting_mut()) {
                    l.flush = Some(r);
                }
                Flush::Running
            }
        }
    }

    /// Takes step `s` of parting endpoint `id`, which then stands at `next`.
    fn take_step(&mut self, id: u64, next: Phase, s: Step) {
        match s {
            Step::Wait => {
                if let Some(l) = self.eps.get_mut(&id).and_then(|e| e.parting_mut()) {
                    l.phase = next;
                }
            }
            Step::Notice { close_first } => self.send_parting_notice(id, close_first),
            Step::End => {
                self.end_parting(id);
            }
        }
    }

    /// Moves on the parting endpoints whose deadline is before `now`: one still waiting
    /// for its flush or operations sends its notice anyway and waits once more; one
    /// whose peer did not answer is closed. Called by the driver before it sleeps, too.
    pub(crate) fn end_overdue_partings(&mut self, now: Instant) {
        while let Some(&(until, id)) = self.partings.deadlines.front() {
            if until > now {
                break;
            }
            self.partings.deadlines.pop_front();
            let Some(e) = self.eps.get(&id) else { continue };
            let Some(l) = e.parting().filter(|l| l.deadline == until) else { continue };
            let (phase, refused) = (l.phase, l.refused);
            let failed = e.failed.is_some() || e.handle.is_null();
            let ops_running = !failed && phase != Phase::NoticeSent && self.ops_running(id);
            // (A failed endpoint's news is on the way; it ends now all the same.)
            let seen = Seen { failed, refused, flush: Flush::Running, ops_running, overdue: true };
            let (next, s) = step(phase, seen);
            match s {
                Step::Notice { .. } => {
                    tracing::debug!(
                        ep = id,
                        "operations still run on the closing endpoint: notice sent anyway"
                    )
                }
                Step::End if !failed && !refused => {
                    tracing::debug!(ep = id, "the peer did not answer in time: closing the endpoint")
                }
                _ => {}
            }
            self.take_step(id, next, s);
        }
    }

    /// Closes parting endpoint `id` now and forgets it (its handle is gone); nothing
    /// (false) if it no longer parts.
    pub(super) fn end_parting(&mut self, id: u64) -> bool {
        let Some(l) = self.eps.get_mut(&id).and_then(|e| e.take_parting()) else { return false };
        self.partings.live -= 1;
        let mut waiters = l.waiters;
        self.after.wake_waiters(&mut waiters);
        if let Some(r) = l.flush {
            // Parked with the closes, not given back: a worker being destroyed waits for
            // it (bounded) as UCX requires of every request it still runs, then gives it
            // up like a close that never finished.
            if let Err(r) = r.take_if_done(self) {
                // SAFETY: a pending request of ours that owns no memory, under the lock.
                unsafe { request::park_close(self, r.raw().cast::<Slot>()) }
            }
        }
        self.close_unwaited(id);
        self.forget_ep(id);
        true
    }

    /// Closes every parting endpoint at once (the worker is going away).
    pub(super) fn end_all_partings(&mut self) {
        for (_, id) in std::mem::take(&mut self.partings.deadlines) {
            self.end_parting(id);
        }
    }

    /// Endpoints still parting.
    pub(crate) fn parting_count(&self) -> usize {
        self.partings.live
    }

    /// Whether endpoint `id` parts.
    pub(crate) fn is_parting(&self, id: u64) -> bool {
        self.eps.get(&id).is_some_and(|e| e.parting().is_some())
    }

    /// Until endpoint `id` stops parting: Pending, with `waker` woken at the end
    /// (registered under `leave`'s key).
    pub(crate) fn wait_parting(&mut self, id: u64, leave: &Leave<'_>, waker: &Waker) -> Poll<()> {
        if !self.is_parting(id) {
            return Poll::Ready(());
        }
        leave.register(self, waker);
        Poll::Pending
    }

    /// For [`request::parting_flush_cb`]: the flush of parting endpoint `id` finished.
    pub(crate) fn parting_flushed(&mut self, id: u64) {
        self.partings.news.push(id);
        self.chores = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(failed: bool, refused: bool, flush: Flush, ops_running: bool, overdue: bool) -> Seen {
        Seen { failed, refused, flush, ops_running, overdue }
    }

    /// Every transition of the protocol: (phase, what was seen) -> (next phase, step).
    #[test]
    fn transitions() {
        use Flush::*;
        use Phase::*;
        let notice = |close_first| Step::Notice { close_first };
        #[rustfmt::skip]
        let table = [
            // phase       failed refused flush    ops    overdue  next        step
            (Flushing,   seen(false, false, Running, false, false), Flushing,   Step::Wait),
            (Flushing,   seen(false, false, Done,    false, false), NoticeSent, notice(false)),
            (Flushing,   seen(false, false, Done,    true,  false), WaitingOps, Step::Wait),
            (Flushing,   seen(false, false, Failed,  false, false), Flushing,   Step::End),
            (Flushing,   seen(false, false, Running, true,  true),  NoticeSent, notice(true)),
            (Flushing,   seen(false, false, Running, false, true),  NoticeSent, notice(false)),
            (Flushing,   seen(true,  false, Running, false, false), Flushing,   Step::End),
            (WaitingOps, seen(false, false, Done,    true,  false), WaitingOps, Step::Wait),
            (WaitingOps, seen(false, false, Done,    false, false), NoticeSent, notice(false)),
            (WaitingOps, seen(false, false, Done,    true,  true),  NoticeSent, notice(true)),
            (WaitingOps, seen(true,  false, Done,    true,  true),  WaitingOps, Step::End),
            (NoticeSent, seen(false, false, Done,    false, false), NoticeSent, Step::Wait),
            (NoticeSent, seen(false, false, Done,    true,  false), NoticeSent, Step::Wait),
            (NoticeSent, seen(false, false, Done,    false, true),  NoticeSent, Step::End),
            (NoticeSent, seen(false, true,  Done,    false, false), NoticeSent, Step::End),
            (NoticeSent, seen(true,  false, Done,    false, false), NoticeSent, Step::End),
        ];
        for (phase, s, next, want) in table {
            assert_eq!(step(phase, s), (next, want), "{phase:?} {s:?}");
        }
    }

    /// Whatever is seen, an endpoint that failed or was refused ends, and a notice is
    /// sent at most once (only from before it).
    #[test]
    fn invariants_over_every_input() {
        let flushes = [Flush::Running, Flush::Done, Flush::Failed];
        for phase in [Phase::Flushing, Phase::WaitingOps, Phase::NoticeSent] {
            for bits in 0..16u8 {
                for &flush in &flushes {
                    let s = seen(bits & 1 != 0, bits & 2 != 0, flush, bits & 4 != 0, bits & 8 != 0);
                    let (next, st) = step(phase, s);
                    if s.failed || s.refused {
                        assert_eq!(st, Step::End, "{phase:?} {s:?}");
                    }
                    if phase == Phase::NoticeSent {
                        assert!(!matches!(st, Step::Notice { .. }), "a second notice: {s:?}");
                        assert_eq!(next, Phase::NoticeSent);
                    }
                    if matches!(st, Step::Notice { .. }) {
                        assert_eq!(next, Phase::NoticeSent);
                    }
                }
            }
        }
    }
}
