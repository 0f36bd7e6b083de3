//! [`SharedBuf`]: one owned buffer of plain values that several operations use at once,
//! each through a [`SharedSlice`] of it (a collective receiving blocks from several
//! peers into one result, sending one block to several peers), and that its owner reads
//! and writes in place whenever no operation holds a part of it.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use super::{IoBuf, IoBufMut};
use crate::error::{Error, Result};

/// The memory of a [`SharedBuf`]: a `Vec<T>` taken apart, so that operations write it
/// through raw pointers only.
struct Storage<T> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    /// For a tracked buffer ([`SharedBuf::tracked`]), the ranges of the live slices (one
    /// entry per slice), for [`SharedBuf::view_range`].
    live: Option<Mutex<Vec<Range<usize>>>>,
}

impl<T> Storage<T> {
    #[inline]
    fn of(values: Vec<T>, tracked: bool) -> Storage<T> {
        let mut values = std::mem::ManuallyDrop::new(values);
        let (len, cap) = (values.len(), values.capacity());
        let ptr = NonNull::new(values.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Storage { ptr, len, cap, live: tracked.then(|| Mutex::new(Vec::new())) }
    }

    /// The values as the `Vec` they came from.
    #[inline]
    fn into_vec(self) -> Vec<T> {
        let mut s = std::mem::ManuallyDrop::new(self);
        // SAFETY: `s` is never dropped, so its live list is dropped here once and the
        // parts of the Vec taken apart in `of` are rebuilt once.
        unsafe {
            std::ptr::drop_in_place(&mut s.live);
            Vec::from_raw_parts(s.ptr.as_ptr(), s.len, s.cap)
        }
    }

    #[inline]
    fn live(&self) -> Option<std::sync::MutexGuard<'_, Vec<Range<usize>>>> {
        self.live.as_ref().map(|m| m.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

// SAFETY: the storage is a Vec<T> of plain values (Pod: no references, any bit pattern
// valid); it is touched through a Rust reference only by the unique owner
// (`SharedBuf::view`, which needs `Arc::get_mut`), otherwise through raw pointers by UCX.
unsafe impl<T: Pod + Send> Send for Storage<T> {}
// SAFETY: as above; `&Storage` gives no access to the values.
unsafe impl<T: Pod + Sync> Sync for Storage<T> {}

impl<T> Drop for Storage<T> {
    fn drop(&mut self) {
        // SAFETY: the parts of a Vec<T> taken apart in `Storage::of`, rebuilt once.
        drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.cap) });
    }
}

/// A buffer of `T` (plain values: integers, floats, `f16`/`bf16`, arrays of them) that
/// several operations may use at once, in parts ([`SharedBuf::slice`]) or whole, for
/// sending and receiving, without copying.
///
/// While any [`SharedSlice`] of it is alive (held by an operation, or parked with the
/// worker because its future was dropped), its values are reachable only by the
/// transports: [`SharedBuf::view`] gives them to the owner, mutably, once every slice is
/// gone, and [`SharedBuf::try_into_vec`] gives the `Vec` back. Slices may overlap: that is
/// memory-safe (no Rust reference to the values exists meanwhile), and what overlapping
/// receives leave is up to the order in which they land.
pub struct SharedBuf<T: Pod + Send + Sync> {
    storage: Arc<Storage<T>>,
}

impl<T: Pod + Send + Sync> SharedBuf<T> {
    /// Takes over `values`, without copying.
    pub fn new(values: Vec<T>) -> SharedBuf<T> {
        SharedBuf { storage: Arc::new(Storage::of(values, false)) }
    }

    /// Takes over `values` as a buffer whose owner can work on parts no operation holds
    /// while others do ([`SharedBuf::view_range`]); each slice costs a lock to make and
    /// to drop (its range is kept).
    pub fn tracked(values: Vec<T>) -> SharedBuf<T> {
        SharedBuf { storage: Arc::new(Storage::of(values, true)) }
    }

    /// Whether it was made by [`SharedBuf::tracked`].
    #[inline]
    pub fn is_tracked(&self) -> bool {
        self.storage.live.is_some()
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.storage.len
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.storage.len == 0
    }

