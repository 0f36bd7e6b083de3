//! Command-line conventions of the tools: the same options, spelled the same way, for
//! the transports, the progress and error modes, durations and output.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use ucxkit::transport::{ContextBuilder, ErrorMode, ProgressMode};

/// `--transport`: which UCX transports a tool's context uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// Shared memory (`UCX_TLS=posix,cma,tcp,self`; data goes over posix and cma, tcp is
    /// there for UCX's connection manager, which `--cm` connections use on one host).
    Shm,
    /// TCP (`UCX_TLS=tcp,self`).
    Tcp,
    /// Whatever UCX picks (`UCX_TLS` from the environment, default all).
    Auto,
}

impl Transport {
    /// The transport list (`UCX_TLS`) it stands for; for `Auto`, the environment's.
    pub fn tls(self) -> Option<String> {
        match self {
            Transport::Shm => Some("posix,cma,tcp,self".into()),
            Transport::Tcp => Some("tcp,self".into()),
            Transport::Auto => std::env::var("UCX_TLS").ok(),
        }
    }

    /// `b` limited to these transports (unchanged for `Auto`).
    pub fn apply(self, b: ContextBuilder) -> ContextBuilder {
        match self {
            Transport::Shm => b.transports("posix,cma,tcp,self"),
            Transport::Tcp => b.transports("tcp,self"),
            Transport::Auto => b,
        }
    }

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Auto => "auto",
        }
    }
}

/// Where a buffer lives, for `--mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory.
    Host,
    /// Memory of CUDA device 0 (feature `cuda`).
    Cuda,
}

impl MemKind {
    /// The name on the command line (and ucx_perftest's, for `-m`).
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Host => "host",
            MemKind::Cuda => "cuda",
        }
    }
}

/// `--mem SEND[,RECV]`: where each side's send and receive buffers live, as
/// `ucx_perftest -m` says it (`cuda` alone: both on the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mem {
    /// The memory messages are sent from.
    pub send: MemKind,
    /// The memory messages are received into.
    pub recv: MemKind,
}

impl Mem {
    /// Host memory on both sides: the default.
    pub const HOST: Mem = Mem { send: MemKind::Host, recv: MemKind::Host };

    /// Whether every buffer is in host memory.
    pub fn is_host(self) -> bool {
        self == Mem::HOST
    }

    /// `SEND,RECV`, as `--mem` and `ucx_perftest -m` take it.
    pub fn name(self) -> String {
        format!("{},{}", self.send.name(), self.recv.name())
    }

    /// `tls` with those of UCX's CUDA transports (cuda_copy, cuda_ipc) it does not name
    /// added, when a buffer is on the device; a list of exclusions (`^ib`) is left as
    /// it is (it keeps them unless it names them).
    pub fn with_device_transports(self, tls: &str) -> String {
        if self.is_host() || tls.starts_with('^') {
            return tls.to_string();
        }
        let mut out = tls.to_string();
        for t in ["cuda_copy", "cuda_ipc"] {
            if !tls.split(',').any(|x| x.trim() == t) {
                out.push(',');
                out.push_str(t);
            }
        }
        out
    }
}

/// Parses `--mem`: `host`, `cuda`, or two of them, comma-separated (send, receive).
pub fn parse_mem(s: &str) -> Result<Mem, String> {
    let kind = |k: &str| match k.trim() {
        "host" => Ok(MemKind::Host),
        "cuda" => Ok(MemKind::Cuda),
        other => Err(format!("unknown memory type {other:?} (host or cuda)")),
    };
    match s.split_once(',') {
        None => kind(s).map(|k| Mem { send: k, recv: k }),
        Some((a, b)) => Ok(Mem { send: kind(a)?, recv: kind(b)? }),
    }
}

/// `--progress`: how workers make progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Progress {
    /// Sleep on the worker's event fd (no CPU while idle).
    Event,
    /// Spin (lowest latency, one core at 100 %).
    Busy,
}

impl Progress {
    /// The worker's progress mode.
    pub fn mode(self) -> ProgressMode {
        match self {
            Progress::Event => ProgressMode::Event,
            Progress::Busy => ProgressMode::BusyPoll,
        }
    }

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Progress::Event => "event",
            Progress::Busy => "busy",
        }
    }
}

