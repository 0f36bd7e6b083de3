//! Paired runs: ucxkit's tag API against raw `ucp_*` calls on the same two workers, the
//! same endpoints and the same pinned threads, alternating in chunks.
//!
//! Comparing ucxkit with a separate `ucx_perftest` run mixes CPU placements on a virtual
//! machine whose host moves its CPUs between runs (one-way latency over shared memory
//! falls into clusters several times apart, and TCP bandwidth swings as much). Here every
//! ucxkit chunk is followed by a raw chunk of the same run, so each ratio compares like
//! placements, and the median of the per-pair ratios is what ucxkit costs.
//!
//! ```text
//! cargo bench -p ucxkit-benches --bench paired -- [--test lat|bw] [--tls posix,self]
//!     [--size 8] [--chunks 40] [--iters N] [--window 32] [--cpus 0,1] [FILTER]
//! ```
//!
//! - `lat`: ping-pong; a chunk's figure is the median round trip, halved (one-way latency,
//!   as ucx_perftest reports). Default 4000 round trips per chunk.
//! - `bw`: the client keeps up to `--window` sends in flight (counting, as ucx_perftest
//!   does, only those UCX did not complete at once), the server keeps as many receives
//!   posted, all into one buffer UCX allocated, and acknowledges each chunk; a chunk's
//!   figure is its bandwidth, from the first send to the acknowledgement. Default: 1 GiB
//!   per chunk, 64 to 20,000 messages.
//!
//! A `FILTER` that is not part of the name `paired` skips the benchmark, so that
//! `cargo bench -p ucxkit-benches -- FILTER` can pick criterion benchmarks.
//!
//! Two workers, each on its own thread with its own current-thread runtime and busy-poll
//! progress, pinned to the two CPUs. A first pair of chunks warms up and is not counted.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Instant;

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
    /// Ping-pong, one-way latency.
    Lat,
    /// Windowed streaming, bandwidth.
    Bw,
}

/// What the command line asks for.
#[derive(Clone)]
struct Opts {
    test: Test,
    tls: String,
    size: usize,
    chunks: u64,
    iters: u64,
    window: usize,
    cpus: [usize; 2],
}

fn usage(msg: &str) -> ! {
    eprintln!("paired: {msg}");
    eprintln!(
        "usage: paired [--test lat|bw] [--tls LIST] [--size BYTES] [--chunks N] [--iters N] [--window N] [--cpus A,B] [FILTER]"
    );
    std::process::exit(2);
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        test: Test::Lat,
        tls: "posix,self".into(),
        size: 8,
        chunks: 40,
        iters: 0,
        window: 32,
        cpus: [0, 1],
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
                    "lat" => Test::Lat,
                    "bw" => Test::Bw,
                    t => usage(&format!("--test is lat or bw, not {t}")),
                }
            }
            "--tls" => o.tls = value(),
            "--window" => o.window = number(value()) as usize,
            "--size" => o.size = number(value()) as usize,
            "--chunks" => o.chunks = number(value()),
            "--iters" => o.iters = number(value()),
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
            Test::Lat => 4000,
            Test::Bw => ((1u64 << 30) / o.size.max(1) as u64).clamp(64, 20_000),
        };
    }
    if o.chunks < 2 || o.window == 0 {
        usage("needs at least 2 chunks and a window of at least 1");
    }
    o
}

fn pin(cpu: usize) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        eprintln!("paired: could not pin a thread to cpu {cpu}; running unpinned");
    }
}

/// A raw tag send, progressed to completion.
///
/// # Safety
/// `w` and `ep` are live, and nothing else uses the worker during the call.
unsafe fn raw_send(w: sys::ucp_worker_h, ep: sys::ucp_ep_h, buf: &[u8], t: u64) {
    // SAFETY: per contract; buf outlives the request, which completes before return.
    unsafe {
        let s = sys::ucp_tag_send_nbx(ep, buf.as_ptr().cast(), buf.len(), t, &raw::send_param());
        raw::wait(w, s);
    }
}

/// A raw tag receive, progressed to completion.
///
/// # Safety
/// As for [`raw_send`].
unsafe fn raw_recv(w: sys::ucp_worker_h, buf: &mut [u8], t: u64) {
    let done = Cell::new(false);
    // SAFETY: per contract; buf and `done` outlive the request, which completes before
    // return.
    unsafe {
        let r = sys::ucp_tag_recv_nbx(
            w,
            buf.as_mut_ptr().cast(),
            buf.len(),
            t,
            tag::EXACT,
            &raw::recv_param(&done),
        );
        raw::wait_recv(w, r, &done);
    }
}

