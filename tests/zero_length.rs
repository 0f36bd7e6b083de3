//! Empty buffers on every operation, between two processes: each completes (or fails
//! with a clear error), and neither process dies. UCX 1.13 asserts on some of them (an
//! empty stream send aborted the peer), so ucxkit must keep such calls from UCX.
//!
//! The peer is this test binary itself, re-run with `UCXKIT_ZL_CONNECT` set so that only
//! the ignored `zero_length_peer` test runs. It connects, registers a region and sends
//! its key, sends empty messages of every kind the other way and receives the test's
//! into empty buffers, then waits for `DONE` and answers `ALIVE` with the number of
//! active messages it received.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::{ctx, loopback};
use ucxkit::transport::{tag, AmProto, AmSend, AmSendOptions, Endpoint};

const T: Duration = Duration::from_secs(20);

const KEY: u64 = 1;
const EMPTY: u64 = 2;
const EMPTY_IOV: u64 = 3;
const DONE: u64 = 4;
const ALIVE: u64 = 5;
const AM_ID: u16 = 7;

/// What the peer sends towards the test, all empty: two tag messages, an eager and a
/// rendezvous active message, and a stream send. The active messages' sends are handed
/// back unawaited: a rendezvous send completes only once the receiver fetched it.
async fn send_empties(ep: &Endpoint) -> Vec<AmSend<Vec<u8>>> {
    ep.tag_send(EMPTY, Vec::new()).await.0.unwrap();
    ep.tag_send_iov(EMPTY_IOV, Vec::<Vec<u8>>::new()).await.0.unwrap();
    ep.stream_send(Vec::new()).await.0.unwrap();
    [AmProto::Eager, AmProto::Rendezvous, AmProto::Auto]
        .into_iter()
        .map(|proto| ep.am_send_with(AM_ID, &[], Vec::new(), AmSendOptions { proto, reply: false }))
        .collect()
}

async fn all_sent(sends: Vec<AmSend<Vec<u8>>>) {
    for s in sends {
        tokio::time::timeout(T, s).await.expect("an empty active message is sent").0.unwrap();
    }
}

#[tokio::test]
#[ignore = "the child half of the zero-length tests; the parent runs it"]
async fn zero_length_peer() {
    let Ok(addr) = std::env::var("UCXKIT_ZL_CONNECT") else { return };
    let tls = std::env::var("UCXKIT_ZL_TLS").unwrap();
    let w = ctx(&tls).create_worker().unwrap();
    let mut rx = w.am_recv(AM_ID).unwrap();
    let ep = w.connect(addr.parse().unwrap()).await.unwrap();
    let region = w.context().alloc(4096).unwrap();
    ep.tag_send(KEY, region.pack_key().unwrap()).await.0.unwrap();
    let sends = send_empties(&ep).await;
    // The other side's empty tag messages, into empty buffers.
    for t in [EMPTY, EMPTY_IOV, EMPTY + 100, EMPTY + 100] {
        let (r, _) = ep.tag_recv(t, tag::EXACT, Vec::new()).await;
        assert_eq!(r.unwrap().len, 0);
    }
    let done = w.tag_recv(DONE, tag::EXACT, Vec::new());
    let mut ams = 0u64;
    tokio::pin!(done);
    loop {
        tokio::select! {
            (r, _) = &mut done => { r.unwrap(); break; }
            m = rx.recv() => {
                let (r, _) = m.recv_data(Vec::new()).await;
                r.unwrap();
                ams += 1;
            }
        }
    }
    while let Some(m) = rx.try_recv() {
        m.recv_data(Vec::new()).await.0.unwrap();
        ams += 1;
    }
    all_sent(sends).await;
    ep.tag_send(ALIVE, ams.to_le_bytes().to_vec()).await.0.unwrap();
    ep.close().await.unwrap();
}

