//! Tagged messaging between two workers in one process, over TCP and over shared memory,
//! through a listener and through worker addresses.

#![forbid(unsafe_code)]

use std::future::Future;
use std::time::Duration;

use ucxkit_testkit as common;

use common::{ctx, pair, pair_with, payload};
use ucxkit::transport::{tag, ErrorKind, ErrorMode, ProgressMode, Worker};

const SIZES: &[usize] = &[0, 1, 8, 93, 94, 8192, 8257, 65536, 1 << 20, 16 << 20];

async fn exchange_sizes(server: &Worker, ep: &ucxkit::transport::Endpoint) {
    for (i, &len) in SIZES.iter().enumerate() {
        let t = 0x100 + i as u64;
        let data = payload(t, len);
        let recv = server.tag_recv(t, tag::EXACT, Vec::with_capacity(len));
        let (sent, back) = ep.tag_send(t, data.clone()).await;
        sent.unwrap_or_else(|e| panic!("send {len}: {e}"));
        assert_eq!(back, data, "the send gives the buffer back");
        let (info, buf) = recv.await;
        let info = info.unwrap_or_else(|e| panic!("recv {len}: {e}"));
        assert_eq!(info.len, len);
        assert_eq!(info.sender_tag, t);
        assert!(buf == data, "payload of {len} bytes differs");
    }
}

#[tokio::test]
async fn tcp_all_sizes_both_directions() {
    let (server, client, accepted, ep) = pair("tcp,self").await;
    assert!(ep.transports().unwrap().contains(&"tcp".to_string()), "{:?}", ep.transport_info());
    exchange_sizes(&server, &ep).await;
    exchange_sizes(&client, &accepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_all_sizes_multi_thread_runtime() {
    let (server, client, accepted, ep) = pair("posix,cma,tcp,self").await;
    assert!(!ep.uses_peer_error_mode(), "loopback peers default to ErrorMode::None");
    let tls = ep.transports().unwrap();
    assert!(tls.contains(&"posix".to_string()), "shared memory expected, got {tls:?}");
    exchange_sizes(&server, &ep).await;
    exchange_sizes(&client, &accepted).await;
}

/// Eager sends (UCX asked to complete them soon) deliver every size, in order with plain
/// sends on the same tag, over shared memory and TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_sends_deliver_every_size_in_order() {
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let (server, _client, _accepted, ep) = pair(tls).await;
        let sends: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let data = payload(i as u64, len);
                if i % 2 == 0 {
                    ep.tag_send_eager(0x300, data)
                } else {
                    ep.tag_send(0x300, data)
                }
            })
            .collect();
        for (i, &len) in SIZES.iter().enumerate() {
            let (info, buf) = server.tag_recv(0x300, tag::EXACT, Vec::with_capacity(len)).await;
            assert_eq!(info.unwrap_or_else(|e| panic!("{tls} recv {len}: {e}")).len, len);
            assert!(buf == payload(i as u64, len), "{tls}: message {i} ({len} bytes) differs");
        }
        for (s, &len) in futures_join(sends).await.into_iter().zip(SIZES) {
            s.0.unwrap_or_else(|e| panic!("{tls} send {len}: {e}"));
        }
    }
}

#[tokio::test]
async fn busy_poll_mode() {
    let (server, _client, _a, ep) = pair_with("tcp,self", ErrorMode::Auto, ProgressMode::BusyPoll).await;
    exchange_sizes(&server, &ep).await;
}

/// A busy-poll worker yielding after every progress call (the least spin it takes)
/// still moves every size; the spin reads back as set, and never below one call.
#[tokio::test]
async fn busy_poll_mode_with_the_least_spin() {
    let (server, _client, _a, ep) = pair_with("tcp,self", ErrorMode::Auto, ProgressMode::BusyPoll).await;
    assert_eq!(server.busy_spin(), ucxkit::transport::DEFAULT_BUSY_SPIN);
    for w in [&server, ep.worker()] {
        w.set_busy_spin(0);
        assert_eq!(w.busy_spin(), 1);
    }
    exchange_sizes(&server, &ep).await;
}

