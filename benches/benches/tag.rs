//! Tagged messaging between two workers of one process, each on its own thread with its
//! own runtime and busy-poll progress (one worker per thread, as deployments run them):
//! ping-pong (round trip) and windowed streaming (bandwidth), by message size, over
//! shared memory and TCP loopback.
//!
//! `cargo bench -p ucxkit-benches`

#![forbid(unsafe_code)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ucxkit_transport::{tag, Context, Endpoint, ProgressMode, Worker};

const PING: u64 = 1;
const PONG: u64 = 2;
const STREAM: u64 = 3;
const ACK: u64 = 4;
/// Control: tells the peer thread what comes next (`[kind, size, count]`).
const CTRL: u64 = 5;
const WINDOW: usize = 16;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

fn context(tls: &str) -> Context {
    let mut cb = Context::builder().transports(tls);
    if tls.contains("tcp") {
        cb = cb.config("NET_DEVICES", "lo");
    }
    cb.build().expect("context")
}

/// The peer thread: answers pings, and receives streams then acknowledges them.
fn peer(tls: String, addr_tx: std::sync::mpsc::Sender<Vec<u8>>, their: std::sync::mpsc::Receiver<Vec<u8>>) {
    let rt = runtime();
    rt.block_on(async {
        let w = context(&tls).worker().progress_mode(ProgressMode::BusyPoll).build().expect("worker");
        addr_tx.send(w.address().expect("address").as_bytes().to_vec()).expect("send address");
        let theirs =
            ucxkit_transport::WorkerAddress::from_bytes(&their.recv().expect("address")).expect("parse");
        let ep = w.connect_address(&theirs).await.expect("connect");
        loop {
            let (_, cmd) = w.tag_recv_any(CTRL, tag::EXACT).await.expect("ctrl");
            let [kind, size, count]: [u64; 3] = std::array::from_fn(|i| {
                u64::from_le_bytes(cmd[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
            });
            let size = size as usize;
            let payload: &'static [u8] = Vec::leak(vec![1u8; size]);
            match kind {
                0 => return,
                1 => {
                    let mut buf = Vec::with_capacity(size);
                    for _ in 0..count {
                        let (r, b) = w.tag_recv(PING, tag::EXACT, buf).await;
                        r.expect("ping");
                        buf = b;
                        ep.tag_send(PONG, payload).await.0.expect("pong");
                    }
                }
                _ => {
                    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| Vec::with_capacity(size)).collect();
                    for i in 0..count as usize {
                        let (r, b) = w.tag_recv(STREAM, tag::EXACT, std::mem::take(&mut bufs[i % 4])).await;
                        r.expect("stream");
                        bufs[i % 4] = b;
                        if (i + 1) % WINDOW == 0 {
                            ep.tag_send(ACK, &b"k"[..]).await.0.expect("ack");
                        }
                    }
                }
            }
        }
    });
}

struct Client {
    rt: tokio::runtime::Runtime,
    w: Worker,
    ep: Endpoint,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Client {
    fn new(tls: &str) -> Client {
        let (tx_a, rx_a) = std::sync::mpsc::channel();
        let (tx_b, rx_b) = std::sync::mpsc::channel();
        let t = tls.to_string();
        let thread = std::thread::spawn(move || peer(t, tx_a, rx_b));
        let rt = runtime();
        let (w, ep) = rt.block_on(async {
            let w = context(tls).worker().progress_mode(ProgressMode::BusyPoll).build().expect("worker");
            tx_b.send(w.address().expect("address").as_bytes().to_vec()).expect("send address");
            let theirs =
                ucxkit_transport::WorkerAddress::from_bytes(&rx_a.recv().expect("address")).expect("parse");
            let ep = w.connect_address(&theirs).await.expect("connect");
            (w, ep)
        });
        Client { rt, w, ep, thread: Some(thread) }
    }

    fn command(&self, kind: u64, size: usize, count: u64) {
        let mut cmd = Vec::with_capacity(24);
        for v in [kind, size as u64, count] {
            cmd.extend_from_slice(&v.to_le_bytes());
        }
        self.rt.block_on(async { self.ep.tag_send(CTRL, cmd).await.0.expect("ctrl") });
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.command(0, 0, 0);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ping_pong(c: &mut Criterion) {
    for (name, tls) in [("shm", "posix,cma,self"), ("tcp", "tcp,self")] {
        let cl = Client::new(tls);
        let mut g = c.benchmark_group(format!("tag_pingpong_{name}"));
        for size in [8usize, 4096, 65536] {
            let payload: &'static [u8] = Vec::leak(vec![7u8; size]);
            g.throughput(Throughput::Bytes(2 * size as u64));
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |bch, &size| {
                bch.iter_custom(|iters| {
                    cl.command(1, size, iters);
                    cl.rt.block_on(async {
                        let mut buf = Vec::with_capacity(size);
                        let t = std::time::Instant::now();
                        for _ in 0..iters {
                            let r = cl.w.tag_recv(PONG, tag::EXACT, buf);
                            cl.ep.tag_send(PING, payload).await.0.expect("ping");
                            buf = r.await.1;
                        }
                        t.elapsed()
                    })
                })
            });
        }
        g.finish();
    }
}

fn stream(c: &mut Criterion) {
    for (name, tls) in [("shm", "posix,cma,self"), ("tcp", "tcp,self")] {
        let cl = Client::new(tls);
        let mut g = c.benchmark_group(format!("tag_stream_{name}"));
        g.sample_size(20);
        for size in [65536usize, 1 << 20] {
            let payload: &'static [u8] = Vec::leak(vec![9u8; size]);
            g.throughput(Throughput::Bytes((WINDOW * size) as u64));
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |bch, &size| {
                bch.iter_custom(|iters| {
                    cl.command(2, size, iters * WINDOW as u64);
                    cl.rt.block_on(async {
                        let t = std::time::Instant::now();
                        let mut ack = Vec::with_capacity(1);
                        for _ in 0..iters {
                            let r = cl.w.tag_recv(ACK, tag::EXACT, ack);
                            let sends: Vec<_> =
                                (0..WINDOW).map(|_| cl.ep.tag_send(STREAM, payload)).collect();
                            for s in sends {
                                s.await.0.expect("send");
                            }
                            ack = r.await.1;
                        }
                        t.elapsed()
                    })
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, ping_pong, stream);
criterion_main!(benches);
