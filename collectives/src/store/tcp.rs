//! [`TcpStoreServer`], the store one rank serves, and [`TcpStore`], every rank's client
//! of it. The server bounds what a client can make it hold ([`MAX_TOTAL`] bytes, at
//! most [`MAX_CONNECTIONS`] connections) and closes a connection that sends anything
//! malformed: it faces the network.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{Notify, Semaphore};

use super::wire::{self, Msg};
use super::{check, missing, Store, StoreFuture};
use crate::error::{Error, Result};

/// The most bytes of keys and values a server holds.
pub const MAX_TOTAL: usize = 1 << 30;
/// The most client connections a server serves at once.
pub const MAX_CONNECTIONS: usize = 4096;

#[derive(Default)]
struct Table {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
}

#[derive(Default)]
struct Shared {
    table: Mutex<Table>,
    changed: Notify,
}

impl Shared {
    fn set(&self, k: String, v: Vec<u8>) -> Msg {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let old = t.map.get(&k).map_or(0, |o| k.len() + o.len());
        let bytes = t.bytes - old + k.len() + v.len();
        if bytes > MAX_TOTAL {
            return Msg::Refused(format!("the store holds at most {MAX_TOTAL} bytes"));
        }
        t.bytes = bytes;
        t.map.insert(k, v);
        drop(t);
        self.changed.notify_waiters();
        Msg::Ok
    }

    fn add(&self, k: String, d: i64) -> Msg {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = match t.map.get(&k) {
            None => 0,
            Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => i64::from_le_bytes(b),
                Err(_) => return Msg::Refused(format!("{k} does not hold a counter")),
            },
        };
        let new = cur.wrapping_add(d);
        if !t.map.contains_key(&k) {
            t.bytes += k.len() + 8;
        }
        t.map.insert(k, new.to_le_bytes().to_vec());
        drop(t);
        self.changed.notify_waiters();
        Msg::Int(new)
    }

    /// The values of `keys`, or the ones missing.
    fn lookup(&self, keys: &[String]) -> std::result::Result<Vec<Vec<u8>>, Vec<String>> {
        let t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let missing: Vec<String> = keys.iter().filter(|k| !t.map.contains_key(*k)).cloned().collect();
        if !missing.is_empty() {
            return Err(missing);
        }
        Ok(keys.iter().map(|k| t.map[k].clone()).collect())
    }

    async fn wait(&self, keys: Vec<String>, timeout: Duration) -> Msg {
        let end = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.lookup(&keys) {
                Ok(v) => return Msg::Values(v),
                Err(m) if Instant::now() >= end => return Msg::Missing(m),
                Err(_) => {}
            }
            let _ = tokio::time::timeout_at(end.into(), notified).await;
        }
    }
}

/// The store served over TCP (by rank 0 in [`crate::Communicator::init`]). Serves
/// until dropped.
pub struct TcpStoreServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TcpStoreServer {
    /// Serves on `addr` (port 0 picks a free port: see [`TcpStoreServer::local_addr`]).
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when the address cannot be bound.
    pub async fn bind(addr: impl ToSocketAddrs) -> Result<TcpStoreServer> {
        let listener =
            TcpListener::bind(addr).await.map_err(|e| Error::Bootstrap(format!("serving the store: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::Bootstrap(e.to_string()))?;
        let shared = Arc::new(Shared::default());
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else { continue };
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    drop(conn);
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    serve(conn, &shared).await;
                    drop(permit);
                });
            }
        });
        Ok(TcpStoreServer { addr, task })
    }

    /// The address it serves on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Answers one connection's requests until it closes or sends something malformed.
async fn serve(mut conn: TcpStream, shared: &Shared) {
    let _ = conn.set_nodelay(true);
    while let Ok(req) = wire::recv(&mut conn).await {
        let reply = match req {
            Msg::Set(k, v) => shared.set(k, v),
            Msg::Get(k) => {
                Msg::Value(shared.table.lock().unwrap_or_else(PoisonError::into_inner).map.get(&k).cloned())
            }
            Msg::Wait(ms, keys) => shared.wait(keys, Duration::from_millis(ms)).await,
            Msg::Add(k, d) => shared.add(k, d),
            _ => return,
        };
        if wire::send(&mut conn, &reply).await.is_err() {
            return;
        }
    }
}

