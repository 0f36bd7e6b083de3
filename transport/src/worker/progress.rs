//! Progress: the [`ProgressMode`] choice, the per-worker driver task (the only place
//! that ties a worker to tokio's reactor) and operations progressed together
//! ([`Worker::poll_joined`]).
//!
//! In event mode the driver follows UCX's wakeup protocol: progress until
//! `ucp_worker_progress` returns 0, then `ucp_worker_arm`; if that says `UCS_ERR_BUSY`,
//! events arrived in between, so progress again; otherwise sleep until the worker's event
//! fd (`ucp_worker_get_efd`) turns readable. No core is used while idle.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tracing::Instrument;
use ucx_sys as sys;

use super::crowding::Crowding;
use super::{Worker, WorkerInner, SPIN_ROUND};

/// How a worker makes progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProgressMode {
    /// The default. The driver task sleeps on the worker's event fd and progresses the
    /// worker when woken. A pending operation's future, when polled, progresses the
    /// worker for up to [`EVENT_SPIN`] before it sleeps, which catches a reply already on
    /// its way (a round trip over shared memory takes well under a microsecond) without a
    /// sleep and a wake-up; after a spin that found nothing, the futures polled in the
    /// next [`EVENT_SPIN_QUIET`] do not spin. After traffic the driver keeps polling for
    /// a short linger ([`crate::WorkerBuilder::event_linger`]) before it sleeps again, so
    /// request-reply traffic is not slowed by a sleep and a wake-up per message. While
    /// the host is crowded (more threads ready to run than cores, or the driver's thread
    /// waits for a core over a tenth of the time), it yields the processor between the
    /// linger's polls, so that the peers it waits for get the core. Costs
    /// no CPU while idle; a message that arrives while everything sleeps pays the
    /// kernel's wake-up latency (a few µs).
    #[default]
    Event,
    /// Futures progress the worker in a loop while they wait (yielding to tokio every few
    /// hundred iterations, after which the driver lets them run again first, or after
    /// [`crate::WorkerBuilder::busy_yield`] of yielding the processor) and the
    /// driver task spins too while the worker is busy (yielding the processor between
    /// its polls on a crowded host, as the event mode's linger does). Lowest
    /// latency; keeps one core (or more, with several waiting tasks on a multi-thread
    /// runtime) at 100 % while traffic flows. After [`BUSY_IDLE`] without any event and with
    /// no future waiting, the driver sleeps on the event fd as in [`ProgressMode::Event`]
    /// until something happens, so an idle worker costs no CPU.
    BusyPoll,
}

thread_local! {
    /// Set while [`crate::Worker::poll_joined`] polls its operations on this thread.
    static JOINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the current poll runs inside [`crate::Worker::poll_joined`].
#[inline]
pub(crate) fn in_joined() -> bool {
    JOINED.with(std::cell::Cell::get)
}

/// Runs `f` with [`in_joined`] set (and restores it afterwards, even on a panic).
pub(crate) fn as_joined<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            JOINED.with(|j| j.set(self.0));
        }
    }
    let _restore = Restore(JOINED.with(|j| j.replace(true)));
    f()
}

/// Wakes the driver: to stop it, or to progress work that no fd event will announce.
#[derive(Default)]
pub(crate) struct Signal {
    stop: AtomicBool,
    sleeping: AtomicBool,
    notify: Notify,
    /// Bumped by a busy-poll future each time it gives up its spin and yields to tokio
    /// (see [`Signal::future_yielded`]).
    yields: AtomicU32,
}

