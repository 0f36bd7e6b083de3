//! Connections made and closed again and again through one listener leave nothing behind:
//! the process's file descriptors stay level. Over shared memory this needs the
//! connecting side to let the accepting side close first (`Endpoint::close`, and the
//! background close of a dropped endpoint): when the connecting side disconnects first,
//! UCX keeps one socket of the connecting worker open per connection.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::{ctx, loopback, wait_parked_zero};
use ucxkit::transport::tag;

const T: Duration = Duration::from_secs(20);

/// One test at a time: descriptors are counted for the whole process.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Open file descriptors of this process.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// How the connecting side ends each connection.
#[derive(Clone, Copy)]
enum End {
    /// `Endpoint::close().await`.
    Close,
    /// The endpoint dropped.
    Drop,
}

/// `rounds` connections, each carrying one message, ended by the connecting side (which
/// lets the peer go first) as `end` says, after some warm-up rounds; returns how many
/// descriptors the rounds left open.
async fn churn(tls: &str, rounds: u64, end: End) -> usize {
    let _serial = SERIAL.lock().await;
    let c = ctx(tls);
    let server = c.create_worker().unwrap();
    let client = c.create_worker().unwrap();
    let listener = server.listen(loopback()).unwrap();
    let addr = listener.local_addr();
    let mut before = 0;
    for i in 0..rounds + 10 {
        if i == 10 {
            before = fds();
        }
        let (a, b) = tokio::time::timeout(T, async { tokio::join!(listener.accept(), client.connect(addr)) })
            .await
            .expect("connecting in time");
        let (a, b) = (a.unwrap(), b.unwrap());
        let recv = server.tag_recv(i, tag::EXACT, Vec::with_capacity(64));
        b.tag_send(i, vec![7u8; 64]).await.0.unwrap();
        let (r, _) = tokio::time::timeout(T, recv).await.unwrap();
        r.unwrap();
        match end {
            End::Close => tokio::time::timeout(T, b.close()).await.expect("closing in time").unwrap(),
            End::Drop => drop(b),
        }
        // The accepting side was closed at the peer's request: its endpoint has failed.
        tokio::time::timeout(T, a.failed()).await.expect("the accepting side sees the close");
        drop(a);
        // A dropped endpoint stays with its worker until the peer's close reaches it.
        wait_parked_zero(&client, T).await;
    }
    fds().saturating_sub(before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_leave_no_descriptors_shm() {
    let left = churn("posix,cma,tcp,self", 60, End::Close).await;
    assert!(left <= 5, "60 connections over shared memory left {left} descriptors open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_leave_no_descriptors_shm() {
    let left = churn("posix,cma,tcp,self", 60, End::Drop).await;
    assert!(left <= 5, "60 dropped connections over shared memory left {left} descriptors open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_leave_no_descriptors_tcp() {
    let left = churn("tcp,self", 60, End::Close).await;
    assert!(left <= 5, "60 connections over TCP left {left} descriptors open");
}