/// A client of a [`TcpStoreServer`]. A call that fails or runs out of time drops its
/// connection (an answer arriving late must not be read as the next call's) and the next
/// call connects again.
pub struct TcpStore {
    conn: tokio::sync::Mutex<Option<TcpStream>>,
    addr: String,
}

/// How much longer than a wait's own timeout a client waits for the server's answer.
const SERVER_GRACE: Duration = Duration::from_secs(5);
/// How long a client waits for any other answer.
const CALL_LIMIT: Duration = Duration::from_secs(30);

impl TcpStore {
    /// Connects to the server at `addr`, trying again until `timeout` passes (the server
    /// may not be up yet).
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when no connection was made in time.
    pub async fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        let conn = Self::open(addr, timeout).await?;
        Ok(TcpStore { conn: tokio::sync::Mutex::new(Some(conn)), addr: addr.to_string() })
    }

    /// A connection to `addr`, tried again until `timeout` passes.
    async fn open(addr: &str, timeout: Duration) -> Result<TcpStream> {
        let end = Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(end.into(), TcpStream::connect(addr)).await {
                Ok(Ok(conn)) => {
                    let _ = conn.set_nodelay(true);
                    return Ok(conn);
                }
                Ok(Err(e)) if Instant::now() + Duration::from_millis(50) >= end => {
                    return Err(Error::Bootstrap(format!(
                        "the store at {addr} did not answer in {timeout:?}: {e}"
                    )))
                }
                Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(_) => {
                    return Err(Error::Bootstrap(format!(
                        "the store at {addr} did not answer in {timeout:?}"
                    )))
                }
            }
        }
    }

    async fn call(&self, req: Msg, limit: Duration) -> Result<Msg> {
        let mut slot = self.conn.lock().await;
        // Taken out for the call and put back only after a whole answer: a call that
        // fails, times out or is dropped leaves no connection with a stray answer in it.
        // One limit for the whole call, reconnecting included.
        let end = Instant::now() + limit;
        let mut conn = match slot.take() {
            Some(c) => c,
            None => Self::open(&self.addr, limit).await?,
        };
        let io = async {
            wire::send(&mut conn, &req).await?;
            wire::recv(&mut conn).await
        };
        let r = tokio::time::timeout_at(end.into(), io).await;
        if matches!(r, Ok(Ok(_))) {
            *slot = Some(conn);
        }
        match r {
            Ok(Ok(Msg::Refused(why))) => {
                Err(Error::Bootstrap(format!("the store at {} refused: {why}", self.addr)))
            }
            Ok(Ok(m)) => Ok(m),
            Ok(Err(e)) => Err(Error::Bootstrap(format!("the store at {}: {e}", self.addr))),
            Err(_) => {
                Err(Error::Bootstrap(format!("the store at {} did not answer in {limit:?}", self.addr)))
            }
        }
    }
}

fn unexpected(m: Msg) -> Error {
    Error::Bootstrap(format!("unexpected answer from the store: {m:?}"))
}

impl Store for TcpStore {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            check(key, Some(value))?;
            match self.call(Msg::Set(key.into(), value.to_vec()), CALL_LIMIT).await? {
                Msg::Ok => Ok(()),
                m => Err(unexpected(m)),
            }
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Vec<u8>>> {
        Box::pin(async move {
            check(key, None)?;
            match self.call(Msg::Get(key.into()), CALL_LIMIT).await? {
                Msg::Value(v) => Ok(v),
                m => Err(unexpected(m)),
            }
        })
    }

