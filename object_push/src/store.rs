//! Where a node keeps its objects: the [`ObjectStore`] trait, [`Object`] (a sealed
//! object's bytes and layout) and [`MemoryStore`], the default.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::sums::Layout;

/// A sealed object: immutable bytes and the layout (chunks and checksums) they were
/// sealed with. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Object {
    bytes: Bytes,
    layout: Arc<Layout>,
}

impl Object {
    /// An object of `bytes` with `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the layout is of another size.
    pub fn new(bytes: Bytes, layout: Layout) -> Result<Object> {
        if layout.size() != bytes.len() as u64 {
            return Err(Error::InvalidArgument(format!(
                "a layout of {} bytes for an object of {}",
                layout.size(),
                bytes.len()
            )));
        }
        Ok(Object { bytes, layout: Arc::new(layout) })
    }

    /// The object's bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// Its chunks and their checksums.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Its bytes, taken out of the object.
    pub fn into_bytes(self) -> Bytes {
        self.bytes
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// A node's objects. An object is visible ([`ObjectStore::get`]) only once sealed, and a
/// node seals only what it verified. Implement it over a runtime's own store; calls
/// must be quick (they run on the node's tasks).
pub trait ObjectStore: Send + Sync + 'static {
    /// The sealed object `id`, if held.
    fn get(&self, id: &ObjectId) -> Option<Object>;

    /// Makes room for an object of `size` bytes about to arrive, or refuses it (no room
    /// left): the room is taken until the object is sealed or the room given back.
    ///
    /// # Errors
    /// [`Error::Store`] when it is refused, [`Error::Exists`] when `id` is held.
    fn reserve(&self, id: &ObjectId, size: u64) -> Result<()>;

    /// Gives back room [`ObjectStore::reserve`] took for an object that did not arrive.
    fn unreserve(&self, id: &ObjectId, size: u64);

    /// Makes `object` visible as `id`, in room reserved for it (or without, for an
    /// object put by the application).
    ///
    /// # Errors
    /// [`Error::Exists`] when `id` is held already.
    fn seal(&self, id: ObjectId, object: Object) -> Result<()>;

    /// Forgets object `id` and hands it back, if it was held. Transfers of it already
    /// under way keep their bytes.
    fn release(&self, id: &ObjectId) -> Option<Object>;
}

/// Objects in memory, up to a capacity in bytes (sealed and reserved together).
#[derive(Debug, Default)]
pub struct MemoryStore {
    capacity: Option<u64>,
    state: Mutex<MemState>,
}

#[derive(Debug, Default)]
struct MemState {
    objects: HashMap<ObjectId, Object>,
    reserved: HashMap<ObjectId, u64>,
    used: u64,
}

impl MemoryStore {
    /// A store without a limit.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// A store that holds at most `bytes` bytes.
    pub fn with_capacity(bytes: u64) -> MemoryStore {
        MemoryStore { capacity: Some(bytes), state: Mutex::default() }
    }

    /// Bytes held and reserved.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ObjectStore for MemoryStore {
    fn get(&self, id: &ObjectId) -> Option<Object> {
        self.lock().objects.get(id).cloned()
    }

    fn reserve(&self, id: &ObjectId, size: u64) -> Result<()> {
        let mut s = self.lock();
        if s.objects.contains_key(id) || s.reserved.contains_key(id) {
            return Err(Error::Exists(*id));
        }
        let after = s.used.saturating_add(size);
        if let Some(cap) = self.capacity.filter(|&c| after > c) {
            return Err(Error::Store(format!("no room for {size} bytes ({} of {cap} in use)", s.used)));
        }
        s.used = after;
        s.reserved.insert(*id, size);
        Ok(())
    }

    fn unreserve(&self, id: &ObjectId, size: u64) {
        let mut s = self.lock();
        if s.reserved.remove(id).is_some() {
            s.used -= size;
        }
    }

    fn seal(&self, id: ObjectId, object: Object) -> Result<()> {
        let mut s = self.lock();
        if s.objects.contains_key(&id) {
            return Err(Error::Exists(id));
        }
        let size = object.len() as u64;
        if s.reserved.remove(&id).is_none() {
            let after = s.used.saturating_add(size);
            if let Some(cap) = self.capacity.filter(|&c| after > c) {
                return Err(Error::Store(format!("no room for {size} bytes ({} of {cap} in use)", s.used)));
            }
            s.used = after;
        }
        s.objects.insert(id, object);
        Ok(())
    }

    fn release(&self, id: &ObjectId) -> Option<Object> {
        let mut s = self.lock();
        let o = s.objects.remove(id)?;
        s.used -= o.len() as u64;
        Some(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(n: usize) -> Object {
        let b = Bytes::from(vec![1u8; n]);
        let l = Layout::of(&b, 4096).unwrap();
        Object::new(b, l).unwrap()
    }

    #[test]
    fn a_memory_store_keeps_within_its_capacity() {
        let s = MemoryStore::with_capacity(10_000);
        let (a, b, c) =
            (ObjectId::new(b"a").unwrap(), ObjectId::new(b"b").unwrap(), ObjectId::new(b"c").unwrap());
        s.reserve(&a, 6000).unwrap();
        assert!(matches!(s.reserve(&a, 1), Err(Error::Exists(_))));
        assert!(matches!(s.reserve(&b, 6000), Err(Error::Store(_))));
        assert!(s.get(&a).is_none(), "reserved is not visible");
        s.seal(a, obj(6000)).unwrap();
        assert_eq!(s.get(&a).unwrap().len(), 6000);
        assert!(matches!(s.seal(c, obj(5000)), Err(Error::Store(_))), "unreserved, over the capacity");
        s.reserve(&b, 4000).unwrap();
        s.unreserve(&b, 4000);
        assert_eq!(s.used(), 6000);
        assert!(s.release(&a).is_some() && s.release(&a).is_none());
        assert_eq!(s.used(), 0);
        assert!(Object::new(Bytes::from_static(b"abc"), Layout::of(b"ab", 4096).unwrap()).is_err());
    }
}