/// Busy-poll workers that go on yielding and spinning within a poll: a poll of a receive
/// that nothing matches lasts at least the time set, and every size still moves with
/// both sides on one current-thread runtime (whose other tasks, the drivers among them,
/// wait out each such poll). The time reads back rounded up to whole microseconds, at
/// most 1 s.
#[tokio::test]
async fn busy_poll_mode_yielding_within_a_poll() {
    let (server, _client, _a, ep) = pair_with("tcp,self", ErrorMode::Auto, ProgressMode::BusyPoll).await;
    assert_eq!(server.busy_yield(), Duration::ZERO);
    for w in [&server, ep.worker()] {
        let (ns, us) = (Duration::from_nanos, Duration::from_micros);
        for (set, got) in
            [(us(5_000_000), us(1_000_000)), (ns(50_900), us(51)), (ns(1), us(1)), (ns(0), ns(0))]
        {
            w.set_busy_yield(set);
            assert_eq!(w.busy_yield(), got, "set {set:?}");
        }
        w.set_busy_spin(4);
    }
    server.set_busy_yield(Duration::from_millis(2));
    let mut never = server.tag_recv(0xdead, u64::MAX, vec![0u8; 8]);
    let mut cx = std::task::Context::from_waker(futures_util::task::noop_waker_ref());
    let polled = std::time::Instant::now();
    assert!(std::pin::Pin::new(&mut never).poll(&mut cx).is_pending());
    assert!(polled.elapsed() >= Duration::from_millis(2), "one poll took {:?}", polled.elapsed());
    drop(never);
    server.set_busy_yield(Duration::from_micros(50));
    exchange_sizes(&server, &ep).await;
}

#[tokio::test]
async fn peer_error_mode_over_tcp() {
    let (server, _client, accepted, ep) = pair_with("tcp,self", ErrorMode::Peer, ProgressMode::Event).await;
    assert!(ep.uses_peer_error_mode() && accepted.uses_peer_error_mode());
    exchange_sizes(&server, &ep).await;
}

#[tokio::test]
async fn connect_by_worker_address_and_reply() {
    let c = ctx("posix,cma,tcp,self");
    let a = c.create_worker().unwrap();
    let b = c.create_worker().unwrap();
    let addr = a.address().unwrap();
    let parsed = ucxkit::transport::WorkerAddress::from_bytes(addr.as_bytes()).unwrap();
    let b_to_a = b.connect_address(&parsed).await.unwrap();
    let a_to_b = a.connect_address(&b.address().unwrap()).await.unwrap();
    let r = a.tag_recv(7, tag::EXACT, vec![0u8; 5]);
    b_to_a.tag_send(7, b"hello".to_vec()).await.0.unwrap();
    assert_eq!(r.await.1, b"hello");
    let r = b.tag_recv(8, tag::EXACT, vec![0u8; 5]);
    a_to_b.tag_send(8, b"world".to_vec()).await.0.unwrap();
    assert_eq!(r.await.1, b"world");
    b_to_a.close().await.unwrap();
    a_to_b.close().await.unwrap();
}

#[tokio::test]
async fn thousand_concurrent_mixed_sizes() {
    let (server, _client, _accepted, ep) = pair("posix,cma,tcp,self").await;
    const N: u64 = 1000;
    let len_of = |i: u64| [0usize, 8, 200, 4096, 9000, 70_000, 300_000][(i % 7) as usize];
    // All receives and all sends outstanding at once, receives posted in reverse order.
    let recvs: Vec<_> =
        (0..N).rev().map(|i| (i, server.tag_recv(i, tag::EXACT, Vec::with_capacity(len_of(i))))).collect();
    let sends: Vec<_> = (0..N).map(|i| ep.tag_send(i, bytes::Bytes::from(payload(i, len_of(i))))).collect();
    let sends = tokio::spawn(futures_join(sends));
    for (i, r) in recvs {
        let (info, buf) = r.await;
        let info = info.unwrap();
        assert_eq!(info.sender_tag, i);
        assert!(buf == payload(i, len_of(i)), "message {i}");
    }
    for (r, _) in sends.await.unwrap() {
        r.unwrap();
    }
}

