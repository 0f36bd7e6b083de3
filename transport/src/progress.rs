//! Progress: the [`ProgressMode`] choice and the per-worker driver task, the only place
//! that ties a worker to tokio's reactor.
//!
//! In event mode the driver follows UCX's wakeup protocol: progress until
//! `ucp_worker_progress` returns 0, then `ucp_worker_arm`; if that says `UCS_ERR_BUSY`,
//! events arrived in between, so progress again; otherwise sleep until the worker's event
//! fd (`ucp_worker_get_efd`) turns readable. No core is used while idle.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tracing::Instrument;
use ucx_sys as sys;

use crate::worker::WorkerInner;

/// How a worker makes progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProgressMode {
    /// The default. The driver task sleeps on the worker's event fd and progresses the
    /// worker when woken; a pending operation's future also progresses once when polled.
    /// Costs no CPU while idle; adds the kernel's wakeup latency (a few µs) to each
    /// message that arrives while everything sleeps.
    #[default]
    Event,
    /// Futures progress the worker in a loop while they wait (yielding to tokio every few
    /// hundred iterations) and the driver task spins too. Lowest latency; keeps one core
    /// (or more, with several waiting tasks on a multi-thread runtime) at 100 %.
    BusyPoll,
}

/// Wakes the driver: to stop it, or to progress work that no fd event will announce.
#[derive(Default)]
pub(crate) struct Signal {
    stop: AtomicBool,
    sleeping: AtomicBool,
    notify: Notify,
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
    pub(crate) fn kick(&self) {
        if self.sleeping.load(Ordering::Acquire) {
            self.notify.notify_one();
        }
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

/// The driver task. Holds the worker alive until shutdown; its `AsyncFd` is dropped
/// before the worker (locals drop before the argument).
pub(crate) async fn drive(inner: Arc<WorkerInner>, signal: Arc<Signal>) {
    let span = tracing::debug_span!("ucx_progress", mode = ?inner.mode);
    match inner.mode {
        ProgressMode::Event => drive_event(&inner, &signal).instrument(span).await,
        ProgressMode::BusyPoll => drive_busy(&inner, &signal).instrument(span).await,
    }
}

/// First fallback wakeup after activity.
const MIN_TICK: Duration = Duration::from_millis(1);
/// Fallback wakeup period when idle (10 wakeups a second).
const MAX_TICK: Duration = Duration::from_millis(100);

async fn drive_event(inner: &WorkerInner, signal: &Signal) {
    let mut tick = MIN_TICK;
    // SAFETY: the event fd belongs to the worker, which `inner` keeps alive (and unchanged)
    // for longer than this AsyncFd, dropped when this function returns.
    let fd =
        match unsafe { AsyncFd::register_with_interest(EventFd(inner.efd), tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
        {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(
                    "registering the UCX event fd with tokio failed ({e}); falling back to busy polling"
                );
                return drive_busy(inner, signal).await;
            }
        };
    while !signal.is_stopped() {
        signal.sleeping.store(true, Ordering::Release);
        let armed = inner.locked(|st| inner.drain_and_arm(st));
        if armed.0 == sys::UCS_ERR_BUSY {
            signal.sleeping.store(false, Ordering::Release);
            tokio::task::yield_now().await;
            continue;
        }
        if !armed.is_ok() {
            signal.sleeping.store(false, Ordering::Release);
            tracing::error!(status = %armed, "ucp_worker_arm failed; falling back to busy polling");
            drop(fd);
            return drive_busy(inner, signal).await;
        }
        // UCX also queues work that no fd announces (endpoint discards after a failure,
        // protocol steps on its progress queue): a backed-off timer makes sure it runs.
        tokio::select! {
            r = fd.readable() => match r {
                Ok(mut g) => {
                    g.clear_ready();
                    tick = MIN_TICK;
                }
                Err(e) => {
                    tracing::error!("waiting on the UCX event fd failed ({e}); falling back to busy polling");
                    drop(fd);
                    return drive_busy(inner, signal).await;
                }
            },
            _ = signal.notify.notified() => tick = MIN_TICK,
            _ = tokio::time::sleep(tick) => tick = (tick * 2).min(MAX_TICK),
        }
        signal.sleeping.store(false, Ordering::Release);
    }
}

async fn drive_busy(inner: &WorkerInner, signal: &Signal) {
    while !signal.is_stopped() {
        inner.locked(|st| inner.progress_locked(st));
        tokio::task::yield_now().await;
    }
}
