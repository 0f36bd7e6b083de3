//! One object to many receivers in one process: every shape delivers byte-exact and
//! the owner sends as many copies as its shape says (the rest is relayed); a relay that
//! refuses the object leaves its receivers to pull from the owner; hostile offers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ucxkit_object_push::wire::{encode_addresses, Msg};
use ucxkit_object_push::{Error, MemoryStore, NodeOptions, ObjectId, ObjectNode, Shape, Verify};
use ucxkit_testkit::payload::payload;
use ucxkit_testkit::workers::{loopback, mesh_with, Mesh};
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::namespace::OBJECT_PUSH;
use ucxkit_transport::ProgressMode;

const T: Duration = Duration::from_secs(60);

fn id(s: &str) -> ObjectId {
    ObjectId::try_from(s).unwrap()
}

fn small() -> NodeOptions {
    NodeOptions { chunk: 4096, window: 3, inline_max: 1000, verify: Verify::Always, ..NodeOptions::default() }
}

/// An owner (node 0) and `n - 1` receivers; receiver `i`'s store holds at most
/// `room(i)` bytes.
async fn nodes(tls: &str, n: usize, room: impl Fn(usize) -> Option<u64>) -> (Mesh, Vec<ObjectNode>) {
    let mesh = mesh_with(tls, n, ProgressMode::Event).await;
    let nodes = mesh
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let store = match room(i) {
                Some(b) => MemoryStore::with_capacity(b),
                None => MemoryStore::new(),
            };
            let node = ObjectNode::new(w, Arc::new(store), small()).expect("node");
            node.listen(loopback()).expect("listen");
            node
        })
        .collect();
    (mesh, nodes)
}