    /// Values `range` as an operation's buffer: a send sends them, a receive writes them
    /// (and nothing past them).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `range` is not within `0..len()`.
    #[inline]
    pub fn slice(&self, range: Range<usize>) -> Result<SharedSlice<T>> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::ApiMisuse(format!(
                "shared buffer slice {range:?} is outside its {} values",
                self.len()
            )));
        }
        Ok(SharedSlice::new(&self.storage, range))
    }

    /// All values as one operation's buffer.
    pub fn whole(&self) -> SharedSlice<T> {
        SharedSlice::new(&self.storage, 0..self.len())
    }

    /// Whether a slice is still alive (an operation, finished or not, still holds it).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.storage) > 1
    }

    /// The values, to read and write in place, when no slice is alive; `None` otherwise.
    pub fn view(&mut self) -> Option<&mut [T]> {
        let s = Arc::get_mut(&mut self.storage)?;
        // SAFETY: `len` initialized values of a live allocation; the `&mut self` borrow
        // and the uniqueness of the Arc make this the only access while it lives.
        Some(unsafe { std::slice::from_raw_parts_mut(s.ptr.as_ptr(), s.len) })
    }

    /// Values `range`, to read and write in place, when no live slice shares a value
    /// with them: the owner works on one part while operations use others. `None`
    /// otherwise, when `range` is not within `0..len()`, and, for a buffer not made by
    /// [`SharedBuf::tracked`], while any slice is alive.
    pub fn view_range(&mut self, range: Range<usize>) -> Option<&mut [T]> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        if Arc::get_mut(&mut self.storage).is_none() {
            let live = self.storage.live()?;
            if live.iter().any(|r| r.start < range.end && range.start < r.end) {
                return None;
            }
        }
        // SAFETY: `range` lies within the `len` initialized values of a live allocation;
        // no live slice covers any of its values, and no new slice can be made while
        // `&mut self` is borrowed, so transports write none of them and this is the only
        // reference to them while it lives.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.storage.ptr.as_ptr().add(range.start), range.len())
        })
    }

    /// Puts `values` in the buffer's place and gives back the values it held, when no
    /// slice is alive (`Err(values)` otherwise): a buffer reused for the next values
    /// costs no allocation of its own. A tracked buffer stays tracked.
    #[inline]
    pub fn replace(&mut self, values: Vec<T>) -> std::result::Result<Vec<T>, Vec<T>> {
        let tracked = self.is_tracked();
        let Some(s) = Arc::get_mut(&mut self.storage) else { return Err(values) };
        Ok(std::mem::replace(s, Storage::of(values, tracked)).into_vec())
    }

    /// The `Vec` back, when no slice is alive; the buffer itself otherwise.
    pub fn try_into_vec(self) -> std::result::Result<Vec<T>, SharedBuf<T>> {
        match Arc::try_unwrap(self.storage) {
            Ok(s) => Ok(s.into_vec()),
            Err(storage) => Err(SharedBuf { storage }),
        }
    }
}

impl<T: Pod + Send + Sync> From<Vec<T>> for SharedBuf<T> {
    fn from(values: Vec<T>) -> Self {
        SharedBuf::new(values)
    }
}

impl<T: Pod + Send + Sync> std::fmt::Debug for SharedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuf").field("len", &self.len()).field("in_use", &self.in_use()).finish()
    }
}

/// Values `range()` of a [`SharedBuf`], as an operation's buffer (made by
/// [`SharedBuf::slice`]). Holding one keeps the buffer's memory alive and its owner's
/// [`SharedBuf::view`] closed.
pub struct SharedSlice<T: Pod + Send + Sync> {
    storage: Arc<Storage<T>>,
    range: Range<usize>,
}

impl<T: Pod + Send + Sync> SharedSlice<T> {
    #[inline]
    fn new(storage: &Arc<Storage<T>>, range: Range<usize>) -> SharedSlice<T> {
        if let Some(mut live) = storage.live() {
            live.push(range.clone());
        }
        SharedSlice { storage: storage.clone(), range }
    }

    /// The values of the buffer this slice covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether it covers no values.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    fn bytes(&self) -> usize {
        self.range.len() * std::mem::size_of::<T>()
    }

    fn start(&self) -> *mut T {
        // `range.start <= len`: checked by `SharedBuf::slice`, so this stays inside (or
        // one past) the allocation.
        self.storage.ptr.as_ptr().wrapping_add(self.range.start)
    }
}

impl<T: Pod + Send + Sync> Drop for SharedSlice<T> {
    #[inline]
    fn drop(&mut self) {
        if let Some(mut live) = self.storage.live() {
            if let Some(i) = live.iter().position(|r| *r == self.range) {
                live.swap_remove(i);
            }
        }
    }
}

