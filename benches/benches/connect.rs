//! What a connection costs: a client's `connect` to a listener until both sides hold
//! their endpoint, through ucxkit's front (without and with a secret) and through UCX's
//! connection manager (`listen_with`/`connect_with` with the handshake off, which is
//! what a plain UCX client and server do). Closing the endpoints is not timed.
//!
//! Two cases of transports: TCP only (UCX's peer error mode) and shared memory with TCP
//! (error mode none). With tcp in both contexts the front hands the client a one-shot
//! UCX listener (see `front::server`): a connection costs the front's exchange and a
//! UCX connection-manager connect.
//!
//! `cargo bench -p ucxkit-benches --bench connect`

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ucxkit_transport::{Context, EndpointOptions, Listener, Secret, Worker};

/// One way of connecting: a listener and the options its clients connect with.
struct Setup {
    rt: tokio::runtime::Runtime,
    ctx: Context,
    listener: Listener,
    client_opts: EndpointOptions,
    // Held so that the listener's worker outlives the benchmark.
    _server: Worker,
}

fn context(tls: &str, secret: bool) -> Context {
    let mut b = Context::builder().transports(tls).config("NET_DEVICES", "lo");
    if secret {
        b = b.secret(Secret::new([7u8; 32]).expect("secret"));
    }
    b.build().expect("context")
}

fn setup(tls: &str, secret: bool, handshake: bool) -> Setup {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let ctx = context(tls, secret);
    let opts = EndpointOptions { handshake, ..EndpointOptions::default() };
    let (server, listener) = rt.block_on(async {
        let w = ctx.create_worker().expect("worker");
        let l = w.listen_with(SocketAddr::from(([127, 0, 0, 1], 0)), opts.clone()).expect("listen");
        (w, l)
    });
    Setup { rt, ctx, listener, client_opts: opts, _server: server }
}

/// `iters` connections from a fresh client worker (a new worker pair per sample keeps
/// each pair's endpoint count small), each accepted, timed until both sides have their
/// endpoint; the endpoints are closed untimed.
fn connections(s: &Setup, iters: u64) -> Duration {
    s.rt.block_on(async {
        let client = s.ctx.create_worker().expect("client worker");
        let addr = s.listener.local_addr();
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let t = Instant::now();
            let (a, c) = tokio::join!(s.listener.accept(), client.connect_with(addr, s.client_opts.clone()));
            total += t.elapsed();
            let (a, c) = (a.expect("accept"), c.expect("connect"));
            let _ = tokio::join!(a.close(), c.close());
        }
        total
    })
}

fn connect(c: &mut Criterion) {
    for (tls, name) in [("tcp,self", "tcp"), ("posix,cma,tcp,self", "shm")] {
        let mut g = c.benchmark_group(format!("connect_{name}"));
        g.sample_size(20).measurement_time(Duration::from_secs(4));
        for (what, secret, handshake) in
            [("front", false, true), ("front_secret", true, true), ("ucx_cm", false, false)]
        {
            let s = setup(tls, secret, handshake);
            g.bench_function(what, |b| b.iter_custom(|iters| connections(&s, iters)));
        }
        g.finish();
    }
}

criterion_group!(benches, connect);
criterion_main!(benches);
