//! The failure suite, short form: every layer (point-to-point, collectives, object pulls)
//! under every fault of the rig (loss, rate, delay with reordering, link down, frozen
//! host, killed process), each case in a rig of two hosts of its own. A process on h0
//! moves checked data to and from one on h1 in paced rounds; once it has started, the
//! fault is put on h1. Every case must either complete with every byte checked, or end
//! with a clear error within its bound: [`OP_DEADLINE`] after the fault, plus
//! [`SLACK`]. The faults that cut or stop the peer must end in an error; the others
//! must complete. The process on h0 must then end by itself, cleanly: the test command
//! runs the loss and kill cases again with both processes under valgrind
//! ([`netns::WRAPPER`]), where that means without memory errors or definite leaks.
//! The cut and frozen peers are then found again with no deadline at all, by the
//! transport's keepalive alone ([`KEEPALIVE`]; bound: its timeout and interval plus
//! [`SLACK`]), and the keepalive must leave a run under a tight rate (slower rounds than
//! its timeout) alone. docs/faults.md has the table of cases and bounds.
//!
//! Creating namespaces needs root: without it each case prints why and does nothing.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ucxkit::collectives::{Communicator, InitOptions, Options, ReduceOp};
use ucxkit::object_push::{MemoryStore, NodeOptions, ObjectId, ObjectNode};
use ucxkit::transport::{tag, Context, Endpoint, Keepalive, Worker};
use ucxkit_testkit::netns::{self, Proc};
use ucxkit_testkit::payload;
use ucxkit_testkit::rig::{DelaySpec, Fault, Rig, Target};

/// Each operation's deadline (a send, a receive, a collective call, an object pull).
const OP_DEADLINE: Duration = Duration::from_secs(4);
/// What a case may take past its deadline: the processes' own reaction and reporting.
const SLACK: Duration = Duration::from_secs(3);
/// The keepalive of the cases without deadlines.
const KEEPALIVE: Keepalive =
    Keepalive { interval: Duration::from_millis(200), timeout: Duration::from_millis(1500) };
/// How the cases without deadlines limit a rate: a 1 MiB round takes about 2.1 s, longer
/// than [`KEEPALIVE`]'s timeout.
const SLOW_RATE: &str = "4mbit";
/// Rounds of a run, and the pause between them (so that a fault lands mid-run).
const ROUNDS: u64 = 40;
const PAUSE: Duration = Duration::from_millis(25);
/// Any child's whole life: it ends itself after this, should the parent be gone.
const CHILD_LIMIT: Duration = Duration::from_secs(90);
/// The collectives' store (rank 0's, on h0; a fresh namespace has every port free).
const STORE_PORT: u16 = 29_500;
const ACK: u64 = 1 << 32;
/// The round after which a run says it has started (and the fault comes): by then both
/// sides' keepalives have heard each other.
const STARTED_AFTER: u64 = 3;

/// The bytes of round `i`: mostly 64 KiB (eager over TCP), every tenth 1 MiB
/// (rendezvous).
fn round_len(i: u64) -> usize {
    if i % 10 == 5 {
        1 << 20
    } else {
        64 << 10
    }
}

#[derive(Clone, Copy, Debug)]
enum Layer {
    P2p,
    Coll,
    Object,
}

impl Layer {
    /// The child tests run on h1 (the peer, which the fault hits) and h0 (the one that
    /// reports).
    fn children(self) -> (&'static str, &'static str) {
        match self {
            Layer::P2p => ("p2p_peer", "p2p_runner"),
            Layer::Coll => ("coll_peer", "coll_runner"),
            Layer::Object => ("object_peer", "object_runner"),
        }
    }
}

/// Whether a fault cuts or stops the peer: then the run must end in an error.
fn fatal(f: &Fault) -> bool {
    matches!(f, Fault::LinkDown | Fault::Freeze(_) | Fault::Kill(_))
}

/// How a case's processes find a dead peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finder {
    /// Each operation's deadline ([`OP_DEADLINE`]).
    Deadline,
    /// The keepalive ([`KEEPALIVE`]) alone: no operation has a deadline.
    Keepalive,
}

impl Finder {
    /// How soon after a fatal fault the run must have ended in an error.
    fn bound(self) -> Duration {
        match self {
            Finder::Deadline => OP_DEADLINE + SLACK,
            Finder::Keepalive => KEEPALIVE.timeout + KEEPALIVE.interval + SLACK,
        }
    }
}

