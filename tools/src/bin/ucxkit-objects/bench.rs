//! `bench`: a holder and `--receivers` receivers on this host; every size moved `--reps`
//! times by each of `--ops` (all receivers pulling at once, the slowest receiver's time
//! counted; or a broadcast in a shape, timed by the holder until every receiver holds
//! it), the median repetition reported; `--compare` adds `ucx_perftest -t tag_bw`, run
//! after each repetition of the first op, and the median of the paired ratios.

use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use std::net::IpAddr;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use ucxkit::object_push::Shape;
use ucxkit_testkit::rig::{Host, Rig};
use ucxkit_tools::perftest;
use ucxkit_tools::size::{format_size, parse_sizes};

use crate::{NodeArgs, OutputArgs};

/// `bench`'s arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {
    /// Object sizes, comma-separated (K/M/G: powers of 1024).
    #[arg(short, long, default_value = "1M,16M,256M")]
    sizes: String,
    /// Receiver processes pulling each object at once.
    #[arg(short, long, default_value_t = 1)]
    receivers: usize,
    /// What to time, comma-separated: `pull` (every receiver pulls from the holder),
    /// `swarm` (every receiver pulls from the holder and the receivers started before
    /// it, chunks spread over all of them), `single` (the first receiver alone pulls: one
    /// transfer, the yardstick of the others), or a broadcast from the holder: `direct`,
    /// `chain`, `tree<fan-out>`, or `auto` (the shape the holder's cost model picks,
    /// reported as `auto:SHAPE`).
    #[arg(long, default_value = "pull", value_delimiter = ',')]
    ops: Vec<Op>,
    /// Arrival skew: `pull` and `swarm` start receiver i this much after receiver i-1,
    /// and are timed from the first start to the last end (broadcasts offer to every
    /// receiver at once).
    #[arg(long, default_value = "0", value_parser = crate::parse_span)]
    skew: Duration,
    /// Repetitions per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Also run `ucx_perftest -t tag_bw` on the same transports and sizes, in the error
    /// mode of the receivers' connections (`-e` where they use UCX's peer mode, as over
    /// TCP), once after each repetition of the first op; the ratio is the median of
    /// those pairs'.
    #[arg(long)]
    compare: bool,
    /// Check every pulled object's bytes (outside the time).
    #[arg(long)]
    check: bool,
    /// Pin the holder to CPU 0 and receiver i to CPU i+1 (mod the CPUs), and
    /// ucx_perftest's server and client to CPUs 0 and 1.
    #[arg(long)]
    pin: bool,
    /// Run the holder and every receiver on a host of its own (network namespaces on one
    /// switch, made and removed by the bench), each link limited to this rate both ways
    /// (tc's units: `1gbit`, `200mbit`; `none`: not limited). Over TCP.
    #[arg(long)]
    netns: Option<String>,
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    output: OutputArgs,
}

/// One way of moving an object to the receivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// Every receiver pulls it from the holder.
    Pull,
    /// Every receiver pulls it from the holder and the receivers before it.
    Swarm,
    /// The first receiver alone pulls it.
    Single,
    /// The holder broadcasts it in a shape.
    Broadcast(Shape),
    /// The holder broadcasts it in the shape its cost model picks.
    Auto,
}

impl std::str::FromStr for Op {
    type Err = String;
    fn from_str(s: &str) -> Result<Op, String> {
        match s {
            "pull" => Ok(Op::Pull),
            "swarm" => Ok(Op::Swarm),
            "single" => Ok(Op::Single),
            "auto" => Ok(Op::Auto),
            s => s.parse().map(Op::Broadcast).map_err(|e| format!("{e} (or pull, single)")),
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Pull => write!(f, "pull"),
            Op::Swarm => write!(f, "swarm"),
            Op::Single => write!(f, "single"),
            Op::Broadcast(s) => write!(f, "{s}"),
            Op::Auto => write!(f, "auto"),
        }
    }
}

/// How long a started process may take to say it is ready.
const START_LIMIT: Duration = Duration::from_secs(120);

