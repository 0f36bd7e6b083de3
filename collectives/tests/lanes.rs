//! Large transfers between ranks of one host through shared-memory lanes: results match
//! a naive reference across pieces and slot rounds, concurrent calls that find a lane
//! busy go as plain messages, and ranks whose endpoints have no shared memory never use
//! one.

use std::time::Duration;

use futures_util::future::join_all;
use ucxkit_collectives::{Communicator, LaneCounts, ReduceOp};

mod common;
use common::group_over;
use ucxkit_testkit::workers::Mesh;
use ucxkit_transport::ProgressMode;

/// A group over `tls` in the default progress mode.
async fn group(tls: &str, n: usize) -> (Mesh, Vec<Communicator>) {
    group_over(tls, n, ProgressMode::default()).await
}

/// Runs `f(rank, comm)` on every rank at once, results in rank order.
async fn all<F, Fut, R>(comms: &[Communicator], f: F) -> Vec<R>
where
    F: Fn(usize, Communicator) -> Fut,
    Fut: std::future::Future<Output = R>,
{
    let run = join_all(comms.iter().enumerate().map(|(r, c)| f(r, c.clone())));
    tokio::time::timeout(Duration::from_secs(120), run).await.expect("collectives finished in time")
}

fn values(r: usize, count: usize) -> Vec<i32> {
    (0..count).map(|i| ((r * 31 + i * 7) % 1001) as i32).collect()
}

fn total(counts: &[LaneCounts]) -> LaneCounts {
    counts.iter().fold(LaneCounts::default(), |a, c| LaneCounts {
        by_lane: a.by_lane + c.by_lane,
        plain: a.plain + c.plain,
    })
}

/// 1 MiB and more per transfer (one piece round, and several rounds of the four slots),
/// odd counts, 2 and 3 ranks, both progress modes: allreduce, broadcast, allgather and
/// all-to-all give the reference's values, and the transfers went by lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_by_lane_match_the_reference() {
    for (n, mode) in [(2, ProgressMode::Event), (3, ProgressMode::Event), (2, ProgressMode::BusyPoll)] {
        let (_mesh, comms) = group_over("posix,cma,self", n, mode).await;
        for count in [(1 << 19) + 3, (5 << 20) / 4 * n + 1] {
            let parts: Vec<Vec<i32>> = (0..n).map(|r| values(r, count)).collect();
            let want: Vec<i32> = (0..count).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
            let got = all(&comms, |r, c| async move {
                c.allreduce(values(r, count), ReduceOp::Sum).await.expect("allreduce")
            })
            .await;
            assert!(got.iter().all(|g| *g == want), "allreduce n {n} count {count}");
            let root = n - 1;
            let got = all(&comms, |r, c| async move {
                let b = if r == root { values(root, count) } else { vec![0; count] };
                c.broadcast(b, root).await.expect("broadcast")
            })
            .await;
            assert!(got.iter().all(|g| *g == values(root, count)), "broadcast n {n} count {count}");
            let got =
                all(&comms, |r, c| async move { c.allgather(values(r, count)).await.expect("allgather") })
                    .await;
            let want: Vec<i32> = (0..n).flat_map(|r| values(r, count)).collect();
            assert!(got.iter().all(|g| *g == want), "allgather n {n} count {count}");
            let per = count / n * n;
            let got =
                all(&comms, |r, c| async move { c.alltoall(values(r, per)).await.expect("alltoall") }).await;
            for (r, g) in got.iter().enumerate() {
                let b = per / n;
                let want: Vec<i32> =
                    (0..n).flat_map(|s| values(s, per)[r * b..(r + 1) * b].to_vec()).collect();
                assert!(*g == want, "alltoall n {n} count {per} rank {r}");
            }
        }
        let counts: Vec<LaneCounts> = comms.iter().map(Communicator::lane_counts).collect();
        assert!(total(&counts).by_lane > 0, "no transfer went by lane: {counts:?}");
    }
}

/// Calls started together share each lane: whichever finds it busy sends plain
/// messages, and every call ends with its own values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_calls_take_the_lane_in_turn() {
    let (_mesh, comms) = group("posix,cma,self", 2).await;
    let count = 1 << 19;
    let got = all(&comms, |r, c| async move {
        let calls: Vec<_> =
            (0..4).map(|k| c.allreduce(vec![(r * 10 + k) as i32; count], ReduceOp::Sum)).collect();
        join_all(calls).await.into_iter().map(|x| x.expect("allreduce")).collect::<Vec<_>>()
    })
    .await;
    for g in &got {
        for (k, res) in g.iter().enumerate() {
            assert!(res.len() == count && res.iter().all(|&v| v == (10 + 2 * k) as i32), "call {k}");
        }
    }
    let counts = total(&comms.iter().map(Communicator::lane_counts).collect::<Vec<_>>());
    assert!(counts.by_lane > 0 && counts.plain > 0, "{counts:?}");
}

/// Over TCP alone no endpoint reaches shared memory: large transfers go as plain
/// messages after their note, and land whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_shared_memory_transfers_go_plain() {
    let (_mesh, comms) = group("tcp,self", 2).await;
    let count = (1 << 19) + 5;
    let got =
        all(
            &comms,
            |r, c| async move { c.allreduce(values(r, count), ReduceOp::Sum).await.expect("allreduce") },
        )
        .await;
    let (a, b) = (values(0, count), values(1, count));
    let want: Vec<i32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert!(got.iter().all(|g| *g == want));
    let counts = total(&comms.iter().map(Communicator::lane_counts).collect::<Vec<_>>());
    assert_eq!(counts.by_lane, 0);
    assert!(counts.plain > 0);
}

/// A call keeps the host layout it started with: rank 0's allreduce is under way when
/// rank 0 learns that the ranks sit on two hosts, and rank 1 starts its part only then;
/// both still move every step by lane and end with the sum (a step that went by the
/// new layout on one rank only would send a plain message where a note is awaited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_keeps_the_host_layout_it_started_with() {
    let (_mesh, comms) = group("posix,cma,self", 2).await;
    let count = 1 << 19;
    let mut first = Box::pin(comms[0].allreduce(values(0, count), ReduceOp::Sum));
    let polled = tokio::time::timeout(Duration::from_millis(20), first.as_mut()).await;
    assert!(polled.is_err(), "rank 0 cannot finish before rank 1 starts");
    comms[0].set_hosts(&[0, 1]).expect("keys");
    let second = comms[1].allreduce(values(1, count), ReduceOp::Sum);
    let (a, b) = tokio::time::timeout(Duration::from_secs(30), futures_util::future::join(first, second))
        .await
        .expect("the call finished in time");
    let (a, b) = (a.expect("rank 0"), b.expect("rank 1"));
    let want: Vec<i32> = values(0, count).iter().zip(&values(1, count)).map(|(x, y)| x + y).collect();
    assert!(a == want && b == want);
    comms[1].set_hosts(&[0, 1]).expect("keys");
    assert_eq!(comms[0].lane_counts().by_lane, 2, "both of rank 0's steps went by lane");
}
