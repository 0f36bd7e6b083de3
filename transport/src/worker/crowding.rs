//! Whether this host's cores are oversubscribed, as the event-mode driver sees it: the
//! time its thread spent ready to run but waiting for a core (the kernel's `run_delay`,
//! `/proc/thread-self/schedstat`). A driver that lingers polls a worker instead of
//! sleeping; where processes outnumber cores, that polling takes the core from the very
//! peers whose messages it waits for (a holder serving two receivers on two cores spent
//! a fifth of a core so, and four ranks on two cores waited hundreds of microseconds
//! for each other's replies), so a crowded driver yields the processor between its
//! polls (`sched_yield`): a peer that is ready runs at once, and the reply it sends is
//! picked up without a sleep and a wake-up.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How often the driver looks at its wait for a core: a look costs three system calls.
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(10);

/// Crowded: the thread waited for a core for over this share of the time since the last
/// look (a tenth). An idle host's wake-ups wait a few microseconds each.
const CROWDED_SHARE: u32 = 10;

/// The driver's view of its host's crowding, updated every [`LOOK_EVERY`].
pub(crate) struct Crowding {
    /// The last look: when, on which thread, the thread's total wait for a core (ns).
    last: Option<(Instant, ThreadId, u64)>,
    crowded: bool,
}

impl Crowding {
    /// Not crowded, until a look says otherwise.
    pub(crate) fn new() -> Crowding {
        Crowding { last: None, crowded: false }
    }

    /// Whether the host was crowded at the last look; looks again once [`LOOK_EVERY`]
    /// passed. Never crowded where the kernel does not say.
    pub(crate) fn crowded(&mut self, now: Instant) -> bool {
        if self.last.is_some_and(|(at, _, _)| now.duration_since(at) < LOOK_EVERY) {
            return self.crowded;
        }
        let Some(delay) = run_delay_ns() else {
            self.crowded = false;
            return false;
        };
        self.update(now, std::thread::current().id(), delay);
        self.crowded
    }

    /// Takes a look: the thread's total wait `delay` (ns) at `now`. A look on another
    /// thread than the last (a multi-thread runtime moved the driver) only starts over.
    fn update(&mut self, now: Instant, thread: ThreadId, delay: u64) {
        if let Some((at, t, before)) = self.last {
            if t == thread {
                let waited = delay.saturating_sub(before);
                let elapsed = u64::try_from(now.duration_since(at).as_nanos()).unwrap_or(u64::MAX);
                self.crowded = waited.saturating_mul(u64::from(CROWDED_SHARE)) > elapsed;
            }
        }
        self.last = Some((now, thread, delay));
    }
}

/// The calling thread's total wait for a core (ns), from `/proc/thread-self/schedstat`.
fn run_delay_ns() -> Option<u64> {
    parse_schedstat(&std::fs::read_to_string("/proc/thread-self/schedstat").ok()?)
}

/// The second field of a `schedstat` line (time on a core, time waiting for one, time
/// slices, all since the thread began).
fn parse_schedstat(s: &str) -> Option<u64> {
    s.split_ascii_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_wait_field_and_rejects_what_is_not_one() {
        assert_eq!(parse_schedstat("115572 108542 2\n"), Some(108_542));
        assert_eq!(parse_schedstat("115572"), None);
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("1 x 2"), None);
    }

    #[test]
    fn crowded_when_the_wait_grows_by_over_a_tenth_of_the_time() {
        let t0 = Instant::now();
        let me = std::thread::current().id();
        let ms = |n: u64| Duration::from_millis(n);
        // (time since t0, total wait in ns, crowded after the look)
        let looks: [(Duration, u64, bool); 6] = [
            (ms(0), 5_000_000, false),    // the first look has nothing to compare
            (ms(10), 5_100_000, false),   // 0.1 ms of 10: 1 %
            (ms(20), 6_200_000, true),    // 1.1 ms of 10: 11 %
            (ms(30), 7_200_000, false),   // 1.0 ms of 10: not over a tenth
            (ms(40), 12_000_000, true),   // 4.8 ms of 10
            (ms(140), 13_000_000, false), // 1 ms of 100
        ];
        let mut c = Crowding::new();
        for (i, (at, delay, want)) in looks.into_iter().enumerate() {
            c.update(t0 + at, me, delay);
            assert_eq!(c.crowded, want, "look {i}");
        }
    }

    #[test]
    fn a_look_on_another_thread_starts_over() {
        let t0 = Instant::now();
        let me = std::thread::current().id();
        let other = std::thread::spawn(|| std::thread::current().id()).join().unwrap();
        let mut c = Crowding::new();
        c.update(t0, me, 0);
        c.update(t0 + Duration::from_millis(10), me, 5_000_000);
        assert!(c.crowded);
        // Another thread's counter is not comparable: the verdict stands until a look on
        // one thread twice.
        c.update(t0 + Duration::from_millis(20), other, 0);
        assert!(c.crowded);
        c.update(t0 + Duration::from_millis(30), other, 10_000);
        assert!(!c.crowded);
    }

    #[test]
    fn this_thread_reads_its_wait_where_the_kernel_keeps_it() {
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            assert!(run_delay_ns().is_some());
        }
        // Looks are spaced: a second look at once gives the same verdict, read or not.
        let mut c = Crowding::new();
        let now = Instant::now();
        let first = c.crowded(now);
        assert_eq!(c.crowded(now), first);
    }
}
