//! Objects in files: pulled into a file-backed store chunk by chunk (byte-exact, holes
//! left where the object is zeros), served from files to other nodes, refused without
//! room (leaving no file behind), and files sealed as they are.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ucxkit_object_push::{Error, FileStore, MemoryStore, NodeOptions, ObjectId, ObjectNode, Verify};
use ucxkit_testkit::payload::payload;
use ucxkit_testkit::workers::{loopback, mesh_with};
use ucxkit_transport::ProgressMode;

mod common;
use common::{take_one, Bent};
use std::sync::atomic::AtomicU32;

const T: Duration = Duration::from_secs(60);

fn id(s: &str) -> ObjectId {
    ObjectId::try_from(s).unwrap()
}

fn small() -> NodeOptions {
    NodeOptions { chunk: 4096, window: 3, inline_max: 1000, verify: Verify::Always, ..NodeOptions::default() }
}

/// A fresh directory of this test's.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ucxkit-files-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn files_in(d: &std::path::Path) -> usize {
    std::fs::read_dir(d).map_or(0, |r| r.count())
}

#[tokio::test]
async fn objects_arrive_in_files_byte_exact_and_are_served_from_them() {
    let d = dir("pull");
    let mesh = mesh_with("posix,cma,tcp,self", 3, ProgressMode::Event).await;
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let store = Arc::new(FileStore::new(&d).unwrap());
    let files = ObjectNode::new(&mesh.workers[1], store.clone(), small()).unwrap();
    let third = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), small()).unwrap();
    let mut zeros = payload(5, 200_000);
    zeros[70_000..180_000].fill(0);
    let objects: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("one", vec![9]),
        ("inline", payload(1, 1000)),
        ("chunk-1", payload(2, 4095)),
        ("chunk+1", payload(3, 4097)),
        ("many", payload(4, 100_000)),
        ("holes", zeros),
    ];
    for (name, bytes) in &objects {
        owner.put(id(name), Bytes::from(bytes.clone())).unwrap();
        let got = tokio::time::timeout(T, files.pull(id(name), mesh.ep(1, 0))).await.unwrap().unwrap();
        assert_eq!(got.read(0..bytes.len() as u64).unwrap(), &bytes[..], "{name}");
        if bytes.len() > 1000 {
            let f = got.file().expect("received into a file");
            assert!(f.path().starts_with(&d));
            assert_eq!(std::fs::read(f.path()).unwrap(), *bytes, "{name}: the file");
        }
        // Served from the file to a third node.
        let again = tokio::time::timeout(T, third.pull(id(name), mesh.ep(2, 1))).await.unwrap().unwrap();
        assert_eq!(again.bytes().unwrap(), &bytes[..], "{name} from the file");
    }
    assert_eq!(files.stats().malformed + files.stats().refetched + third.stats().refetched, 0);
    // Released, an object's file goes (once nothing reads it).
    let before = files_in(&d);
    assert!(files.release(&id("many")));
    assert_eq!(files_in(&d), before - 1);
    // Persisted, it moves out of the store and stays.
    let to = d.join("kept");
    assert_eq!(store.persist(&id("holes"), &to).unwrap(), Some(to.clone()));
    assert_eq!(std::fs::read(&to).unwrap(), objects[6].1);
    drop(files);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn a_file_store_without_room_refuses_and_keeps_no_file() {
    let d = dir("room");
    let mesh = mesh_with("posix,cma,tcp,self", 3, ProgressMode::Event).await;
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let files =
        ObjectNode::new(&mesh.workers[1], Arc::new(FileStore::with_capacity(&d, 50_000).unwrap()), small())
            .unwrap();
    owner.put(id("big"), Bytes::from(payload(1, 60_000))).unwrap();
    let err = files.pull(id("big"), mesh.ep(1, 0)).await.unwrap_err();
    assert!(matches!(&err, Error::Store(r) if r.contains("no room")), "{err}");
    // A pull that fails midway (its holder forgets the object after its lookup and the
    // first run of chunks) leaves no file either.
    let gets = Arc::new(AtomicU32::new(2));
    let forgetful = Bent::new({
        let gets = gets.clone();
        move |o| take_one(&gets).then_some(o)
    });
    let forgetful = Arc::new(forgetful);
    let holder = ObjectNode::new(&mesh.workers[2], forgetful, small()).unwrap();
    holder.put(id("gone"), Bytes::from(payload(2, 40_000))).unwrap();
    let err = files.pull(id("gone"), mesh.ep(1, 2)).await.unwrap_err();
    assert!(matches!(&err, Error::Remote(r) if r.contains("no longer held")), "{err}");
    assert_eq!(files_in(&d), 0, "the failed pull's file was removed");
    drop(files);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn files_sealed_as_they_are_are_served_and_kept() {
    let d = dir("put");
    std::fs::create_dir_all(&d).unwrap();
    let path = d.join("data");
    let bytes = payload(8, 50_001);
    std::fs::write(&path, &bytes).unwrap();
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let puller = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), small()).unwrap();
    let o = owner.put_file(id("f"), &path).await.unwrap();
    assert_eq!((o.len(), o.layout().count()), (50_001, 13));
    let got = tokio::time::timeout(T, puller.pull(id("f"), mesh.ep(1, 0))).await.unwrap().unwrap();
    assert_eq!(got.bytes().unwrap(), &bytes[..]);
    assert!(owner.release(&id("f")));
    drop(o);
    assert!(path.exists(), "the application's file is kept");
    let err = owner.put_file(id("g"), d.join("missing")).await.unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A file changed after it was sealed is not handed out as the object, inline either:
