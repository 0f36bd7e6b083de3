//! Whether the event-mode driver lingers after traffic.
//!
//! Polling on for a while after an event saves a sleep and a wake-up per message, and
//! costs nothing while a core would otherwise idle. When more threads are runnable than
//! the machine has CPUs, the polling takes a core from work that would make progress: a
//! holder answering two receivers on this host spun through the whole transfer on a
//! core their copies needed (256 MiB to two receivers took 1.4-1.5x one transfer with
//! the linger, 1.05-1.2x without). So the driver looks at the kernel's count of runnable
//! threads (`/proc/loadavg`, a few microseconds) at most once per [`ON`] while it
//! lingers, and stops lingering for [`OFF`] when the count is above the CPUs online. The
//! count is the whole machine's: in a container it counts other tenants' threads too,
//! against the host's CPUs.

use std::time::{Duration, Instant};

/// How long a look that found a CPU to spare lets the driver linger.
pub(crate) const ON: Duration = Duration::from_millis(1);
/// How long a look that found the CPUs oversubscribed stops the linger: longer than
/// [`ON`], as oversubscription seen once tends to last (a transfer's copies).
pub(crate) const OFF: Duration = Duration::from_millis(10);

/// The driver's decision and until when it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linger {
    /// Lingers after events.
    On { until: Instant },
    /// Sleeps at once after events: the CPUs were oversubscribed.
    Off { until: Instant },
}

impl Linger {
    /// A decision to take at the first look.
    pub(crate) fn new(now: Instant) -> Linger {
        Linger::On { until: now }
    }

    /// Whether to linger now; past the decision's time, `oversubscribed` is asked (None:
    /// not known, which lingers).
    pub(crate) fn lingers(&mut self, now: Instant, oversubscribed: impl FnOnce() -> Option<bool>) -> bool {
        match *self {
            Linger::On { until } if now < until => return true,
            Linger::Off { until } if now < until => return false,
            _ => {}
        }
        *self = match oversubscribed() {
            Some(true) => Linger::Off { until: now + OFF },
            _ => Linger::On { until: now + ON },
        };
        matches!(self, Linger::On { .. })
    }
}

/// Whether more threads are runnable right now than there are CPUs online: the fourth
/// field of `/proc/loadavg` ("runnable/total", the caller among the runnable) against
/// `sysconf(_SC_NPROCESSORS_ONLN)`. None where either is unknown.
pub(crate) fn oversubscribed() -> Option<bool> {
    let text = std::fs::read("/proc/loadavg").ok()?;
    let runnable = runnable_of(&text)?;
    // SAFETY: sysconf reads a constant of the system.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    (cpus > 0).then_some(runnable > cpus as u64)
}

/// The runnable count in `/proc/loadavg`'s text ("0.85 1.23 1.31 3/104 22199").
fn runnable_of(text: &[u8]) -> Option<u64> {
    let field = std::str::from_utf8(text).ok()?.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_look_decides_for_a_while() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // (time, what a look would say, whether it may look, lingers, state after)
        type Step = (Duration, Option<bool>, bool, bool, Linger);
        let on = |at: Duration| Linger::On { until: t0 + at };
        let off = |at: Duration| Linger::Off { until: t0 + at };
        assert_eq!((ON, OFF), (ms(1), ms(10)), "the table's times");
        let steps: [Step; 9] = [
            (ms(0), Some(false), true, true, on(ms(1))),
            (ms(0), Some(true), false, true, on(ms(1))),
            (ms(1), Some(true), true, false, off(ms(11))),
            (ms(10), Some(false), false, false, off(ms(11))),
            (ms(11), Some(false), true, true, on(ms(12))),
            (ms(12), None, true, true, on(ms(13))),
            (ms(20), Some(true), true, false, off(ms(30))),
            (ms(30), None, true, true, on(ms(31))),
            (ms(30), Some(true), false, true, on(ms(31))),
        ];
        let mut l = Linger::new(t0);
        for (i, (at, says, looks, lingers, after)) in steps.into_iter().enumerate() {
            let mut looked = false;
            let got = l.lingers(t0 + at, || {
                looked = true;
                says
            });
            assert_eq!((looked, got, l), (looks, lingers, after), "step {i}");
        }
    }

    #[test]
    fn the_runnable_count_is_read_from_loadavg() {
        assert_eq!(runnable_of(b"0.85 1.23 1.31 3/104 22199\n"), Some(3));
        assert_eq!(runnable_of(b"0.00 0.00 0.00 12/1000 1"), Some(12));
        for bad in [&b""[..], b"0.85 1.23 1.31", b"0.85 1.23 1.31 x/104 1", b"1 2 3 4 5", b"\xff\xfe"] {
            assert_eq!(runnable_of(bad), None, "{bad:?}");
        }
        // This machine says, one way or the other.
        assert!(oversubscribed().is_some());
    }
}
