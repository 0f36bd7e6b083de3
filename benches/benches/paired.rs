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

mod raw;

const PING: u64 = 0x5049_4e47;
const PONG: u64 = 0x504f_4e47;

/// Which test a run pairs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Test {
    /// Tag ping-pong, one-way latency.
    TagLat,
    /// Windowed tag streaming, bandwidth.
    TagBw,
    /// Active-message ping-pong (no header), one-way latency.
    AmLat,
    /// Ping-pong on the endpoint's byte stream, one-way latency.
    StreamLat,
    /// Windowed stream sends, received whole (`WAITALL`), bandwidth.
    StreamBw,
    /// Windowed active messages (no header), rendezvous payloads fetched, bandwidth.
    AmBw,
    /// Windowed puts into the server's region, then a flush, bandwidth.
    PutBw,
    /// Windowed gets from the server's region, then a flush, bandwidth.
    GetBw,
}

impl Test {
    fn is_bw(self) -> bool {
        matches!(self, Test::TagBw | Test::StreamBw | Test::AmBw | Test::PutBw | Test::GetBw)
    }

    fn is_rma(self) -> bool {
        matches!(self, Test::PutBw | Test::GetBw)
    }
}

/// Largest message `--immediate` applies to: longer ones never complete during the call,
/// and trying each first would add a refused call per message (as in `ucxkit-perf`).
const IMMEDIATE_MAX: usize = 8 << 10;

/// Largest `am_lat` message: the raw side's handler only counts arrivals, so payloads
/// must arrive eager (rendezvous data would need fetching).
const AM_LAT_MAX: usize = 1024;

/// What the command line asks for.
#[derive(Clone)]
struct Opts {
    test: Test,
    tls: String,
    size: usize,
    chunks: u64,
    iters: u64,
    window: usize,
    /// Latency tests: the client's wait before each round trip.
    pause: Duration,
    cpus: [usize; 2],
    /// `tag_bw`, `put_bw`: ucxkit sends through `try_tag_send` (`try_put`) first.
    immediate: bool,
    /// The server runs in a child process.
    processes: bool,
    /// This is that child: the port of the parent's setup socket.
    serve: Option<u16>,
}

fn usage(msg: &str) -> ! {
    eprintln!("paired: {msg}");
    eprintln!(
        "usage: paired [--test tag_lat|tag_bw|am_lat|am_bw|stream_lat|stream_bw|put_bw|get_bw] [--tls LIST] [--size BYTES] [--chunks N] [--iters N] [--window N] [--pause-us N] [--cpus A,B] [--immediate] [--processes] [FILTER]"
    );
    std::process::exit(2);
}

