//! Every operation of a communicator against a naive reference, on in-process groups of
//! 1 to 5 workers (full meshes over TCP and shared memory), with every algorithm the
//! planner can pick forced in turn; concurrent calls; malformed calls; mismatched calls.

use std::time::Duration;

use futures_util::future::join_all;
use ucxkit_collectives::{Communicator, Element, Error, Op, Options, ReduceOp};

mod common;
use common::group;
use ucxkit_transport::namespace::COLLECTIVES;

fn contribution<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| T::from_small(((r * 7 + i * 3) % 5) as u8 + 1)).collect()
}

fn reduce_all<T: Element>(parts: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        T::reduce(op, &mut acc, p);
    }
    acc
}

/// Runs `f(rank, comm)` on every rank at once and returns the results in rank order.
async fn all<F, Fut, R>(comms: &[Communicator], f: F) -> Vec<R>
where
    F: Fn(usize, Communicator) -> Fut,
    Fut: std::future::Future<Output = R>,
{
    let limit = Duration::from_secs(60);
    tokio::time::timeout(limit, join_all(comms.iter().enumerate().map(|(r, c)| f(r, c.clone()))))
        .await
        .expect("collective finished in time")
}

async fn check_reductions<T: Element>(comms: &[Communicator], count: usize, op: ReduceOp) {
    let n = comms.len();
    let parts: Vec<Vec<T>> = (0..n).map(|r| contribution(r, count)).collect();
    let want = reduce_all(&parts, op);
    let got = all(comms, |r, c| {
        let p = parts[r].clone();
        async move { c.allreduce(p, op).await.expect("allreduce") }
    })
    .await;
    assert!(got.iter().all(|g| *g == want), "allreduce {} {op} n {n} count {count}", T::DTYPE);
    let root = n - 1;
    let got = all(comms, |r, c| {
        let p = parts[r].clone();
        async move { c.reduce(p, op, root).await.expect("reduce") }
    })
    .await;
    assert_eq!(got[root], want, "reduce {} n {n} count {count}", T::DTYPE);
    let got = all(comms, |r, c| {
        let p = parts[r].clone();
        async move { c.reduce_scatter(p, op).await.expect("reduce_scatter") }
    })
    .await;
    assert_eq!(got.concat(), want, "reduce_scatter {} n {n} count {count}", T::DTYPE);
    let got = all(comms, |r, c| {
        let p = parts[r].clone();
        async move { c.reduce_scatter_in_place(p, op).await.expect("reduce_scatter_in_place") }
    })
    .await;
    let cut = |r: usize| {
        let (q, rem) = (count / n, count % n);
        let start = r * q + r.min(rem);
        start..start + q + usize::from(r < rem)
    };
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g.len(), count);
        assert_eq!(g[cut(r)], want[cut(r)], "reduce_scatter_in_place rank {r}");
    }
    for exclusive in [false, true] {
        let got = all(comms, |r, c| {
            let p = parts[r].clone();
            async move {
                if exclusive {
                    c.exscan(p, op).await.expect("exscan")
                } else {
                    c.scan(p, op).await.expect("scan")
                }
            }
        })
        .await;
        for (r, g) in got.iter().enumerate() {
            let want = match (exclusive, r) {
                (true, 0) => parts[0].clone(),
                (true, _) => reduce_all(&parts[..r], op),
                (false, _) => reduce_all(&parts[..=r], op),
            };
            assert_eq!(*g, want, "scan exclusive {exclusive} rank {r}");
        }
    }
}

