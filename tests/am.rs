//! Active messages: eager and rendezvous payloads, forced protocols, replies, handlers
//! (including one that panics), and the errors for bad ids and headers.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{ctx, pair, payload};
use ucxkit::transport::{
    AmProto, AmSendOptions, Endpoint, EndpointOptions, Error, ErrorKind, ErrorMode, Worker,
};

/// Header and payload splits of messages around the 22 bytes a message kept whole in
/// place holds, and past them: header and payload arrive byte for byte,
/// with and without a reply endpoint, read in place or copied out, and a buffer one byte
/// short is a truncation.
async fn short_messages(tls: &str) {
    let (server, _c, _sep, cep) = pair(tls).await;
    let mut rx = server.am_recv(9).unwrap();
    let mut n = 0u64;
    for total in [0usize, 1, 8, 15, 19, 20, 21, 22, 23, 24, 40] {
        for hlen in
            [0, 1, 7, 8, 9, 14, 15, 16, 19, 20, 21, 22, 23, 24, 40].into_iter().filter(|&h| h <= total)
        {
            for (reply, copy) in [(false, false), (false, true), (true, false), (true, true)] {
                n += 1;
                let header = payload(n, hlen);
                let data = payload(n + 1000, total - hlen);
                let opts = AmSendOptions { proto: AmProto::Auto, reply };
                cep.am_send_with(9, &header, data.clone(), opts).await.0.unwrap();
                let m = tokio::time::timeout(T, rx.recv()).await.expect("message");
                let what = format!("header {hlen}, payload {}, reply {reply}", data.len());
                assert_eq!(m.header(), &header[..], "{what}");
                assert_eq!(m.data(), Some(&data[..]), "{what}");
                assert_eq!(m.len(), data.len(), "{what}");
                assert_eq!(m.reply_endpoint().is_some(), reply, "{what}");
                if copy || data.is_empty() {
                    let (r, buf) = m.into_vec().await;
                    assert_eq!(r.unwrap(), data.len(), "{what}");
                    assert_eq!(buf, data, "{what}");
                } else {
                    let (r, _) = m.recv_data(Vec::with_capacity(data.len() - 1)).await;
                    match r.unwrap_err() {
                        Error::Truncated { capacity, len, tag } => {
                            assert_eq!((capacity, len, tag), (data.len() - 1, data.len(), 9), "{what}")
                        }
                        e => panic!("{what}: {e}"),
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn short_messages_tcp() {
    short_messages("tcp,self").await;
}

#[tokio::test]
async fn short_messages_shm() {
    short_messages("posix,cma,tcp,self").await;
}

/// Messages the receiver can answer.
const REPLY: AmSendOptions = AmSendOptions { proto: AmProto::Auto, reply: true };

const T: Duration = Duration::from_secs(20);

async fn eager_and_rendezvous(tls: &str) {
    let (server, _c, _sep, cep) = pair(tls).await;
    let mut rx = server.am_recv(7).unwrap();
    let cases = [
        (0usize, AmProto::Auto),
        (10, AmProto::Auto),
        (8 * 1024, AmProto::Auto),
        (64 * 1024, AmProto::Auto),
        (4 << 20, AmProto::Auto),
        (100, AmProto::Rendezvous),
        (200_000, AmProto::Eager),
    ];
    for (i, &(len, proto)) in cases.iter().enumerate() {
        // Headers from empty through short (kept in the message) to longer ones.
        let header = format!("hdr-{i}-").repeat(i * 3);
        let data = payload(i as u64, len);
        let send = cep.am_send_with(7, header.as_bytes(), data.clone(), AmSendOptions { proto, reply: true });
        let msg = tokio::time::timeout(T, rx.recv()).await.expect("message");
        assert_eq!(msg.id(), 7);
        assert_eq!(msg.header(), header.as_bytes());
        assert_eq!(msg.len(), len);
        match proto {
            AmProto::Rendezvous => assert!(msg.is_rendezvous(), "forced rendezvous"),
            AmProto::Eager => assert!(!msg.is_rendezvous(), "forced eager"),
            AmProto::Auto => {}
        }
        if len >= 4 << 20 {
            assert!(msg.is_rendezvous(), "4 MiB goes by rendezvous");
        }
        if let Some(d) = msg.data() {
            assert!(d == &data[..]);
        }
        let (r, buf) = msg.into_vec().await;
        assert_eq!(r.unwrap(), len);
        assert!(buf == data, "payload {i} differs");
        send.await.0.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_and_rendezvous_tcp() {
    eager_and_rendezvous("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_and_rendezvous_shm() {
    eager_and_rendezvous("posix,cma,tcp,self").await;
}

/// Many eager payloads read in place (held in UCX's receive buffers, from 2 KiB on) and
/// kept alive together, then dropped in an order unlike arrival: every one keeps its
/// bytes until dropped, and the worker goes on receiving afterwards.
async fn eager_payloads_kept(tls: &str) {
    let (server, _c, _sep, cep) = pair(tls).await;
    let mut rx = server.am_recv(9).unwrap();
    let eager = AmSendOptions { proto: AmProto::Eager, reply: false };
    let lens: Vec<usize> = (0..300).map(|i| [100, 2047, 2048, 4096, 8000, 20_000][i % 6]).collect();
    for round in 0..2u64 {
        let sends: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| cep.am_send_with(9, &[], payload(round * 1000 + i as u64, len), eager))
            .collect();
        let mut kept = Vec::new();
        for _ in &lens {
            kept.push(tokio::time::timeout(T, rx.recv()).await.expect("message"));
        }
        for s in sends {
            s.await.0.unwrap();
        }
        // Odd ones first, then the even ones from the back.
        let (odd, even): (Vec<_>, Vec<_>) = kept.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
        for (i, msg) in odd.into_iter().chain(even.into_iter().rev()) {
            assert!(!msg.is_rendezvous());
            let data = msg.data().expect("eager payload");
            assert!(
                data == &payload(round * 1000 + i as u64, lens[i])[..],
                "round {round} message {i} differs"
            );
            if i % 3 == 0 {
                let (r, buf) = msg.into_vec().await;
                assert_eq!(r.unwrap(), lens[i]);
                assert!(buf == payload(round * 1000 + i as u64, lens[i]));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_payloads_kept_tcp() {
    eager_payloads_kept("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_payloads_kept_shm() {
    eager_payloads_kept("posix,cma,tcp,self").await;
}

/// The receiver answers each message on the sender's endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_round_trip() {
    let (server, client, _sep, cep) = pair("tcp,self").await;
    let mut requests = server.am_recv(1).unwrap();
    let mut answers = client.am_recv(2).unwrap();
    let srv = tokio::spawn(async move {
        for _ in 0..50 {
            let m = requests.recv().await;
            let ep = m.reply_endpoint().expect("reply endpoint").clone();
            let (r, body) = m.into_vec().await;
            r.unwrap();
            let mut back = body;
            back.reverse();
            ep.am_send(2, b"re", back).await.0.unwrap();
        }
    });
    for i in 0..50u64 {
        let len = [1usize, 5000, 100_000][i as usize % 3];
        let p = payload(i, len);
        cep.am_send_with(1, &i.to_le_bytes(), p.clone(), REPLY).await.0.unwrap();
        let m = tokio::time::timeout(T, answers.recv()).await.unwrap();
        assert_eq!(m.header(), b"re");
        let (r, back) = m.into_vec().await;
        r.unwrap();
        let mut expect = p;
        expect.reverse();
        assert!(back == expect);
    }
    srv.await.unwrap();
}

/// A handler sees every message in order, may reply from inside, and a panic inside
/// it is reported as an error while the worker keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_reply_and_survive_panics() {
    let (server, client, _sep, cep) = pair("tcp,self").await;
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = seen.clone();
    let h = server
        .am_handler(3, move |m| {
            let n = u64::from_le_bytes(m.header().try_into().unwrap());
            assert_eq!(n as usize, seen2.load(Ordering::SeqCst), "in order");
            seen2.fetch_add(1, Ordering::SeqCst);
            if n == 5 {
                panic!("handler refuses message 5");
            }
            // Replies from inside the handler (the worker lock is not held here).
            drop(m.reply(4, &n.to_le_bytes(), Vec::new()).unwrap());
        })
        .unwrap();
    let mut replies = client.am_recv(4).unwrap();
    for i in 0..20u64 {
        cep.am_send_with(3, &i.to_le_bytes(), vec![0u8; 32], REPLY).await.0.unwrap();
    }
    for i in (0..20u64).filter(|&i| i != 5) {
        let m = tokio::time::timeout(T, replies.recv()).await.unwrap();
        assert_eq!(m.header(), i.to_le_bytes());
    }
    assert_eq!(seen.load(Ordering::SeqCst), 20);
    let errs = h.take_errors();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].to_string().contains("refuses message 5"), "{}", errs[0]);
    assert!(h.take_errors().is_empty());
}

#[tokio::test]
async fn bad_ids_headers_and_buffers_are_errors() {
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    // Reserved and duplicate ids.
    assert_eq!(server.am_recv(4095).unwrap_err().kind(), ErrorKind::InvalidInput);
    let rx = server.am_recv(9).unwrap();
    assert_eq!(server.am_recv(9).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(server.am_handler(9, |_| {}).is_err());
    let (r, b) = cep.am_send(4095, b"", vec![1u8]).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(b, [1]);
    // Oversized header.
    let big = vec![0u8; cep.worker().max_am_header() + 1];
    let (r, _) = cep.am_send(9, &big, Vec::new()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    // Too-small fetch buffer: Truncated, and the worker goes on.
    let mut rx = rx;
    cep.am_send(9, b"", payload(1, 1000)).await.0.unwrap();
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    let (r, _) = m.recv_data(Vec::with_capacity(10)).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Truncated);
    // A rendezvous send completes once the receiver has fetched the payload.
    let send = cep.am_send_with(
        9,
        b"",
        payload(2, 100_000),
        AmSendOptions { proto: AmProto::Rendezvous, reply: false },
    );
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    assert!(m.reply_endpoint().is_none(), "no reply asked");
    assert!(m.reply(1, b"", Vec::new()).is_err());
    let (r, b) = m.into_vec().await;
    assert_eq!(r.unwrap(), 100_000);
    assert!(b == payload(2, 100_000));
    send.await.0.unwrap();
    // After the receiver is gone, arrivals are dropped and counted; a rendezvous
    // sender is released.
    drop(rx);
    cep.am_send(9, b"", vec![0u8; 10]).await.0.unwrap();
    let send = cep.am_send_with(
        9,
        b"",
        vec![0u8; 200_000],
        AmSendOptions { proto: AmProto::Rendezvous, reply: true },
    );
    tokio::time::timeout(T, send).await.unwrap().0.unwrap();
    tokio::time::timeout(T, async {
        while server.am_dropped() < 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap();
    // The id can be registered again.
    let mut rx = server.am_recv(9).unwrap();
    cep.am_send(9, b"again", Vec::new()).await.0.unwrap();
    assert_eq!(tokio::time::timeout(T, rx.recv()).await.unwrap().header(), b"again");
}

/// A receiver dropped with a rendezvous message still queued releases that sender too.
#[tokio::test]
async fn dropped_receiver_releases_queued_rendezvous() {
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    let rx = server.am_recv(12).unwrap();
    let send = cep.am_send_with(
        12,
        b"",
        vec![1u8; 1 << 20],
        AmSendOptions { proto: AmProto::Rendezvous, reply: true },
    );
    // Let the worker's driver queue the arrival (the receiver is not polled), then drop
    // the receiver with the message still in its queue.
    tokio::time::timeout(T, async {
        while rx.queued() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the message is queued");
    drop(rx);
    tokio::time::timeout(T, send).await.expect("the sender completes once the receiver is gone").0.unwrap();
    assert_eq!(server.am_dropped(), 0, "the message was queued, not dropped on arrival");
}

/// A rendezvous message dropped unfetched releases its sender.
#[tokio::test]
async fn unfetched_rendezvous_releases_sender() {
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    let mut rx = server.am_recv(11).unwrap();
    let send = cep.am_send_with(
        11,
        b"",
        vec![7u8; 1 << 20],
        AmSendOptions { proto: AmProto::Rendezvous, reply: true },
    );
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    assert!(m.is_rendezvous());
    drop(m);
    tokio::time::timeout(T, send).await.unwrap().0.unwrap();
}

/// Messages for an id the receiver has not registered are held, not lost: eager and
/// rendezvous ones sent before the registration arrive, in order, at the first receiver
/// (the rendezvous sender waits until then). Past the worker's limit they are dropped
/// and each is reported as a clear error naming the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_ids_are_held_then_reported() {
    use ucxkit::transport::{am, Error};
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    // 1. Sent before anyone registered id 21: three eager messages and a rendezvous one.
    for i in 0..3u64 {
        cep.am_send(21, &i.to_le_bytes(), payload(i, 100 + i as usize)).await.0.unwrap();
    }
    let rndv = cep.am_send_with(
        21,
        &3u64.to_le_bytes(),
        payload(3, 300_000),
        AmSendOptions { proto: AmProto::Rendezvous, reply: false },
    );
    wait_until(|| server.am_unclaimed() == [(21, 4)], || format!("held: {:?}", server.am_unclaimed())).await;
    assert_eq!(server.am_dropped(), 0);
    let mut rx = server.am_recv(21).unwrap();
    assert!(server.am_unclaimed().is_empty(), "handed to the receiver");
    for i in 0..4u64 {
        let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
        assert_eq!(m.header(), i.to_le_bytes(), "arrival order");
        let len = if i == 3 { 300_000 } else { 100 + i as usize };
        let (r, data) = m.into_vec().await;
        assert_eq!(r.unwrap(), len);
        assert!(data == payload(i, len), "message {i} intact");
    }
    tokio::time::timeout(T, rndv).await.unwrap().0.unwrap();

    // 2. An id nobody ever registers: the worker holds up to its limit, then drops and
    // reports each message with the id.
    let extra = 5;
    for i in 0..am::UNCLAIMED_MAX_MESSAGES + extra {
        cep.am_send(22, b"", vec![i as u8]).await.0.unwrap();
    }
    wait_until(|| server.am_dropped() >= extra as u64, || format!("dropped {}", server.am_dropped())).await;
    assert_eq!(server.am_unclaimed(), [(22, am::UNCLAIMED_MAX_MESSAGES)]);
    let errs = server.take_am_errors();
    assert_eq!(errs.len(), extra, "{errs:?}");
    for e in &errs {
        assert!(matches!(e, Error::AmUnclaimed { id: 22, len: 1 }), "{e}");
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("id 22"), "{e}");
    }
    assert!(server.take_am_errors().is_empty(), "taken");
    // The worker goes on: a registered id still works.
    cep.am_send(21, b"after", vec![7u8; 3]).await.0.unwrap();
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    assert_eq!(m.header(), b"after");
}

/// Waits up to `T` for `done`, failing with `what` when it does not come.
async fn wait_until(done: impl Fn() -> bool, what: impl Fn() -> String) {
    let deadline = tokio::time::Instant::now() + T;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{}", what());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Messages held for an id nobody registered can be let go: a held rendezvous message
/// keeps its sender waiting until then, and the receiver registered afterwards sees only
/// what arrived after the discard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unclaimed_messages_can_be_discarded() {
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    cep.am_send(23, b"eager", vec![1u8; 10]).await.0.unwrap();
    let mut rndv = Box::pin(cep.am_send_with(
        23,
        b"rndv",
        payload(1, 300_000),
        AmSendOptions { proto: AmProto::Rendezvous, reply: false },
    ));
    wait_until(|| server.am_unclaimed() == [(23, 2)], || format!("held: {:?}", server.am_unclaimed())).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut rndv).await.is_err(),
        "a held rendezvous message keeps its sender waiting"
    );
    assert_eq!(server.am_discard_unclaimed(23), 2);
    tokio::time::timeout(T, rndv).await.expect("the sender is released").0.unwrap();
    assert!(server.am_unclaimed().is_empty());
    assert_eq!(server.am_dropped(), 2);
    assert_eq!(server.am_discard_unclaimed(23), 0, "nothing left");
    assert!(server.take_am_errors().is_empty(), "a discard asked for is not an error");

    let mut rx = server.am_recv(23).unwrap();
    cep.am_send(23, b"new", vec![2u8; 4]).await.0.unwrap();
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    assert_eq!(m.header(), b"new", "discarded messages are gone");
    assert_eq!(m.data(), Some(&[2u8; 4][..]));
}

/// Two workers of one shared-memory context (no TCP: a worker destroyed while the other
/// tests open sockets could meet UCX's fd-reuse abort, see `Worker`), the client connected
/// to the server by address with `opts`: (server, client, client-side endpoint). The
/// server holds no endpoint handle, which would keep it alive.
async fn by_address(opts: EndpointOptions) -> (Worker, Worker, Endpoint) {
    let c = ctx("posix,cma,self");
    let server = c.worker().build().unwrap();
    let client = c.worker().build().unwrap();
    let ep = client.connect_address_with(&server.address().unwrap(), opts).await.unwrap();
    (server, client, ep)
}

/// A worker whose last handle goes while it holds messages for an id nobody registered
/// (eager payloads, and a rendezvous one whose sender waits until its payload is fetched
/// or let go) gives their payloads back to UCX before it is destroyed: the rendezvous
/// send then completes, instead of failing when the worker's connections go. A message
/// handed out whose payload UCX holds keeps its worker: while it lives, the payload stays
/// readable (run under valgrind too) and the worker, with the messages it holds, stays.
/// Over shared memory, where eager payloads from 2 KiB on stay in UCX's receive buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_dropped_with_held_messages() {
    // Without the handshake. No peer-failure mode (it would leave shared memory out): a
    // rendezvous send to a worker destroyed without letting its payload go would wait for
    // ever.
    let opts = EndpointOptions { handshake: false, error_mode: ErrorMode::None, ..Default::default() };
    let (server, _client, ep) = by_address(opts).await;
    let eager = AmSendOptions { proto: AmProto::Eager, reply: false };
    for i in 0..4u64 {
        ep.am_send_with(31, b"", payload(i, 4096), eager).await.0.unwrap();
    }
    let mut rndv = Box::pin(ep.am_send_with(
        31,
        b"",
        payload(9, 300_000),
        AmSendOptions { proto: AmProto::Rendezvous, reply: false },
    ));
    // One message of another id, handed out and kept.
    let mut rx = server.am_recv(32).unwrap();
    ep.am_send_with(32, b"kept", payload(7, 8192), eager).await.0.unwrap();
    let kept = tokio::time::timeout(T, rx.recv()).await.unwrap();
    wait_until(|| server.am_unclaimed() == [(31, 5)], || format!("held: {:?}", server.am_unclaimed())).await;
    drop((rx, server));
    // The kept message is the worker's last handle: the worker, holding the rendezvous
    // message, stays, and the sender waits.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut rndv).await.is_err(),
        "the worker stays while a message of it is kept"
    );
    assert_eq!(kept.header(), b"kept");
    assert!(kept.data().expect("eager payload") == &payload(7, 8192)[..]);
    drop(kept);
    let (r, _) = tokio::time::timeout(T, rndv).await.expect("the rendezvous send ends");
    r.expect("the payload was let go before the worker was destroyed");
}

/// A fetch of an eager payload UCX holds (shared memory, from 2 KiB on) into a buffer too
/// small for it fails without touching the buffer: 300 such messages in a row,
/// each a `Truncated` error with the sizes and its buffer handed back unwritten, and the
/// worker goes on (run under valgrind too: the payload is read in place, then let go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_held_payloads() {
    let (server, _client, ep) =
        by_address(EndpointOptions { error_mode: ErrorMode::None, ..Default::default() }).await;
    let mut rx = server.am_recv(40).unwrap();
    let eager = AmSendOptions { proto: AmProto::Eager, reply: false };
    for i in 0..300u64 {
        let len = [2048, 4096, 7000][i as usize % 3];
        let send = ep.am_send_with(40, b"", payload(i, len), eager);
        let m = tokio::time::timeout(T, rx.recv()).await.unwrap_or_else(|_| panic!("message {i} arrives"));
        assert!(m.data().is_some_and(|d| d == &payload(i, len)[..]), "message {i} intact");
        let (r, buf) = m.recv_data(vec![0xeeu8; len - 1]).await;
        match r.unwrap_err() {
            Error::Truncated { capacity, len: got, tag } => {
                assert_eq!((capacity, got, tag), (len - 1, len, 40))
            }
            e => panic!("message {i}: {e}"),
        }
        assert!(buf.len() == len - 1 && buf.iter().all(|&b| b == 0xee), "message {i}: buffer written");
        send.await.0.unwrap();
    }
}
