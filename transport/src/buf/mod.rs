//! Owned buffers for operations: [`IoBuf`] (read by a send) and [`IoBufMut`] (written by
//! a receive).
//!
//! An operation takes its buffer by value and gives it back when it completes, on success
//! and on error. If the operation's future is dropped first, the buffer stays with the
//! worker until UCX lets go of it, so UCX never touches memory that safe code could free
//! or reuse. Registered memory and GPU buffers implement the same traits.
//!
//! The only calls that borrow instead, `try_tag_send`, `try_am_send` and `try_put`, are
//! not zero-copy: UCX must finish with the bytes during the call
//! (`UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`) or send nothing, so no borrow outlives the call and
//! they need no `unsafe`.
//!
//! A part of a buffer is sent or received through a [`Slice`] ([`IoBuf::into_slice`],
//! [`IoBufMut::into_slice_mut`]), which gives the whole buffer back; several operations
//! use parts of one buffer at once through a [`SharedBuf`].
//!
//! A buffer says where its bytes live ([`IoBuf::memory_type`]); every UCX call on one
//! that is not in host memory passes the type, so UCX never guesses (see [`MemoryType`]).

use std::ops::RangeBounds;

use ucx_sys as sys;

use crate::error::Error;
pub use either::Either;
pub use huge::huge_zeroed;
pub use shared::{SharedBuf, SharedSlice};
pub use slice::Slice;

mod either;
mod huge;
mod shared;
mod slice;

/// Where a buffer's bytes live.
///
/// Host memory needs nothing; for any other type, each operation checks that the worker's
/// UCX can reach that memory ([`crate::Context::supports`]; [`crate::ErrorKind::Unsupported`]
/// otherwise, with the buffer given back), waits for the buffer's pending device work
/// ([`IoBuf::ready`]) and passes the type to UCX (`UCP_OP_ATTR_FIELD_MEMORY_TYPE`), which
/// then moves the bytes with its device transports (cuda_copy, cuda_ipc, GPUDirect RDMA)
/// instead of detecting the type from a cache of allocations it has seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum MemoryType {
    /// Host memory: what every buffer is unless it says otherwise.
    #[default]
    Host,
    /// Memory of CUDA device `device` (its ordinal), allocated in the device's primary
    /// context, the one cudarc's `CudaContext::new` uses.
    Cuda {
        /// The device's ordinal.
        device: usize,
    },
}

impl MemoryType {
    /// UCX's name for this memory type.
    pub(crate) fn ucs(self) -> sys::ucs_memory_type_t {
        match self {
            MemoryType::Host => sys::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda { .. } => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

impl std::fmt::Display for MemoryType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryType::Host => f.write_str("host"),
            MemoryType::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}

/// A buffer UCX may read from while an operation owns it.
///
/// # Safety
/// While the value is owned by an operation (moved into it and not yet given back),
/// `stable_ptr()` must keep returning the same pointer, valid for reads of
/// `bytes_init()` bytes, even if the value itself is moved in memory. Heap-backed
/// containers satisfy this; inline arrays do not. `memory_type()` must say truly where
/// those bytes are, and keep saying the same while an operation owns the value: host
/// memory is copied with the host's own instructions, and UCX is told the type.
pub unsafe trait IoBuf: Send + 'static {
    /// Start of the bytes to send.
    fn stable_ptr(&self) -> *const u8;
    /// Number of initialized bytes (what a send transmits).
    fn bytes_init(&self) -> usize;

    /// Where the bytes live: [`MemoryType::Host`] unless the type says otherwise. A
    /// buffer must report the same type for as long as an operation owns it.
    #[inline(always)]
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }

