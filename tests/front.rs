//! The listener front (`ucxkit::transport::front`): hostile bytes at a listener's port
//! (and at UCX's own transport port) leave the listening process alive and listening;
//! secrets decide who connects; connections made at once, between the same two workers
//! in either direction or mixed with connections by worker address, each get their own
//! pair of endpoints.
//!
//! The listening process of the hostile-bytes test is this test binary, re-run with
//! `UCXKIT_FRONT_TARGET` set so that only the ignored `front_target` test runs in it:
//! an abort there fails the test instead of ending the test runner.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use common::{ctx, loopback, payload, Rng};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use ucxkit::transport::{tag, Context, Endpoint, EndpointOptions, ErrorKind, Secret, Worker};

const T: Duration = Duration::from_secs(30);

/// Hostile cases per port in the test command; `UCXKIT_FUZZ_CASES` sets more (the long
/// form, run by hand).
const DEFAULT_CASES: usize = 3000;

/// The listening ports of this process other than `except`: UCX's transport ports.
fn own_listening_ports(except: u16) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|p| p.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
        .collect();
    let mut ports = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                let port = u16::from_str_radix(f[1].rsplit(':').next().unwrap(), 16).unwrap();
                if port != except && !ports.contains(&port) {
                    ports.push(port);
                }
            }
        }
    }
    ports
}

/// The listening child: a worker over TCP (so that UCX's TCP transport listens too) and
/// a listener that echoes one tagged message on each connection it accepts. Prints its
/// ports; ends when its standard input closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the front tests; the parent runs it"]
async fn front_target() {
    let Some(kind) = std::env::var_os("UCXKIT_FRONT_TARGET") else { return };
    let w = front_ctx(kind == "secret").create_worker().unwrap();
    let l = w.listen(loopback()).unwrap();
    let port = l.local_addr().port();
    println!("PORT {port}");
    let ucx: Vec<String> = own_listening_ports(port).iter().map(u16::to_string).collect();
    println!("UCX_PORTS {}", ucx.join(","));
    // Each request accepted in a task of its own, as a server does (an accept waits for
    // its client's hello, which a hostile client never sends: bounded by the timeout).
    let opts = EndpointOptions { timeout: Duration::from_secs(2), ..Default::default() };
    let serve = async {
        loop {
            let Ok(req) = l.next().await else { continue };
            let (w, opts) = (w.clone(), opts.clone());
            tokio::spawn(async move {
                let Ok(ep) = req.accept_with(opts).await else { return };
                let (r, data) = w.tag_recv(1, tag::EXACT, Vec::with_capacity(64)).await;
                if r.is_ok() {
                    let _ = ep.tag_send(2, data).await;
                }
            });
        }
    };
    // Standard input closing (the parent is done, or gone) ends the child.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        let _ = std::io::Read::read(&mut std::io::stdin(), &mut buf);
        let _ = tx.send(());
    });
    tokio::select! {
        _ = serve => {}
        _ = rx => {}
        _ = tokio::time::sleep(Duration::from_secs(600)) => {}
    }
    println!("TARGET DONE");
}

/// The context of the hostile-bytes test's two sides: over TCP, with a secret or not.
fn front_ctx(with_secret: bool) -> Context {
    if with_secret {
        secret_ctx(Some(secret(9)))
    } else {
        ctx("tcp,self")
    }
}

/// A real client's connect and one echo through the listener at `addr`.
async fn real_client(addr: SocketAddr, with_secret: bool) -> Result<(), String> {
    let w = front_ctx(with_secret).create_worker().map_err(|e| e.to_string())?;
    let opts = EndpointOptions { timeout: Duration::from_secs(10), ..Default::default() };
    let ep = w.connect_with(addr, opts).await.map_err(|e| e.to_string())?;
    let back = w.tag_recv(2, tag::EXACT, Vec::with_capacity(64));
    ep.tag_send(1, b"still here".to_vec()).await.0.map_err(|e| e.to_string())?;
    let (r, data) = tokio::time::timeout(T, back).await.map_err(|_| "no echo".to_string())?;
    r.map_err(|e| e.to_string())?;
    if data != b"still here" {
        return Err("the echo differs".into());
    }
    ep.close().await.map_err(|e| e.to_string())
}

