//! `ucxkit-rig`: test hosts on this machine (network namespaces on one bridge) and faults
//! between them, for bringing up and checking ucxkit, UCX and the programs on top.
//!
//! ```text
//! ucxkit-rig up 3                      # hosts h0..h2: 10.214.0.1..3 on eth0
//! ucxkit-rig exec h1 -- ucxkit-perf --server --transport tcp
//! ucxkit-rig fault h1 loss 2%          # also: link-down, rate 100mbit, delay 20ms jitter 5ms,
//! ucxkit-rig fault h1 clear            #       freeze, thaw, kill [PID]
//! ucxkit-rig list
//! ucxkit-rig down
//! ucxkit-rig soak --duration 10m        # every layer through random faults, on a rig of its own
//! ```
//!
//! A rig belongs to the process that ran `up` (the calling shell or script) unless
//! `--keep` is given: once that process is gone, the next `up` removes it. Exit codes: 0
//! done, 1 failed, 2 bad usage, 3 (`up --rxe`) this kernel has no soft-RoCE.

#![forbid(unsafe_code)]

mod rxe;
mod soak;
mod soak_node;

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::json;
use ucxkit_testkit::rig::record::Owner;
use ucxkit_testkit::rig::{self, Fault, Rig};

/// `up --rxe` where the kernel has no `rdma_rxe`.
const EXIT_NO_RXE: u8 = 3;

