//! Pulls between nodes of one process: sizes around the chunk and window edges,
//! byte-exact, over shared memory and TCP; relays; missing objects; store refusals;
//! corrupt chunks refetched or reported; malformed and hostile peers; deadlines.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ucxkit_object_push::wire::{encode_sums, Msg};
mod common;

use common::{take_one, Bent};
use ucxkit_object_push::{Error, MemoryStore, NodeOptions, Object, ObjectId, ObjectNode, Verify};
use ucxkit_testkit::payload::payload;
use ucxkit_testkit::workers::{mesh_with, wait_parked_zero, Mesh};
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::namespace::OBJECT_PUSH;
use ucxkit_transport::ProgressMode;

const T: Duration = Duration::from_secs(60);

fn id(s: &str) -> ObjectId {
    ObjectId::try_from(s).unwrap()
}

/// Small chunks and windows, so that a few KiB take several windows.
fn small() -> NodeOptions {
    NodeOptions { chunk: 4096, window: 3, inline_max: 1000, verify: Verify::Always, ..NodeOptions::default() }
}

async fn nodes(tls: &str, n: usize, opts: NodeOptions) -> (Mesh, Vec<ObjectNode>) {
    let mesh = mesh_with(tls, n, ProgressMode::Event).await;
    let nodes = mesh
        .workers
        .iter()
        .map(|w| ObjectNode::new(w, Arc::new(MemoryStore::new()), opts.clone()).expect("node"))
        .collect();
    (mesh, nodes)
}

#[tokio::test]
async fn objects_of_every_edge_size_arrive_byte_exact_and_can_be_relayed() {
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let (mesh, n) = nodes(tls, 3, small()).await;
        // Empty, one byte, inline limit and one past, a chunk less one, a chunk, a chunk
        // more one, a window's worth of chunks and one more, many windows.
        for (i, len) in
            [0usize, 1, 1000, 1001, 4095, 4096, 4097, 3 * 4096 + 1, 100_000].into_iter().enumerate()
        {
            let o = id(&format!("o{i}"));
            let bytes = Bytes::from(payload(i as u64, len));
            n[0].put(o, bytes.clone()).unwrap();
            let got = tokio::time::timeout(T, n[1].pull(o, mesh.ep(1, 0))).await.unwrap().unwrap();
            assert_eq!(got.bytes(), Some(&bytes), "{tls} {len} B");
            assert_eq!(n[1].get(&o).unwrap().bytes(), Some(&bytes), "sealed in the puller's store");
            // The puller serves it onwards.
            let relayed = tokio::time::timeout(T, n[2].pull(o, mesh.ep(2, 1))).await.unwrap().unwrap();
            assert_eq!(relayed.bytes(), Some(&bytes), "{tls} {len} B relayed");
        }
        for node in &n {
            assert_eq!(node.stats().malformed + node.stats().refetched, 0);
        }
    }
}

