//! Forming groups: through a TCP store and a file store in one process, with a rank
//! missing (named in the error), in real processes with torchrun-style variables, under
//! `mpirun`, and splitting and duplicating communicators.

use std::time::Duration;

use futures_util::future::join_all;
use ucxkit_collectives::store::env::detect_from;
use ucxkit_collectives::store::{FileStore, Store, TcpStore, TcpStoreServer};
use ucxkit_collectives::{
    Communicator, Error, InitOptions, LaneCounts, ReduceOp, CROWDED_SPIN, CROWDED_YIELD,
};
use ucxkit_testkit as common;
use ucxkit_testkit::procs::{role, Group};
use ucxkit_transport::{ProgressMode, DEFAULT_BUSY_SPIN};

const TLS: &str = "posix,cma,self";
/// Transports of ranks in processes of their own.
const TLS_NET: &str = "posix,cma,tcp,self";
const LIMIT: Duration = Duration::from_secs(60);

/// Forms `size` ranks in this process (workers of one context) through `store(rank)`;
/// only the ranks in `present` come.
async fn form<S: Store>(
    size: usize,
    present: &[usize],
    store: impl Fn(usize) -> S,
    deadline: Duration,
) -> Vec<Result<Communicator, Error>> {
    let ctx = common::ctx(TLS);
    let workers: Vec<_> = present.iter().map(|_| ctx.worker().build().expect("worker")).collect();
    let stores: Vec<S> = present.iter().map(|&r| store(r)).collect();
    join_all(
        present
            .iter()
            .zip(&workers)
            .zip(&stores)
            .map(|((&r, w), s)| Communicator::bootstrap(w, r, size, s, deadline)),
    )
    .await
}

async fn sums_to(comms: &[Communicator]) -> Vec<Vec<i32>> {
    let calls = comms.iter().map(|c| c.allreduce(vec![c.rank() as i32 + 1; 5], ReduceOp::Sum));
    join_all(calls).await.into_iter().map(|r| r.expect("allreduce")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_meet_through_a_tcp_store_and_split() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.expect("store");
    let at = server.local_addr().to_string();
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(TcpStore::connect(&at, LIMIT).await.expect("connect"));
    }
    let ctx = common::ctx(TLS);
    let workers: Vec<_> = (0..4).map(|_| ctx.worker().build().expect("worker")).collect();
    let comms: Vec<Communicator> =
        join_all((0..4).map(|r| Communicator::bootstrap(&workers[r], r, 4, &clients[r], LIMIT)))
            .await
            .into_iter()
            .map(|c| c.expect("bootstrap"))
            .collect();
    assert!(sums_to(&comms).await.iter().all(|s| *s == vec![10; 5]));

    // Even and odd ranks, ordered backwards by key; rank 3 takes no part in a colour.
    let halves: Vec<Option<Communicator>> = join_all(comms.iter().map(|c| {
        let color = (c.rank() != 3).then_some((c.rank() % 2) as u32);
        c.split(color, -(c.rank() as i64))
    }))
    .await
    .into_iter()
    .map(|c| c.expect("split"))
    .collect();
    assert!(halves[3].is_none());
    let halves: Vec<Communicator> = halves.into_iter().flatten().collect();
    assert_eq!(halves.iter().map(|c| (c.size(), c.rank())).collect::<Vec<_>>(), vec![(2, 1), (1, 0), (2, 0)]);
    assert_ne!(halves[0].id(), comms[0].id());
    // The sub-communicators and the world run at once without crossing.
    let (world, sub) = tokio::join!(sums_to(&comms), sums_to(&halves));
    assert!(world.iter().all(|s| *s == vec![10; 5]));
    // Each adds its rank in the sub-communicator plus one.
    assert_eq!(sub, vec![vec![3; 5], vec![1; 5], vec![3; 5]]);

    let dups: Vec<Communicator> =
        join_all(comms.iter().map(|c| c.dup())).await.into_iter().map(|c| c.expect("dup")).collect();
    assert!(dups
        .iter()
        .zip(&comms)
        .all(|(d, c)| d.rank() == c.rank() && d.id() != c.id() && d.id() != halves[0].id()));
    assert!(sums_to(&dups).await.iter().all(|s| *s == vec![10; 5]));

    // An id given back cools: the next communicators take other ids while there are.
    let gone = dups[0].id();
    drop(dups);
    let again: Vec<Communicator> =
        join_all(comms.iter().map(|c| c.dup())).await.into_iter().map(|c| c.expect("dup")).collect();
    assert!(again.iter().all(|d| d.id() != gone), "id {gone} was taken again at once");
    assert!(sums_to(&again).await.iter().all(|s| *s == vec![10; 5]));
}

