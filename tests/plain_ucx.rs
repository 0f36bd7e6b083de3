//! ucxkit against a plain UCX program (`tests/peers/plain_ucx_peer.c`, built here with the
//! C compiler against the UCX ucxkit was built with): tagged messages, active messages
//! (eager and rendezvous), remote keys in UCX's own form both ways (put, get and atomics
//! into the program's memory, its put into ucxkit's), and byte streams, with ucxkit's
//! handshake off, over TCP and over shared memory, with ucxkit connecting and accepting
//! through listeners and connecting by worker address in UCX's own form, in both
//! error-handling modes. Every byte that comes back is checked.

#![deny(unsafe_code)]

use ucxkit_testkit as common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use common::{ctx, loopback, payload};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use ucxkit::transport::{
    tag, AmProto, AmSendOptions, Endpoint, EndpointOptions, ErrorKind, ErrorMode, Worker, WorkerAddress,
};

const T: Duration = Duration::from_secs(30);

// The peer's protocol (see the comment at the top of the C file).
const REPLY_BIT: u64 = 1 << 63;
const TAG_END_TAGS: u64 = 0x7fff_ffff_ffff_fff0;
const TAG_MY_KEY: u64 = 0x7fff_ffff_ffff_fff1;
const TAG_EXPECT: u64 = 0x7fff_ffff_ffff_fff2;
const TAG_VERDICT: u64 = 0x7fff_ffff_ffff_fff3;
const TAG_YOUR_KEY: u64 = 0x7fff_ffff_ffff_fff4;
const TAG_PUT_DONE: u64 = 0x7fff_ffff_ffff_fff5;
const TAG_BYE: u64 = 0x7fff_ffff_ffff_fff6;
const AM_ECHO: u16 = 7;
const AM_ECHO_BACK: u16 = 8;
const PEER_REGION: usize = 64 * 1024;

/// One test at a time: UCX 1.13 can trip over connections that end in several workers
/// of one process at once.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The peer program, compiled once per test run.
fn peer_program() -> &'static Path {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/plain_ucx_peer.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plain_ucx_peer");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let mut cmd = std::process::Command::new(&cc);
        cmd.args(["-O1", "-Wall", "-Wextra", "-o"]).arg(&out).arg(&src);
        let dirs = |list: &str| {
            std::env::split_paths(list).filter(|d| !d.as_os_str().is_empty()).collect::<Vec<_>>()
        };
        for d in dirs(ucx_sys::INCLUDE_DIRS) {
            cmd.arg(format!("-I{}", d.display()));
        }
        for d in dirs(ucx_sys::LIB_DIRS) {
            cmd.arg(format!("-L{}", d.display())).arg(format!("-Wl,-rpath,{}", d.display()));
        }
        cmd.args(["-lucp", "-lucs"]);
        let o = cmd.output().unwrap_or_else(|e| panic!("running the C compiler `{cc}`: {e}"));
        assert!(o.status.success(), "compiling {}:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
        out
    })
}

/// Starts the peer with `args`, limited to the transports `tls`.
fn start_peer(args: &[&str], tls: &str) -> Child {
    Command::new(peer_program())
        .args(args)
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting the plain UCX peer")
}

/// The port a listening peer printed.
async fn peer_port(child: &mut Child) -> u16 {
    let out = child.stdout.take().expect("piped");
    let mut line = String::new();
    tokio::time::timeout(T, tokio::io::BufReader::new(out).read_line(&mut line))
        .await
        .expect("the peer prints its port")
        .unwrap();
    line.trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("peer said {line:?}"))
}

fn opts(mode: ErrorMode) -> EndpointOptions {
    EndpointOptions { handshake: false, error_mode: mode, ..Default::default() }
}