impl Signal {
    /// Stops the driver.
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    /// Makes a sleeping driver run its progress-and-arm cycle once more. Needed after
    /// posting an operation that did not complete at once: UCX may continue it from its
    /// progress queue (a rendezvous get, a pending send) without any fd event.
    #[inline]
    pub(crate) fn kick(&self) {
        // The first kick after the driver went to sleep takes the flag and wakes it; the
        // ones after it, until the driver runs (every pending post while a waiting future
        // keeps the runtime busy), cost one load instead of a compare-and-swap in
        // `Notify`. A wake-up left over from a kick that raced with the driver waking on
        // its own ends its next sleep early, which costs one more turn, nothing else.
        if self.sleeping.load(Ordering::Acquire) && self.sleeping.swap(false, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }

    /// Tells the driver that a busy-poll future spun without its result and yielded,
    /// waking itself. The driver then steps aside for one turn instead of spinning: on a
    /// current-thread runtime a task that keeps waking itself is run up to 61 times
    /// before `block_on` polls its future again, which made every such yield cost the
    /// waiting future several microseconds.
    pub(crate) fn future_yielded(&self) {
        self.yields.fetch_add(1, Ordering::Relaxed);
    }

    fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl Worker {
    /// Polls several pending operations of this worker together: `poll_all` polls each
    /// (their futures look for their results without progressing the worker), and
    /// whenever the worker, progressed here for all of them, handles an event, it polls
    /// them again. For protocols whose operations wait on the task's own reaction to each
    /// other's results (a credit that frees a slot for the next piece): a future polled
    /// on its own spins for its own result only (in busy-poll mode a whole
    /// [`crate::WorkerBuilder::busy_spin`]), while the result it waits for may need the task to
    /// act on another's first.
    ///
    /// Progress as the futures make it: busy-poll mode spins up to the busy spin, then
    /// yields (spinning again within [`crate::WorkerBuilder::busy_yield`]); event mode spins up
    /// to [`EVENT_SPIN`] and leaves the rest to the driver (the futures' wakers are
    /// registered).
    pub fn poll_joined<R>(
        &self,
        cx: &mut TaskContext<'_>,
        mut poll_all: impl FnMut(&mut TaskContext<'_>) -> Poll<R>,
    ) -> Poll<R> {
        let inner = &self.shared.inner;
        as_joined(|| {
            if let Poll::Ready(r) = poll_all(cx) {
                return Poll::Ready(r);
            }
            // Progress until an event, a round at a time (the lock is let go between
            // rounds so that other threads can post).
            let mut round = |cx: &mut TaskContext<'_>, n: u32| {
                let events = inner.locked(|st| (0..n).any(|_| inner.progress_locked(st) != 0));
                match events.then(|| poll_all(cx)) {
                    Some(Poll::Ready(r)) => Some(r),
                    _ => None,
                }
            };
            if inner.mode == ProgressMode::BusyPoll {
                return inner.busy_spin_for(cx, round);
            }
            // Event mode: later completions wake the task through the futures' wakers.
            let end = Instant::now() + EVENT_SPIN;
            loop {
                if let Some(r) = round(cx, SPIN_ROUND) {
                    return Poll::Ready(r);
                }
                if Instant::now() >= end {
                    return Poll::Pending;
                }
            }
        })
    }
}

/// The driver task. Holds the worker alive until shutdown; its `AsyncFd` is dropped
/// before the worker (locals drop before the argument).
pub(crate) async fn drive(inner: Arc<WorkerInner>, signal: Arc<Signal>) {
    let span = tracing::debug_span!("ucx_progress", mode = ?inner.mode);
    match inner.mode {
        ProgressMode::Event => drive_sleeping(&inner, &signal, inner.linger).instrument(span).await,
        ProgressMode::BusyPoll => drive_sleeping(&inner, &signal, BUSY_IDLE).instrument(span).await,
    }
}

/// How long a busy-poll driver spins without seeing an event before it sleeps on the
/// event fd.
pub const BUSY_IDLE: Duration = Duration::from_millis(5);

/// Default [`crate::WorkerBuilder::busy_spin`]: a waiting future's progress calls
/// before it yields (some 10 us of polling here, many round trips over shared memory).
pub const DEFAULT_BUSY_SPIN: u32 = 512;

/// The longest [`crate::WorkerBuilder::busy_yield`].
const MAX_BUSY_YIELD: Duration = Duration::from_secs(1);

/// Busy-poll mode on a crowded host (more threads ready to run than processors, or the
/// driver's thread waiting for one over a tenth of the time): a waiting future spins at
/// most this many progress calls before it yields the processor, whatever
/// [`crate::WorkerBuilder::busy_spin`] says. The
/// process a message waits for is then often not running, and the sooner the waiting
/// one yields, the sooner it runs (Open MPI yields on every idle poll when
/// oversubscribed). Two ranks confined to one processor (`taskset`), 8 B: broadcast
/// 0.78 -> 0.43-0.53 us, allreduce 13.0-13.3 -> 3.3 (Open MPI, yielding: 0.19, 2.4).
pub const CROWDED_SPIN: u32 = 4;

/// Busy-poll mode on a crowded host: a waiting future goes on yielding and spinning
/// within one poll for at least this long ([`crate::WorkerBuilder::busy_yield`]).
pub const CROWDED_YIELD: Duration = Duration::from_micros(20);

/// [`crate::WorkerBuilder::busy_yield`]'s `time` as kept: whole microseconds, rounded
/// up, at most [`MAX_BUSY_YIELD`].
pub(crate) fn busy_yield_us(time: Duration) -> u32 {
    let us = time.min(MAX_BUSY_YIELD).as_nanos().div_ceil(1000);
    u32::try_from(us).unwrap_or(u32::MAX)
}

/// Default event-mode linger ([`crate::WorkerBuilder::event_linger`]): longer than a
/// round trip over TCP loopback, so that request-reply traffic keeps the driver polling.
pub const DEFAULT_LINGER: Duration = Duration::from_micros(50);

/// Event mode: how long a waiting future polls the worker before it sleeps, to catch a
/// reply already on its way.
pub const EVENT_SPIN: Duration = Duration::from_micros(2);
/// Event mode: after a waiting future's spin found nothing, how long the futures polled
/// next skip theirs (so that many futures polled in turn, or a slow peer, cost one spin).
pub const EVENT_SPIN_QUIET: Duration = Duration::from_micros(50);

/// First fallback wakeup after activity.
const MIN_TICK: Duration = Duration::from_millis(1);
/// Fallback wakeup period when idle (10 wakeups a second).
const MAX_TICK: Duration = Duration::from_millis(100);

fn register_efd(inner: &WorkerInner) -> std::io::Result<AsyncFd<EventFd>> {
    // SAFETY: the event fd belongs to the worker, which `inner` keeps alive (and unchanged)
    // for longer than the AsyncFd, dropped by the caller before it returns.
    unsafe { AsyncFd::register_with_interest(EventFd(inner.efd), tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

/// What one sleep on the event fd ended with.
enum Slept {
    /// An event, a kick or the fallback timer: go on.
    Woken,
    /// The fd cannot be used: spin instead.
    Broken,
}

/// One cycle of UCX's wakeup protocol: drain, arm, sleep until the fd, a kick or the
/// fallback timer (`tick`, backed off while nothing happens).
async fn sleep_once(
    inner: &WorkerInner,
    signal: &Signal,
    fd: &AsyncFd<EventFd>,
    tick: &mut Duration,
) -> Slept {
    signal.sleeping.store(true, Ordering::Release);
    let status = inner.locked(|st| {
        while inner.progress_locked(st) != 0 {}
        // Endpoints closing through their peer: their deadline passes
        // with no event to announce it (the fallback timer below brings the driver back).
        if st.parting_count() > 0 {
            st.end_overdue_partings(std::time::Instant::now());
        }
        // Probes (`tag_recv_any`) are woken when a progress call reports events; a
        // message that became visible in a call reporting none would leave them asleep,
        // so they look again before the driver sleeps.
        st.wake_probes();
        inner.arm(st)
    });
    if status.0 == sys::UCS_ERR_BUSY {
        signal.sleeping.store(false, Ordering::Release);
        tokio::task::yield_now().await;
        return Slept::Woken;
    }
    if !status.is_ok() {
        signal.sleeping.store(false, Ordering::Release);
        tracing::error!(%status, "ucp_worker_arm failed; falling back to busy polling");
        return Slept::Broken;
    }
    // UCX also queues work that no fd announces (endpoint discards after a failure,
    // protocol steps on its progress queue): a backed-off timer makes sure it runs.
    let r = tokio::select! {
        r = fd.readable() => match r {
            Ok(mut g) => {
                g.clear_ready();
                *tick = MIN_TICK;
                Slept::Woken
            }
            Err(e) => {
                tracing::error!("waiting on the UCX event fd failed ({e}); falling back to busy polling");
                Slept::Broken
            }
        },
        _ = signal.notify.notified() => {
            *tick = MIN_TICK;
            Slept::Woken
        }
        _ = tokio::time::sleep(*tick) => {
            *tick = (*tick * 2).min(MAX_TICK);
            Slept::Woken
        }
    };
    signal.sleeping.store(false, Ordering::Release);
    r
}

/// Both modes: poll the worker while events keep coming (`poll_for`: the event mode's
/// linger, [`BUSY_IDLE`] in busy-poll mode), then sleep on the event fd until something
/// happens. In busy-poll mode the waiting futures progress the worker themselves, so a
/// sleeping driver costs them nothing.
async fn drive_sleeping(inner: &WorkerInner, signal: &Signal, poll_for: Duration) {
    let mut tick = MIN_TICK;
    let fd = match register_efd(inner) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(
                "registering the UCX event fd with tokio failed ({e}); falling back to busy polling"
            );
            return spin(inner, signal).await;
        }
    };
    let adapt = inner.mode == ProgressMode::Event;
    let mut linger = poll_for;
    let mut crowding = Crowding::new();
    while !signal.is_stopped() {
        if crowded(inner, &mut crowding, Instant::now()) {
            // The linger's polling (or the busy-poll mode's, after traffic) would take
            // the core from the peers it waits for: the whole of it, giving the core away
            // between polls.
            poll_while_busy(inner, signal, poll_for, Pace::Cede, &mut crowding).await;
        } else {
            let caught = poll_while_busy(inner, signal, linger, Pace::Spin, &mut crowding).await;
            if adapt {
                linger = next_linger(poll_for, linger, caught);
            }
        }
        let slept = std::time::Instant::now();
        let woken = sleep_once(inner, signal, &fd, &mut tick).await;
        if adapt && slept.elapsed() < poll_for {
            // Woken within the full linger: lingering would have caught it.
            linger = poll_for;
        }
        if let Slept::Broken = woken {
            drop(fd);
            return spin(inner, signal).await;
        }
    }
}

/// The event mode's next linger, after one of `linger` that `caught` an event or not:
/// the full `full` again after a linger that caught one (it saved a sleep and a
/// wake-up), half after one that did not, down to nothing after six in a row. A worker
/// whose peers answer within the linger (request and reply, a collective's steps) keeps
/// it; one whose peers are slow (starved of CPU by this very polling, as receivers that
/// share cores with a holder are) stops spinning for them.
fn next_linger(full: Duration, linger: Duration, caught: bool) -> Duration {
    if caught {
        full
    } else if linger <= full / 32 {
        Duration::ZERO
    } else {
        linger / 2
    }
}

/// How [`poll_while_busy`] waits between progress calls that found nothing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Lets the runtime's other ready tasks run, and polls again.
    Spin,
    /// Also yields the processor (`sched_yield`) to the processes waiting for it.
    Cede,
}

/// Whether the host is crowded, as `crowding` finds it at `now` (it looks again every
/// few milliseconds); published to the worker's busy-poll futures when it changes (a
/// store each time would pull the flag's cache line from the cores that read it).
fn crowded(inner: &WorkerInner, crowding: &mut Crowding, now: Instant) -> bool {
    let c = crowding.crowded(now);
    if inner.crowded.load(Ordering::Relaxed) != c {
        inner.crowded.store(c, Ordering::Relaxed);
    }
    c
}

/// Keeps progressing the worker, yielding to other tasks between calls (and the
/// processor, at `pace` [`Pace::Cede`], and from when `crowding` finds the host crowded),
/// until `idle` passes without an event (or the driver is stopped); whether it found an
/// event.
async fn poll_while_busy(
    inner: &WorkerInner,
    signal: &Signal,
    idle: Duration,
    mut pace: Pace,
    crowding: &mut Crowding,
) -> bool {
    let mut caught = false;
    if idle.is_zero() {
        return caught;
    }
    let mut last = std::time::Instant::now();
    let mut rounds = 0u32;
    let mut yields = signal.yields.load(Ordering::Relaxed);
    while !signal.is_stopped() {
        let y = signal.yields.load(Ordering::Relaxed);
        if y != yields {
            // A future that progresses the worker itself is waiting to be polled again:
            // let it run first (`yield_now` lets the runtime's queue drain), rather
            // than spinning ahead of it.
            yields = y;
            last = std::time::Instant::now();
            tokio::task::yield_now().await;
            continue;
        }
        if inner.locked(|st| inner.progress_locked(st)) > 0 {
            caught = true;
            last = std::time::Instant::now();
            // Something happened: let the runtime poll everything, the future `block_on`
            // runs included, which it does only after polling its I/O driver.
            tokio::task::yield_now().await;
        } else {
            rounds = rounds.wrapping_add(1);
            // Read the clock only now and then: the spin is what must stay cheap.
            if rounds % 16 == 0 {
                let now = Instant::now();
                if now.duration_since(last) >= idle {
                    return caught;
                }
                // Traffic can keep this loop going for as long as it lasts: look again.
                if crowded(inner, crowding, now) {
                    pace = Pace::Cede;
                }
            }
            // Nothing happened: let other ready tasks run, without the system call
            // `yield_now` costs.
            if pace == Pace::Cede {
                std::thread::yield_now();
            }
            requeue().await;
        }
    }
    caught
}

/// Lets the other ready tasks run, then continues: the task wakes itself and returns
/// `Pending` once. Unlike `tokio::task::yield_now`, which defers the wake-up until the
/// runtime has polled its I/O driver (an `epoll_wait` system call), this costs no system
/// call; the runtime still polls its driver at its regular interval (every 61 tasks on a
/// current-thread runtime), and a future run by `block_on` waits for that too.
fn requeue() -> impl std::future::Future<Output = ()> {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
}

/// Progresses the worker in a loop, yielding to other tasks between calls.
async fn spin(inner: &WorkerInner, signal: &Signal) {
    while !signal.is_stopped() {
        inner.locked(|st| inner.progress_locked(st));
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lingers_that_catch_nothing_shrink_to_none_and_one_that_catches_restores_it() {
        let full = DEFAULT_LINGER;
        let mut l = full;
        let mut seen = vec![l];
        for _ in 0..8 {
            l = next_linger(full, l, false);
            seen.push(l);
        }
        assert_eq!(seen[1], full / 2);
        assert_eq!(*seen.last().unwrap(), Duration::ZERO);
        assert_eq!(seen.iter().position(|d| d.is_zero()), Some(6), "six in a row: {seen:?}");
        assert_eq!(next_linger(full, Duration::ZERO, true), full);
        assert_eq!(next_linger(full, full / 4, true), full);
    }

    /// Whether a wake-up is stored for the driver (consuming it).
    async fn woken(s: &Signal) -> bool {
        tokio::time::timeout(Duration::from_millis(20), s.notify.notified()).await.is_ok()
    }

    #[tokio::test]
    async fn a_kick_wakes_a_sleeping_driver_and_only_the_first_notifies() {
        let s = Signal::default();
        // An awake driver needs no wake-up.
        s.kick();
        assert!(!woken(&s).await, "a kick woke a driver that was not sleeping");
        // A sleeping one gets exactly one, from the first kick, which takes the flag.
        s.sleeping.store(true, Ordering::Release);
        s.kick();
        assert!(!s.sleeping.load(Ordering::Acquire), "the first kick left the flag set");
        s.kick();
        assert!(woken(&s).await, "a kick did not wake the sleeping driver");
        assert!(!woken(&s).await, "a later kick stored another wake-up");
        // Asleep again: woken again.
        s.sleeping.store(true, Ordering::Release);
        s.kick();
        assert!(woken(&s).await, "a kick did not wake the driver after its next sleep");
    }
}
