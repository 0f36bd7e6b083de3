//! Paired runs: ucxkit's tag, active-message, stream and one-sided operations against raw
//! `ucp_*` calls on the same two workers, the same endpoints and the same pinned threads,
//! alternating in chunks.
//!
//! Comparing ucxkit with a separate `ucx_perftest` run mixes CPU placements on a virtual
//! machine whose host moves its CPUs between runs (one-way latency over shared memory
//! falls into clusters several times apart, and TCP bandwidth swings as much). Here every
//! ucxkit chunk is paired with a raw chunk run right before or after it (the order
//! alternates from pair to pair), so each ratio compares like placements, and the median
//! of the per-pair ratios is what ucxkit costs.
//!
//! ```text
//! cargo bench -p ucxkit-benches --bench paired -- [--test tag_lat|tag_bw|am_lat|am_bw|stream_lat|stream_bw|put_bw|get_bw]
//!     [--tls posix,self]
//!     [--size 8|64K|16M] [--chunks 40] [--iters N] [--window 32] [--pause-us 0] [--cpus 0,1]
//!     [--immediate] [--processes] [FILTER]
//! ```
//!
//! - `tag_lat`, `am_lat`, `stream_lat`: ping-pong with tags, active messages (no header;
//!   the raw side counts arrivals in a handler of its own id, so up to 1 KiB, while
//!   ucxkit's receiver also hands each message out: in place up to 22 bytes of header
//!   and payload, in one heap allocation above, which its figure includes) or the
//!   endpoint's byte stream; a chunk's figure is the median round trip, halved (one-way
//!   latency, as ucx_perftest reports). Default 4000 round trips per chunk.
//!   With `--pause-us N` the client waits N µs before each round trip (not timed), so
//!   the answering side waits that long for each message: longer than a busy-poll
//!   future spins, it yields to tokio meanwhile, and the figure then shows how soon a
//!   future that yielded notices its message. Default then: chunks of about 0.1 s.
//! - `tag_bw`: the client keeps up to `--window` sends in flight (counting, as ucx_perftest
//!   does, only those UCX did not complete at once), the server keeps as many receives
//!   posted, all into one buffer UCX allocated, and acknowledges each chunk; a chunk's
//!   figure is its bandwidth, from the first send to the acknowledgement. Default: 1 GiB
//!   per chunk, 64 to 20,000 messages.
//! - `stream_bw`: the same with stream sends; the server receives each whole
//!   (`WAITALL`).
//! - `am_bw`: the same with active messages (no header). The server takes each message
//!   whole: an eager one as it arrives (the raw handler only counts it, as
//!   `ucx_perftest`'s does, while ucxkit hands it out: in place up to 22 bytes, copied
//!   below 2 KiB, held in UCX's descriptor from there), a rendezvous one once its
//!   payload is fetched into the buffer (the raw handler fetches from within the
//!   callback, ucxkit's receiver keeps up to `--window` fetches in flight).
//! - `put_bw`, `get_bw`: the client keeps up to `--window` puts (gets) between its
//!   buffer and the server's region in flight, flushes, then exchanges an end-of-chunk
//!   message with the server, which only progresses meanwhile. The raw side reaches the
//!   same region through a key packed with `ucp_rkey_pack`.
//! - `--immediate` (`tag_bw`, `put_bw`, up to 8 KiB): ucxkit's side sends each message with
//!   `try_tag_send` (`try_put`) from a borrowed buffer first, and only what UCX does not
//!   complete during that call with the owned operation, as an application sending
//!   short messages would.
//!
//! A `FILTER` that is not part of the name `paired` skips the benchmark, so that
//! `cargo bench -p ucxkit-benches -- FILTER` can pick criterion benchmarks.
//!
//! Two workers, each on its own thread with its own current-thread runtime and busy-poll
//! progress, pinned to the two CPUs. With `--processes` the server runs in a child
//! process instead (this program again, started with `--serve PORT`, exchanging addresses
//! and keys over a loopback TCP connection to that port), as two UCX programs such as
//! `ucxkit-perf` and `ucx_perftest` run. A first pair of chunks warms up and is not counted.
//! The raw side's worker and endpoint handles are taken outside the timed loops (taking
//! one locks the worker).

use std::cell::Cell;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ucx_sys as sys;
use ucxkit_transport::{
    tag, Context, Endpoint, EndpointOptions, ErrorMode, IoBuf, MemRegion, ProgressMode, Worker, WorkerAddress,
};

