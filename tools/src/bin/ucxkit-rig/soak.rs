//! `ucxkit-rig soak`: a rig of its own with one process per host moving checked data
//! through every layer ([`crate::soak_node`]), while faults are set on random hosts and
//! cleared again (a killed process is started again, joining the next collectives
//! epoch); at the end, per layer, the bytes moved, operations done, failed and
//! recovered, and corrupt bytes (which must be 0), as a table or JSON, every process
//! that ran counted.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use ucxkit_testkit::payload::Rng;
use ucxkit_testkit::rig::{DelaySpec, Fault, Rig, Target};

use crate::soak_node::LAYERS;

/// The longest soak.
const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// Options of `soak`.
#[derive(clap::Args, Debug)]
pub(crate) struct SoakArgs {
    /// How long to run (at most 24h).
    #[arg(long, default_value = "60s", value_parser = ucxkit_tools::cli::parse_duration)]
    duration: Duration,
    /// Hosts (each runs one process).
    #[arg(long, default_value_t = 3)]
    hosts: usize,
    /// A new fault about this often (each held for a random 1 to 3 s, then cleared).
    #[arg(long, default_value = "5s", value_parser = ucxkit_tools::cli::parse_duration)]
    fault_every: Duration,
    /// Seed of the faults' and the payloads' draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// A random fault: loss, a rate, delay with reordering, the link down, the host's
/// processes frozen, or its process killed.
fn draw(rng: &mut Rng) -> Fault {
    match rng.below(6) {
        0 => Fault::Loss(1.0 + rng.below(9) as f64),
        1 => Fault::Rate(format!("{}mbit", 20 + 20 * rng.below(10))),
        2 => Fault::Delay(DelaySpec {
            delay: Duration::from_millis(5 + rng.below(26) as u64),
            jitter: Duration::from_millis(rng.below(11) as u64),
            reorder: rng.below(20) as f64,
        }),
        3 => Fault::LinkDown,
        4 => Fault::Freeze(Target::All),
        _ => Fault::Kill(Target::All),
    }
}

/// A started process: which one it is (every start has a number of its own), its
/// handle, and the last lines it wrote to stderr (see [`STDERR_KEPT`]).
struct Node {
    run: usize,
    child: Child,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

/// The lines of a process's stderr kept, the last ones, for the report of a process that
/// did not report at the end.
const STDERR_KEPT: usize = 20;

impl Node {
    /// How the process ended (or that it runs), and its last lines on stderr.
    fn account(&mut self) -> String {
        let status = match self.child.try_wait() {
            Ok(Some(s)) => s.to_string(),
            Ok(None) => "still running".into(),
            Err(e) => e.to_string(),
        };
        let lines = self.stderr.lock().unwrap_or_else(PoisonError::into_inner);
        let tail: Vec<&str> = lines.iter().map(String::as_str).collect();
        format!("process {} ({status}); its last lines on stderr: {tail:?}", self.run)
    }
}

/// Starts host `i`'s process, number `run`, joining collectives epoch `epoch`; its lines
/// go to `tx` with its number.
fn start(
    rig: &Rig,
    i: usize,
    a: &SoakArgs,
    (run, epoch): (usize, u64),
    tx: mpsc::Sender<(usize, String)>,
) -> Result<Node, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = rig
        .command(i, exe.to_str().ok_or("the tool's path is not UTF-8")?)?
        .args(["soak-node", &i.to_string(), &a.hosts.to_string(), &a.seed.to_string(), &epoch.to_string()])
        .env("UCX_TLS", "tcp,self")
        .env("UCX_WARN_UNUSED_ENV_VARS", "n")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting host {i}'s process: {e}"))?;
    let out = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send((run, line)).is_err() {
                break;
            }
        }
    });
    let err = child.stderr.take().expect("piped");
    let stderr = Arc::new(Mutex::new(VecDeque::new()));
    let kept = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let mut k = kept.lock().unwrap_or_else(PoisonError::into_inner);
            if k.len() == STDERR_KEPT {
                k.pop_front();
            }
            k.push_back(line);
        }
    });
    Ok(Node { run, child, stderr })
}

