//! [`FileStore`]: the store as files in a directory every rank reaches (a shared file
//! system, or /tmp for ranks on one host). Each key is a file named by the key in hex,
//! written whole and renamed into place, so a reader never sees half a value.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::{check, missing, Store, StoreFuture};
use crate::error::{Error, Result};

/// The longest key a file store takes (its file name is the key in hex).
pub const MAX_FILE_KEY: usize = 120;
/// How often a wait looks for its keys.
const POLL: Duration = Duration::from_millis(5);
/// A counter's lock older than this is taken to belong to a process that died holding it.
const STALE_LOCK: Duration = Duration::from_secs(10);

/// A store in a directory.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

fn io(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::Bootstrap(format!("file store: {what} {}: {e}", p.display()))
}

impl FileStore {
    /// A store in `dir`, made if missing.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when the directory cannot be made.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| io("making", &dir, e))?;
        Ok(FileStore { dir })
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check(key, None)?;
        if key.len() > MAX_FILE_KEY {
            return Err(Error::Bootstrap(format!("file store keys are at most {MAX_FILE_KEY} bytes")));
        }
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        Ok(self.dir.join(hex))
    }

    fn write(&self, path: &Path, value: &[u8]) -> Result<()> {
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
        std::fs::write(&tmp, value).map_err(|e| io("writing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("renaming into", path, e))
    }

    fn read(path: &Path) -> Result<Option<Vec<u8>>> {
        match std::fs::read(path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", path, e)),
        }
    }

    /// Takes the lock of a counter (a file made exclusively), waiting for it.
    async fn lock(&self, path: &Path) -> Result<PathBuf> {
        let lock = path.with_extension("lock");
        let end = Instant::now() + 2 * STALE_LOCK;
        loop {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&lock) {
                Ok(_) => return Ok(lock),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let age = std::fs::metadata(&lock)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| SystemTime::now().duration_since(t).ok());
                    if age.is_some_and(|a| a > STALE_LOCK) {
                        let _ = std::fs::remove_file(&lock);
                    } else if Instant::now() >= end {
                        return Err(Error::Bootstrap(format!("file store: {} stays locked", lock.display())));
                    } else {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                Err(e) => return Err(io("locking", &lock, e)),
            }
        }
    }
}

impl Store for FileStore {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            check(key, Some(value))?;
            let p = self.path(key)?;
            self.write(&p, value)
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Vec<u8>>> {
        Box::pin(async move { FileStore::read(&self.path(key)?) })
    }

    fn wait<'a>(&'a self, keys: &'a [String], timeout: Duration) -> StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async move {
            let paths = keys.iter().map(|k| self.path(k)).collect::<Result<Vec<_>>>()?;
            let end = Instant::now() + timeout;
            loop {
                let mut values = Vec::with_capacity(keys.len());
                let mut absent = Vec::new();
                for (k, p) in keys.iter().zip(&paths) {
                    match FileStore::read(p)? {
                        Some(v) => values.push(v),
                        None => absent.push(k.as_str()),
                    }
                }
                if absent.is_empty() {
                    return Ok(values);
                }
                if Instant::now() >= end {
                    return Err(missing(&absent, timeout));
                }
                tokio::time::sleep(POLL).await;
            }
        })
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        Box::pin(async move {
            let p = self.path(key)?;
            let lock = self.lock(&p).await?;
            let r = (|| {
                let cur = match FileStore::read(&p)? {
                    None => 0,
                    Some(v) => i64::from_le_bytes(
                        v.try_into()
                            .map_err(|_| Error::Bootstrap(format!("{key} does not hold a counter")))?,
                    ),
                };
                let new = cur.wrapping_add(delta);
                self.write(&p, &new.to_le_bytes())?;
                Ok(new)
            })();
            let _ = std::fs::remove_file(&lock);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn set_get_wait_add_in_a_directory() {
        let dir = std::env::temp_dir().join(format!("ucxkit-file-store-{}", std::process::id()));
        let s = FileStore::new(&dir).expect("dir");
        assert_eq!(s.get("a/b").await.expect("get"), None);
        s.set("a/b", b"v").await.expect("set");
        assert_eq!(s.get("a/b").await.expect("get"), Some(b"v".to_vec()));
        let t = s.clone();
        let adds = (0..8).map(|_| {
            let t = t.clone();
            tokio::spawn(async move { t.add("n", 2).await })
        });
        for a in adds {
            a.await.expect("join").expect("add");
        }
        assert_eq!(s.add("n", 0).await.expect("add"), 16);
        assert_eq!(s.wait(&["a/b".into(), "n".into()], Duration::from_secs(1)).await.expect("wait").len(), 2);
        let e = s.wait(&["nope".into()], Duration::from_millis(20)).await.expect_err("missing");
        assert!(e.to_string().contains("nope"));
        assert!(s.set(&"k".repeat(MAX_FILE_KEY + 1), b"").await.is_err());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
