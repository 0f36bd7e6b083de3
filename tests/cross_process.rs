//! Streams, active messages and RMA between two processes over loopback, through a
//! listener: the peer is this test binary itself, run again by the test kit's process
//! group so that only the ignored `xp_peer` test runs in it.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use bytes::Bytes;
use common::procs::{self, Group};
use common::{ctx, loopback, payload};
use futures_util::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use ucxkit::transport::{AmSendOptions, Endpoint, UcxStream};

const T: Duration = Duration::from_secs(30);
const AM_ECHO: u16 = 20;
const AM_ECHO_BACK: u16 = 21;
const AM_KEY: u16 = 22;
const AM_CHECK: u16 = 23;
const AM_VERDICT: u16 = 24;
const REGION: usize = 1 << 20;

/// One child at a time: UCX 1.13's async thread can trip over connections dying in
/// several workers at once (see tests/peer_failure.rs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The child: serves each protocol in turn on the one endpoint it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the cross-process tests; the parent runs it"]
async fn xp_peer() {
    let Some(me) = procs::role() else { return };
    let tls = std::env::var("UCXKIT_XP_TLS").unwrap();
    let addr = String::from_utf8(me.exchange.wait("listener", T).unwrap()).unwrap();
    let w = ctx(&tls).create_worker().unwrap();
    let mut echo = w.am_recv(AM_ECHO).unwrap();
    let mut check = w.am_recv(AM_CHECK).unwrap();
    let ep = w.connect(addr.parse().unwrap()).await.unwrap();

    // 1. Stream: a framed echo (each frame reversed) until the parent ends its stream.
    let mut f = Framed::new(UcxStream::new(ep.clone()), LengthDelimitedCodec::new());
    while let Some(frame) = f.next().await {
        let mut frame = frame.unwrap();
        frame.reverse();
        f.send(frame.freeze()).await.unwrap();
    }
    f.get_mut().shutdown().await.unwrap();

    // 2. Active messages: echo each payload back, reversed, on the reply endpoint.
    loop {
        let m = echo.recv().await;
        if m.header() == b"stop" {
            break;
        }
        let reply_ep = m.reply_endpoint().unwrap().clone();
        let (r, mut data) = m.into_vec().await;
        r.unwrap();
        data.reverse();
        reply_ep.am_send(AM_ECHO_BACK, b"", data).await.0.unwrap();
    }

    // 3. RMA: expose a region, then check what the parent wrote into it.
    let region = w.context().register(vec![0u8; REGION]).unwrap();
    ep.am_send(AM_KEY, b"", region.pack_key().unwrap()).await.0.unwrap();
    let m = check.recv().await;
    let (r, expect) = m.into_vec().await;
    r.unwrap();
    let verdict: &'static [u8] = if region.to_vec() == expect { b"same" } else { b"different" };
    ep.am_send(AM_VERDICT, b"", verdict).await.0.unwrap();
    // Until the parent closes: a receive bound to the endpoint ends then.
    let (r, _) =
        tokio::time::timeout(T, ep.tag_recv(999, ucxkit::transport::tag::EXACT, Vec::new())).await.unwrap();
    assert_eq!(r.unwrap_err().kind(), ucxkit::transport::ErrorKind::ConnectionReset);
}

