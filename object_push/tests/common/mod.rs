//! What the object tests share: a store whose reads a test can bend.

use std::sync::atomic::{AtomicU32, Ordering};

use ucxkit_object_push::{MemoryStore, Object, ObjectId, ObjectStore, Result};

/// A [`MemoryStore`] whose reads of a held object go through `read` (with the object,
/// it returns what the node gets): stores that lie, forget or die on a given read.
pub(crate) struct Bent<F> {
    pub(crate) inner: MemoryStore,
    pub(crate) read: F,
}

impl<F: Fn(Object) -> Option<Object> + Send + Sync + 'static> ObjectStore for Bent<F> {
    fn get(&self, id: &ObjectId) -> Option<Object> {
        self.inner.get(id).and_then(&self.read)
    }
    fn reserve(&self, id: &ObjectId, size: u64) -> Result<()> {
        self.inner.reserve(id, size)
    }
    fn unreserve(&self, id: &ObjectId, size: u64) {
        self.inner.unreserve(id, size)
    }
    fn seal(&self, id: ObjectId, object: Object) -> Result<()> {
        self.inner.seal(id, object)
    }
    fn release(&self, id: &ObjectId) -> Option<Object> {
        self.inner.release(id)
    }
}

impl<F> Bent<F> {
    /// A store over a fresh [`MemoryStore`].
    pub(crate) fn new(read: F) -> Bent<F> {
        Bent { inner: MemoryStore::new(), read }
    }
}

/// Takes one from `n` unless it is zero; whether it took one.
#[allow(dead_code)] // Not every test crate counts.
pub(crate) fn take_one(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1)).is_ok()
}
