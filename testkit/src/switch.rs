//! Several test hosts on one switch: a network namespace per host, each joined by a veth
//! pair to a bridge in a switch namespace of its own, every link optionally limited to a
//! rate in both directions (`tc tbf`). Made by the test or tool and removed when the rig
//! is dropped (also when it fails); nothing is changed outside the namespaces.

use std::net::IpAddr;
use std::process::Command;

use crate::netns::{ip, remove_stale, unique, wait_up};

/// The most hosts a switch takes (one /24, and device names within 15 characters).
pub const MAX_HOSTS: usize = 32;

/// One host of a [`Switch`].
#[derive(Clone, Debug)]
pub struct Host {
    /// Its namespace's name (`ip netns exec NAME ...` runs a program there).
    pub ns: String,
    /// Its address on the switch's network.
    pub addr: IpAddr,
    /// Its end of the link (UCX's device name there, for `UCX_NET_DEVICES`).
    pub dev: String,
}

/// Hosts `10.214.0.1`, `10.214.0.2`, ... (/24) on one bridge.
pub struct Switch {
    /// The hosts, in order.
    pub hosts: Vec<Host>,
    /// The switch's namespace.
    switch: String,
}

/// Runs `tc` with `args`; an error names the command and what it printed.
fn tc(args: &[&str]) -> Result<(), String> {
    let out = Command::new("tc").args(args).output().map_err(|e| format!("running tc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("tc {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Limits what leaves `dev` in `ns` to `rate` (tc's units: `1gbit`, `200mbit`).
fn limit(ns: &str, dev: &str, rate: &str) -> Result<(), String> {
    // A burst of a few milliseconds' worth at 1 Gbit/s, and a queue of 50 ms at most.
    tc(&[
        "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb", "latency",
        "50ms",
    ])
}

impl Switch {
    /// Makes `n` hosts on a switch, each link limited to `rate` each way when given
    /// (first removing any rig that a killed process left).
    ///
    /// # Errors
    /// The `ip` or `tc` command that failed, with what it printed; `n` over [`MAX_HOSTS`].
    pub fn new(n: usize, rate: Option<&str>) -> Result<Switch, String> {
        if n == 0 || n > MAX_HOSTS {
            return Err(format!("{n} hosts: a switch takes 1 to {MAX_HOSTS}"));
        }
        remove_stale();
        let u = unique();
        let switch = format!("ucxk{u}s");
        // From here on, Drop removes whatever was made.
        let mut rig = Switch { hosts: Vec::new(), switch };
        ip(&["netns", "add", &rig.switch])?;
        ip(&["-n", &rig.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &rig.switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let host = Host {
                ns: format!("ucxk{u}h{i}"),
                addr: IpAddr::from([10, 214, 0, i as u8 + 1]),
                dev: format!("uk{u}h{i}"),
            };
            let port = format!("uk{u}p{i}");
            ip(&["netns", "add", &host.ns])?;
            rig.hosts.push(host.clone());
            ip(&[
                "link",
                "add",
                &host.dev,
                "netns",
                &host.ns,
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                &rig.switch,
            ])?;
            ip(&["-n", &rig.switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &rig.switch, "link", "set", &port, "up"])?;
            ip(&["-n", &host.ns, "addr", "add", &format!("{}/24", host.addr), "dev", &host.dev])?;
            ip(&["-n", &host.ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &host.ns, "link", "set", &host.dev, "up"])?;
            if let Some(rate) = rate {
                limit(&host.ns, &host.dev, rate)?;
                limit(&rig.switch, &port, rate)?;
            }
        }
        // UCX leaves out devices that are not up yet when a context opens them.
        for h in &rig.hosts {
            wait_up(&h.ns, &h.dev)?;
        }
        Ok(rig)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends in it, and with them the pairs.
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hosts reach one another through the switch, and the rig leaves nothing behind.
    #[test]
    fn hosts_reach_each_other_and_are_removed() {
        if let Err(e) = crate::netns::available() {
            eprintln!("skipped: {e}");
            return;
        }
        let rig = Switch::new(3, Some("100mbit")).unwrap();
        let names: Vec<String> = rig.hosts.iter().map(|h| h.ns.clone()).chain([rig.switch.clone()]).collect();
        let (a, c) = (&rig.hosts[0], &rig.hosts[2]);
        let listen =
            "import socket; s = socket.create_server(('0.0.0.0', 7777)); c, _ = s.accept(); c.send(b'hi')";
        let mut server =
            Command::new("ip").args(["netns", "exec", &c.ns, "python3", "-c", listen]).spawn().unwrap();
        let connect = format!(
            "import socket, time\nfor _ in range(100):\n  try:\n    print(socket.create_connection(('{}', 7777), 5).recv(2).decode()); break\n  except OSError: time.sleep(0.05)",
            c.addr
        );
        let out =
            Command::new("ip").args(["netns", "exec", &a.ns, "python3", "-c", &connect]).output().unwrap();
        let _ = server.kill();
        let _ = server.wait();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "hi",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        drop(rig);
        let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let list = String::from_utf8_lossy(&list.stdout);
        for n in names {
            assert!(!list.contains(&n), "{n} left behind");
        }
        assert!(Switch::new(0, None).is_err() && Switch::new(MAX_HOSTS + 1, None).is_err());
    }
}