/// The node's counts once it serves no request (a chunk counts once its send ended,
/// which may be after its receiver had it).
async fn settled(node: &ObjectNode) -> ucxkit_object_push::NodeStats {
    tokio::time::timeout(T, async {
        while node.stats().serving > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the node's sends end");
    node.stats()
}

fn receivers(mesh: &Mesh, n: usize) -> Vec<ucxkit_transport::Endpoint> {
    (1..n).map(|r| mesh.ep(0, r).clone()).collect()
}

#[tokio::test]
async fn every_shape_delivers_byte_exact_and_the_owner_sends_only_its_share() {
    const N: usize = 8;
    let (mesh, n) = nodes("posix,cma,tcp,self", N, |_| None).await;
    let to = receivers(&mesh, N);
    // 25 chunks of 4 KiB (the last one short).
    let bytes = Bytes::from(payload(3, 100_000));
    let count = 25;
    // Shape, copies the owner sends (receivers at the top of the shape).
    let cases = [(Shape::Direct, 7), (Shape::Chain, 1), (Shape::Tree(2), 2), (Shape::Tree(3), 3)];
    for (k, (shape, copies)) in cases.into_iter().enumerate() {
        let o = id(&format!("b{k}"));
        n[0].put(o, bytes.clone()).unwrap();
        let sent = settled(&n[0]).await.chunks_sent;
        let b = tokio::time::timeout(T, n[0].broadcast(o, &to, shape)).await.unwrap().unwrap();
        assert!(b.is_ok(), "{shape}: {:?}", b.first_error());
        assert_eq!(b.shape, shape);
        for (r, node) in n.iter().enumerate().skip(1) {
            assert!(node.get(&o).expect("sealed").bytes() == Some(&bytes), "{shape}: receiver {r}");
        }
        let st: Vec<_> = n.iter().map(|x| x.stats()).collect();
        assert_eq!(
            settled(&n[0]).await.chunks_sent - sent,
            copies * count,
            "{shape}: the owner's chunks {st:#?}"
        );
    }
    // Receivers on this host, through shared memory: the model's pick is direct sends.
    n[0].put(id("auto"), bytes.clone()).unwrap();
    let b = tokio::time::timeout(T, n[0].broadcast_auto(id("auto"), &to)).await.unwrap().unwrap();
    assert!(b.is_ok() && b.shape == Shape::Direct, "{b:?}");
    assert!(n[7].get(&id("auto")).unwrap().bytes() == Some(&bytes));
    for node in &n {
        assert_eq!(node.stats().malformed + node.stats().refetched + node.stats().holders_failed, 0);
    }
}

#[tokio::test]
async fn a_relay_without_room_leaves_its_receivers_to_the_owner() {
    // Receivers 0..4 in a chain; receiver 1 (node 2) has no room for the object.
    let (mesh, n) = nodes("posix,cma,tcp,self", 5, |i| (i == 2).then_some(1000)).await;
    let to = receivers(&mesh, 5);
    let bytes = Bytes::from(payload(9, 50_000));
    n[0].put(id("o"), bytes.clone()).unwrap();
    let b = tokio::time::timeout(T, n[0].broadcast(id("o"), &to, Shape::Chain)).await.unwrap().unwrap();
    let failed: Vec<usize> =
        b.results.iter().enumerate().filter(|(_, r)| r.is_err()).map(|(i, _)| i).collect();
    assert_eq!(failed, [1], "{:?}", b.results);
    assert!(
        matches!(b.first_error(), Some((1, Error::Remote(r))) if r.contains("no room")),
        "{:?}",
        b.results
    );
    for r in [1, 3, 4] {
        assert!(n[r].get(&id("o")).unwrap().bytes() == Some(&bytes), "node {r}");
    }
    assert!(n[2].get(&id("o")).is_none());
}

#[tokio::test]
async fn broadcasts_of_objects_not_held_and_to_nobody() {
    let (mesh, n) = nodes("posix,cma,tcp,self", 2, |_| None).await;
    let err = n[0].broadcast(id("none"), &receivers(&mesh, 2), Shape::Chain).await.unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err}");
    n[0].put(id("o"), Bytes::from_static(b"x")).unwrap();
    let b = n[0].broadcast(id("o"), &[], Shape::Tree(2)).await.unwrap();
    assert!(b.is_ok() && b.results.is_empty());
}

/// Offers whose relays are garbage: refused as malformed (and answered so); one that
/// names the receiver itself or an address nobody listens on: those relays are skipped
/// and the object pulled from the offerer.
#[tokio::test]
async fn hostile_offers_are_refused_or_pulled_from_the_offerer() {
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let rogue = mesh.workers[0].namespace(OBJECT_PUSH).unwrap();
    let node = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), small()).unwrap();
    let own = node.listen("0.0.0.0:0".parse().unwrap()).unwrap();
    assert!(node.listen(loopback()).is_err(), "a node listens once");
    let mut requests = rogue.am_recv(0).unwrap();
    let mut answers = rogue.am_recv(1).unwrap();
    let closed = {
        let l = std::net::TcpListener::bind(loopback()).unwrap();
        l.local_addr().unwrap()
    };
    let own = std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), own.port());
    let cases: [(u8, Vec<u8>); 6] = [
        (1, vec![1, 2, 3]),
        // More bytes than one relay's address can take: refused before it is read.
        (1, vec![b'1'; 200]),
        (2, encode_addresses(&[own])),
        (0, encode_addresses(&[own])),
        (1, [&[5][..], b"UCXA!"].concat()),
        (2, encode_addresses(&[own, closed])),
    ];
    let opts = AmSendOptions { reply: true, ..Default::default() };
    for (req, (relays, payload)) in cases.into_iter().enumerate() {
        let offer = Msg::Offer { req: req as u32, id: id("o"), size: 20_000, relays }.encode();
        rogue.am_send_with(mesh.ep(0, 1), 0, &offer, Bytes::from(payload), opts).await.0.unwrap();
    }
    // The last offer's pull asks the offerer (no relay left), which does not have it.
    let m = tokio::time::timeout(T, requests.recv()).await.unwrap();
    let Msg::Lookup { req, wait_ms: 0, .. } = Msg::decode(m.header()).unwrap() else { panic!("a lookup") };
    rogue.reply(&m, 1, &Msg::Missing { req }.encode(), Bytes::new()).unwrap().await.0.unwrap();
    let mut reasons = vec![String::new(); 6];
    for _ in 0..6 {
        let m = tokio::time::timeout(T, answers.recv()).await.unwrap();
        let Msg::Failed { req, reason } = Msg::decode(m.header()).unwrap() else { panic!("failed") };
        reasons[req as usize] = reason;
    }
    for r in &reasons[..5] {
        assert!(r.contains("malformed"), "{reasons:?}");
    }
    assert!(reasons[1].contains("at most 65"), "{reasons:?}");
    assert!(reasons[5].contains("not held"), "{reasons:?}");
    assert_eq!(node.stats().malformed, 5);
    assert!(node.get(&id("o")).is_none());
}
