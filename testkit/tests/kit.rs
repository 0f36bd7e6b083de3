//! The kit's own checks: a mesh connects every pair, and a process group's members find
//! each other through the exchange, with a failing member reported by rank.

use std::time::Duration;

use ucxkit_testkit::procs::{role, Group};
use ucxkit_testkit::{mesh, payload};
use ucxkit_transport::tag;

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_connects_every_pair() {
    let n = 4;
    let m = mesh("tcp,self", n).await;
    for i in 0..n {
        for j in 0..n {
            if i == j {
                assert!(m.eps[i][j].is_none());
                continue;
            }
            let t = (i * n + j) as u64;
            let recv = m.ep(j, i).tag_recv(t, tag::EXACT, Vec::with_capacity(64));
            let (r, _) = m.ep(i, j).tag_send(t, payload(t, 64)).await;
            r.unwrap();
            let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
            assert_eq!(info.unwrap().len, 64);
            assert_eq!(got, payload(t, 64), "{i} -> {j}");
        }
    }
}

/// The member half: publishes its rank, waits for the test's word, and fails on
/// purpose as rank 2 when asked to.
#[test]
#[ignore = "a member of the process-group test; the test runs it"]
fn group_member() {
    let Some(me) = role() else { return };
    me.exchange.publish(&format!("rank-{}", me.rank), me.rank.to_string().as_bytes());
    let go = me.exchange.wait("go", T).unwrap();
    assert_eq!(go, format!("size {}", me.size).as_bytes());
    if me.rank == 2 && std::env::var_os("KIT_FAIL_RANK_2").is_some() {
        // Failing on purpose, quietly (a panic would print a failed test to the log).
        std::process::exit(3);
    }
}

#[tokio::test]
async fn a_group_finds_each_other_and_reports_failures() {
    for fail in [false, true] {
        let env: &[(&str, &str)] = if fail { &[("KIT_FAIL_RANK_2", "1")] } else { &[] };
        let (group, me) = Group::spawn("group_member", 4, env);
        assert_eq!((me.rank, me.size), (0, 4));
        for r in 1..4 {
            assert_eq!(me.exchange.wait(&format!("rank-{r}"), T).unwrap(), r.to_string().as_bytes());
        }
        me.exchange.publish("go", b"size 4");
        let r = group.wait(T).await;
        if fail {
            let e = r.unwrap_err();
            assert!(
                e.contains("rank 2: exit status: 3") && !e.contains("rank 1") && !e.contains("rank 3"),
                "{e}"
            );
        } else {
            r.unwrap();
        }
    }
    assert!(role().is_none());
}