/// A worker on this thread's runtime and an endpoint to the other thread's worker.
async fn connect(
    tls: &str,
    mine: mpsc::Sender<Vec<u8>>,
    theirs: mpsc::Receiver<Vec<u8>>,
) -> (Worker, Endpoint) {
    let ctx = Context::builder().transports(tls).build().expect("context");
    let w = ctx.worker().progress_mode(ProgressMode::BusyPoll).build().expect("worker");
    mine.send(w.address().expect("address").as_bytes().to_vec()).expect("send address");
    let addr = WorkerAddress::from_bytes(&theirs.recv().expect("peer address")).expect("parse address");
    // No UCX peer-failure handling: with it, UCX 1.13 leaves shared memory out.
    let opts = EndpointOptions { error_mode: ErrorMode::None, ..EndpointOptions::default() };
    let ep = w.connect_address_with(&addr, opts).await.expect("connect");
    (w, ep)
}

/// A first pair of chunks, not counted: it pays for first touches and connection set-up.
const WARMUP_CHUNKS: u64 = 2;

/// Even chunks go through ucxkit, odd ones through raw UCX.
fn is_raw(chunk: u64) -> bool {
    chunk % 2 == 1
}

/// A tag receive into `buf` without a callback, for [`raw::wait`]: the request pointer,
/// or a status if it completed at once.
///
/// # Safety
/// `w` is live and nothing else uses it during the call; `buf` stays valid for `len`
/// bytes until the request completes.
unsafe fn raw_post_recv(w: sys::ucp_worker_h, buf: *mut u8, len: usize, t: u64) -> sys::ucs_status_ptr_t {
    let param = sys::ucp_request_param_t::default();
    // SAFETY: per contract.
    unsafe { sys::ucp_tag_recv_nbx(w, buf.cast(), len, t, tag::EXACT, &param) }
}

/// The answering side of one chunk: per round trip, one receive then one send.
async fn serve_lat(
    w: &Worker,
    ep: &Endpoint,
    raw: bool,
    o: &Opts,
    payload: &'static [u8],
    buf: &mut Vec<u8>,
) {
    let mut raw_buf = vec![0u8; o.size];
    for _ in 0..o.iters {
        if raw {
            // SAFETY: the handles are live (held by `w` and `ep`); this thread is the only
            // user of the worker, and no ucxkit operation is pending.
            unsafe {
                raw_recv(w.as_raw(), &mut raw_buf, PING);
                raw_send(w.as_raw(), ep.as_raw(), payload, PONG);
            }
        } else {
            let (r, b) = w.tag_recv(PING, tag::EXACT, std::mem::take(buf)).await;
            r.expect("ping");
            *buf = b;
            ep.tag_send(PONG, payload).await.0.expect("pong");
        }
    }
}

/// The receiving side of one bandwidth chunk: `window` receives kept posted, all into
/// `sink`, then an acknowledgement.
async fn serve_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, sink: &MemRegion) {
    let n = o.iters as usize;
    if raw {
        let ptr = sink.slice(0..o.size).stable_ptr().cast_mut();
        let mut posted = VecDeque::with_capacity(o.window);
        // SAFETY: as in `serve_lat`; `sink` outlives every receive, each waited for
        // before this returns.
        unsafe {
            for _ in 0..n.min(o.window) {
                posted.push_back(raw_post_recv(w.as_raw(), ptr, o.size, PING));
            }
            for i in 0..n {
                raw::wait(w.as_raw(), posted.pop_front().expect("posted"));
                if i + o.window < n {
                    posted.push_back(raw_post_recv(w.as_raw(), ptr, o.size, PING));
                }
            }
            raw_send(w.as_raw(), ep.as_raw(), b"ack", PONG);
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
        ep.tag_send(PONG, &b"ack"[..]).await.0.expect("ack");
    }
}

/// The answering side.
fn server(o: Opts, mine: mpsc::Sender<Vec<u8>>, theirs: mpsc::Receiver<Vec<u8>>) {
    pin(o.cpus[0]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, mine, theirs).await;
        let payload: &'static [u8] = Vec::leak(vec![2u8; o.size]);
        let mut buf = Vec::with_capacity(o.size);
        let sink = w.context().alloc(o.size.max(1)).expect("receive buffer");
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            match o.test {
                Test::Lat => serve_lat(&w, &ep, is_raw(chunk), &o, payload, &mut buf).await,
                Test::Bw => serve_bw(&w, &ep, is_raw(chunk), &o, &sink).await,
            }
        }
        ep.close().await.ok();
    });
}

/// One latency chunk: per round trip, one send then one receive; the median one-way
/// latency in ns.
async fn measure_lat(
    w: &Worker,
    ep: &Endpoint,
    raw: bool,
    o: &Opts,
    payload: &'static [u8],
    buf: &mut Vec<u8>,
) -> f64 {
    let mut raw_buf = vec![0u8; o.size];
    let mut times = Vec::with_capacity(o.iters as usize);
    let mut last = Instant::now();
    for _ in 0..o.iters {
        if raw {
            // SAFETY: as in `serve_lat`.
            unsafe {
                raw_send(w.as_raw(), ep.as_raw(), payload, PING);
                raw_recv(w.as_raw(), &mut raw_buf, PONG);
            }
        } else {
            let send = ep.tag_send(PING, payload);
            let recv = w.tag_recv(PONG, tag::EXACT, std::mem::take(buf));
            send.await.0.expect("ping");
            let (r, b) = recv.await;
            r.expect("pong");
            *buf = b;
        }
        let now = Instant::now();
        times.push((now - last).as_nanos() as u64);
        last = now;
    }
    times.sort_unstable();
    times[times.len() / 2] as f64 / 2.0
}