/// Runs one case: the layer's two processes on a fresh rig, `fault` on h1 once the run
/// has started, dead peers found by `finder`; checks the outcome and its time.
fn case(layer: Layer, fault: Fault, finder: Finder) {
    if let Err(e) = netns::available() {
        eprintln!("{layer:?} under {fault}: skipped, network namespaces are not available here ({e})");
        return;
    }
    let mut rig = Rig::up(2, None).expect("making the rig");
    let (h0, h1) = (rig.hosts()[0].clone(), rig.hosts()[1].clone());
    let env = |extra: Vec<(&'static str, String)>| {
        let mut e = vec![
            ("UCX_TLS", "tcp,self".to_string()),
            ("UCX_WARN_UNUSED_ENV_VARS", "n".to_string()),
            ("FAULTS_STORE", format!("{}:{STORE_PORT}", h0.addr)),
        ];
        if finder == Finder::Keepalive {
            e.push(("FAULTS_KEEPALIVE", "1".to_string()));
        }
        e.extend(extra);
        e
    };
    let (peer_test, runner_test) = layer.children();
    let mut peer = Proc::child_test(&h1.ns, peer_test, &env(vec![("FAULTS_ADDR", h1.addr.to_string())]));
    let port = match layer {
        Layer::Coll => String::new(),
        _ => peer.expect_line("PORT", Duration::from_secs(30)).expect("the peer's port"),
    };
    let mut runner =
        Proc::child_test(&h0.ns, runner_test, &env(vec![("FAULTS_PEER", format!("{}:{port}", h1.addr))]));
    runner.expect_line("STARTED", Duration::from_secs(30)).expect("the run starts");
    rig.set(1, &fault).expect("setting the fault");
    let set = Instant::now();
    let limit = OP_DEADLINE * (ROUNDS as u32 / 4) + SLACK;
    let outcome = runner.expect_line("OUTCOME", limit).expect("an outcome within the run's limit");
    let took = set.elapsed();
    eprintln!("{layer:?} under {fault}, found by {finder:?}: {outcome} ({took:?} after the fault)");
    // The runner ends by itself after its outcome, cleanly (under valgrind: without
    // memory errors or definite leaks).
    runner.finish(Duration::from_secs(60)).expect("the runner ends well");
    if fatal(&fault) {
        assert!(outcome.starts_with("error "), "{layer:?} under {fault}: {outcome}");
        if matches!(layer, Layer::Coll) {
            assert!(outcome.contains("rank 1"), "the error names the rank: {outcome}");
        }
        assert!(
            took <= finder.bound(),
            "{layer:?} under {fault}: the error came {took:?} after the fault (bound {:?})",
            finder.bound()
        );
    } else {
        assert_eq!(outcome, format!("ok {ROUNDS} rounds checked"), "{layer:?} under {fault}");
        // The peer checked what it received too.
        if !matches!(layer, Layer::Object) {
            let checked = peer.expect_line("CHECKED", Duration::from_secs(30)).expect("the peer's own check");
            assert_eq!(checked, format!("{ROUNDS} rounds"), "{layer:?} under {fault}");
        }
    }
    drop((peer, runner));
}

fn delay() -> Fault {
    Fault::Delay(DelaySpec {
        delay: Duration::from_millis(20),
        jitter: Duration::from_millis(10),
        reorder: 10.0,
    })
}

/// One test per line, grouped by how the processes find a dead peer.
macro_rules! cases {
    ($($finder:ident { $($name:ident: $layer:expr, $fault:expr;)* })*) => {$($(
        #[test]
        fn $name() {
            case($layer, $fault, Finder::$finder);
        }
    )*)*};
}

