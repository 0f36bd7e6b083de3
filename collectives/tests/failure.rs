//! Failures reach every rank: a rank killed (SIGKILL) in the middle of allreduces ends
//! every survivor's pending collective with an error naming it within a bound, and the
//! survivors shrink to a communicator that works; a collective future dropped on one
//! rank, or a deadline passing on one rank, aborts the others' too; a rank that drops
//! its communicator fails the others' calls it did not make.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ucxkit_collectives::store::FileStore;
use ucxkit_collectives::{Communicator, Error, Options, ReduceOp};
use ucxkit_testkit as kit;

mod common;
use common::group;
use ucxkit_testkit::procs::{role, Group};

/// How long survivors may take to learn of a dead rank (same host: ucxkit's watch of
/// the peer process, then one abort message).
const BOUND: Duration = Duration::from_secs(5);
const LIMIT: Duration = Duration::from_secs(60);

/// Waits until `c` has heard of its communicator's abort, failing after [`BOUND`].
async fn hears_of_the_abort(c: &Communicator) {
    let t = Instant::now();
    while c.aborted().is_none() {
        assert!(t.elapsed() < BOUND, "rank {} never heard of the abort", c.rank());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_collective_aborts_every_rank_and_shrink_recovers() {
    let (_mesh, comms) = group(3).await;
    // Rank 0 starts an allreduce and drops it; ranks 1 and 2 wait in theirs.
    drop(comms[0].allreduce(vec![1u32; 100], ReduceOp::Sum));
    let waits = join_all(
        comms[1..].iter().map(|c| tokio::time::timeout(BOUND, c.allreduce(vec![1u32; 100], ReduceOp::Sum))),
    );
    for r in waits.await {
        let e = r.expect("ended within the bound").expect_err("aborted").error;
        assert!(matches!(&e, Error::Aborted(a) if a.by == 0 && a.reason.contains("dropped")), "{e}");
    }
    assert!(comms[0].aborted().is_some());
    let shrunk: Vec<Communicator> = join_all(comms.iter().map(|c| c.shrink(LIMIT)))
        .await
        .into_iter()
        .map(|c| c.expect("shrink"))
        .collect();
    assert!(shrunk
        .iter()
        .enumerate()
        .all(|(r, c)| c.size() == 3 && c.rank() == r && c.id() != comms[0].id()));
    let sums = join_all(shrunk.iter().map(|c| c.allreduce(vec![c.rank() as u32; 4], ReduceOp::Sum))).await;
    assert!(sums.into_iter().all(|s| s.expect("allreduce") == vec![3; 4]));
    // The survivors agreed on the new communicator's token: a departure from it counts
    // (its barrier and the allreduce were rank 0's calls).
    let mut shrunk = shrunk;
    drop(shrunk.remove(0));
    for r in join_all(shrunk.iter().map(|c| tokio::time::timeout(BOUND, c.barrier()))).await {
        let e = r.expect("ended within the bound").expect_err("rank 0 left");
        assert!(left_after(&e, "2 collective calls"), "{e}");
    }
}

/// Communicators of `base`'s ranks formed by ucxkit (`dup`).
async fn dups(base: &[Communicator]) -> Vec<Communicator> {
    join_all(base.iter().map(|c| c.dup())).await.into_iter().map(|c| c.expect("dup")).collect()
}

/// Whether `e` is the abort of a call beyond the `made` calls of rank 0, which left.
fn left_after(e: &Error, made: &str) -> bool {
    let said = format!("rank 0 dropped its communicator: it made {made},");
    matches!(e, Error::Aborted(a) if a.failed == Some(0) && a.reason.contains(&said))
}

/// A rank that drops its communicator tells the others how many collective calls it
/// made: a later call waiting on another rank ends when the notice comes, one made after
/// it fails, both naming the rank; the calls it made too go on, so ranks that end the
/// same calls and drop their communicators at different times see no error. A
/// communicator made with an id of the caller's (`from_endpoints`) tells nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_drops_its_communicator_fails_the_others_later_calls() {
    let (_mesh, base) = group(3).await;
    let mut comms = dups(&base).await;
    let sums = join_all(comms.iter().map(|c| c.allreduce(vec![1u32; 4], ReduceOp::Sum))).await;
    assert!(sums.into_iter().all(|s| s.expect("allreduce") == vec![3; 4]));
    // Rank 1 makes its second call before rank 0 leaves (the call is numbered when it is
    // made), and waits in it.
    let waiting = tokio::spawn(comms[1].barrier());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "rank 1 cannot finish alone");
    drop(comms.remove(0));
    let e = tokio::time::timeout(BOUND, waiting).await.expect("ended within the bound").expect("task");
    let e = e.expect_err("rank 0 left");
    assert!(left_after(&e, "1 collective call"), "{e}");
    // Rank 2 heard of it (from rank 0, and from rank 1's abort): its next call fails.
    let e = tokio::time::timeout(BOUND, comms[1].allreduce(vec![1u32], ReduceOp::Sum))
        .await
        .expect("ended within the bound")
        .expect_err("rank 0 left")
        .error;
    assert!(left_after(&e, "1 collective call"), "{e}");

    // Rank 0, the root, ends its broadcast at once and leaves before the others take
    // theirs: that call was its too, so they get its data, and nothing is aborted.
    let (_mesh, base) = group(3).await;
    let mut comms = dups(&base).await;
    let root = comms.remove(0);
    assert_eq!(root.broadcast(vec![9u32; 4], 0).await.expect("root"), vec![9; 4]);
    drop(root);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for c in &comms {
        assert_eq!(c.broadcast(vec![0u32; 4], 0).await.expect("rank 0 made this call"), vec![9; 4]);
        assert!(c.aborted().is_none());
    }
    // Their next collective is one rank 0 never made.
    let late = join_all(comms.iter().map(|c| tokio::time::timeout(BOUND, c.barrier()))).await;
    for e in late {
        let e = e.expect("ended within the bound").expect_err("rank 0 left");
        assert!(left_after(&e, "1 collective call"), "{e}");
    }

    // Rank 0 drops a communicator of the test's id, then a formed one. Notices travel
    // the same endpoint in order: once rank 1 heard of the second, it would have heard
    // of the first; but its communicator of the test's id neither sends nor hears one,
    // and its call there still waits.
    let (_mesh, mut base) = group(2).await;
    let mut formed = dups(&base).await;
    drop(base.remove(0));
    drop(formed.remove(0));
    let e = tokio::time::timeout(BOUND, formed[0].barrier())
        .await
        .expect("ended within the bound")
        .expect_err("rank 0 left");
    assert!(left_after(&e, "0 collective calls"), "{e}");
    let waited = tokio::time::timeout(Duration::from_millis(200), base[0].barrier()).await;
    assert!(waited.is_err(), "{waited:?}");
}

