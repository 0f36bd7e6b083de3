//! Whether this host's cores are oversubscribed, as a worker's driver sees it: the
//! threads ready to run outnumber the cores (`/proc/loadavg`), or the driver's own thread
//! spent over a tenth of the time ready to run but waiting for a core (the kernel's
//! `run_delay`, `/proc/thread-self/schedstat`: the whole-host count misses a quota or a
//! pinning that leaves the process fewer cores). A driver that lingers polls a worker
//! instead of sleeping; where processes outnumber cores, that polling takes the core
//! from the very peers whose messages it waits for (a holder serving two receivers on
//! two cores spent a fifth of a core so, and four ranks on two cores waited hundreds of
//! microseconds for each other's replies), so a crowded driver yields the processor
//! between its polls (`sched_yield`): a peer that is ready runs at once, and the reply
//! it sends is picked up without a sleep and a wake-up. The same holds for a busy-poll
//! driver's polling after traffic ([`super::progress::BUSY_IDLE`]).
//!
//! Its own wait alone is not enough: a driver that spins keeps its core and hardly
//! waits, while the peer sharing that core yields it back at once and does all the
//! waiting; four ranks on two cores settled so, the spinners never counted as crowded,
//! and a 16 B allgather took 100 us instead of 10.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How often the driver looks: a look costs a few system calls.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// Crowded: the thread waited for a core for over this share of the time since its last
/// look (a tenth). An idle host's wake-ups wait a few microseconds each.
const CROWDED_SHARE: u32 = 10;

/// The driver's view of its host's crowding, updated every [`LOOK_EVERY`].
pub(crate) struct Crowding {
    /// When it last looked.
    looked: Option<Instant>,
    /// The last look at the thread's wait: when, on which thread, its total (ns).
    waits: Option<(Instant, ThreadId, u64)>,
    /// The processors of this host ([`crate::host_cpus`]).
    cores: u32,
    crowded: bool,
}

impl Crowding {
    /// Not crowded, until a look says otherwise.
    pub(crate) fn new() -> Crowding {
        let cores = u32::try_from(crate::host_cpus()).unwrap_or(u32::MAX);
        Crowding { looked: None, waits: None, cores, crowded: false }
    }

    /// Whether the host was crowded at the last look; looks again once [`LOOK_EVERY`]
    /// passed. Never crowded by a measure the kernel does not give.
    pub(crate) fn crowded(&mut self, now: Instant) -> bool {
        if self.looked.is_some_and(|at| now.duration_since(at) < LOOK_EVERY) {
            return self.crowded;
        }
        self.looked = Some(now);
        let waited = run_delay_ns().is_some_and(|d| self.waited(now, std::thread::current().id(), d));
        self.crowded = waited || runnable().is_some_and(|r| r > self.cores);
        self.crowded
    }

    /// Whether the thread waited for a core over a tenth of the time since the last look,
    /// its total wait being `delay` (ns) at `now`. A look on another thread than the last
    /// (a multi-thread runtime moved the driver) only starts over.
    fn waited(&mut self, now: Instant, thread: ThreadId, delay: u64) -> bool {
        let before = self.waits.replace((now, thread, delay));
        match before {
            Some((at, t, before)) if t == thread => {
                let waited = delay.saturating_sub(before);
                let elapsed = u64::try_from(now.duration_since(at).as_nanos()).unwrap_or(u64::MAX);
                waited.saturating_mul(u64::from(CROWDED_SHARE)) > elapsed
            }
            _ => false,
        }
    }
}

/// Threads ready to run on the whole host now, this one included (`/proc/loadavg`).
fn runnable() -> Option<u32> {
    parse_loadavg(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

/// The running count of a `loadavg` line (`0.52 0.58 0.59 3/512 12345`: the fourth
/// field, before its slash).
fn parse_loadavg(s: &str) -> Option<u32> {
    s.split_ascii_whitespace().nth(3)?.split_once('/')?.0.parse().ok()
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
    fn parses_the_fields_it_reads_and_rejects_what_is_not_one() {
        assert_eq!(parse_schedstat("115572 108542 2\n"), Some(108_542));
        for bad in ["115572", "", "1 x 2"] {
            assert_eq!(parse_schedstat(bad), None, "{bad:?}");
        }
        assert_eq!(parse_loadavg("1.91 1.79 1.61 3/106 17070\n"), Some(3));
        for bad in ["1.91 1.79 1.61", "1.91 1.79 1.61 3 17070", "1 1 1 x/2 3", ""] {
            assert_eq!(parse_loadavg(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn waited_when_the_wait_grows_by_over_a_tenth_of_the_time() {
        let t0 = Instant::now();
        let me = std::thread::current().id();
        let ms = |n: u64| Duration::from_millis(n);
        // (time since t0, total wait in ns, waited since the look before)
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
            assert_eq!(c.waited(t0 + at, me, delay), want, "look {i}");
        }
    }

    #[test]
    fn a_look_on_another_thread_starts_over() {
        let t0 = Instant::now();
        let me = std::thread::current().id();
        let other = std::thread::spawn(|| std::thread::current().id()).join().unwrap();
        let mut c = Crowding::new();
        assert!(!c.waited(t0, me, 0));
        assert!(c.waited(t0 + Duration::from_millis(10), me, 5_000_000));
        // Another thread's counter is not comparable to this one's.
        assert!(!c.waited(t0 + Duration::from_millis(20), other, 0));
        assert!(c.waited(t0 + Duration::from_millis(30), other, 5_000_000));
    }

    #[test]
    fn looks_are_spaced_and_read_what_the_kernel_keeps() {
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            assert!(run_delay_ns().is_some());
        }
        if std::path::Path::new("/proc/loadavg").exists() {
            // This thread is running while it reads.
            assert!(runnable().is_some_and(|r| r >= 1));
        }
        let mut c = Crowding::new();
        let now = Instant::now();
        let first = c.crowded(now);
        // Within the spacing the verdict stands, whatever the host does meanwhile.
        c.crowded = !first;
        assert_eq!(c.crowded(now + LOOK_EVERY / 2), !first);
        assert_eq!(c.looked, Some(now));
    }
}
