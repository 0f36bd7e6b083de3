//! Ranks on two hosts: two network namespaces joined by a veth pair (made and removed by
//! the test), two rank processes in each, meeting through rank 0's TCP store. The group
//! finds its two hosts by itself, runs the two-level forms (forced) and what the model
//! picks against references, and says what it picked.

use std::time::Duration;

use ucxkit_collectives::{Algorithm, Communicator, InitOptions, Op, Options, ReduceOp};
use ucxkit_testkit::netns::{self, Proc, TwoHosts};

/// Ranks per host.
const PER_HOST: usize = 2;
/// Inside the namespaces each rank is in a PID namespace of its own, where UCX's cma
/// cannot name its peers' processes: shared memory through posix files, TCP between
/// hosts.
const TLS: &str = "posix,tcp,self";

#[test]
fn two_hosts_of_two_ranks_run_two_level_collectives() {
    if let Err(e) = netns::available() {
        eprintln!("two-level: skipped, network namespaces are not available here ({e})");
        return;
    }
    let hosts = TwoHosts::new().expect("making the two hosts");
    // A fresh namespace listens on nothing: any port is free there.
    let store = format!("{}:{}", hosts.addr_a, 20_000 + std::process::id() % 20_000);
    let mut ranks: Vec<Proc> = (0..2 * PER_HOST)
        .map(|r| {
            let ns = if r < PER_HOST { &hosts.a } else { &hosts.b };
            let env = [
                ("UCXKIT_TEST_RANK", r.to_string()),
                ("UCXKIT_TEST_STORE", store.clone()),
                ("UCX_POSIX_USE_PROC_LINK", "n".to_string()),
                ("UCX_WARN_UNUSED_ENV_VARS", "n".to_string()),
            ];
            Proc::child_test(ns, "two_level_rank", &env)
        })
        .collect();
    let mut failed = Vec::new();
    for (r, p) in ranks.iter_mut().enumerate() {
        match p.finish(Duration::from_secs(120)) {
            Ok(()) if p.seen.iter().any(|l| l.contains("TWO-LEVEL-OK")) => {}
            Ok(()) => failed.push(format!("rank {r} skipped its part:\n{}", p.seen.join("\n"))),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    for l in ranks[0].seen.iter().filter(|l| l.contains("PLAN")) {
        eprintln!("two-level rank 0: {}", &l[l.find("PLAN").unwrap_or(0)..]);
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of two_hosts_of_two_ranks_run_two_level_collectives"]
async fn two_level_rank() {
    let Ok(rank) = std::env::var("UCXKIT_TEST_RANK") else { return };
    let rank: usize = rank.parse().expect("rank");
    let store = std::env::var("UCXKIT_TEST_STORE").expect("store");
    let n = 2 * PER_HOST;
    let opts = InitOptions { transports: Some(TLS.into()), ..Default::default() };
    let comm = Communicator::init_with(rank, n, &store, opts).await.expect("the group forms");
    let hosts = comm.hosts();
    assert_eq!(hosts.count(), 2, "the group sees two hosts");
    assert_eq!(hosts.members(hosts.of(rank)).len(), PER_HOST);
    let forced = comm.with_options(Options {
        algorithm: [Op::Allreduce, Op::Broadcast, Op::Allgather].map(|op| (op, Algorithm::TwoLevel)).to_vec(),
        ..Default::default()
    });
    for c in [&forced, &comm] {
        for count in [1usize, 1000, 300_001] {
            let mine: Vec<f32> = (0..count).map(|i| (rank * 3 + i % 7) as f32).collect();
            let want: Vec<f32> = (0..count).map(|i| (0..n).map(|r| (r * 3 + i % 7) as f32).sum()).collect();
            let got = c.allreduce(mine, ReduceOp::Sum).await.expect("allreduce");
            assert!(got == want, "allreduce of {count}");
            for root in [1, n - 1] {
                let b = if rank == root { vec![root as u8 + 1; count] } else { vec![0; count] };
                let got = c.broadcast(b, root).await.expect("broadcast");
                assert!(got.iter().all(|&x| x == root as u8 + 1), "broadcast of {count} from {root}");
            }
            let got = c.allgather(vec![rank as u16; count]).await.expect("allgather");
            let want: Vec<u16> = (0..n).flat_map(|r| std::iter::repeat(r as u16).take(count)).collect();
            assert!(got == want, "allgather of {count}");
        }
    }
    comm.barrier().await.expect("barrier");
    for bytes in [8, 64 << 10, 16 << 20] {
        println!("PLAN {}", comm.plan(Op::Allreduce, bytes, 4, 0));
    }
    println!("TWO-LEVEL-OK");
}