/// ucxkit connects to a listening plain UCX program.
async fn ucxkit_connects(tls: &str, mode: ErrorMode, transport: &str) {
    let _serial = SERIAL.lock().await;
    let mode_arg = if mode == ErrorMode::Peer { "peer" } else { "none" };
    let mut child = start_peer(&["listen", mode_arg], tls);
    let port = peer_port(&mut child).await;
    let w = ctx(tls).worker().namespaces(false).build().unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let ep = bounded(w.connect_with(addr, opts(mode))).await.unwrap();
    exchange(&w, &ep, tls, transport, mode == ErrorMode::Peer).await;
    finish(child, ep).await;
}

/// A plain UCX program connects to ucxkit's listener.
async fn ucxkit_accepts(tls: &str, mode: ErrorMode, transport: &str) {
    let _serial = SERIAL.lock().await;
    let w = ctx(tls).worker().namespaces(false).build().unwrap();
    // Without the handshake: UCX's own listener, which plain UCX clients speak to.
    let listener = w.listen_with(loopback(), opts(mode)).unwrap();
    let port = listener.local_addr().port().to_string();
    let mode_arg = if mode == ErrorMode::Peer { "peer" } else { "none" };
    let child = start_peer(&["connect", mode_arg, "127.0.0.1", &port], tls);
    let request = bounded(listener.next()).await.unwrap();
    let ep = bounded(request.accept_with(opts(mode))).await.unwrap();
    exchange(&w, &ep, tls, transport, mode == ErrorMode::Peer).await;
    finish(child, ep).await;
}

/// ucxkit and a plain UCX program connect to each other by worker address, each given
/// the other's in UCX's own form (`ucp_worker_get_address`), exchanged over the peer's
/// standard input and output.
async fn by_worker_address(tls: &str, mode: ErrorMode, transport: &str) {
    let _serial = SERIAL.lock().await;
    let mode_arg = if mode == ErrorMode::Peer { "peer" } else { "none" };
    let mut child = Command::new(peer_program())
        .args(["address", mode_arg])
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting the plain UCX peer");
    let out = child.stdout.take().expect("piped");
    let mut line = String::new();
    bounded(tokio::io::BufReader::new(out).read_line(&mut line)).await.unwrap();
    let hex = line.trim().strip_prefix("address ").unwrap_or_else(|| panic!("peer said {line:?}"));
    let raw: Vec<u8> =
        (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    #[allow(unsafe_code)]
    // SAFETY: the bytes are the peer's address as ucp_worker_get_address gave it, from a
    // program of this test built against the same UCX.
    let addr = unsafe { WorkerAddress::from_ucx_bytes(&raw) }.unwrap();
    assert_eq!(addr.ucx_bytes(), &raw[..]);
    let w = ctx(tls).worker().namespaces(false).build().unwrap();
    let ep = bounded(w.connect_address_with(&addr, opts(mode))).await.unwrap();
    let mine: String = w.address().unwrap().ucx_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut stdin = child.stdin.take().expect("piped");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, format!("{mine}\n").as_bytes()).await.unwrap();
    exchange(&w, &ep, tls, transport, mode == ErrorMode::Peer).await;
    finish(child, ep).await;
}

/// Waits until the peer has read everything (its bye, or its disconnect, which it sends
/// only after the bye), then both sides close (each flushing) and the peer ends
/// successfully. Closing before that could drop the last stream bytes: UCX discards
/// what arrives for an endpoint whose peer disconnected, and the disconnect can overtake
/// data on another lane.
async fn finish(mut child: Child, ep: Endpoint) {
    let (r, bye) = bounded(ep.tag_recv(TAG_BYE, tag::EXACT, Vec::with_capacity(8))).await;
    match r {
        Ok(_) => assert_eq!(bye, b"bye"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "waiting for the peer's bye: {e}"),
    }
    bounded(ep.close()).await.expect("closing after the peer was served");
    let status = bounded(child.wait()).await.unwrap();
    assert!(status.success(), "the plain UCX peer failed: {status}");
}