    fn wait<'a>(&'a self, keys: &'a [String], timeout: Duration) -> StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async move {
            for k in keys {
                check(k, None)?;
            }
            let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
            match self.call(Msg::Wait(ms, keys.to_vec()), timeout.saturating_add(SERVER_GRACE)).await? {
                Msg::Values(v) if v.len() == keys.len() => Ok(v),
                Msg::Missing(m) => Err(missing(&m.iter().map(String::as_str).collect::<Vec<_>>(), timeout)),
                m => Err(unexpected(m)),
            }
        })
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        Box::pin(async move {
            check(key, None)?;
            match self.call(Msg::Add(key.into(), delta), CALL_LIMIT).await? {
                Msg::Int(n) => Ok(n),
                m => Err(unexpected(m)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn set_get_wait_add_through_the_server() {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.expect("bind");
        let addr = server.local_addr().to_string();
        let a = TcpStore::connect(&addr, Duration::from_secs(5)).await.expect("connect");
        let b = TcpStore::connect(&addr, Duration::from_secs(5)).await.expect("connect");
        assert_eq!(a.get("x").await.expect("get"), None);
        let keys = vec!["x".to_string(), "y".to_string()];
        let waiter = tokio::spawn(async move { b.wait(&keys, Duration::from_secs(10)).await });
        a.set("x", b"1").await.expect("set");
        a.set("y", b"22").await.expect("set");
        assert_eq!(waiter.await.expect("join").expect("wait"), vec![b"1".to_vec(), b"22".to_vec()]);
        assert_eq!(a.add("n", 5).await.expect("add"), 5);
        assert_eq!(a.add("n", -7).await.expect("add"), -2);
        assert!(a.add("x", 1).await.is_err(), "not a counter");
        let err =
            a.wait(&["x".into(), "never".into()], Duration::from_millis(100)).await.expect_err("missing");
        assert!(err.to_string().contains("never") && !err.to_string().contains("x,"), "{err}");
        assert!(a.set("", b"").await.is_err());
    }

    /// A call that ran out of time does not read its late answer as the next call's: the
    /// client connects again. The server here answers the first request after the
    /// client gave up, the next ones at once.
    #[tokio::test]
    async fn a_late_answer_is_not_taken_for_the_next_one() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            let mut first = true;
            loop {
                let Ok((mut c, _)) = listener.accept().await else { return };
                let slow = std::mem::take(&mut first);
                tokio::spawn(async move {
                    while let Ok(m) = wire::recv(&mut c).await {
                        if slow {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                        let key = match m {
                            Msg::Get(k) => k,
                            _ => return,
                        };
                        if wire::send(&mut c, &Msg::Value(Some(key.into_bytes()))).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).await.expect("connect");
        let late = store.call(Msg::Get("first".into()), Duration::from_millis(100)).await;
        assert!(late.expect_err("too slow").to_string().contains("did not answer"));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(store.get("second").await.expect("get"), Some(b"second".to_vec()));
    }

    #[tokio::test]
    async fn garbage_closes_only_its_connection() {
        use tokio::io::AsyncWriteExt;
        let server = TcpStoreServer::bind("127.0.0.1:0").await.expect("bind");
        let addr = server.local_addr();
        for junk in [&b"\xff\xff\xff\xff"[..], b"\x03\0\0\0Zab", b"\x05\0\0\0G\xff\xff\xff\xff"] {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(junk).await.expect("write");
            let mut buf = [0u8; 1];
            let n =
                tokio::time::timeout(Duration::from_secs(5), tokio::io::AsyncReadExt::read(&mut c, &mut buf))
                    .await
                    .expect("closed in time")
                    .unwrap_or(0);
            assert_eq!(n, 0, "the server closed the connection");
        }
        let ok = TcpStore::connect(&addr.to_string(), Duration::from_secs(5)).await.expect("connect");
        ok.set("k", b"v").await.expect("still serving");
    }

    #[tokio::test]
    async fn connecting_to_nobody_gives_up_in_time() {
        let t = Instant::now();
        assert!(TcpStore::connect("127.0.0.1:1", Duration::from_millis(300)).await.is_err());
        assert!(t.elapsed() < Duration::from_secs(3));
    }
}