/// `--error-mode`: endpoint error handling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ErrMode {
    /// None for peers on this host, peer mode otherwise.
    Auto,
    /// UCX peer failure detection (no shared memory between processes in UCX 1.13).
    Peer,
    /// No UCX failure detection (same-host peers are watched by ucxkit).
    None,
}

impl ErrMode {
    /// The endpoints' error mode.
    pub fn mode(self) -> ErrorMode {
        match self {
            ErrMode::Auto => ErrorMode::Auto,
            ErrMode::Peer => ErrorMode::Peer,
            ErrMode::None => ErrorMode::None,
        }
    }

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ErrMode::Auto => "auto",
            ErrMode::Peer => "peer",
            ErrMode::None => "none",
        }
    }
}

/// How results are printed and drawn: `--json`, `--csv`, `--plot`, `--quiet`.
#[derive(clap::Args, Debug, Clone)]
pub struct Output {
    /// Print one JSON object per line instead of a table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print CSV (a header line, then one line per row) instead of a table.
    #[arg(long)]
    pub csv: bool,
    /// Write an SVG plot of the results against message size to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// No progress display on stderr.
    #[arg(short, long)]
    pub quiet: bool,
}

impl Output {
    /// Whether results print as the aligned table (neither JSON nor CSV).
    pub fn table(&self) -> bool {
        !self.json && !self.csv
    }
}

/// Parses a duration such as `2s`, `500ms`, `50us`, `10m`, `1h` or `1.5` (seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 2s, 500ms)"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("{s:?}: duration must be positive"));
    }
    Duration::try_from_secs_f64(v * mult).map_err(|_| format!("{s:?}: duration out of range"))
}

/// Writes a line to stdout, returning the error instead of panicking, so that a closed
/// stdout (the reader of a pipe went away, as `| head` does) ends the run quietly.
pub fn out(line: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_fmt(line)?;
    o.write_all(b"\n")
}

/// Whether `e` is a write to a pipe whose reader has gone.
pub fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// A TCP port on 127.0.0.1 free a moment ago, for a server a tool starts and tells its
/// clients about (drawn below the ephemeral range: see [`ucxkit_testkit::ports`]).
///
/// # Errors
/// When no socket can be bound.
pub fn free_port() -> Result<u16, String> {
    ucxkit_testkit::ports::free_port().map_err(|e| format!("finding a free port: {e}"))
}

/// Pins the calling thread (and the threads it starts later) to CPU `n` modulo the
/// CPUs there are; does nothing where the CPUs cannot be listed.
pub fn pin_to_cpu(n: usize) {
    if let Some(ids) = core_affinity::get_core_ids().filter(|i| !i.is_empty()) {
        core_affinity::set_for_current(ids[n % ids.len()]);
    }
}

/// Prints `tool: msg` on stderr and exits with status 1.
pub fn die(tool: &str, msg: impl std::fmt::Display) -> ! {
    eprintln!("{tool}: {msg}");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_as_ucx_perftest_spells_them() {
        assert_eq!(parse_mem("host"), Ok(Mem::HOST));
        let m = parse_mem("cuda").unwrap();
        assert_eq!((m.send, m.recv), (MemKind::Cuda, MemKind::Cuda));
        let m = parse_mem("host,cuda").unwrap();
        assert_eq!((m.send, m.recv, m.name().as_str()), (MemKind::Host, MemKind::Cuda, "host,cuda"));
        assert!(parse_mem("gpu").is_err() && parse_mem("cuda,").is_err());
        assert_eq!(m.with_device_transports("posix,self"), "posix,self,cuda_copy,cuda_ipc");
        assert_eq!(m.with_device_transports("cuda_copy,tcp"), "cuda_copy,tcp,cuda_ipc");
        assert_eq!(m.with_device_transports("tcp,cuda_ipc,cuda_copy"), "tcp,cuda_ipc,cuda_copy");
        assert_eq!(m.with_device_transports("^ib"), "^ib");
        assert_eq!(Mem::HOST.with_device_transports("tcp"), "tcp");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("50us"), Ok(Duration::from_micros(50)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in ["", "0", "-1s", "abc", "nan", "inf", "1e300", "5mm", "1e300h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
