//! What the collectives add to the transport for small messages: an allreduce of 8 bytes
//! between 2 ranks in one process (two workers over shared memory, one thread), against
//! the same exchange written directly on the transport (each rank posts a receive from
//! the other and a send to it, then adds what came). The difference is the collective
//! call's own work: planning, buffers, tags, the executor and failure bookkeeping.
//!
//! `cargo bench -p ucxkit-benches --bench coll`; instructions per call (steady from run
//! to run where timings are not): `scripts/overhead-instructions coll`.

use criterion::{criterion_group, criterion_main, Criterion};
use ucxkit_collectives::{Communicator, ReduceOp};
use ucxkit_testkit::workers::{mesh_with, Mesh};
use ucxkit_transport::namespace::COLLECTIVES;
use ucxkit_transport::{tag::EXACT, Namespace, ProgressMode};

struct Pair {
    rt: tokio::runtime::Runtime,
    _mesh: Mesh,
    comms: Vec<Communicator>,
    ns: Vec<Namespace>,
}

fn setup() -> Pair {
    setup_in(ProgressMode::Event)
}

fn setup_in(mode: ProgressMode) -> Pair {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let (mesh, comms, ns) = rt.block_on(async {
        let mesh = mesh_with("posix,tcp,self", 2, mode).await;
        let ns: Vec<Namespace> = mesh.workers.iter().map(|w| w.namespace(COLLECTIVES).expect("ns")).collect();
        let comms = (0..2)
            .map(|r| Communicator::from_endpoints(&ns[r], 0, r, mesh.eps[r].clone()).expect("communicator"))
            .collect();
        (mesh, comms, ns)
    });
    Pair { rt, _mesh: mesh, comms, ns }
}

/// How long `turns` takes on the pair's runtime.
fn timed(p: &Pair, turns: impl std::future::Future<Output = ()>) -> std::time::Duration {
    p.rt.block_on(async {
        let t = std::time::Instant::now();
        turns.await;
        t.elapsed()
    })
}

/// Rank 0's and rank 1's endpoints to each other.
fn eps(p: &Pair) -> (ucxkit_transport::Endpoint, ucxkit_transport::Endpoint) {
    (p.comms[0].endpoint(1).expect("ep").clone(), p.comms[1].endpoint(0).expect("ep").clone())
}

/// One rank's half of the hand-written exchange (tags outside the communicator's).
async fn by_hand(ns: &Namespace, ep: &ucxkit_transport::Endpoint, mine: Vec<u8>, spare: Vec<u8>) -> Vec<u8> {
    let recv = ns.tag_recv_from(ep, 1 << 50, EXACT, spare);
    let send = ns.tag_send(ep, 1 << 50, mine);
    let ((r, theirs), (s, mut mine)) = tokio::join!(recv, send);
    r.expect("recv");
    s.expect("send");
    for (a, b) in mine.chunks_exact_mut(4).zip(theirs.chunks_exact(4)) {
        let sum = f32::from_le_bytes([a[0], a[1], a[2], a[3]]) + f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        a.copy_from_slice(&sum.to_le_bytes());
    }
    mine
}

fn allreduce_8b(c: &mut Criterion) {
    let p = setup();
    let eps = eps(&p);
    let mut g = c.benchmark_group("allreduce_2ranks_8B_event");
    g.bench_function("collectives", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (mut x, mut y) = (vec![1.0f32; 2], vec![2.0f32; 2]);
                for _ in 0..iters {
                    let (a, b) = tokio::join!(
                        p.comms[0].allreduce(x, ReduceOp::Sum),
                        p.comms[1].allreduce(y, ReduceOp::Sum)
                    );
                    (x, y) = (a.expect("allreduce"), b.expect("allreduce"));
                }
            })
        })
    });
    g.bench_function("transport", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (mut x, mut y) = (vec![0u8; 8], vec![0u8; 8]);
                for _ in 0..iters {
                    let (sx, sy) = (vec![0u8; 8], vec![0u8; 8]);
                    (x, y) = tokio::join!(by_hand(&p.ns[0], &eps.0, x, sx), by_hand(&p.ns[1], &eps.1, y, sy));
                }
            })
        })
    });
    g.finish();
}

