//! Large host buffers the kernel may back with transparent huge pages.
//!
//! Shared memory's `cma` transport moves a rendezvous with `process_vm_readv`, which pins
//! the peer's memory page by page and copies through the kernel's own mapping: over
//! 4 KiB pages a 256 MiB transfer walks 65,536 page-table entries on each side. Where
//! both buffers lie on 2 MiB pages, the same transfer took 25-27 ms here against
//! 56-75 ms (and 40-53 ms for `ucx_perftest -t tag_bw`, whose buffers UCX allocates).

/// The size of a transparent huge page on x86-64 and arm64's 4 KiB-page kernels.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed vector of `len` bytes whose memory the kernel is asked to back with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)` on every whole 2 MiB page of it,
/// before any is touched). Where the kernel has them disabled (`never`) or the
/// allocation is smaller than a huge page, it is a plain `vec![0; len]`. Meant for large
/// buffers moved over shared memory: objects, receive buffers, staging.
pub fn huge_zeroed(len: usize) -> Vec<u8> {
    // An allocation over glibc's mmap threshold (128 KiB, rising with the mapped blocks
    // freed, up to 32 MiB) is fresh anonymous memory that `calloc` does not write, so
    // the advice comes before any page is faulted in. One served from the heap may have
    // been written already; the kernel then backs it with huge pages only as it
    // collapses them in the background.
    let mut v = vec![0u8; len];
    if len >= HUGE_PAGE {
        let start = v.as_mut_ptr() as usize;
        let lo = start.next_multiple_of(HUGE_PAGE);
        let hi = (start + len) & !(HUGE_PAGE - 1);
        if hi > lo {
            // SAFETY: [lo, hi) lies within `v`'s allocation, which this function owns.
            // MADV_HUGEPAGE changes only how the kernel backs the pages, never their
            // contents, and fails harmlessly (EINVAL) where huge pages are not built in.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::huge_zeroed;

    #[test]
    fn every_length_is_zeroed_and_whole() {
        for len in [0, 1, 4095, 4096, (2 << 20) - 1, 2 << 20, (5 << 20) + 3] {
            let mut v = huge_zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&b| b == 0), "length {len}");
            // Writable everywhere, first and last bytes included.
            if let Some(b) = v.first_mut() {
                *b = 1;
            }
            if let Some(b) = v.last_mut() {
                *b = 2;
            }
        }
    }

    #[test]
    fn a_large_buffer_is_advised_for_huge_pages() {
        // Only where the kernel lets programs ask (`madvise` or `always`): then the
        // buffer's mapping says so in smaps once its pages are touched.
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !mode.contains("[madvise]") && !mode.contains("[always]") {
            return;
        }
        let mut v = huge_zeroed(8 << 20);
        for p in v.chunks_mut(4096) {
            p[0] = 1;
        }
        let addr = v.as_ptr() as usize + (4 << 20);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut advised = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
                let (a, b) = range.split_once('-').unwrap();
                let (a, b) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16));
                inside = matches!((a, b), (Ok(a), Ok(b)) if a <= addr && addr < b);
            } else if inside && line.starts_with("VmFlags:") {
                advised = line.split_whitespace().any(|f| f == "hg");
            }
        }
        assert!(advised, "the middle of the buffer is not advised for huge pages");
    }
}
