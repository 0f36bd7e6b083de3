//! Test hosts on one machine, and faults between them: each host a network namespace with
//! one device, `eth0`, joined by a veth pair to a bridge in a switch namespace of its own;
//! addresses `10.214.0.1`, `10.214.0.2`, ... (/24) exist only inside. Nothing is changed
//! outside the namespaces. The same code serves the `ucxkit-rig` tool and tests:
//!
//! - [`Rig::up`] (tests): a rig owned by this process, removed when dropped;
//! - [`Rig::create`], [`Rig::open`], [`Rig::remove`] (the tool): a named rig that stays
//!   until removed, or until its owner process is gone and the next rig is made.
//!
//! A rig is written down in [`record`] before anything is made, so that a rig whose
//! owner died half-way is still removed whole. [`Rig::set`] puts a [`Fault`] on a host.

pub mod fault;
pub mod nfqueue;
pub mod record;

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use fault::{DelaySpec, Fault, Target};
use record::{Daemon, Lock, Owner, Record};

/// The most hosts a rig has.
pub const MAX_HOSTS: usize = 64;
/// Each host's device (UCX's device name there: `UCX_NET_DEVICES=eth0`).
pub const DEVICE: &str = "eth0";
/// How long a delay program has to bind its queue, and to let go when stopped.
const DAEMON_WAIT: Duration = Duration::from_secs(5);

/// One host of a rig.
#[derive(Clone, Debug)]
pub struct Host {
    /// Its namespace's name (`ip netns exec NAME ...` runs a program there).
    pub ns: String,
    /// Its address.
    pub addr: IpAddr,
    /// Its device ([`DEVICE`]).
    pub dev: String,
}

/// A delay program run as a thread of this process.
struct DelayThread {
    host: usize,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<(), String>>,
}

/// A rig of hosts (see the module's documentation).
pub struct Rig {
    record: Record,
    hosts: Vec<Host>,
    /// Removed when dropped (a test's rig).
    owned_here: bool,
    delays: Vec<DelayThread>,
    /// Serves delays as a process of its own, detached (`PROGRAM delay-serve RIG HOST
    /// WORDS...`), so that they outlive this process; else as threads of this one.
    pub delay_program: Option<PathBuf>,
}

/// Host `i`'s address on its rig's bridge (the same in every rig: each has its own).
pub fn host_addr(i: usize) -> IpAddr {
    IpAddr::from([10, 214, 0, i as u8 + 1])
}

fn host_ns(rig: &str, i: usize) -> String {
    format!("ucxr-{rig}-h{i}")
}

fn switch_ns(rig: &str) -> String {
    format!("ucxr-{rig}-sw")
}

fn port(i: usize) -> String {
    format!("h{i}")
}

