//! Cancel safety: dropping a pending operation's future is memory-safe. An unmatched
//! receive is canceled and its buffer is never written; a dropped send keeps its buffer
//! alive until UCX is done with it; a dropped stream receive or active-message fetch
//! keeps its buffer until UCX has written it; vectored receives and sends do the same
//! for every buffer of theirs. `.ci/run` also runs this file under valgrind.

use ucxkit_testkit as common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{pair, payload};
use ucxkit::transport::{tag, Endpoint, IoBuf, IoBufMut, Worker};

const NOT_DROPPED: u8 = 0;
const CLEAN: u8 = 1;
const DIRTY: u8 = 2;

/// A buffer that reports, when dropped, whether its bytes still hold the fill pattern.
struct Sentinel {
    data: Vec<u8>,
    fill: u8,
    state: Arc<AtomicU8>,
}

impl Sentinel {
    fn new(len: usize, fill: u8) -> (Sentinel, Arc<AtomicU8>) {
        let state = Arc::new(AtomicU8::new(NOT_DROPPED));
        (Sentinel { data: vec![fill; len], fill, state: state.clone() }, state)
    }

    /// A send buffer holding a copy of `bytes`; only its lifetime is reported (whether
    /// it was dropped), its contents are not checked.
    fn holding(bytes: &[u8]) -> (Sentinel, Arc<AtomicU8>) {
        let (mut s, state) = Sentinel::new(0, 0);
        s.data = bytes.to_vec();
        (s, state)
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let clean = self.data.iter().all(|&b| b == self.fill);
        self.state.store(if clean { CLEAN } else { DIRTY }, Ordering::SeqCst);
    }
}

// SAFETY: the Vec's heap pointer is stable while the Sentinel is owned by an operation.
unsafe impl IoBuf for Sentinel {
    fn stable_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.data.len()
    }
}

