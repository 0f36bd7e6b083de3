//! [`RegionView`]: a region's bytes in place, while nothing else of this process uses
//! the region.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::key::packed;
use super::MemRegion;
use crate::error::{Error, Result};

/// The bytes of a [`MemRegion`] as a Rust slice, from [`MemRegion::view`]. While it
/// lives, no operation of this process can use the region: the view borrows the only
/// handle, and keys for the region cannot be unpacked in this process.
pub struct RegionView<'a> {
    region: &'a mut MemRegion,
}

impl MemRegion {
    /// The region's bytes in place, to read and write without a copy (a reduction into
    /// registered memory, say), while this handle is the region's only one in this
    /// process: no clone, [`super::RegionSlice`], operation or key unpacked in this
    /// process holds it, so no operation of this process touches the bytes meanwhile.
    ///
    /// Peer processes given the region's key are not stopped: a put of theirs can land
    /// while the view is open. Order their accesses with the view through the protocol
    /// (they send a message after their put completes; the view is opened after it
    /// arrives), as any code reading RDMA-written memory must.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when another handle of this process holds the region;
    /// [`Error::Unsupported`] for a region in device memory.
    pub fn view(&mut self) -> Result<RegionView<'_>> {
        crate::device::host_only("a region's view", self.inner.mem)?;
        // Under the lock of the registry that key unpacking takes: no key of this region
        // can be unpacked (and hold it) between the check and the flag.
        let _registry = packed();
        let handles = Arc::strong_count(&self.inner);
        if handles != 1 {
            return Err(Error::ApiMisuse(format!(
                "the region has {} other handles in this process (clones, slices, operations or \
                 unpacked keys); a view needs the only one",
                handles - 1
            )));
        }
        // The other handles' drops (on other threads) happen before the view's accesses,
        // as in `Arc::get_mut`: `strong_count` alone is a relaxed load.
        std::sync::atomic::fence(Ordering::Acquire);
        self.inner.viewed.store(true, Ordering::Release);
        Ok(RegionView { region: self })
    }

    /// Whether a view is open (key unpacking in this process refuses the region then).
    pub(super) fn viewed(inner: &super::MemInner) -> bool {
        inner.viewed.load(Ordering::Acquire)
    }
}

impl Deref for RegionView<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let inner = &self.region.inner;
        // SAFETY: the region's memory is valid and initialized for `len` bytes while the
        // borrowed handle lives; no operation or other handle of this process can reach
        // it while the view is open (see `MemRegion::view`).
        unsafe { std::slice::from_raw_parts(inner.ptr, inner.len) }
    }
}

impl DerefMut for RegionView<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        let inner = &self.region.inner;
        // SAFETY: as in deref; the view is the only way to the bytes in this process and
        // it is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(inner.ptr, inner.len) }
    }
}

impl Drop for RegionView<'_> {
    fn drop(&mut self) {
        self.region.inner.viewed.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for RegionView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionView").field("len", &self.region.inner.len).finish()
    }
}
