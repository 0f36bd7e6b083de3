//! Windows of operations in flight, as the bandwidth tests keep them: the client's
//! ([`Window`]: posts, counting only those UCX did not complete at once) and the
//! server's posted receives ([`keep_posted`]).

use std::collections::VecDeque;

use crate::clock::Clock;
use crate::AnyResult;

/// An operation of a bandwidth test: posted when made, and kept in the window until it
/// completes unless UCX completed it at once.
pub(crate) trait WindowOp: std::future::Future + Sized {
    fn completed_immediately(&self) -> bool;
    /// The operation's error, from its result.
    fn check(out: Self::Output) -> AnyResult<()>;
}

impl<B: Send + 'static> WindowOp for ucxkit::transport::SendOp<B> {
    fn completed_immediately(&self) -> bool {
        ucxkit::transport::SendOp::completed_immediately(self)
    }
    fn check(out: Self::Output) -> AnyResult<()> {
        Ok(out.0?)
    }
}

impl<B: ucxkit::transport::IoBufMut> WindowOp for ucxkit::transport::RecvOp<B> {
    fn completed_immediately(&self) -> bool {
        ucxkit::transport::RecvOp::completed_immediately(self)
    }
    fn check(out: Self::Output) -> AnyResult<()> {
        out.0?;
        Ok(())
    }
}

impl WindowOp for ucxkit::transport::Atomic {
    fn completed_immediately(&self) -> bool {
        ucxkit::transport::Atomic::completed_immediately(self)
    }
    fn check(out: Self::Output) -> AnyResult<()> {
        out?;
        Ok(())
    }
}

/// The client loop of a bandwidth test.
pub(crate) struct Window<'a> {
    /// Times the completions.
    pub(crate) clock: &'a mut Clock,
    /// Operations in all.
    pub(crate) total: u64,
    /// The first of them, not timed.
    pub(crate) warmup: u64,
    /// The most in flight.
    pub(crate) window: usize,
}

impl Window<'_> {
    /// Runs `total` operations, the first `warmup` unmeasured, keeping up to `window` in
    /// flight. Each is first offered to `sent_now` (`--immediate`), and made with `post`
    /// when that did not send it. As in ucx_perftest, only operations left in flight take
    /// a place in the window; one UCX completed at once is finished right here.
    ///
    /// Generic over the operation, so that the window holds one future type and the hot
    /// loop makes no choice of test.
    pub(crate) async fn keep<O: WindowOp>(
        self,
        mut sent_now: impl FnMut() -> AnyResult<bool>,
        mut post: impl FnMut() -> O,
    ) -> AnyResult<()> {
        let Window { clock, total, warmup, window } = self;
        let mut inflight: VecDeque<O> = VecDeque::with_capacity(window);
        for i in 0..total {
            if i == warmup {
                // Drain the warm-up operations before starting the clock.
                while let Some(op) = inflight.pop_front() {
                    O::check(op.await)?;
                }
                clock.restart();
            }
            if sent_now()? {
                if i >= warmup {
                    clock.record()?;
                }
                continue;
            }
            if inflight.len() == window {
                O::check(inflight.pop_front().expect("window is full").await)?;
                if i >= warmup {
                    clock.record()?;
                }
            }
            let op = post();
            if op.completed_immediately() {
                O::check(op.await)?;
                if i >= warmup {
                    clock.record()?;
                }
            } else {
                inflight.push_back(op);
            }
        }
        while let Some(op) = inflight.pop_front() {
            O::check(op.await)?;
            clock.record()?;
        }
        // Every measured operation is timed, the last ones without what follows.
        clock.close_batch()
    }
}

/// Receives `total` messages, keeping `window` receives posted with `post`, into
/// buffers from `buf` (each reposted as its receive completes).
pub(crate) async fn keep_posted<B, T, E, F>(
    total: u64,
    window: usize,
    mut buf: impl FnMut() -> B,
    post: impl Fn(B) -> F,
) -> AnyResult<()>
where
    F: std::future::Future<Output = (Result<T, E>, B)>,
    E: std::error::Error + Send + Sync + 'static,
{
    let mut posted = VecDeque::with_capacity(window);
    let mut next = 0u64;
    while next < total.min(window as u64) {
        posted.push_back(post(buf()));
        next += 1;
    }
    while let Some(f) = posted.pop_front() {
        let (r, b) = f.await;
        r?;
        if next < total {
            posted.push_back(post(b));
            next += 1;
        }
    }
    Ok(())
}