/// A process `bench` started, with its stdin and stdout lines.
struct Proc {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

/// Where a started process runs: on this host, or on a host of a switch, where it listens
/// on its address and reaches the holder at the holder's.
struct Place<'a> {
    host: Option<&'a Host>,
    holder: IpAddr,
}

impl Proc {
    fn start(
        role: &str,
        port: u16,
        sizes: &str,
        cpu: Option<usize>,
        check: bool,
        node: &NodeArgs,
        place: &Place<'_>,
    ) -> Result<Proc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
        let mut c = match place.host {
            Some(h) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &h.ns]).arg(exe).env("UCX_NET_DEVICES", &h.dev);
                c.arg(role).arg(format!("--ip={}", h.addr));
                c
            }
            None => {
                let mut c = Command::new(exe);
                c.arg(role);
                c
            }
        };
        c.arg(format!("--port={port}"))
            .arg(format!("--holder-ip={}", place.holder))
            .arg(format!("--sizes={sizes}"));
        if let Some(cpu) = cpu {
            c.arg(format!("--cpu={cpu}"));
        }
        if check {
            c.arg("--check");
        }
        c.args(node.to_args()).stdin(Stdio::piped()).stdout(Stdio::piped()).kill_on_drop(true);
        let mut child = c.spawn().map_err(|e| format!("starting the {role}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        Ok(Proc { _child: child, stdin, lines })
    }

    async fn line(&mut self, limit: Duration) -> Result<String, String> {
        match tokio::time::timeout(limit, self.lines.next_line()).await {
            Ok(Ok(Some(l))) => Ok(l),
            Ok(Ok(None)) => Err("a process ended early (see its message above)".into()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {limit:?}")),
        }
    }

    async fn expect(&mut self, what: &str) -> Result<(), String> {
        let l = self.line(START_LIMIT).await?;
        if l != what {
            return Err(format!("expected {what:?}, got {l:?}"));
        }
        Ok(())
    }
}

/// One result row.
struct Row {
    op: String,
    size: usize,
    receivers: usize,
    time_us: f64,
    /// The receivers' largest peak resident memory after this size, MiB (0: not known).
    peak_mib: f64,
    source: &'static str,
}

impl Row {
    fn mibps(&self) -> f64 {
        self.size as f64 / (self.time_us * 1e-6) / f64::from(1 << 20)
    }
}

pub(crate) async fn run(a: BenchArgs) -> Result<(), String> {
    let sizes = parse_sizes(&a.sizes)?;
    if a.receivers == 0 || a.reps == 0 {
        return Err("--receivers and --reps must be at least 1".into());
    }
    let list = sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let port = ucxkit_tools::cli::free_port()?;
    let mut a = a;
    // Removed (with the processes in it killed first) when the bench ends, either way.
    let switch = match &a.netns {
        Some(rate) => {
            if a.compare {
                return Err("--compare runs ucx_perftest on this host: leave it out with --netns".into());
            }
            a.node.transport = ucxkit_tools::cli::Transport::Tcp;
            let rate = (rate != "none").then_some(rate.as_str());
            Some(Rig::up(a.receivers + 1, rate)?)
        }
        None => None,
    };
    let host = |i: usize| switch.as_ref().map(|s| &s.hosts()[i]);
    let holder_ip = host(0).map_or(IpAddr::from([127, 0, 0, 1]), |h| h.addr);
    let place = |i| Place { host: host(i), holder: holder_ip };
    let mut holder = Proc::start("holder", port, &list, a.pin.then_some(0), false, &a.node, &place(0))?;
    holder.expect("ready").await?;
    let mut receivers = Vec::new();
    let mut addrs = Vec::new();
    let mut lanes = Vec::new();
    // Whether the first receiver's connection to the holder uses UCX's peer error mode.
    let mut peer_mode = None;
    for i in 0..a.receivers {
        let mut r =
            Proc::start("receiver", port, &list, a.pin.then_some(i + 1), a.check, &a.node, &place(i + 1))?;
        let l = r.line(START_LIMIT).await?;
        let mut words = l.strip_prefix("connected ").unwrap_or_default().split(' ');
        let (Some(addr), Some(their_lanes), Some(mode @ ("peer" | "none"))) =
            (words.next(), words.next(), words.next())
        else {
            return Err(format!("expected \"connected ADDR LANES peer|none\", got {l:?}"));
        };
        addrs.push(addr.to_string());
        if !lanes.contains(&their_lanes.to_string()) {
            lanes.push(their_lanes.to_string());
        }
        peer_mode.get_or_insert(mode == "peer");
        receivers.push(r);
    }
    let peer_mode = peer_mode.unwrap_or(false);
    // ucx_perftest over the network devices of the first receiver's lanes (the same rails).
    let net_devices = perftest::net_devices(
        lanes.first().into_iter().flat_map(|l| l.split(',')).filter_map(|l| Some(l.split_once('/')?.1)),
    );
    if a.output.table() {
        // How the chunks move: the data path is chosen per endpoint by UCX's rendezvous.
        println!(
            "# chunks: tagged rendezvous into the receiver's buffer; receivers' lanes to the holder: {}; \
             error mode {}",
            lanes.join(" | "),
            if peer_mode { "peer (ucx_perftest -e)" } else { "none" }
        );
    }
    let limit = a.node.deadline + Duration::from_secs(10);
    let mut rows = Vec::new();
    for &size in &sizes {
        // With --compare, ucx_perftest runs after each repetition of the first op, and
        // each pair gives a ratio: this machine's speed drifts between repetitions.
        let mut theirs: Vec<Row> = Vec::new();
        let mut paired: Vec<f64> = Vec::new();
        for &op in &a.ops {
            let mut times = Vec::new();
            let mut peak = 0f64;
            let mut name = op.to_string();
            for _ in 0..a.reps {
                let (t, p) = match op {
                    Op::Pull => pull(&mut receivers, size, a.skew, None, limit).await?,
                    Op::Swarm => pull(&mut receivers, size, a.skew, Some(&addrs), limit).await?,
                    Op::Single => pull(&mut receivers[..1], size, Duration::ZERO, None, limit).await?,
                    Op::Broadcast(shape) => {
                        broadcast(&mut holder, &mut receivers, size, shape.to_string(), limit).await?.0
                    }
                    Op::Auto => {
                        let (tp, taken) =
                            broadcast(&mut holder, &mut receivers, size, "auto".into(), limit).await?;
                        name = format!("auto:{taken}");
                        tp
                    }
                };
                times.push(t);
                peak = peak.max(p);
                if a.compare && op == a.ops[0] {
                    let row = perftest_row(&a, size, net_devices.as_deref(), peer_mode)?;
                    paired.push(row.time_us / t);
                    theirs.push(row);
                }
            }
            let time_us = median(&mut times).ok_or("no repetitions")?;
            let receivers = if op == Op::Single { 1 } else { a.receivers };
            let row = Row { op: name, size, receivers, time_us, peak_mib: peak, source: "ucxkit" };
            // Against one transfer of the same size, where measured before it.
            let single = rows.iter().rev().find(|r: &&Row| r.size == size && r.op == "single");
            let x_single = single.filter(|_| op != Op::Single).map(|s| time_us / s.time_us);
            print(&a, &row, None, x_single, rows.is_empty());
            rows.push(row);
        }
        if let Some(ratio) = median(&mut paired) {
            // ucx_perftest's median repetition, and the median of the paired ratios of
            // the first op's bandwidth to ucx_perftest's.
            theirs.sort_by(|x, y| x.time_us.total_cmp(&y.time_us));
            let row = theirs.swap_remove(theirs.len() / 2);
            print(&a, &row, Some(ratio), None, false);
            rows.push(row);
        }
    }
    if let Some(path) = &a.output.plot {
        let points: Vec<_> = rows.iter().flat_map(plot_rows).collect();
        let svg = ucxkit_tools::plot::render(&points, "ucxkit-objects", &|t: &str| t.ends_with(" time"))?;
        std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    drop(receivers);
    drop(holder);
    drop(switch);
    Ok(())
}

/// The median of `v` (the upper one of an even count), or `None` when it is empty.
fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// Every receiver pulls the object of `size` bytes, receiver i starting `skew` after
/// receiver i-1: from the holder, or (`swarm`: the receivers' listening addresses) from
/// the holder and the receivers before it. The time from the first start to the last
/// end (microseconds) and the largest peak resident memory (MiB).
async fn pull(
    receivers: &mut [Proc],
    size: usize,
    skew: Duration,
    swarm: Option<&[String]>,
    limit: Duration,
) -> Result<(f64, f64), String> {
    let start = tokio::time::Instant::now();
    for (i, r) in receivers.iter_mut().enumerate() {
        tokio::time::sleep_until(start + skew * i as u32).await;
        let command = match swarm {
            Some(addrs) => format!("swarm {size} {}\n", addrs[..i].join(",")),
            None => format!("pull {size}\n"),
        };
        r.stdin.write_all(command.as_bytes()).await.map_err(|e| e.to_string())?;
    }
    let (mut end, mut peak) = (0f64, 0f64);
    for (i, r) in receivers.iter_mut().enumerate() {
        let l = r.line(limit).await?;
        let bad = || format!("a receiver said {l:?}");
        let (us, kib) = l.split_once(' ').ok_or_else(bad)?;
        let at = skew.as_secs_f64() * 1e6 * i as f64;
        end = end.max(at + us.parse::<f64>().map_err(|_| bad())?);
        peak = peak.max(kib.parse::<f64>().map_err(|_| bad())? / 1024.0);
    }
    if swarm.is_some() {
        for r in receivers.iter_mut() {
            r.stdin.write_all(format!("release {size}\n").as_bytes()).await.map_err(|e| e.to_string())?;
            let l = r.line(limit).await?;
            peak = peak.max(l.parse::<f64>().map_err(|_| format!("a receiver said {l:?}"))? / 1024.0);
        }
    }
    Ok((end, peak))
}

/// The holder broadcasts the object of `size` bytes in `shape` (a shape's name, or
/// `auto`): its time (microseconds) and the receivers' largest peak resident memory
/// (MiB), read as they release it, with the shape it took.
async fn broadcast(
    holder: &mut Proc,
    receivers: &mut [Proc],
    size: usize,
    shape: String,
    limit: Duration,
) -> Result<((f64, f64), String), String> {
    holder
        .stdin
        .write_all(format!("broadcast {size} {shape}\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let l = holder.line(limit).await?;
    let bad = || format!("the holder said {l:?}");
    let (us, taken) = l.split_once(' ').ok_or_else(bad)?;
    let us = us.parse::<f64>().map_err(|_| bad())?;
    let taken = taken.to_string();
    let mut peak = 0f64;
    for r in receivers.iter_mut() {
        r.stdin.write_all(format!("release {size}\n").as_bytes()).await.map_err(|e| e.to_string())?;
        let l = r.line(limit).await?;
        peak = peak.max(l.parse::<f64>().map_err(|_| format!("a receiver said {l:?}"))? / 1024.0);
    }
    Ok(((us, peak), taken))
}

/// `ucx_perftest -t tag_bw` at `size` on the bench's transports, network devices,
/// progress mode and the receivers' error mode (`peer_mode`: `-e`, as a pull's endpoint
/// over TCP has it).
fn perftest_row(
    a: &BenchArgs,
    size: usize,
    net_devices: Option<&str>,
    peer_mode: bool,
) -> Result<Row, String> {
    let tls = a.node.transport.tls();
    let setup = perftest::Setup {
        tls: tls.as_deref(),
        peer_mode,
        sleep: a.node.progress == ucxkit_tools::cli::Progress::Event,
        cpu: a.pin.then_some(1),
        server_cpu: a.pin.then_some(0),
        window: 32,
        net_devices,
        mem: None,
    };
    // About 4 GiB moved, at least 10 and at most 10,000 messages.
    let iters = ((4u64 << 30) / size.max(1) as u64).clamp(10, 10_000);
    let case = perftest::Case {
        test: "tag_bw",
        size,
        iters,
        warmup: (iters / 10).max(2),
        latency: false,
        one_sided: false,
    };
    let v = perftest::run(&case, &setup)?;
    // Overall bandwidth (MB/s, 2^20 bytes) as time per message.
    let time_us = size as f64 / (v[5] * f64::from(1 << 20)) * 1e6;
    Ok(Row { op: "tag_bw".into(), size, receivers: 1, time_us, peak_mib: 0.0, source: "ucx_perftest" })
}

/// A row as the plotting module's points: bandwidth, and time per pull (ucx_perftest's
/// under the same names, drawn dashed beside ucxkit's).
fn plot_rows(r: &Row) -> [ucxkit_tools::report::Row; 2] {
    use ucxkit_tools::report::Row as Point;
    // ucx_perftest's one transfer is drawn beside the first op's.
    let op = if r.source == "ucx_perftest" { "pull" } else { &r.op };
    [
        Point::point(op, r.size, 0.0, r.mibps(), r.source),
        Point::point(format!("{op} time"), r.size, r.time_us, 0.0, r.source),
    ]
}

/// Prints a row; `ratio` is ucxkit's bandwidth over ucx_perftest's (on ucx_perftest's
/// row), `x_single` the row's time over one transfer's.
fn print(a: &BenchArgs, r: &Row, ratio: Option<f64>, x_single: Option<f64>, first: bool) {
    let (op, receivers) = (r.op.as_str(), r.receivers);
    let net = a.netns.as_deref().unwrap_or("");
    // The chunk the object was cut in (an automatic one grows with the size).
    let chunk = ucxkit::object_push::sums::chunk_for(r.size as u64, a.node.chunk);
    if a.output.json {
        let mut v = json!({
            "op": op, "bytes": r.size, "receivers": receivers, "time_us": (r.time_us * 10.0).round() / 10.0,
            "mibps": r.mibps().round(), "peak_rss_mib": r.peak_mib.round(), "chunk": chunk, "window": a.node.window, "network_window": a.node.network_window,
            "transport": a.node.transport.name(), "netns": net, "source": r.source,
        });
        if let Some(x) = ratio {
            v["ratio"] = json!((x * 1000.0).round() / 1000.0);
        }
        if let Some(x) = x_single {
            v["x_single"] = json!((x * 1000.0).round() / 1000.0);
        }
        println!("{v}");
        return;
    }
    if a.output.csv {
        if first {
            println!("op,bytes,receivers,time_us,mibps,peak_rss_mib,chunk,window,network_window,transport,netns,source,ratio,x_single");
        }
        let ratio = ratio.map_or(String::new(), |x| format!("{x:.3}"));
        let x_single = x_single.map_or(String::new(), |x| format!("{x:.3}"));
        println!(
            "{op},{},{},{:.1},{:.0},{:.0},{},{},{},{},{net},{},{ratio},{x_single}",
            r.size,
            receivers,
            r.time_us,
            r.mibps(),
            r.peak_mib,
            chunk,
            a.node.window,
            a.node.network_window,
            a.node.transport.name(),
            r.source
        );
        return;
    }
    if first {
        println!(
            "{:<11} {:>9} {:>9} {:>12} {:>10} {:>9}  {:<12} {:>6} {:>8}",
            "op", "size", "receivers", "time_us", "MiB/s", "peak_MiB", "source", "ratio", "x_single"
        );
    }
    let ratio = ratio.map_or(String::new(), |x| format!("{x:.2}"));
    let x_single = x_single.map_or(String::new(), |x| format!("{x:.2}"));
    let peak = if r.peak_mib > 0.0 { format!("{:.0}", r.peak_mib) } else { "-".into() };
    println!(
        "{op:<11} {:>9} {:>9} {:>12.1} {:>10.0} {peak:>9}  {:<12} {ratio:>6} {x_single:>8}",
        format_size(r.size),
        receivers,
        r.time_us,
        r.mibps(),
        r.source
    );
}