#[path = "paired/measure.rs"]
mod measure;
#[path = "paired/opts.rs"]
mod opts;
mod raw;
#[path = "paired/serve.rs"]
mod serve;

use measure::*;
use opts::*;
use serve::*;

const PING: u64 = 0x5049_4e47;
const PONG: u64 = 0x504f_4e47;

fn pin(cpu: usize) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        eprintln!("paired: could not pin a thread to cpu {cpu}; running unpinned");
    }
}

/// How the two sides exchange worker addresses and keys before the chunks.
enum Link {
    /// Two threads of this process.
    Threads(mpsc::Sender<Vec<u8>>, mpsc::Receiver<Vec<u8>>),
    /// Two processes: messages of a 4-byte little-endian length and the bytes, over a
    /// loopback TCP connection.
    Socket(TcpStream),
}

impl Link {
    fn send(&self, what: &str, m: Vec<u8>) {
        match self {
            Link::Threads(tx, _) => {
                tx.send(m).unwrap_or_else(|_| panic!("send {what}: the other side is gone"))
            }
            Link::Socket(stream) => {
                let mut tx = stream;
                let len = u32::try_from(m.len()).expect("a setup message under 4 GiB");
                tx.write_all(&len.to_le_bytes())
                    .and_then(|()| tx.write_all(&m))
                    .and_then(|()| tx.flush())
                    .unwrap_or_else(|e| panic!("send {what}: {e}"));
            }
        }
    }

    fn recv(&self, what: &str) -> Vec<u8> {
        match self {
            Link::Threads(_, rx) => {
                rx.recv().unwrap_or_else(|_| panic!("receive {what}: the other side is gone"))
            }
            Link::Socket(stream) => {
                let mut rx = stream;
                let mut len = [0u8; 4];
                rx.read_exact(&mut len).unwrap_or_else(|e| panic!("receive {what}: {e}"));
                let mut m = vec![0u8; u32::from_le_bytes(len) as usize];
                rx.read_exact(&mut m).unwrap_or_else(|e| panic!("receive {what}: {e}"));
                m
            }
        }
    }
}

/// A worker on this thread's runtime and an endpoint to the other side's worker.
async fn connect(tls: &str, link: &Link) -> (Worker, Endpoint) {
    let ctx = Context::builder().transports(tls).build().expect("context");
    let w = ctx.worker().progress_mode(ProgressMode::BusyPoll).build().expect("worker");
    link.send("address", w.address().expect("address").as_bytes().to_vec());
    let addr = WorkerAddress::from_bytes(&link.recv("peer address")).expect("parse address");
    // No UCX peer-failure handling: with it, UCX 1.13 leaves shared memory out.
    let opts = EndpointOptions { error_mode: ErrorMode::None, ..EndpointOptions::default() };
    let ep = w.connect_address_with(&addr, opts).await.expect("connect");
    (w, ep)
}

/// A first pair of chunks, not counted: it pays for first touches and connection set-up.
const WARMUP_CHUNKS: u64 = 2;

/// Chunks come in pairs, one through ucxkit and one through raw UCX, in alternating
/// order (ucxkit first in even pairs, raw first in odd ones), so that whatever the
/// first or second chunk of a pair has in common (the state a bulk transfer leaves in
/// the TCP stack, say) falls on both sides equally.
fn is_raw(chunk: u64) -> bool {
    (chunk % 2 == 1) != ((chunk / 2) % 2 == 1)
}

/// The two directions of a ping-pong.
#[derive(Clone, Copy)]
enum Dir {
    Ping,
    Pong,
}

impl Dir {
    /// The opposite direction.
    fn other(self) -> Dir {
        match self {
            Dir::Ping => Dir::Pong,
            Dir::Pong => Dir::Ping,
        }
    }

    fn tag(self) -> u64 {
        match self {
            Dir::Ping => PING,
            Dir::Pong => PONG,
        }
    }

    /// Active-message id through ucxkit.
    fn am_id(self) -> u16 {
        match self {
            Dir::Ping => 1,
            Dir::Pong => 2,
        }
    }

    /// Active-message id through raw UCX (its handler replaces ucxkit's catch-all one).
    fn raw_am_id(self) -> u16 {
        self.am_id() + 2
    }
}