/// The bytes a real client sends on the front, recorded by a proxy between it and the
/// listener at `target`.
async fn recorded_opening(target: SocketAddr, with_secret: bool) -> Vec<u8> {
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = proxy.local_addr().unwrap();
    let record = tokio::spawn(async move {
        let (mut client, _) = proxy.accept().await.unwrap();
        let mut server = TcpStream::connect(target).await.unwrap();
        let (mut cr, mut cw) = client.split();
        let (mut sr, mut sw) = server.split();
        let mut seen = Vec::new();
        let up = async {
            let mut b = [0u8; 4096];
            loop {
                match cr.read(&mut b).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        seen.extend_from_slice(&b[..n]);
                        if sw.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = sw.shutdown().await;
        };
        let down = async {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
            let _ = cw.shutdown().await;
        };
        tokio::join!(up, down);
        seen
    });
    real_client(via, with_secret).await.expect("a real client through the recording proxy");
    let seen = tokio::time::timeout(T, record).await.unwrap().unwrap();
    assert!(seen.len() > 40, "the recorded opening is {} bytes", seen.len());
    seen
}

/// Hostile byte strings: random ones of many lengths, frames claiming odd lengths, and
/// the real opening damaged in every way at hand.
fn cases(opening: &[u8], n: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng::new(seed);
    let mut out = vec![
        Vec::new(),
        vec![0u8; 17],
        vec![0u8; 8],
        vec![0xff; 64],
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        0xffff_ffffu32.to_le_bytes().to_vec(),
        (64u32 * 1024 + 1).to_le_bytes().to_vec(),
        [5u32.to_le_bytes().to_vec(), vec![0; 5]].concat(),
        [opening, opening].concat(),
    ];
    while out.len() < n {
        let mut b = opening.to_vec();
        match rng.below(7) {
            0 => {
                let len = [1, 4, 6, 17, 40, 100, 300, 5000][rng.below(8)];
                b = (0..len).map(|_| rng.next() as u8).collect();
            }
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
            }
            2 => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
            3 => b.truncate(rng.below(b.len())),
            4 => {
                let i = rng.below(b.len());
                let extra: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
                b.splice(i..i, extra);
            }
            5 => {
                // A frame length changed: the opening's first, or a later one.
                let at = if rng.below(2) == 0 { 0 } else { 4 + rng.below(b.len() - 4) };
                let v = [0u32, 5, 6, 7, 0xffff, 64 * 1024, 64 * 1024 + 1, u32::MAX][rng.below(8)];
                let end = (at + 4).min(b.len());
                b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            _ => {
                let i = rng.below(b.len());
                b.drain(i..(i + 1 + rng.below(16)).min(b.len()));
            }
        }
        out.push(b);
    }
    out
}

/// Throws every case at `port` (64 connections at a time): each is written, the write
/// side shut, and whatever comes back read for a moment.
async fn throw(port: u16, cases: &[Vec<u8>]) {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    for chunk in cases.chunks(64) {
        let tasks: Vec<_> = chunk
            .iter()
            .cloned()
            .map(|bytes| {
                tokio::spawn(async move {
                    let Ok(Ok(mut s)) = tokio::time::timeout(T, TcpStream::connect(addr)).await else {
                        return;
                    };
                    let _ = s.write_all(&bytes).await;
                    let _ = s.shutdown().await;
                    let mut sink = [0u8; 1024];
                    let _ = tokio::time::timeout(Duration::from_millis(50), async {
                        while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                    })
                    .await;
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    }
}

/// Random and damaged real openings at a listener's port: the listening process lives
/// and still takes real clients. Then the same bytes at the ports UCX's TCP transport
/// listens on for that worker, with the same outcome required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bytes_leave_the_listener_alive() {
    hostile_bytes(false).await;
}

/// The same at a listener whose context has a secret (the opening then carries nonces
/// and proofs, and every later frame a MAC).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bytes_leave_a_listener_with_a_secret_alive() {
    hostile_bytes(true).await;
}

/// A listening child (`front_target`) and what it printed: its listener's port and the
/// ports UCX's TCP transport listens on for its worker; its standard error is gathered.
struct Target {
    child: tokio::process::Child,
    port: u16,
    ucx_ports: Vec<u16>,
    stderr: tokio::task::JoinHandle<String>,
}

impl Target {
    async fn start(with_secret: bool) -> Target {
        let mut child = common::procs::command("front_target", &[])
            .env("UCXKIT_FRONT_TARGET", if with_secret { "secret" } else { "open" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Drained as it comes (UCX logs each refused byte string there).
        let mut err = child.stderr.take().unwrap();
        let stderr = tokio::spawn(async move {
            let mut text = Vec::new();
            let _ = err.read_to_end(&mut text).await;
            String::from_utf8_lossy(&text).into_owned()
        });
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut port, mut ucx_ports) = (0u16, Vec::new());
        while port == 0 || ucx_ports.is_empty() {
            let line = tokio::time::timeout(T, lines.next_line())
                .await
                .unwrap()
                .unwrap()
                .expect("the target's ports");
            // (The test harness prints its "test ... " before the child's first line.)
            if let Some(p) = line.split("PORT ").nth(1).filter(|_| !line.contains("UCX_PORTS")) {
                port = p.trim().parse().unwrap();
            } else if let Some(p) = line.strip_prefix("UCX_PORTS ") {
                ucx_ports =
                    p.trim().split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap()).collect();
                assert!(!ucx_ports.is_empty(), "UCX's TCP transport listens on no port");
            }
        }
        // The rest of its output is not needed; read it so that the child never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Target { child, port, ucx_ports, stderr }
    }

    fn listener(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// Ends the child (closing its standard input) and returns how it ended and what it
    /// wrote to standard error.
    async fn finish(mut self) -> (std::process::ExitStatus, String) {
        drop(self.child.stdin.take());
        let status = tokio::time::timeout(T, self.child.wait()).await.unwrap().unwrap();
        (status, tokio::time::timeout(T, self.stderr).await.unwrap().unwrap())
    }
}

async fn hostile_bytes(with_secret: bool) {
    let n: usize =
        std::env::var("UCXKIT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    let mut t = Target::start(with_secret).await;
    let opening = recorded_opening(t.listener(), with_secret).await;
    let cases = cases(&opening, n, 0x5eed_f00d);
    for (what, p) in std::iter::once(("the listener", t.port))
        // (UCX's port is the same with or without a secret: thrown at once.)
        .chain(t.ucx_ports.iter().filter(|_| !with_secret).map(|&p| ("UCX's TCP port", p)))
    {
        throw(p, &cases).await;
        if let Some(status) = t.child.try_wait().unwrap() {
            panic!("the listening process died ({status}) after {n} hostile byte strings at {what} ({p})");
        }
        real_client(t.listener(), with_secret)
            .await
            .unwrap_or_else(|e| panic!("a real client after the bytes at {what}: {e}"));
        eprintln!(
            "{n} hostile byte strings at {what} (port {p}, secret: {with_secret}): \
             the process lives and takes clients"
        );
    }
    let (status, stderr) = t.finish().await;
    assert!(status.success(), "the listening process ended with {status}:\n{stderr}");
}

/// UCX's TCP transport's opening: its magic number, then a connection request (UCX's
/// connection-manager message id, 32) whose length is not the one UCX expects.
fn ucx_tcp_bad_request() -> Vec<u8> {
    let mut b = 0xCAFE_BABE_1234_5678u64.to_le_bytes().to_vec();
    b.push(32);
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b
}

/// The threat model's one known crash inside UCX, checked so that the documentation
/// stays true: 17 bytes at UCX's own TCP port (not the listener's) abort the process on
/// a UCX built with assertions, as Debian's 1.13 is, and nothing else happens. On UCX
/// builds that live through them (the 1.22 build used here), the process must still
/// take clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_tcp_port_crash_is_as_documented() {
    let mut t = Target::start(false).await;
    let mut s = TcpStream::connect(("127.0.0.1", t.ucx_ports[0])).await.unwrap();
    s.write_all(&ucx_tcp_bad_request()).await.unwrap();
    // (Polled: `Child::wait` would close the child's standard input, which ends it.)
    let mut died = false;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if t.child.try_wait().unwrap().is_some() {
            died = true;
            break;
        }
    }
    let lived = !died && real_client(t.listener(), false).await.is_ok();
    let (status, stderr) = t.finish().await;
    let assertion = stderr.contains("tcp_cm.c") && stderr.contains("Assertion");
    let (major, minor, _) = Context::ucx_version();
    eprintln!("UCX {major}.{minor}: a bad connection request at UCX's TCP port: {status}, lived: {lived}");
    if (major, minor) == (1, 13) {
        assert!(!status.success() && assertion, "UCX 1.13 no longer aborts ({status}):\n{stderr}");
    } else {
        assert!(lived || assertion, "the process died another way ({status}):\n{stderr}");
    }
}

/// The documented mitigation: `TCP_PORT_RANGE` puts UCX's TCP transport's port where a
/// firewall rule can admit only chosen hosts (per context from UCX 1.17 on; older UCX
/// takes it from the environment only, and the context refuses it).
#[tokio::test]
async fn ucx_tcp_ports_can_be_pinned_to_a_range() {
    // Below the kernel's ephemeral range, so no other test's port lands there.
    let range = 21370..21400u16;
    let in_range = || own_listening_ports(0).into_iter().filter(|p| range.contains(p)).count();
    let before = in_range();
    let c = Context::builder()
        .transports("tcp,self")
        .config("NET_DEVICES", "lo")
        .config("TCP_PORT_RANGE", format!("{}-{}", range.start, range.end - 1))
        .build();
    if Context::ucx_version() < (1, 17, 0) {
        assert_eq!(c.unwrap_err().kind(), ErrorKind::Unsupported);
        return;
    }
    let w = c.unwrap().create_worker().unwrap();
    assert!(in_range() > before, "no UCX port in {range:?}: {:?}", own_listening_ports(0));
    drop(w);
}

fn secret(byte: u8) -> Secret {
    Secret::new([byte; 32]).unwrap()
}

fn secret_ctx(s: Option<Secret>) -> Context {
    let mut b = Context::builder().transports("tcp,self").config("NET_DEVICES", "lo");
    if let Some(s) = s {
        b = b.secret(s);
    }
    b.build().unwrap()
}

/// Two workers connected through a listener, or the client's error (a refused opening
/// never reaches the listener's application).
async fn try_connect(
    server: &Context,
    client: &Context,
) -> (Worker, Result<(Endpoint, Endpoint), ucxkit::transport::Error>) {
    let sw = server.create_worker().unwrap();
    let cw = client.create_worker().unwrap();
    let l = sw.listen(loopback()).unwrap();
    let addr = l.local_addr();
    let accept = tokio::spawn(async move { l.accept().await });
    let opts = EndpointOptions { timeout: Duration::from_secs(5), ..Default::default() };
    match cw.connect_with(addr, opts).await {
        Ok(c) => {
            let a = tokio::time::timeout(T, accept).await.unwrap().unwrap().unwrap();
            (sw, Ok((a, c)))
        }
        Err(e) => {
            accept.abort();
            (sw, Err(e))
        }
    }
}

/// Peers holding the same secret connect; a wrong secret, or a secret on one side only,
/// is refused with `ErrorKind::Authentication` before the listener gives anything out,
/// and the listener goes on taking the right clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_decide_who_connects() {
    let good = secret_ctx(Some(secret(1)));
    let (_w, r) = try_connect(&good, &secret_ctx(Some(secret(1)))).await;
    let (a, c) = r.expect("the same secret on both sides");
    let recv = a.tag_recv(3, tag::EXACT, Vec::with_capacity(8));
    c.tag_send(3, b"secret".to_vec()).await.0.unwrap();
    assert_eq!(recv.await.1, b"secret");
    for (what, server, client) in [
        ("a wrong secret", Some(secret(1)), Some(secret(2))),
        ("no secret at the client", Some(secret(1)), None),
        ("no secret at the listener", None, Some(secret(1))),
    ] {
        let (_w, r) = try_connect(&secret_ctx(server), &secret_ctx(client)).await;
        let e = r.err().unwrap_or_else(|| panic!("{what}: connected"));
        assert_eq!(e.kind(), ErrorKind::Authentication, "{what}: {e}");
    }
    // One listener: refused clients first, then a good one.
    let sw = good.create_worker().unwrap();
    let l = sw.listen(loopback()).unwrap();
    for bad in [Some(secret(3)), None] {
        let e = secret_ctx(bad).create_worker().unwrap().connect(l.local_addr()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Authentication, "{e}");
    }
    let cw = secret_ctx(Some(secret(1))).create_worker().unwrap();
    let (a, c) = tokio::join!(l.accept(), cw.connect(l.local_addr()));
    a.unwrap();
    c.unwrap();
    assert!(Secret::new(b"too short").is_err());
}

/// Each connection echoes its own stream message: streams belong to one endpoint pair,
/// so a mixed-up pairing shows as another connection's bytes.
async fn check_pairs(pairs: &[(Endpoint, Endpoint)], what: &str) {
    for (i, (a, b)) in pairs.iter().enumerate() {
        let msg = payload(1000 + i as u64, 100 + i);
        b.stream_send(msg.clone()).await.0.unwrap();
        let (r, got) = tokio::time::timeout(T, a.stream_recv_exact(vec![0u8; msg.len()])).await.unwrap();
        r.unwrap_or_else(|e| panic!("{what}: connection {i}: {e}"));
        assert!(got == msg, "{what}: connection {i} received another connection's bytes");
    }
}

/// Several connections between the same two workers made at once: each accepted
/// endpoint is the peer of the one its client made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connections_pair_up() {
    for tls in ["tcp,self", "posix,cma,tcp,self", "posix,cma,self"] {
        let c = ctx(tls);
        let server = c.create_worker().unwrap();
        let client = c.create_worker().unwrap();
        let l = server.listen(loopback()).unwrap();
        let addr = l.local_addr();
        let connects = futures_util::future::join_all((0..8).map(|_| client.connect(addr)));
        let accepts = async {
            let mut v = Vec::new();
            for _ in 0..8 {
                v.push(l.accept().await);
            }
            v
        };
        let (clients, servers) =
            tokio::time::timeout(T, async { tokio::join!(connects, accepts) }).await.unwrap();
        let clients: Vec<Endpoint> = clients.into_iter().map(Result::unwrap).collect();
        // Which accepted endpoint belongs to which client is found out by a stream
        // message (a stream belongs to one endpoint pair; tag receives match across the
        // worker): every client must turn up exactly once.
        for (i, c) in clients.iter().enumerate() {
            c.stream_send(vec![i as u8]).await.0.unwrap();
        }
        let mut pairs = Vec::new();
        let mut seen = [false; 8];
        for s in servers {
            let s = s.unwrap();
            let (r, b) = tokio::time::timeout(T, s.stream_recv_exact(vec![0u8; 1])).await.unwrap();
            r.unwrap();
            let i = b[0] as usize;
            assert!(!seen[i], "{tls}: two accepted endpoints are the peers of client {i}");
            seen[i] = true;
            pairs.push((s, clients[i].clone()));
        }
        check_pairs(&pairs, tls).await;
    }
}

/// Two workers connecting to each other's listener at the same time, both ways, round
/// after round: every connection pairs up (connections that meet are tried again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_connecting_to_each_other_at_once() {
    for tls in ["tcp,self", "posix,cma,tcp,self"] {
        let c = ctx(tls);
        let (a, b) = (c.create_worker().unwrap(), c.create_worker().unwrap());
        let (la, lb) = (a.listen(loopback()).unwrap(), b.listen(loopback()).unwrap());
        for round in 0..4 {
            let ((ab, ba), (acc_b, acc_a)) = tokio::time::timeout(T, async {
                tokio::join!(
                    async { tokio::join!(a.connect(lb.local_addr()), b.connect(la.local_addr())) },
                    async { tokio::join!(lb.accept(), la.accept()) }
                )
            })
            .await
            .unwrap_or_else(|_| panic!("{tls} round {round}: connecting both ways at once hangs"));
            let pairs = [(acc_b.unwrap(), ab.unwrap()), (acc_a.unwrap(), ba.unwrap())];
            check_pairs(&pairs, &format!("{tls} round {round}")).await;
        }
    }
}

