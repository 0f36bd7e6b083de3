//! Copies whose bytes are for another core: stores that bypass this core's cache.
//!
//! A core reads cache lines that another core holds modified slowly on some machines:
//! on this project's test machine, a 2-thread staged copy (one thread writes 1 MiB
//! pieces into four slots, the other copies them out) moved 18-47 GB/s with plain stores
//! while the two processors shared a cache, and 2.6-3.2 GB/s minutes later, after the
//! host moved them apart; with non-temporal stores it moved 15-26 GB/s in both.

/// Copies below this many bytes are made with plain stores: the lines are few, and the
/// fence the streaming stores need costs more than they save.
pub(crate) const STREAM_FROM: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst` (which may overlap) for another core to read:
/// with non-temporal stores (x86-64, non-overlapping copies of [`STREAM_FROM`] bytes or
/// more), else as `ptr::copy`.
///
/// # Safety
/// As for `std::ptr::copy`: `src` readable and `dst` writable for `len` bytes.
pub(crate) unsafe fn copy_for_peer(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (s, d) = (src as usize, dst as usize);
        let apart = s.saturating_add(len) <= d || d.saturating_add(len) <= s;
        if apart && len >= STREAM_FROM {
            // SAFETY: per the caller, and the ranges do not overlap.
            unsafe { stream_copy(src, dst, len) };
            return;
        }
    }
    // SAFETY: per the caller.
    unsafe { std::ptr::copy(src, dst, len) }
}

/// A copy with SSE2 streaming stores (SSE2 is part of x86-64), ended by a store fence so
/// that the bytes are visible to other cores before anything this thread writes next
/// (the message that tells the peer, say).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes; the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Plain stores up to the first 16-byte boundary of the destination.
    let head = dst.align_offset(16).min(len);
    // SAFETY: within both ranges (head <= len).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 64 <= len {
        // SAFETY: bytes i..i + 64 lie within both ranges; dst + i is 16-byte aligned.
        unsafe {
            let a = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(src.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(src.add(i + 32).cast::<__m128i>());
            let d = _mm_loadu_si128(src.add(i + 48).cast::<__m128i>());
            _mm_stream_si128(dst.add(i).cast::<__m128i>(), a);
            _mm_stream_si128(dst.add(i + 16).cast::<__m128i>(), b);
            _mm_stream_si128(dst.add(i + 32).cast::<__m128i>(), c);
            _mm_stream_si128(dst.add(i + 48).cast::<__m128i>(), d);
        }
        i += 64;
    }
    // SAFETY: the tail lies within both ranges; the fence orders the streaming stores
    // before later ones.
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every alignment of source and destination and lengths around the threshold and
    /// the 64-byte blocks land exactly, and touch nothing around the destination.
    #[test]
    fn copies_land_exactly_at_any_alignment() {
        let src: Vec<u8> = (0..STREAM_FROM * 2 + 300).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 63, STREAM_FROM - 1, STREAM_FROM, STREAM_FROM + 1, STREAM_FROM + 77] {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 3), (5, 9), (15, 16), (17, 31)] {
                let mut dst = vec![0xeeu8; len + 64];
                // SAFETY: both ranges lie inside their vectors, which do not overlap.
                unsafe { copy_for_peer(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len) };
                assert!(dst[d_off..d_off + len] == src[s_off..s_off + len], "len {len} at {s_off}/{d_off}");
                assert!(dst[..d_off].iter().chain(&dst[d_off + len..]).all(|&b| b == 0xee));
            }
        }
    }

    /// Overlapping ranges copy as `ptr::copy` does, in either direction.
    #[test]
    fn overlapping_copies_move_as_memmove() {
        let len = STREAM_FROM + 100;
        for shift in [1usize, 4096] {
            let orig: Vec<u8> = (0..len + shift).map(|i| (i % 251) as u8).collect();
            let mut v = orig.clone();
            // SAFETY: both ranges lie inside v.
            unsafe { copy_for_peer(v.as_ptr(), v.as_mut_ptr().add(shift), len) };
            assert!(v[shift..] == orig[..len], "forward by {shift}");
            let mut v = orig.clone();
            // SAFETY: both ranges lie inside v.
            unsafe { copy_for_peer(v.as_ptr().add(shift), v.as_mut_ptr(), len) };
            assert!(v[..len] == orig[shift..], "backward by {shift}");
        }
    }
}
