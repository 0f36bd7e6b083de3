//! Runs `ucx_perftest` (from `ucx-utils`) for the tools' `--compare`: a server and a
//! client on loopback with the same test, size, iterations, window, transports, pinning
//! and wait mode (`-E sleep` for ucxkit's event progress mode), bounded in time, and
//! reads the values of its result line.
//!
//! Both processes use the network devices of the endpoint ucxkit measured
//! ([`net_devices`]): UCX splits a large message over every network device an endpoint
//! has (with `eth0` beside `lo`, two TCP connections; 256 MiB in 55 ms against 73 ms over
//! `lo` alone here), so both sides get the same rails.

use std::process::{Command, Stdio};
use std::time::Duration;

/// How to run ucx_perftest for one comparison.
pub struct Setup<'a> {
    /// `UCX_TLS` for both processes (None: inherit the environment).
    pub tls: Option<&'a str>,
    /// Peer error handling (`-e`).
    pub peer_mode: bool,
    /// Event-driven waiting (`-E sleep`), matching ucxkit's event progress mode.
    pub sleep: bool,
    /// The client's CPU (`taskset`), if pinned.
    pub cpu: Option<usize>,
    /// The server's CPU, if pinned.
    pub server_cpu: Option<usize>,
    /// Outstanding messages in bandwidth tests (`-O`).
    pub window: usize,
    /// `UCX_NET_DEVICES` for both processes (None: inherit the environment).
    pub net_devices: Option<&'a str>,
    /// Memory types of the send and receive buffers (`-m SEND,RECV`; None: host).
    pub mem: Option<&'a str>,
}

/// `UCX_NET_DEVICES` naming the network devices among `devices` (those of the lanes of
/// the endpoint ucxkit measured, in order, without repeats); `memory` ones (shared
/// memory, self) and GPUs (`cuda`, `rocm`, `gdr`) are not network devices. None when no
/// network device is among them.
pub fn net_devices<'d>(devices: impl IntoIterator<Item = &'d str>) -> Option<String> {
    let mut net: Vec<&str> = Vec::new();
    for d in devices {
        let local = ["memory", "cuda", "rocm", "gdr"].iter().any(|p| d.starts_with(p));
        if !local && !net.contains(&d) {
            net.push(d);
        }
    }
    (!net.is_empty()).then(|| net.join(","))
}

/// One ucx_perftest measurement.
pub struct Case<'a> {
    /// The test (`-t`: `tag_bw`, `ucp_put_lat`, ...).
    pub test: &'a str,
    /// Message size in bytes (`-s`).
    pub size: usize,
    /// Measured iterations (`-n`).
    pub iters: u64,
    /// Warm-up iterations (`-w`).
    pub warmup: u64,
    /// Whether it is a latency test (no window).
    pub latency: bool,
    /// Whether it is one-sided (waits by polling memory, so never `-E sleep`).
    pub one_sided: bool,
}

/// What ucx_perftest printed (`-f -v`): iterations, median latency, average and
/// overall latency (us), average and overall bandwidth (MB/s), average and overall
/// message rate.
pub type Values = [f64; 8];

fn command(cpu: Option<usize>, setup: &Setup<'_>, case: &Case<'_>) -> Command {
    let mut c = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string(), "ucx_perftest"]);
            c
        }
        None => Command::new("ucx_perftest"),
    };
    if let Some(tls) = setup.tls {
        c.env("UCX_TLS", tls);
    }
    if let Some(d) = setup.net_devices {
        c.env("UCX_NET_DEVICES", d);
    }
    if setup.peer_mode {
        c.arg("-e");
    }
    if let Some(m) = setup.mem {
        c.args(["-m", m]);
    }
    // One-sided tests wait by polling memory, which no event announces: ucx_perftest
    // would sleep through them.
    if setup.sleep && !case.one_sided {
        c.args(["-E", "sleep"]);
    }
    c
}

/// How long one ucx_perftest client may run before it is killed.
const LIMIT: Duration = Duration::from_secs(300);