async fn cross_process(tls: &str) {
    let _serial = SERIAL.lock().await;
    let w = ctx(tls).create_worker().unwrap();
    let mut echo_back = w.am_recv(AM_ECHO_BACK).unwrap();
    let mut key_rx = w.am_recv(AM_KEY).unwrap();
    let mut verdict_rx = w.am_recv(AM_VERDICT).unwrap();
    let listener = w.listen(loopback()).unwrap();
    let (group, me) = Group::spawn("xp_peer", 2, &[("UCXKIT_XP_TLS", tls)]);
    me.exchange.publish("listener", listener.local_addr().to_string().as_bytes());
    let ep: Endpoint = tokio::time::timeout(T, listener.accept()).await.unwrap().unwrap();

    // 1. Stream.
    let mut f = Framed::new(UcxStream::new(ep.clone()), LengthDelimitedCodec::new());
    for i in 0..60u64 {
        let p = payload(i, [0usize, 3, 5000, 100_000, 1 << 20][i as usize % 5]);
        f.send(Bytes::from(p.clone())).await.unwrap();
        let back = tokio::time::timeout(T, f.next()).await.unwrap().unwrap().unwrap();
        let mut expect = p;
        expect.reverse();
        assert!(back[..] == expect[..], "{tls}: frame {i} differs");
    }
    f.get_mut().shutdown().await.unwrap();
    assert!(tokio::time::timeout(T, f.next()).await.unwrap().is_none(), "{tls}: the child ended its stream");

    // 2. Active messages, eager and rendezvous.
    for (i, len) in [0usize, 10, 8000, 64 * 1024, 3 << 20].into_iter().enumerate() {
        let p = payload(100 + i as u64, len);
        let send =
            ep.am_send_with(AM_ECHO, b"", p.clone(), AmSendOptions { reply: true, ..Default::default() });
        let m = tokio::time::timeout(T, echo_back.recv()).await.unwrap();
        let (r, back) = m.into_vec().await;
        r.unwrap();
        send.await.0.unwrap();
        let mut expect = p;
        expect.reverse();
        assert!(back == expect, "{tls}: AM echo of {len} bytes differs");
    }
    ep.am_send(AM_ECHO, b"stop", Vec::new()).await.0.unwrap();

    // 3. RMA into the child's memory.
    let m = tokio::time::timeout(T, key_rx.recv()).await.unwrap();
    let (r, packed) = m.into_vec().await;
    r.unwrap();
    let key = ep.unpack_key(&packed).unwrap();
    assert_eq!(key.len(), REGION as u64);
    let data = payload(7, REGION - 4096);
    let (r, _) = tokio::time::timeout(T, ep.put(data.clone(), &key, 4096)).await.unwrap();
    r.unwrap();
    ep.flush().await.unwrap();
    let (r, got) =
        tokio::time::timeout(T, ep.get(Vec::with_capacity(REGION - 4096), REGION - 4096, &key, 4096))
            .await
            .unwrap();
    r.unwrap();
    assert!(got == data, "{tls}: get differs from put");
    let mut expect = vec![0u8; REGION];
    // UCX 1.16 and later have no remote atomics over TCP in peer error mode, which the
    // default error mode picks over TCP (see tests/rma.rs).
    let atomics =
        common::tcp_atomics_in_peer_mode() || !(tls.starts_with("tcp") && ep.uses_peer_error_mode());
    if atomics {
        assert_eq!(ep.atomic_fetch_add(&key, 0, 5).await.unwrap(), 0);
        assert_eq!(ep.atomic_fetch_add(&key, 0, 5).await.unwrap(), 5);
        assert_eq!(ep.atomic_compare_swap(&key, 8, 0, 99).await.unwrap(), 0);
        assert_eq!(ep.atomic_swap(&key, 8, 1234).await.unwrap(), 99);
        expect[0..8].copy_from_slice(&10u64.to_le_bytes());
        expect[8..16].copy_from_slice(&1234u64.to_le_bytes());
    }
    ep.flush().await.unwrap();
    expect[4096..].copy_from_slice(&data);
    ep.am_send(AM_CHECK, b"", expect).await.0.unwrap();
    let m = tokio::time::timeout(T, verdict_rx.recv()).await.unwrap();
    assert_eq!(m.data().unwrap(), b"same", "{tls}: the child's region holds what was written");

    drop(key);
    ep.close().await.unwrap();
    group.wait(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_tcp() {
    cross_process("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_shm() {
    cross_process("posix,cma,tcp,self").await;
}