/// Polls `call` for a moment, checks that it is still waiting (`why` it must be), and
/// drops it there.
async fn dropped_waiting<F: std::future::Future>(call: F, why: &str) {
    let mut call = Box::pin(call);
    let polled = tokio::time::timeout(Duration::from_millis(20), call.as_mut()).await;
    assert!(polled.is_err(), "{why}");
}

/// Drops the communicators, then waits (at most [`BOUND`]) until no operation of theirs
/// is left with the transport on any worker: what a peer sent that no call took was
/// received and thrown away, which ended its send.
async fn ends_clean(mesh: &kit::workers::Mesh, comms: Vec<Communicator>) {
    drop(comms);
    for w in &mesh.workers {
        kit::workers::wait_parked_zero(w, BOUND).await;
    }
}

/// A message of an aborted communicator that arrives after its drop (sent by a peer that
/// had not heard of the abort) is taken and thrown away, so the peer's send ends. The
/// id stays held meanwhile, so no new communicator on that worker takes it until
/// `LATE_GRACE` has passed, but the namespace is free at once (a group can form again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_communicators_late_messages_end_their_sends() {
    use ucxkit_collectives::late::LATE_GRACE;
    use ucxkit_collectives::tag::tag;
    use ucxkit_transport::namespace::COLLECTIVES;
    let mesh = kit::workers::mesh_with("tcp,posix,cma,self", 2, Default::default()).await;
    let claim = |r: usize| mesh.workers[r].namespace(COLLECTIVES).expect("namespace");
    let made = |ns: &ucxkit_transport::Namespace, r: usize| {
        Communicator::from_endpoints(ns, 3, r, mesh.eps[r].clone())
    };
    let (ns0, ns1) = (claim(0), claim(1));
    let first = made(&ns0, 0).expect("rank 0");
    let second = made(&ns1, 1).expect("rank 1");
    second.abort("the test gives up");
    let dropped = Instant::now();
    drop((second, ns1));
    // The namespace is given back at once; the id is held.
    let ns1 = claim(1);
    let refused =
        made(&ns1, 1).map(|c| c.id()).expect_err("the id was given back while late messages may come");
    assert!(refused.to_string().contains("taken"), "{refused}");
    // Sent as the collective of a peer that had not heard yet: rendezvous (1 MiB) and
    // eager, with the communicator's tags.
    let ep = mesh.eps[0][1].as_ref().expect("endpoint");
    let big = ns0.tag_send(ep, tag(3, 7, 0, 0), vec![7u8; 1 << 20]);
    let small = ns0.tag_send(ep, tag(3, 7, 1, 0), vec![8u8; 8]);
    let (big, small) = tokio::time::timeout(BOUND, futures_util::future::join(big, small))
        .await
        .expect("the late messages' sends ended");
    big.0.expect("the rendezvous send");
    small.0.expect("the eager send");
    // Given back once the grace has passed, not before.
    let again = loop {
        if let Ok(c) = made(&ns1, 1) {
            break c;
        }
        assert!(dropped.elapsed() < LATE_GRACE + BOUND, "the id was never given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(dropped.elapsed() >= LATE_GRACE, "given back after {:?}", dropped.elapsed());
    drop((again, ns1, ns0));
    ends_clean(&mesh, vec![first]).await;
}

/// A collective whose future is dropped while its transfers are in flight leaves their
/// buffers with the transport: the peer still reads what rank 0 had posted to send and
/// sends into what it had posted to receive, and that memory stays allocated until UCX
/// lets go (the test command runs this under valgrind, which reports any access to freed
/// memory). The peer ends with the abort the drop sent. Once the communicators are
/// dropped, no operation is left on either worker, also where the peer heard of the abort
/// before it called and never took rank 0's send. Then the same with an eager mid-size
/// send (64 KiB), with transfers through shared-memory lanes (2 MiB), and with small
/// calls (8 bytes, whose receives wait in landing vectors of their own): on two ranks
/// (one step, run without the step loop), a broadcast's leaf on two (its receive lands
/// in the caller's vector; also one never polled, its receive posted when the call was
/// made), an allgather on two (its receive lands in a block of the call's vector) and on
/// three (the step loop); and a root dropped while it waits for its leaf's ready word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collective_dropped_mid_transfer_leaves_its_buffers_to_the_transport() {
    let (mesh, comms) = group(2).await;
    // 1 MiB of f32: rendezvous transfers into tracked buffers, piecewise combines.
    let n = 1 << 18;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; n], ReduceOp::Sum),
        "rank 0 cannot finish before rank 1 starts",
    )
    .await;
    let late = tokio::time::timeout(BOUND, comms[1].allreduce(vec![2f32; n], ReduceOp::Sum));
    let e = late.await.expect("ended within the bound").expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    assert!(comms[0].aborted().is_some());
    ends_clean(&mesh, comms).await;

    // The same, with rank 1 hearing of the abort before it calls: its call fails at once
    // and never takes rank 0's send, which waits in rank 1's queue until the drop.
    let (mesh, comms) = group(2).await;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; n], ReduceOp::Sum),
        "rank 0 cannot finish before rank 1 starts",
    )
    .await;
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].allreduce(vec![2f32; n], ReduceOp::Sum).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;

    // 64 KiB: its send goes eagerly (a mid-size message over shared memory) and is done
    // once copied; its receive into the call's tracked scratch waits when the call is
    // dropped. (Rank 1 hears of the abort first: its own eager send needs nobody, so a
    // call made before the abort reached it could end well.)
    let (mesh, comms) = group(2).await;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; 1 << 14], ReduceOp::Sum),
        "rank 0 cannot finish before rank 1 starts",
    )
    .await;
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].allreduce(vec![2f32; 1 << 14], ReduceOp::Sum).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;

    // 2 MiB: transfers of 1 MiB through shared-memory lanes. Rank 0 stages its first
    // pieces and sends their notes, then is dropped while it waits for rank 1's: the lane
    // is left unused, its region stays with the communicator, and the notes wait in rank
    // 1's queue while rank 1's call fails on the abort.
    let (mesh, comms) = group(2).await;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; 1 << 19], ReduceOp::Sum),
        "rank 0 cannot finish before rank 1 starts",
    )
    .await;
    assert_eq!(comms[0].lane_counts().by_lane, 1, "the dropped call's send went by lane");
    let late = tokio::time::timeout(BOUND, comms[1].allreduce(vec![2f32; 1 << 19], ReduceOp::Sum));
    let e = late.await.expect("ended within the bound").expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;

    // 8 bytes: a small call (its receive posted into a landing vector of its own, its send
    // made during the call), dropped while the receive waits. Rank 1 hears of the abort
    // before it calls, so its call fails at once; the dropped receive is canceled by the
    // transport, which keeps the vector until UCX lets go.
    let (mesh, comms) = group(2).await;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; 2], ReduceOp::Sum),
        "rank 0 cannot finish before rank 1 starts",
    )
    .await;
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].allreduce(vec![2f32; 2], ReduceOp::Sum).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;

    // A broadcast's leaf: its receive lands in the caller's vector, which the transport
    // keeps when the call is dropped.
    let (mesh, comms) = group(2).await;
    dropped_waiting(comms[1].broadcast(vec![0u32; 2], 0), "the leaf cannot finish before the root sends")
        .await;
    hears_of_the_abort(&comms[0]).await;
    let e = comms[0].broadcast(vec![5u32; 2], 0).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 1), "{e}");
    ends_clean(&mesh, comms).await;

    // A broadcast's leaf dropped before it is ever polled: its receive was posted, into
    // the caller's vector, when the call was made.
    let (mesh, comms) = group(2).await;
    drop(comms[1].broadcast(vec![0u32; 2], 0));
    hears_of_the_abort(&comms[0]).await;
    let e = comms[0].broadcast(vec![5u32; 2], 0).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 1), "{e}");
    ends_clean(&mesh, comms).await;

    // An allgather on two ranks whose receive lands in its block of the call's vector,
    // beside this rank's own, dropped while it waits.
    let (mesh, comms) = group(2).await;
    dropped_waiting(comms[0].allgather(vec![1u32; 2]), "rank 0 cannot finish before rank 1 starts").await;
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].allgather(vec![2u32; 2]).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;

    // 8 bytes on three ranks: several steps, so the step loop's receive is what waits.
    let (mesh, comms) = group(3).await;
    dropped_waiting(
        comms[0].allreduce(vec![1f32; 2], ReduceOp::Sum),
        "rank 0 cannot finish before the others start",
    )
    .await;
    for c in &comms[1..] {
        hears_of_the_abort(c).await;
    }
    let late = join_all(comms[1..].iter().map(|c| c.allreduce(vec![2f32; 2], ReduceOp::Sum))).await;
    for r in late {
        let e = r.expect_err("aborted").error;
        assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    }
    ends_clean(&mesh, comms).await;

    // A broadcast root's 256th call waits for its leaf's ready word (the leaf has not
    // come to it) before it sends: dropped there, its receive of the word is canceled
    // and the leaf hears of the abort.
    let (mesh, comms) = group(2).await;
    for i in 0..255u32 {
        let calls = comms.iter().map(|c| c.broadcast(vec![i; 2], 0));
        for r in join_all(calls).await {
            assert_eq!(r.expect("broadcast"), vec![i; 2]);
        }
    }
    dropped_waiting(comms[0].broadcast(vec![7u32; 2], 0), "the root waits for its leaf's word").await;
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].broadcast(vec![0u32; 2], 0).await.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 0), "{e}");
    ends_clean(&mesh, comms).await;
}