#[tokio::test]
async fn default_chunks_move_a_few_mebibytes() {
    let (mesh, n) = nodes("posix,cma,tcp,self", 2, NodeOptions::default()).await;
    let bytes = Bytes::from(payload(7, (9 << 20) + 123));
    n[0].put(id("big"), bytes.clone()).unwrap();
    let got = tokio::time::timeout(T, n[1].pull(id("big"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
    assert_eq!(got.layout().count(), 10);
    // Released, its memory is kept and the next pull lands in it.
    let ptr = got.bytes().unwrap().as_ptr();
    drop(got);
    assert!(n[1].release(&id("big")));
    assert_eq!(n[1].stats().kept, bytes.len() as u64);
    let again = tokio::time::timeout(T, n[1].pull(id("big"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert!(again.bytes() == Some(&bytes));
    assert_eq!((again.bytes().unwrap().as_ptr(), n[1].stats().kept), (ptr, 0));
}

#[tokio::test]
async fn missing_objects_and_full_stores_are_errors_that_leave_nothing_behind() {
    let mesh = mesh_with("posix,tcp,self", 2, ProgressMode::Event).await;
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let store = Arc::new(MemoryStore::with_capacity(10_000));
    let puller = ObjectNode::new(&mesh.workers[1], store.clone(), small()).unwrap();
    let err = tokio::time::timeout(T, puller.pull(id("none"), mesh.ep(1, 0))).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::NotFound(o) if o == id("none")), "{err}");
    holder.put(id("big"), Bytes::from(payload(1, 20_000))).unwrap();
    let err = tokio::time::timeout(T, puller.pull(id("big"), mesh.ep(1, 0))).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert_eq!(store.used(), 0, "the room reserved is given back");
    assert!(puller.get(&id("big")).is_none());
    holder.put(id("fits"), Bytes::from(payload(2, 9000))).unwrap();
    tokio::time::timeout(T, puller.pull(id("fits"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert_eq!(store.used(), 9000);
}

#[tokio::test]
async fn corrupt_chunks_are_fetched_again_or_reported() {
    let mesh = mesh_with("posix,tcp,self", 3, ProgressMode::Event).await;
    // The first `lies` reads hand out the object with one byte flipped in each chunk
    // after the first (the layout stays the true one).
    let lies = Arc::new(AtomicU32::new(0));
    let lying = Bent::new({
        let lies = lies.clone();
        move |o: Object| {
            if !take_one(&lies) {
                return Some(o);
            }
            let mut b = o.bytes().unwrap().to_vec();
            for k in 1..o.layout().count() {
                b[o.layout().range(k).start] ^= 0x20;
            }
            Some(Object::new(Bytes::from(b), o.layout().clone()).unwrap())
        }
    });
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(lying), small()).unwrap();
    // The holder is on this host: its chunks are checked only when asked (`small`).
    let puller = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), small()).unwrap();
    let bytes = Bytes::from(payload(3, 5 * 4096));
    holder.put(id("o"), bytes.clone()).unwrap();
    // The lookup reads the store once, then the first fetch (chunks 0..3) gets lies.
    lies.store(2, Ordering::SeqCst);
    let got = tokio::time::timeout(T, puller.pull(id("o"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
    assert_eq!(puller.stats().refetched, 2, "chunks 1 and 2 came corrupt once");
    // Lies on every read: the chunk is reported after the node's tries.
    lies.store(u32::MAX, Ordering::SeqCst);
    holder.put(id("p"), bytes.clone()).unwrap();
    let err = tokio::time::timeout(T, puller.pull(id("p"), mesh.ep(1, 0))).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Corrupt { chunk: 1..=4, tries: 3, .. }), "{err}");
    assert!(puller.get(&id("p")).is_none(), "nothing unverified is sealed");
    // By default, a holder on this host is trusted: its chunks are not checked.
    assert_eq!(NodeOptions::default().verify, Verify::OtherHosts);
    let default = NodeOptions { verify: Verify::OtherHosts, ..small() };
    let trusting = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), default).unwrap();
    let got = tokio::time::timeout(T, trusting.pull(id("p"), mesh.ep(2, 0))).await.unwrap().unwrap();
    assert!(got.bytes() != Some(&bytes) && trusting.stats().refetched == 0);
}

/// A peer that speaks the protocol badly: garbage requests and answers are dropped and
/// counted, a malformed layout ends the pull with a protocol error, a holder that never
/// answers ends it at the deadline; the node serves correct peers all along.
#[tokio::test]
async fn malformed_and_silent_peers_end_in_errors_not_panics() {
    let mesh = mesh_with("posix,tcp,self", 3, ProgressMode::Event).await;
    let opts = NodeOptions { deadline: Duration::from_millis(500), ..small() };
    let node = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let honest = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), opts).unwrap();
    let rogue = mesh.workers[1].namespace(OBJECT_PUSH).unwrap();
    let (to_node, reply) = (mesh.ep(1, 0), AmSendOptions { reply: true, ..Default::default() });
    let garbage: [&[u8]; 4] = [b"", &[1, 1, 0], &[9, 9, 9, 9, 9, 9], &[1, 4, 0, 0, 0, 0]];
    for (i, g) in garbage.iter().enumerate() {
        for am in [0u16, 1] {
            let (r, _) = rogue.am_send_with(to_node, am, g, Bytes::new(), reply).await;
            r.unwrap();
        }
        // A valid request without a way to answer.
        let lookup = Msg::Lookup { req: i as u32, id: id("x"), inline_max: 10, wait_ms: 0 };
        rogue.am_send(to_node, 0, &lookup.encode(), Bytes::new()).await.0.unwrap();
    }
    let want = 2 * garbage.len() as u64 + garbage.len() as u64;
    let t = std::time::Instant::now();
    while node.stats().malformed < want && t.elapsed() < T {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each garbage header sent as a request and as an answer, and each lookup that
    // cannot be answered, counted once.
    assert_eq!(node.stats().malformed, want, "{:?}", node.stats());
    // The node still serves.
    node.put(id("ok"), Bytes::from(payload(4, 9000))).unwrap();
    tokio::time::timeout(T, honest.pull(id("ok"), mesh.ep(2, 0))).await.unwrap().unwrap();

    // The rogue as a holder: a layout whose checksums do not match its size.
    let mut requests = rogue.am_recv(0).unwrap();
    let pull = node.pull(id("bad"), mesh.ep(0, 1));
    let serve = async {
        let m = requests.recv().await;
        let Msg::Lookup { req, .. } = Msg::decode(m.header()).unwrap() else { panic!() };
        let layout = Msg::Layout { req, size: 10_000, chunk: 4096 };
        rogue.reply(&m, 1, &layout.encode(), Bytes::from(encode_sums(&[1, 2]))).unwrap().await.0.unwrap();
        // Then one that never answers.
        requests.recv().await
    };
    let (r, _) = tokio::join!(
        async {
            let first = pull.await;
            let second = node.pull(id("silent"), mesh.ep(0, 1)).await;
            (first, second)
        },
        serve
    );
    assert!(matches!(r.0, Err(Error::Protocol(_))), "{:?}", r.0);
    assert!(matches!(r.1, Err(Error::DeadlineExceeded { .. })), "{:?}", r.1);
}

/// A pull dropped while its chunks are in flight: the receives it posted stay with the
/// transport until UCX lets go, its store room is given back, and the next pull of the
/// same object works (run under valgrind by the test command; its chunks are small
/// enough to go eagerly, so no holder's send outlives the test).
#[tokio::test]
async fn a_pull_dropped_mid_transfer_leaves_nothing_behind() {
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let store = Arc::new(MemoryStore::new());
    let puller = ObjectNode::new(&mesh.workers[1], store.clone(), small()).unwrap();
    let bytes = Bytes::from(payload(5, 2 << 20));
    holder.put(id("o"), bytes.clone()).unwrap();
    for wait_us in [0, 50, 300, 2000] {
        let pull = puller.pull(id("o"), mesh.ep(1, 0));
        let _ = tokio::time::timeout(Duration::from_micros(wait_us), pull).await;
        if puller.get(&id("o")).is_some() {
            assert!(puller.release(&id("o")));
        }
        assert_eq!(store.used(), 0, "dropped after {wait_us} us");
    }
    let got = tokio::time::timeout(T, puller.pull(id("o"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
}

/// A puller that gives up tells its holder, which stops sending, and takes in the chunks
/// already announced: with chunks large enough to go by rendezvous, a send whose receive
/// is gone waits for ever otherwise (the holder's task for the fetch's limit, a minute,
/// and the transport's hold on the chunk until the endpoint closes). Nothing is left
/// sending or held soon after.
#[tokio::test]
async fn a_holder_stops_sending_when_the_puller_gives_up() {
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let opts = NodeOptions { chunk: 64 << 10, window: 4, ..small() };
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let puller = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), opts).unwrap();
    let bytes = Bytes::from(payload(5, 4 << 20));
    holder.put(id("o"), bytes.clone()).unwrap();
    for wait_us in [0, 50, 300, 2000] {
        let _ =
            tokio::time::timeout(Duration::from_micros(wait_us), puller.pull(id("o"), mesh.ep(1, 0))).await;
        puller.release(&id("o"));
    }
    let got = tokio::time::timeout(T, puller.pull(id("o"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
    let t = std::time::Instant::now();
    while holder.stats().serving > 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the holder still serves {:?}", holder.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The chunks already announced were taken in by the puller: the holder's transport
    // holds no send (and so no object memory) for them.
    wait_parked_zero(&mesh.workers[0], Duration::from_secs(10)).await;
}

/// Several holders: the chunks are spread over those that have the object (one that
/// does not is skipped); one that loses it mid-transfer leaves its chunks to the other;
/// with every holder gone the pull fails with the last holder's reason.
#[tokio::test]
async fn chunks_spread_over_holders_and_move_on_when_one_fails() {
    let mesh = mesh_with("posix,cma,tcp,self", 4, ProgressMode::Event).await;
    let opts = NodeOptions { window: 2, ..small() };
    // B's store forgets its objects after `reads` reads: its node then answers fetches
    // with `Failed`, as a holder that lost the object mid-transfer.
    let reads = Arc::new(AtomicU32::new(u32::MAX));
    let forgetful = Arc::new(Bent::new({
        let reads = reads.clone();
        move |o| take_one(&reads).then_some(o)
    }));
    let a = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let b = ObjectNode::new(&mesh.workers[1], forgetful.clone(), opts.clone()).unwrap();
    let _c = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let puller = ObjectNode::new(&mesh.workers[3], Arc::new(MemoryStore::new()), opts).unwrap();
    let holders: Vec<_> = (0..3).map(|h| mesh.ep(3, h).clone()).collect();
    let bytes = Bytes::from(payload(6, 64 * 4096 + 5));
    a.put(id("o"), bytes.clone()).unwrap();
    b.put(id("o"), bytes.clone()).unwrap();
    let got = tokio::time::timeout(T, puller.pull_from(id("o"), &holders)).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
    let (sa, sb) = (a.stats().chunks_sent, b.stats().chunks_sent);
    assert_eq!(sa + sb, 65, "each chunk sent once");
    assert!(sa > 0 && sb > 0, "both holders served: {sa} + {sb}");
    // B answers its lookup and a few fetches, then has lost the object.
    b.put(id("p"), bytes.clone()).unwrap();
    a.put(id("p"), bytes.clone()).unwrap();
    reads.store(4, Ordering::SeqCst);
    let got = tokio::time::timeout(T, puller.pull_from(id("p"), &holders)).await.unwrap().unwrap();
    assert!(got.bytes() == Some(&bytes));
    assert_eq!(puller.stats().holders_failed, 1);
    // Only B has it, and loses it: the pull fails with B's reason.
    b.put(id("q"), bytes.clone()).unwrap();
    reads.store(3, Ordering::SeqCst);
    let err = tokio::time::timeout(T, puller.pull_from(id("q"), &holders)).await.unwrap().unwrap_err();
    assert!(matches!(&err, Error::Remote(r) if r.contains("no longer held")), "{err}");
    assert!(puller.get(&id("q")).is_none());
    let err = tokio::time::timeout(T, puller.pull_from(id("q"), &[])).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

/// Pulls of one object at once share one transfer: the holder sends each chunk once and
/// every pull gets the object.
#[tokio::test]
async fn concurrent_pulls_of_one_object_share_one_transfer() {
    let (mesh, n) = nodes("posix,cma,tcp,self", 2, small()).await;
    let bytes = Bytes::from(payload(8, 40 * 4096));
    n[0].put(id("o"), bytes.clone()).unwrap();
    let pulls = (0..4).map(|_| n[1].pull(id("o"), mesh.ep(1, 0)));
    let got = tokio::time::timeout(T, futures_util::future::join_all(pulls)).await.unwrap();
    for g in got {
        assert!(g.unwrap().bytes() == Some(&bytes));
    }
    assert_eq!(n[0].stats().chunks_sent, 40);
}

/// Pushes: the receiver pulls the offered object and holds it when the push returns; a
/// receiver without room refuses (and keeps nothing); an object the pusher does not hold
/// cannot be pushed.
#[tokio::test]
async fn pushed_objects_arrive_within_the_receivers_room() {
    let mesh = mesh_with("posix,cma,tcp,self", 3, ProgressMode::Event).await;
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let roomy = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), small()).unwrap();
    let tight_store = Arc::new(MemoryStore::with_capacity(50_000));
    let tight = ObjectNode::new(&mesh.workers[2], tight_store.clone(), small()).unwrap();
    for (name, len) in [("small", 100), ("big", 100_000)] {
        let bytes = Bytes::from(payload(len as u64, len));
        owner.put(id(name), bytes.clone()).unwrap();
        tokio::time::timeout(T, owner.push(id(name), mesh.ep(0, 1))).await.unwrap().unwrap();
        assert!(roomy.get(&id(name)).unwrap().bytes() == Some(&bytes), "{name}");
    }
    // Pushed again: already held, done at once.
    tokio::time::timeout(T, owner.push(id("big"), mesh.ep(0, 1))).await.unwrap().unwrap();
    let err = tokio::time::timeout(T, owner.push(id("big"), mesh.ep(0, 2))).await.unwrap().unwrap_err();
    assert!(matches!(&err, Error::Remote(r) if r.contains("no room")), "{err}");
    assert_eq!((tight_store.used(), tight.get(&id("big")).is_none()), (0, true));
    tokio::time::timeout(T, owner.push(id("small"), mesh.ep(0, 2))).await.unwrap().unwrap();
    let err = tokio::time::timeout(T, owner.push(id("none"), mesh.ep(0, 1))).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err}");
    // A receiver waiting for an object gets it when a push brings it.
    let bytes = Bytes::from(payload(9, 30_000));
    owner.put(id("later"), bytes.clone()).unwrap();
    let (waited, pushed) = tokio::join!(roomy.wait(id("later"), T), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        owner.push(id("later"), mesh.ep(0, 1)).await
    });
    pushed.unwrap();
    assert!(waited.unwrap().bytes() == Some(&bytes));
    let err = roomy.wait(id("never"), Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(err, Error::DeadlineExceeded { .. }), "{err}");
}

/// The node's room for chunks in flight bounds all its pulls together, and a prefetch
/// uses at most half of it (sampled while the transfers run).
#[tokio::test]
async fn chunks_in_flight_stay_within_the_nodes_room() {
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let room = 5 * 4096;
    let opts = NodeOptions { window: 4, in_flight: room, ..small() };
    let puller = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), opts).unwrap();
    let objects: Vec<_> =
        (0..3).map(|i| (id(&format!("o{i}")), Bytes::from(payload(20 + i, 300 * 4096)))).collect();
    for (o, b) in &objects {
        holder.put(*o, b.clone()).unwrap();
    }
    let most = std::sync::atomic::AtomicU64::new(0);
    let watch = || async {
        loop {
            most.fetch_max(puller.stats().in_flight, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    };
    let ep = mesh.ep(1, 0);
    let pulls = async {
        let (a, b) = tokio::join!(puller.pull(objects[0].0, ep), puller.pull(objects[1].0, ep));
        (a.unwrap(), b.unwrap())
    };
    let (a, b) = tokio::select! {
        r = tokio::time::timeout(T, pulls) => r.unwrap(),
        () = watch() => unreachable!(),
    };
    assert!(a.bytes() == Some(&objects[0].1) && b.bytes() == Some(&objects[1].1));
    let seen = most.swap(0, Ordering::Relaxed);
    assert!(seen > 0 && seen <= room, "{seen} bytes in flight, room {room}");
    let p = tokio::select! {
        r = tokio::time::timeout(T, puller.prefetch_from(objects[2].0, std::slice::from_ref(ep))) => r.unwrap().unwrap(),
        () = watch() => unreachable!(),
    };
    assert!(p.bytes() == Some(&objects[2].1));
    let seen = most.load(Ordering::Relaxed);
    assert!(seen > 0 && seen <= room / 2, "a prefetch had {seen} bytes in flight, room {room}");
    assert_eq!(puller.stats().in_flight, 0);
}

/// A node relays an object while it pulls it: a third node pulls it only from the
/// second, which is still receiving it from the first, and gets it byte-exact; every
/// chunk it got came through the relay.
#[tokio::test]
async fn an_object_is_relayed_while_it_arrives() {
    let (mesh, n) = nodes("posix,cma,tcp,self", 3, NodeOptions { window: 2, ..small() }).await;
    let bytes = Bytes::from(payload(31, 600 * 4096 + 7));
    n[0].put(id("o"), bytes.clone()).unwrap();
    let first = n[1].pull(id("o"), mesh.ep(1, 0));
    let relayed = async {
        // Once the relay's transfer is under way (its layout known, chunks asked for).
        while n[1].stats().in_flight == 0 && n[1].get(&id("o")).is_none() {
            tokio::task::yield_now().await;
        }
        n[2].pull(id("o"), mesh.ep(2, 1)).await
    };
    let (a, b) = tokio::time::timeout(T, async { tokio::join!(first, relayed) }).await.unwrap();
    assert!(a.unwrap().bytes() == Some(&bytes));
    assert!(b.unwrap().bytes() == Some(&bytes), "relayed byte-exact");
    assert_eq!(n[1].stats().chunks_sent, 601, "every chunk through the relay");
    assert_eq!(n[0].stats().chunks_sent, 601, "the owner sent each chunk once");
}

/// A relay whose own puller gives up still ends its transfer at once, byte-exact: the
/// pieces its sends borrowed come back (the puller takes in what it abandoned), so the
/// relay joins its object without waiting or fetching again.
#[tokio::test]
async fn a_relay_keeps_its_object_when_its_puller_gives_up() {
    let opts = NodeOptions { chunk: 64 << 10, window: 2, ..small() };
    let (mesh, n) = nodes("posix,cma,tcp,self", 3, opts).await;
    let bytes = Bytes::from(payload(32, 8 << 20));
    n[0].put(id("o"), bytes.clone()).unwrap();
    let relay = n[1].pull(id("o"), mesh.ep(1, 0));
    let quitter = async {
        while n[1].stats().in_flight == 0 && n[1].get(&id("o")).is_none() {
            tokio::task::yield_now().await;
        }
        let _ = tokio::time::timeout(Duration::from_millis(2), n[2].pull(id("o"), mesh.ep(2, 1))).await;
    };
    let t = std::time::Instant::now();
    let (got, ()) = tokio::time::timeout(T, async { tokio::join!(relay, quitter) }).await.unwrap();
    assert!(got.unwrap().bytes() == Some(&bytes));
    assert!(t.elapsed() < Duration::from_secs(2), "the relay waited for its pieces: {:?}", t.elapsed());
    assert_eq!(n[1].stats().refetched, 0);
}

/// A pull waits for room in the store (given back when an object is released) and says
/// so when none comes within the node's `room_wait`; a holder sending to several
/// pullers within a send room of one chunk serves them all.
#[tokio::test]
async fn pulls_wait_for_room_and_sends_wait_for_theirs() {
    let mesh = mesh_with("posix,cma,tcp,self", 4, ProgressMode::Event).await;
    let one_chunk = NodeOptions { send_in_flight: 4096, ..small() };
    let holder = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), one_chunk).unwrap();
    let store = Arc::new(MemoryStore::with_capacity(30_000));
    let patient = NodeOptions { room_wait: T, ..small() };
    let puller = ObjectNode::new(&mesh.workers[1], store.clone(), patient).unwrap();
    let other = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), small()).unwrap();
    let impatient = NodeOptions { room_wait: Duration::from_millis(100), ..small() };
    let hasty =
        ObjectNode::new(&mesh.workers[3], Arc::new(MemoryStore::with_capacity(30_000)), impatient).unwrap();
    let (a, b) = (Bytes::from(payload(1, 20_000)), Bytes::from(payload(2, 20_000)));
    holder.put(id("a"), a.clone()).unwrap();
    holder.put(id("b"), b.clone()).unwrap();
    // Two pullers at once, through a send room of one chunk.
    let (x, y) = tokio::join!(puller.pull(id("a"), mesh.ep(1, 0)), other.pull(id("a"), mesh.ep(2, 0)));
    assert!(x.unwrap().bytes() == Some(&a) && y.unwrap().bytes() == Some(&a));
    // No room for b until a goes.
    let (got, released) = tokio::join!(puller.pull(id("b"), mesh.ep(1, 0)), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        puller.release(&id("a"))
    });
    assert!(released && got.unwrap().bytes() == Some(&b));
    assert_eq!(store.used(), 20_000);
    // None comes: the pull says so after its wait, and keeps nothing.
    hasty.pull(id("a"), mesh.ep(3, 0)).await.unwrap();
    let err = hasty.pull(id("b"), mesh.ep(3, 0)).await.unwrap_err();
    assert!(matches!(&err, Error::NoRoom(r) if r.contains("still after 100ms")), "{err}");
    assert!(hasty.get(&id("b")).is_none());
}