impl<T: Pod + Send + Sync> std::fmt::Debug for SharedSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSlice").field("range", &self.range).finish()
    }
}

// SAFETY: the pointer is into a heap allocation the slice keeps alive (its Arc), valid
// for the slice's bytes, and does not move.
unsafe impl<T: Pod + Send + Sync> IoBuf for SharedSlice<T> {
    fn stable_ptr(&self) -> *const u8 {
        self.start().cast()
    }
    fn bytes_init(&self) -> usize {
        self.bytes()
    }
}

// SAFETY: as above; writes are allowed because no Rust reference to the slice's values
// exists while it is alive (`SharedBuf::view` needs every slice gone, `view_range` every
// slice sharing a value gone), and any bit pattern is a valid `T` (Pod).
unsafe impl<T: Pod + Send + Sync> IoBufMut for SharedSlice<T> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.start().cast()
    }
    fn bytes_total(&self) -> usize {
        self.bytes()
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_their_values_and_close_the_view() {
        let mut b = SharedBuf::new(vec![1u32, 2, 3, 4]);
        let s = b.slice(1..3).expect("in range");
        assert_eq!((s.bytes_init(), s.len()), (8, 2));
        assert_eq!(s.stable_ptr() as usize - b.whole().stable_ptr() as usize, 4);
        assert!(b.in_use() && b.view().is_none());
        drop(s);
        b.view().expect("no slice alive")[0] = 9;
        assert_eq!(b.try_into_vec().expect("unique"), vec![9, 2, 3, 4]);
    }

    #[test]
    fn out_of_range_slices_are_errors() {
        let b = SharedBuf::new(vec![0u8; 4]);
        assert!(b.slice(0..5).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let r = b.slice(3..2);
        assert!(r.is_err());
        assert!(b.slice(4..4).expect("empty at the end").is_empty());
    }

    #[test]
    fn try_into_vec_waits_for_slices() {
        let b = SharedBuf::new(vec![1.5f64; 3]);
        let s = b.whole();
        let b = b.try_into_vec().expect_err("a slice is alive");
        drop(s);
        assert_eq!(b.try_into_vec().expect("unique").len(), 3);
        let empty: SharedBuf<u8> = Vec::new().into();
        assert!(empty.is_empty() && empty.try_into_vec().expect("unique").is_empty());
    }

    #[test]
    fn replace_swaps_values_only_when_no_slice_is_alive() {
        let mut b = SharedBuf::new(vec![1u16, 2]);
        assert_eq!(b.replace(vec![7; 5]), Ok(vec![1, 2]));
        assert_eq!((b.len(), b.view().expect("unique")[4]), (5, 7));
        let s = b.slice(0..1).expect("in range");
        assert_eq!(b.replace(Vec::new()), Err(Vec::new()));
        drop(s);
        assert_eq!(b.replace(Vec::new()), Ok(vec![7; 5]));
        assert!(b.is_empty() && b.try_into_vec().expect("unique").is_empty());
    }

    #[test]
    fn view_range_opens_the_parts_no_slice_holds() {
        let mut plain = SharedBuf::new(vec![0u8; 4]);
        let s = plain.slice(0..1).expect("in range");
        assert!(!plain.is_tracked() && plain.view_range(2..4).is_none(), "untracked: only when unique");
        drop(s);
        assert!(plain.view_range(2..4).is_some());
        let mut b = SharedBuf::tracked((0u32..10).collect());
        let s = b.slice(2..5).expect("in range");
        let t = b.slice(4..6).expect("in range");
        assert!(b.view().is_none());
        b.view_range(6..10).expect("free part")[0] = 60;
        assert!(b.view_range(0..3).is_none() && b.view_range(5..7).is_none());
        assert!(b.view_range(0..11).is_none(), "outside the buffer");
        drop(t);
        b.view_range(5..7).expect("freed")[1] = 66;
        assert_eq!(b.view_range(0..2).expect("free part"), &[0, 1]);
        assert!(b.view_range(4..5).is_none(), "still under the first slice");
        drop(s);
        assert_eq!(b.view().expect("unique")[5..7], [5, 66]);
        assert_eq!(b.replace(Vec::new()).expect("unique")[6], 66);
        assert!(b.is_tracked(), "replace keeps the mode");
    }
}