/// Connections by worker address (which the peer makes no endpoint for) between two
/// workers, then listener connections between the same two, either way: the listener
/// connections pair up, and the ones by address keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_and_listener_connections_mix() {
    for tls in ["tcp,self", "posix,cma,tcp,self"] {
        let c = ctx(tls);
        let (a, b) = (c.create_worker().unwrap(), c.create_worker().unwrap());
        let lb = b.listen(loopback()).unwrap();
        // a -> b by address twice, b -> a once.
        let by_addr = [
            a.connect_address(&b.address().unwrap()).await.unwrap(),
            a.connect_address(&b.address().unwrap()).await.unwrap(),
            b.connect_address(&a.address().unwrap()).await.unwrap(),
        ];
        let mut pairs = Vec::new();
        for _ in 0..3 {
            let (s, c) =
                tokio::time::timeout(T, async { tokio::join!(lb.accept(), a.connect(lb.local_addr())) })
                    .await
                    .unwrap_or_else(|_| panic!("{tls}: a listener connection after ones by address hangs"));
            pairs.push((s.unwrap(), c.unwrap()));
        }
        check_pairs(&pairs, tls).await;
        for (i, ep) in by_addr.iter().enumerate() {
            let to = if i < 2 { &b } else { &a };
            let recv = to.tag_recv(900 + i as u64, tag::EXACT, Vec::with_capacity(8));
            ep.tag_send(900 + i as u64, b"by addr".to_vec()).await.0.unwrap();
            let (r, got) = tokio::time::timeout(T, recv).await.unwrap();
            r.unwrap();
            assert_eq!(got, b"by addr", "{tls}: connection by address {i}");
        }
    }
}