async fn check_movement(comms: &[Communicator], count: usize) {
    let n = comms.len();
    let parts: Vec<Vec<u32>> = (0..n).map(|r| (0..count).map(|i| (r * 1000 + i) as u32).collect()).collect();
    for root in [0, n / 2] {
        let got = all(comms, |r, c| {
            let b = if r == root { parts[root].clone() } else { vec![0; count] };
            async move { c.broadcast(b, root).await.expect("broadcast") }
        })
        .await;
        assert!(got.iter().all(|g| *g == parts[root]), "broadcast n {n} count {count} root {root}");
        let got = all(comms, |r, c| {
            let p = parts[r].clone();
            async move { c.gather(p, root).await.expect("gather") }
        })
        .await;
        assert_eq!(got[root], parts.concat(), "gather n {n} count {count}");
        let got = all(comms, |r, c| {
            let b = if r == root { parts.concat() } else { Vec::new() };
            async move { c.scatter(b, count, root).await.expect("scatter") }
        })
        .await;
        assert_eq!(got, parts, "scatter n {n} count {count}");
    }
    let got = all(comms, |r, c| {
        let p = parts[r].clone();
        async move { c.allgather(p).await.expect("allgather") }
    })
    .await;
    assert!(got.iter().all(|g| *g == parts.concat()), "allgather n {n} count {count}");
    let got = all(comms, |r, c| {
        let b: Vec<u32> = (0..n * count).map(|i| (r * 100_000 + i) as u32).collect();
        async move { c.alltoall(b).await.expect("alltoall") }
    })
    .await;
    for (r, g) in got.iter().enumerate() {
        let want: Vec<u32> = (0..n)
            .flat_map(|src| (r * count..(r + 1) * count).map(move |i| (src * 100_000 + i) as u32))
            .collect();
        assert_eq!(*g, want, "alltoall n {n} count {count} rank {r}");
    }
    let got = all(comms, |r, c| {
        let mut b = vec![0u32; n * count];
        b[r * count..(r + 1) * count].copy_from_slice(&parts[r]);
        async move { c.allgather_in_place(b).await.expect("allgather_in_place") }
    })
    .await;
    assert!(got.iter().all(|g| *g == parts.concat()), "allgather_in_place n {n} count {count}");
    let got = all(comms, |r, c| {
        let b: Vec<u32> = (0..n * count).map(|i| (r * 100_000 + i) as u32).collect();
        async move { c.alltoall_into(b, Vec::with_capacity(3)).await.expect("alltoall_into") }
    })
    .await;
    for (r, (g, input)) in got.iter().enumerate() {
        let want: Vec<u32> = (0..n)
            .flat_map(|src| (r * count..(r + 1) * count).map(move |i| (src * 100_000 + i) as u32))
            .collect();
        assert_eq!(*g, want, "alltoall_into n {n} count {count} rank {r}");
        assert_eq!(input.len(), n * count, "the input comes back");
    }
    all(comms, |_, c| async move { c.barrier().await.expect("barrier") }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_matches_the_reference_on_1_to_5_ranks() {
    for n in 1..=5 {
        let (_mesh, comms) = group(n).await;
        for count in [0, 1, 7, 1000] {
            check_reductions::<i32>(&comms, count, ReduceOp::Sum).await;
            check_movement(&comms, count).await;
        }
        check_reductions::<f32>(&comms, 33, ReduceOp::Max).await;
        check_reductions::<u8>(&comms, 5, ReduceOp::Bxor).await;
        check_reductions::<ucxkit_collectives::bf16>(&comms, 300, ReduceOp::Sum).await;
        check_reductions::<ucxkit_collectives::f16>(&comms, 3, ReduceOp::Prod).await;
        check_reductions::<u64>(&comms, 100_000, ReduceOp::Min).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_matches_the_reference_on_6_to_8_ranks() {
    for n in 6..=8 {
        let (_mesh, comms) = group(n).await;
        for count in [1, 13, 4099] {
            check_reductions::<i32>(&comms, count, ReduceOp::Sum).await;
            check_movement(&comms, count).await;
        }
        check_reductions::<f64>(&comms, 100, ReduceOp::Min).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_runs_when_forced() {
    for n in [2, 3, 4, 5] {
        let (_mesh, comms) = group(n).await;
        let ops = [
            Op::Allreduce,
            Op::Broadcast,
            Op::Reduce,
            Op::Allgather,
            Op::ReduceScatter,
            Op::Alltoall,
            Op::Barrier,
        ];
        for op in ops {
            for alg in op.candidates() {
                let forced: Vec<Communicator> = comms
                    .iter()
                    .map(|c| c.with_options(Options { algorithm: vec![(op, *alg)], ..Default::default() }))
                    .collect();
                assert!(forced[0].plan(op, 64, 4, 0).forced);
                for count in [1, 250_000] {
                    match op {
                        Op::Broadcast | Op::Allgather | Op::Alltoall | Op::Barrier => {
                            check_movement(&forced, count).await
                        }
                        _ => check_reductions::<i64>(&forced, count, ReduceOp::Sum).await,
                    }
                }
            }
        }
    }
}

/// Transfers cut into pieces land whole, short ones included (pieces of 12 bytes: three
/// i32), and long ones reduced piece by piece as they land (pieces of 4 KiB) give what
/// reducing them whole gives, for every algorithm the planner picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_in_pieces_match_the_reference() {
    for n in [2, 3] {
        let (_mesh, comms) = group(n).await;
        for (segment, counts) in [(12, &[1, 7, 100][..]), (4096, &[5000, 30_001][..])] {
            let opts = Options { segment: Some(segment), ..Default::default() };
            let pieces: Vec<Communicator> = comms.iter().map(|c| c.with_options(opts.clone())).collect();
            for &count in counts {
                check_reductions::<i32>(&pieces, count, ReduceOp::Sum).await;
                check_reductions::<f32>(&pieces, count, ReduceOp::Max).await;
                check_movement(&pieces, count).await;
            }
        }
    }
}

/// Handles with cost constants of their own plan with them, whatever the other handles
/// of the communicator planned before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_with_their_own_costs_plan_with_them() {
    let (_mesh, comms) = group(4).await;
    let slow = ucxkit_collectives::plan::Costs {
        latency: Duration::from_secs(1),
        rndv_latency: Duration::from_secs(1),
        ..Default::default()
    };
    let own = comms[0].with_options(Options { costs: Some(slow), ..Default::default() });
    let bytes = 4 << 20;
    let shared = comms[0].plan(Op::Allreduce, bytes, 4, 0);
    let fewest_steps = own.plan(Op::Allreduce, bytes, 4, 0);
    assert_ne!(shared.algorithm, fewest_steps.algorithm, "{shared} / {fewest_steps}");
    assert_eq!(comms[0].plan(Op::Allreduce, bytes, 4, 0).algorithm, shared.algorithm);
}

/// A receive from a silent peer ends at the handle's deadline with its buffer back, and
/// a pending receive ends when another rank aborts the communicator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_calls_end_at_the_deadline_and_on_abort() {
    let (_mesh, comms) = group(2).await;
    let limit =
        comms[0].with_options(Options { deadline: Some(Duration::from_millis(200)), ..Default::default() });
    let t = std::time::Instant::now();
    let recv = tokio::time::timeout(Duration::from_secs(10), limit.recv(vec![0u32; 4], 1, 5));
    let f = recv.await.expect("ended by the deadline").expect_err("nobody sends");
    assert!(
        matches!(&f.error, Error::DeadlineExceeded { waiting_on, .. } if waiting_on == &[1]),
        "{}",
        f.error
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(f.buf, Some(vec![0; 4]), "the buffer comes back");
    // The communicator goes on: a matched pair still works.
    let (s, r) = tokio::join!(comms[1].send(vec![3u32; 4], 0, 6), comms[0].recv(vec![0u32; 4], 1, 6));
    assert_eq!((s.expect("send").len(), r.expect("recv")), (4, vec![3; 4]));
    let pending = comms[0].recv(vec![0u8; 8], 1, 7);
    let waiter = tokio::spawn(pending);
    tokio::time::sleep(Duration::from_millis(50)).await;
    comms[1].abort("the test gives up");
    let f = tokio::time::timeout(Duration::from_secs(10), waiter).await.expect("ended").expect("task");
    let f = f.expect_err("aborted");
    assert!(matches!(f.error, Error::Aborted(_)), "{}", f.error);
}

/// A communicator shrunk to its live ranks keeps their host layout (here: all alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_keeps_the_host_layout() {
    let (_mesh, comms) = group(4).await;
    for c in &comms {
        c.set_hosts(&[0u8, 0, 1, 1]).expect("hosts");
    }
    let shrunk =
        all(&comms, |_, c| async move { c.shrink(Duration::from_secs(10)).await.expect("shrink") }).await;
    for c in &shrunk {
        assert_eq!((c.size(), c.hosts().count()), (4, 2));
        assert!(c.hosts().same(0, 1) && !c.hosts().same(1, 2));
    }
}

/// A communicator keeps a call's buffers for the next call emptied: a later call with no
/// input of its own never gets an earlier call's values back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_buffers_never_hand_back_earlier_values() {
    let (_mesh, comms) = group(2).await;
    // Rank 0 roots a gather (the communicator keeps its input's buffer)...
    let got =
        all(
            &comms,
            |r, c| async move { c.gather_v(vec![r as u32 + 7; 3], vec![3, 3], 0).await.expect("gather") },
        )
        .await;
    assert_eq!(got[0], vec![7, 7, 7, 8, 8, 8]);
    // ...then sends nothing to another root, and gets back the nothing it passed.
    let got = all(&comms, |r, c| async move {
        let mine = if r == 0 { Vec::new() } else { vec![9u32; 2] };
        c.gather_v(mine, vec![0, 2], 1).await.expect("gather")
    })
    .await;
    assert_eq!(got, vec![vec![], vec![9, 9]]);
    // An all-to-all of nothing gives nothing back either.
    let got =
        all(&comms, |_, c| async move { c.alltoall_into(Vec::<u32>::new(), Vec::new()).await.expect("a2a") })
            .await;
    assert!(got.iter().all(|(out, input)| out.is_empty() && input.is_empty()), "{got:?}");
}

/// Ranks told they sit on several hosts run the two-level forms, forced and as the
/// model picks them, on contiguous, interleaved and uneven layouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_level_forms_match_the_reference_on_every_layout() {
    let layouts: [&[u8]; 5] =
        [&[0, 0, 1, 1], &[0, 1, 0, 1], &[0, 0, 0, 1, 1], &[0, 1, 1], &[0, 1, 2, 0, 1, 2]];
    for keys in layouts {
        let (_mesh, comms) = group(keys.len()).await;
        for c in &comms {
            c.set_hosts(keys).expect("hosts");
            assert!(c.hosts().two_level());
        }
        let ops = [Op::Allreduce, Op::Broadcast, Op::Allgather];
        let algorithm: Vec<_> = ops.iter().map(|&op| (op, ucxkit_collectives::Algorithm::TwoLevel)).collect();
        let opts = Options { algorithm, ..Default::default() };
        let forced: Vec<Communicator> = comms.iter().map(|c| c.with_options(opts.clone())).collect();
        for count in [0, 1, 7, 40_000] {
            check_reductions::<i32>(&forced, count, ReduceOp::Sum).await;
            check_movement(&forced, count).await;
        }
        check_reductions::<f64>(&comms, 3001, ReduceOp::Max).await;
        check_movement(&comms, 3001).await;
    }
    let (_mesh, comms) = group(2).await;
    assert!(comms[0].set_hosts(&[1, 2, 3]).is_err(), "one key per rank");
}

/// A rank with nothing to send or receive in an all-to-all-v (and a scatter-v block of
/// none) takes part without a message, and nobody waits for one from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_empty_parts_neither_send_nor_are_waited_for() {
    let (_mesh, comms) = group(3).await;
    // Ranks 0 and 1 swap 2 elements each way; rank 2 sends and receives nothing.
    let counts = |r: usize| -> Vec<usize> {
        if r == 2 {
            vec![0, 0, 0]
        } else {
            vec![2, 2, 0]
        }
    };
    let got = all(&comms, |r, c| {
        let buf = vec![r as u8; counts(r).iter().sum()];
        async move { c.alltoall_v(buf, counts(r), counts(r)).await.expect("alltoall_v") }
    })
    .await;
    assert_eq!(got, vec![vec![0, 0, 1, 1], vec![0, 0, 1, 1], vec![]]);
    let got = all(&comms, |r, c| {
        let buf = if r == 0 { vec![7u16, 8] } else { Vec::new() };
        async move { c.scatter_v(buf, vec![1, 0, 1], 0).await.expect("scatter_v") }
    })
    .await;
    assert_eq!(got, vec![vec![7], vec![], vec![8]]);
    // Nothing stray is left to match a later call.
    let sums =
        all(
            &comms,
            |r, c| async move { c.allreduce(vec![r as u8; 3], ReduceOp::Sum).await.expect("allreduce") },
        )
        .await;
    assert!(sums.iter().all(|s| *s == vec![3; 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_collectives_do_not_cross() {
    let (_mesh, comms) = group(4).await;
    let got = all(&comms, |r, c| async move {
        // Started in the same order everywhere, awaited in reverse.
        let futs: Vec<_> =
            (0..8).map(|k| c.allreduce(vec![(r * 10 + k) as i64; 3 + k * 1000], ReduceOp::Sum)).collect();
        let mut out = Vec::new();
        for f in futs.into_iter().rev() {
            out.push(f.await.expect("allreduce"));
        }
        out
    })
    .await;
    for (k, res) in got[0].iter().rev().enumerate() {
        let want = (0..4).map(|r| (r * 10 + k) as i64).sum::<i64>();
        assert!(res.iter().all(|v| *v == want) && res.len() == 3 + k * 1000, "call {k}");
    }
    assert!(got.iter().all(|g| *g == got[0]));
}

/// Many small calls in flight at once against a rank that starts late: the early rank
/// sends more than the endpoint takes during a call, so later sends queue (from copies
/// of their values); every call still ends with its own values, on both ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_small_calls_queues_behind_a_late_rank() {
    let (_mesh, comms) = group(2).await;
    let calls = 2000u64;
    let got = all(&comms, |r, c| async move {
        if r == 1 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let futs: Vec<_> =
            (0..calls).map(|k| c.broadcast(vec![if r == 0 { k } else { u64::MAX }; 4], 0)).collect();
        join_all(futs).await.into_iter().map(|b| b.expect("broadcast")).collect::<Vec<_>>()
    })
    .await;
    for g in &got {
        for (k, b) in g.iter().enumerate() {
            assert_eq!(*b, vec![k as u64; 4], "call {k}");
        }
    }
}

/// A small broadcast starts when it is made: the root's message goes out before its
/// future is first polled (its receiver ends first), and a receiver whose message is
/// there ends at once; a reduce alike. The communicator goes on as usual after. Over
/// shared memory only, whose queue takes a short message during the call for sure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_rooted_calls_start_when_made() {
    let (_mesh, comms) = common::group_over("posix,self", 2, ucxkit_transport::ProgressMode::default()).await;
    let limit = Duration::from_secs(10);
    let root = comms[0].broadcast(vec![7u32; 2], 0);
    let got = tokio::time::timeout(limit, comms[1].broadcast(vec![0u32; 2], 0)).await;
    assert_eq!(got.expect("the root sent when its call was made").expect("broadcast"), vec![7, 7]);
    assert_eq!(root.await.expect("root"), vec![7, 7]);
    // The leaf's part of a reduce to rank 1, made and never polled, still arrives.
    drop(comms[0].reduce(vec![2u32; 3], ReduceOp::Sum, 1));
    let sum = tokio::time::timeout(limit, comms[1].reduce(vec![5u32; 3], ReduceOp::Sum, 1)).await;
    assert_eq!(sum.expect("the leaf sent when its call was made").expect("reduce"), vec![7, 7, 7]);
    let after =
        all(&comms, |_, c| async move { c.allreduce(vec![1u32], ReduceOp::Sum).await.expect("allreduce") })
            .await;
    assert_eq!(after, vec![vec![2], vec![2]], "a call that ended when made aborts nothing when dropped");
}

/// Senders run at most 256 calls ahead of their receivers: leaves whose root makes no
/// call stop at the 256th reduce (it waits for the root's word that it came), and go
/// on, every result right, once the root makes its calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn senders_run_a_bounded_number_of_calls_ahead() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const CALLS: usize = 600;
    const AHEAD: usize = 255;
    let (_mesh, comms) = group(3).await;
    let done: Arc<Vec<AtomicUsize>> = Arc::new((0..3).map(|_| AtomicUsize::new(0)).collect());
    let leaves: Vec<_> = (1..3)
        .map(|r| {
            let (c, done) = (comms[r].clone(), done.clone());
            tokio::spawn(async move {
                for _ in 0..CALLS {
                    c.reduce(vec![r as u32; 4], ReduceOp::Sum, 0).await.expect("leaf's reduce");
                    done[r].fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Until the leaves stop (they must not finish).
    let mut last = (0, 0);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = (done[1].load(Ordering::Relaxed), done[2].load(Ordering::Relaxed));
        if now == last && now.0 >= AHEAD && now.1 >= AHEAD {
            break;
        }
        last = now;
    }
    assert_eq!(last, (AHEAD, AHEAD), "calls the leaves made before the root made any");
    for i in 0..CALLS {
        let sum = comms[0].reduce(vec![10u32; 4], ReduceOp::Sum, 0).await.expect("root's reduce");
        assert_eq!(sum, vec![13; 4], "call {i}");
    }
    for l in leaves {
        l.await.expect("leaf");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_messages_match_by_peer_and_tag() {
    let (_mesh, comms) = group(3).await;
    let got = all(&comms, |r, c| async move {
        match r {
            0 => {
                let b = c.recv(vec![0u16; 4], 2, 7).await.expect("recv 7");
                let a = c.recv(vec![0u16; 4], 1, 7).await.expect("recv from 1");
                [a, b].concat()
            }
            r => c.send(vec![r as u16; 4], 0, 7).await.expect("send"),
        }
    })
    .await;
    assert_eq!(got[0], [vec![1; 4], vec![2; 4]].concat());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_give_the_buffer_back() {
    // A malformed call fails where it is made and aborts the communicator (its peers
    // would otherwise wait for its messages); each check gets a fresh group.
    async fn first<T: std::fmt::Debug>(
        f: impl std::future::Future<Output = ucxkit_collectives::CallResult<u8, T>>,
    ) -> Box<ucxkit_collectives::Failed<u8>> {
        f.await.expect_err("malformed")
    }
    let (_mesh, comms) = group(2).await;
    let c = &comms[0];
    let f = c.allreduce(vec![1.0f32; 3], ReduceOp::Band).await.expect_err("bitwise on floats");
    assert!(matches!(f.error, Error::InvalidArgument(_)), "{}", f.error);
    assert_eq!(f.buf, Some(vec![1.0; 3]));
    // Now aborted, here and at the peer: later calls fail at once, buffers back.
    let f = c.broadcast(vec![1u8; 2], 0).await.expect_err("aborted");
    assert!(matches!(f.error, Error::Aborted(_)), "{}", f.error);
    assert_eq!(f.buf, Some(vec![1; 2]));
    let peer = tokio::time::timeout(Duration::from_secs(10), comms[1].allreduce(vec![0u8; 1], ReduceOp::Sum))
        .await
        .expect("the peer learns of the abort")
        .expect_err("aborted there too");
    assert!(matches!(&peer.error, Error::Aborted(a) if a.by == 0), "{}", peer.error);
    let (_m1, g1) = group(2).await;
    let (_m2, g2) = group(2).await;
    let (_m3, g3) = group(2).await;
    for (name, f) in [
        ("root out of range", first(g1[0].broadcast(vec![1u8; 2], 2)).await),
        ("not a multiple of the size", first(g2[0].alltoall(vec![1u8; 3])).await),
        ("counts of the wrong length", first(g3[0].allgather_v(vec![1u8; 3], vec![3])).await),
    ] {
        assert!(matches!(f.error, Error::InvalidArgument(_)), "{name}: {}", f.error);
        assert!(f.buf.is_some_and(|b| !b.is_empty()), "{name}");
    }
    let (_m, c2) = group(2).await;
    let f = c2[0].alltoall_into(vec![1u8; 3], vec![7u8; 2]).await.expect_err("not a multiple");
    assert_eq!((f.buf, f.output), (Some(vec![1; 3]), Some(vec![7; 2])));
    let f = c2[1].allgather_in_place(vec![1u8; 3]).await.expect_err("not a multiple");
    assert_eq!(f.buf, Some(vec![1; 3]));
    let f = c2[0].send(vec![1u8], 0, 0).await.expect_err("send to self");
    assert_eq!(f.buf, Some(vec![1]));
    assert!(Communicator::from_endpoints(
        &comms[1].endpoint(0).expect("ep").worker().namespace(COLLECTIVES + 5).expect("ns"),
        0,
        2,
        vec![None, None]
    )
    .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_sizes_are_reported_and_a_silent_peer_hits_the_deadline() {
    let (_mesh, comms) = group(2).await;
    let opts = Options { deadline: Some(Duration::from_millis(500)), ..Default::default() };
    let timed: Vec<Communicator> = comms.iter().map(|c| c.with_options(opts.clone())).collect();
    let got = all(&timed, |r, c| async move {
        c.broadcast(vec![1u32; 4 + r], 0).await.map(|_| ()).map_err(|f| f.error)
    })
    .await;
    assert!(got.iter().any(|r| matches!(r, Err(Error::Mismatch { .. }))), "{got:?}");
    // Rank 1 never calls: rank 0 gives up at its deadline, with its buffer back.
    let (_mesh, comms) = group(2).await;
    let c = comms[0].with_options(opts);
    let t = std::time::Instant::now();
    let f = c.allreduce(vec![5u8; 4], ReduceOp::Sum).await.expect_err("no peer");
    assert!(
        matches!(&f.error, Error::DeadlineExceeded { waiting_on, .. } if waiting_on == &[1]),
        "{}",
        f.error
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(f.buf.map(|b| b.len()), Some(4));
}