/// A byte count with an optional binary suffix: `8`, `64K`, `16M`, `1G`.
fn parse_size(v: &str) -> Option<usize> {
    let (digits, shift) = match v.as_bytes().last()?.to_ascii_uppercase() {
        b'K' => (&v[..v.len() - 1], 10),
        b'M' => (&v[..v.len() - 1], 20),
        b'G' => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        test: Test::TagLat,
        tls: "posix,self".into(),
        size: 8,
        chunks: 40,
        iters: 0,
        window: 32,
        pause: Duration::ZERO,
        cpus: [0, 1],
        immediate: false,
        processes: false,
        serve: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // `cargo bench` passes `--bench` to every benchmark binary.
        if a == "--bench" {
            continue;
        }
        let mut value = || args.next().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        let number =
            |v: String| v.parse::<u64>().unwrap_or_else(|_| usage(&format!("{a}: not a number: {v}")));
        match a.as_str() {
            "--test" => {
                o.test = match value().as_str() {
                    "tag_lat" => Test::TagLat,
                    "tag_bw" => Test::TagBw,
                    "am_lat" => Test::AmLat,
                    "am_bw" => Test::AmBw,
                    "stream_lat" => Test::StreamLat,
                    "stream_bw" => Test::StreamBw,
                    "put_bw" => Test::PutBw,
                    "get_bw" => Test::GetBw,
                    t => usage(&format!(
                        "--test is tag_lat, tag_bw, am_lat, am_bw, stream_lat, stream_bw, put_bw or get_bw, not {t}"
                    )),
                }
            }
            "--tls" => o.tls = value(),
            "--window" => o.window = number(value()) as usize,
            "--size" => {
                let v = value();
                o.size = parse_size(&v).unwrap_or_else(|| usage(&format!("--size: not a size: {v}")));
            }
            "--chunks" => o.chunks = number(value()),
            "--iters" => o.iters = number(value()),
            "--pause-us" => o.pause = Duration::from_micros(number(value())),
            "--immediate" => o.immediate = true,
            "--processes" => o.processes = true,
            "--serve" => {
                let v = value();
                o.serve = Some(v.parse().unwrap_or_else(|_| usage(&format!("--serve: not a port: {v}"))));
            }
            "--cpus" => {
                let v = value();
                let c: Vec<usize> = v.split(',').filter_map(|x| x.parse().ok()).collect();
                o.cpus = match c[..] {
                    [a, b] => [a, b],
                    _ => usage(&format!("--cpus wants two CPU numbers, got {v}")),
                };
            }
            // A name filter, as `cargo bench -- FILTER` passes to every benchmark binary:
            // run only if it matches this benchmark, like criterion's benchmarks.
            f if !f.starts_with('-') => {
                if !"paired".contains(f) {
                    std::process::exit(0);
                }
            }
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    if o.iters == 0 {
        o.iters = match o.test {
            t if t.is_bw() => ((1u64 << 30) / o.size.max(1) as u64).clamp(64, 20_000),
            _ if !o.pause.is_zero() => (100_000 / (o.pause.as_micros() as u64 + 1)).clamp(50, 4000),
            _ => 4000,
        };
    }
    if o.test == Test::AmLat && o.size > AM_LAT_MAX {
        usage(&format!("am_lat sizes go up to {AM_LAT_MAX} bytes"));
    }
    if o.immediate && !matches!(o.test, Test::TagBw | Test::PutBw) {
        usage("--immediate is for tag_bw and put_bw");
    }
    if o.immediate && o.size > IMMEDIATE_MAX {
        usage(&format!("--immediate is for messages up to {IMMEDIATE_MAX} bytes (UCX's short protocol)"));
    }
    if o.test.is_bw() && !o.pause.is_zero() {
        usage("--pause-us is for the latency tests");
    }
    if o.chunks < 2 || o.chunks % 2 != 0 || o.window == 0 {
        usage("needs an even number of chunks (they come in pairs), at least 2, and a window of at least 1");
    }
    o
}

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

/// The answering side of one latency chunk: per round trip, one receive then one send.
async fn serve_lat(side: &mut PingPong, raw: bool, iters: u64) {
    for _ in 0..iters {
        side.recv(raw).await;
        side.send(raw).await;
    }
}

/// The receiving side of one bandwidth chunk: `window` receives kept posted, all into
/// `sink`, then an acknowledgement.
async fn serve_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, sink: &MemRegion) {
    let n = o.iters as usize;
    if raw {
        let (wh, ptr) = (w.as_raw(), sink.slice(0..o.size).stable_ptr().cast_mut());
        let mut posted = VecDeque::with_capacity(o.window);
        // SAFETY: as in `PingPong::send`; `sink` outlives every receive, each waited for
        // before this returns.
        unsafe {
            for _ in 0..n.min(o.window) {
                posted.push_back(raw::post_tag_recv(wh, ptr, o.size, PING, None));
            }
            for i in 0..n {
                raw::wait(wh, posted.pop_front().expect("posted"));
                if i + o.window < n {
                    posted.push_back(raw::post_tag_recv(wh, ptr, o.size, PING, None));
                }
            }
        }
    } else {
        let mut posted = VecDeque::with_capacity(o.window);
        for _ in 0..n.min(o.window) {
            posted.push_back(w.tag_recv(PING, tag::EXACT, sink.slice(0..o.size)));
        }
        for i in 0..n {
            posted.pop_front().expect("posted").await.0.expect("data");
            if i + o.window < n {
                posted.push_back(w.tag_recv(PING, tag::EXACT, sink.slice(0..o.size)));
            }
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The receiving side of one `stream_bw` chunk: the chunk's sends, each received whole
/// into `sink` (`WAITALL`), then an acknowledgement.
async fn serve_stream_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, sink: &MemRegion) {
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = sink.slice(0..o.size).stable_ptr().cast_mut();
        // SAFETY: as in `PingPong::send`; `sink` outlives every receive, each waited for.
        unsafe {
            for _ in 0..o.iters {
                raw::stream_recv_exact(wh, eh, ptr, o.size);
            }
        }
    } else {
        for _ in 0..o.iters {
            ep.stream_recv_exact(sink.slice(0..o.size)).await.0.expect("stream data");
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The receiving side of one `am_bw` chunk: the chunk's messages, each taken whole into
/// `sink` (see the module docs), then an acknowledgement. The raw path's handler, set up
/// by [`AmBwServer::new`], takes them on its own while the worker progresses.
async fn serve_am_bw(ep: &Endpoint, raw: bool, o: &Opts, am: &mut AmBwServer) {
    if raw {
        let want = am.raw.done.get() + o.iters;
        // SAFETY: this thread is the worker's only user and no ucxkit operation is pending.
        unsafe {
            while am.raw.done.get() < want {
                sys::ucp_worker_progress(am.raw.worker);
            }
        }
    } else {
        let mut fetching: VecDeque<ucxkit_transport::AmRecvData<_>> = VecDeque::with_capacity(o.window);
        for _ in 0..o.iters {
            let m = am.ucxkit.recv().await;
            if !m.is_rendezvous() {
                continue;
            }
            if fetching.len() == o.window {
                fetching.pop_front().expect("full").await.0.expect("fetch");
            }
            fetching.push_back(m.recv_data(am.sink.slice(0..o.size)));
        }
        while let Some(f) = fetching.pop_front() {
            f.await.0.expect("fetch");
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The server's two ways of taking `am_bw` messages. Dropping it removes the raw
/// handler, before the region its buffer points into can go.
struct AmBwServer {
    ucxkit: ucxkit_transport::AmReceiver,
    /// The raw handler's state (for the whole program: it must outlive the handler's
    /// registration even if a chunk panics).
    raw: &'static raw::AmSink,
    sink: MemRegion,
}

impl Drop for AmBwServer {
    fn drop(&mut self) {
        // SAFETY: this thread is the worker's only user, and the worker is alive (the
        // server drops this before its worker handle).
        unsafe { raw::count_am(self.raw.worker, Dir::Ping.raw_am_id(), None) };
    }
}

impl AmBwServer {
    fn new(w: &Worker, sink: &MemRegion) -> AmBwServer {
        let raw: &'static raw::AmSink = Box::leak(Box::new(raw::AmSink {
            worker: w.as_raw(),
            buf: sink.slice(0..sink.len()).stable_ptr().cast_mut(),
            len: sink.len(),
            done: Cell::new(0),
        }));
        // SAFETY: no ucxkit operation is pending and this thread is the worker's only
        // user; the region stays mapped (a clone is kept in `self`) until `drop` removes
        // the handler.
        unsafe { raw::sink_am(Dir::Ping.raw_am_id(), raw) };
        AmBwServer { ucxkit: w.am_recv(Dir::Ping.am_id()).expect("am_recv"), raw, sink: sink.clone() }
    }
}

/// The passive side of one one-sided chunk: it only answers the client's end-of-chunk
/// message, progressing its worker meanwhile (UCX's TCP transport carries puts and gets
/// as messages the target handles).
async fn acknowledge(w: &Worker, ep: &Endpoint, raw: bool) {
    recv_ack(w, raw, PING).await;
    send_ack(ep, raw, PONG).await;
}

/// The answering side.
fn server(o: Opts, link: Link) {
    pin(o.cpus[0]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, &link).await;
        let sink = w.context().alloc(o.size.max(1)).expect("receive buffer");
        // One-sided tests: the client reaches `sink` through a ucxkit key and through a
        // key packed with raw UCX.
        if o.test.is_rma() {
            link.send("key", sink.pack_key().expect("pack key"));
            // SAFETY: the context and the region are alive.
            link.send("raw key", unsafe { raw::pack_rkey(w.context().as_raw(), sink.as_raw()) });
            link.send("region address", sink.addr().to_le_bytes().to_vec());
        }
        let mut side = (!o.test.is_bw()).then(|| PingPong::new(w.clone(), ep.clone(), &o, Dir::Ping, 2));
        let mut am = (o.test == Test::AmBw).then(|| AmBwServer::new(&w, &sink));
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            let raw = is_raw(chunk);
            match (o.test, &mut side) {
                (Test::TagBw, _) => serve_bw(&w, &ep, raw, &o, &sink).await,
                (Test::StreamBw, _) => serve_stream_bw(&w, &ep, raw, &o, &sink).await,
                (Test::AmBw, _) => serve_am_bw(&ep, raw, &o, am.as_mut().expect("am_bw server")).await,
                (Test::PutBw | Test::GetBw, _) => acknowledge(&w, &ep, raw).await,
                (_, Some(side)) => serve_lat(side, raw, o.iters).await,
                (_, None) => unreachable!("a latency test has its ping-pong side"),
            }
        }
        match side {
            Some(side) => {
                drop(ep);
                side.finish().await;
            }
            None => ep.close().await.unwrap_or(()),
        }
    });
}

/// One latency chunk: per round trip, one send then one receive; the median one-way
/// latency in ns. With a `pause`, each round trip starts after it (and is timed from
/// then); without, each is timed from the end of the previous one (one clock read).
async fn measure_lat(side: &mut PingPong, raw: bool, iters: u64, pause: Duration) -> f64 {
    let mut times = Vec::with_capacity(iters as usize);
    let mut last = Instant::now();
    for _ in 0..iters {
        if !pause.is_zero() {
            while last.elapsed() < pause {
                std::hint::spin_loop();
            }
            last = Instant::now();
        }
        side.send(raw).await;
        side.recv(raw).await;
        let now = Instant::now();
        times.push((now - last).as_nanos() as u64);
        last = now;
    }
    times.sort_unstable();
    times[times.len() / 2] as f64 / 2.0
}

/// One `tag_bw`, `stream_bw` or `am_bw` chunk: up to `window` tag (stream,
/// active-message) sends from `source` in flight, then the server's acknowledgement; MiB/s.
async fn measure_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, source: &MemRegion) -> f64 {
    let test = o.test;
    // What `--immediate` sends from (borrowed, so any memory does), made before the clock.
    let data = if o.immediate { vec![1u8; o.size] } else { Vec::new() };
    let t0 = Instant::now();
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = source.slice(0..o.size).stable_ptr();
        // SAFETY: as in `PingPong::send`; `source` outlives every send, each waited for
        // before this returns.
        unsafe {
            raw_windowed(wh, o.iters, o.window, || match test {
                Test::StreamBw => raw::post_stream_send(eh, ptr, o.size),
                Test::AmBw => raw::post_am_send(eh, Dir::Ping.raw_am_id(), ptr, o.size),
                _ => raw::post_tag_send(eh, ptr, o.size, PING),
            });
        }
    } else if o.immediate {
        windowed_or_immediate(
            o.iters,
            o.window,
            || ep.try_tag_send(PING, &data).expect("immediate send"),
            || ep.tag_send(PING, source.slice(0..o.size)),
        )
        .await;
    } else {
        windowed(o.iters, o.window, || match test {
            Test::StreamBw => ep.stream_send(source.slice(0..o.size)),
            Test::AmBw => ep.am_send(Dir::Ping.am_id(), &[], source.slice(0..o.size)),
            _ => ep.tag_send(PING, source.slice(0..o.size)),
        })
        .await;
    }
    recv_ack(w, raw, PONG).await;
    mib_per_s(o, t0)
}