    /// Makes the bytes ready for UCX; called once before each operation on a buffer
    /// whose [`IoBuf::memory_type`] is not host memory (never for host memory). A device
    /// buffer waits here for the work queued on it (a kernel still writing it, a copy
    /// still reading it), since UCX's own copies run on streams of UCX's.
    ///
    /// # Errors
    /// The device's error, which refuses the operation (the buffer is given back).
    fn ready(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Bytes `range` of this buffer's initialized bytes as an operation's buffer, without
    /// copying: a send sends only them, and gives back the [`Slice`], whose
    /// [`Slice::into_inner`] is the whole buffer.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] with the buffer when `range` is not within
    /// `0..bytes_init()`.
    fn into_slice(self, range: impl RangeBounds<usize>) -> Result<Slice<Self>, (Error, Self)>
    where
        Self: Sized,
    {
        Slice::of(self, range)
    }
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

    /// Bytes `range` of this buffer's capacity as a receive's buffer, without copying: a
    /// receive writes only there, and gives back the [`Slice`], whose
    /// [`Slice::into_inner`] is the whole buffer, its length grown to the end of what
    /// arrived when that is past it.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] with the buffer when `range` is not within
    /// `0..bytes_total()` or starts after `bytes_init()` (which would leave unwritten
    /// bytes inside the contents).
    fn into_slice_mut(self, range: impl RangeBounds<usize>) -> Result<Slice<Self>, (Error, Self)>
    where
        Self: Sized,
    {
        Slice::of_mut(self, range)
    }
}

/// `IoBuf` through the types' own `as_ptr` and `len`.
macro_rules! io_buf {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: see the list at the invocation: each type's pointer is stable while an
        // operation owns the value.
        unsafe impl IoBuf for $t {
            fn stable_ptr(&self) -> *const u8 {
                self.as_ptr()
            }
            fn bytes_init(&self) -> usize {
                self.len()
            }
        }
    )*};
}

// - `Vec<u8>`, `BytesMut`: uniquely owned heap storage whose pointer does not change
//   while the container is not resized; the owning operation never resizes it.
// - `Bytes`: an immutable, reference-counted view of heap or static memory.
// - `&'static [u8]`: memory that is never freed or moved.
io_buf!(Vec<u8>, bytes::BytesMut, bytes::Bytes, &'static [u8]);

// SAFETY: a boxed slice is a fixed heap allocation (an empty one, or one of zero-sized
// elements, has no bytes to read); plain-old-data elements have no padding, so all
// their bytes are initialized.
unsafe impl<T: bytemuck::Pod + Send> IoBuf for Box<[T]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr().cast()
    }
    fn bytes_init(&self) -> usize {
        std::mem::size_of_val::<[T]>(self)
    }
}

/// `IoBufMut` for growable containers: receives write into the spare capacity and set
/// the length to what arrived.
macro_rules! io_buf_mut_growable {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: as for `IoBuf` above; `capacity()` bytes are allocated and writable.
        unsafe impl IoBufMut for $t {
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
    )*};
}

io_buf_mut_growable!(Vec<u8>, bytes::BytesMut);

// SAFETY: a boxed slice's heap pointer is stable; all its bytes are writable and always
// initialized, and any bytes are a valid plain-old-data element. A receive overwrites the
// bytes it reaches and leaves the rest as they were.
unsafe impl<T: bytemuck::Pod + Send> IoBufMut for Box<[T]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr().cast()
    }
    fn bytes_total(&self) -> usize {
        std::mem::size_of_val::<[T]>(self)
    }
    unsafe fn set_init(&mut self, _n: usize) {}
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
    fn boxed_elements_are_their_bytes() {
        let mut b: Box<[u32]> = vec![0u32; 3].into_boxed_slice();
        assert_eq!((b.bytes_init(), b.bytes_total()), (12, 12));
        let p = b.stable_mut_ptr();
        // SAFETY: 4 bytes within the 12.
        unsafe {
            std::ptr::copy_nonoverlapping(7u32.to_ne_bytes().as_ptr(), p.add(4), 4);
            b.set_init(8);
        }
        assert_eq!(&b[..], &[0, 7, 0]);
        let empty: Box<[f64]> = Box::new([]);
        assert_eq!(empty.bytes_total(), 0);
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
