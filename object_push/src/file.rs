//! Objects in files, for objects larger than memory: [`ObjectFile`] (a file an object
//! is received into or served from) and [`FileStore`] (a store that receives every
//! object into a file of its directory).
//!
//! Chunks are written with positioned writes as they check out and read with
//! positioned reads when served, so a node holds only the chunks in flight in memory.
//! Files are sparse: made at their full size, a chunk's runs of zeros are not written.
//! Written through a memory mapping instead, a full disk would end the process with a
//! signal; here it is an error of that transfer.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::{Ledger, Object, ObjectStore};

/// Runs of zeros at least this long are left as holes.
const HOLE: usize = 64 << 10;

/// A file holding one object's bytes.
#[derive(Debug)]
pub struct ObjectFile {
    file: File,
    path: PathBuf,
    len: u64,
    /// Removed when dropped.
    remove: AtomicBool,
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Store(format!("{what} {}: {e}", path.display()))
}

impl ObjectFile {
    /// A new file of `len` bytes at `path` (all holes until written), removed when
    /// dropped unless [`ObjectFile::keep`] is called.
    ///
    /// # Errors
    /// [`Error::Store`] when it cannot be made (it exists already, the directory is
    /// missing, no room).
    pub fn create(path: impl Into<PathBuf>, len: u64) -> Result<ObjectFile> {
        let path = path.into();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io("creating", &path, e))?;
        let f = ObjectFile { file, path, len, remove: AtomicBool::new(true) };
        f.file.set_len(len).map_err(|e| io("sizing", &f.path, e))?;
        Ok(f)
    }

    /// The file at `path` as it is, kept when dropped.
    ///
    /// # Errors
    /// [`Error::Store`] when it cannot be opened.
    pub fn open(path: impl Into<PathBuf>) -> Result<ObjectFile> {
        let path = path.into();
        let file = File::open(&path).map_err(|e| io("opening", &path, e))?;
        let len = file.metadata().map_err(|e| io("reading the size of", &path, e))?.len();
        Ok(ObjectFile { file, path, len, remove: AtomicBool::new(false) })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The object's size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the file when the object goes.
    pub fn keep(&self) {
        self.remove.store(false, Ordering::Relaxed);
    }

    /// Bytes `range` of the file (blocking).
    ///
    /// # Errors
    /// [`Error::Store`] when they cannot be read (the file shrank, an I/O error).
    pub fn read(&self, range: std::ops::Range<u64>) -> Result<Vec<u8>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::Store(format!("bytes {range:?} of a file of {}", self.len)));
        }
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| Error::Store("a read larger than memory".into()))?;
        let mut buf = vec![0; len];
        self.file.read_exact_at(&mut buf, range.start).map_err(|e| io("reading", &self.path, e))?;
        Ok(buf)
    }

    /// Writes `bytes` at `offset` (blocking), leaving runs of zeros as holes.
    ///
    /// # Errors
    /// [`Error::Store`] when they cannot be written (no room on the disk, say).
    pub(crate) fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        for (i, run) in bytes.chunks(HOLE).enumerate() {
            if run.iter().all(|&b| b == 0) {
                continue;
            }
            let at = offset + (i * HOLE) as u64;
            self.file.write_all_at(run, at).map_err(|e| io("writing", &self.path, e))?;
        }
        Ok(())
    }
}