/// Ranks meet through a file store; the group they form agreed on a token, so when
/// rank 0 drops its communicator the others' next call fails, naming it (see
/// `collectives::leave`), rather than waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_meet_through_a_file_store() {
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-file-{}", std::process::id()));
    let mut comms: Vec<Communicator> = form(3, &[0, 1, 2], |_| FileStore::new(&dir).expect("dir"), LIMIT)
        .await
        .into_iter()
        .map(|c| c.expect("bootstrap"))
        .collect();
    assert!(sums_to(&comms).await.iter().all(|s| *s == vec![6; 5]));
    std::fs::remove_dir_all(&dir).expect("clean up");
    // Its barrier and the allreduce.
    drop(comms.remove(0));
    for r in join_all(comms.iter().map(|c| tokio::time::timeout(Duration::from_secs(5), c.barrier()))).await {
        let e = r.expect("ended within 5 s").expect_err("rank 0 left");
        assert!(e.to_string().contains("rank 0 dropped its communicator: it made 2 collective calls"), "{e}");
    }
}

/// Splits of two communicators over the same workers, running at once, both succeed
/// with ids of their own (they used to pick the same id, and the rank that lost the
/// claim failed alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_splits_on_shared_workers_agree() {
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-splits-{}", std::process::id()));
    let a: Vec<Communicator> = form(2, &[0, 1], |_| FileStore::new(&dir).expect("dir"), LIMIT)
        .await
        .into_iter()
        .map(|c| c.expect("bootstrap"))
        .collect();
    let b: Vec<Communicator> =
        join_all(a.iter().map(|c| c.dup())).await.into_iter().map(|c| c.expect("dup")).collect();
    for _ in 0..5 {
        let both = join_all(a.iter().zip(&b).map(|(x, y)| async move {
            let (p, q) = tokio::join!(x.dup(), y.dup());
            (p.expect("split of a"), q.expect("split of b"))
        }))
        .await;
        let (pa, pb): (Vec<Communicator>, Vec<Communicator>) = both.into_iter().unzip();
        assert!(pa[0].id() == pa[1].id() && pb[0].id() == pb[1].id() && pa[0].id() != pb[0].id());
        let (x, y) = tokio::join!(sums_to(&pa), sums_to(&pb));
        assert_eq!((x, y), (vec![vec![3; 5]; 2], vec![vec![3; 5]; 2]));
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// Groups formed again on the same workers, after the last one ended, take ids the
/// workers did not give back recently (messages the old group left behind match
/// nothing of the new one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_formed_again_on_a_worker_take_fresh_ids() {
    let base = std::env::temp_dir().join(format!("ucxkit-coll-again-{}", std::process::id()));
    let ctx = common::ctx(TLS);
    let workers: Vec<_> = (0..2).map(|_| ctx.worker().build().expect("worker")).collect();
    let formed = |round: usize| {
        let dir = base.join(round.to_string());
        let workers = &workers;
        async move {
            let store = FileStore::new(&dir).expect("dir");
            let comms = join_all(
                workers.iter().enumerate().map(|(r, w)| Communicator::bootstrap(w, r, 2, &store, LIMIT)),
            );
            let comms: Vec<Communicator> = comms.await.into_iter().map(|c| c.expect("bootstrap")).collect();
            assert_eq!(comms[0].id(), comms[1].id());
            comms
        }
    };
    let mut seen = Vec::new();
    for round in 0..3 {
        let comms = formed(round).await;
        assert!(!seen.contains(&comms[0].id()), "id {} came back at once ({seen:?})", comms[0].id());
        seen.push(comms[0].id());
        assert!(sums_to(&comms).await.iter().all(|s| *s == vec![3; 5]));
    }
    std::fs::remove_dir_all(&base).expect("clean up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_comes_is_named() {
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-missing-{}", std::process::id()));
    let t = std::time::Instant::now();
    let got = form(4, &[0, 2], |_| FileStore::new(&dir).expect("dir"), Duration::from_millis(500)).await;
    assert!(t.elapsed() < Duration::from_secs(10));
    for r in got {
        let e = r.expect_err("two ranks are missing");
        assert!(e.to_string().contains("ranks 1, 3 never came"), "{e}");
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// A group larger than the tag layout numbers is refused at once, before the store is
/// used (its ranks' messages would otherwise share tags).
#[tokio::test]
async fn a_group_too_large_for_the_tags_is_refused() {
    let size = ucxkit_collectives::tag::MAX_RANKS + 1;
    let t = std::time::Instant::now();
    let got = form(size, &[0], |_| Broken, LIMIT).await;
    let e = got.into_iter().next().expect("one rank").expect_err("too many ranks");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("more than the"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A store that takes writes and then stops answering.
struct Broken;

impl Store for Broken {
    fn set<'a>(&'a self, _: &'a str, _: &'a [u8]) -> ucxkit_collectives::store::StoreFuture<'a, ()> {
        Box::pin(async { Ok(()) })
    }
    fn get<'a>(&'a self, _: &'a str) -> ucxkit_collectives::store::StoreFuture<'a, Option<Vec<u8>>> {
        Box::pin(async { Err(Error::Bootstrap("the store's connection broke".into())) })
    }
    fn wait<'a>(
        &'a self,
        _: &'a [String],
        _: Duration,
    ) -> ucxkit_collectives::store::StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async { Err(Error::Bootstrap("the store's connection broke".into())) })
    }
    fn add<'a>(&'a self, _: &'a str, _: i64) -> ucxkit_collectives::store::StoreFuture<'a, i64> {
        Box::pin(async { Err(Error::Bootstrap("the store's connection broke".into())) })
    }
}

