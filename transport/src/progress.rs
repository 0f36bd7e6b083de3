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

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tracing::Instrument;
use ucx_sys as sys;

use crate::error::Status;
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

/// Tells the driver to stop.
#[derive(Default)]
pub(crate) struct Shutdown {
    flag: AtomicBool,
    notify: Notify,
}

impl Shutdown {
    pub(crate) fn signal(&self) {
        self.flag.store(true, Ordering::Release);
        self.notify.notify_one();
    }
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
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
pub(crate) async fn drive(inner: Arc<WorkerInner>, shutdown: Arc<Shutdown>) {
    let span = tracing::debug_span!("ucx_progress", mode = ?inner.mode);
    match inner.mode {
        ProgressMode::Event => drive_event(&inner, &shutdown).instrument(span).await,
        ProgressMode::BusyPoll => drive_busy(&inner, &shutdown).instrument(span).await,
    }
}

async fn drive_event(inner: &WorkerInner, shutdown: &Shutdown) {
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
                return drive_busy(inner, shutdown).await;
            }
        };
    while !shutdown.is_set() {
        let armed = inner.locked(|st| {
            while inner.progress_locked(st) != 0 {}
            // SAFETY: the worker is valid under the lock and has UCP_FEATURE_WAKEUP.
            Status(unsafe { sys::ucp_worker_arm(st.handle) })
        });
        if armed.0 == sys::UCS_ERR_BUSY {
            tokio::task::yield_now().await;
            continue;
        }
        if !armed.is_ok() {
            tracing::error!(status = %armed, "ucp_worker_arm failed; falling back to busy polling");
            drop(fd);
            return drive_busy(inner, shutdown).await;
        }
        tokio::select! {
            r = fd.readable() => match r {
                Ok(mut g) => g.clear_ready(),
                Err(e) => {
                    tracing::error!("waiting on the UCX event fd failed ({e}); falling back to busy polling");
                    drop(fd);
                    return drive_busy(inner, shutdown).await;
                }
            },
            _ = shutdown.notify.notified() => break,
        }
    }
}

async fn drive_busy(inner: &WorkerInner, shutdown: &Shutdown) {
    while !shutdown.is_set() {
        inner.locked(|st| inner.progress_locked(st));
        tokio::task::yield_now().await;
    }
}
