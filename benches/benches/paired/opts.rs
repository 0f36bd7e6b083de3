//! The command line of the paired benchmark: which test, sizes, chunks, placement.

use super::*;

/// Which test a run pairs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Test {
    /// Tag ping-pong, one-way latency.
    TagLat,
    /// Windowed tag streaming, bandwidth.
    TagBw,
    /// Active-message ping-pong (no header), one-way latency.
    AmLat,
    /// Ping-pong on the endpoint's byte stream, one-way latency.
    StreamLat,
    /// Windowed stream sends, received whole (`WAITALL`), bandwidth.
    StreamBw,
    /// Windowed active messages (no header), rendezvous payloads fetched, bandwidth.
    AmBw,
    /// Windowed puts into the server's region, then a flush, bandwidth.
    PutBw,
    /// Windowed gets from the server's region, then a flush, bandwidth.
    GetBw,
}

impl Test {
    pub(crate) fn is_bw(self) -> bool {
        matches!(self, Test::TagBw | Test::StreamBw | Test::AmBw | Test::PutBw | Test::GetBw)
    }

    pub(crate) fn is_rma(self) -> bool {
        matches!(self, Test::PutBw | Test::GetBw)
    }
}

/// Largest message `--immediate` applies to: longer ones never complete during the call,
/// and trying each first would add a refused call per message (as in `ucxkit-perf`).
pub(crate) const IMMEDIATE_MAX: usize = 8 << 10;

/// Largest `am_lat` message: the raw side's handler only counts arrivals, so payloads
/// must arrive eager (rendezvous data would need fetching).
pub(crate) const AM_LAT_MAX: usize = 1024;

/// What the command line asks for.
#[derive(Clone)]
pub(crate) struct Opts {
    pub(crate) test: Test,
    pub(crate) tls: String,
    pub(crate) size: usize,
    pub(crate) chunks: u64,
    pub(crate) iters: u64,
    pub(crate) window: usize,
    /// Latency tests: the client's wait before each round trip.
    pub(crate) pause: Duration,
    pub(crate) cpus: [usize; 2],
    /// `tag_bw`, `put_bw`: ucxkit sends through `try_tag_send` (`try_put`) first.
    pub(crate) immediate: bool,
    /// The server runs in a child process.
    pub(crate) processes: bool,
    /// This is that child: the port of the parent's setup socket.
    pub(crate) serve: Option<u16>,
}

pub(crate) fn usage(msg: &str) -> ! {
    eprintln!("paired: {msg}");
    eprintln!(
        "usage: paired [--test tag_lat|tag_bw|am_lat|am_bw|stream_lat|stream_bw|put_bw|get_bw] [--tls LIST] [--size BYTES] [--chunks N] [--iters N] [--window N] [--pause-us N] [--cpus A,B] [--immediate] [--processes] [FILTER]"
    );
    std::process::exit(2);
}

/// A byte count with an optional binary suffix: `8`, `64K`, `16M`, `1G`.
pub(crate) fn parse_size(v: &str) -> Option<usize> {
    let (digits, shift) = match v.as_bytes().last()?.to_ascii_uppercase() {
        b'K' => (&v[..v.len() - 1], 10),
        b'M' => (&v[..v.len() - 1], 20),
        b'G' => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

pub(crate) fn parse_opts() -> Opts {
    let mut o = Opts {
        test: Test::TagLat,
        tls: "posix,self".into(),
        size: 8,
        chunks: 40,
        iters: 0,
        window: 32,
        pause: Duration::ZERO,
        cpus: [0, 1],
        immediate: false,
        processes: false,
        serve: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // `cargo bench` passes `--bench` to every benchmark binary.
        if a == "--bench" {
            continue;
        }
        let mut value = || args.next().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        let number =
            |v: String| v.parse::<u64>().unwrap_or_else(|_| usage(&format!("{a}: not a number: {v}")));
        match a.as_str() {
            "--test" => {
                o.test = match value().as_str() {
                    "tag_lat" => Test::TagLat,
                    "tag_bw" => Test::TagBw,
                    "am_lat" => Test::AmLat,
                    "am_bw" => Test::AmBw,
                    "stream_lat" => Test::StreamLat,
                    "stream_bw" => Test::StreamBw,
                    "put_bw" => Test::PutBw,
                    "get_bw" => Test::GetBw,
                    t => usage(&format!(
                        "--test is tag_lat, tag_bw, am_lat, am_bw, stream_lat, stream_bw, put_bw or get_bw, not {t}"
                    )),
                }
            }
            "--tls" => o.tls = value(),
            "--window" => o.window = number(value()) as usize,
            "--size" => {
                let v = value();
                o.size = parse_size(&v).unwrap_or_else(|| usage(&format!("--size: not a size: {v}")));
            }
            "--chunks" => o.chunks = number(value()),
            "--iters" => o.iters = number(value()),
            "--pause-us" => o.pause = Duration::from_micros(number(value())),
            "--immediate" => o.immediate = true,
            "--processes" => o.processes = true,
            "--serve" => {
                let v = value();
                o.serve = Some(v.parse().unwrap_or_else(|_| usage(&format!("--serve: not a port: {v}"))));
            }
            "--cpus" => {
                let v = value();
                let c: Vec<usize> = v.split(',').filter_map(|x| x.parse().ok()).collect();
                o.cpus = match c[..] {
                    [a, b] => [a, b],
                    _ => usage(&format!("--cpus wants two CPU numbers, got {v}")),
                };
            }
            // A name filter, as `cargo bench -- FILTER` passes to every benchmark binary:
            // run only if it matches this benchmark, like criterion's benchmarks.
            f if !f.starts_with('-') => {
                if !"paired".contains(f) {
                    std::process::exit(0);
                }
            }
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    if o.iters == 0 {
        o.iters = match o.test {
            t if t.is_bw() => ((1u64 << 30) / o.size.max(1) as u64).clamp(64, 20_000),
            _ if !o.pause.is_zero() => (100_000 / (o.pause.as_micros() as u64 + 1)).clamp(50, 4000),
            _ => 4000,
        };
    }
    if o.test == Test::AmLat && o.size > AM_LAT_MAX {
        usage(&format!("am_lat sizes go up to {AM_LAT_MAX} bytes"));
    }
    if o.immediate && !matches!(o.test, Test::TagBw | Test::PutBw) {
        usage("--immediate is for tag_bw and put_bw");
    }
    if o.immediate && o.size > IMMEDIATE_MAX {
        usage(&format!("--immediate is for messages up to {IMMEDIATE_MAX} bytes (UCX's short protocol)"));
    }
    if o.test.is_bw() && !o.pause.is_zero() {
        usage("--pause-us is for the latency tests");
    }
    if o.chunks < 2 || o.chunks % 2 != 0 || o.window == 0 {
        usage("needs an even number of chunks (they come in pairs), at least 2, and a window of at least 1");
    }
    o
}
