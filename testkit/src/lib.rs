//! Shared helpers for the integration tests: contexts pinned to a transport set, worker
//! pairs connected through a listener on 127.0.0.1:0 (the real port is passed along, no
//! port guessing), and deterministic payloads.

#![allow(dead_code, unreachable_pub)]

pub mod forge;
pub mod netns;

use std::net::SocketAddr;

use ucxkit::transport::{Context, Endpoint, EndpointOptions, ErrorMode, ProgressMode, Worker};

/// A context limited to `tls` (for example `"tcp,self"` or `"posix,cma,self"`), with
/// TCP on the loopback device, or on the devices `UCXKIT_NET_DEVICES` names (set for
/// the children tests run in network namespaces of their own).
pub fn ctx(tls: &str) -> Context {
    let mut b = Context::builder().transports(tls);
    if tls.contains("tcp") {
        b = b.config("NET_DEVICES", std::env::var("UCXKIT_NET_DEVICES").unwrap_or_else(|_| "lo".into()));
    }
    b.build().expect("context")
}

/// How long [`pair_with`] waits for its two workers to connect.
pub const CONNECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Two workers of one context, connected through a listener; returns
/// (server worker, client worker, server-side endpoint, client-side endpoint).
pub async fn pair_with(
    tls: &str,
    mode: ErrorMode,
    progress: ProgressMode,
) -> (Worker, Worker, Endpoint, Endpoint) {
    let c = ctx(tls);
    let opts = EndpointOptions { error_mode: mode, ..Default::default() };
    let server =
        c.worker().progress_mode(progress).endpoint_options(opts.clone()).build().expect("server worker");
    let client = c.worker().progress_mode(progress).endpoint_options(opts).build().expect("client worker");
    let listener = server.listen(loopback()).expect("listen");
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "listener reports its real port");
    // Bounded: without a connection manager among the transports (`tcp`), connecting
    // through a listener would wait forever.
    let (a, b) =
        tokio::time::timeout(CONNECT_LIMIT, async { tokio::join!(listener.accept(), client.connect(addr)) })
            .await
            .unwrap_or_else(|_| {
                panic!("connecting over {tls} took over {CONNECT_LIMIT:?} (is tcp in the list?)")
            });
    (server, client, a.expect("accept"), b.expect("connect"))
}

/// [`pair_with`] in the default error mode and the progress mode from
/// `UCXKIT_TEST_PROGRESS` (`event`, the default, or `busy`).
pub async fn pair(tls: &str) -> (Worker, Worker, Endpoint, Endpoint) {
    let progress = match std::env::var("UCXKIT_TEST_PROGRESS").as_deref() {
        Ok("busy") => ProgressMode::BusyPoll,
        _ => ProgressMode::Event,
    };
    pair_with(tls, ErrorMode::Auto, progress).await
}

pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// `len` bytes that depend on `seed` and the position.
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..len).map(|_| rng.next() as u8).collect()
}

/// A small deterministic generator (xorshift64), for payloads and generated test cases.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value; 0 is made nonzero).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// The next value.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Waits (at most `limit`) until `w` holds no parked request and no endpoint waiting for
/// its peer to close first ([`Worker::parked_requests`] is 0); panics past the limit.
pub async fn wait_parked_zero(w: &Worker, limit: std::time::Duration) {
    let deadline = std::time::Instant::now() + limit;
    while w.parked_requests() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "parked requests never drained: {}",
            w.parked_requests()
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// In a child test (this test binary run again by its parent): whether the variable
/// `env` is set, that is, whether this is the child's run; if so, sends ucxkit's
/// `tracing` output for `filter` (an `EnvFilter`) to stderr.
pub fn child_run(env: &str, filter: &str) -> bool {
    if std::env::var_os(env).is_none() {
        return false;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .init();
    true
}

/// Whether the UCX loaded here has remote atomics over TCP in UCX's peer error mode:
/// from 1.16 on it has no protocol for them there (it leaves its software emulation out).
pub fn tcp_atomics_in_peer_mode() -> bool {
    Context::ucx_version() < (1, 16, 0)
}
