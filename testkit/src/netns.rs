//! Hosts for multi-host tests on one machine: network namespaces joined by a veth pair,
//! made by the test and removed when the rig is dropped (also when the test fails), and
//! processes started inside them (`ip netns exec`, each in a PID namespace of its own),
//! killed when their handle is dropped.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Distinguishes the rigs of one test process (its tests run in parallel).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name part unique to this process and call.
pub(crate) fn unique() -> String {
    format!("{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Two namespaces, `a` and `b`, each with loopback up and one end of a veth pair,
/// addressed `10.213.7.1` and `10.213.7.2` (/24).
pub struct TwoHosts {
    /// Host `a`'s namespace name.
    pub a: String,
    /// Host `b`'s namespace name.
    pub b: String,
    /// Host `a`'s address.
    pub addr_a: IpAddr,
    /// Host `b`'s address.
    pub addr_b: IpAddr,
    /// The veth device in `a` (UCX's device name there).
    pub dev_a: String,
    /// The veth device in `b`.
    pub dev_b: String,
}

/// Runs `ip` with `args`; an error names the command and what it printed.
pub(crate) fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether this process may create network namespaces: `Err` with the reason when it
/// lacks the privilege (not root). Any other failure (no `ip`, say) panics: the suite
/// runs as root and must not skip these tests quietly.
pub fn available() -> Result<(), String> {
    let probe = format!("ucxk{}p", unique());
    match ip(&["netns", "add", &probe]) {
        Ok(()) => {
            ip(&["netns", "del", &probe]).unwrap();
            Ok(())
        }
        Err(e) if e.contains("Operation not permitted") || e.contains("Permission denied") => Err(e),
        Err(e) => panic!("cannot make network namespaces: {e}"),
    }
}

/// Deletes the namespaces a test process left behind when it was killed before its rigs
/// were dropped (`ucxk<pid>x...`, the process gone).
pub(crate) fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else { continue };
        let Some(pid) = name.strip_prefix("ucxk").and_then(|r| r.split('x').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl TwoHosts {
    /// Makes the two namespaces and the link between them (first removing any that a
    /// killed test process left).
    pub fn new() -> Result<TwoHosts, String> {
        remove_stale();
        // Names distinct per process and rig, so that tests running at once do not
        // collide (interface names have at most 15 characters). The addresses may repeat:
        // each pair of namespaces is a network of its own.
        let u = unique();
        let hosts = TwoHosts {
            a: format!("ucxk{u}a"),
            b: format!("ucxk{u}b"),
            addr_a: "10.213.7.1".parse().unwrap(),
            addr_b: "10.213.7.2".parse().unwrap(),
            dev_a: format!("uk{u}a"),
            dev_b: format!("uk{u}b"),
        };
        // From here on, Drop removes whatever was made.
        ip(&["netns", "add", &hosts.a])?;
        ip(&["netns", "add", &hosts.b])?;
        ip(&[
            "link",
            "add",
            &hosts.dev_a,
            "netns",
            &hosts.a,
            "type",
            "veth",
            "peer",
            "name",
            &hosts.dev_b,
            "netns",
            &hosts.b,
        ])?;
        for (ns, dev, addr) in
            [(&hosts.a, &hosts.dev_a, hosts.addr_a), (&hosts.b, &hosts.dev_b, hosts.addr_b)]
        {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        // UCX leaves out devices that are not up yet when a context opens them: wait until
        // both ends report their carrier.
        for (ns, dev) in [(&hosts.a, &hosts.dev_a), (&hosts.b, &hosts.dev_b)] {
            wait_up(ns, dev)?;
        }
        Ok(hosts)
    }
}

/// Waits (at most 10 s) until device `dev` in namespace `ns` reports its carrier.
pub(crate) fn wait_up(ns: &str, dev: &str) -> Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new("ip")
            .args(["-n", ns, "link", "show", dev])
            .output()
            .map_err(|e| format!("running ip: {e}"))?;
        if String::from_utf8_lossy(&out.stdout).contains("state UP") {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(format!("{dev} in {ns} did not come up"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and with it the pair.
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
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
