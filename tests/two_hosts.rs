//! Two hosts: two network namespaces joined by a veth pair (made and removed by the
//! test), a ucxkit process in each, connected by IP:port as two machines would be. With
//! the default options the connection uses UCX's peer failure handling (`ErrorMode::Auto`
//! for processes in pid namespaces of their own, whom shared memory does not join) and
//! TCP over the veth; tagged messages eager and rendezvous both ways, a stream, and
//! put/get into the server's memory arrive byte for byte; and when the server process is killed, a pending send
//! and a pending receive on the client fail with `ConnectionReset` within a bound.
//!
//! A server whose link goes down (a host cut off, powered off) sends no reset: TCP keeps
//! retransmitting, for about 15 minutes by default. ucxkit's keepalive bounds that on
//! every UCX (3 s here), and UCX 1.22 and later with `UCX_TCP_USER_TIMEOUT` too (the
//! context's `TCP_USER_TIMEOUT` setting; 3 s here as well): the same pending operations
//! must fail within the bound.
//!
//! Creating namespaces needs root: without it the test prints why and does nothing.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::net::SocketAddr;
use std::time::Duration;

use common::netns::{self, Proc, TwoHosts};
use common::payload;
use ucxkit::transport::{tag, Context, ErrorKind, Keepalive};

/// How long the client waits for its pending operations to fail once the server died.
const DEATH_BOUND: Duration = Duration::from_secs(10);
/// Any child's whole life: it ends itself after this, should the parent be gone.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

const KEY: u64 = 100;
const TO_SERVER: u64 = 1;
const TO_CLIENT: u64 = 2;
const DONE: u64 = 9;
const NEVER: u64 = 77;
const UNRECEIVED: u64 = 55;
const SIZES: [usize; 5] = [0, 8, 65536, 4 << 20, 8 << 20];
const REGION: usize = 1 << 20;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// The server: listens on its namespace's address, tells the port, echoes tagged
/// messages (tag TO_SERVER back as TO_CLIENT) and the stream, lends a region for put/get,
/// and after DONE waits to be killed.
#[tokio::test]
#[ignore = "the server half of two_hosts; the parent runs it in a namespace"]
async fn two_hosts_server() {
    let Ok(addr) = std::env::var("UCXKIT_HOST_ADDR") else { return };
    let ctx = Context::builder().build().unwrap();
    let w = ctx.create_worker().unwrap();
    let l = w.listen(SocketAddr::new(addr.parse().unwrap(), 0)).unwrap();
    println!("PORT {}", l.local_addr().port());
    let served = async {
        let ep = l.accept().await.unwrap();
        assert!(!ep.is_watched(), "the client, on another host, is watched through a pidfd");
        let region = ctx.alloc(REGION).unwrap();
        ep.tag_send(KEY, region.pack_key().unwrap()).await.0.unwrap();
        loop {
            let (info, data) = w.tag_recv_any(0, tag::ANY).await.unwrap();
            match info.sender_tag {
                TO_SERVER => ep.tag_send(TO_CLIENT, data).await.0.unwrap(),
                DONE => break,
                t => panic!("unexpected tag {t}"),
            }
        }
        // Stream echo of one block.
        let (r, block) = ep.stream_recv_exact(vec![0u8; 256 << 10]).await;
        r.unwrap();
        ep.stream_send(block).await.0.unwrap();
        println!("SERVED");
        // Keeps the connection (and the client's unreceived send) until killed.
        std::future::pending::<()>().await;
    };
    if tokio::time::timeout(CHILD_LIMIT, served).await.is_err() {
        panic!("the server was not killed in time");
    }
}

