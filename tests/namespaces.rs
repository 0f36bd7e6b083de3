//! Namespaces on one worker: the application's receives and each namespace's match only
//! their own messages, whatever the tags and masks; ids and tags outside a space are
//! refused; a claim is exclusive until its last handle goes.

#![deny(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::pair;
use ucxkit::transport::{am, namespace, tag, ErrorKind};

const T: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_stay_in_their_space() {
    let (s, c, sep, cep) = pair("tcp,self").await;
    let (ns_s, ns_c) =
        (s.namespace(namespace::COLLECTIVES).unwrap(), c.namespace(namespace::COLLECTIVES).unwrap());
    let (other_s, other_c) =
        (s.namespace(namespace::FIRST_FREE).unwrap(), c.namespace(namespace::FIRST_FREE).unwrap());
    // Receives that match any tag, posted before anything is sent, in every space.
    let app = s.tag_recv(0, tag::ANY, vec![0u8; 16]);
    let ns = ns_s.tag_recv(0, tag::ANY, vec![0u8; 16]);
    let other = other_s.tag_recv(0, tag::ANY, vec![0u8; 16]);
    // The same tag value in each space, sent in the reverse order.
    let t = 7u64;
    let (r, _) = other_c.tag_send(&cep, t, b"other".to_vec()).await;
    r.unwrap();
    let (r, _) = ns_c.tag_send(&cep, t, b"layer".to_vec()).await;
    r.unwrap();
    let (r, _) = cep.tag_send(t, b"app".to_vec()).await;
    r.unwrap();
    for (name, recv, want) in [("app", app, &b"app"[..]), ("layer", ns, b"layer"), ("other", other, b"other")]
    {
        let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
        let info = info.unwrap();
        assert_eq!(got, want, "{name}");
        assert_eq!(info.sender_tag, t, "{name}: the tag is reported local to the space");
    }
    // Probes and receives of any size see only their own space.
    let (r, _) = ns_c.tag_send(&cep, (1 << namespace::TAG_BITS) - 1, vec![1u8; 3]).await;
    r.unwrap();
    let deadline = std::time::Instant::now() + T;
    let info = loop {
        if let Some(i) = ns_s.tag_probe(0, tag::ANY).unwrap() {
            break i;
        }
        assert!(std::time::Instant::now() < deadline, "the namespace's message never arrived");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    assert_eq!(info.sender_tag, (1 << namespace::TAG_BITS) - 1);
    assert!(s.tag_probe(0, tag::ANY).is_none(), "the application sees the namespace's message");
    assert!(other_s.tag_probe(0, tag::ANY).unwrap().is_none());
    let (info, got) = tokio::time::timeout(T, ns_s.tag_recv_any(0, tag::ANY)).await.unwrap().unwrap();
    assert_eq!((info.len, got), (3, vec![1u8; 3]));
    // Vectored, and bound to an endpoint.
    let recv = ns_s.tag_recv_iov(9, tag::EXACT, vec![Vec::with_capacity(2), Vec::with_capacity(8)]);
    let (r, _) = ns_c.tag_send_iov(&cep, 9, vec![b"ab".to_vec(), b"cdef".to_vec()]).await;
    r.unwrap();
    let (info, bufs) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().sender_tag, 9);
    assert_eq!(bufs, vec![b"ab".to_vec(), b"cdef".to_vec()]);
    let recv = ns_s.tag_recv_from(&sep, 10, tag::EXACT, Vec::with_capacity(4));
    let sent = ns_c.try_tag_send(&cep, 10, b"imm").unwrap();
    if !sent {
        let (r, _) = ns_c.tag_send(&cep, 10, b"imm".to_vec()).await;
        r.unwrap();
    }
    let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!((info.unwrap().len, got), (3, b"imm".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_and_ids_outside_a_space_are_refused() {
    let (s, c, _sep, cep) = pair("tcp,self").await;
    let ns = c.namespace(3).unwrap();
    let (r, back) = cep.tag_send(1 << 63, b"x".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(back, b"x");
    assert_eq!(cep.try_tag_send(u64::MAX, b"x").unwrap_err().kind(), ErrorKind::InvalidInput);
    let (r, _) = s.tag_recv(1 << 63, tag::EXACT, vec![0u8; 4]).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    let (r, _) = s.tag_recv_iov(1 << 63, tag::EXACT, vec![vec![0u8; 4]]).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    let (r, _) = ns.tag_send(&cep, 1 << namespace::TAG_BITS, b"x".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(ns.tag_probe(1 << namespace::TAG_BITS, tag::EXACT).is_err());
    // Active-message ids: the application's end at am::MAX_ID, a namespace has
    // am::NAMESPACE_IDS.
    assert_eq!(s.am_recv(am::MAX_ID + 1).unwrap_err().kind(), ErrorKind::InvalidInput);
    let (r, _) = cep.am_send(am::MAX_ID + 1, b"", b"x".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(ns.am_recv(am::NAMESPACE_IDS).is_err());
    let (r, _) = ns.am_send(&cep, am::NAMESPACE_IDS, b"", b"x".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    // An endpoint of another worker: the namespace is not claimed there.
    let ns_s = s.namespace(3).unwrap();
    let (r, _) = ns_s.tag_send(&cep, 1, b"x".to_vec()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(ns_s.try_am_send(&cep, 0, b"", b"x").is_err());
    let (r, _) = ns_s.tag_recv_from(&cep, 1, tag::EXACT, vec![0u8; 4]).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_messages_stay_in_their_space() {
    let (s, c, _sep, cep) = pair("tcp,self").await;
    let ns_s = s.namespace(namespace::OBJECT_PUSH).unwrap();
    let ns_c = c.namespace(namespace::OBJECT_PUSH).unwrap();
    let other_s = s.namespace(namespace::COLLECTIVES).unwrap();
    let mut app = s.am_recv(0).unwrap();
    let mut ns = ns_s.am_recv(0).unwrap();
    let mut other = other_s.am_recv(0).unwrap();
    let (r, _) = ns_c.am_send(&cep, 0, b"h", b"layer".to_vec()).await;
    r.unwrap();
    let (r, _) = cep.am_send(0, b"h", b"app".to_vec()).await;
    r.unwrap();
    let m = tokio::time::timeout(T, ns.recv()).await.unwrap();
    assert_eq!(m.data(), Some(&b"layer"[..]));
    assert_eq!(Some(m.id()), ns_s.am_wire_id(0));
    let m = tokio::time::timeout(T, app.recv()).await.unwrap();
    assert_eq!(m.data(), Some(&b"app"[..]));
    assert!(other.try_recv().is_none());
    assert!(ns.try_recv().is_none());
    // A handler, and a reply in the namespace.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _h = ns_c
        .am_handler(1, move |m| {
            let _ = tx.send(m.data().map(<[u8]>::to_vec));
        })
        .unwrap();
    let opts = am::AmSendOptions { reply: true, ..Default::default() };
    let mut ping = ns_s.am_recv(2).unwrap();
    let (r, _) = ns_c.am_send_with(&cep, 2, b"", b"ping".to_vec(), opts).await;
    r.unwrap();
    let m = tokio::time::timeout(T, ping.recv()).await.unwrap();
    let (r, _) = ns_s.reply(&m, 1, b"", b"pong".to_vec()).unwrap().await;
    r.unwrap();
    assert_eq!(tokio::time::timeout(T, rx.recv()).await.unwrap().unwrap(), Some(b"pong".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_exclusive_until_its_last_handle_goes() {
    let (s, _c, _sep, _cep) = pair("tcp,self").await;
    for bad in [0u8, namespace::LAST + 1, 255] {
        assert_eq!(s.namespace(bad).unwrap_err().kind(), ErrorKind::InvalidInput, "{bad}");
    }
    let a = s.namespace(namespace::LAST).unwrap();
    assert_eq!(a.number(), namespace::LAST);
    let b = a.clone();
    assert_eq!(s.namespace(namespace::LAST).unwrap_err().kind(), ErrorKind::InvalidInput);
    drop(a);
    assert!(s.namespace(namespace::LAST).is_err(), "a clone still holds the claim");
    drop(b);
    let _again = s.namespace(namespace::LAST).unwrap();
    // Claims are per worker.
    let other = s.context().create_worker().unwrap();
    let _there = other.namespace(namespace::LAST).unwrap();
}

/// A worker without namespaces gives the application every tag bit and id up to 4094
/// (as plain UCX peers may use them) and refuses claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_namespaces() {
    let c = common::ctx("tcp,self");
    let s = c.worker().namespaces(false).build().unwrap();
    let cw = c.worker().namespaces(false).build().unwrap();
    assert_eq!(s.namespace(1).unwrap_err().kind(), ErrorKind::InvalidInput);
    let l = s.listen(common::loopback()).unwrap();
    let (a, b) = tokio::join!(l.accept(), cw.connect(l.local_addr()));
    let (_a, cep) = (a.unwrap(), b.unwrap());
    let recv = s.tag_recv(u64::MAX, tag::EXACT, vec![0u8; 4]);
    let (r, _) = cep.tag_send(u64::MAX, b"top".to_vec()).await;
    r.unwrap();
    let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!((info.unwrap().sender_tag, got), (u64::MAX, b"top".to_vec()));
    let mut high = s.am_recv(4094).unwrap();
    let (r, _) = cep.am_send(4094, b"", b"id".to_vec()).await;
    r.unwrap();
    assert_eq!(tokio::time::timeout(T, high.recv()).await.unwrap().data(), Some(&b"id"[..]));
    assert!(s.am_recv(4095).is_err());
}

/// A namespace's active messages sent before its receiver is registered are held for
/// it, as the application's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_namespace_messages_are_held() {
    let (s, c, _sep, cep) = pair("tcp,self").await;
    let ns_c = c.namespace(namespace::LAST).unwrap();
    let ns_s = s.namespace(namespace::LAST).unwrap();
    let (r, _) = ns_c.am_send(&cep, am::NAMESPACE_IDS - 1, b"", b"early".to_vec()).await;
    r.unwrap();
    let wire = ns_s.am_wire_id(am::NAMESPACE_IDS - 1).unwrap();
    let deadline = std::time::Instant::now() + T;
    while s.am_unclaimed() != vec![(wire, 1)] {
        assert!(
            std::time::Instant::now() < deadline,
            "the early message was not held: {:?}",
            s.am_unclaimed()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut rx = ns_s.am_recv(am::NAMESPACE_IDS - 1).unwrap();
    assert_eq!(tokio::time::timeout(T, rx.recv()).await.unwrap().data(), Some(&b"early"[..]));
    assert_eq!(s.am_dropped(), 0);
}