/// Without UCX's TCP transport a listener still connects (endpoints from worker
/// addresses over shared memory), and a worker cannot connect to its own listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_need_no_tcp_transport_and_refuse_their_own_worker() {
    let c = ctx("posix,cma,self");
    let (s, w) = (c.create_worker().unwrap(), c.create_worker().unwrap());
    let l = s.listen(loopback()).unwrap();
    let (a, b) =
        tokio::time::timeout(T, async { tokio::join!(l.accept(), w.connect(l.local_addr())) }).await.unwrap();
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(!b.uses_peer_error_mode());
    check_pairs(&[(a, b.clone())], "posix,cma,self").await;
    tokio::time::timeout(T, b.close()).await.unwrap().unwrap();
    let e = s.connect(l.local_addr()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
}

/// A context with a secret seals the worker addresses and remote keys it hands out, and
/// takes only sealed ones: an address or key from a context without the secret (or
/// with another), or one changed since (its checksum recomputed), is refused with
/// `ErrorKind::Authentication` before UCX sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_addresses_and_keys() {
    let (c1, c2) = (secret_ctx(Some(secret(7))), secret_ctx(Some(secret(7))));
    let (open, other) = (secret_ctx(None), secret_ctx(Some(secret(8))));
    let (w1, w2) = (c1.create_worker().unwrap(), c2.create_worker().unwrap());
    let ep =
        w2.connect_address(&w1.address().unwrap()).await.expect("an address sealed with the same secret");
    for (what, from) in [("no secret", &open), ("another secret", &other)] {
        let addr = from.create_worker().unwrap().address().unwrap();
        let e = w2.connect_address(&addr).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Authentication, "an address with {what}: {e}");
    }
    // Keys, over a listener connection between the two sealed contexts.
    let l = w1.listen(loopback()).unwrap();
    let (a, b) = tokio::join!(l.accept(), w2.connect(l.local_addr()));
    let (_a, b) = (a.unwrap(), b.unwrap());
    let region = c1.alloc(4096).unwrap();
    let key = region.pack_key().unwrap();
    b.unpack_key(&key).expect("a key sealed with the same secret");
    for (what, from) in [("no secret", &open), ("another secret", &other)] {
        let k = from.alloc(4096).unwrap().pack_key().unwrap();
        let e = b.unpack_key(&k).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Authentication, "a key with {what}: {e}");
    }
    // A sealed key whose range was widened, checksum recomputed (the MAC left as it
    // was): refused.
    let mut forged = key.clone();
    forged[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    common::forge::fix_key_checksum(&mut forged);
    let e = b.unpack_key(&forged).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Authentication, "a forged key: {e}");
    drop(ep);
}

