//! Key-value stores that ranks meet through before they have endpoints (Gloo's shape):
//! `set`, `get`, `wait` for keys with a timeout, and an atomic `add`. [`TcpStore`] is
//! served by one rank (rank 0 in [`crate::Communicator::init`]); [`FileStore`] lives in
//! a directory every rank can reach. The [`mod@env`] module reads the launchers' variables.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::error::Result;

pub mod env;
mod file;
mod tcp;
mod wire;

pub use file::{FileStore, MAX_FILE_KEY};
pub use tcp::{TcpStore, TcpStoreServer, MAX_CONNECTIONS, MAX_TOTAL};

/// The longest key a store takes, in bytes.
pub const MAX_KEY: usize = 1024;
/// The longest value a store takes, in bytes.
pub const MAX_VALUE: usize = 16 << 20;

/// A boxed future of a store call.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// A key-value store the ranks of a group share.
pub trait Store: Send + Sync {
    /// Sets `key` to `value` (replacing any value).
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()>;
    /// The value of `key`, if set.
    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Vec<u8>>>;
    /// The values of `keys`, once all are set; [`crate::Error::Bootstrap`] naming the
    /// keys still missing when `timeout` passes first.
    fn wait<'a>(&'a self, keys: &'a [String], timeout: Duration) -> StoreFuture<'a, Vec<Vec<u8>>>;
    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64>;
}

/// Checks a key and value against the limits.
pub(crate) fn check(key: &str, value: Option<&[u8]>) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(crate::Error::Bootstrap(format!(
            "store keys are 1 to {MAX_KEY} bytes; got {}",
            key.len()
        )));
    }
    if value.is_some_and(|v| v.len() > MAX_VALUE) {
        return Err(crate::Error::Bootstrap(format!("store values are at most {MAX_VALUE} bytes")));
    }
    Ok(())
}

/// The error for keys still missing at a wait's timeout.
pub(crate) fn missing(keys: &[&str], timeout: Duration) -> crate::Error {
    crate::Error::Bootstrap(format!("after {timeout:?} these keys were still not set: {}", keys.join(", ")))
}