/// One bandwidth chunk: up to `window` sends from `source` in flight, then the server's
/// acknowledgement; MiB/s.
async fn measure_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, source: &MemRegion) -> f64 {
    let t0 = Instant::now();
    if raw {
        let ptr = source.slice(0..o.size).stable_ptr();
        let mut ack = [0u8; 3];
        let mut inflight = VecDeque::with_capacity(o.window);
        // SAFETY: as in `serve_lat`; `source` outlives every send, each waited for before
        // this returns.
        unsafe {
            for _ in 0..o.iters {
                if inflight.len() == o.window {
                    raw::wait(w.as_raw(), inflight.pop_front().expect("in flight"));
                }
                let s = sys::ucp_tag_send_nbx(ep.as_raw(), ptr.cast(), o.size, PING, &raw::send_param());
                assert!(!sys::UCS_PTR_IS_ERR(s), "raw send failed");
                if sys::UCS_PTR_IS_PTR(s) {
                    inflight.push_back(s);
                }
            }
            while let Some(s) = inflight.pop_front() {
                raw::wait(w.as_raw(), s);
            }
            raw_recv(w.as_raw(), &mut ack, PONG);
        }
    } else {
        let mut inflight = VecDeque::with_capacity(o.window);
        for _ in 0..o.iters {
            if inflight.len() == o.window {
                let op: ucxkit_transport::SendOp<_> = inflight.pop_front().expect("in flight");
                op.await.0.expect("send");
            }
            let op = ep.tag_send(PING, source.slice(0..o.size));
            if op.completed_immediately() {
                op.await.0.expect("send");
            } else {
                inflight.push_back(op);
            }
        }
        while let Some(op) = inflight.pop_front() {
            op.await.0.expect("send");
        }
        w.tag_recv(PONG, tag::EXACT, Vec::with_capacity(3)).await.0.expect("ack");
    }
    (o.size as f64 * o.iters as f64) / t0.elapsed().as_secs_f64() / (1 << 20) as f64
}

/// The measuring side: each chunk's figure.
fn client(o: Opts, mine: mpsc::Sender<Vec<u8>>, theirs: mpsc::Receiver<Vec<u8>>) -> Vec<f64> {
    pin(o.cpus[1]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, mine, theirs).await;
        let payload: &'static [u8] = Vec::leak(vec![1u8; o.size]);
        let mut buf = Vec::with_capacity(o.size);
        let source = w.context().alloc(o.size.max(1)).expect("send buffer");
        for at in (0..o.size).step_by(4096) {
            source.write_at(at, &payload[at..o.size.min(at + 4096)]);
        }
        let mut figures = Vec::with_capacity(o.chunks as usize);
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            figures.push(match o.test {
                Test::Lat => measure_lat(&w, &ep, is_raw(chunk), &o, payload, &mut buf).await,
                Test::Bw => measure_bw(&w, &ep, is_raw(chunk), &o, &source).await,
            });
        }
        ep.close().await.ok();
        figures
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let o = parse_opts();
    let (to_client, from_server) = mpsc::channel();
    let (to_server, from_client) = mpsc::channel();
    let so = o.clone();
    let srv = std::thread::spawn(move || server(so, to_client, from_client));
    let figures = client(o.clone(), to_server, from_server);
    srv.join().expect("server thread");

    // Each ucxkit chunk against the raw chunk after it, after the warm-up pair.
    let (mut ours, mut raw, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in figures[WARMUP_CHUNKS as usize..].chunks_exact(2) {
        ours.push(pair[0]);
        raw.push(pair[1]);
        ratios.push(pair[0] / pair[1]);
    }
    let (lo, hi) = ratios.iter().fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
    let (what, unit, chunk) = match o.test {
        Test::Lat => ("tag ping-pong", "one-way latency (ns)", "round trips"),
        Test::Bw => ("tag streaming", "bandwidth (MiB/s)", "messages"),
    };
    println!(
        "{what}, {} B over {}, cpus {},{}: {} pairs of chunks of {} {chunk}",
        o.size,
        o.tls,
        o.cpus[0],
        o.cpus[1],
        ratios.len(),
        o.iters
    );
    println!("{unit}, median of chunks: ucxkit {:.1}, raw UCX {:.1}", median(&mut ours), median(&mut raw));
    println!(
        "ucxkit / raw UCX, median of paired ratios: {:.3} (range {lo:.3} .. {hi:.3})",
        median(&mut ratios)
    );
}