async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::with_capacity(fs.len());
    for f in fs {
        out.push(f.await);
    }
    out
}

#[tokio::test]
async fn mask_matching_and_unknown_size() {
    let (server, _client, _a, ep) = pair("tcp,self").await;
    // A receive for any tag with high byte 0x2B.
    let r = server.tag_recv(0x2B00_0000_0000_0000, 0xFF00_0000_0000_0000, vec![0u8; 16]);
    ep.tag_send(0x2B00_0000_0000_0042, b"masked".to_vec()).await.0.unwrap();
    let (info, buf) = r.await;
    assert_eq!(info.unwrap().sender_tag, 0x2B00_0000_0000_0042);
    assert_eq!(buf, b"masked");

    for len in [0usize, 10, 100_000, 3 << 20] {
        let data = payload(len as u64, len);
        // Rendezvous sends complete only once received: await the send afterwards.
        let send = ep.tag_send(99, data.clone());
        // Wait until it is visible to a probe, then receive it without knowing its size.
        let mut probed = None;
        for _ in 0..10_000 {
            probed = server.tag_probe(99, tag::EXACT);
            if probed.is_some() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(probed.map(|p| p.len), Some(len));
        let (info, buf) = server.tag_recv_any(99, tag::EXACT).await.unwrap();
        assert_eq!(info.len, len);
        assert!(buf == data);
        send.await.0.unwrap();
    }
    // recv_any posted before the send.
    let pending = tokio::spawn({
        let server = server.clone();
        async move { server.tag_recv_any(5, tag::EXACT).await }
    });
    tokio::task::yield_now().await;
    ep.tag_send(5, payload(5, 200_000)).await.0.unwrap();
    let (_, buf) = pending.await.unwrap().unwrap();
    assert!(buf == payload(5, 200_000));
}

/// A message nobody will receive, thrown away by the receiver: the sender's send ends,
/// rendezvous ones too (over TCP and shared memory), and only the messages the mask picks
/// go; the next message of the same tag is received as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discarded_messages_end_their_sends() {
    for tls in ["tcp,self", "posix,cma,tcp,self"] {
        let (server, _client, _a, ep) = pair(tls).await;
        assert_eq!(server.tag_discard(0x70, !0xf).unwrap(), 0, "nothing to throw away");
        let sends: Vec<_> = [(0x71, 8), (0x72, 1 << 20), (0x80, 64)]
            .into_iter()
            .map(|(t, len)| ep.tag_send(t, payload(t, len)))
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut gone = 0;
        while gone < 2 {
            assert!(std::time::Instant::now() < deadline, "{tls}: {gone} of 2 messages arrived");
            gone += server.tag_discard(0x70, !0xf).unwrap();
            tokio::task::yield_now().await;
        }
        assert_eq!(gone, 2, "{tls}: only the masked tags go");
        let ended = tokio::time::timeout(Duration::from_secs(10), futures_join(sends)).await;
        for (r, _) in ended.unwrap_or_else(|_| panic!("{tls}: a discarded send never ended")) {
            r.unwrap();
        }
        let kept = tokio::time::timeout(Duration::from_secs(10), server.tag_recv_any(0x80, tag::EXACT));
        let (info, buf) = kept.await.expect("the other tag was kept").unwrap();
        assert_eq!((info.len, buf), (64, payload(0x80, 64)), "{tls}: other tags stay");
        let r = server.tag_recv(0x72, tag::EXACT, Vec::with_capacity(16));
        ep.tag_send(0x72, payload(0x72, 16)).await.0.unwrap();
        assert!(r.await.1 == payload(0x72, 16));
    }
}