/// A broadcast of 8 bytes from rank 0: the collective against a send and a receive on
/// the transport.
fn broadcast_8b(c: &mut Criterion) {
    let p = setup();
    let eps = eps(&p);
    let mut g = c.benchmark_group("broadcast_2ranks_8B_event");
    g.bench_function("collectives", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (mut x, mut y) = (vec![1.0f32; 2], vec![2.0f32; 2]);
                for _ in 0..iters {
                    let (a, b) = tokio::join!(p.comms[0].broadcast(x, 0), p.comms[1].broadcast(y, 0));
                    (x, y) = (a.expect("broadcast"), b.expect("broadcast"));
                }
            })
        })
    });
    g.bench_function("transport", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (x, mut y) = (vec![1u8; 8], vec![0u8; 8]);
                for _ in 0..iters {
                    let recv = p.ns[1].tag_recv_from(&eps.1, 1 << 50, EXACT, std::mem::take(&mut y));
                    let sent = p.ns[0].try_tag_send(&eps.0, 1 << 50, &x).expect("send");
                    let send = async {
                        if !sent {
                            p.ns[0].tag_send(&eps.0, 1 << 50, x.clone()).await.0.expect("send");
                        }
                    };
                    let ((r, got), ()) = tokio::join!(recv, send);
                    r.expect("recv");
                    y = got;
                    y.clear();
                }
            })
        })
    });
    g.finish();
}

/// Broadcasts queued ahead of their receivers, as back-to-back calls queue when ranks
/// share cores: the root makes [`AHEAD`] calls of 8 bytes (each done once UCX takes its
/// send), then rank 1 makes its [`AHEAD`], each finding its message arrived. Time and
/// instructions per pair of calls, busy-poll mode, against the same sends and receives
/// on the transport: what a call costs the processor, which bounds back-to-back
/// broadcasts on a crowded host.
fn broadcast_8b_ahead(c: &mut Criterion) {
    let p = setup_in(ProgressMode::BusyPoll);
    let eps = eps(&p);
    let mut g = c.benchmark_group("broadcast_2ranks_8B_ahead");
    g.bench_function("collectives", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (mut x, mut y) = (vec![1.0f32; 2], vec![2.0f32; 2]);
                for _ in 0..iters.div_ceil(AHEAD) {
                    for _ in 0..AHEAD {
                        x = p.comms[0].broadcast(x, 0).await.expect("broadcast");
                    }
                    for _ in 0..AHEAD {
                        y = p.comms[1].broadcast(y, 0).await.expect("broadcast");
                    }
                }
            })
        })
    });
    g.bench_function("transport", |b| {
        b.iter_custom(|iters| {
            timed(&p, async {
                let (x, mut y) = (vec![1u8; 8], vec![0u8; 8]);
                for _ in 0..iters.div_ceil(AHEAD) {
                    for _ in 0..AHEAD {
                        if !p.ns[0].try_tag_send(&eps.0, 1 << 50, &x).expect("send") {
                            p.ns[0].tag_send(&eps.0, 1 << 50, x.clone()).await.0.expect("send");
                        }
                    }
                    for _ in 0..AHEAD {
                        let (r, got) =
                            p.ns[1].tag_recv_from(&eps.1, 1 << 50, EXACT, std::mem::take(&mut y)).await;
                        r.expect("recv");
                        y = got;
                        y.clear();
                    }
                }
            })
        })
    });
    g.finish();
}

/// Calls the root of [`broadcast_8b_ahead`] makes before its receiver makes its own:
/// within UCX's shared-memory queue (64 messages by default).
const AHEAD: u64 = 16;

criterion_group!(benches, allreduce_8b, broadcast_8b, broadcast_8b_ahead);
criterion_main!(benches);
