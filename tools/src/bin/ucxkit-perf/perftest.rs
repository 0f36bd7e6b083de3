//! `--compare`: runs `ucx_perftest` with the same test, size, iterations, window,
//! transports, pinning and wait mode (`-E sleep` for ucxkit's event progress mode), and
//! reads its result as a [`Row`].

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::bench::Test;
use crate::AnyResult;
use ucxkit_tools::report::Row;

/// How to run ucx_perftest for one comparison.
pub(crate) struct Setup<'a> {
    /// `UCX_TLS` for both processes (None: inherit the environment).
    pub(crate) tls: Option<&'a str>,
    /// Peer error handling (`-e`).
    pub(crate) peer_mode: bool,
    /// Event-driven waiting (`-E sleep`), matching ucxkit's event progress mode.
    pub(crate) sleep: bool,
    pub(crate) cpu: Option<usize>,
    pub(crate) server_cpu: Option<usize>,
    pub(crate) window: usize,
}

fn command(cpu: Option<usize>, setup: &Setup<'_>, test: Test) -> Command {
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
    if setup.peer_mode {
        c.arg("-e");
    }
    // One-sided tests wait by polling memory, which no event announces: ucx_perftest
    // would sleep through them.
    if setup.sleep && !test.is_one_sided() {
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
) -> AnyResult<(Option<std::process::ExitStatus>, Vec<u8>, Vec<u8>)> {
    use std::io::Read;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    // Drain the pipes on their own threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take().ok_or("no stdout")?;
    let mut err = child.stderr.take().ok_or("no stderr")?;
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

fn free_port() -> AnyResult<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs one ucx_perftest pair and returns its result.
pub(crate) fn run(test: Test, size: usize, iters: u64, warmup: u64, setup: &Setup<'_>) -> AnyResult<Row> {
    let size = test.effective_size(size);
    let mut last_err = String::new();
    // The server needs a moment to listen; retry the client a few times.
    for attempt in 0..5u64 {
        let port = free_port()?;
        let mut server = command(setup.server_cpu, setup, test)
            .args(["-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting ucx_perftest (apt-get install ucx-utils): {e}"))?;
        std::thread::sleep(Duration::from_millis(200 + 200 * attempt));
        let mut client = command(setup.cpu, setup, test);
        client.args(["127.0.0.1", "-p", &port.to_string(), "-t", test.perftest_name()]);
        client.args(["-s", &size.to_string(), "-n", &iters.to_string(), "-w", &warmup.to_string()]);
        if !test.is_latency() {
            client.args(["-O", &setup.window.to_string()]);
        }
        let out = run_bounded(client.args(["-f", "-v"]).stdin(Stdio::null()), LIMIT);
        let _ = server.kill();
        let _ = server.wait();
        let (status, stdout, stderr) = out?;
        let text = String::from_utf8_lossy(&stdout);
        match parse(&text) {
            Some(v) if status.as_ref().is_some_and(|s| s.success()) => return Ok(row(test, size, v)),
            _ => {
                let timed_out = status.is_none();
                last_err = format!(
                    "ucx_perftest -t {} {}: {}{}",
                    test.perftest_name(),
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
    Err(last_err.into())
}

/// The values of the CSV line `-f -v` prints: iterations, p50 latency, average and
/// overall latency, average and overall bandwidth, average and overall message rate.
fn parse(text: &str) -> Option<[f64; 8]> {
    let line = text.lines().rev().find(|l| l.split(',').count() == 8 && !l.starts_with("iterations"))?;
    let mut v = [0f64; 8];
    for (slot, cell) in v.iter_mut().zip(line.split(',')) {
        *slot = cell.trim().parse().ok()?;
    }
    Some(v)
}

fn row(test: Test, size: usize, v: [f64; 8]) -> Row {
    Row {
        test: test.name().into(),
        size,
        iters: v[0] as u64,
        lat_us: v[3],
        lat_p50_us: v[1],
        lat_p99_us: f64::NAN,
        bw_mibps: if size == 0 { 0.0 } else { v[5] },
        msg_rate: v[7],
        transport: String::new(),
        source: "ucx_perftest".into(),
    }
}

/// ucxkit / ucx_perftest on the figure that matters for the test: latency for latency
/// tests (lower is better, so a ratio above 1 is slower), message rate for atomics,
/// bandwidth otherwise (above 1 is faster).
pub(crate) fn ratio(test: Test, ours: &Row, theirs: &Row) -> f64 {
    if test.is_latency() {
        ours.lat_us / theirs.lat_us
    } else if test == Test::AtomicRate {
        ours.msg_rate / theirs.msg_rate
    } else {
        ours.bw_mibps / theirs.bw_mibps
    }
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
        let r = row(Test::AmBw, 65536, v);
        assert_eq!(r.bw_mibps, 4036.31);
        assert_eq!(r.source, "ucx_perftest");
        assert!(parse("garbage\n").is_none());
        assert!(parse("1,2,3\n").is_none());
    }
}
