//! [`Either`]: one of two buffer types as one operation buffer type, for code whose
//! buffers are sometimes of one kind and sometimes of another (host or device memory,
//! say) and that keeps them in one queue or window. `Infallible` is a buffer type too,
//! for the side of an `Either` a build never uses.

use std::convert::Infallible;

use super::{IoBuf, IoBufMut, MemoryType};
use crate::error::Error;

/// A buffer of type `L` or of type `R`; an operation on it is an operation on the
/// buffer inside, which it gives back in the same variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Either<L, R> {
    /// A buffer of the first type.
    Left(L),
    /// A buffer of the second type.
    Right(R),
}

// SAFETY: every method answers for the buffer inside, which the value owns: its
// contract is the Either's.
unsafe impl<L: IoBuf, R: IoBuf> IoBuf for Either<L, R> {
    fn stable_ptr(&self) -> *const u8 {
        match self {
            Either::Left(b) => b.stable_ptr(),
            Either::Right(b) => b.stable_ptr(),
        }
    }
    fn bytes_init(&self) -> usize {
        match self {
            Either::Left(b) => b.bytes_init(),
            Either::Right(b) => b.bytes_init(),
        }
    }
    fn memory_type(&self) -> MemoryType {
        match self {
            Either::Left(b) => b.memory_type(),
            Either::Right(b) => b.memory_type(),
        }
    }
    fn ready(&self) -> Result<(), Error> {
        match self {
            Either::Left(b) => b.ready(),
            Either::Right(b) => b.ready(),
        }
    }
}

// SAFETY: as above.
unsafe impl<L: IoBufMut, R: IoBufMut> IoBufMut for Either<L, R> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Either::Left(b) => b.stable_mut_ptr(),
            Either::Right(b) => b.stable_mut_ptr(),
        }
    }
    fn bytes_total(&self) -> usize {
        match self {
            Either::Left(b) => b.bytes_total(),
            Either::Right(b) => b.bytes_total(),
        }
    }
    unsafe fn set_init(&mut self, n: usize) {
        match self {
            // SAFETY: the caller's guarantee, passed on to the buffer it is about.
            Either::Left(b) => unsafe { b.set_init(n) },
            // SAFETY: as above.
            Either::Right(b) => unsafe { b.set_init(n) },
        }
    }
}

// SAFETY: no value of an uninhabited type exists, so none of these can be called.
unsafe impl IoBuf for Infallible {
    fn stable_ptr(&self) -> *const u8 {
        match *self {}
    }
    fn bytes_init(&self) -> usize {
        match *self {}
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for Infallible {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        match *self {}
    }
    fn bytes_total(&self) -> usize {
        match *self {}
    }
    unsafe fn set_init(&mut self, _n: usize) {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn either_side_answers_for_its_buffer() {
        let mut l: Either<Vec<u8>, Box<[u8]>> = Either::Left(Vec::with_capacity(8));
        let r: Either<Vec<u8>, Box<[u8]>> = Either::Right(vec![1, 2, 3].into());
        assert_eq!((l.bytes_init(), r.bytes_init(), r.bytes_total()), (0, 3, 3));
        assert!(l.bytes_total() >= 8);
        // SAFETY: two bytes within capacity, written first.
        unsafe {
            l.stable_mut_ptr().write(9);
            l.stable_mut_ptr().add(1).write(8);
            l.set_init(2);
        }
        assert_eq!(l, Either::Left(vec![9, 8]));
        assert_eq!(r.memory_type(), MemoryType::Host);
        let e: Either<Vec<u8>, Infallible> = Either::Left(vec![1]);
        assert_eq!(e.bytes_init(), 1);
    }
}
