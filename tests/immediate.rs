//! Sends from borrowed buffers that UCX completes during the call or not at all
//! (`try_tag_send`, `try_am_send`, `try_put`): short messages arrive
//! byte for byte, long ones are refused without anything being sent, order with the
//! owned sends is kept, a closed endpoint or a bad range is an error, and a worker that
//! takes UCX's request path for everything refuses them.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::{Duration, Instant};

use common::{ctx, pair, payload};
use ucxkit::transport::{tag, Endpoint, EndpointOptions, ErrorKind, ErrorMode};

const T: Duration = Duration::from_secs(20);

/// Retries `send` until UCX takes it at once (a transport may have no room for a moment),
/// for at most `T`.
async fn until_sent(ep: &Endpoint, send: impl FnMut() -> ucxkit::transport::Result<bool>) {
    assert!(sent_within(ep, T, send).await, "UCX never took a short message at once");
}

/// Retries `send` for up to `limit`; whether UCX took it at once.
async fn sent_within(
    ep: &Endpoint,
    limit: Duration,
    mut send: impl FnMut() -> ucxkit::transport::Result<bool>,
) -> bool {
    let end = Instant::now() + limit;
    while !send().expect("immediate send") {
        if Instant::now() >= end {
            return false;
        }
        ep.worker().progress();
        tokio::task::yield_now().await;
    }
    true
}

/// Over shared memory UCX completes a short tag send during the call; over TCP, UCX 1.13
/// does and 1.22 does not, and then the message goes through the owned send: either way
/// exactly one copy arrives.
async fn tag_immediate(tls: &str, always_immediate: bool) {
    let (s, _c, _sep, cep) = pair(tls).await;
    let short = payload(1, 16);
    if always_immediate {
        until_sent(&cep, || cep.try_tag_send(0x11, &short)).await;
    } else if !sent_within(&cep, Duration::from_millis(200), || cep.try_tag_send(0x11, &short)).await {
        tokio::time::timeout(T, cep.tag_send(0x11, short.clone())).await.unwrap().0.unwrap();
    }
    let (r, got) =
        tokio::time::timeout(T, s.tag_recv(0x11, tag::EXACT, Vec::with_capacity(64))).await.unwrap();
    assert_eq!(r.unwrap().len, 16);
    assert_eq!(got, short);
    assert!(s.tag_probe(0x11, tag::EXACT).is_none(), "one message, received once");
    // Too long for the short protocol: refused, and nothing goes out. A message sent after
    // it arrives after anything sent before it, so once that one is in, a refused message
    // that had gone out would show.
    let long = payload(2, 1 << 20);
    assert!(!cep.try_tag_send(0x12, &long).unwrap(), "a 1 MiB message cannot complete at once");
    tokio::time::timeout(T, cep.tag_send(0x13, &b"after"[..])).await.unwrap().0.unwrap();
    let (r, _) = tokio::time::timeout(T, s.tag_recv(0x13, tag::EXACT, Vec::with_capacity(8))).await.unwrap();
    r.unwrap();
    assert!(s.tag_probe(0x12, tag::EXACT).is_none(), "a refused message was sent");
}

#[tokio::test]
async fn tag_immediate_tcp() {
    tag_immediate("tcp,self", false).await;
}

#[tokio::test]
async fn tag_immediate_shm() {
    tag_immediate("posix,cma,tcp,self", true).await;
}

/// Immediate and owned sends mixed on one endpoint and tag arrive in call order. Where
/// UCX completes short sends at once (`immediate`), some of them must have.
async fn order_with_owned_sends(tls: &str, immediate: bool) {
    let (s, _c, _sep, cep) = pair(tls).await;
    const N: u32 = 400;
    let mut owned = Vec::new();
    let mut at_once = 0;
    for i in 0..N {
        let mut msg = i.to_le_bytes().to_vec();
        // Every third message is long enough that it needs the owned path.
        if i % 3 == 0 {
            msg.resize(64 << 10, 0xab);
        }
        if i % 2 == 1 && cep.try_tag_send(0x20, &msg).unwrap() {
            at_once += 1;
        } else {
            owned.push(cep.tag_send(0x20, msg));
        }
    }
    assert!(!immediate || at_once > 0, "no short send completed at once");
    for i in 0..N {
        let (r, got) = tokio::time::timeout(T, s.tag_recv(0x20, tag::EXACT, Vec::with_capacity(64 << 10)))
            .await
            .unwrap();
        r.unwrap();
        assert_eq!(u32::from_le_bytes(got[..4].try_into().unwrap()), i, "message {i} out of order");
    }
    for f in owned {
        f.await.0.unwrap();
    }
}