/// One side of a ping-pong, with what each protocol needs on both paths.
struct PingPong {
    w: Worker,
    ep: Endpoint,
    /// The raw handles of `w` and `ep`, taken once (taking one locks the worker).
    wh: sys::ucp_worker_h,
    eh: sys::ucp_ep_h,
    test: Test,
    payload: &'static [u8],
    /// Tag receive buffer (ucxkit).
    buf: Vec<u8>,
    /// Stream receive buffer (ucxkit).
    stream_buf: Box<[u8]>,
    /// Receive buffer of the raw path.
    raw_buf: Vec<u8>,
    /// Active messages arriving through ucxkit.
    am: Option<ucxkit_transport::AmReceiver>,
    /// Active messages the raw handler counted (for the whole program: it must outlive
    /// the handler's registration even if a chunk panics), and how many this side has
    /// taken.
    arrived: &'static Cell<u64>,
    taken: u64,
    /// The direction this side receives.
    inbound: Dir,
}

impl PingPong {
    fn new(w: Worker, ep: Endpoint, o: &Opts, inbound: Dir, fill: u8) -> PingPong {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let arrived: &'static Cell<u64> = Box::leak(Box::new(Cell::new(0)));
        let am = if o.test == Test::AmLat {
            // SAFETY: no ucxkit operation is pending and this thread is the worker's only
            // user.
            unsafe { raw::count_am(wh, inbound.raw_am_id(), Some(arrived)) };
            Some(w.am_recv(inbound.am_id()).expect("am_recv"))
        } else {
            None
        };
        PingPong {
            payload: Vec::leak(vec![fill; o.size]),
            buf: Vec::with_capacity(o.size),
            stream_buf: vec![0u8; o.size].into(),
            raw_buf: vec![0u8; o.size],
            am,
            arrived,
            taken: 0,
            inbound,
            test: o.test,
            wh,
            eh,
            w,
            ep,
        }
    }

    /// Sends one message the other way from `inbound`.
    async fn send(&mut self, raw: bool) {
        let (dir, payload) = (self.inbound.other(), self.payload);
        if raw {
            let (p, n) = (payload.as_ptr(), payload.len());
            // SAFETY: the handles are live (held by `self`); this thread is the only user of
            // the worker, and no ucxkit operation is pending; the payload is 'static.
            unsafe {
                let s = match self.test {
                    Test::AmLat => raw::post_am_send(self.eh, dir.raw_am_id(), p, n),
                    Test::StreamLat => raw::post_stream_send(self.eh, p, n),
                    _ => raw::post_tag_send(self.eh, p, n, dir.tag()),
                };
                raw::wait(self.wh, s);
            }
            return;
        }
        let r = match self.test {
            Test::AmLat => self.ep.am_send(dir.am_id(), &[], payload).await.0,
            Test::StreamLat => self.ep.stream_send(payload).await.0,
            _ => self.ep.tag_send(dir.tag(), payload).await.0,
        };
        r.expect("send");
    }

    /// Receives one message of direction `inbound`.
    async fn recv(&mut self, raw: bool) {
        if raw {
            let (w, buf) = (self.wh, &mut self.raw_buf);
            // SAFETY: as in `send`; the buffers outlive the requests, waited for here.
            unsafe {
                match self.test {
                    Test::AmLat => {
                        self.taken += 1;
                        raw::wait_am(w, self.arrived, self.taken);
                    }
                    Test::StreamLat => raw::stream_recv_exact(w, self.eh, buf.as_mut_ptr(), buf.len()),
                    _ => raw::tag_recv(w, buf, self.inbound.tag()),
                }
            }
            return;
        }
        match self.test {
            Test::AmLat => drop(self.am.as_mut().expect("receiver").recv().await),
            Test::StreamLat => {
                let (r, b) = self.ep.stream_recv_exact(std::mem::take(&mut self.stream_buf)).await;
                r.expect("stream receive");
                self.stream_buf = b;
            }
            _ => {
                let (r, b) =
                    self.w.tag_recv(self.inbound.tag(), tag::EXACT, std::mem::take(&mut self.buf)).await;
                r.expect("tag receive");
                self.buf = b;
            }
        }
    }

    /// Unregisters the raw handler and closes the endpoint.
    async fn finish(self) {
        if self.test == Test::AmLat {
            // SAFETY: as in `new`.
            unsafe { raw::count_am(self.wh, self.inbound.raw_am_id(), None) };
        }
        self.ep.close().await.ok();
    }
}

/// Sends the 3-byte end-of-chunk message or acknowledgement with `tag` on `ep`.
async fn send_ack(ep: &Endpoint, raw: bool, tag: u64) {
    if raw {
        let (wh, eh) = (ep.worker().as_raw(), ep.as_raw());
        // SAFETY: this thread is the worker's only user and no ucxkit operation is
        // pending; the message is 'static.
        unsafe { raw::wait(wh, raw::post_tag_send(eh, b"ack".as_ptr(), 3, tag)) };
    } else {
        ep.tag_send(tag, &b"ack"[..]).await.0.expect("acknowledgement");
    }
}

