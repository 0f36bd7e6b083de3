//! Workers for tests: contexts pinned to a transport set, connected pairs and full meshes
//! in one process (through listeners on 127.0.0.1:0: the real port is passed along, no
//! port guessing), and waits on what a worker still holds.

use std::net::SocketAddr;

use ucxkit_transport::{Context, Endpoint, EndpointOptions, ErrorMode, ProgressMode, Worker};

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

/// `127.0.0.1:0`: a loopback address whose port the system picks.
pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// `n` workers of one context, each connected to every other: worker `j` connects to
/// worker `i`'s listener for every `i < j`, saying who it is in its connect payload.
/// `eps[i][j]` is worker `i`'s endpoint to worker `j` (None for `i == j`).
pub struct Mesh {
    /// The workers, by rank.
    pub workers: Vec<Worker>,
    /// The endpoints: `eps[i][j]` from worker `i` to worker `j`.
    pub eps: Vec<Vec<Option<Endpoint>>>,
}

impl Mesh {
    /// Worker `i`'s endpoint to worker `j`.
    ///
    /// # Panics
    /// When `i == j` or either is out of range.
    pub fn ep(&self, i: usize, j: usize) -> &Endpoint {
        self.eps[i][j].as_ref().expect("no endpoint from a worker to itself")
    }
}

/// A full mesh of `n` workers over `tls` (see [`Mesh`]), in the progress mode
/// `progress`. Connections are made one at a time (UCX before 1.18 can trip over
/// several workers of a process opening sockets at once; see `ucxkit_transport::Worker`).
pub async fn mesh_with(tls: &str, n: usize, progress: ProgressMode) -> Mesh {
    let c = ctx(tls);
    let workers: Vec<Worker> =
        (0..n).map(|_| c.worker().progress_mode(progress).build().expect("worker")).collect();
    let mut eps: Vec<Vec<Option<Endpoint>>> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for i in 0..n {
        let listener = workers[i].listen(loopback()).expect("listen");
        let addr = listener.local_addr();
        for j in i + 1..n {
            let opts =
                EndpointOptions { connect_payload: (j as u64).to_le_bytes().to_vec(), ..Default::default() };
            let (a, b) = tokio::time::timeout(CONNECT_LIMIT, async {
                tokio::join!(listener.accept(), workers[j].connect_with(addr, opts))
            })
            .await
            .unwrap_or_else(|_| panic!("mesh: connecting {j} to {i} over {tls} took over {CONNECT_LIMIT:?}"));
            let a = a.expect("accept");
            assert_eq!(a.connect_payload(), (j as u64).to_le_bytes(), "mesh: who connected");
            eps[i][j] = Some(a);
            eps[j][i] = Some(b.expect("connect"));
        }
    }
    Mesh { workers, eps }
}

/// [`mesh_with`] in event mode.
pub async fn mesh(tls: &str, n: usize) -> Mesh {
    mesh_with(tls, n, ProgressMode::Event).await
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

/// Whether the UCX loaded here has remote atomics over TCP in UCX's peer error mode:
/// from 1.16 on it has no protocol for them there (it leaves its software emulation out).
pub fn tcp_atomics_in_peer_mode() -> bool {
    Context::ucx_version() < (1, 16, 0)
}