// SAFETY: as above; len bytes are writable.
unsafe impl IoBufMut for Sentinel {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.data.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.data.len()
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

/// Polls a future exactly once.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx: &mut Context<'_>| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// Waits (at most 2 s) for every parked buffer of `w` to be released.
async fn wait_parked_zero(w: &Worker) {
    common::wait_parked_zero(w, Duration::from_secs(2)).await;
}

/// Sends `data` with tag `t` and checks that a new receive gets it whole: the worker
/// goes on working after a dropped receive.
async fn next_receive_gets_the_message(server: &Worker, ep: &Endpoint, t: u64, data: Vec<u8>) {
    let next = server.tag_recv(t, tag::EXACT, Vec::with_capacity(data.len()));
    let (r, data) = ep.tag_send(t, data).await;
    r.unwrap();
    let (info, buf) = next.await;
    assert_eq!(info.unwrap().len, data.len());
    assert!(buf == data, "the next receive got other bytes");
}

async fn dropped_receive_is_never_written(tls: &str) {
    let (server, _client, _a, ep) = pair(tls).await;
    for len in [8usize, 100_000] {
        let (s, state) = Sentinel::new(len, 0xAA);
        let mut dropped = server.tag_recv(5, tag::EXACT, s);
        assert!(poll_once(&mut dropped).await.is_pending());
        drop(dropped);
        // The canceled receive released its buffer, unwritten.
        wait_parked_zero(&server).await;
        assert_eq!(state.load(Ordering::SeqCst), CLEAN, "the dropped receive buffer was written");
        next_receive_gets_the_message(&server, &ep, 5, payload(9, len)).await;
    }
}

#[tokio::test]
async fn dropped_receive_tcp() {
    dropped_receive_is_never_written("tcp,self").await;
}

#[tokio::test]
async fn dropped_receive_shared_memory() {
    dropped_receive_is_never_written("posix,cma,tcp,self").await;
}

async fn dropped_rendezvous_send_is_kept_alive(tls: &str) {
    let (server, client, _a, ep) = pair(tls).await;
    let len = 8 << 20;
    let data = payload(3, len);
    let (s, state) = Sentinel::holding(&data);
    let mut send = ep.tag_send(11, s);
    assert!(poll_once(&mut send).await.is_pending(), "a rendezvous send waits for its receiver");
    drop(send);
    assert_eq!(state.load(Ordering::SeqCst), NOT_DROPPED, "the buffer is parked, not freed");
    assert_eq!(client.parked_requests(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The peer receives later and gets the right bytes from the parked buffer.
    let (info, buf) = server.tag_recv(11, tag::EXACT, Vec::with_capacity(len)).await;
    assert_eq!(info.unwrap().len, len);
    assert!(buf == data, "rendezvous payload differs");
    wait_parked_zero(&client).await;
    assert_ne!(state.load(Ordering::SeqCst), NOT_DROPPED, "the parked buffer is released after completion");
}

/// Operations that completed during the call and are dropped without being awaited drop
/// their buffers once, there and then.
#[tokio::test]
async fn completed_at_once_dropped_unawaited() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let (s, sent) = Sentinel::new(16, 3);
    let send = ep.tag_send(12, s);
    assert!(send.completed_immediately(), "a short send over shared memory completes at once");
    drop(send);
    assert_eq!(sent.load(Ordering::SeqCst), CLEAN, "the send's buffer is dropped with it");
    // Once the message is there, the receive matches it at once.
    for _ in 0..100_000 {
        if server.tag_probe(12, tag::EXACT).is_some() {
            break;
        }
        tokio::task::yield_now().await;
    }
    let (r, recv_state) = Sentinel::new(16, 0);
    let recv = server.tag_recv(12, tag::EXACT, r);
    assert!(recv.completed_immediately(), "the receive matched the message that had arrived");
    drop(recv);
    assert_eq!(
        recv_state.load(Ordering::SeqCst),
        DIRTY,
        "the receive wrote the message, then dropped its buffer"
    );
    assert_eq!(server.parked_requests(), 0);
}

/// A receive's outcome is taken without awaiting it once it completed when posted; a
/// pending one gives none and is awaited as usual.
#[tokio::test]
async fn outcome_of_a_receive_done_when_posted_is_taken_without_a_task() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let mut pending = server.tag_recv(13, tag::EXACT, vec![0u8; 8]);
    assert!(pending.take_done().is_none(), "nothing arrived yet");
    ep.tag_send(14, vec![7u8; 5]).await.0.expect("send");
    for _ in 0..100_000 {
        if server.tag_probe(14, tag::EXACT).is_some() {
            break;
        }
        tokio::task::yield_now().await;
    }
    let mut recv = server.tag_recv(14, tag::EXACT, Vec::with_capacity(8));
    let (info, buf) = recv.take_done().expect("the message had arrived");
    assert_eq!(info.expect("received").len, 5);
    assert_eq!(buf, vec![7u8; 5]);
    assert!(recv.take_done().is_none(), "taken once");
    drop(recv);
    ep.tag_send(13, vec![9u8; 8]).await.0.expect("send");
    let (info, buf) = pending.await;
    assert_eq!((info.expect("received").len, buf), (8, vec![9u8; 8]));
}

/// A vectored receive dropped while pending is canceled like a plain one: none of its
/// buffers is ever written, and the message goes to the next receive.
async fn dropped_iov_receive_is_never_written(tls: &str) {
    let (server, _client, _a, ep) = pair(tls).await;
    for len in [8usize, 100_000] {
        let (first, first_state) = Sentinel::new(len / 2, 0xAA);
        let (second, second_state) = Sentinel::new(len - len / 2, 0xBB);
        let mut dropped = server.tag_recv_iov(6, tag::EXACT, vec![first, second]);
        assert!(poll_once(&mut dropped).await.is_pending());
        drop(dropped);
        wait_parked_zero(&server).await;
        assert_eq!(
            first_state.load(Ordering::SeqCst),
            CLEAN,
            "the dropped receive's first buffer was written"
        );
        assert_eq!(
            second_state.load(Ordering::SeqCst),
            CLEAN,
            "the dropped receive's second buffer was written"
        );
        next_receive_gets_the_message(&server, &ep, 6, payload(10, len)).await;
    }
}

#[tokio::test]
async fn dropped_iov_receive_tcp() {
    dropped_iov_receive_is_never_written("tcp,self").await;
}

#[tokio::test]
async fn dropped_iov_receive_shared_memory() {
    dropped_iov_receive_is_never_written("posix,cma,tcp,self").await;
}

/// Sentinels holding copies of `parts`, and the states they report when dropped.
fn sentinels_holding(parts: &[&[u8]]) -> (Vec<Sentinel>, Vec<Arc<AtomicU8>>) {
    parts.iter().map(|part| Sentinel::holding(part)).unzip()
}

/// Every buffer of a dropped operation still in flight is kept (parked), not freed.
fn assert_all_parked(states: &[Arc<AtomicU8>]) {
    for state in states {
        assert_eq!(state.load(Ordering::SeqCst), NOT_DROPPED, "a buffer was freed, not parked");
    }
}

/// Every parked buffer has been released once its operation completed.
fn assert_all_released(states: &[Arc<AtomicU8>]) {
    for state in states {
        assert_ne!(state.load(Ordering::SeqCst), NOT_DROPPED, "a parked buffer is released after completion");
    }
}

/// A vectored rendezvous send dropped before its receiver shows up keeps every buffer
/// until UCX has read it, and the receiver gets the bytes of all of them.
async fn dropped_iov_rendezvous_send_is_kept_alive(tls: &str) {
    let (server, client, _a, ep) = pair(tls).await;
    let len = 8 << 20;
    let data = payload(4, len);
    let (bufs, states) = sentinels_holding(&[&data[..len / 3], &data[len / 3..]]);
    let mut send = ep.tag_send_iov(13, bufs);
    assert!(poll_once(&mut send).await.is_pending(), "a rendezvous send waits for its receiver");
    drop(send);
    assert_all_parked(&states);
    assert_eq!(client.parked_requests(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (info, buf) = server.tag_recv(13, tag::EXACT, Vec::with_capacity(len)).await;
    assert_eq!(info.unwrap().len, len);
    assert!(buf == data, "vectored rendezvous payload differs");
    wait_parked_zero(&client).await;
    assert_all_released(&states);
}

#[tokio::test]
async fn dropped_iov_rendezvous_send_tcp() {
    dropped_iov_rendezvous_send_is_kept_alive("tcp,self").await;
}

#[tokio::test]
async fn dropped_iov_rendezvous_send_shared_memory() {
    dropped_iov_rendezvous_send_is_kept_alive("posix,cma,tcp,self").await;
}

/// A vectored put dropped while its parts are in flight keeps every buffer until UCX
/// has read the last of them, and the target region gets the bytes of all of them.
#[tokio::test]
async fn dropped_put_iov_keeps_its_buffers_until_done() {
    let (server, client, _sep, cep) = pair("tcp,self").await;
    let len = 8 << 20;
    let region = server.context().register(vec![0u8; len]).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let data = payload(5, len);
    let (bufs, states) = sentinels_holding(&[&data[..len / 3], &data[len / 3..]]);
    let mut put = cep.put_iov(bufs, &key, 0);
    assert!(poll_once(&mut put).await.is_pending(), "an 8 MiB put over TCP takes a while");
    drop(put);
    assert!(client.parked_requests() >= 1, "the parts in flight are parked");
    assert_all_parked(&states);
    tokio::time::timeout(Duration::from_secs(20), cep.flush()).await.unwrap().unwrap();
    wait_parked_zero(&client).await;
    assert_all_released(&states);
    let mut got = vec![0u8; len];
    region.read_at(0, &mut got);
    assert!(got == data, "the region lacks bytes of the dropped put");
}

#[tokio::test]
async fn dropped_rendezvous_send_tcp() {
    dropped_rendezvous_send_is_kept_alive("tcp,self").await;
}

#[tokio::test]
async fn dropped_rendezvous_send_shared_memory() {
    dropped_rendezvous_send_is_kept_alive("posix,cma,tcp,self").await;
}

#[tokio::test]
async fn dropped_matched_receive_finishes_in_background() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let len = 4 << 20;
    let (s, state) = Sentinel::new(len, 0x55);
    let send = ep.tag_send(12, payload(12, len));
    // Wait until the message is there, so that the receive matches it when posted (an
    // unmatched receive would be canceled on drop instead).
    for _ in 0..10_000 {
        if server.tag_probe(12, tag::EXACT).is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut recv = server.tag_recv(12, tag::EXACT, s);
    // Let the rendezvous start, then drop the receive while UCX may be writing into it.
    let _ = poll_once(&mut recv).await;
    drop(recv);
    let (r, _) = send.await;
    r.unwrap();
    wait_parked_zero(&server).await;
    assert_ne!(state.load(Ordering::SeqCst), NOT_DROPPED);
    // The worker goes on.
    let next = server.tag_recv(13, tag::EXACT, vec![0u8; 3]);
    ep.tag_send(13, b"abc".to_vec()).await.0.unwrap();
    assert_eq!(next.await.1, b"abc");
}

/// Receives bound to an endpoint, dropped while the future holds the endpoint's last
/// handle (the future keeps only the endpoint, through which it finds the worker): an
/// unmatched one is canceled and its buffer never written; a matched rendezvous one
/// keeps its buffer parked until UCX has written it, then releases it.
#[tokio::test]
async fn dropped_endpoint_receives_holding_the_last_endpoint() {
    // TCP: a rendezvous over shared memory can finish within the first poll.
    let (server, _client, a, ep) = pair("tcp,self").await;
    let (s, state) = Sentinel::new(64, 0xAA);
    let mut unmatched = a.tag_recv(21, tag::EXACT, s);
    assert!(poll_once(&mut unmatched).await.is_pending());
    let b = a.clone();
    drop(a);
    drop(unmatched);
    wait_parked_zero(&server).await;
    assert_eq!(state.load(Ordering::SeqCst), CLEAN, "the dropped receive buffer was written");

    let len = 16 << 20;
    let send = ep.tag_send(22, payload(22, len));
    for _ in 0..10_000 {
        if server.tag_probe(22, tag::EXACT).is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (s, state) = Sentinel::new(len, 0x55);
    let mut matched = b.tag_recv(22, tag::EXACT, s);
    let pending = poll_once(&mut matched).await.is_pending();
    assert!(pending, "a 16 MiB rendezvous receive over TCP finished at its first poll");
    drop(b);
    drop(matched);
    assert_eq!(state.load(Ordering::SeqCst), NOT_DROPPED, "a buffer UCX writes was freed");
    // The receive, parked (and the endpoint, closing through its peer, its last handle
    // gone).
    assert!(server.parked_requests() >= 1, "the receive is not parked");
    let (r, _) = send.await;
    r.unwrap();
    wait_parked_zero(&server).await;
    assert_ne!(state.load(Ordering::SeqCst), NOT_DROPPED, "the parked buffer is released after completion");
}

#[tokio::test]
async fn worker_dropped_with_operations_in_flight() {
    let (server, client, a, ep) = pair("tcp,self").await;
    let (s, state) = Sentinel::new(64, 0x11);
    let recv = server.tag_recv(99, tag::EXACT, s);
    let send = ep.tag_send(98, payload(1, 1 << 20));
    drop((recv, send, a, ep, server, client));
    // Give the drivers a moment to stop and the workers to be destroyed.
    for _ in 0..100 {
        if state.load(Ordering::SeqCst) != NOT_DROPPED {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state.load(Ordering::SeqCst), CLEAN);
}

/// `tag_recv_any` dropped after it found a rendezvous message and posted the receive into
/// its own buffer: the buffer stays with the worker until UCX finished writing it.
#[tokio::test]
async fn dropped_recv_any_after_match() {
    let (server, _client, _a, ep) = pair("posix,cma,tcp,self").await;
    let len = 4 << 20;
    let send = ep.tag_send(21, payload(21, len));
    // Wait until the message is visible, then poll the unknown-size receive once.
    for _ in 0..10_000 {
        if server.tag_probe(21, tag::EXACT).is_some() {
            break;
        }
        tokio::task::yield_now().await;
    }
    let mut any = Box::pin(server.tag_recv_any(21, tag::EXACT));
    let _ = poll_once(&mut any).await;
    drop(any);
    let (r, _) = send.await;
    r.unwrap();
    wait_parked_zero(&server).await;
    // The worker goes on.
    let next = server.tag_recv(22, tag::EXACT, vec![0u8; 2]);
    ep.tag_send(22, b"ok".to_vec()).await.0.unwrap();
    assert_eq!(next.await.1, b"ok");
}

/// Waits until `state` leaves NOT_DROPPED and returns it.
async fn dropped_state(state: &AtomicU8) -> u8 {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let s = state.load(Ordering::SeqCst);
            if s != NOT_DROPPED {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the parked buffer is released once UCX is done")
}

/// A stream receive dropped while pending cannot be canceled in UCX: its buffer is kept
/// and UCX writes the next bytes into it (they are lost), and only then is it freed.
#[tokio::test]
async fn dropped_stream_recv_keeps_its_buffer_until_written() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let (s, state) = Sentinel::new(16, 0xAA);
    let mut dropped = sep.stream_recv(s);
    assert!(poll_once(&mut dropped).await.is_pending());
    drop(dropped);
    assert_eq!(state.load(Ordering::SeqCst), NOT_DROPPED, "still owned by UCX");
    cep.stream_send(vec![0x55u8; 16]).await.0.unwrap();
    assert_eq!(dropped_state(&state).await, DIRTY, "UCX wrote into the kept buffer");
    // The stream goes on with the next bytes.
    cep.stream_send(b"after".to_vec()).await.0.unwrap();
    let (r, b) = sep.stream_recv_exact(vec![0u8; 5].into_boxed_slice()).await;
    assert_eq!(r.unwrap(), 5);
    assert_eq!(&b[..], b"after");
}

/// An active-message fetch dropped in flight keeps its buffer until UCX completes it;
/// the sender completes too.
#[tokio::test]
async fn dropped_am_fetch_keeps_its_buffer_until_done() {
    use ucxkit::transport::{AmProto, AmSendOptions};
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    let mut rx = server.am_recv(30).unwrap();
    let opts = AmSendOptions { proto: AmProto::Rendezvous, reply: true };
    let send = cep.am_send_with(30, b"", vec![0x55u8; 1 << 20], opts);
    let m = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.unwrap();
    let (s, state) = Sentinel::new(1 << 20, 0xAA);
    let mut fetch = m.recv_data(s);
    let _ = poll_once(&mut fetch).await;
    drop(fetch);
    tokio::time::timeout(Duration::from_secs(20), send).await.unwrap().0.unwrap();
    assert_eq!(dropped_state(&state).await, DIRTY, "the fetch finished into the kept buffer");
}

/// Active-message sends with headers, dropped while pending: eager ones queued behind a
/// full TCP connection and a rendezvous one waiting for its receiver. Each payload stays
/// with the worker until UCX has read it, and so does each header (on UCX 1.13 ucxkit's
/// copy of it, which UCX reads until the send completes; 1.14 and newer copy it during
/// the call); the receiver, coming later, gets every header and payload intact. With the
/// header copy freed at the drop, the rendezvous message's header arrives corrupted, and
/// valgrind reports the reads.
#[tokio::test]
async fn dropped_am_sends_with_headers_arrive_intact() {
    use ucxkit::transport::{AmProto, AmSendOptions};
    let (server, client, _sep, cep) = pair("tcp,self").await;
    const EAGER: u64 = 8;
    let (eager_len, rndv_len) = (1 << 20, 4 << 20);
    let header = |i: u64| payload(100 + i, 48);
    // A fill per message (cheap under valgrind), and one distinct last byte.
    let data = |i: u64| {
        let mut d = vec![0x40 + i as u8; if i < EAGER { eager_len } else { rndv_len }];
        *d.last_mut().expect("not empty") = 0xF0 + i as u8;
        d
    };
    let mut states = Vec::new();
    // Posted without yielding: on this single-thread runtime the receiving worker does
    // not progress meanwhile, so the connection fills and the later sends queue. Each
    // pending send is checked at its drop, when nothing has progressed the worker since
    // the poll that found it pending: later polls progress it, and may complete (and
    // rightly release) sends queued earlier as the socket takes more bytes.
    for i in 0..=EAGER {
        let (s, state) = Sentinel::holding(&data(i));
        let proto = if i < EAGER { AmProto::Eager } else { AmProto::Rendezvous };
        let mut send = cep.am_send_with(31, &header(i), s, AmSendOptions { proto, reply: false });
        let pending = poll_once(&mut send).await.is_pending();
        let parked = client.parked_requests();
        drop(send);
        if pending {
            assert_all_parked(std::slice::from_ref(&state));
            assert_eq!(client.parked_requests(), parked + 1, "message {i}: the dropped send is parked");
            states.push(state);
        }
        if i == EAGER {
            assert!(pending, "the rendezvous send waits for its receiver");
        }
    }
    assert!(states.len() >= 2, "at least one eager send is queued too");
    // The rendezvous send cannot finish before its receiver fetches the payload.
    assert_all_parked(&states[states.len() - 1..]);
    // The receiver registers only now: the messages were held for it.
    let mut rx = server.am_recv(31).unwrap();
    for i in 0..=EAGER {
        let m = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.unwrap();
        assert_eq!(m.is_rendezvous(), i == EAGER);
        assert_eq!(m.header(), &header(i)[..], "message {i}: header intact");
        let (r, got) = m.into_vec().await;
        assert_eq!(r.unwrap(), data(i).len());
        assert!(got == data(i), "message {i}: payload intact");
    }
    wait_parked_zero(&client).await;
    assert_all_released(&states);
}
