//! Owned buffers for operations: [`IoBuf`] (read by a send) and [`IoBufMut`] (written by
//! a receive).
//!
//! An operation takes its buffer by value and gives it back when it completes, on success
//! and on error. If the operation's future is dropped first, the buffer stays with the
//! worker until UCX lets go of it, so UCX never touches memory that safe code could free
//! or reuse. Registered memory and GPU buffers implement the same traits.

/// A buffer UCX may read from while an operation owns it.
///
/// # Safety
/// While the value is owned by an operation (moved into it and not yet given back),
/// `stable_ptr()` must keep returning the same pointer, valid for reads of
/// `bytes_init()` bytes, even if the value itself is moved in memory. Heap-backed
/// containers satisfy this; inline arrays do not.
pub unsafe trait IoBuf: Send + 'static {
    /// Start of the bytes to send.
    fn stable_ptr(&self) -> *const u8;
    /// Number of initialized bytes (what a send transmits).
    fn bytes_init(&self) -> usize;
}

/// A buffer UCX may write into while an operation owns it.
///
/// # Safety
/// As for [`IoBuf`], and `stable_mut_ptr()` must be valid for writes of `bytes_total()`
/// bytes for as long as an operation owns the value.
pub unsafe trait IoBufMut: IoBuf {
    /// Start of the writable memory.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Capacity: the most a receive may write.
    fn bytes_total(&self) -> usize;
    /// Marks the first `n` bytes as the contents (a receive calls this with the received
    /// length, so afterwards `Vec::len()` and `BytesMut::len()` equal what arrived).
    ///
    /// # Safety
    /// The first `n` bytes, `n <= bytes_total()`, have been written.
    unsafe fn set_init(&mut self, n: usize);
}

// SAFETY: a Vec's heap pointer does not change while it is not resized, and the operation
// owning it never resizes it.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; capacity bytes are allocated.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
    unsafe fn set_init(&mut self, n: usize) {
        // SAFETY: the caller guarantees n bytes within capacity were written.
        unsafe { self.set_len(n) }
    }
}

// SAFETY: Bytes is an immutable, reference-counted view of heap (or static) memory; its
// pointer is stable and its contents never change.
unsafe impl IoBuf for bytes::Bytes {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: BytesMut owns its heap storage uniquely; the pointer is stable while it is not
// resized, and the operation never resizes it.
unsafe impl IoBuf for bytes::BytesMut {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; capacity bytes are allocated.
unsafe impl IoBufMut for bytes::BytesMut {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
    unsafe fn set_init(&mut self, n: usize) {
        // SAFETY: the caller guarantees n bytes within capacity were written.
        unsafe { self.set_len(n) }
    }
}

// SAFETY: a boxed slice's heap pointer is stable.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; all len bytes are writable and always initialized.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

// SAFETY: static memory is never freed or moved.
unsafe impl IoBuf for &'static [u8] {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vec_receives_into_capacity_and_sets_len() {
        let mut v: Vec<u8> = Vec::with_capacity(16);
        assert_eq!(v.bytes_init(), 0);
        assert!(v.bytes_total() >= 16);
        let p = v.stable_mut_ptr();
        // SAFETY: 3 bytes within capacity.
        unsafe {
            std::ptr::copy_nonoverlapping(b"abc".as_ptr(), p, 3);
            v.set_init(3);
        }
        assert_eq!(v, b"abc");
    }

    #[test]
    fn bytesmut_set_init() {
        let mut b = bytes::BytesMut::with_capacity(8);
        let p = b.stable_mut_ptr();
        // SAFETY: 2 bytes within capacity.
        unsafe {
            *p = 1;
            *p.add(1) = 2;
            b.set_init(2);
        }
        assert_eq!(&b[..], &[1, 2]);
    }
}