/// A transfer under way reports how far it came, and no longer once it ended; the
/// application cannot put an object of the id it is receiving.
#[tokio::test]
async fn a_transfer_reports_its_progress_while_it_lasts() {
    let mesh = mesh_with("posix,tcp,self", 2, ProgressMode::Event).await;
    let node = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    // A holder that answers the lookup and then sends nothing.
    let silent = mesh.workers[1].namespace(OBJECT_PUSH).unwrap();
    let mut requests = silent.am_recv(0).unwrap();
    let pull = node.pull(id("slow"), mesh.ep(0, 1));
    let serve = async {
        let m = requests.recv().await;
        let Msg::Lookup { req, .. } = Msg::decode(m.header()).unwrap() else { panic!("a lookup") };
        let layout = Msg::Layout { req, size: 10_000, chunk: 4096 };
        silent.reply(&m, 1, &layout.encode(), Bytes::from(encode_sums(&[1, 2, 3]))).unwrap().await.0.unwrap();
        // The fetch comes once the transfer is under way.
        requests.recv().await;
        // Meanwhile the application cannot put the same id (nor take the pull's room).
        let put = node.put(id("slow"), Bytes::from_static(b"x"));
        assert!(matches!(put, Err(Error::Exists(_))), "{put:?}");
        node.progress(&id("slow"))
    };
    let progress = tokio::select! {
        _ = pull => panic!("the pull ended"),
        p = serve => p,
    };
    assert_eq!(progress, Some(ucxkit_object_push::Progress { done: 0, size: 10_000 }));
    assert_eq!(node.progress(&id("slow")), None, "the pull was dropped");
}