cases! {
    Deadline {
        p2p_under_loss: Layer::P2p, Fault::Loss(3.0);
        p2p_under_rate: Layer::P2p, Fault::Rate("50mbit".into());
        p2p_under_delay_and_reordering: Layer::P2p, delay();
        p2p_with_the_link_down: Layer::P2p, Fault::LinkDown;
        p2p_with_the_peer_frozen: Layer::P2p, Fault::Freeze(Target::All);
        p2p_with_the_peer_killed: Layer::P2p, Fault::Kill(Target::All);
        coll_under_loss: Layer::Coll, Fault::Loss(3.0);
        coll_under_rate: Layer::Coll, Fault::Rate("50mbit".into());
        coll_under_delay_and_reordering: Layer::Coll, delay();
        coll_with_the_link_down: Layer::Coll, Fault::LinkDown;
        coll_with_the_peer_frozen: Layer::Coll, Fault::Freeze(Target::All);
        coll_with_the_peer_killed: Layer::Coll, Fault::Kill(Target::All);
        object_under_loss: Layer::Object, Fault::Loss(3.0);
        object_under_rate: Layer::Object, Fault::Rate("50mbit".into());
        object_under_delay_and_reordering: Layer::Object, delay();
        object_with_the_link_down: Layer::Object, Fault::LinkDown;
        object_with_the_holder_frozen: Layer::Object, Fault::Freeze(Target::All);
        object_with_the_holder_killed: Layer::Object, Fault::Kill(Target::All);
    }
    Keepalive {
        p2p_link_down_found_by_keepalive: Layer::P2p, Fault::LinkDown;
        p2p_frozen_peer_found_by_keepalive: Layer::P2p, Fault::Freeze(Target::All);
        p2p_slow_rounds_kept_by_keepalive: Layer::P2p, Fault::Rate(SLOW_RATE.into());
        coll_link_down_found_by_keepalive: Layer::Coll, Fault::LinkDown;
        coll_frozen_peer_found_by_keepalive: Layer::Coll, Fault::Freeze(Target::All);
        coll_slow_rounds_kept_by_keepalive: Layer::Coll, Fault::Rate(SLOW_RATE.into());
        object_link_down_found_by_keepalive: Layer::Object, Fault::LinkDown;
        object_frozen_holder_found_by_keepalive: Layer::Object, Fault::Freeze(Target::All);
        object_slow_rounds_kept_by_keepalive: Layer::Object, Fault::Rate(SLOW_RATE.into());
    }
}

// The children. Each returns at once outside a case (no variables set).

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Whether this child finds dead peers by the keepalive alone (no deadlines).
fn by_keepalive() -> bool {
    var("FAULTS_KEEPALIVE").is_some()
}

/// Each operation's deadline: none to speak of when the keepalive alone finds dead peers.
fn op_deadline() -> Duration {
    if by_keepalive() {
        CHILD_LIMIT
    } else {
        OP_DEADLINE
    }
}

/// The child's keepalive: [`KEEPALIVE`] when it alone finds dead peers, else the default.
fn keepalive() -> Option<Keepalive> {
    Some(if by_keepalive() { KEEPALIVE } else { Keepalive::default() })
}

fn worker() -> Worker {
    Context::builder().build().expect("context").worker().keepalive(keepalive()).build().expect("worker")
}

/// Prints the run's outcome: every round checked, or the first error (with the round).
fn report(r: Result<(), String>) {
    match r {
        Ok(()) => println!("OUTCOME ok {ROUNDS} rounds checked"),
        Err(e) => println!("OUTCOME error {e}"),
    }
}

/// `f` within [`op_deadline`], its error as text.
async fn within<T, E: std::fmt::Display>(
    what: String,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    let deadline = op_deadline();
    match tokio::time::timeout(deadline, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {deadline:?}")),
    }
}

#[tokio::test]
#[ignore = "a child of the failure suite's point-to-point cases"]
async fn p2p_peer() {
    let Some(addr) = var("FAULTS_ADDR") else { return };
    let w = worker();
    let l = w.listen(SocketAddr::new(addr.parse().unwrap(), 0)).unwrap();
    println!("PORT {}", l.local_addr().port());
    let served = async {
        let ep = l.accept().await.unwrap();
        for i in 0..ROUNDS {
            let (info, data) = w.tag_recv_any(i, tag::EXACT).await.unwrap();
            let good = info.len == round_len(i) && data == payload(i, round_len(i));
            ep.tag_send(ACK + i, vec![u8::from(good)]).await.0.unwrap();
            assert!(good, "round {i} arrived different");
        }
        println!("CHECKED {ROUNDS} rounds");
        std::future::pending::<()>().await;
    };
    let _ = tokio::time::timeout(CHILD_LIMIT, served).await;
}

#[tokio::test]
#[ignore = "a child of the failure suite's point-to-point cases"]
async fn p2p_runner() {
    let Some(peer) = var("FAULTS_PEER") else { return };
    let w = worker();
    let run = async {
        let ep = within("connecting".into(), w.connect(peer.parse().unwrap())).await?;
        for i in 0..ROUNDS {
            // Bound to the endpoint: its failure ends the receive.
            let ack = ep.tag_recv(ACK + i, tag::EXACT, vec![0u8; 1]);
            within(format!("round {i}: send"), async { ep.tag_send(i, payload(i, round_len(i))).await.0 })
                .await?;
            let got = within(format!("round {i}: acknowledgement"), async {
                let (r, b) = ack.await;
                r.map(|_| b)
            })
            .await?;
            if got != [1] {
                return Err(format!("round {i}: the peer found its bytes different"));
            }
            if i == STARTED_AFTER {
                println!("STARTED");
            }
            tokio::time::sleep(PAUSE).await;
        }
        Ok(())
    };
    report(run.await);
}