/// An operation future of ucxkit's, as [`windowed`] keeps it: whether UCX finished it
/// while posting, and the check of its result.
trait WindowOp: std::future::Future + Unpin {
    fn immediate(&self) -> bool;
    fn check(out: Self::Output);
}

impl<B: ucxkit_transport::IoBuf> WindowOp for ucxkit_transport::SendOp<B> {
    fn immediate(&self) -> bool {
        self.completed_immediately()
    }
    fn check(out: Self::Output) {
        out.0.expect("operation");
    }
}

impl<B: ucxkit_transport::IoBufMut> WindowOp for ucxkit_transport::RecvOp<B> {
    fn immediate(&self) -> bool {
        self.completed_immediately()
    }
    fn check(out: Self::Output) {
        out.0.expect("operation");
    }
}

/// Keeps up to `window` of `n` operations in flight, counting only those UCX did not
/// complete at once, the way UCX programs do: `post` posts one. One that completed at
/// once is awaited right away, as application code would.
async fn windowed<F: WindowOp>(n: u64, window: usize, post: impl FnMut() -> F) {
    windowed_or_immediate(n, window, || false, post).await;
}

/// [`windowed`], each operation first tried with `try_now` (true: UCX completed it during
/// the call) and posted with `post` only when that did not complete it.
async fn windowed_or_immediate<F: WindowOp>(
    n: u64,
    window: usize,
    mut try_now: impl FnMut() -> bool,
    mut post: impl FnMut() -> F,
) {
    let mut inflight = VecDeque::with_capacity(window);
    for _ in 0..n {
        if try_now() {
            continue;
        }
        if inflight.len() == window {
            F::check(inflight.pop_front().expect("in flight").await);
        }
        let op = post();
        if op.immediate() {
            F::check(op.await);
        } else {
            inflight.push_back(op);
        }
    }
    while let Some(op) = inflight.pop_front() {
        F::check(op.await);
    }
}

