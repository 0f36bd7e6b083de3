//! [`Worker::shutdown`]: a worker's orderly end, awaited instead of left to `Drop`.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::endpoint::Endpoint;
use crate::error::{Error, Peer, Result};
use crate::worker::Worker;

/// Idle polls of the wait for the last operations that only yield before it sleeps.
const SPIN_POLLS: u32 = 64;
/// The pause between later polls.
const POLL_SLEEP: Duration = Duration::from_micros(500);

impl Worker {
    /// Ends this worker within `limit`: closes its listeners (their pending requests are
    /// refused) and every endpoint still open ([`Endpoint::close`], all at once), then
    /// waits for the operations still in flight (sends its peers have not taken, closes
    /// going through their peers) to finish, then lets go of this handle. The UCX worker
    /// is destroyed when its last handle goes: at the end of this call when it held the
    /// last one, at once then, since nothing is left to wait for. Afterwards listening
    /// and connecting on the worker (through any clone) are refused, and operations on
    /// its endpoints fail as on closed ones.
    ///
    /// Unlike dropping the last handle, which waits up to 2 s on the dropping thread
    /// (see [`Worker`]), this waits on the runtime without blocking it.
    ///
    /// # Errors
    /// [`Error::Timeout`] when endpoints or operations were still not done at `limit`;
    /// the rest is left to the worker's drop (bounded as always). The first close error
    /// otherwise (the worker is shut down all the same).
    ///
    /// # Cancel safety
    /// Safe to drop: the listeners are closed and the endpoints' closes go on in the
    /// background.
    pub async fn shutdown(self, limit: Duration) -> Result<()> {
        // (Bounded, so that `Duration::MAX` means "no limit" rather than an overflow.)
        let deadline = Instant::now() + limit.min(Duration::from_secs(1 << 32));
        self.shared.shut.store(true, Ordering::Release);
        let closers: Vec<_> =
            std::mem::take(&mut *self.shared.closers.lock().unwrap_or_else(PoisonError::into_inner));
        for c in closers.iter().filter_map(std::sync::Weak::upgrade) {
            c.close();
        }
        let mut closes = tokio::task::JoinSet::new();
        for ep in self.open_endpoints() {
            closes.spawn(ep.close());
        }
        let mut first_error = None;
        let joined = tokio::time::timeout_at(deadline.into(), async {
            while let Some(r) = closes.join_next().await {
                if let Ok(Err(e)) = r {
                    first_error.get_or_insert(e);
                }
            }
        })
        .await;
        // Closes not done by the deadline go on in the background.
        closes.detach_all();
        let mut idle = 0u32;
        while self.parked_requests() > 0 && Instant::now() < deadline {
            if self.shared.inner.progress_if_free() > 0 {
                idle = 0;
                tokio::task::yield_now().await;
            } else if idle < SPIN_POLLS {
                idle += 1;
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(POLL_SLEEP).await;
            }
        }
        let left = self.parked_requests();
        drop(self);
        if joined.is_err() || left > 0 {
            return Err(Error::Timeout { op: "shutdown", peer: Peer::Any, after: limit });
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The endpoints of this worker still open, as handles.
    fn open_endpoints(&self) -> Vec<Endpoint> {
        self.shared.inner.locked(|st| {
            st.eps
                .iter()
                .map(|(_, e)| e)
                .filter(|e| !e.handle.is_null() && !e.hidden)
                .filter_map(|e| Endpoint::from_ref(&e.endpoint))
                .collect()
        })
    }
}