/// A store that fails is reported as such, not as ranks that never came.
#[tokio::test]
async fn a_failing_store_is_not_taken_for_missing_ranks() {
    let got = form(2, &[0], |_| Broken, Duration::from_millis(200)).await;
    let e = got.into_iter().next().expect("one rank").expect_err("the store fails");
    assert!(e.to_string().contains("connection broke") && !e.to_string().contains("never came"), "{e}");
}

/// Busy-polling ranks formed by `init_with` yield the processor sooner when their host
/// runs more of them than it has processors: three ranks here, crowded on a host of two
/// processors (as this one and CI's), not on one of three or more. Crowded, their large
/// transfers go as plain messages, not offered a shared-memory lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_ranks_crowding_their_host_yield_sooner() {
    let store = format!("127.0.0.1:{}", free_port());
    let opts =
        InitOptions { progress: ProgressMode::BusyPoll, transports: Some(TLS.into()), ..Default::default() };
    let comms: Vec<Communicator> =
        join_all((0..3).map(|r| Communicator::init_with(r, 3, &store, opts.clone())))
            .await
            .into_iter()
            .map(|c| c.expect("formed"))
            .collect();
    let cpus = ucxkit_collectives::hosts::host_cpus();
    let want = if cpus < 3 { (CROWDED_SPIN, CROWDED_YIELD) } else { (DEFAULT_BUSY_SPIN, Duration::ZERO) };
    for c in &comms {
        let peer = (c.rank() + 1) % 3;
        let w = c.endpoint(peer).expect("endpoint").worker();
        assert_eq!((w.busy_spin(), w.busy_yield()), want, "{cpus} processors");
    }
    assert_eq!(sums_to(&comms).await, vec![vec![6; 5]; 3]);
    // Transfers of 1 MiB and more (a lane's least) between the ranks.
    let count = 3 << 18;
    let calls = comms.iter().map(|c| c.allgather(vec![c.rank() as u32; count]));
    for got in join_all(calls).await {
        let want: Vec<u32> = (0..3).flat_map(|r| vec![r; count]).collect();
        assert!(got.expect("allgather") == want, "allgather's values");
    }
    for c in &comms {
        let LaneCounts { by_lane, plain } = c.lane_counts();
        match cpus < 3 {
            // Not even offered a lane (no note before the data).
            true => assert_eq!((by_lane, plain), (0, 0), "rank {}", c.rank()),
            false => assert!(by_lane + plain > 0, "rank {}", c.rank()),
        }
    }
}