/// The same through raw UCX: `post` returns what the `*_nbx` call returned.
///
/// # Safety
/// As for [`raw::wait`], for every operation `post` posts on `w`.
unsafe fn raw_windowed(
    w: sys::ucp_worker_h,
    n: u64,
    window: usize,
    mut post: impl FnMut() -> sys::ucs_status_ptr_t,
) {
    let mut inflight = VecDeque::with_capacity(window);
    // SAFETY: per contract.
    unsafe {
        for _ in 0..n {
            if inflight.len() == window {
                raw::wait(w, inflight.pop_front().expect("in flight"));
            }
            let s = post();
            assert!(!sys::UCS_PTR_IS_ERR(s), "raw operation failed");
            if sys::UCS_PTR_IS_PTR(s) {
                inflight.push_back(s);
            }
        }
        while let Some(s) = inflight.pop_front() {
            raw::wait(w, s);
        }
    }
}

/// The server's region, as both paths reach it.
struct Remote {
    key: ucxkit_transport::RemoteKey,
    raw_key: raw::RawRkey,
    raw_addr: u64,
}

/// One `put_bw` or `get_bw` chunk: up to `window` puts from (gets into) `source` in
/// flight, a flush, then an end-of-chunk exchange with the server; MiB/s.
async fn measure_rma_bw(
    w: &Worker,
    ep: &Endpoint,
    raw: bool,
    o: &Opts,
    source: &MemRegion,
    remote: &Remote,
) -> f64 {
    let get = o.test == Test::GetBw;
    let data = if o.immediate { vec![1u8; o.size] } else { Vec::new() };
    let t0 = Instant::now();
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = source.slice(0..o.size).stable_ptr().cast_mut();
        // SAFETY: as in `PingPong::send`; `source` and the server's region outlive every
        // operation, each waited for; the key belongs to `ep` and covers `size` bytes.
        unsafe {
            raw_windowed(wh, o.iters, o.window, || {
                raw::post_rma(eh, get, ptr, o.size, remote.raw_addr, &remote.raw_key)
            });
            raw::flush(wh, eh);
        }
    } else {
        if get {
            windowed(o.iters, o.window, || ep.get(source.slice(0..o.size), o.size, &remote.key, 0)).await;
        } else if o.immediate {
            windowed_or_immediate(
                o.iters,
                o.window,
                || ep.try_put(&data, &remote.key, 0).expect("immediate put"),
                || ep.put(source.slice(0..o.size), &remote.key, 0),
            )
            .await;
        } else {
            windowed(o.iters, o.window, || ep.put(source.slice(0..o.size), &remote.key, 0)).await;
        }
        ep.flush().await.expect("flush");
    }
    send_ack(ep, raw, PING).await;
    recv_ack(w, raw, PONG).await;
    mib_per_s(o, t0)
}

