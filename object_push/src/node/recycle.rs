//! Buffers of released objects, kept for the next pulls: a buffer the kernel has to
//! fault in page by page costs more than the transfer into it (256 MiB over shared
//! memory: about 65,000 faults, three times the copy's time), so a node that keeps
//! receiving objects reuses the memory of those it let go.

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;

/// The smallest allocation a node keeps: smaller ones cost few page faults, and many of
/// them would make the list long.
pub(super) const MIN_KEPT: usize = 1 << 20;

/// Kept buffers, at most `limit` bytes of them, none smaller than `min`.
pub(super) struct Recycler {
    limit: u64,
    min: usize,
    kept: Mutex<Vec<Vec<u8>>>,
}

impl Recycler {
    pub(super) fn new(limit: u64, min: usize) -> Recycler {
        Recycler { limit, min, kept: Mutex::default() }
    }

    /// A buffer of `size` bytes whose contents are unspecified (every byte is written
    /// before the object is sealed): a kept one whose allocation holds at least that and
    /// at most twice it (only the part past its last length is written, with zeros),
    /// else a new one on huge pages where the kernel gives them
    /// ([`ucxkit_transport::huge_zeroed`]: shared memory's copies run twice as fast).
    pub(super) fn take(&self, size: usize) -> Vec<u8> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let best = kept
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= size && v.capacity() / 2 <= size)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut v = kept.swap_remove(i);
                drop(kept);
                v.resize(size, 0);
                v
            }
            None => ucxkit_transport::huge_zeroed(size),
        }
    }

    /// Keeps the memory of `bytes` if nothing else holds it, it is not too small and
    /// there is room (the oldest kept buffers are freed to make room); frees it
    /// otherwise.
    pub(super) fn give(&self, bytes: Bytes) {
        if bytes.len() as u64 > self.limit {
            return;
        }
        let Ok(b) = bytes.try_into_mut() else { return };
        let v = Vec::from(b);
        if v.capacity() < self.min.max(1) || v.capacity() as u64 > self.limit {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let mut held: u64 = kept.iter().map(|k| k.capacity() as u64).sum();
        while held + v.capacity() as u64 > self.limit && !kept.is_empty() {
            held -= kept.remove(0).capacity() as u64;
        }
        kept.push(v);
    }

    /// Bytes kept.
    pub(super) fn held(&self) -> u64 {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).iter().map(|k| k.capacity() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_by_size_within_the_limit() {
        let r = Recycler::new(10_000, 1);
        let a = r.take(4000);
        let ptr = a.as_ptr();
        r.give(Bytes::from(a));
        assert_eq!(r.held(), 4000);
        // Too small a request for it (it would waste over half), then one it fits.
        assert_eq!(r.take(1000).len(), 1000);
        let b = r.take(3000);
        assert_eq!((b.len(), b.as_ptr()), (3000, ptr), "reused");
        assert_eq!(r.held(), 0);
        // A buffer someone else still holds is not kept.
        let shared = Bytes::from(vec![1u8; 100]);
        let _other = shared.clone();
        r.give(shared);
        assert_eq!(r.held(), 0);
        // Over the limit, the oldest go.
        r.give(Bytes::from(vec![0u8; 6000]));
        r.give(Bytes::from(vec![0u8; 5000]));
        assert_eq!(r.held(), 5000);
        r.give(Bytes::from(vec![0u8; 20_000]));
        assert_eq!(r.held(), 5000, "larger than the limit: freed");
        assert!(Recycler::new(0, 1).take(10).len() == 10);
        // Empty and too small allocations are not kept.
        let r = Recycler::new(10_000, 1000);
        r.give(Bytes::new());
        r.give(Bytes::from(vec![0u8; 999]));
        assert_eq!(r.held(), 0);
        r.give(Bytes::from(vec![0u8; 1000]));
        assert_eq!(r.held(), 1000);
    }
}