pub(crate) fn run(a: SoakArgs) -> Result<(), String> {
    if a.duration > MAX_DURATION {
        return Err(format!("--duration is at most {MAX_DURATION:?}"));
    }
    if a.hosts < 2 {
        return Err("--hosts: 2 at least".into());
    }
    let mut rig = Rig::up(a.hosts, None)?;
    let (tx, rx) = mpsc::channel();
    let mut runs = 0..;
    let mut nodes = (0..a.hosts)
        .map(|i| start(&rig, i, &a, (runs.next().unwrap_or_default(), 0), tx.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut rng = Rng::new(a.seed);
    let mut faults: BTreeMap<&str, u64> = BTreeMap::new();
    // The last report of every process that ran, by its number.
    let mut last: BTreeMap<usize, Value> = BTreeMap::new();
    let take = |(run, line): (usize, String), last: &mut BTreeMap<usize, Value>| {
        if let Ok(v) = serde_json::from_str::<Value>(&line) {
            last.insert(run, v);
        }
    };
    let t0 = Instant::now();
    let end = t0 + a.duration;
    let mut next_fault = t0 + a.fault_every;
    let mut active: Option<(usize, Instant, bool)> = None;
    while Instant::now() < end {
        while let Ok(line) = rx.try_recv() {
            take(line, &mut last);
        }
        let now = Instant::now();
        if let Some((host, until, killed)) = active {
            if now >= until {
                end_fault(&mut rig, &a, &mut nodes, (host, killed), (&mut runs, &last), &tx)?;
                active = None;
            }
        } else if now >= next_fault {
            let host = rng.below(a.hosts);
            let f = draw(&mut rng);
            rig.set(host, &f)?;
            let killed = matches!(f, Fault::Kill(_));
            if killed {
                let _ = nodes[host].child.wait();
            }
            *faults.entry(f.name()).or_default() += 1;
            active = Some((host, now + Duration::from_millis(1000 + rng.below(2001) as u64), killed));
            next_fault = now + a.fault_every;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some((host, _, killed)) = active {
        end_fault(&mut rig, &a, &mut nodes, (host, killed), (&mut runs, &last), &tx)?;
    }
    drop(tx);
    // Closing stdin ends each process after one last report.
    for n in &mut nodes {
        drop(n.child.stdin.take());
    }
    let done = |last: &BTreeMap<usize, Value>| {
        nodes.iter().filter(|n| last.get(&n.run).is_some_and(|v| v["last"] == true)).count()
    };
    let until = Instant::now() + Duration::from_secs(10);
    while done(&last) < a.hosts && Instant::now() < until {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            take(line, &mut last);
        }
    }
    let reported = done(&last);
    for (i, n) in nodes.iter_mut().enumerate() {
        if !last.get(&n.run).is_some_and(|v| v["last"] == true) {
            eprintln!("ucxkit-rig: host {i} did not report at the end: {}", n.account());
        }
    }
    for n in &mut nodes {
        let _ = n.child.kill();
        let _ = n.child.wait();
    }
    drop(rig);
    report(&a, t0.elapsed(), &faults, &last, reported)
}

/// Ends the fault on `host`: clears it, or after a kill starts the host's process
/// again (the next number of `runs`), in the epoch the others are in by now (as they
/// last reported): the one after the killed process's, or a later one.
fn end_fault(
    rig: &mut Rig,
    a: &SoakArgs,
    nodes: &mut [Node],
    (host, killed): (usize, bool),
    (runs, last): (&mut std::ops::RangeFrom<usize>, &BTreeMap<usize, Value>),
    tx: &mpsc::Sender<(usize, String)>,
) -> Result<(), String> {
    if !killed {
        return rig.set(host, &Fault::Clear);
    }
    let epoch_of = |n: &Node| last.get(&n.run).and_then(|v| v["epoch"].as_u64()).unwrap_or(0);
    let others = nodes.iter().enumerate().filter(|&(i, _)| i != host).map(|(_, n)| epoch_of(n)).max();
    let epoch = others.unwrap_or(0).max(epoch_of(&nodes[host]) + 1);
    nodes[host] = start(rig, host, a, (runs.next().unwrap_or_default(), epoch), tx.clone())?;
    Ok(())
}

/// Prints the totals per layer over every process that ran; an error when a byte was
/// corrupt or a host's last process did not report at the end (`reported` hosts did).
fn report(
    a: &SoakArgs,
    took: Duration,
    faults: &BTreeMap<&str, u64>,
    last: &BTreeMap<usize, Value>,
    reported: usize,
) -> Result<(), String> {
    let fields = ["bytes", "ok", "failed", "recovered", "corrupt"];
    let mut totals: BTreeMap<&str, BTreeMap<&str, u64>> = BTreeMap::new();
    for v in last.values() {
        for layer in LAYERS {
            for f in fields {
                *totals.entry(layer).or_default().entry(f).or_default() +=
                    v["layers"][layer][f].as_u64().unwrap_or(0);
            }
        }
    }
    let corrupt: u64 = totals.values().map(|t| t["corrupt"]).sum();
    let injected: u64 = faults.values().sum();
    if a.json {
        println!(
            "{}",
            json!({
                "seconds": took.as_secs_f64(), "hosts": a.hosts, "seed": a.seed,
                "faults": faults, "faults_injected": injected, "layers": totals,
                "corrupt_bytes": corrupt, "hosts_reported": reported,
            })
        );
    } else {
        println!(
            "soak: {} hosts, {:.0} s, {injected} faults injected {faults:?}",
            a.hosts,
            took.as_secs_f64()
        );
        println!(
            "{:<12} {:>12} {:>9} {:>8} {:>10} {:>8}",
            "layer", "MiB", "ops ok", "failed", "recovered", "corrupt"
        );
        for (layer, t) in &totals {
            println!(
                "{:<12} {:>12.1} {:>9} {:>8} {:>10} {:>8}",
                layer,
                t["bytes"] as f64 / f64::from(1 << 20),
                t["ok"],
                t["failed"],
                t["recovered"],
                t["corrupt"]
            );
        }
    }
    if reported < a.hosts {
        return Err(format!("{reported} of {} hosts reported at the end", a.hosts));
    }
    if corrupt > 0 {
        return Err(format!("{corrupt} corrupt bytes"));
    }
    Ok(())
}