/// an object of one chunk travels with the checksum it was sealed with, so the puller's
/// check fails; one of several chunks is refused by its holder.
#[tokio::test]
async fn files_changed_since_sealing_are_refused_inline_too() {
    let d = dir("changed");
    std::fs::create_dir_all(&d).unwrap();
    let mesh = mesh_with("posix,cma,tcp,self", 2, ProgressMode::Event).await;
    let opts = || NodeOptions { inline_max: 16_384, ..small() };
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts()).unwrap();
    let puller = ObjectNode::new(&mesh.workers[1], Arc::new(MemoryStore::new()), opts()).unwrap();
    for (name, len, chunks) in [("one", 3000, 1), ("three", 10_000, 3)] {
        let path = d.join(name);
        let mut bytes = payload(9, len);
        std::fs::write(&path, &bytes).unwrap();
        let o = owner.put_file(id(name), &path).await.unwrap();
        assert_eq!(o.layout().count(), chunks);
        bytes[len / 2] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let pulled = tokio::time::timeout(T, puller.pull(id(name), mesh.ep(1, 0))).await.unwrap();
        let err = pulled.map(|o| o.len()).unwrap_err();
        match chunks {
            1 => assert!(matches!(err, Error::Corrupt { chunk: 0, .. }), "{err}"),
            _ => assert!(matches!(&err, Error::Remote(r) if r.contains("changed since")), "{err}"),
        }
        assert!(puller.get(&id(name)).is_none(), "nothing sealed");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A receiver taking an object into a file does not relay it while it arrives: the
/// receiver below it in a chain is told at once and pulls from the owner, without
/// waiting for the relay to start.
#[tokio::test]
async fn a_relay_receiving_into_a_file_sends_its_receivers_to_the_owner() {
    let d = dir("relay");
    let mesh = mesh_with("posix,cma,tcp,self", 3, ProgressMode::Event).await;
    let owner = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), small()).unwrap();
    let relay = ObjectNode::new(&mesh.workers[1], Arc::new(FileStore::new(&d).unwrap()), small()).unwrap();
    let last = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), small()).unwrap();
    for n in [&relay, &last] {
        n.listen(loopback()).unwrap();
    }
    let bytes = Bytes::from(payload(6, 100_000));
    owner.put(id("o"), bytes.clone()).unwrap();
    let to = [mesh.ep(0, 1).clone(), mesh.ep(0, 2).clone()];
    let t = std::time::Instant::now();
    let b = tokio::time::timeout(T, owner.broadcast(id("o"), &to, ucxkit_object_push::Shape::Chain))
        .await
        .unwrap();
    assert!(b.unwrap().is_ok());
    // Well under the 5 s a receiver waits for a relay that never starts.
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(last.get(&id("o")).unwrap().bytes(), Some(&bytes));
    assert_eq!(relay.get(&id("o")).unwrap().read(0..100_000).unwrap(), bytes);
    drop(relay);
    std::fs::remove_dir_all(&d).unwrap();
}
