//! One host's process of a soak (`ucxkit-rig soak-node`, started by `soak`): it moves
//! checked data with its neighbours through every layer until its stdin closes, and
//! prints its counters as a JSON line every second and once more at the end.
//!
//! - point-to-point: tagged messages to the next host, echoed back and compared;
//! - collectives: allreduce among all hosts, results compared; a failed communicator is
//!   left for a new one (the next *epoch*, its store on the next port of h0; a process
//!   started again after a kill joins the epoch it is given);
//! - objects: pulls of the previous host's objects, compared, then released.
//!
//! A failed operation is counted, and the layer starts over (a new endpoint, a new
//! communicator) after a pause; the first success after failures counts as recovered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use ucxkit::collectives::{Communicator, InitOptions, Options, ReduceOp};
use ucxkit::object_push::{MemoryStore, NodeOptions, ObjectId, ObjectNode};
use ucxkit::transport::{tag, Context, Endpoint, Worker};
use ucxkit_testkit::payload::{payload, Rng};
use ucxkit_testkit::rig::host_addr as addr;

/// Every operation's deadline.
pub(crate) const DEADLINE: Duration = Duration::from_secs(4);
/// The ports of the echo listener, the object listener and the first store.
const ECHO_PORT: u16 = 29_600;
const OBJECT_PORT: u16 = 29_601;
const STORE_PORT: u16 = 29_700;
/// Objects each host holds, and their size.
const OBJECTS: u64 = 8;
const OBJECT_SIZE: usize = 2 << 20;
/// How long a layer waits after a failure before it starts over.
const BACKOFF: Duration = Duration::from_millis(300);

/// The layers, in the order reported.
pub(crate) const LAYERS: [&str; 3] = ["p2p", "collectives", "objects"];

/// One layer's counters.
#[derive(Default)]
struct Counters {
    bytes: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    recovered: AtomicU64,
    corrupt: AtomicU64,
}

impl Counters {
    /// Counts a finished operation of `bytes`: good, or with `bad` corrupt bytes.
    fn done(&self, bytes: u64, bad: u64, after_failure: &mut bool) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.corrupt.fetch_add(bad, Ordering::Relaxed);
        self.ok.fetch_add(1, Ordering::Relaxed);
        if std::mem::take(after_failure) {
            self.recovered.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display, after_failure: &mut bool) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        *after_failure = true;
        eprintln!("soak-node: {what}: {e}");
    }

    fn json(&self) -> serde_json::Value {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "bytes": get(&self.bytes), "ok": get(&self.ok), "failed": get(&self.failed),
            "recovered": get(&self.recovered), "corrupt": get(&self.corrupt),
        })
    }
}

/// The bytes in which `got` differs from `want` (every byte of either's excess too).
fn differing(got: &[u8], want: &[u8]) -> u64 {
    let common = got.iter().zip(want).filter(|(a, b)| a != b).count();
    (common + got.len().abs_diff(want.len())) as u64
}

async fn within<T, E: std::fmt::Display>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(DEADLINE, f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {DEADLINE:?}")),
    }
}

/// The tag bit of echo requests: a worker's echo server takes only those, and its
/// client's replies (tagged with the bare sequence number) stay its client's (tag
/// matching is per worker, not per endpoint).
const REQUEST: u64 = 1 << 62;

/// Echoes every request of every endpoint that connects (each endpoint's buffer used
/// again from message to message).
async fn echo_server(w: Worker, at: SocketAddr) -> Result<(), String> {
    let l = w.listen(at).map_err(|e| e.to_string())?;
    loop {
        let Ok(ep) = l.accept().await else { continue };
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1 << 20);
            loop {
                buf.clear();
                let (r, b) = ep.tag_recv(REQUEST, REQUEST, buf).await;
                let Ok(info) = r else { return };
                let (r, b) = ep.tag_send(info.sender_tag & !REQUEST, b).await;
                if r.is_err() {
                    return;
                }
                buf = b;
            }
        });
    }
}