/// Runs `cmd` to completion or until `limit`, then kills it; returns its exit status
/// (None when killed), stdout and stderr.
fn run_bounded(
    cmd: &mut Command,
    limit: Duration,
) -> std::io::Result<(Option<std::process::ExitStatus>, Vec<u8>, Vec<u8>)> {
    use std::io::Read;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    // Drain the pipes on their own threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take().ok_or_else(|| std::io::Error::other("no stdout"))?;
    let mut err = child.stderr.take().ok_or_else(|| std::io::Error::other("no stderr"))?;
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = t_out.join().unwrap_or_default();
    let stderr = t_err.join().unwrap_or_default();
    Ok((status, stdout, stderr))
}

/// Runs one ucx_perftest pair (retrying a start that failed) and returns its values.
///
/// # Errors
/// When ucx_perftest is missing, fails, or does not finish within five minutes.
pub fn run(case: &Case<'_>, setup: &Setup<'_>) -> Result<Values, String> {
    let (test, size) = (case.test, case.size);
    let mut last_err = String::new();
    // The server needs a moment to listen; retry the client a few times.
    for attempt in 0..5u64 {
        let port = crate::cli::free_port()?;
        let mut server = command(setup.server_cpu, setup, case)
            .args(["-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting ucx_perftest (apt-get install ucx-utils): {e}"))?;
        std::thread::sleep(Duration::from_millis(200 + 200 * attempt));
        let mut client = command(setup.cpu, setup, case);
        client.args(["127.0.0.1", "-p", &port.to_string(), "-t", test]);
        client.args(["-s", &size.to_string(), "-n", &case.iters.to_string(), "-w", &case.warmup.to_string()]);
        if !case.latency {
            client.args(["-O", &setup.window.to_string()]);
        }
        let out = run_bounded(client.args(["-f", "-v"]).stdin(Stdio::null()), LIMIT);
        let _ = server.kill();
        let _ = server.wait();
        let (status, stdout, stderr) = out.map_err(|e| format!("running ucx_perftest: {e}"))?;
        let text = String::from_utf8_lossy(&stdout);
        match parse(&text) {
            Some(v) if status.as_ref().is_some_and(|s| s.success()) => return Ok(v),
            _ => {
                let timed_out = status.is_none();
                last_err = format!(
                    "ucx_perftest -t {} {}: {}{}",
                    test,
                    match status {
                        Some(s) => format!("failed ({s})"),
                        None => format!("did not finish within {LIMIT:?}"),
                    },
                    text.trim(),
                    String::from_utf8_lossy(&stderr).trim()
                );
                if timed_out {
                    // A run that hangs will hang again; retries are for failed starts.
                    break;
                }
            }
        }
    }
    Err(last_err)
}

/// The values of the CSV line `-f -v` prints: iterations, p50 latency, average and
/// overall latency, average and overall bandwidth, average and overall message rate.
pub fn parse(text: &str) -> Option<[f64; 8]> {
    let line = text.lines().rev().find(|l| l.split(',').count() == 8 && !l.starts_with("iterations"))?;
    let mut v = [0f64; 8];
    for (slot, cell) in v.iter_mut().zip(line.split(',')) {
        *slot = cell.trim().parse().ok()?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_csv_line() {
        let out = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                   2000,0.381,15.484,15.484,4036.31,4036.31,64581,64581\n";
        let v = parse(out).unwrap();
        assert_eq!(v[0], 2000.0);
        assert_eq!(v[5], 4036.31);
        assert!(parse("garbage\n").is_none());
        assert!(parse("1,2,3\n").is_none());
    }

    #[test]
    fn net_devices_are_the_lanes_network_devices() {
        assert_eq!(net_devices(["lo", "eth0", "lo"]).as_deref(), Some("lo,eth0"));
        assert_eq!(net_devices(["memory", "memory0", "lo"]).as_deref(), Some("lo"));
        assert_eq!(net_devices(["memory", "memory0"]), None);
        assert_eq!(net_devices(["cuda", "cuda0", "memory", "eth0"]).as_deref(), Some("eth0"));
        assert_eq!(net_devices([]), None);
    }
}
