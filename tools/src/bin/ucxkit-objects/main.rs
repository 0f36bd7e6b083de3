//! `ucxkit-objects`: moves objects between ucxkit object nodes and measures it.
//!
//! ```text
//! ucxkit-objects bench                               # 1 MiB to 256 MiB, one receiver, shm
//! ucxkit-objects bench --receivers 2 --sizes 256M --compare
//! ucxkit-objects bench --receivers 4 --ops pull,direct,chain,tree2 --transport tcp
//! ucxkit-objects serve --listen 0.0.0.0:13340 FILE...
//! ucxkit-objects get --from HOST:13340 NAME --out FILE
//! ```
//!
//! `bench` starts a holder process and `--receivers` receiver processes of this program
//! on this host; the holder seals one object per size, the receivers pull it at once
//! (each its own copy, released after each pull) and report their time; the slowest
//! receiver's time counts; `--ops` adds broadcasts from the holder in a shape, the
//! receivers relaying to one another. `--compare` runs `ucx_perftest -t tag_bw` on the same
//! transports and sizes in the same run and prints the ratio.

#![forbid(unsafe_code)]

mod bench;
mod files;
mod role;

use std::time::Duration;

use clap::{Parser, Subcommand};
use ucxkit::object_push::{NodeOptions, Verify};
use ucxkit_tools::cli::{self, parse_duration, Output, Progress, Transport};

/// Moves objects between ucxkit object nodes and measures it.
#[derive(Parser, Debug)]
#[command(name = "ucxkit-objects", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Pull objects of several sizes from a holder into receivers on this host, timed.
    Bench(bench::BenchArgs),
    /// Serve files as objects (each named by its file name) until interrupted.
    Serve(files::ServeArgs),
    /// Pull one object from a serving node into a file.
    Get(files::GetArgs),
    /// (Started by `bench`.) Hold the objects.
    #[command(hide = true)]
    Holder(role::RoleArgs),
    /// (Started by `bench`.) Pull on command.
    #[command(hide = true)]
    Receiver(role::RoleArgs),
}

/// How the nodes are set up: the options every subcommand shares.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct NodeArgs {
    /// UCX transports.
    #[arg(long, value_enum, default_value = "shm")]
    pub(crate) transport: Transport,
    /// How workers make progress.
    #[arg(long, value_enum, default_value = "event")]
    progress: Progress,
    /// Event progress: how long a worker keeps polling after its last event before it
    /// sleeps (`0`: at once).
    #[arg(long, default_value = "50us", value_parser = parse_span)]
    linger: Duration,
    /// Chunk size of the objects sealed (K/M suffixes), or `auto` (1 MiB, doubled while
    /// an object would have over 64 chunks, up to 4 MiB).
    #[arg(long, default_value = "auto", value_parser = parse_chunk)]
    chunk: u32,
    /// Chunks in flight per pull.
    #[arg(long, default_value_t = 8)]
    window: u32,
    /// Bytes in flight per holder reached over a network, at most (K/M/G suffixes).
    #[arg(long, default_value = "8M", value_parser = parse_bytes)]
    network_window: u64,
    /// Deadline of each pull.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    deadline: Duration,
    /// Which chunks are checked against their checksums: `always`, or `other-hosts`
    /// (not those from a holder on this host).
    #[arg(long, default_value = "other-hosts", value_parser = parse_verify)]
    verify: Verify,
}

impl NodeArgs {
    fn options(&self) -> NodeOptions {
        NodeOptions {
            chunk: self.chunk,
            window: self.window,
            network_window: self.network_window,
            deadline: self.deadline,
            verify: self.verify,
            ..NodeOptions::default()
        }
    }

    /// This node's worker (on a context of the chosen transports).
    fn worker(&self) -> Result<ucxkit::transport::Worker, String> {
        let ctx =
            self.transport.apply(ucxkit::transport::Context::builder()).build().map_err(|e| e.to_string())?;
        ctx.worker()
            .progress_mode(self.progress.mode())
            .event_linger(self.linger)
            .build()
            .map_err(|e| e.to_string())
    }

    /// The same options as command-line arguments, for the processes `bench` starts.
    fn to_args(&self) -> Vec<String> {
        vec![
            format!("--transport={}", self.transport.name()),
            format!("--progress={}", self.progress.name()),
            format!("--linger={}us", self.linger.as_micros()),
            format!("--chunk={}", self.chunk),
            format!("--window={}", self.window),
            format!("--network-window={}", self.network_window),
            format!("--deadline={}s", self.deadline.as_secs_f64()),
            format!("--verify={}", verify_name(self.verify)),
        ]
    }
}

/// A duration that may be zero (`0`, `0us`), or one such as `50us`, `200ms`, `1s`.
pub(crate) fn parse_span(s: &str) -> Result<Duration, String> {
    if s == "0" || s == "0us" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

fn parse_verify(s: &str) -> Result<Verify, String> {
    match s {
        "always" => Ok(Verify::Always),
        "other-hosts" => Ok(Verify::OtherHosts),
        _ => Err(format!("{s}: not always or other-hosts")),
    }
}

fn verify_name(v: Verify) -> &'static str {
    match v {
        Verify::Always => "always",
        Verify::OtherHosts => "other-hosts",
    }
}

/// A byte count (K/M/G suffixes).
fn parse_bytes(s: &str) -> Result<u64, String> {
    ucxkit_tools::size::parse_size(s).map(|n| n as u64)
}

/// A chunk size, or `auto` (also written as 0, as `to_args` passes it on).
fn parse_chunk(s: &str) -> Result<u32, String> {
    if s == "auto" {
        return Ok(ucxkit::object_push::sums::AUTO_CHUNK);
    }
    let n = ucxkit_tools::size::parse_size(s)?;
    u32::try_from(n).map_err(|_| format!("{s}: chunk too large"))
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let rt = rt.unwrap_or_else(|e| cli::die("ucxkit-objects", format!("runtime: {e}")));
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::Serve(a) => files::serve(a).await,
            Cmd::Get(a) => files::get(a).await,
            Cmd::Holder(a) => role::holder(a).await,
            Cmd::Receiver(a) => role::receiver(a).await,
        }
    });
    if let Err(e) = r {
        cli::die("ucxkit-objects", e);
    }
}

/// Output options, re-exported for the subcommands.
pub(crate) type OutputArgs = Output;