/// Every phase of the peer's protocol; the connection uses `transport`.
async fn exchange(w: &Worker, ep: &Endpoint, tls: &str, transport: &str, peer_mode: bool) {
    tags(ep, tls).await;
    active_messages(w, ep, tls).await;
    // UCX 1.16 and later have no protocol for atomics over TCP in peer error mode (see
    // tests/rma.rs, `atomics_in_peer_mode_over_tcp`), and fail the endpoint.
    let atomics = common::tcp_atomics_in_peer_mode() || !(peer_mode && transport == "tcp");
    remote_memory(w, ep, tls, atomics).await;
    let used = ep.transports().unwrap();
    assert!(used.iter().any(|t| t == transport), "expected {transport} among {used:?}");
    stream(ep, tls).await;
}

/// Sizes across UCX's protocols: short, copied, zero-copy and rendezvous.
const SIZES: [usize; 9] = [0, 1, 8, 200, 4096, 10_000, 65_536, 1 << 20, (5 << 20) + 7];

async fn tags(ep: &Endpoint, tls: &str) {
    // All receives posted and all sends in flight at once, then each echo checked.
    let mut pending = Vec::new();
    for (i, &len) in SIZES.iter().enumerate() {
        let t = 0x1000 + i as u64;
        let recv = ep.tag_recv(t | REPLY_BIT, tag::EXACT, Vec::with_capacity(len));
        let send = ep.tag_send(t, payload(t, len));
        pending.push((t, len, recv, send));
    }
    for (t, len, recv, send) in pending {
        let (r, _) = bounded(send).await;
        r.unwrap();
        let (r, back) = bounded(recv).await;
        let info = r.unwrap_or_else(|e| panic!("{tls}: echo of {len} bytes: {e}"));
        assert_eq!(info.sender_tag, t | REPLY_BIT);
        assert_eq!(info.len, len);
        assert!(back == payload(t, len), "{tls}: tag echo of {len} bytes differs");
    }
    bounded(ep.tag_send(TAG_END_TAGS, Vec::new())).await.0.unwrap();
}

async fn active_messages(w: &Worker, ep: &Endpoint, tls: &str) {
    let mut rx = w.am_recv(AM_ECHO_BACK).unwrap();
    let cases = [
        (0, AmProto::Auto),
        (10, AmProto::Eager),
        (3000, AmProto::Auto),
        (5000, AmProto::Rendezvous),
        (100_000, AmProto::Rendezvous),
        (2 << 20, AmProto::Auto),
    ];
    for (i, (len, proto)) in cases.into_iter().enumerate() {
        let header = format!("header {i}");
        let data = payload(500 + i as u64, len);
        let opts = AmSendOptions { proto, ..Default::default() };
        let send = ep.am_send_with(AM_ECHO, header.as_bytes(), data.clone(), opts);
        let m = bounded(rx.recv()).await;
        assert_eq!(m.header(), header.as_bytes());
        let (r, back) = bounded(m.into_vec()).await;
        r.unwrap();
        assert!(back == data, "{tls}: active-message echo of {len} bytes ({proto:?}) differs");
        bounded(send).await.0.unwrap();
    }
    bounded(ep.am_send(AM_ECHO, b"end", Vec::new())).await.0.unwrap();
}

/// `f`, or a panic after [`T`].
async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(T, f).await.expect("the plain UCX peer answers in time")
}

/// A key message: address, length, then UCX's key bytes.
fn key_message(addr: u64, len: u64, ucx_key: &[u8]) -> Vec<u8> {
    [&addr.to_ne_bytes()[..], &len.to_ne_bytes(), ucx_key].concat()
}