/// An endpoint to `to`, connecting again after each failure (counted in `c` as `what`).
async fn connect(w: &Worker, to: SocketAddr, what: &str, c: &Counters, after_failure: &mut bool) -> Endpoint {
    loop {
        match within(w.connect(to)).await {
            Ok(ep) => return ep,
            Err(e) => {
                c.failed(what, e, after_failure);
                tokio::time::sleep(BACKOFF).await;
            }
        }
    }
}

/// One echo of `data` through `ep` under sequence number `seq`: what came back, and the
/// data sent (the send gives its buffer back, so nothing is copied to compare).
async fn echo(ep: &Endpoint, seq: u64, data: Vec<u8>) -> Result<(Vec<u8>, Vec<u8>), String> {
    let back = ep.tag_recv(seq, tag::EXACT, Vec::with_capacity(data.len()));
    let data = match tokio::time::timeout(DEADLINE, ep.tag_send(REQUEST | seq, data)).await {
        Ok((Ok(()), data)) => data,
        Ok((Err(e), _)) => return Err(e.to_string()),
        Err(_) => return Err(format!("send: no answer within {DEADLINE:?}")),
    };
    let got = within(async {
        let (r, b) = back.await;
        r.map(|_| b)
    })
    .await?;
    Ok((got, data))
}

/// Sends messages to host `to`'s echo and compares what comes back.
async fn echo_client(w: Worker, to: usize, seed: u64, c: Arc<Counters>) {
    let mut rng = Rng::new(seed);
    let (mut after_failure, mut seq) = (false, 0u64);
    loop {
        let ep =
            connect(&w, SocketAddr::new(addr(to), ECHO_PORT), "p2p connect", &c, &mut after_failure).await;
        loop {
            seq += 1;
            let len = [8, 4 << 10, 64 << 10, 1 << 20][rng.below(4)];
            match echo(&ep, seq, payload(seed ^ seq, len)).await {
                Ok((got, data)) => c.done(2 * len as u64, differing(&got, &data), &mut after_failure),
                Err(e) => {
                    c.failed("p2p echo", e, &mut after_failure);
                    break;
                }
            }
        }
        tokio::time::sleep(BACKOFF).await;
    }
}

/// Round `k`'s allreduce input on `rank` (small integers: the f32 sums are exact).
fn coll_input(k: u64, rank: usize) -> Vec<f32> {
    (0..16_384u64).map(|j| ((j + k) % 50 + rank as u64) as f32).collect()
}

/// Allreduces among all `n` hosts, a new communicator after each failure, from epoch
/// `first` on; the current epoch in `now`.
async fn collectives(rank: usize, n: usize, c: Arc<Counters>, first: u64, now: Arc<AtomicU64>) {
    let mut after_failure = false;
    let mut epoch = first;
    loop {
        now.store(epoch, Ordering::Relaxed);
        let store = format!("{}:{}", addr(0), STORE_PORT as u64 + epoch % 200);
        let opts = InitOptions { deadline: Duration::from_secs(20), ..Default::default() };
        let comm = match Communicator::init_with(rank, n, &store, opts).await {
            Ok(comm) => comm.with_options(Options { deadline: Some(DEADLINE), ..Default::default() }),
            Err(e) => {
                c.failed(&format!("forming epoch {epoch}"), e, &mut after_failure);
                epoch += 1;
                continue;
            }
        };
        for k in 0.. {
            let want: Vec<f32> = (0..n)
                .map(|r| coll_input(k, r))
                .fold(vec![0.0; 16_384], |acc, v| acc.iter().zip(v).map(|(a, b)| a + b).collect());
            match comm.allreduce(coll_input(k, rank), ReduceOp::Sum).await {
                Ok(got) => {
                    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count() as u64 * 4;
                    c.done(want.len() as u64 * 4, bad, &mut after_failure);
                }
                Err(f) => {
                    c.failed(&format!("allreduce in epoch {epoch}"), f.error, &mut after_failure);
                    break;
                }
            }
        }
        epoch += 1;
        tokio::time::sleep(BACKOFF).await;
    }
}