/// Every operation with an empty buffer towards a peer process that posted nothing for
/// them (the case that made UCX abort), and every receive with an empty buffer for the
/// peer's empty messages.
async fn empty_everything(tls: &str) {
    let w = ctx(tls).create_worker().unwrap();
    let mut rx = w.am_recv(AM_ID).unwrap();
    let listener = w.listen(loopback()).unwrap();
    let child = common::procs::command("zero_length_peer", &[])
        .env("UCXKIT_ZL_CONNECT", listener.local_addr().to_string())
        .env("UCXKIT_ZL_TLS", tls)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ep = tokio::time::timeout(T, listener.accept()).await.unwrap().unwrap();
    let (r, packed) = w.tag_recv(KEY, tag::EXACT, Vec::with_capacity(4096)).await;
    r.unwrap();
    let key = ep.unpack_key(&packed).unwrap();

    // Sends of every kind, empty.
    let sends = send_empties(&ep).await;
    // The sends that complete at once or not at all: the owned call when they did not.
    if !ep.try_tag_send(EMPTY + 100, &[]).unwrap() {
        ep.tag_send(EMPTY + 100, Vec::new()).await.0.unwrap();
    }
    if !ep.try_am_send(AM_ID, &[], &[]).unwrap() {
        ep.am_send(AM_ID, &[], Vec::new()).await.0.unwrap();
    }
    ep.am_send(AM_ID, b"header only", Vec::new()).await.0.unwrap();
    ep.tag_send_iov(EMPTY + 100, vec![Vec::new(), Vec::new()]).await.0.unwrap();
    // One-sided operations of no bytes, at the region's start and end.
    for off in [0, 4096] {
        tokio::time::timeout(T, ep.put(Vec::new(), &key, off)).await.unwrap().0.unwrap();
        let (r, got) = tokio::time::timeout(T, ep.get(Vec::new(), 0, &key, off)).await.unwrap();
        r.unwrap();
        assert!(got.is_empty());
        if !ep.try_put(&[], &key, off).unwrap() {
            tokio::time::timeout(T, ep.put(Vec::new(), &key, off)).await.unwrap().0.unwrap();
        }
        tokio::time::timeout(T, ep.put_iov(Vec::<Vec<u8>>::new(), &key, off)).await.unwrap().0.unwrap();
        tokio::time::timeout(T, ep.put_iov(vec![Vec::new()], &key, off)).await.unwrap().0.unwrap();
    }
    tokio::time::timeout(T, ep.flush()).await.unwrap().unwrap();

    // Receives of the peer's empty messages into empty buffers.
    let (r, b) = tokio::time::timeout(T, ep.tag_recv(EMPTY, tag::EXACT, Vec::new())).await.unwrap();
    assert_eq!(r.unwrap().len, 0);
    assert!(b.is_empty());
    let (r, _) =
        tokio::time::timeout(T, ep.tag_recv_iov(EMPTY_IOV, tag::EXACT, Vec::<Vec<u8>>::new())).await.unwrap();
    assert_eq!(r.unwrap().len, 0);
    for _ in 0..3 {
        let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
        assert_eq!(m.len(), 0);
        let (r, _) = m.recv_data(Vec::new()).await;
        r.unwrap();
    }
    all_sent(sends).await;
    // An empty stream receive returns at once, without waiting for bytes.
    let (r, _) = tokio::time::timeout(T, ep.stream_recv(Vec::new())).await.unwrap();
    assert_eq!(r.unwrap(), 0);

    // Empty memory.
    for region in [w.context().register(Vec::new()), w.context().alloc(0)] {
        match region {
            Ok(r) => {
                assert!(r.is_empty());
                // Taken as an empty key, or refused with an error.
                match ep.unpack_key(&r.pack_key().unwrap()) {
                    Ok(k) => assert_eq!(k.len(), 0),
                    Err(e) => eprintln!("{tls}: the key of an empty region is refused: {e}"),
                }
            }
            Err(e) => eprintln!("{tls}: an empty region is refused: {e}"),
        }
    }

    // The peer lives: it answers, having received every active message sent to it.
    let alive = w.tag_recv(ALIVE, tag::EXACT, vec![0u8; 8]);
    ep.tag_send(DONE, Vec::new()).await.0.unwrap();
    let (r, n) = tokio::time::timeout(T, alive).await.expect("the peer answers DONE");
    r.unwrap();
    assert_eq!(u64::from_le_bytes(n[..8].try_into().unwrap()), 5, "active messages the peer received");
    let out = tokio::time::timeout(T, child.wait_with_output()).await.unwrap().unwrap();
    // UCX logs to standard output.
    let err = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{tls}: the peer process ended with {}: {err}", out.status);
    // UCX complains of nothing (a descriptor of an empty rendezvous message, say, that
    // was never given back).
    assert!(!err.contains("UCX  WARN") && !err.contains("UCX  ERROR"), "{tls}: {err}");
    drop(ep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_buffers_over_tcp() {
    empty_everything("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_buffers_over_shared_memory() {
    empty_everything("posix,cma,tcp,self").await;
}
