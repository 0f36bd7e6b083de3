//! `ucxkit-rig soak`: a rig of its own with one process per host moving checked data
//! through every layer ([`crate::soak_node`]), while faults are set on random hosts and
//! cleared again; at the end, per layer, the bytes moved, operations done, failed and
//! recovered, and corrupt bytes (which must be 0), as a table or JSON.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
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

/// A random fault: loss, a rate, delay with reordering, the link down, or the host's
/// processes frozen.
fn draw(rng: &mut Rng) -> Fault {
    match rng.below(5) {
        0 => Fault::Loss(1.0 + rng.below(9) as f64),
        1 => Fault::Rate(format!("{}mbit", 20 + 20 * rng.below(10))),
        2 => Fault::Delay(DelaySpec {
            delay: Duration::from_millis(5 + rng.below(26) as u64),
            jitter: Duration::from_millis(rng.below(11) as u64),
            reorder: rng.below(20) as f64,
        }),
        3 => Fault::LinkDown,
        _ => Fault::Freeze(Target::All),
    }
}

/// A fault's kind, as counted in the report.
fn kind(f: &Fault) -> &'static str {
    match f {
        Fault::Loss(_) => "loss",
        Fault::Rate(_) => "rate",
        Fault::Delay(_) => "delay",
        Fault::LinkDown => "link-down",
        _ => "freeze",
    }
}

/// Starts host `i`'s process; its lines go to `tx`.
fn start(rig: &Rig, i: usize, n: usize, seed: u64, tx: mpsc::Sender<String>) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = rig
        .command(i, exe.to_str().ok_or("the tool's path is not UTF-8")?)?
        .args(["soak-node", &i.to_string(), &n.to_string(), &seed.to_string()])
        .env("UCX_TLS", "tcp,self")
        .env("UCX_WARN_UNUSED_ENV_VARS", "n")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting host {i}'s process: {e}"))?;
    let out = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(child)
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
    let mut nodes =
        (0..a.hosts).map(|i| start(&rig, i, a.hosts, a.seed, tx.clone())).collect::<Result<Vec<_>, _>>()?;
    drop(tx);
    let mut rng = Rng::new(a.seed);
    let mut faults: BTreeMap<&str, u64> = BTreeMap::new();
    let mut last: BTreeMap<u64, Value> = BTreeMap::new();
    let take = |line: String, last: &mut BTreeMap<u64, Value>| {
        if let Ok(v) = serde_json::from_str::<Value>(&line) {
            if let Some(n) = v["node"].as_u64() {
                last.insert(n, v);
            }
        }
    };
    let t0 = Instant::now();
    let end = t0 + a.duration;
    let mut next_fault = t0 + a.fault_every;
    let mut active: Option<(usize, Instant)> = None;
    while Instant::now() < end {
        while let Ok(line) = rx.try_recv() {
            take(line, &mut last);
        }
        let now = Instant::now();
        if let Some((host, until)) = active {
            if now >= until {
                rig.set(host, &Fault::Clear)?;
                active = None;
            }
        } else if now >= next_fault {
            let host = rng.below(a.hosts);
            let f = draw(&mut rng);
            rig.set(host, &f)?;
            *faults.entry(kind(&f)).or_default() += 1;
            active = Some((host, now + Duration::from_millis(1000 + rng.below(2001) as u64)));
            next_fault = now + a.fault_every;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some((host, _)) = active {
        rig.set(host, &Fault::Clear)?;
    }
    // Closing stdin ends each process after one last report.
    for n in &mut nodes {
        drop(n.stdin.take());
    }
    let until = Instant::now() + Duration::from_secs(10);
    while last.values().filter(|v| v["last"] == true).count() < a.hosts && Instant::now() < until {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            take(line, &mut last);
        }
    }
    for n in &mut nodes {
        let _ = n.kill();
        let _ = n.wait();
    }
    drop(rig);
    report(&a, t0.elapsed(), &faults, &last)
}

/// Prints the totals per layer; an error when a byte was corrupt or a host never
/// reported.
fn report(
    a: &SoakArgs,
    took: Duration,
    faults: &BTreeMap<&str, u64>,
    last: &BTreeMap<u64, Value>,
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
                "corrupt_bytes": corrupt, "hosts_reported": last.len(),
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
    if last.len() < a.hosts {
        return Err(format!("{} of {} hosts reported", last.len(), a.hosts));
    }
    if corrupt > 0 {
        return Err(format!("{corrupt} corrupt bytes"));
    }
    Ok(())
}