/// A 2-rank small call (one step, run without the step loop) that waits ends when the
/// other rank aborts, woken by the abort alone, and at its own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_two_rank_small_call_ends_on_abort_and_deadline() {
    let (_mesh, comms) = group(2).await;
    let waiting = tokio::spawn({
        let c = comms[0].clone();
        async move { c.allreduce(vec![7u32; 2], ReduceOp::Sum).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "rank 0 cannot finish alone");
    comms[1].abort("rank 1 gives up");
    let e = tokio::time::timeout(BOUND, waiting).await.expect("woken within the bound").expect("task");
    let e = e.expect_err("aborted").error;
    assert!(matches!(&e, Error::Aborted(a) if a.by == 1 && a.reason == "rank 1 gives up"), "{e}");

    let (_mesh, comms) = group(2).await;
    let timed =
        comms[0].with_options(Options { deadline: Some(Duration::from_millis(200)), ..Default::default() });
    let t = Instant::now();
    let f = timed.broadcast(vec![1u8; 4], 1).await.expect_err("rank 1 never came");
    assert!(t.elapsed() < BOUND, "{:?}", t.elapsed());
    let e = f.error;
    assert!(matches!(&e, Error::DeadlineExceeded { waiting_on, .. } if waiting_on == &[1]), "{e}");
    assert!(e.to_string().ends_with("still waiting on rank 1"), "{e}");
    // A leaf's receive lands straight in its buffer, which the given-up receive keeps
    // until UCX lets go of it.
    assert!(f.buf.is_none(), "{:?}", f.buf);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_on_one_rank_aborts_the_others() {
    let (_mesh, comms) = group(2).await;
    let timed =
        comms[0].with_options(Options { deadline: Some(Duration::from_millis(200)), ..Default::default() });
    let e = timed.barrier().await.expect_err("rank 1 never came");
    assert!(matches!(&e, Error::DeadlineExceeded { waiting_on, .. } if waiting_on == &[1]), "{e}");
    // Rank 1 hears of it without calling anything (its worker takes the abort message),
    // and its next call fails at once.
    hears_of_the_abort(&comms[1]).await;
    let e = comms[1].allreduce(vec![1u8], ReduceOp::Sum).await.expect_err("aborted").error;
    // The abort's reason names the rank rank 0 waited on, which it does not count as
    // failed (it may only be slow, or waiting on another).
    assert!(
        matches!(&e, Error::Aborted(a) if a.by == 0 && a.failed.is_none() && a.reason.ends_with("still waiting on rank 1")),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_a_killed_rank_error_within_the_bound_and_shrink() {
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-kill-{}", std::process::id()));
    let store = dir.to_string_lossy().into_owned();
    let (group, me) = Group::spawn("killed_rank_member", 4, &[("STORE_DIR", store.as_str())]);
    member(me.rank, 4, &store).await;
    // Every survivor passed its checks; rank 3 is the one that was killed.
    assert_eq!(group.wait(LIMIT).await, Err("rank 3: signal: 9 (SIGKILL)".to_string()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of survivors_of_a_killed_rank_error_within_the_bound_and_shrink"]
async fn killed_rank_member() {
    let Some(me) = role() else { return };
    member(me.rank, me.size, &std::env::var("STORE_DIR").expect("store")).await;
}

/// One rank of the kill test: rank 3 kills itself after 50 allreduces; the others loop
/// until theirs fails, check the error and its timing, then shrink and allreduce again.
async fn member(rank: usize, size: usize, dir: &str) {
    let store = FileStore::new(dir).expect("store");
    let worker = kit::ctx("posix,cma,tcp,self").worker().build().expect("worker");
    let c = Communicator::bootstrap(&worker, rank, size, &store, LIMIT).await.expect("bootstrap");
    let died = std::path::Path::new(dir).join("died");
    let mut i = 0u64;
    let err = loop {
        if rank == 3 && i == 50 {
            std::fs::write(&died, b"").expect("marking the time");
            let _ =
                std::process::Command::new("kill").args(["-KILL", &std::process::id().to_string()]).status();
            unreachable!("killed");
        }
        match c.allreduce(vec![1u64; 4096], ReduceOp::Sum).await {
            Ok(v) => assert_eq!(v[0], size as u64),
            Err(f) => break f.error,
        }
        i += 1;
        assert!(i < 1_000_000, "rank 3 never died");
    };
    let since = std::fs::metadata(&died).and_then(|m| m.modified()).expect("rank 3 marked its death");
    let took = std::time::SystemTime::now().duration_since(since).unwrap_or_default();
    eprintln!("rank {rank} learned of rank 3's death after {took:?}: {err}");
    assert!(took < BOUND, "rank {rank} learned of the failure after {took:?}");
    assert_eq!(err.rank(), Some(3), "rank {rank}: {err}");
    let s = c.shrink(LIMIT).await.expect("shrink");
    assert_eq!((s.size(), s.rank()), (3, rank));
    let v = s.allreduce(vec![rank as u64; 8], ReduceOp::Sum).await.expect("allreduce of the survivors");
    assert_eq!(v, vec![3; 8]);
}
