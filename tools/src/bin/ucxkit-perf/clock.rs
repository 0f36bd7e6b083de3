//! The run clock: one cheap read per iteration (latency) or per [`BATCH`] completions
//! (bandwidth).
//!
//! A latency loop reads the clock between posting its message and waiting for the reply,
//! and over shared memory a reply can arrive within 100 ns, so the read sits on the round
//! trip. It therefore reads the processor's time-stamp counter where there is one that
//! runs at a constant rate (through `quanta`, which checks that and otherwise falls back
//! to the monotonic clock), as ucx_perftest does (`ucs_get_time`): about 12 ns here,
//! against 33 ns for `Instant::elapsed`. Intervals stay in counter ticks in a buffer and
//! are scaled to nanoseconds when they go into the histogram, when the buffer is full or
//! the run ends.
//!
//! A bandwidth loop over shared memory completes a short put in about 10 ns of UCX's
//! time, less than one clock read, so it reads the clock once per batch of completions
//! and records each of them as the batch's mean interval.

use std::time::Instant;

use hdrhistogram::Histogram;

use crate::AnyResult;

/// Intervals buffered before they go into the histogram.
const BUFFERED: usize = 1 << 20;

/// Bandwidth completions per clock read.
pub(crate) const BATCH: u64 = 16;

/// Times a run: one clock read per round trip (latency), each timed from the previous
/// one, or per batch of [`BATCH`] completions (bandwidth); the run's clock starts when
/// warm-up ends.
pub(crate) struct Clock {
    warmup: u64,
    /// When the measured part began (for the run's total time).
    pub(crate) start: Instant,
    /// The counter every read comes from.
    ticks: quanta::Clock,
    /// The previous read, in ticks.
    last: u64,
    /// Intervals in ticks, not yet in `hist`.
    pending: Vec<u64>,
    /// Bandwidth completions since the last read.
    batched: u64,
    hist: Histogram<u64>,
}

impl Clock {
    pub(crate) fn new(warmup: u64) -> AnyResult<Clock> {
        let ticks = quanta::Clock::new();
        Ok(Clock {
            warmup,
            start: Instant::now(),
            last: ticks.raw(),
            ticks,
            pending: Vec::with_capacity(BUFFERED),
            batched: 0,
            hist: Histogram::new(3)?,
        })
    }

    /// The counter now, in ticks.
    #[inline]
    fn now(&self) -> u64 {
        self.ticks.raw()
    }

    /// At the start of iteration `i` of a latency test (after posting its message), or
    /// with `i` = the iteration count after the last one: ends iteration `i - 1`.
    #[inline]
    pub(crate) fn tick_before(&mut self, i: u64) -> AnyResult<()> {
        match i.checked_sub(1) {
            Some(prev) => self.tick(prev),
            None => Ok(()),
        }
    }

    /// After iteration `i` of a latency test.
    #[inline]
    fn tick(&mut self, i: u64) -> AnyResult<()> {
        let now = self.now();
        if i >= self.warmup {
            self.push(now.saturating_sub(self.last))?;
        } else if i + 1 == self.warmup {
            self.start = Instant::now();
        }
        self.last = now;
        Ok(())
    }

    /// Starts the measured part now (bandwidth tests, after the warm-up drained).
    pub(crate) fn restart(&mut self) {
        self.start = Instant::now();
        self.last = self.now();
        self.batched = 0;
    }

    /// One measured completion of a bandwidth test.
    #[inline]
    pub(crate) fn record(&mut self) -> AnyResult<()> {
        self.batched += 1;
        if self.batched == BATCH {
            self.close_batch()?;
        }
        Ok(())
    }

    /// Reads the clock for the completions recorded since the last read, each timed as
    /// their mean interval (bandwidth tests call it after their last completion).
    pub(crate) fn close_batch(&mut self) -> AnyResult<()> {
        let n = std::mem::take(&mut self.batched);
        if let Some(mean) = self.now().saturating_sub(self.last).checked_div(n) {
            self.hist.record_n(self.ticks.delta_as_nanos(0, mean), n)?;
            self.last += mean * n;
        }
        Ok(())
    }

    #[inline]
    fn push(&mut self, ticks: u64) -> AnyResult<()> {
        self.pending.push(ticks);
        if self.pending.len() == BUFFERED {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> AnyResult<()> {
        let Clock { ticks, pending, hist, .. } = self;
        for t in pending.drain(..) {
            hist.record(ticks.delta_as_nanos(0, t))?;
        }
        Ok(())
    }

    /// The intervals so far, in nanoseconds.
    pub(crate) fn histogram(&mut self) -> AnyResult<&Histogram<u64>> {
        self.close_batch()?;
        self.flush()?;
        Ok(&self.hist)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Intervals come out in nanoseconds, buffered ones included: a 2 ms sleep between two
    /// reads is recorded as about 2 ms, and a latency run's warm-up is left out.
    #[test]
    fn records_intervals_in_nanoseconds() {
        let mut c = Clock::new(0).expect("clock");
        c.restart();
        std::thread::sleep(Duration::from_millis(2));
        c.record().expect("record");
        let h = c.histogram().expect("histogram");
        assert_eq!(h.len(), 1);
        assert!((1_900_000..50_000_000).contains(&h.max()), "2 ms recorded as {} ns", h.max());

        let mut c = Clock::new(2).expect("clock");
        for i in 0..=5 {
            c.tick_before(i).expect("tick");
        }
        // Iterations 0 and 1 are warm-up; 2, 3 and 4 are measured.
        assert_eq!(c.histogram().expect("histogram").len(), 3);
    }

    /// Bandwidth completions are timed in batches, and a partial last batch still counts:
    /// every completion is in the histogram, each as its batch's mean interval.
    #[test]
    fn bandwidth_completions_are_timed_in_batches() {
        let mut c = Clock::new(0).expect("clock");
        c.restart();
        let n = 2 * BATCH + 5;
        for _ in 0..n {
            std::thread::sleep(Duration::from_micros(200));
            c.record().expect("record");
        }
        let h = c.histogram().expect("histogram");
        assert_eq!(h.len(), n);
        // Each completion took at least 200 µs; a mean over a batch cannot be less.
        assert!(h.min() >= 190_000, "a completion recorded as {} ns", h.min());
    }
}