#[allow(unsafe_code)] // unpack_ucx_key: the caller vouches for the range
async fn remote_memory(w: &Worker, ep: &Endpoint, tls: &str, atomics: bool) {
    // The peer's region, through the key it packed with ucp_rkey_pack.
    let (r, msg) = bounded(ep.tag_recv(TAG_MY_KEY, tag::EXACT, Vec::with_capacity(4096))).await;
    r.unwrap();
    let word = |at: usize| u64::from_ne_bytes(msg[at..at + 8].try_into().unwrap());
    let (addr, len) = (word(0), word(8));
    assert_eq!(len, PEER_REGION as u64);
    // SAFETY: the range is the one the peer registered and sent with its key.
    let key = unsafe { ep.unpack_ucx_key(&msg[16..], addr, len) }.unwrap();
    let data = payload(9, 20_000);
    bounded(ep.put(data.clone(), &key, 4096)).await.0.unwrap();
    let (r, _) = bounded(ep.put(vec![1u8; 2], &key, len - 1)).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput, "the peer's region ends where it said");
    let mut expect = vec![0u8; PEER_REGION];
    if atomics {
        assert_eq!(bounded(ep.atomic_fetch_add(&key, 0, 5)).await.unwrap(), 0);
        assert_eq!(bounded(ep.atomic_compare_swap(&key, 0, 5, 77)).await.unwrap(), 5);
        bounded(ep.atomic_add(&key, 8, 3)).await.unwrap();
        expect[0..8].copy_from_slice(&77u64.to_ne_bytes());
        expect[8..16].copy_from_slice(&3u64.to_ne_bytes());
    }
    bounded(ep.flush()).await.unwrap();
    let (r, got) = bounded(ep.get(Vec::with_capacity(data.len()), data.len(), &key, 4096)).await;
    r.unwrap();
    assert!(got == data, "{tls}: get differs from put");
    expect[4096..4096 + data.len()].copy_from_slice(&data);
    bounded(ep.tag_send(TAG_EXPECT, expect)).await.0.unwrap();
    let (r, verdict) = bounded(ep.tag_recv(TAG_VERDICT, tag::EXACT, Vec::with_capacity(16))).await;
    r.unwrap();
    assert_eq!(verdict, b"same", "{tls}: the peer's region holds what ucxkit wrote");
    drop(key);

    // Ours, through a key in UCX's form: the peer puts a pattern over all of it.
    let region = w.context().alloc(100_000).unwrap();
    let msg = key_message(region.addr(), region.len() as u64, &region.pack_ucx_key().unwrap());
    bounded(ep.tag_send(TAG_YOUR_KEY, msg)).await.0.unwrap();
    let (r, done) = bounded(ep.tag_recv(TAG_PUT_DONE, tag::EXACT, Vec::with_capacity(8))).await;
    r.unwrap();
    assert_eq!(done, b"done");
    let pattern: Vec<u8> = (0..region.len()).map(|i| (i * 7 + 3) as u8).collect();
    assert!(region.to_vec() == pattern, "{tls}: the peer's put into ucxkit's region");
}

async fn stream(ep: &Endpoint, tls: &str) {
    for (i, len) in [1usize, 13, 4096, 300_000, 3 << 20].into_iter().enumerate() {
        let data = payload(700 + i as u64, len);
        bounded(ep.stream_send((len as u64).to_ne_bytes().to_vec())).await.0.unwrap();
        bounded(ep.stream_send(data.clone())).await.0.unwrap();
        let (r, back) = bounded(ep.stream_recv_exact(vec![0u8; len])).await;
        r.unwrap();
        assert!(back == data, "{tls}: stream echo of {len} bytes differs");
    }
    bounded(ep.stream_send(0u64.to_ne_bytes().to_vec())).await.0.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucxkit_connects_over_tcp() {
    ucxkit_connects("tcp,self", ErrorMode::None, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucxkit_connects_over_shared_memory() {
    ucxkit_connects("posix,cma,tcp,self", ErrorMode::None, "posix").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucxkit_accepts_over_tcp_in_peer_mode() {
    ucxkit_accepts("tcp,self", ErrorMode::Peer, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucxkit_accepts_over_shared_memory() {
    ucxkit_accepts("posix,cma,tcp,self", ErrorMode::None, "posix").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_worker_address_over_tcp_in_peer_mode() {
    by_worker_address("tcp,self", ErrorMode::Peer, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_worker_address_over_shared_memory() {
    by_worker_address("posix,cma,tcp,self", ErrorMode::None, "posix").await;
}
