//! `Worker::shutdown`: listeners and endpoints closed, peers told, the worker refusing
//! new connections through its other handles, and the whole bounded by its limit even
//! when a peer never takes what was sent to it.

#![deny(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::{loopback, pair, pair_with, payload};
use ucxkit::transport::{tag, ErrorKind, ErrorMode, ProgressMode};

const T: Duration = Duration::from_secs(20);

async fn closes_everything(tls: &str) {
    let (s, c, sep, cep) = pair(tls).await;
    let listener = s.listen(loopback()).unwrap();
    let addr = listener.local_addr();
    let keep = s.clone();
    // Pending on the client: a receive bound to its endpoint; on the server, one bound
    // to the worker.
    let bound = cep.tag_recv(1, tag::EXACT, vec![0u8; 16]);
    let unbound = s.tag_recv(2, tag::EXACT, vec![0u8; 16]);
    // Sent before the shutdown: arrives.
    let (r, _) = sep.tag_send(3, b"before".to_vec()).await;
    r.unwrap();
    tokio::time::timeout(T, s.shutdown(Duration::from_secs(10))).await.unwrap().unwrap();
    let (info, got) = tokio::time::timeout(T, cep.tag_recv(3, tag::EXACT, vec![0u8; 16])).await.unwrap();
    assert_eq!((info.unwrap().len, got), (6, b"before".to_vec()));
    // The client's receive on the endpoint ends: the peer closed it.
    let (r, _) = tokio::time::timeout(T, bound).await.unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{tls}");
    // The server's endpoint is closed, its listener too; its other handles cannot make
    // new ones.
    let (r, _) = sep.tag_send(4, b"after".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(listener.accept().await.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(c.connect(addr).await.is_err(), "connected to a closed listener");
    assert_eq!(keep.listen(loopback()).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(keep.connect(addr).await.unwrap_err().kind(), ErrorKind::InvalidInput);
    // A receive on the worker itself is not the shutdown's to end: it goes when dropped.
    drop(unbound);
    drop((keep, sep, listener));
    common::wait_parked_zero(&c, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_everything_tcp() {
    closes_everything("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_everything_shared_memory() {
    closes_everything("posix,cma,tcp,self").await;
}

/// Large sends the peer never receives: the shutdown ends within its limit (done, or
/// reporting a timeout), in both error modes, with the peer alive and progressing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_by_its_limit() {
    for mode in [ErrorMode::Peer, ErrorMode::None] {
        let (s, _c, sep, _cep) = pair_with("tcp,self", mode, ProgressMode::Event).await;
        let sends: Vec<_> = (0..4).map(|i| sep.tag_send(50 + i, payload(i, 4 << 20))).collect();
        drop(sep);
        let limit = Duration::from_secs(2);
        let started = std::time::Instant::now();
        let r = tokio::time::timeout(limit + Duration::from_secs(10), s.shutdown(limit))
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: the shutdown overran its limit by 10 s"));
        if let Err(e) = r {
            assert_eq!(e.kind(), ErrorKind::Timeout, "{mode:?}: {e}");
        }
        eprintln!("{mode:?}: shutdown in {:?}", started.elapsed());
        for (i, f) in sends.into_iter().enumerate() {
            // The close through the peer ended them: sent (the peer took them in while
            // it closed) or failed by the close.
            assert!(
                tokio::time::timeout(T, f).await.is_ok(),
                "{mode:?}: send {i} still pending after the shutdown"
            );
        }
    }
}

/// A worker with nothing open shuts down at once and is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_shuts_down() {
    let c = common::ctx("tcp,self");
    let w = c.create_worker().unwrap();
    let l = w.listen(loopback()).unwrap();
    w.shutdown(Duration::from_secs(5)).await.unwrap();
    assert_eq!(l.accept().await.unwrap_err().kind(), ErrorKind::InvalidInput);
}

/// A plain UCX listener's request taken before the shutdown stays usable after it (the
/// UCX listener lives until its last handle goes): rejecting it refuses the client, and
/// the listener takes no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_taken_before_the_shutdown_can_still_be_rejected() {
    let c = common::ctx("tcp,self");
    let (s, cw) = (c.create_worker().unwrap(), c.create_worker().unwrap());
    let plain = ucxkit::transport::EndpointOptions { handshake: false, ..Default::default() };
    let l = s.listen_with(loopback(), plain.clone()).unwrap();
    let addr = l.local_addr();
    let connect = tokio::spawn(async move { cw.connect_with(addr, plain).await.map(drop) });
    let req = tokio::time::timeout(T, l.next()).await.unwrap().unwrap();
    tokio::time::timeout(T, s.shutdown(Duration::from_secs(5))).await.unwrap().unwrap();
    req.reject();
    assert!(tokio::time::timeout(T, connect).await.unwrap().unwrap().is_err(), "the client was not refused");
    assert_eq!(l.next().await.unwrap_err().kind(), ErrorKind::InvalidInput);
}