/// Distinguishes the rigs of one test process (its tests run in parallel).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name part unique to this process and call.
pub(crate) fn unique() -> String {
    format!("{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs `words` (a program and its arguments); an error names the command and what it
/// printed, unless `may_fail`.
pub(crate) fn run(words: &[String], may_fail: bool) -> Result<(), String> {
    let out = Command::new(&words[0])
        .args(&words[1..])
        .output()
        .map_err(|e| format!("running {}: {e}", words[0]))?;
    if out.status.success() || may_fail {
        Ok(())
    } else {
        Err(format!("{}: {}", words.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether this process may create network namespaces: `Err` with the reason when it
/// lacks the privilege (not root). Any other failure (no `ip`, say) panics: the suite
/// runs as root and must not skip these tests quietly.
pub fn available() -> Result<(), String> {
    let probe = probe_ns();
    match sh(&["ip", "netns", "add", &probe]) {
        Ok(()) => {
            let _ = sh(&["ip", "netns", "del", &probe]);
            Ok(())
        }
        Err(e) if e.contains("Operation not permitted") || e.contains("Permission denied") => Err(e),
        Err(e) => panic!("cannot make network namespaces: {e}"),
    }
}

/// A name for [`available`]'s probe namespace: one of a rig without a record, so that a
/// probe left by a process killed during it goes with the next stale rigs; named after
/// its process, which the cleanup leaves alone while it lives ([`probe_of_live`]).
fn probe_ns() -> String {
    host_ns(&format!("probe{}", unique()), 0)
}

/// Whether rig name `rig` is a probe's (see [`probe_ns`]) whose process lives.
fn probe_of_live(rig: &str) -> bool {
    let pid = rig.strip_prefix("probe").and_then(|r| r.split('x').next()).and_then(|p| p.parse::<i32>().ok());
    pid.is_some_and(|p| {
        // SAFETY: kill(2) with signal 0 only checks that the process exists.
        p > 0
            && (unsafe { libc::kill(p, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    })
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

/// Runs `words`, which must succeed (see [`run`]).
fn sh(words: &[&str]) -> Result<(), String> {
    let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
    run(&words, false)
}

/// Whether `name` may name a rig: 1 to 16 lower-case letters and digits.
pub fn check_name(name: &str) -> Result<(), String> {
    if (1..=16).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
        Ok(())
    } else {
        Err(format!("{name:?}: a rig's name is 1 to 16 lower-case letters and digits"))
    }
}

/// The network namespaces on this machine.
fn namespaces() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// The processes in namespace `ns`.
fn pids_in(ns: &str) -> Vec<u32> {
    let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) takes no memory.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// Asks a delay program to let its packets go and end, and kills it if it has not
/// within [`DAEMON_WAIT`].
fn stop_daemon(d: &Daemon) {
    if !d.process.alive() {
        return;
    }
    signal(d.process.pid, libc::SIGTERM);
    let until = Instant::now() + DAEMON_WAIT;
    while d.process.alive() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    if d.process.alive() {
        signal(d.process.pid, libc::SIGKILL);
    }
}

/// What is left of rig `name`: its namespaces, record and delay programs.
pub fn leftovers(name: &str) -> Vec<String> {
    let prefix = format!("ucxr-{name}-");
    let mut left: Vec<String> = namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .map(|n| format!("namespace {n}"))
        .collect();
    if let Ok(Some(r)) = Record::load(name) {
        left.push(format!("record {}/{name}.json", record::DIR));
        left.extend(
            r.daemons
                .iter()
                .filter(|d| d.process.alive())
                .map(|d| format!("delay program {}", d.process.pid)),
        );
    }
    left
}

/// Removes rig `name` (holding the lock): its delay programs, every process on its hosts,
/// its namespaces (with them its links, bridge and rules), then its record.
fn remove_locked(name: &str) -> Result<(), String> {
    if let Ok(Some(r)) = Record::load(name) {
        r.daemons.iter().for_each(stop_daemon);
    }
    let prefix = format!("ucxr-{name}-");
    for ns in namespaces().into_iter().filter(|n| n.starts_with(&prefix)) {
        // A namespace lives on while a process is in it: end them first.
        for pid in pids_in(&ns) {
            signal(pid, libc::SIGKILL);
        }
        sh(&["ip", "netns", "del", &ns])?;
    }
    Record::delete(name)
}

/// Removes the rigs whose owner is gone, and namespaces of rigs without a record (holding
/// the lock); the names of the rigs removed.
fn remove_stale_locked() -> Vec<String> {
    let mut removed = Vec::new();
    for name in Record::names() {
        let stale = match Record::load(&name) {
            Ok(Some(r)) => r.owner.is_some_and(|o| !o.alive()),
            Ok(None) => false,
            Err(_) => true,
        };
        if stale && remove_locked(&name).is_ok() {
            removed.push(name);
        }
    }
    // Namespaces without a record: each such rig removed once, whatever its hosts.
    let recorded = Record::names();
    let unrecorded: std::collections::BTreeSet<String> = namespaces()
        .iter()
        .filter_map(|ns| ns.strip_prefix("ucxr-").and_then(|r| r.split('-').next()))
        .filter(|rig| !recorded.iter().any(|r| r == rig) && !probe_of_live(rig))
        .map(str::to_string)
        .collect();
    for rig in unrecorded {
        if remove_locked(&rig).is_ok() {
            removed.push(rig);
        }
    }
    removed
}

/// Enters network namespace `ns` (this thread only).
pub fn enter(ns: &str) -> Result<(), String> {
    let f = std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| format!("namespace {ns}: {e}"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: setns on a descriptor that stays open for the call.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("entering {ns}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Whether this kernel has soft-RoCE (`rdma_rxe`); the reason when it has not.
pub fn rxe_available() -> Result<(), String> {
    let here = || std::path::Path::new("/sys/module/rdma_rxe").exists();
    if !here() {
        let _ = Command::new("modprobe").arg("rdma_rxe").stderr(Stdio::null()).status();
    }
    if here() {
        Ok(())
    } else {
        Err("this kernel has no soft-RoCE: the rdma_rxe module is neither loaded nor loadable".into())
    }
}

impl Rig {
    /// A rig of `n` hosts owned by this process and removed when dropped (also when the
    /// test fails; one left by a killed test is removed by the next); each link limited
    /// to `rate` each way when given (tc's units: `1gbit`, `200mbit`).
    pub fn up(n: usize, rate: Option<&str>) -> Result<Rig, String> {
        let name = format!("t{}", unique());
        let mut rig = Rig::create(&name, n, rate, Some(Owner::this()))?;
        rig.owned_here = true;
        Ok(rig)
    }

    /// Makes rig `name` of `n` hosts (see [`Rig::up`] for `rate`), removed with
    /// [`Rig::remove`], or by the next rig made once `owner` (if given) has ended. Rigs
    /// whose owner has ended are removed first.
    pub fn create(name: &str, n: usize, rate: Option<&str>, owner: Option<Owner>) -> Result<Rig, String> {
        check_name(name)?;
        if n == 0 || n > MAX_HOSTS {
            return Err(format!("{n} hosts: a rig has 1 to {MAX_HOSTS}"));
        }
        let _lock = Lock::take()?;
        remove_stale_locked();
        if Record::load(name)?.is_some() {
            return Err(format!("rig {name} is up already (`ucxkit-rig down --name {name}` removes it)"));
        }
        let record = Record {
            name: name.into(),
            hosts: n,
            rate: rate.map(str::to_string),
            owner,
            daemons: Vec::new(),
        };
        record.save()?;
        let rig = Rig::from_record(record);
        if let Err(e) = rig.build() {
            let _ = remove_locked(name);
            return Err(e);
        }
        Ok(rig)
    }

    fn from_record(record: Record) -> Rig {
        let hosts = (0..record.hosts)
            .map(|i| Host { ns: host_ns(&record.name, i), addr: host_addr(i), dev: DEVICE.into() })
            .collect();
        Rig { record, hosts, owned_here: false, delays: Vec::new(), delay_program: None }
    }

    fn build(&self) -> Result<(), String> {
        let sw = switch_ns(&self.record.name);
        sh(&["ip", "netns", "add", &sw])?;
        sh(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for (i, h) in self.hosts.iter().enumerate() {
            let p = port(i);
            sh(&["ip", "netns", "add", &h.ns])?;
            sh(&[
                "ip", "link", "add", DEVICE, "netns", &h.ns, "type", "veth", "peer", "name", &p, "netns", &sw,
            ])?;
            sh(&["ip", "-n", &sw, "link", "set", &p, "master", "br0"])?;
            sh(&["ip", "-n", &sw, "link", "set", &p, "up"])?;
            sh(&["ip", "-n", &h.ns, "addr", "add", &format!("{}/24", h.addr), "dev", DEVICE])?;
            sh(&["ip", "-n", &h.ns, "link", "set", "lo", "up"])?;
            sh(&["ip", "-n", &h.ns, "link", "set", DEVICE, "up"])?;
            if let Some(rate) = &self.record.rate {
                self.commands(i, &Fault::Rate(rate.clone()))
                    .iter()
                    .try_for_each(|(c, may_fail)| run(c, *may_fail))?;
            }
        }
        // UCX leaves out devices that are not up yet when a context opens them.
        self.hosts.iter().try_for_each(|h| wait_up(&h.ns, DEVICE))
    }

    /// Rig `name`, as made by [`Rig::create`] (in this process or another).
    pub fn open(name: &str) -> Result<Rig, String> {
        check_name(name)?;
        let record = Record::load(name)?.ok_or_else(|| format!("no rig named {name} is up"))?;
        Ok(Rig::from_record(record))
    }

    /// Removes rig `name` whole; an error names what is left.
    pub fn remove(name: &str) -> Result<(), String> {
        check_name(name)?;
        let lock = Lock::take()?;
        remove_locked(name)?;
        drop(lock);
        let left = leftovers(name);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("rig {name}: left behind: {}", left.join(", ")))
        }
    }

    /// Removes the rigs whose owner is gone; their names.
    pub fn remove_stale() -> Result<Vec<String>, String> {
        let _lock = Lock::take()?;
        Ok(remove_stale_locked())
    }

    /// The rigs up on this machine, by name.
    pub fn names() -> Vec<String> {
        Record::names()
    }

    /// The rig's name.
    pub fn name(&self) -> &str {
        &self.record.name
    }

    /// The rig's record (hosts, rate, owner, delay programs).
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// The hosts, in order.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Host `i`, or an error naming the rig's hosts.
    pub fn host(&self, i: usize) -> Result<&Host, String> {
        self.hosts
            .get(i)
            .ok_or_else(|| format!("rig {} has hosts 0 to {}", self.record.name, self.hosts.len() - 1))
    }

    /// A command that runs `program` on host `i` (`ip netns exec`).
    pub fn command(&self, i: usize, program: &str) -> Result<Command, String> {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host(i)?.ns, program]);
        Ok(c)
    }

    fn commands(&self, i: usize, f: &Fault) -> Vec<fault::Cmd> {
        let (sw, p) = (switch_ns(&self.record.name), port(i));
        let place = fault::Place { ns: &self.hosts[i].ns, dev: DEVICE, switch: &sw, port: &p };
        fault::commands(f, &place, self.record.rate.as_deref())
    }

    /// Puts `fault` on host `i` (see [`Fault`]); in effect when this returns.
    pub fn set(&mut self, i: usize, fault: &Fault) -> Result<(), String> {
        let ns = self.host(i)?.ns.clone();
        if matches!(fault, Fault::Delay(_) | Fault::Clear) {
            self.stop_delay(i)?;
        }
        self.commands(i, fault).iter().try_for_each(|(c, may_fail)| run(c, *may_fail))?;
        match fault {
            Fault::LinkUp | Fault::Clear => wait_up(&ns, DEVICE)?,
            Fault::Delay(spec) => self.start_delay(i, *spec)?,
            _ => {}
        }
        let sig = match fault {
            Fault::Freeze(t) => Some((t, libc::SIGSTOP)),
            Fault::Thaw(t) => Some((t, libc::SIGCONT)),
            Fault::Kill(t) => Some((t, libc::SIGKILL)),
            Fault::Clear => Some((&Target::All, libc::SIGCONT)),
            _ => None,
        };
        if let Some((target, sig)) = sig {
            let daemons: Vec<u32> = self.record.daemons.iter().map(|d| d.process.pid).collect();
            let pids: Vec<u32> = pids_in(&ns).into_iter().filter(|p| !daemons.contains(p)).collect();
            match target {
                Target::All => pids.iter().for_each(|&p| signal(p, sig)),
                Target::Pid(p) if pids.contains(p) => signal(*p, sig),
                Target::Pid(p) => return Err(format!("process {p} does not run on host {i}")),
            }
        }
        Ok(())
    }

    /// Serves host `i`'s queue with `spec`: in a thread, or in a detached process when
    /// [`Rig::delay_program`] is set; returns once the queue is bound.
    fn start_delay(&mut self, i: usize, spec: DelaySpec) -> Result<(), String> {
        let ns = self.hosts[i].ns.clone();
        if let Some(program) = &self.delay_program {
            let words = Fault::Delay(spec).to_string();
            let mut child = Command::new(program)
                .args(["delay-serve", &self.record.name, &i.to_string()])
                .args(words.split_whitespace().skip(1))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .map_err(|e| format!("starting {}: {e}", program.display()))?;
            let out = child.stdout.take().expect("piped");
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ = BufReader::new(out).read_line(&mut line);
                let _ = tx.send(line);
            });
            let line = rx.recv_timeout(DAEMON_WAIT).unwrap_or_default();
            let process = Owner::of(child.id()).filter(|_| line.trim() == "ready");
            let Some(process) = process else {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the delay program for host {i} did not start: {}", line.trim()));
            };
            // Its end is not waited for here: it is detached, and reaped by init.
            let _lock = Lock::take()?;
            self.record = Record::load(&self.record.name)?.unwrap_or_else(|| self.record.clone());
            self.record.daemons.push(Daemon { host: i, process });
            return self.record.save();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let ready = || {
                let _ = tx.send(Ok(()));
            };
            let r = enter(&ns).and_then(|()| nfqueue::serve(fault::QUEUE, spec, &flag, ready));
            if let Err(e) = &r {
                let _ = tx.send(Err(e.clone()));
            }
            r
        });
        match rx.recv_timeout(DAEMON_WAIT) {
            Ok(Ok(())) => {
                self.delays.push(DelayThread { host: i, stop, thread });
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!("the delay queue of host {i} was not bound in {DAEMON_WAIT:?}")),
        }
    }

    /// Ends host `i`'s delay program, if it has one (its held packets let go).
    fn stop_delay(&mut self, i: usize) -> Result<(), String> {
        for d in std::mem::take(&mut self.delays) {
            if d.host == i {
                d.stop.store(true, Ordering::Relaxed);
                let _ = d.thread.join();
            } else {
                self.delays.push(d);
            }
        }
        if self.record.daemons.iter().any(|d| d.host == i) {
            // The record as it is now (another process may have changed it).
            let _lock = Lock::take()?;
            if let Some(r) = Record::load(&self.record.name)? {
                self.record = r;
            }
            self.record.daemons.iter().filter(|d| d.host == i).for_each(stop_daemon);
            self.record.daemons.retain(|d| d.host != i);
            self.record.save()?;
        }
        Ok(())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for d in self.delays.drain(..) {
            d.stop.store(true, Ordering::Relaxed);
            let _ = d.thread.join();
        }
        if self.owned_here {
            let _ = Rig::remove(&self.record.name);
        }
    }
}

/// Serves host `host` of rig `rig`'s queue with `spec` until this process gets SIGTERM
/// (the `delay-serve` program of [`Rig::delay_program`]); prints `ready` once bound.
pub fn serve_delay(rig: &str, host: usize, spec: DelaySpec) -> Result<(), String> {
    static STOP: AtomicBool = AtomicBool::new(false);
    extern "C" fn on_term(_: libc::c_int) {
        STOP.store(true, Ordering::Relaxed);
    }
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe { libc::signal(libc::SIGTERM, on_term as extern "C" fn(libc::c_int) as libc::sighandler_t) };
    let r = Rig::open(rig)?;
    enter(&r.host(host)?.ns)?;
    nfqueue::serve(fault::QUEUE, spec, &STOP, || println!("ready"))
}

#[cfg(test)]
mod tests;
