//! Paired ping-pong: ucxkit's tag API against raw `ucp_*` calls on the same two workers,
//! the same endpoints and the same pinned threads, alternating in chunks of round trips.
//!
//! Comparing ucxkit with a separate `ucx_perftest` run mixes CPU placements on a virtual
//! machine whose host moves its CPUs between runs (one-way latency over shared memory
//! falls into clusters several times apart). Here every ucxkit chunk sits between two raw
//! chunks of the same run, so each ratio compares like placements, and the median of the
//! per-pair ratios is what ucxkit adds on the latency path.
//!
//! ```text
//! cargo bench -p ucxkit-benches --bench pingpong -- [--tls posix,self] [--size 8]
//!     [--chunks 40] [--iters 4000] [--cpus 0,1] [FILTER]
//! ```
//!
//! A `FILTER` that is not part of the name `pingpong` skips the benchmark, so that
//! `cargo bench -p ucxkit-benches -- FILTER` can pick criterion benchmarks.
//!
//! Two workers, each on its own thread with its own current-thread runtime and busy-poll
//! progress, pinned to the two CPUs. Per chunk the client records each round trip's
//! time; a chunk's figure is its median, halved (one-way latency, as ucx_perftest reports).

use std::cell::Cell;
use std::sync::mpsc;
use std::time::Instant;

use ucx_sys as sys;
use ucxkit_transport::{
    tag, Context, Endpoint, EndpointOptions, ErrorMode, ProgressMode, Worker, WorkerAddress,
};

mod raw;

const PING: u64 = 0x5049_4e47;
const PONG: u64 = 0x504f_4e47;

/// What the command line asks for.
#[derive(Clone)]
struct Opts {
    tls: String,
    size: usize,
    chunks: u64,
    iters: u64,
    cpus: [usize; 2],
}

fn usage(msg: &str) -> ! {
    eprintln!("pingpong: {msg}");
    eprintln!("usage: pingpong [--tls LIST] [--size BYTES] [--chunks N] [--iters N] [--cpus A,B] [FILTER]");
    std::process::exit(2);
}

fn parse_opts() -> Opts {
    let mut o = Opts { tls: "posix,self".into(), size: 8, chunks: 40, iters: 4000, cpus: [0, 1] };
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
            "--tls" => o.tls = value(),
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
                if !"pingpong".contains(f) {
                    std::process::exit(0);
                }
            }
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    if o.chunks < 2 || o.iters == 0 {
        usage("needs at least 2 chunks of at least 1 iteration");
    }
    o
}

fn pin(cpu: usize) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        eprintln!("pingpong: could not pin a thread to cpu {cpu}; running unpinned");
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
        raw::wait_send(w, s);
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

/// Even chunks go through ucxkit, odd ones through raw UCX.
fn is_raw(chunk: u64) -> bool {
    chunk % 2 == 1
}

/// The answering side: per round trip, one receive then one send.
fn server(o: Opts, mine: mpsc::Sender<Vec<u8>>, theirs: mpsc::Receiver<Vec<u8>>) {
    pin(o.cpus[0]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, mine, theirs).await;
        let payload: &'static [u8] = Vec::leak(vec![2u8; o.size]);
        let mut raw_buf = vec![0u8; o.size];
        let mut buf = Vec::with_capacity(o.size);
        for chunk in 0..o.chunks {
            for _ in 0..o.iters {
                if is_raw(chunk) {
                    // SAFETY: the handles are live (held by `w` and `ep`); this thread is
                    // the only user of the worker, and no ucxkit operation is pending.
                    unsafe {
                        raw_recv(w.as_raw(), &mut raw_buf, PING);
                        raw_send(w.as_raw(), ep.as_raw(), payload, PONG);
                    }
                } else {
                    let (r, b) = w.tag_recv(PING, tag::EXACT, buf).await;
                    r.expect("ping");
                    buf = b;
                    ep.tag_send(PONG, payload).await.0.expect("pong");
                }
            }
        }
        ep.close().await.ok();
    });
}

/// The measuring side: per round trip, one send then one receive; returns each chunk's
/// median one-way latency in ns.
fn client(o: Opts, mine: mpsc::Sender<Vec<u8>>, theirs: mpsc::Receiver<Vec<u8>>) -> Vec<f64> {
    pin(o.cpus[1]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, mine, theirs).await;
        let payload: &'static [u8] = Vec::leak(vec![1u8; o.size]);
        let mut raw_buf = vec![0u8; o.size];
        let mut buf = Vec::with_capacity(o.size);
        let mut medians = Vec::with_capacity(o.chunks as usize);
        let mut times = Vec::with_capacity(o.iters as usize);
        for chunk in 0..o.chunks {
            times.clear();
            let mut last = Instant::now();
            for _ in 0..o.iters {
                if is_raw(chunk) {
                    // SAFETY: as in `server`.
                    unsafe {
                        raw_send(w.as_raw(), ep.as_raw(), payload, PING);
                        raw_recv(w.as_raw(), &mut raw_buf, PONG);
                    }
                } else {
                    let send = ep.tag_send(PING, payload);
                    let recv = w.tag_recv(PONG, tag::EXACT, buf);
                    send.await.0.expect("ping");
                    let (r, b) = recv.await;
                    r.expect("pong");
                    buf = b;
                }
                let now = Instant::now();
                times.push((now - last).as_nanos() as u64);
                last = now;
            }
            times.sort_unstable();
            medians.push(times[times.len() / 2] as f64 / 2.0);
        }
        ep.close().await.ok();
        medians
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
    let medians = client(o.clone(), to_server, from_server);
    srv.join().expect("server thread");

    // Each ucxkit chunk against the raw chunk after it.
    let (mut ours, mut raw, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in medians.chunks_exact(2) {
        ours.push(pair[0]);
        raw.push(pair[1]);
        ratios.push(pair[0] / pair[1]);
    }
    let (lo, hi) = ratios.iter().fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
    println!(
        "tag ping-pong, {} B over {}, cpus {},{}: {} pairs of {}-round-trip chunks",
        o.size,
        o.tls,
        o.cpus[0],
        o.cpus[1],
        ratios.len(),
        o.iters
    );
    println!(
        "one-way latency, median of chunk medians: ucxkit {:.1} ns, raw UCX {:.1} ns",
        median(&mut ours),
        median(&mut raw)
    );
    println!(
        "ucxkit / raw UCX, median of paired ratios: {:.3} (range {lo:.3} .. {hi:.3})",
        median(&mut ratios)
    );
}