/// A chunk's bandwidth in MiB/s, from its start.
fn mib_per_s(o: &Opts, t0: Instant) -> f64 {
    (o.size as f64 * o.iters as f64) / t0.elapsed().as_secs_f64() / (1 << 20) as f64
}

/// The measuring side: each chunk's figure.
fn client(o: Opts, link: Link) -> Vec<f64> {
    pin(o.cpus[1]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, &link).await;
        let mut side = (!o.test.is_bw()).then(|| PingPong::new(w.clone(), ep.clone(), &o, Dir::Pong, 1));
        let source = w.context().alloc(o.size.max(1)).expect("send buffer");
        source.write_at(0, &vec![1u8; o.size]);
        let keys = o.test.is_rma().then(|| {
            let key = ep.unpack_key(&link.recv("key")).expect("unpack key");
            // SAFETY: no ucxkit operation is pending and this thread is the worker's only
            // user; the key is dropped before the endpoint closes.
            let raw_key = unsafe { raw::RawRkey::unpack(ep.as_raw(), &link.recv("raw key")) };
            let addr = link.recv("region address");
            let raw_addr = u64::from_le_bytes(addr.try_into().expect("an address of 8 bytes"));
            Remote { key, raw_key, raw_addr }
        });
        let mut figures = Vec::with_capacity(o.chunks as usize);
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            let raw = is_raw(chunk);
            figures.push(match (o.test, &keys, &mut side) {
                (Test::TagBw | Test::StreamBw | Test::AmBw, ..) => {
                    measure_bw(&w, &ep, raw, &o, &source).await
                }
                (Test::PutBw | Test::GetBw, Some(k), _) => measure_rma_bw(&w, &ep, raw, &o, &source, k).await,
                (_, _, Some(side)) => measure_lat(side, raw, o.iters, o.pause).await,
                _ => unreachable!("a latency test has its ping-pong side, a one-sided one its keys"),
            });
        }
        drop(keys);
        match side {
            Some(side) => {
                drop(ep);
                side.finish().await;
            }
            None => ep.close().await.unwrap_or(()),
        }
        figures
    })
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