impl Drop for ObjectFile {
    fn drop(&mut self) {
        if self.remove.load(Ordering::Relaxed) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Objects in files of one directory, up to a capacity in bytes (sealed and reserved
/// together): every object a node receives in chunks goes straight into a file of its
/// own (named by its id, this process and a stamp), removed when the object is released
/// and no transfer reads it any more; files a process that is gone left behind are
/// removed when a store opens the directory. Objects that come inline (up to the node's
/// `inline_max`) stay in memory, as do those the application seals with
/// [`crate::ObjectNode::put`]; [`crate::ObjectNode::put_file`] seals a file as it is.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    ledger: Ledger,
    next: AtomicU64,
}

impl FileStore {
    /// A store in directory `dir` (made if missing), without a limit.
    ///
    /// # Errors
    /// [`Error::Store`] when the directory cannot be made.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        FileStore::make(dir.into(), None)
    }

    /// A store in directory `dir` that holds at most `bytes` bytes.
    ///
    /// # Errors
    /// [`Error::Store`] when the directory cannot be made.
    pub fn with_capacity(dir: impl Into<PathBuf>, bytes: u64) -> Result<FileStore> {
        FileStore::make(dir.into(), Some(bytes))
    }

    fn make(dir: PathBuf, capacity: Option<u64>) -> Result<FileStore> {
        std::fs::create_dir_all(&dir).map_err(|e| io("making", &dir, e))?;
        sweep(&dir);
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let next = AtomicU64::new(stamp.as_nanos() as u64 & 0xffff_ffff_ffff);
        Ok(FileStore { dir, ledger: Ledger::new(capacity), next })
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes held and reserved.
    pub fn used(&self) -> u64 {
        self.ledger.used()
    }

    /// Releases object `id` and keeps its file, moved to `to` (on the store's file
    /// system); the object's file, or `None` when the store does not hold `id` in a file.
    ///
    /// # Errors
    /// [`Error::Store`] when the file cannot be moved (the object stays held).
    pub fn persist(&self, id: &ObjectId, to: &Path) -> Result<Option<PathBuf>> {
        let Some(o) = self.ledger.get(id) else { return Ok(None) };
        let Some(f) = o.file() else { return Ok(None) };
        std::fs::rename(f.path(), to).map_err(|e| io("moving", f.path(), e))?;
        f.keep();
        self.ledger.release(id);
        Ok(Some(to.to_path_buf()))
    }
}

/// Removes the object files in `dir` whose process is gone (`<id>.<pid>.<n>.obj`).
fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".obj") else { continue };
        let Some(pid) = stem.split('.').nth(1).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl ObjectStore for FileStore {
    crate::store::ledger_methods!();

    fn file_for(&self, id: &ObjectId, size: u64) -> Result<Option<ObjectFile>> {
        let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        ObjectFile::create(self.dir.join(format!("{hex}.{}.{n}.obj", std::process::id())), size).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sums::Layout;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ucxkit-objects-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn files_are_sparse_read_back_and_removed_unless_kept() {
        let d = dir("files");
        std::fs::create_dir_all(&d).unwrap();
        let f = ObjectFile::create(d.join("a"), 1 << 20).unwrap();
        let mut data = vec![0u8; 300_000];
        data[200_000] = 7;
        f.write_at(1000, &data).unwrap();
        assert_eq!(f.read(1000..301_000).unwrap(), data);
        assert_eq!(f.read(201_000..201_001).unwrap(), [7]);
        assert!(f.read(0..(2 << 20)).is_err(), "past the end");
        // Only the 64 KiB run holding the 7 took blocks.
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(f.path()).unwrap().blocks();
        assert!(blocks * 512 <= 128 << 10, "{blocks} blocks");
        assert!(ObjectFile::create(d.join("a"), 1).is_err(), "exists");
        let path = f.path().to_path_buf();
        drop(f);
        assert!(!path.exists(), "removed");
        let kept = ObjectFile::create(d.join("b"), 10).unwrap();
        kept.keep();
        drop(kept);
        let opened = ObjectFile::open(d.join("b")).unwrap();
        assert_eq!((opened.len(), opened.read(0..10).unwrap()), (10, vec![0; 10]));
        drop(opened);
        assert!(d.join("b").exists(), "an opened file is kept");
        assert!(ObjectFile::open(d.join("none")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_store_makes_files_within_its_capacity_and_persists_them() {
        let d = dir("store");
        let s = FileStore::with_capacity(&d, 10_000).unwrap();
        let id = ObjectId::new(b"x/1").unwrap();
        s.reserve(&id, 6000).unwrap();
        assert!(matches!(s.reserve(&ObjectId::new(b"y").unwrap(), 6000), Err(Error::NoRoom(_))));
        let f = s.file_for(&id, 6000).unwrap().unwrap();
        assert!(
            f.path().starts_with(&d)
                && f.path().file_name().unwrap().to_string_lossy().starts_with("782f31.")
        );
        // A file a gone process left is swept when a store opens the directory; this
        // process's are not.
        let stale = d.join("aa.4000000000.1.obj");
        std::fs::write(&stale, b"old").unwrap();
        drop(FileStore::new(&d).unwrap());
        assert!(!stale.exists() && f.path().exists());
        f.write_at(0, &[5; 6000]).unwrap();
        let layout = Layout::from_parts(6000, 4096, vec![0, 0]).unwrap();
        s.seal(id, Object::in_file(f, layout).unwrap()).unwrap();
        let o = s.get(&id).unwrap();
        assert_eq!((o.bytes(), o.read(5990..6000).unwrap().to_vec()), (None, vec![5; 10]));
        assert!(o.read(5990..6001).is_err());
        let to = d.join("kept");
        assert_eq!(s.persist(&id, &to).unwrap(), Some(to.clone()));
        drop(o);
        assert_eq!(std::fs::read(&to).unwrap(), vec![5; 6000]);
        assert_eq!(s.used(), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