fn object_id(holder: usize, k: u64) -> ObjectId {
    ObjectId::try_from(format!("h{holder}-{k}").as_str()).expect("a valid id")
}

fn object_bytes(holder: usize, k: u64) -> Vec<u8> {
    payload(((holder as u64) << 32) | k, OBJECT_SIZE)
}

/// Pulls host `from`'s objects in turn, compares and releases them.
async fn puller(w: Worker, node: Arc<ObjectNode>, from: usize, c: Arc<Counters>) {
    let mut after_failure = false;
    let mut k = 0u64;
    loop {
        let at = SocketAddr::new(addr(from), OBJECT_PORT);
        let ep = connect(&w, at, "objects connect", &c, &mut after_failure).await;
        loop {
            k += 1;
            let id = object_id(from, k % OBJECTS);
            // The node's deadline bounds the pull; the outer one only catches a hang.
            let pulled = tokio::time::timeout(DEADLINE * 2, node.pull(id, &ep)).await;
            match pulled {
                Ok(Ok(obj)) => {
                    let want = object_bytes(from, k % OBJECTS);
                    let bad = obj.bytes().map_or(want.len() as u64, |b| differing(b, &want));
                    node.release(&id);
                    c.done(OBJECT_SIZE as u64, bad, &mut after_failure);
                }
                Ok(Err(e)) => {
                    c.failed("pull", e, &mut after_failure);
                    break;
                }
                Err(_) => {
                    c.failed("pull", "outlived its deadline", &mut after_failure);
                    break;
                }
            }
        }
        tokio::time::sleep(BACKOFF).await;
    }
}

/// Runs host `index` of `n`, from collectives epoch `epoch` on, until stdin closes.
pub(crate) async fn run(index: usize, n: usize, seed: u64, epoch: u64) -> Result<(), String> {
    let w =
        Context::builder().build().map_err(|e| e.to_string())?.create_worker().map_err(|e| e.to_string())?;
    let counters: Vec<Arc<Counters>> = LAYERS.iter().map(|_| Arc::new(Counters::default())).collect();
    let now = Arc::new(AtomicU64::new(epoch));
    let node_opts = NodeOptions { chunk: 256 << 10, window: 4, deadline: DEADLINE, ..NodeOptions::default() };
    let node =
        Arc::new(ObjectNode::new(&w, Arc::new(MemoryStore::new()), node_opts).map_err(|e| e.to_string())?);
    for k in 0..OBJECTS {
        node.put(object_id(index, k), Bytes::from(object_bytes(index, k))).map_err(|e| e.to_string())?;
    }
    node.listen(SocketAddr::new(addr(index), OBJECT_PORT)).map_err(|e| e.to_string())?;
    let tasks = [
        tokio::spawn({
            let w = w.clone();
            async move {
                if let Err(e) = echo_server(w, SocketAddr::new(addr(index), ECHO_PORT)).await {
                    eprintln!("soak-node: echo server: {e}");
                }
            }
        }),
        tokio::spawn(echo_client(w.clone(), (index + 1) % n, seed ^ index as u64, counters[0].clone())),
        tokio::spawn(collectives(index, n, counters[1].clone(), epoch, now.clone())),
        tokio::spawn(puller(w.clone(), node.clone(), (index + n - 1) % n, counters[2].clone())),
    ];
    let report = |last: bool| {
        let layers: serde_json::Map<_, _> =
            LAYERS.iter().zip(&counters).map(|(l, c)| (l.to_string(), c.json())).collect();
        let epoch = now.load(Ordering::Relaxed);
        println!("{}", json!({ "node": index, "last": last, "epoch": epoch, "layers": layers }));
    };
    // Ends when the driver closes stdin (or goes away).
    let mut stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
    });
    loop {
        tokio::select! {
            _ = &mut stdin_closed => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => report(false),
        }
    }
    tasks.iter().for_each(|t| t.abort());
    report(true);
    Ok(())
}
