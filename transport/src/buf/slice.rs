//! [`Slice`]: a sub-range of an owned buffer, used as an operation's buffer without
//! copying; the whole buffer comes back with the result ([`Slice::into_inner`]).

use std::ops::{Bound, Range, RangeBounds};

use super::{IoBuf, IoBufMut};
use crate::error::Error;

/// Bytes `begin..end` of an owned buffer `B`, as an operation's buffer: a send sends
/// them, a receive writes into them. Made by [`IoBuf::into_slice`] (a range of the bytes a
/// send would send) or [`IoBufMut::into_slice_mut`] (a range of the buffer's capacity, for a
/// receive). The operation gives the slice back; [`Slice::into_inner`] gives the whole
/// buffer.
///
/// A receive into a slice of a growable buffer (`Vec<u8>`, `BytesMut`) that ends past
/// the buffer's length sets the length to the end of what arrived: the bytes before the
/// slice keep their contents, and a slice may start no later than the length, so the
/// contents stay contiguous.
#[derive(Debug)]
pub struct Slice<B> {
    buf: B,
    begin: usize,
    end: usize,
}

/// `range` as `begin..end`, checked against `limit`.
fn bounds(range: &impl RangeBounds<usize>, limit: usize) -> Option<Range<usize>> {
    let begin = match range.start_bound() {
        Bound::Included(&b) => b,
        Bound::Excluded(&b) => b.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => limit,
    };
    (begin <= end && end <= limit).then_some(begin..end)
}

#[cold]
fn bad_range(what: &str, begin: Bound<&usize>, end: Bound<&usize>, limit: usize) -> Error {
    Error::ApiMisuse(format!("slice ({begin:?}, {end:?}) is outside the buffer's {limit} {what}"))
}

impl<B> Slice<B> {
    /// Start of the slice in the buffer.
    pub fn begin(&self) -> usize {
        self.begin
    }

    /// End of the slice in the buffer (exclusive).
    pub fn end(&self) -> usize {
        self.end
    }

    /// Length of the slice.
    pub fn len(&self) -> usize {
        self.end - self.begin
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.begin == self.end
    }

    /// The whole buffer.
    pub fn get_ref(&self) -> &B {
        &self.buf
    }

    /// The whole buffer, given back.
    pub fn into_inner(self) -> B {
        self.buf
    }
}

impl<B: IoBuf> Slice<B> {
    /// The slice of `buf` for `range` of its initialized bytes (see [`IoBuf::into_slice`]).
    pub(crate) fn of(buf: B, range: impl RangeBounds<usize>) -> Result<Slice<B>, (Error, B)> {
        let limit = buf.bytes_init();
        match bounds(&range, limit) {
            Some(r) => Ok(Slice { buf, begin: r.start, end: r.end }),
            None => Err((bad_range("initialized bytes", range.start_bound(), range.end_bound(), limit), buf)),
        }
    }
}

impl<B: IoBufMut> Slice<B> {
    /// The slice of `buf` for `range` of its capacity (see [`IoBufMut::into_slice_mut`]).
    pub(crate) fn of_mut(buf: B, range: impl RangeBounds<usize>) -> Result<Slice<B>, (Error, B)> {
        let limit = buf.bytes_total();
        match bounds(&range, limit) {
            Some(r) if r.start <= buf.bytes_init() => Ok(Slice { buf, begin: r.start, end: r.end }),
            Some(r) => Err((
                Error::ApiMisuse(format!(
                    "a receive slice may start no later than the buffer's {} initialized bytes (it starts at {})",
                    buf.bytes_init(),
                    r.start
                )),
                buf,
            )),
            None => Err((bad_range("bytes of capacity", range.start_bound(), range.end_bound(), limit), buf)),
        }
    }
}

