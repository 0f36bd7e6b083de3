//! [`WorkerInner`]: the UCX worker handle with its lock and State, progress under the
//! lock, and the destruction that waits for in-flight operations.

use super::*;

/// The worker and its lock. Dropped after the driver, the last handle and the last
/// operation are gone.
pub(crate) struct WorkerInner {
    /// Keeps the context alive until the worker is destroyed.
    pub(crate) ctx: Arc<ContextInner>,
    pub(super) lock: RawLock,
    pub(super) state: UnsafeCell<State>,
    pub(crate) mode: ProgressMode,
    /// Event mode: how long the driver polls after the last event before sleeping.
    pub(crate) linger: Duration,
    pub(crate) efd: RawFd,
    pub(crate) no_imm: bool,
    pub(crate) signal: Arc<progress::Signal>,
    /// The largest active-message header this worker can send.
    pub(crate) max_am_header: usize,
    /// Layers may claim namespaces on the worker, which keeps tag bits and
    /// active-message ids from the application's calls (see [`crate::namespace`]).
    pub(crate) namespaces: bool,
    /// Busy-poll mode: progress calls a waiting future makes before it yields.
    pub(crate) busy_spin: std::sync::atomic::AtomicU32,
    /// Busy-poll mode: microseconds a waiting future goes on spinning and yielding the
    /// processor within one poll ([`crate::WorkerBuilder::busy_yield`]).
    pub(crate) busy_yield_us: std::sync::atomic::AtomicU32,
    /// Whether the driver last found the host crowded ([`super::crowding`]): busy-poll
    /// futures then spin and yield as [`progress::CROWDED_SPIN`] and
    /// [`progress::CROWDED_YIELD`] say, at the most.
    pub(crate) crowded: std::sync::atomic::AtomicBool,
    /// The CUDA device this worker serves, bound on the thread of every call into UCX
    /// once a device buffer has been posted (see [`WorkerInner::bind_device`]).
    #[cfg(feature = "cuda")]
    pub(crate) device: std::sync::OnceLock<crate::cuda::Bound>,
}

// SAFETY: `state` is only accessed while `lock` is held (see `locked`), and the UCX
// worker it holds is in SERIALIZED mode, whose contract is exactly that: any thread,
// one at a time.
unsafe impl Send for WorkerInner {}
// SAFETY: as above.
unsafe impl Sync for WorkerInner {}

/// A busy-poll future's spin (progress calls) and yield time (us), from the worker's
/// settings `spin` and `yield_us`, held to [`progress::CROWDED_SPIN`] and
/// [`progress::CROWDED_YIELD`] at the most on a `crowded` host.
fn busy_limits(spin: u32, yield_us: u32, crowded: bool) -> (u32, u32) {
    if crowded {
        (spin.min(progress::CROWDED_SPIN), yield_us.max(progress::busy_yield_us(progress::CROWDED_YIELD)))
    } else {
        (spin, yield_us)
    }
}

/// Progress calls per lock acquisition while a busy-poll future spins.
pub(crate) const SPIN_ROUND: u32 = 32;

/// The longest one busy spin of [`crate::WorkerBuilder::busy_spin`] progress calls
/// lasts. Over shared memory a progress call with nothing to do takes some 20 ns, but
/// where it is a system call (TCP's `epoll_wait`) 512 of them took milliseconds, during
/// which the spinning task's runtime ran nothing else: a busy-poll node's answer waited
/// 8-13 ms for the task that sends it.
pub(crate) const SPIN_TIME: std::time::Duration = std::time::Duration::from_micros(20);