/// Waits for the 3-byte message [`send_ack`] sends with `tag`.
async fn recv_ack(w: &Worker, raw: bool, tag: u64) {
    if raw {
        let mut ack = [0u8; 3];
        // SAFETY: as in `send_ack`; the buffer outlives the receive, waited for here.
        unsafe { raw::tag_recv(w.as_raw(), &mut ack, tag) };
    } else {
        w.tag_recv(tag, tag::EXACT, Vec::with_capacity(3)).await.0.expect("acknowledgement");
    }
}

/// The server process's setup connection; panics if the process ends, or has not
/// connected after 30 s, instead.
fn accept_child(setup: &TcpListener, child: &mut std::process::Child) -> TcpStream {
    setup.set_nonblocking(true).expect("non-blocking setup socket");
    let t0 = Instant::now();
    loop {
        match setup.accept() {
            Ok((link, _)) => {
                link.set_nonblocking(false).expect("blocking setup connection");
                return link;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("setup socket: {e}"),
        }
        if let Some(status) = child.try_wait().expect("server process") {
            panic!("the server process ended before connecting: {status}");
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the server process did not connect within 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let o = parse_opts();
    if let Some(port) = o.serve {
        let link = TcpStream::connect(("127.0.0.1", port)).expect("connect to the parent's setup socket");
        server(o, Link::Socket(link));
        return;
    }
    let figures = if o.processes {
        let setup = TcpListener::bind("127.0.0.1:0").expect("setup socket");
        let port = setup.local_addr().expect("setup socket address").port();
        let exe = std::env::current_exe().expect("this program's path");
        let mut child = Command::new(exe)
            .args(std::env::args_os().skip(1))
            .args(["--serve", &port.to_string()])
            .spawn()
            .expect("start the server process");
        let link = accept_child(&setup, &mut child);
        let figures = client(o.clone(), Link::Socket(link));
        let status = child.wait().expect("server process");
        assert!(status.success(), "server process: {status}");
        figures
    } else {
        let (to_client, from_server) = mpsc::channel();
        let (to_server, from_client) = mpsc::channel();
        let so = o.clone();
        let srv = std::thread::spawn(move || server(so, Link::Threads(to_client, from_client)));
        let figures = client(o.clone(), Link::Threads(to_server, from_server));
        srv.join().expect("server thread");
        figures
    };

    // Each ucxkit chunk against the raw chunk of its pair, after the warm-up pair.
    let (mut ours, mut raw, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for (i, pair) in figures.chunks_exact(2).enumerate().skip(WARMUP_CHUNKS as usize / 2) {
        let first = 2 * i as u64;
        let (u, r) = if is_raw(first) { (pair[1], pair[0]) } else { (pair[0], pair[1]) };
        ours.push(u);
        raw.push(r);
        ratios.push(u / r);
    }
    let (lo, hi) = ratios.iter().fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
    let (what, unit, chunk) = match o.test {
        Test::TagLat => ("tag ping-pong", "one-way latency (ns)", "round trips"),
        Test::AmLat => ("active-message ping-pong", "one-way latency (ns)", "round trips"),
        Test::StreamLat => ("stream ping-pong", "one-way latency (ns)", "round trips"),
        Test::TagBw => ("tag streaming", "bandwidth (MiB/s)", "messages"),
        Test::StreamBw => ("stream sends", "bandwidth (MiB/s)", "sends"),
        Test::AmBw => ("active messages", "bandwidth (MiB/s)", "messages"),
        Test::PutBw => ("puts", "bandwidth (MiB/s)", "puts"),
        Test::GetBw => ("gets", "bandwidth (MiB/s)", "gets"),
    };
    let paused = if o.pause.is_zero() {
        String::new()
    } else {
        format!(", each after a {} µs pause", o.pause.as_micros())
    };
    println!(
        "{what}, {} B over {}, cpus {},{}{}: {} pairs of chunks of {} {chunk}{paused}",
        o.size,
        o.tls,
        o.cpus[0],
        o.cpus[1],
        if o.processes { " (two processes)" } else { "" },
        ratios.len(),
        o.iters
    );
    println!("{unit}, median of chunks: ucxkit {:.1}, raw UCX {:.1}", median(&mut ours), median(&mut raw));
    println!(
        "ucxkit / raw UCX, median of paired ratios: {:.3} (range {lo:.3} .. {hi:.3})",
        median(&mut ratios)
    );
}
