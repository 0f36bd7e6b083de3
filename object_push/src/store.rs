//! Where a node keeps its objects: the [`ObjectStore`] trait, [`Object`] (a sealed
//! object's bytes, in memory or in a file, and its layout) and [`MemoryStore`], the
//! default ([`crate::FileStore`] keeps objects in files).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::device::buf_len;
use crate::error::{Error, Result};
use crate::file::ObjectFile;
use crate::id::ObjectId;
use crate::sums::Layout;

/// A sealed object: immutable bytes, in memory or in a file ([`ObjectFile`]), and the
/// layout (chunks and checksums) they were sealed with. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Object {
    body: Body,
    layout: Arc<Layout>,
}

/// Where an object's bytes are.
#[derive(Clone, Debug)]
enum Body {
    Memory(Bytes),
    File(Arc<ObjectFile>),
    /// Device memory (feature `cuda`; uninhabited without it).
    Device(crate::device::DeviceBuf),
}

impl Object {
    /// An object of `bytes` with `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the layout is of another size.
    pub fn new(bytes: Bytes, layout: Layout) -> Result<Object> {
        Object::checked(Body::Memory(bytes), layout)
    }

    /// An object whose bytes are `file`'s, with `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the layout is of another size.
    pub fn in_file(file: ObjectFile, layout: Layout) -> Result<Object> {
        Object::checked(Body::File(Arc::new(file)), layout)
    }

    /// An object whose bytes are a device buffer a transfer filled.
    pub(crate) fn in_device(buf: crate::device::DeviceBuf, layout: Layout) -> Result<Object> {
        Object::checked(Body::Device(buf), layout)
    }

    /// An object whose bytes are a file shared with others (a transfer's).
    pub(crate) fn in_shared_file(file: Arc<ObjectFile>, layout: Layout) -> Result<Object> {
        Object::checked(Body::File(file), layout)
    }

    /// An object whose bytes are the device buffer `buf`'s, with `layout` (feature
    /// `cuda`): served from device memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the layout is of another size.
    #[cfg(feature = "cuda")]
    pub fn on_device(buf: crate::device::DeviceBuf, layout: Layout) -> Result<Object> {
        Object::in_device(buf, layout)
    }

    /// The device buffer holding the object's bytes, for an object in device memory
    /// (feature `cuda`).
    #[cfg(feature = "cuda")]
    pub fn device(&self) -> Option<&crate::device::DeviceBuf> {
        match &self.body {
            Body::Device(d) => Some(d),
            _ => None,
        }
    }

    fn checked(body: Body, layout: Layout) -> Result<Object> {
        let len = match &body {
            Body::Memory(b) => b.len() as u64,
            Body::File(f) => f.len(),
            Body::Device(d) => buf_len(d) as u64,
        };
        if layout.size() != len {
            return Err(Error::InvalidArgument(format!(
                "a layout of {} bytes for an object of {len}",
                layout.size()
            )));
        }
        Ok(Object { body, layout: Arc::new(layout) })
    }

    /// The object's bytes, when they are in memory (`None` for an object in a file:
    /// [`Object::read`] it, or use its [`Object::file`]).
    pub fn bytes(&self) -> Option<&Bytes> {
        match &self.body {
            Body::Memory(b) => Some(b),
            _ => None,
        }
    }

    /// The file holding the object's bytes, for an object in a file.
    pub fn file(&self) -> Option<&ObjectFile> {
        match &self.body {
            Body::File(f) => Some(f),
            _ => None,
        }
    }

    /// Bytes `range` of the object: a slice of it in memory (no copy), or read from its
    /// file or copied from device memory (blocking: call it off the async threads for
    /// large reads).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range past the object's end; [`Error::Store`]
    /// when its file or device memory cannot be read.
    pub fn read(&self, range: std::ops::Range<u64>) -> Result<Bytes> {
        if range.start > range.end || range.end > self.layout.size() {
            return Err(Error::InvalidArgument(format!(
                "bytes {range:?} of an object of {}",
                self.layout.size()
            )));
        }
        match &self.body {
            Body::Memory(b) => Ok(b.slice(range.start as usize..range.end as usize)),
            Body::File(f) => f.read(range).map(Bytes::from),
            Body::Device(d) => {
                let piece = crate::device::piece_of(d, range.start as usize..range.end as usize)?;
                crate::device::host_copy(&piece).map(Bytes::from)
            }
        }
    }

    /// Its chunks and their checksums.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Its bytes in memory, taken out of the object (`None` for an object in a file).
    pub fn into_bytes(self) -> Option<Bytes> {
        match self.body {
            Body::Memory(b) => Some(b),
            _ => None,
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.layout.size() as usize
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }
}

/// A node's objects. An object is visible ([`ObjectStore::get`]) only once sealed, and a
/// node seals only what it verified. Implement it over a runtime's own store; calls
/// must be quick (they run on the node's tasks).
pub trait ObjectStore: Send + Sync + 'static {
    /// The sealed object `id`, if held.
    fn get(&self, id: &ObjectId) -> Option<Object>;

