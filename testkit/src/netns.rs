//! Hosts for multi-host tests on one machine: two hosts of a [`Rig`] ([`TwoHosts`]),
//! removed when dropped (also when the test fails), and processes started inside them
//! (`ip netns exec`, each in a PID namespace of its own), killed when their handle is
//! dropped.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub use crate::rig::available;
use crate::rig::{Host, Rig};

/// Two hosts, `a` and `b` (hosts 0 and 1 of a [`Rig`]): each a namespace with loopback up
/// and one device, joined through the rig's bridge; removed when dropped.
pub struct TwoHosts {
    /// Host `a`'s namespace name.
    pub a: String,
    /// Host `b`'s namespace name.
    pub b: String,
    /// Host `a`'s address.
    pub addr_a: IpAddr,
    /// Host `b`'s address.
    pub addr_b: IpAddr,
    /// The device in `a` (UCX's device name there).
    pub dev_a: String,
    /// The device in `b`.
    pub dev_b: String,
    /// Removes the hosts when dropped.
    _rig: Rig,
}

impl TwoHosts {
    /// Makes the two hosts (see [`Rig::up`]).
    pub fn new() -> Result<TwoHosts, String> {
        let rig = Rig::up(2, None)?;
        let [a, b] = [&rig.hosts()[0], &rig.hosts()[1]].map(Host::clone);
        Ok(TwoHosts {
            a: a.ns,
            b: b.ns,
            addr_a: a.addr,
            addr_b: b.addr,
            dev_a: a.dev,
            dev_b: b.dev,
            _rig: rig,
        })
    }
}

/// The variable naming a command that child tests run under (`valgrind --error-exitcode=99
/// ...`), split at spaces.
pub const WRAPPER: &str = "UCXKIT_CHILD_WRAPPER";

/// A process in a namespace, its stdout read line by line; killed when dropped.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Everything read so far, for error messages.
    pub seen: Vec<String>,
}

impl Proc {
    /// Runs the child test `name` of this test binary in network namespace `ns` and a PID
    /// namespace of its own (as on another machine, its peers cannot watch it through a
    /// pidfd), with `env` set. Its stderr goes to the test's. Killing it kills `unshare`,
    /// whose death kills the child (`--kill-child`). With [`WRAPPER`] set, the child runs
    /// under that command (`valgrind ...`).
    pub fn child_test(ns: &str, name: &str, env: &[(&str, String)]) -> Proc {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, "unshare", "--pid", "--fork", "--kill-child"]);
        if let Ok(w) = std::env::var(WRAPPER) {
            cmd.args(w.split_whitespace());
        }
        cmd.arg(exe)
            .args(["--exact", name, "--ignored", "--nocapture", "--test-threads", "1"])
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("starting a process in a namespace");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines, seen: Vec::new() }
    }

    /// Waits (at most `limit`) for a line holding `marker` and returns what follows it
    /// (the test harness may print its own words first on the line).
    pub fn expect_line(&mut self, marker: &str, limit: Duration) -> Result<String, String> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Some(at) = line.find(marker) {
                        return Ok(line[at + marker.len()..].trim().to_string());
                    }
                }
                Err(_) => {
                    return Err(format!(
                        "no line with {marker:?} within {limit:?}; output so far:\n{}",
                        self.seen.join("\n")
                    ))
                }
            }
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (at most `limit`) for the process to exit; its success, and the rest of its
    /// output.
    pub fn finish(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                // The reader thread has the last lines; it ends at the pipe's end.
                let until = std::time::Instant::now() + Duration::from_secs(10);
                while let Ok(line) =
                    self.lines.recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
                {
                    self.seen.push(line);
                }
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("exited with {status}; output:\n{}", self.seen.join("\n")))
                };
            }
            if std::time::Instant::now() >= deadline {
                self.kill();
                return Err(format!("still running after {limit:?}; output:\n{}", self.seen.join("\n")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}