#[tokio::test]
async fn truncation_is_an_error_and_the_worker_goes_on() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    for (len, cap) in [(100usize, 10usize), (1 << 20, 1024)] {
        let r = server.tag_recv(1, tag::EXACT, Vec::with_capacity(cap));
        let s = ep.tag_send(1, payload(1, len));
        let (res, _) = r.await;
        let err = res.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Truncated, "{err}");
        assert!(err.to_string().contains("truncated"), "{err}");
        let _ = s.await;
        // The worker keeps working.
        let r = server.tag_recv(2, tag::EXACT, Vec::with_capacity(len));
        ep.tag_send(2, payload(2, len)).await.0.unwrap();
        assert!(r.await.1 == payload(2, len));
    }
}

/// A receive posted after its message arrived completes inside the posting call (UCX's
/// unexpected queue): the length, the sender's tag and truncation still come through.
#[tokio::test]
async fn receive_of_a_message_already_arrived() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let arrived = |t: u64| {
        let server = server.clone();
        async move {
            while server.tag_probe(t, tag::EXACT).is_none() {
                tokio::task::yield_now().await;
            }
        }
    };
    ep.tag_send(0x71, payload(7, 100)).await.0.unwrap();
    arrived(0x71).await;
    // Any tag with the high bits 0x70: the sender's tag is reported.
    let (r, buf) = server.tag_recv(0x70, 0xf0, Vec::with_capacity(256)).await;
    let info = r.unwrap();
    assert_eq!((info.sender_tag, info.len), (0x71, 100));
    assert!(buf == payload(7, 100));
    ep.tag_send(0x72, payload(8, 100)).await.0.unwrap();
    arrived(0x72).await;
    let (r, _) = server.tag_recv(0x72, tag::EXACT, Vec::with_capacity(10)).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Truncated);
    // The worker keeps working.
    ep.tag_send(0x73, payload(9, 5)).await.0.unwrap();
    let (r, buf) = server.tag_recv(0x73, tag::EXACT, Vec::with_capacity(5)).await;
    assert_eq!(r.unwrap().len, 5);
    assert!(buf == payload(9, 5));
}

#[tokio::test]
async fn forced_request_path() {
    let c = ctx("tcp,self");
    let a = c.worker().no_immediate_completion(true).build().unwrap();
    let b = c.worker().no_immediate_completion(true).build().unwrap();
    let l = a.listen(common::loopback()).unwrap();
    let (_acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
    let ep = ep.unwrap();
    for len in [0usize, 8, 100_000] {
        let r = a.tag_recv(3, tag::EXACT, Vec::with_capacity(len));
        ep.tag_send(3, payload(3, len)).await.0.unwrap();
        assert!(r.await.1 == payload(3, len));
    }
}

/// Event mode without the linger (the driver arms and sleeps as soon as it has drained
/// the worker): every size still arrives, over shared memory and TCP.
#[tokio::test]
async fn event_mode_without_linger() {
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let c = ctx(tls);
        let a = c.worker().event_linger(std::time::Duration::ZERO).build().unwrap();
        let b = c.worker().event_linger(std::time::Duration::ZERO).build().unwrap();
        let l = a.listen(common::loopback()).unwrap();
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        exchange_sizes(&a, &ep).await;
        exchange_sizes(&b, &acc).await;
    }
}

/// A message larger than 4 GiB (lengths past `u32`) over shared memory, and an empty one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_gib_message() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let len: usize = (4 << 30) + 4099;
    let mut data = vec![0u8; len];
    // A pattern that changes every page, so a misplaced chunk is caught.
    for (i, chunk) in data.chunks_mut(4096).enumerate() {
        chunk.fill((i % 251) as u8);
    }
    let recv = server.tag_recv(77, tag::EXACT, Vec::with_capacity(len));
    let send = ep.tag_send(77, data);
    let ((info, got), (sent, data)) = tokio::join!(recv, send);
    sent.unwrap();
    assert_eq!(info.unwrap().len, len);
    assert!(got.len() == len && got == data, "multi-GiB payload differs");
    drop((got, data));

    let recv = server.tag_recv(78, tag::EXACT, Vec::new());
    ep.tag_send(78, Vec::new()).await.0.unwrap();
    let (info, got) = recv.await;
    assert_eq!(info.unwrap().len, 0);
    assert!(got.is_empty());
}