/// A free TCP port on the loopback, out of the ephemeral range.
fn free_port() -> u16 {
    ucxkit_testkit::ports::free_port().expect("a free port")
}

/// One rank formed from launcher variables (`vars`, or this process's environment
/// when None): allreduce, split, broadcast, and a barrier.
async fn env_rank(vars: Option<&[(&str, String)]>) {
    let form = async {
        match vars {
            None => Communicator::from_env().await,
            Some(vars) => {
                let l = detect_from(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
                    .expect("variables");
                let opts = InitOptions { transports: Some(TLS_NET.into()), ..Default::default() };
                Communicator::from_launch(&l, opts).await
            }
        }
    };
    let c = tokio::time::timeout(LIMIT, form).await.expect("in time").expect("formed");
    let (r, n) = (c.rank(), c.size());
    let sum = c.allreduce(vec![r as u64 + 1; 1000], ReduceOp::Sum).await.expect("allreduce");
    assert_eq!(sum, vec![(n * (n + 1) / 2) as u64; 1000]);
    let half = c.split(Some((r % 2) as u32), r as i64).await.expect("split").expect("a colour");
    let b = half.broadcast(vec![r as u8; 3], 0).await.expect("broadcast");
    assert_eq!(b, vec![(r % 2) as u8; 3]);
    c.barrier().await.expect("barrier");
}

/// The variables torchrun sets for rank `r` of 4.
fn torchrun(r: usize, port: &str) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", r.to_string()),
        ("WORLD_SIZE", "4".into()),
        ("LOCAL_RANK", r.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.into()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_meet_with_torchrun_variables() {
    let port = free_port().to_string();
    let env = [
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
        ("UCX_TLS", "posix,cma,tcp,self"),
    ];
    let (group, _me) = Group::spawn("torchrun_rank", 4, &env);
    // Rank 0 is this process.
    for (k, v) in env.iter().chain(&[("RANK", "0")]) {
        std::env::set_var(k, v);
    }
    env_rank(None).await;
    group.wait(LIMIT).await.expect("every rank finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of processes_meet_with_torchrun_variables"]
async fn torchrun_rank() {
    let Some(me) = role() else { return };
    let port = std::env::var("MASTER_PORT").expect("the parent's port");
    env_rank(Some(&torchrun(me.rank, &port))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_meet_under_mpirun() {
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-mpirun-{}", std::process::id()));
    let exe = std::env::current_exe().expect("test binary");
    let store = format!("UCXKIT_STORE=file:{}", dir.display());
    let run = tokio::process::Command::new("mpirun")
        .args(["-np", "4", "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,vader"])
        .args(["-x", &store, "-x", &format!("UCX_TLS={TLS_NET}")])
        .arg(exe)
        .args(["--exact", "mpirun_rank", "--ignored", "--nocapture", "--test-threads=1"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("mpirun finished in time")
        .expect("mpirun runs (apt-get install openmpi-bin)");
    let done: Vec<bool> = (0..4).map(|r| dir.join(format!("done-{r}")).exists()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "mpirun: {}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert_eq!(done, [true; 4], "every rank finished its part\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of processes_meet_under_mpirun"]
async fn mpirun_rank() {
    let Ok(rank) = std::env::var("OMPI_COMM_WORLD_RANK") else { return };
    env_rank(None).await;
    let dir = std::env::var("UCXKIT_STORE").expect("the store");
    std::fs::write(format!("{}/done-{rank}", dir.trim_start_matches("file:")), b"").expect("marking done");
}
