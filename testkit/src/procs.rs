//! Several processes of one test binary: the test (rank 0) starts ranks 1..size as
//! child processes, each running one ignored test of the same binary in its role, and
//! they find each other through a shared directory of published values (worker
//! addresses, listener ports): [`Group`], [`Role`], [`Exchange`].
//!
//! ```no_run
//! # async fn f() {
//! use std::time::Duration;
//! use ucxkit_testkit::procs::{role, Group};
//! // The test: rank 0, in this process.
//! let (group, me) = Group::spawn("the_peer", 3, &[("TLS", "tcp,self")]);
//! me.exchange.publish("addr-0", b"127.0.0.1:4000");
//! group.wait(Duration::from_secs(60)).await.unwrap();
//! // The ignored test `the_peer`, in each child:
//! if let Some(me) = role() {
//!     let addr = me.exchange.wait("addr-0", Duration::from_secs(30)).unwrap();
//! }
//! # }
//! ```

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const RANK: &str = "UCXKIT_TESTKIT_RANK";
const SIZE: &str = "UCXKIT_TESTKIT_SIZE";
const DIR: &str = "UCXKIT_TESTKIT_EXCHANGE";

/// Child processes of this test binary, killed when dropped; their exchange directory
/// is removed then too.
pub struct Group {
    children: Vec<(usize, tokio::process::Child)>,
    dir: PathBuf,
}

/// One process's place in a [`Group`]: its rank, the group's size, and the exchange.
pub struct Role {
    /// This process's rank: 0 for the test that started the group.
    pub rank: usize,
    /// How many processes the group has, the test's included.
    pub size: usize,
    /// Where the group's processes publish values for each other.
    pub exchange: Exchange,
}

/// Named values shared by a group's processes: files in one directory, each written
/// whole before it appears (written aside, then renamed).
#[derive(Clone, Debug)]
pub struct Exchange {
    dir: PathBuf,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Group {
    /// Starts ranks 1..`size` as children running the ignored test `test` of this
    /// binary (`--exact test --ignored`), with the variables `env` set; returns the group
    /// and rank 0's role, for the caller.
    ///
    /// # Panics
    /// When the exchange directory or a child cannot be made.
    pub fn spawn(test: &str, size: usize, env: &[(&str, &str)]) -> (Group, Role) {
        let dir = std::env::temp_dir().join(format!(
            "ucxkit-testkit-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("exchange directory");
        let children = (1..size)
            .map(|rank| {
                let mut c = command(test, &[]);
                c.env(RANK, rank.to_string()).env(SIZE, size.to_string()).env(DIR, &dir).stdin(Stdio::null());
                for (k, v) in env {
                    c.env(k, v);
                }
                (rank, c.spawn().expect("spawning a child"))
            })
            .collect();
        let exchange = Exchange { dir: dir.clone() };
        (Group { children, dir }, Role { rank: 0, size, exchange })
    }

    /// Waits, at most `limit` in all, for every child to exit; an error names the ranks
    /// that failed or had to be killed.
    pub async fn wait(mut self, limit: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut failed = Vec::new();
        for (rank, child) in &mut self.children {
            match tokio::time::timeout_at(deadline, child.wait()).await {
                Ok(Ok(s)) if s.success() => {}
                Ok(Ok(s)) => failed.push(format!("rank {rank}: {s}")),
                Ok(Err(e)) => failed.push(format!("rank {rank}: {e}")),
                Err(_) => {
                    let _ = child.kill().await;
                    failed.push(format!("rank {rank}: still running after {limit:?}, killed"));
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("; "))
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A command that runs the ignored test `test` of this test binary (`--exact test
/// --ignored --nocapture`) in a child killed when its handle is dropped: for a child
/// the test drives by hand (kills, pipes), where a [`Group`] does not fit. `wrapper`
/// runs it under another program first (`["ip", "netns", "exec", "ns1"]`, say).
///
/// # Panics
/// When this test binary's path cannot be found.
pub fn command(test: &str, wrapper: &[&str]) -> tokio::process::Command {
    let exe = std::env::current_exe().expect("the test binary");
    let mut c = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = tokio::process::Command::new(program);
            c.args(args).arg(exe);
            c
        }
        None => tokio::process::Command::new(exe),
    };
    c.args(["--exact", test, "--ignored", "--nocapture", "--test-threads=1"]).kill_on_drop(true);
    c
}

/// In a child started by [`Group::spawn`]: its role; None in any other run (the
/// ignored test then returns at once).
pub fn role() -> Option<Role> {
    let rank = std::env::var(RANK).ok()?.parse().ok()?;
    let size = std::env::var(SIZE).ok()?.parse().ok()?;
    let dir = PathBuf::from(std::env::var_os(DIR)?);
    Some(Role { rank, size, exchange: Exchange { dir } })
}

impl Exchange {
    /// Publishes `value` under `key` (a file name: letters, digits, `-`, `_`, `.`).
    ///
    /// # Panics
    /// On a bad key or when the file cannot be written.
    pub fn publish(&self, key: &str, value: &[u8]) {
        assert!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
            "bad exchange key {key:?}"
        );
        let aside = self.dir.join(format!(".{key}.{}", std::process::id()));
        std::fs::write(&aside, value).expect("writing an exchange value");
        std::fs::rename(&aside, self.dir.join(key)).expect("publishing an exchange value");
    }

    /// The value published under `key`, waiting for it at most `limit`.
    pub fn wait(&self, key: &str, limit: Duration) -> Result<Vec<u8>, String> {
        let deadline = Instant::now() + limit;
        loop {
            match std::fs::read(self.dir.join(key)) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("exchange value {key}: {e}")),
            }
        }
    }
}

/// In a child test (this test binary run again by its parent): whether the variable
/// `env` is set, that is, whether this is the child's run; if so, sends ucxkit's
/// `tracing` output for `filter` (an `EnvFilter`) to stderr.
pub fn child_run(env: &str, filter: &str) -> bool {
    if std::env::var_os(env).is_none() {
        return false;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .init();
    true
}