impl WorkerInner {
    /// Runs `f` under the worker lock, then wakes the wakers and drops the parked values
    /// it collected, after releasing the lock.
    #[inline(always)]
    pub(crate) fn locked<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let guard = self.lock.lock();
        let bound = self.bind_current();
        // SAFETY: the lock is held, so this is the only reference to the state.
        let st = unsafe { &mut *self.state.get() };
        let r = f(st);
        unbind(bound);
        if !st.after.any {
            // The common case on the hot path: nothing to do after unlocking.
            drop(guard);
            return r;
        }
        let after = std::mem::take(&mut st.after);
        drop(guard);
        self.run_after(after);
        r
    }

    /// Does what was collected under the lock, once it is released. A panic of a
    /// task's waker or of a released buffer's drop is caught and logged: this runs inside
    /// the calls that post operations, and an unwind there would drop the buffer of the
    /// operation just handed to UCX.
    #[inline(never)]
    pub(super) fn run_after(&self, after: Deferred) {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        if after.kick {
            self.signal.kick();
        }
        for w in after.wake {
            if catch_unwind(AssertUnwindSafe(|| w.wake())).is_err() {
                tracing::error!("a task's waker panicked; the panic was caught");
            }
        }
        for g in after.graveyard {
            if catch_unwind(AssertUnwindSafe(|| drop(g))).is_err() {
                tracing::error!("dropping a buffer UCX released panicked; the panic was caught");
            }
        }
        for h in after.handlers {
            h.run();
        }
    }

    /// Makes the device context this worker serves current on this thread, if it serves
    /// one (a no-op without the `cuda` feature); what to give back with [`unbind`] once
    /// the call into UCX is over, so that a thread's own context is left as it was (one
    /// that had none keeps the worker's: see `cuda::Bound::bind`).
    #[inline(always)]
    fn bind_current(&self) -> Bound {
        #[cfg(feature = "cuda")]
        return self.device.get().and_then(|d| d.bind());
        #[cfg(not(feature = "cuda"))]
        Bound
    }

    /// Makes this worker serve the device of `mem` (a buffer of operation `op`): from
    /// now on its calls into UCX run with the device's context current, which UCX's
    /// CUDA transports need. A worker serves one device.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a build without the `cuda` feature or a device whose
    /// context cannot be had; [`Error::ApiMisuse`] for a second device.
    #[cold]
    pub(crate) fn bind_device(
        &self,
        op: &'static str,
        mem: crate::MemoryType,
    ) -> std::result::Result<(), Box<Error>> {
        #[cfg(feature = "cuda")]
        {
            let crate::MemoryType::Cuda { device } = mem else { return Ok(()) };
            if self.device.get().is_none() {
                let bound = crate::cuda::Bound::new(device).map_err(Box::new)?;
                // A race with another thread's first device buffer leaves one of the two.
                let _ = self.device.set(bound);
            }
            let serving = self.device.get().map(|b| b.device());
            if serving != Some(device) {
                return Err(Box::new(Error::ApiMisuse(format!(
                    "{op} on cuda:{device} memory: this worker serves cuda:{} (use a worker per device)",
                    serving.unwrap_or_default()
                ))));
            }
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        Err(Box::new(Error::Unsupported {
            what: format!("{op} on {mem} memory: ucxkit-transport was built without its `cuda` feature"),
        }))
    }

    /// Progresses the worker once if its lock is free, for another worker's drop (see
    /// `live_workers`). Wakes what the progress finished, but leaves active-message
    /// handlers, which run user code, to this worker's own driver, which it kicks.
    pub(crate) fn progress_if_free(&self) -> u32 {
        let Some(guard) = self.lock.try_lock() else { return 0 };
        let bound = self.bind_current();
        // SAFETY: the lock is held, so this is the only reference to the state.
        let st = unsafe { &mut *self.state.get() };
        let n = self.progress_locked(st);
        unbind(bound);
        if !st.after.any {
            return n;
        }
        let mut after = std::mem::take(&mut st.after);
        if !after.handlers.is_empty() {
            st.after.handlers = std::mem::take(&mut after.handlers);
            st.after.any = true;
            after.kick = true;
        }
        drop(guard);
        self.run_after(after);
        n
    }

    /// `ucp_worker_progress` plus the work that must happen outside UCX callbacks
    /// (handshake replies, failing endpoints).
    pub(crate) fn progress_locked(&self, st: &mut State) -> u32 {
        // SAFETY: the lock is held.
        unsafe { request::free_spare(st) };
        // SAFETY: the worker is valid and the lock is held.
        let n = unsafe { sys::ucp_worker_progress(st.handle) };
        if st.chores {
            self.chores(st, n);
        }
        n
    }

    /// After a progress call that found `n` events: wakes waiting probes (when `n > 0`),
    /// sends queued handshake replies, fails endpoints UCX reported.
    #[cold]
    pub(super) fn chores(&self, st: &mut State, n: u32) {
        if n > 0 {
            st.after.wake_all(&mut st.probe_waiters);
        }
        if !st.outbox.is_empty() {
            for (ep, bytes) in std::mem::take(&mut st.outbox) {
                st.send_handshake(ep, bytes, false);
            }
        }
        if !st.failed.is_empty() {
            // (A failure UCX reports during a bare progress loop, such as the drain in
            // `fail_ep`, is marked here only at the next chores; a close in between prints
            // UCX's flush errors.)
            st.fail_reported();
        }
        if !st.close_first.is_empty() {
            // The peer is closing, or answers this side's `Closing`: what it sent stays
            // readable, this end closes (flushing what it sent) before the peer's own
            // close goes out, and fails as if the peer had disconnected.
            // With operations still running (sends the closing peer will not take), UCX
            // must not be asked to close: in peer mode the close is forced (UCX purges
            // them); otherwise this side asks the peer to close first in turn, and its
            // disconnect makes UCX purge them.
            for id in std::mem::take(&mut st.close_first) {
                st.keep_stream(id);
                let running = st.ops_running(id);
                let Some(e) = st.eps.get(&id) else { continue };
                let (h, peer_mode, parting) = (e.handle, e.peer_mode, e.parting().is_some());
                if running && !peer_mode && !parting && !h.is_null() && e.failed.is_none() {
                    st.send_notice(h, Kind::CloseFirst, false, 0);
                } else {
                    if !h.is_null() && e.failed.is_none() && e.by_address {
                        // The peer's end is done once this arrives: nothing else tells an
                        // endpoint made from a worker address that its peer closed. (Through
                        // UCX's connection manager the disconnect does, and the peer must
                        // wait for it: a connecting side that disconnects first over shared
                        // memory leaves one socket of its worker open.)
                        st.send_notice(h, Kind::Closed, peer_mode, 0);
                    }
                    if let Some(p) = st.close_ep(id, running && peer_mode) {
                        st.finish_close(id, p);
                    }
                }
                st.fail_ep(id, Status::CONNECTION_RESET, false);
            }
        }
        if !st.peer_closing.is_empty() {
            // The accepting peer is closing: what it sent stays readable after its
            // disconnect, which it sends once this side answers.
            for id in std::mem::take(&mut st.peer_closing) {
                st.keep_stream(id);
                if let Some(e) = st.eps.get(&id).filter(|e| !e.handle.is_null() && e.failed.is_none()) {
                    let (h, peer_mode) = (e.handle, e.peer_mode);
                    st.send_notice(h, Kind::CloseFirst, peer_mode, 0);
                }
            }
        }
        for id in std::mem::take(&mut st.peer_closed) {
            // The peer's end is gone: this end is done too.
            st.fail_ep(id, Status::CONNECTION_RESET, false);
        }
        if st.partings.live > 0 || !st.partings.news.is_empty() {
            // (News of an endpoint no longer parting, its parked flush finishing, is
            // dropped here.)
            st.tend_partings();
        }
        // Replies and failures are handled; probes wait for an event, parting endpoints
        // for their flush, their peer's close or their deadline.
        st.chores = !st.probe_waiters.is_empty() || st.partings.live > 0 || !st.partings.news.is_empty();
    }

    /// Arms the worker's event fd (`ucp_worker_arm`). OK: armed, the fd signals the next
    /// event. `UCS_ERR_BUSY`: UCX cannot sleep yet (events arrived in between, or sends
    /// wait for the peer to make room): the caller must let other tasks run and try again,
    /// not spin under the lock.
    pub(crate) fn arm(&self, st: &mut State) -> Status {
        // SAFETY: the worker is valid under the lock and has UCP_FEATURE_WAKEUP.
        Status(unsafe { sys::ucp_worker_arm(st.handle) })
    }

    /// After posting an operation that is still pending: make sure it will be progressed
    /// even if no fd event announces its next step.
    #[inline]
    pub(crate) fn posted(&self) {
        // Both modes: a busy-poll driver also sleeps once the worker has been idle.
        self.signal.kick();
    }

    /// Busy-poll mode, after a spin that found nothing: gives the processor away before
    /// the task spins again (sched_yield), so that busy-polling processes that outnumber
    /// the cores let each other run, and has the task polled again. Without the yield,
    /// four busy ranks on two cores took 5.7 ms per 8-byte allreduce (the scheduler's
    /// time slice), against 8 us for Open MPI, which yields the same way.
    pub(crate) fn spun_in_vain(&self, cx: &mut TaskContext<'_>) {
        std::thread::yield_now();
        self.signal.future_yielded();
        cx.waker().wake_by_ref();
    }

    /// Busy-poll mode: looks for a result with one progress call (a `round` of `n` calls
    /// returns it once there is one); then, unless another task's spin found nothing a
    /// moment ago, spins up to [`crate::WorkerBuilder::busy_spin`] progress calls (for at
    /// most [`SPIN_TIME`]), a round of up to [`SPIN_ROUND`] at a time, and for
    /// [`crate::WorkerBuilder::busy_yield`] yields the processor and spins again. Without
    /// a result, has the task polled again: at once after a glance, after yielding the
    /// processor after a spin ([`WorkerInner::spun_in_vain`]).
    #[inline]
    pub(crate) fn busy_spin_for<T>(
        &self,
        cx: &mut TaskContext<'_>,
        mut round: impl FnMut(&mut TaskContext<'_>, u32) -> Option<T>,
    ) -> Poll<T> {
        if let Some(t) = round(cx, 1) {
            return Poll::Ready(t);
        }
        // Progress is the worker's, not a task's: right after another task spun in vain,
        // this one's spin would find what that one found, and keep the runtime from the
        // tasks that wait on something else (a channel, a timer; `block_on`'s future is
        // polled once per 61 tasks run). With three busy-poll tasks waiting, a node's
        // answer waited milliseconds for the task that sends it. Not where spins yield
        // the processor (`busy_yield`, for more busy processes than cores): there every
        // waiting task's yield is what lets the others' processes run.
        let now = Instant::now();
        let (spin, yield_us) = busy_limits(
            self.busy_spin.load(std::sync::atomic::Ordering::Relaxed),
            self.busy_yield_us.load(std::sync::atomic::Ordering::Relaxed),
            self.crowded.load(std::sync::atomic::Ordering::Relaxed),
        );
        let glance = yield_us == 0
            && self.locked(|st| {
                let other = |(end, w): &(Instant, Waker)| {
                    now.duration_since(*end) < SPIN_TIME && !w.will_wake(cx.waker())
                };
                st.busy_spun.as_ref().is_some_and(other)
            });
        if glance {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let (mut left, mut began) = (spin.saturating_sub(1), now);
        // With `busy_yield`: when the spins after yields end, counted from the end of the
        // first fruitless spin.
        let mut yield_end: Option<Instant> = None;
        loop {
            while left > 0 {
                let n = left.min(SPIN_ROUND);
                left -= n;
                if let Some(t) = round(cx, n) {
                    return Poll::Ready(t);
                }
                if left > 0 && began.elapsed() >= SPIN_TIME {
                    break;
                }
            }
            if yield_us == 0 {
                break;
            }
            let end =
                *yield_end.get_or_insert_with(|| Instant::now() + Duration::from_micros(u64::from(yield_us)));
            if Instant::now() >= end {
                break;
            }
            std::thread::yield_now();
            (left, began) = (spin, Instant::now());
        }
        if yield_us == 0 {
            self.locked(|st| match &mut st.busy_spun {
                Some((end, w)) if w.will_wake(cx.waker()) => *end = Instant::now(),
                spun => *spun = Some((Instant::now(), cx.waker().clone())),
            });
        }
        self.spun_in_vain(cx);
        Poll::Pending
    }

    /// Polls for a result: `check` looks for it under the lock; if it is not there yet,
    /// the worker is progressed (a bounded spin in busy-poll mode; in event mode a spin of
    /// at most [`progress::EVENT_SPIN`], or one call during a quiet period) and
    /// `register` stores the task's waker.
    #[inline]
    pub(crate) fn poll_until<T>(
        &self,
        cx: &mut TaskContext<'_>,
        mut check: impl FnMut(&mut State) -> Option<T>,
        register: impl FnOnce(&mut State, &Waker),
    ) -> Poll<T> {
        if progress::in_joined() {
            // Polled with others (`Worker::poll_joined`), which progresses the worker for
            // all of them: look, and leave the waker for event mode's wake-up.
            return self.locked(|st| match check(st) {
                Some(t) => Poll::Ready(t),
                None => {
                    register(st, cx.waker());
                    Poll::Pending
                }
            });
        }
        match self.mode {
            ProgressMode::BusyPoll => {
                // Spin in rounds: each round holds the lock for up to SPIN_ROUND progress
                // calls (so arrival is noticed within one progress call), then releases it
                // so other threads can post.
                self.busy_spin_for(cx, |_, round| {
                    self.locked(|st| {
                        if let Some(t) = check(st) {
                            return Some(t);
                        }
                        for _ in 0..round {
                            if self.progress_locked(st) != 0 {
                                if let Some(t) = check(st) {
                                    return Some(t);
                                }
                            }
                        }
                        check(st)
                    })
                })
            }
            ProgressMode::Event => self.locked(|st| {
                if let Some(t) = check(st) {
                    return Poll::Ready(t);
                }
                // Progress, then sleep. Arming the worker is left to the driver, which
                // does it right before it sleeps: an armed worker makes every sender
                // signal it (a syscall on each side per message), so arming on every
                // poll, as the plain wakeup protocol would, costs several syscalls per
                // message. The driver's arm stays in force while it sleeps: whatever
                // arrives after it makes the event fd readable, whoever progresses it.
                //
                // A short spin catches a reply that is already on its way (a round trip
                // over shared memory is well under a microsecond) without a sleep and a
                // wake-up. After a spin that found nothing, the next ones are skipped for a
                // while, so that many futures polled in turn (a `join_all`) or a slow peer
                // cost one spin, not one each.
                let now = Instant::now();
                if st.spin_quiet_until.map_or(true, |q| now >= q) {
                    let end = now + progress::EVENT_SPIN;
                    loop {
                        for _ in 0..8 {
                            if self.progress_locked(st) != 0 {
                                if let Some(t) = check(st) {
                                    return Poll::Ready(t);
                                }
                            }
                        }
                        let now = Instant::now();
                        if now >= end {
                            st.spin_quiet_until = Some(now + progress::EVENT_SPIN_QUIET);
                            break;
                        }
                    }
                } else {
                    self.progress_locked(st);
                }
                // Checked again whatever the progress calls returned: one that reports no
                // event may still have finished what this future waits for, and no wake-up
                // would follow.
                if let Some(t) = check(st) {
                    return Poll::Ready(t);
                }
                register(st, cx.waker());
                Poll::Pending
            }),
        }
    }
}

/// Every worker of this process, for a worker being dropped to progress the others
/// while it waits for its last operations ([`WorkerInner`]'s `Drop`).
pub(super) static LIVE: std::sync::Mutex<Vec<Weak<WorkerInner>>> = std::sync::Mutex::new(Vec::new());

/// Adds a new worker to [`LIVE`], forgetting the destroyed ones.
pub(super) fn register_live(w: &Arc<WorkerInner>) {
    let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(w));
}

/// The workers of this process still alive (not the one being dropped, whose count is
/// already zero).
pub(super) fn live_workers() -> Vec<Arc<WorkerInner>> {
    // Collected under the lock, dropped after it: dropping the last handle of a worker
    // runs its `Drop`, which takes this lock.
    LIVE.lock().unwrap_or_else(PoisonError::into_inner).iter().filter_map(Weak::upgrade).collect()
}

/// Idle rounds (nothing progressed) a worker being dropped spins, yielding, while it
/// waits for its last operations, before it sleeps [`DROP_IDLE_SLEEP`] between rounds.
const DROP_SPIN_ROUNDS: u32 = 1000;

/// The pause between idle rounds of a worker's drop, once [`DROP_SPIN_ROUNDS`] passed.
const DROP_IDLE_SLEEP: Duration = Duration::from_micros(200);

/// What [`WorkerInner::bind_current`] changed on the thread.
#[cfg(feature = "cuda")]
type Bound = Option<crate::cuda::Previous>;
/// What [`WorkerInner::bind_current`] changed on the thread: nothing, without `cuda`.
#[cfg(not(feature = "cuda"))]
struct Bound;

/// Gives the thread back the context [`WorkerInner::bind_current`] replaced.
#[inline(always)]
fn unbind(bound: Bound) {
    #[cfg(feature = "cuda")]
    if let Some(prev) = bound {
        crate::cuda::Bound::unbind(prev);
    }
    #[cfg(not(feature = "cuda"))]
    let Bound = bound;
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        let bound = self.bind_current();
        let st = self.state.get_mut();
        // Active messages held for ids nobody registered give their payloads back first,
        // while the worker can still tell rendezvous senders (UCX sends that during the
        // release call, or during the wait below).
        if let Some(am) = &mut st.am {
            // SAFETY: exclusive access (we are in drop); the worker is not destroyed yet.
            unsafe { am.release(st.handle) };
        }
        // Endpoints still closing through their peer close now, and the hidden ones.
        st.end_all_partings();
        st.close_hidden();
        // Let parked operations (sends to slow peers, closes of dropped endpoints)
        // finish, bounded. Their peer may be another worker of this process that only
        // this thread would progress (a single-thread runtime, blocked here): other live
        // workers are progressed too, when free.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        let others = if st.parked > 0 || st.closes_waiting_ops > 0 { live_workers() } else { Vec::new() };
        let mut idle = 0u32;
        while (st.parked > 0 || st.closes_waiting_ops > 0) && std::time::Instant::now() < deadline {
            // SAFETY: exclusive access (we are in drop); the worker is valid.
            let mut n = unsafe { sys::ucp_worker_progress(st.handle) };
            // Closes that waited for operations run once those finished (UCX purges them
            // when the endpoint fails: such a close is quiet, as in `chores`).
            st.fail_reported();
            for id in std::mem::take(&mut st.partings.news) {
                st.run_deferred_close(id);
            }
            for w in &others {
                n += w.progress_if_free();
            }
            if n > 0 {
                idle = 0;
            } else if idle < DROP_SPIN_ROUNDS {
                idle += 1;
                std::thread::yield_now();
            } else {
                // A peer that does not answer (gone, or not progressing) would otherwise
                // cost a whole core for the rest of the wait.
                std::thread::sleep(DROP_IDLE_SLEEP);
            }
        }
        // Closes still waiting for operations: in peer mode forced now (UCX purges the
        // operations); without it UCX offers no way to end them, and destroying the worker
        // would destroy the endpoint with them (UCX 1.13 asserts; without assertions
        // they keep pointing at it), so the UCX worker is left as it is, never progressed
        // again, with its context (see `Worker`).
        let stuck: Vec<u64> = st.eps.iter().filter(|(_, e)| e.close_waits_ops()).map(|(&id, _)| id).collect();
        let mut leak = false;
        for id in stuck {
            if st.eps.get(&id).is_some_and(|e| e.peer_mode) {
                st.close_deferred(id, true);
            } else {
                leak = true;
            }
        }
        if leak {
            tracing::warn!(
                "a worker dropped with sends its peer never took, on an endpoint without peer error \
                 handling: UCX cannot end them, so the UCX worker and its context are leaked instead of destroyed"
            );
            std::mem::forget(self.ctx.clone());
            // The active-message tables too: the UCX worker still points into them.
            std::mem::forget(st.am.take());
            drop(others);
            LIVE.lock().unwrap_or_else(PoisonError::into_inner).retain(|w| w.strong_count() > 0);
            drop(std::mem::take(&mut st.after));
            return;
        }
        // SAFETY: we are in drop, the worker not yet destroyed.
        unsafe {
            request::free_spare(st);
            request::give_up_closes(st);
        }
        if st.parked > 0 {
            tracing::warn!(
                parked = st.parked,
                "destroying a worker with operations UCX never completed; their buffers are leaked, not freed"
            );
        }
        for (id, e) in st.eps.iter() {
            if !e.handle.is_null() {
                tracing::warn!(ep = id, "endpoint still open at worker destruction");
            }
        }
        // SAFETY: every endpoint, listener and operation holds the worker alive, so none is
        // left except parked requests, whose memory UCX reclaims here; the event fd's
        // AsyncFd was dropped with the driver before this runs.
        unsafe { sys::ucp_worker_destroy(st.handle) };
        unbind(bound);
        // Dropped only now: if one of them was the last handle of its worker, that
        // worker's drop runs here, with this worker gone, instead of inside the wait
        // above, where this worker could no longer be progressed for it.
        drop(others);
        // Forget this worker (and any other gone), so that its memory is freed.
        LIVE.lock().unwrap_or_else(PoisonError::into_inner).retain(|w| w.strong_count() > 0);
        drop(std::mem::take(&mut st.after));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a crowded host a busy-poll future spins at most `CROWDED_SPIN` calls and yields
    /// for at least `CROWDED_YIELD`; elsewhere the worker's settings hold as they are.
    #[test]
    fn busy_futures_spin_less_and_yield_more_when_crowded() {
        let crowded_yield = progress::busy_yield_us(progress::CROWDED_YIELD);
        let cases = [
            // (spin, yield_us, crowded) -> (spin, yield_us)
            ((512, 0, false), (512, 0)),
            ((512, 0, true), (progress::CROWDED_SPIN, crowded_yield)),
            ((2, 0, true), (2, crowded_yield)),
            ((512, 1000, true), (progress::CROWDED_SPIN, 1000)),
            ((1, 5, false), (1, 5)),
        ];
        for ((spin, yield_us, crowded), want) in cases {
            assert_eq!(busy_limits(spin, yield_us, crowded), want, "{spin} {yield_us} {crowded}");
        }
    }
}