/// Round `i`'s allreduce input on `rank` (small integers: f32 sums are exact).
fn coll_input(i: u64, rank: usize) -> Vec<f32> {
    (0..round_len(i) / 4).map(|k| ((k as u64 + i) % 100 + rank as u64) as f32).collect()
}

async fn coll_rank(rank: usize) -> Result<(), String> {
    let store = var("FAULTS_STORE").unwrap();
    let opts =
        InitOptions { deadline: Duration::from_secs(30), keepalive: keepalive(), ..Default::default() };
    let comm = Communicator::init_with(rank, 2, &store, opts).await.map_err(|e| format!("forming: {e}"))?;
    let deadline = (!by_keepalive()).then_some(OP_DEADLINE);
    let comm = comm.with_options(Options { deadline, ..Default::default() });
    for i in 0..ROUNDS {
        let want: Vec<f32> = coll_input(i, 0).iter().zip(coll_input(i, 1)).map(|(a, b)| a + b).collect();
        let got = comm
            .allreduce(coll_input(i, rank), ReduceOp::Sum)
            .await
            .map_err(|f| format!("round {i}: {}", f.error))?;
        if got != want {
            return Err(format!("round {i}: the allreduce's result is wrong"));
        }
        if i == STARTED_AFTER && rank == 0 {
            println!("STARTED");
        }
        tokio::time::sleep(PAUSE).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of the failure suite's collective cases"]
async fn coll_peer() {
    if var("FAULTS_ADDR").is_none() {
        return;
    }
    if tokio::time::timeout(CHILD_LIMIT, coll_rank(1)).await.is_ok_and(|r| r.is_ok()) {
        println!("CHECKED {ROUNDS} rounds");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of the failure suite's collective cases"]
async fn coll_runner() {
    if var("FAULTS_PEER").is_none() {
        return;
    }
    match tokio::time::timeout(CHILD_LIMIT, coll_rank(0)).await {
        Ok(r) => report(r),
        Err(_) => report(Err(format!("no outcome within {CHILD_LIMIT:?}"))),
    }
}

fn object_opts() -> NodeOptions {
    NodeOptions { chunk: 64 << 10, window: 4, deadline: op_deadline(), ..NodeOptions::default() }
}

fn object_id(i: u64) -> ObjectId {
    ObjectId::try_from(format!("round-{i}").as_str()).unwrap()
}

#[tokio::test]
#[ignore = "a child of the failure suite's object cases"]
async fn object_peer() {
    let Some(addr) = var("FAULTS_ADDR") else { return };
    let w = worker();
    let node = ObjectNode::new(&w, Arc::new(MemoryStore::new()), object_opts()).unwrap();
    for i in 0..ROUNDS {
        node.put(object_id(i), Bytes::from(payload(i, round_len(i)))).unwrap();
    }
    let bound = node.listen(SocketAddr::new(addr.parse().unwrap(), 0)).unwrap();
    println!("PORT {}", bound.port());
    tokio::time::sleep(CHILD_LIMIT).await;
}

#[tokio::test]
#[ignore = "a child of the failure suite's object cases"]
async fn object_runner() {
    let Some(peer) = var("FAULTS_PEER") else { return };
    let w = worker();
    let node = ObjectNode::new(&w, Arc::new(MemoryStore::new()), object_opts()).unwrap();
    let run = async {
        let holder: Endpoint = within("connecting".into(), w.connect(peer.parse().unwrap())).await?;
        for i in 0..ROUNDS {
            // The node's own deadline bounds the pull; the outer one only catches a hang.
            let got = tokio::time::timeout(op_deadline() + SLACK, node.pull(object_id(i), &holder))
                .await
                .map_err(|_| format!("round {i}: the pull outlived its deadline"))?
                .map_err(|e| format!("round {i}: {e}"))?;
            if got.bytes().map(|b| b[..] != payload(i, round_len(i))[..]).unwrap_or(true) {
                return Err(format!("round {i}: the object arrived different"));
            }
            node.release(&object_id(i));
            if i == STARTED_AFTER {
                println!("STARTED");
            }
            tokio::time::sleep(PAUSE).await;
        }
        Ok(())
    };
    report(run.await);
}
