//! The worker lock: a futex-based mutual-exclusion lock with no data and no poisoning.
//!
//! Every operation takes the worker lock at least once, so its uncontended path is on the
//! latency path of every message. `std::sync::Mutex` adds a poison check on lock and on
//! unlock (a read of the global panic count each time); the worker never relies on
//! poisoning (UCX state is consistent between calls whatever a panicking caller did), so
//! this lock leaves it out: one compare-and-swap to lock, one swap to unlock, and a system
//! call only when a thread has to wait.

use std::sync::atomic::{AtomicU32, Ordering};

/// Unlocked.
const FREE: u32 = 0;
/// Locked, nobody waiting.
const LOCKED: u32 = 1;
/// Locked, and a thread may be sleeping on the futex.
const CONTENDED: u32 = 2;

/// How many times a thread that finds the lock taken looks again before it sleeps.
const SPINS: u32 = 100;

/// A lock guarding data kept elsewhere (the worker's `UnsafeCell`).
pub(crate) struct RawLock {
    state: AtomicU32,
}

/// Holds a [`RawLock`] until dropped.
pub(crate) struct LockGuard<'a> {
    lock: &'a RawLock,
}

impl RawLock {
    /// An unlocked lock.
    pub(crate) const fn new() -> RawLock {
        RawLock { state: AtomicU32::new(FREE) }
    }

    /// Takes the lock, waiting as long as needed.
    #[inline]
    pub(crate) fn lock(&self) -> LockGuard<'_> {
        if self.state.compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
        LockGuard { lock: self }
    }

    /// Takes the lock if it is free.
    pub(crate) fn try_lock(&self) -> Option<LockGuard<'_>> {
        self.state
            .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| LockGuard { lock: self })
    }

    #[cold]
    fn lock_contended(&self) {
        // A holder usually lets go within a few hundred nanoseconds: look again a while
        // before paying for a system call.
        for _ in 0..SPINS {
            let s = self.state.load(Ordering::Relaxed);
            if s == FREE
                && self.state.compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_ok()
            {
                return;
            }
            if s == CONTENDED {
                break;
            }
            std::hint::spin_loop();
        }
        // Mark the lock contended, so that its holder wakes a sleeper when it lets go;
        // taking it this way leaves it marked, which at worst costs one needless wake-up.
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            futex_wait(&self.state, CONTENDED);
        }
    }

    #[inline]
    fn unlock(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            futex_wake_one(&self.state);
        }
    }
}

impl Drop for LockGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

/// Sleeps while `*state == expected` (or until a wake-up, a signal, or spuriously).
fn futex_wait(state: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT reads the u32 at the address, which is valid for the call; a
    // null timeout waits without limit. Every outcome (woken, EAGAIN when the value
    // changed, EINTR) sends the caller back to look at the lock again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            state.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Wakes one thread sleeping in [`futex_wait`] on `state`.
fn futex_wake_one(state: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key.
    unsafe {
        libc::syscall(libc::SYS_futex, state.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::UnsafeCell;
    use std::sync::Arc;

    use super::RawLock;

    struct Counter {
        lock: RawLock,
        n: UnsafeCell<u64>,
    }

    // SAFETY: `n` is only touched with `lock` held.
    unsafe impl Sync for Counter {}

    /// Threads that outnumber the cores increment a plain counter under the lock, so
    /// that holders are preempted and waiters sleep on the futex: no increment is lost
    /// and nobody sleeps forever.
    #[test]
    fn excludes_and_wakes_under_contention() {
        const THREADS: u64 = 8;
        const EACH: u64 = 50_000;
        let c = Arc::new(Counter { lock: RawLock::new(), n: UnsafeCell::new(0) });
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let _g = c.lock.lock();
                        // SAFETY: the lock is held.
                        unsafe {
                            let v = std::ptr::read_volatile(c.n.get());
                            if i % 1000 == 0 {
                                std::thread::yield_now();
                            }
                            std::ptr::write_volatile(c.n.get(), v + 1);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("thread");
        }
        let _g = c.lock.lock();
        // SAFETY: the lock is held.
        assert_eq!(unsafe { *c.n.get() }, THREADS * EACH);
    }

    /// A guard dropped by a panic lets the lock go.
    #[test]
    fn unwinding_releases() {
        let lock = RawLock::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = lock.lock();
            panic!("inside");
        }));
        assert!(r.is_err());
        drop(lock.lock());
    }

    /// `try_lock` takes a free lock only, and what it takes is released like any other.
    #[test]
    fn try_lock_takes_only_a_free_lock() {
        let lock = RawLock::new();
        let g = lock.lock();
        assert!(lock.try_lock().is_none());
        drop(g);
        let g = lock.try_lock().expect("free");
        assert!(lock.try_lock().is_none());
        drop(g);
        drop(lock.lock());
    }
}