/// Test hosts as network namespaces on one bridge, and faults between them.
#[derive(Parser, Debug)]
#[command(name = "ucxkit-rig", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Make N hosts (h0, h1, ...: addresses 10.214.0.1, .2, ... on device eth0).
    Up {
        /// How many hosts.
        hosts: usize,
        /// The rig's name (several rigs can be up at once).
        #[arg(long, default_value = "rig")]
        name: String,
        /// Limit every link to this rate each way (tc's units: 1gbit, 200mbit).
        #[arg(long)]
        rate: Option<String>,
        /// Keep the rig until `down`, even after the calling process ends.
        #[arg(long)]
        keep: bool,
        /// Add a soft-RoCE (rxe) device on each host's eth0 and run ucxkit-perf over UCX's
        /// verbs transports between h0 and h1 (exit code 3 where the kernel lacks rdma_rxe).
        #[arg(long)]
        rxe: bool,
        /// Print the hosts as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a rig: the processes on its hosts, its namespaces, links and rules.
    Down {
        /// The rig's name.
        #[arg(long, default_value = "rig")]
        name: String,
        /// Every rig on this machine.
        #[arg(long)]
        all: bool,
    },
    /// The rigs up, with their hosts.
    List {
        /// As JSON, one rig a line.
        #[arg(long)]
        json: bool,
    },
    /// Run a command on a host (its exit code is this one's).
    Exec {
        /// The host: h0, h1, ... (or 0, 1, ...).
        host: String,
        /// The rig's name.
        #[arg(long, default_value = "rig")]
        name: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Set or clear a fault on a host or its link (the words: see `--help`).
    #[command(about = format!("Set or clear a fault on a host or its link: {}", rig::fault::WORDS))]
    Fault {
        /// The host: h0, h1, ... (or 0, 1, ...).
        host: String,
        /// The fault, in words.
        #[arg(required = true, num_args = 1..)]
        words: Vec<String>,
        /// The rig's name.
        #[arg(long, default_value = "rig")]
        name: String,
    },
    /// Move checked data through every layer between the hosts of a new rig for a
    /// while, setting faults on random hosts, and report bytes moved, operations done,
    /// failed and recovered, and corrupt bytes (exit code 1 if any).
    Soak(soak::SoakArgs),
    /// (Started by `soak`.) One host's process: traffic until stdin closes.
    #[command(hide = true)]
    SoakNode {
        index: usize,
        hosts: usize,
        seed: u64,
        /// The collectives epoch to join first (a process started again after a kill).
        #[arg(default_value_t = 0)]
        epoch: u64,
    },
    /// (Started by `fault ... delay`.) Serve a host's delay queue until terminated.
    #[command(hide = true)]
    DelayServe {
        rig: String,
        host: usize,
        #[arg(num_args = 1.., allow_hyphen_values = true)]
        words: Vec<String>,
    },
}

/// `h2` or `2` as a host index.
fn host_index(s: &str) -> Result<usize, String> {
    s.strip_prefix('h')
        .unwrap_or(s)
        .parse()
        .map_err(|_| format!("{s:?}: a host is h0, h1, ... (or 0, 1, ...)"))
}

fn hosts_json(r: &Rig) -> serde_json::Value {
    let owner = r.record().owner;
    json!({
        "name": r.name(),
        "owner": owner.map(|o| o.pid),
        "owner_alive": owner.map(|o| o.alive()),
        "rate": r.record().rate,
        "hosts": r.hosts().iter().enumerate().map(|(i, h)| json!({
            "host": format!("h{i}"), "namespace": h.ns, "address": h.addr.to_string(), "device": h.dev,
        })).collect::<Vec<_>>(),
        "delays": r.record().daemons.iter().map(|d| format!("h{}", d.host)).collect::<Vec<_>>(),
    })
}

fn print_hosts(r: &Rig) {
    println!("{:<6} {:<24} {:<12} device", "host", "namespace", "address");
    for (i, h) in r.hosts().iter().enumerate() {
        println!("{:<6} {:<24} {:<12} {}", format!("h{i}"), h.ns, h.addr, h.dev);
    }
}

/// The process that called this one (the owner of a rig made without `--keep`).
fn caller() -> Option<Owner> {
    Owner::of(std::os::unix::process::parent_id())
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    match cli.cmd {
        Cmd::Up { hosts, name, rate, keep, rxe, json } => {
            if rxe {
                if hosts < 2 {
                    return Err("--rxe runs ucxkit-perf between h0 and h1: make 2 hosts or more".into());
                }
                if let Err(why) = rig::rxe_available() {
                    println!("ucxkit-rig: {why}; no rig was made (exit code {EXIT_NO_RXE})");
                    return Ok(ExitCode::from(EXIT_NO_RXE));
                }
            }
            let owner = if keep { None } else { caller() };
            let r = Rig::create(&name, hosts, rate.as_deref(), owner)?;
            if json {
                println!("{}", hosts_json(&r));
            } else {
                print_hosts(&r);
            }
            if rxe {
                rxe::run(&r)?;
            }
        }
        Cmd::Down { name, all } => {
            let names = if all { Rig::names() } else { vec![name] };
            for n in names {
                Rig::remove(&n)?;
                println!("rig {n} removed: no namespace, link, rule or delay program of it is left");
            }
        }
        Cmd::List { json } => {
            Rig::remove_stale()?;
            for n in Rig::names() {
                let r = Rig::open(&n)?;
                if json {
                    println!("{}", hosts_json(&r));
                    continue;
                }
                let owner = match r.record().owner {
                    Some(o) => format!("owned by process {}", o.pid),
                    None => "kept until down".into(),
                };
                println!("rig {n}: {} hosts, {owner}", r.hosts().len());
                print_hosts(&r);
            }
        }
        Cmd::Exec { host, name, cmd } => {
            let r = Rig::open(&name)?;
            let mut c = r.command(host_index(&host)?, &cmd[0])?;
            // Only returns when it could not run.
            return Err(format!("running {}: {}", cmd[0], c.args(&cmd[1..]).exec()));
        }
        Cmd::Fault { host, words, name } => {
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            let fault = Fault::parse(&words)?;
            let mut r = Rig::open(&name)?;
            r.delay_program = Some(std::env::current_exe().map_err(|e| e.to_string())?);
            r.set(host_index(&host)?, &fault)?;
            println!("h{}: {fault}", host_index(&host)?);
        }
        Cmd::Soak(a) => soak::run(a)?,
        Cmd::SoakNode { index, hosts, seed, epoch } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(soak_node::run(index, hosts, seed, epoch))?;
        }
        Cmd::DelayServe { rig, host, words } => {
            let mut all = vec!["delay"];
            all.extend(words.iter().map(String::as_str));
            let Fault::Delay(spec) = Fault::parse(&all)? else { return Err("not a delay".into()) };
            rig::serve_delay(&rig, host, spec)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ucxkit-rig: {e}");
            ExitCode::FAILURE
        }
    }
}