/// The client: connects to the server's address, checks the endpoint, exchanges every
/// kind of traffic, then leaves a send and a receive pending and says READY; the parent
/// takes the server away, and both must fail with ConnectionReset within DEATH_BOUND.
#[tokio::test]
#[ignore = "the client half of two_hosts; the parent runs it in a namespace"]
async fn two_hosts_client() {
    let Ok(server) = std::env::var("UCXKIT_SERVER") else { return };
    let dev = env("UCXKIT_HOST_DEV");
    let server: SocketAddr = server.parse().unwrap();
    let run = async {
        // The unreceived send below must stay pending: rendezvous at its size (UCX may
        // pick an eager protocol over TCP for large messages, which completes unreceived).
        let mut b = Context::builder().config("RNDV_THRESH", "64k");
        if let Ok(t) = std::env::var("UCXKIT_TCP_USER_TIMEOUT") {
            // Keepalive probes too, so that the timeout applies even with nothing
            // unacknowledged in flight when the link goes.
            b = b.config("TCP_USER_TIMEOUT", t).config("TCP_KEEPIDLE", "1s").config("TCP_KEEPINTVL", "1s");
        }
        let ctx = b.build().unwrap();
        let mut k = Keepalive::default();
        if let Ok(t) = std::env::var("UCXKIT_KEEPALIVE_TIMEOUT") {
            k = Keepalive {
                interval: Duration::from_millis(500),
                timeout: Duration::from_secs(t.parse().unwrap()),
            };
        }
        let w = ctx.worker().keepalive(Some(k)).build().unwrap();
        let ep = w.connect(server).await.unwrap();
        assert!(ep.uses_peer_error_mode(), "ErrorMode::Auto did not pick peer mode for a remote peer");
        // Only UCX can notice the server's death: no pidfd watch across hosts.
        assert!(!ep.is_watched(), "the server, on another host, is watched through a pidfd");
        let lanes = ep.lanes().unwrap();
        assert!(
            !lanes.is_empty() && lanes.iter().all(|l| l.transport == "tcp" && l.device == dev),
            "lanes {lanes:?}: expected TCP over {dev}"
        );
        println!("LANES {lanes:?}");
        let (_, key) = w.tag_recv_any(KEY, tag::EXACT).await.unwrap();
        let key = ep.unpack_key(&key).unwrap();
        for (i, &len) in SIZES.iter().enumerate() {
            let data = payload(i as u64, len);
            let recv = w.tag_recv(TO_CLIENT, tag::EXACT, Vec::with_capacity(len));
            ep.tag_send(TO_SERVER, data.clone()).await.0.unwrap();
            let (info, back) = recv.await;
            assert_eq!(info.unwrap().len, len);
            assert!(back == data, "{len} bytes came back different");
        }
        let data = payload(7, 64 << 10);
        ep.put(data.clone(), &key, 4096).await.0.unwrap();
        ep.flush().await.unwrap();
        let (n, got) = ep.get(vec![0u8; 64 << 10], 64 << 10, &key, 4096).await;
        assert_eq!(n.unwrap(), 64 << 10);
        assert!(got == data, "get did not return what put wrote");
        ep.tag_send(DONE, Vec::new()).await.0.unwrap();
        let block = payload(8, 256 << 10);
        ep.stream_send(block.clone()).await.0.unwrap();
        let (r, back) = ep.stream_recv_exact(vec![0u8; 256 << 10]).await;
        r.unwrap();
        assert!(back == block, "the stream came back different");
        // Left pending: a receive bound to the endpoint that the server never answers,
        // and a rendezvous send it never receives.
        let recv = ep.tag_recv(NEVER, tag::EXACT, vec![0u8; 64]);
        let send = ep.tag_send(UNRECEIVED, payload(9, 8 << 20));
        println!("READY");
        let t = std::time::Instant::now();
        let ((s, _), (r, _)) = tokio::time::timeout(DEATH_BOUND, async { tokio::join!(send, recv) })
            .await
            .expect("pending operations did not fail in time after the server died");
        let (s, r) = (s.unwrap_err(), r.unwrap_err());
        assert_eq!(s.kind(), ErrorKind::ConnectionReset, "send: {s}");
        assert_eq!(r.kind(), ErrorKind::ConnectionReset, "receive: {r}");
        println!("PEER-DEATH-OK after {:?}", t.elapsed());
    };
    tokio::time::timeout(CHILD_LIMIT, run).await.expect("the client took too long");
}

/// What happens to the server once the client is READY.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL: the kernel resets its connections.
    Kill,
    /// Its end of the link goes down: no reset, the server process lives on.
    LinkDown,
}

fn two_hosts_with(fault: Fault) {
    if let Err(e) = netns::available() {
        eprintln!("two_hosts: skipped, network namespaces are not available here ({e})");
        return;
    }
    let hosts = TwoHosts::new().expect("making the two hosts");
    let mut server =
        Proc::child_test(&hosts.a, "two_hosts_server", &[("UCXKIT_HOST_ADDR", hosts.addr_a.to_string())]);
    let port = server.expect_line("PORT ", Duration::from_secs(30)).unwrap();
    let mut env =
        vec![("UCXKIT_SERVER", format!("{}:{port}", hosts.addr_a)), ("UCXKIT_HOST_DEV", hosts.dev_b.clone())];
    if let Fault::LinkDown = fault {
        env.push(("UCXKIT_KEEPALIVE_TIMEOUT", "3".to_string()));
        if ucx_sys::API_MINOR >= 22 {
            env.push(("UCXKIT_TCP_USER_TIMEOUT", "3s".to_string()));
        }
    }
    let mut client = Proc::child_test(&hosts.b, "two_hosts_client", &env);
    if let Err(e) = client.expect_line("READY", Duration::from_secs(60)) {
        server.kill();
        let _ = client.finish(Duration::from_secs(5));
        panic!("client: {e}\nserver output:\n{}", server.seen.join("\n"));
    }
    server.expect_line("SERVED", Duration::from_secs(10)).unwrap();
    let t = std::time::Instant::now();
    match fault {
        Fault::Kill => server.kill(),
        Fault::LinkDown => {
            let down = std::process::Command::new("ip")
                .args(["-n", &hosts.a, "link", "set", &hosts.dev_a, "down"])
                .status()
                .unwrap();
            assert!(down.success(), "taking the server's link down");
        }
    }
    client.finish(DEATH_BOUND + Duration::from_secs(20)).unwrap();
    let took = t.elapsed();
    assert!(client.seen.iter().any(|l| l.contains("PEER-DEATH-OK")), "{}", client.seen.join("\n"));
    eprintln!("two_hosts ({fault:?}): the client finished {took:?} after the fault");
    for l in client.seen.iter().filter(|l| l.contains("LANES") || l.contains("PEER-DEATH-OK")) {
        eprintln!("two_hosts ({fault:?}) client: {}", l.trim_start_matches("test two_hosts_client ... "));
    }
}

#[test]
fn two_hosts() {
    two_hosts_with(Fault::Kill);
}

#[test]
fn two_hosts_link_down() {
    two_hosts_with(Fault::LinkDown);
}