/// A connect's payload reaches the accepting side, before it accepts (on the request)
/// and after (on the endpoint), over the plain and the authenticated front, through
/// UCX's connection manager and without it; oversized payloads, and payloads where none
/// can travel, are refused; a connect without one gives an empty one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_payloads_say_who_connected() {
    use ucxkit::transport::MAX_CONNECT_PAYLOAD;
    for (tls, with_secret) in [("tcp,self", false), ("tcp,self", true), ("posix,self", false)] {
        let mut b = Context::builder().transports(tls);
        if tls.contains("tcp") {
            b = b.config("NET_DEVICES", "lo");
        }
        if with_secret {
            b = b.secret(secret(7));
        }
        let c = b.build().unwrap();
        let (sw, cw) = (c.create_worker().unwrap(), c.create_worker().unwrap());
        let l = sw.listen(loopback()).unwrap();
        let addr = l.local_addr();
        for payload in [Vec::new(), b"rank 3".to_vec(), payload(9, MAX_CONNECT_PAYLOAD)] {
            let opts = EndpointOptions { connect_payload: payload.clone(), ..Default::default() };
            let server = async {
                let req = l.next().await.unwrap();
                assert_eq!(req.connect_payload(), &payload[..], "{tls}, secret {with_secret}");
                req.accept().await.unwrap()
            };
            let (a, cep) =
                tokio::time::timeout(T, async { tokio::join!(server, cw.connect_with(addr, opts)) })
                    .await
                    .unwrap();
            let cep = cep.unwrap();
            assert_eq!(a.connect_payload(), &payload[..]);
            assert!(cep.connect_payload().is_empty(), "the connecting side has no payload of its own");
            // The connection works.
            let recv = a.tag_recv(1, tag::EXACT, vec![0u8; 8]);
            cep.tag_send(1, b"ok".to_vec()).await.0.unwrap();
            assert_eq!(tokio::time::timeout(T, recv).await.unwrap().1, b"ok");
        }
        // Over the limit: refused before anything is sent; the listener goes on.
        let opts =
            EndpointOptions { connect_payload: vec![0; MAX_CONNECT_PAYLOAD + 1], ..Default::default() };
        assert_eq!(cw.connect_with(addr, opts).await.unwrap_err().kind(), ErrorKind::InvalidInput);
        let plain =
            EndpointOptions { connect_payload: b"x".to_vec(), handshake: false, ..Default::default() };
        assert_eq!(cw.connect_with(addr, plain.clone()).await.unwrap_err().kind(), ErrorKind::InvalidInput);
        let wa = sw.address().unwrap();
        assert_eq!(cw.connect_address_with(&wa, plain).await.unwrap_err().kind(), ErrorKind::InvalidInput);
    }
}