#[tokio::test]
async fn order_with_owned_sends_tcp() {
    order_with_owned_sends("tcp,self", false).await;
}

#[tokio::test]
async fn order_with_owned_sends_shm() {
    order_with_owned_sends("posix,cma,tcp,self", true).await;
}

#[tokio::test]
async fn am_immediate() {
    let (s, _c, _sep, cep) = pair("posix,cma,tcp,self").await;
    let mut rx = s.am_recv(5).unwrap();
    let data = payload(3, 40);
    until_sent(&cep, || cep.try_am_send(5, b"head", &data)).await;
    let m = tokio::time::timeout(T, rx.recv()).await.unwrap();
    assert_eq!(m.header(), b"head");
    assert_eq!(m.data(), Some(&data[..]));
    assert!(!cep.try_am_send(5, &[], &payload(4, 1 << 20)).unwrap(), "1 MiB cannot complete at once");
    let e = cep.try_am_send(ucxkit::transport::am::MAX_ID + 1, &[], &data).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let big = vec![0u8; cep.worker().max_am_header() + 1];
    let e = cep.try_am_send(5, &big, &data).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[tokio::test]
async fn put_immediate() {
    let (_s, _c, sep, cep) = pair("posix,cma,tcp,self").await;
    let region = sep.worker().context().alloc(2 << 20).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let data = payload(6, 32);
    until_sent(&cep, || cep.try_put(&data, &key, 100)).await;
    tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
    let mut got = vec![0u8; 32];
    region.read_at(100, &mut got);
    assert_eq!(got, data);
    assert!(!cep.try_put(&payload(7, 1 << 20), &key, 0).unwrap(), "a 1 MiB put cannot complete at once");
    let e = cep.try_put(&data, &key, (2 << 20) - 6).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
}

#[tokio::test]
async fn closed_endpoint_is_an_error() {
    let (_s, _c, _sep, cep) = pair("tcp,self").await;
    let other = cep.clone();
    tokio::time::timeout(T, cep.close()).await.unwrap().unwrap();
    let e = other.try_tag_send(1, b"late").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(other.try_am_send(1, &[], b"late").is_err());
}

/// A worker that takes UCX's request path for everything refuses the sends that only
/// complete at once, sends nothing for them, and goes on working.
#[tokio::test]
async fn no_immediate_completion_refuses() {
    let c = ctx("posix,cma,tcp,self");
    let w = c.worker().no_immediate_completion(true).build().unwrap();
    let opts = EndpointOptions { handshake: false, error_mode: ErrorMode::None, ..Default::default() };
    let ep =
        tokio::time::timeout(T, w.connect_address_with(&w.address().unwrap(), opts)).await.unwrap().unwrap();
    let region = c.alloc(64).unwrap();
    region.write_at(0, &[0u8; 64]);
    let key = ep.unpack_key(&region.pack_key().unwrap()).unwrap();
    assert!(!ep.try_tag_send(7, b"short").unwrap());
    assert!(!ep.try_am_send(3, &[], b"short").unwrap());
    assert!(!ep.try_put(b"short", &key, 0).unwrap());
    // The refused tag-7 message was not sent: the owned one is the first to arrive.
    let recv = w.tag_recv(7, tag::EXACT, Vec::with_capacity(8));
    ep.tag_send(7, &b"owned"[..]).await.0.unwrap();
    let (r, b) = tokio::time::timeout(T, recv).await.unwrap();
    r.unwrap();
    assert_eq!(b, b"owned");
    let mut got = [1u8; 5];
    region.read_at(0, &mut got);
    assert_eq!(got, [0u8; 5], "the refused put wrote nothing");
}
