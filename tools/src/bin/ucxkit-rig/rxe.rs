//! Soft-RoCE on a rig (`up --rxe`): an rxe device on each host's `eth0`, then
//! `ucxkit-perf` between h0 and h1 over UCX's verbs transports on them.

use std::process::Stdio;
use std::time::Duration;

use ucxkit_testkit::rig::Rig;

/// The port the server listens on in h1.
const PORT: &str = "13337";
/// The verbs transports measured (and `self`, which UCX wants beside them).
const TLS: &str = "rc_verbs,ud_verbs,self";

/// The rxe device of host `i` of rig `rig`.
fn device(rig: &str, i: usize) -> String {
    format!("rxe_{rig}_h{i}")
}

/// Adds the devices and runs the measurement, its output on this one's.
pub(crate) fn run(r: &Rig) -> Result<(), String> {
    for i in 0..r.hosts().len() {
        let out = r
            .command(i, "rdma")?
            .args(["link", "add", &device(r.name(), i), "type", "rxe", "netdev", &r.hosts()[i].dev])
            .output()
            .map_err(|e| format!("running rdma: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "adding an rxe device on h{i}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    let perf = std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("ucxkit-perf");
    let perf = perf.to_str().ok_or("the tools' directory is not UTF-8")?.to_string();
    let server_addr = r.hosts()[1].addr.to_string();
    let mut server = r
        .command(1, &perf)?
        .args(["--server", "--bind", &server_addr, "--port", PORT, "--transport", "auto", "--tls", TLS])
        .env("UCX_NET_DEVICES", format!("{}:1", device(r.name(), 1)))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {perf} on h1: {e}"))?;
    std::thread::sleep(Duration::from_millis(500));
    let status = r
        .command(0, &perf)?
        .args(["--client", &format!("{server_addr}:{PORT}"), "--transport", "auto", "--tls", TLS])
        .env("UCX_NET_DEVICES", format!("{}:1", device(r.name(), 0)))
        .status()
        .map_err(|e| format!("starting {perf} on h0: {e}"))?;
    let _ = server.kill();
    let _ = server.wait();
    if status.success() {
        Ok(())
    } else {
        Err(format!("ucxkit-perf over soft-RoCE ended with {status}"))
    }
}
