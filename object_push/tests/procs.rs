//! Object transfers between processes: a holder killed (SIGKILL) in the middle of a
//! transfer leaves its chunks to another holder and the object arrives byte-exact.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
mod common;

use common::Bent;
use ucxkit_object_push::{MemoryStore, NodeOptions, ObjectId, ObjectNode};
use ucxkit_testkit::payload::payload;
use ucxkit_testkit::procs::{role, Group};
use ucxkit_testkit::workers::{ctx, loopback};

const T: Duration = Duration::from_secs(60);
const SIZE: usize = 8 << 20;

fn opts() -> NodeOptions {
    NodeOptions { chunk: 64 << 10, window: 4, ..NodeOptions::default() }
}

/// Ranks 1 and 2 hold the object (rank 1 dies on its fifth store read: the lookup and
/// three fetches served); rank 0 pulls from both, over shared memory and over TCP.
#[tokio::test]
async fn a_holder_killed_mid_transfer_leaves_its_chunks_to_another() {
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        pull_past_a_killed_holder(tls).await;
    }
}

async fn pull_past_a_killed_holder(tls: &str) {
    let (group, me) = Group::spawn("holder_process", 3, &[("OBJ_TLS", tls)]);
    let id = ObjectId::try_from("weights").unwrap();
    let worker = ctx(tls).worker().build().unwrap();
    let node = ObjectNode::new(&worker, Arc::new(MemoryStore::new()), opts()).unwrap();
    let mut holders = Vec::new();
    for r in 1..3 {
        let port = me.exchange.wait(&format!("port-{r}"), T).unwrap();
        let port: u16 = String::from_utf8(port).unwrap().parse().unwrap();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        holders.push(tokio::time::timeout(T, worker.connect(addr)).await.unwrap().unwrap());
    }
    let got = tokio::time::timeout(T, node.pull_from(id, &holders)).await.unwrap().unwrap();
    assert!(got.bytes().unwrap()[..] == payload(11, SIZE)[..], "byte-exact");
    assert_eq!(node.stats().holders_failed, 1, "{tls}: {:?}", node.stats());
    me.exchange.publish("done", b"");
    drop(group);
}

/// A holder process of the test above.
#[tokio::test]
#[ignore = "a child of a_holder_killed_mid_transfer_leaves_its_chunks_to_another"]
async fn holder_process() {
    let Some(me) = role() else { return };
    let worker = ctx(&std::env::var("OBJ_TLS").unwrap()).worker().build().unwrap();
    // Rank 1's store kills its process (SIGKILL) on its fifth read: a holder that dies
    // after it answered the lookup and served some fetches.
    let fatal = if me.rank == 1 { 5 } else { u32::MAX };
    let reads = AtomicU32::new(0);
    let store = Arc::new(Bent::new(move |o| {
        if reads.fetch_add(1, Ordering::SeqCst) + 1 == fatal {
            let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(10));
        }
        Some(o)
    }));
    let node = ObjectNode::new(&worker, store, opts()).unwrap();
    node.put(ObjectId::try_from("weights").unwrap(), Bytes::from(payload(11, SIZE))).unwrap();
    let listener = worker.listen(loopback()).unwrap();
    me.exchange.publish(&format!("port-{}", me.rank), listener.local_addr().port().to_string().as_bytes());
    let accept = async {
        let mut eps = Vec::new();
        while let Ok(ep) = listener.accept().await {
            eps.push(ep);
        }
    };
    let done = async {
        while me.exchange.wait("done", Duration::from_millis(1)).is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let _ = tokio::time::timeout(T, async {
        tokio::select! { () = accept => {}, () = done => {} }
    })
    .await;
}