    /// Makes room for an object of `size` bytes about to arrive, or refuses it: the room
    /// is taken until the object is sealed or the room given back.
    ///
    /// # Errors
    /// [`Error::NoRoom`] when there is no room now (the node waits for some, up to its
    /// `room_wait`), [`Error::Store`] when there never will be (the object is larger
    /// than the store), [`Error::Exists`] when `id` is held.
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

    /// A file to receive object `id` of `size` bytes into (after [`ObjectStore::reserve`]
    /// took room for it), or `None` to receive it in memory, the default. An object
    /// received into a file is sealed as [`Object::in_file`] of it.
    ///
    /// # Errors
    /// [`Error::Store`] when the file cannot be made.
    fn file_for(&self, id: &ObjectId, size: u64) -> Result<Option<ObjectFile>> {
        let _ = (id, size);
        Ok(None)
    }

    /// A device buffer to receive object `id` of `size` bytes into (feature `cuda`; after
    /// [`ObjectStore::reserve`] took room for it), or `None`, the default: asked before
    /// [`ObjectStore::file_for`]. An object received into one is sealed as
    /// [`Object::on_device`] of it (see [`crate::device`]).
    ///
    /// # Errors
    /// [`Error::Store`] when the memory cannot be had.
    #[cfg(feature = "cuda")]
    fn device_for(&self, id: &ObjectId, size: u64) -> Result<Option<crate::device::DeviceBuf>> {
        let _ = (id, size);
        Ok(None)
    }
}

/// Objects in memory, up to a capacity in bytes (sealed and reserved together).
#[derive(Debug, Default)]
pub struct MemoryStore {
    ledger: Ledger,
}

impl MemoryStore {
    /// A store without a limit.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// A store that holds at most `bytes` bytes.
    pub fn with_capacity(bytes: u64) -> MemoryStore {
        MemoryStore { ledger: Ledger::new(Some(bytes)) }
    }

    /// Bytes held and reserved.
    pub fn used(&self) -> u64 {
        self.ledger.used()
    }
}

impl ObjectStore for MemoryStore {
    ledger_methods!();
}

/// The [`ObjectStore`] methods a store with a `ledger` field hands to its [`Ledger`].
macro_rules! ledger_methods {
    () => {
        fn get(&self, id: &ObjectId) -> Option<Object> {
            self.ledger.get(id)
        }
        fn reserve(&self, id: &ObjectId, size: u64) -> Result<()> {
            self.ledger.reserve(id, size)
        }
        fn unreserve(&self, id: &ObjectId, size: u64) {
            self.ledger.unreserve(id, size)
        }
        fn seal(&self, id: ObjectId, object: Object) -> Result<()> {
            self.ledger.seal(id, object)
        }
        fn release(&self, id: &ObjectId) -> Option<Object> {
            self.ledger.release(id)
        }
    };
}
pub(crate) use ledger_methods;

/// The objects of a store and the room they take, up to a capacity: what
/// [`MemoryStore`] and [`crate::FileStore`] share.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    capacity: Option<u64>,
    state: Mutex<LedgerState>,
}

#[derive(Debug, Default)]
struct LedgerState {
    objects: HashMap<ObjectId, Object>,
    reserved: HashMap<ObjectId, u64>,
    used: u64,
}

impl Ledger {
    pub(crate) fn new(capacity: Option<u64>) -> Ledger {
        Ledger { capacity, state: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn used(&self) -> u64 {
        self.lock().used
    }

    pub(crate) fn get(&self, id: &ObjectId) -> Option<Object> {
        self.lock().objects.get(id).cloned()
    }

    pub(crate) fn reserve(&self, id: &ObjectId, size: u64) -> Result<()> {
        let mut s = self.lock();
        if s.objects.contains_key(id) || s.reserved.contains_key(id) {
            return Err(Error::Exists(*id));
        }
        let after = s.used.saturating_add(size);
        if let Some(cap) = self.capacity.filter(|&c| size > c) {
            return Err(Error::Store(format!("no room for {size} bytes: the store holds at most {cap}")));
        }
        if let Some(cap) = self.capacity.filter(|&c| after > c) {
            return Err(Error::NoRoom(format!("no room for {size} bytes ({} of {cap} in use)", s.used)));
        }
        s.used = after;
        s.reserved.insert(*id, size);
        Ok(())
    }

    pub(crate) fn unreserve(&self, id: &ObjectId, size: u64) {
        let mut s = self.lock();
        if s.reserved.remove(id).is_some() {
            s.used -= size;
        }
    }

    pub(crate) fn seal(&self, id: ObjectId, object: Object) -> Result<()> {
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

    pub(crate) fn release(&self, id: &ObjectId) -> Option<Object> {
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
        assert!(matches!(s.reserve(&b, 6000), Err(Error::NoRoom(_))), "room later");
        assert!(matches!(s.reserve(&b, 10_001), Err(Error::Store(_))), "never room");
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