// SAFETY: the pointer is the buffer's own (stable while an operation owns the slice,
// which owns the buffer) moved by `begin`, which is at most the buffer's initialized
// length; the length read is clipped to the initialized bytes.
unsafe impl<B: IoBuf> IoBuf for Slice<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr().wrapping_add(self.begin)
    }
    fn bytes_init(&self) -> usize {
        self.end.min(self.buf.bytes_init()).saturating_sub(self.begin)
    }
    #[inline(always)]
    fn memory_type(&self) -> crate::MemoryType {
        self.buf.memory_type()
    }
    fn ready(&self) -> Result<(), Error> {
        self.buf.ready()
    }
}

// SAFETY: `end` is at most the buffer's capacity (checked when made; the capacity of an
// owned buffer does not shrink while the slice owns it), so `begin..end` is writable.
unsafe impl<B: IoBufMut> IoBufMut for Slice<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr().wrapping_add(self.begin)
    }
    fn bytes_total(&self) -> usize {
        self.end - self.begin
    }
    unsafe fn set_init(&mut self, n: usize) {
        let end = self.begin + n;
        if end > self.buf.bytes_init() {
            // SAFETY: bytes up to `begin` were initialized when the slice was made (it
            // starts within them), and the caller wrote `begin..begin + n`.
            unsafe { self.buf.set_init(end) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_and_the_buffer_comes_back() {
        let v = b"0123456789".to_vec();
        let s = v.into_slice(2..5).unwrap();
        assert_eq!((s.begin(), s.end(), s.len()), (2, 5, 3));
        // SAFETY: reading the slice's own initialized bytes.
        let sent = unsafe { std::slice::from_raw_parts(s.stable_ptr(), s.bytes_init()) };
        assert_eq!(sent, b"234");
        let v = s.into_inner();
        for bad in [5..11, 11..11] {
            let (e, back) = v.clone().into_slice(bad.clone()).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{bad:?}");
            assert_eq!(back, v);
        }
        #[allow(clippy::reversed_empty_ranges)]
        let r = 6..5;
        assert!(v.clone().into_slice(r).is_err());
        assert!(v.clone().into_slice((Bound::Excluded(usize::MAX), Bound::Unbounded)).is_err());
        assert!(v.clone().into_slice(..=usize::MAX).is_err());
        assert_eq!(v.clone().into_slice(..).unwrap().len(), 10);
        assert_eq!(v.clone().into_slice(10..).unwrap().len(), 0);
    }

    /// A receive into a slice: what lands keeps the bytes before it, and the length
    /// grows to the end of what arrived, never shrinks.
    fn recv(buf: Vec<u8>, range: Range<usize>, data: &[u8]) -> Vec<u8> {
        let mut s = buf.into_slice_mut(range).unwrap();
        assert!(data.len() <= s.bytes_total());
        // SAFETY: data.len() bytes within the slice's capacity are written first.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), s.stable_mut_ptr(), data.len());
            s.set_init(data.len());
        }
        s.into_inner()
    }

    #[test]
    fn receives_land_in_the_slice() {
        let mut v = Vec::with_capacity(16);
        v.extend_from_slice(b"abcd");
        let v = recv(v, 4..12, b"xyz");
        assert_eq!(v, b"abcdxyz");
        let v = recv(v, 1..3, b"QR");
        assert_eq!(v, b"aQRdxyz");
        let v = recv(v, 7..16, b"");
        assert_eq!(v, b"aQRdxyz");
        // Starting past the contents would leave a gap of unwritten bytes.
        let (e, v) = v.into_slice_mut(8..9).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidInput);
        let cap = v.capacity();
        assert!(v.into_slice_mut(0..cap + 1).is_err());
        let b: Box<[u8]> = vec![0u8; 8].into_boxed_slice();
        let mut s = b.into_slice_mut(6..8).unwrap();
        assert_eq!(s.bytes_total(), 2);
        // SAFETY: two bytes within the slice.
        unsafe {
            s.stable_mut_ptr().write(1);
            s.stable_mut_ptr().add(1).write(2);
            s.set_init(2);
        }
        assert_eq!(&*s.into_inner(), &[0, 0, 0, 0, 0, 0, 1, 2]);
    }
}
