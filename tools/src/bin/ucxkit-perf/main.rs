//! `ucxkit-perf`: latency and bandwidth of ucxkit's transport, in the spirit of
//! `ucx_perftest`, and side by side with it.
//!
//! ```text
//! ucxkit-perf                                   # loopback, tag tests
//! ucxkit-perf --test all --compare --plot perf.svg
//! ucxkit-perf --server --port 13337
//! ucxkit-perf --client HOST:13337 --test tag_bw --sizes 64K,1M
//! ```
//!
//! Without `--server`/`--client` the tool starts its own server process and runs over
//! loopback. Tests: `tag_lat`, `tag_bw`, `stream_lat`, `stream_bw`, `am_lat`, `am_bw`,
//! `put_lat`, `put_bw`, `get_bw`, `atomic_rate` (see [`bench::Test`]).
//!
//! The client drives: for each (test, size) it sends the server a one-line command on
//! the control tag, waits for `ready`, runs warm-up plus measured iterations, and reads
//! the server's `done`. With `--compare` it then runs `ucx_perftest` on the same test,
//! size, iterations, window, transports and pinning, and prints both rows and the ratio.

#![forbid(unsafe_code)]

mod bench;
mod clock;
mod device;
mod perftest;
mod timed;
mod window;

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use ucxkit::transport::{tag, Context, Endpoint, EndpointOptions, Worker, WorkerAddress};

use bench::{recv_ctrl, send_ctrl, Side, Test, CTRL};
use ucxkit_tools::cli::{self, parse_duration, ErrMode, Progress, Transport};
use ucxkit_tools::report::Row;
use ucxkit_tools::{plot, report, size};

/// Latency and bandwidth of ucxkit's transport, side by side with ucx_perftest.
#[derive(Parser, Debug, Clone)]
#[command(name = "ucxkit-perf", version)]
struct Args {
    /// Tests to run, comma-separated, or `all`: tag_lat, tag_bw, stream_lat, stream_bw,
    /// am_lat, am_bw, put_lat, put_bw, get_bw, atomic_rate.
    #[arg(short, long, value_delimiter = ',', default_values = ["tag_lat", "tag_bw"], value_parser = parse_test)]
    test: Vec<Vec<Test>>,
    /// Message sizes, comma-separated; K/M/G (and KiB/MiB/GiB) are powers of 1024, KB/MB/GB of 1000.
    #[arg(short, long, default_value = "8,4K,64K,1M,16M")]
    sizes: String,
    /// Measured iterations per size (default: scaled to the size, 100 to 20,000).
    #[arg(short = 'n', long)]
    iters: Option<u64>,
    /// Warm-up iterations per size (default: a tenth of the iterations).
    #[arg(short, long)]
    warmup: Option<u64>,
    /// Run each size for about this long instead of a fixed count (e.g. 2s, 500ms).
    #[arg(long, value_parser = parse_duration, conflicts_with = "iters")]
    duration: Option<Duration>,
    /// Outstanding messages in bandwidth tests.
    #[arg(long, default_value_t = 32)]
    window: usize,
    /// Receives (and active-message fetches) the bandwidth server keeps posted; default:
    /// the window. Messages up to 8 KiB are received each into its own buffer; larger
    /// ones all land in one registered buffer, as with ucx_perftest's receiver, so that
    /// a deep window does not stream distinct large buffers through memory.
    #[arg(long)]
    recv_window: Option<usize>,
    /// Bandwidth tests (tag_bw, am_bw, put_bw): send each message that UCX can complete
    /// during the call with ucxkit's borrowed-buffer calls (`try_tag_send`, `try_am_send`,
    /// `try_put`), and only the others as owned operations: the fastest way to send
    /// short messages.
    #[arg(long)]
    immediate: bool,
    /// Bandwidth tests: move data out of memory never written, as ucx_perftest's UCP
    /// tests do (they never write their buffers): the messages of tag_bw, stream_bw and
    /// am_bw, put_bw's source and get_bw's remote region are left as UCX allocated them.
    /// Untouched memory from the kernel reads as its shared zero page, which stays in
    /// cache, so copy-based transports (TCP) move large messages faster than real data.
    /// By default that memory is written before the run, as an application's data would
    /// be.
    #[arg(long, alias = "unwritten-send")]
    unwritten_source: bool,
    /// Where the send and receive buffers live: `host`, `cuda` (device 0), or
    /// `SEND,RECV` (`host,cuda`: host to device), on both sides, as `ucx_perftest -m`
    /// takes it. Device memory needs a build with the `cuda` feature and runs tag_lat
    /// and tag_bw; UCX's CUDA transports (cuda_copy, cuda_ipc) are added to the
    /// transports unless they name one. A standalone `--server` needs it too (for its
    /// transports).
    #[arg(long, value_parser = cli::parse_mem, default_value = "host")]
    mem: cli::Mem,
    /// UCX transports to use.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    transport: Transport,
    /// Exact UCX transport list (`UCX_TLS`), overriding --transport, e.g. `posix,self`.
    #[arg(long)]
    tls: Option<String>,
    /// Connect through a ucxkit `Listener` on the port (its front: ucxkit's handshake,
    /// then UCX's connection manager on loopback or the worker address) instead of
    /// exchanging worker addresses over a TCP socket on the port (the default, as
    /// ucx_perftest does).
    #[arg(long)]
    cm: bool,
    /// Progress mode.
    #[arg(long, value_enum, default_value_t = Progress::Busy)]
    progress: Progress,
    /// Endpoint error handling.
    #[arg(long, value_enum, default_value_t = ErrMode::Auto)]
    error_mode: ErrMode,
    /// Run as a server and wait for clients.
    #[arg(long, conflicts_with = "client")]
    server: bool,
    /// Server port (0 picks one and prints it).
    #[arg(long, default_value_t = 13337)]
    port: u16,
    /// Address the server binds.
    #[arg(long, default_value = "0.0.0.0")]
    bind: std::net::IpAddr,
    /// Connect to a server at HOST:PORT.
    #[arg(long)]
    client: Option<String>,
    /// Also run ucx_perftest (from ucx-utils) with the same test, size, iterations,
    /// window, transports and pinning, and print its row and the ratio. Which of the two
    /// runs first alternates from one test and size to the next (ucxkit first for the
    /// first), so that what a run leaves behind (warm caches, socket buffers, CPU
    /// frequency) favours neither.
    #[arg(long)]
    compare: bool,
    /// With --compare: start the alternation with ucx_perftest (repeated comparisons
    /// pass it every other time, so each test and size is measured in both orders).
    #[arg(long, requires = "compare")]
    perftest_first: bool,
    /// Fail unless the connection uses these UCX transports (comma-separated, e.g.
    /// `posix` or `rc_mlx5`), instead of silently measuring whatever UCX picked.
    #[arg(long, value_delimiter = ',')]
    require_transport: Vec<String>,
    /// Pin this process to a CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// In loopback mode, pin the spawned server to this CPU.
    #[arg(long)]
    server_cpu: Option<usize>,
    #[command(flatten)]
    output: cli::Output,
    /// Serve one client, then exit (used by the loopback mode).
    #[arg(long, hide = true)]
    once: bool,
}

fn parse_test(s: &str) -> Result<Vec<Test>, String> {
    if s == "all" {
        return Ok(Test::value_variants().to_vec());
    }
    Test::from_name(s).map(|t| vec![t]).ok_or_else(|| {
        let names: Vec<&str> = Test::value_variants().iter().map(|t| t.name()).collect();
        format!("unknown test {s:?} (one of {}, or all)", names.join(", "))
    })
}

/// `println!` that returns the error instead of panicking, so that a closed stdout (the
/// reader of a pipe went away, as `| head` does) ends the run through the caller's `?`.
macro_rules! out {
    ($($arg:tt)*) => {
        cli::out(format_args!($($arg)*))
    };
}

fn die(msg: impl std::fmt::Display) -> ! {
    cli::die("ucxkit-perf", msg)
}

fn main() {
    let args = Args::parse();
    if let Some(cpu) = args.cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
            die(format!("cannot pin to CPU {cpu}"));
        }
    }
    if args.compare && args.client.is_some() {
        die("--compare runs ucx_perftest over loopback; use it without --client");
    }
    if args.iters == Some(0) {
        die("--iters must be at least 1");
    }
    if !args.mem.is_host() {
        if !cfg!(feature = "cuda") {
            die("--mem cuda: this ucxkit-perf was built without the `cuda` feature (cargo build --features cuda)");
        }
        if let Some(t) = args.test.iter().flatten().find(|t| !matches!(t, Test::TagLat | Test::TagBw)) {
            die(format!("--mem {} runs tag_lat and tag_bw, not {}", args.mem.name(), t.name()));
        }
        if size::parse_sizes(&args.sizes).is_ok_and(|s| s.contains(&0)) {
            die(format!("--mem {}: sizes from 1 byte", args.mem.name()));
        }
        #[cfg(feature = "cuda")]
        if let Err(e) = ucxkit::transport::cuda::probe() {
            die(format!("--mem {}: {e}", args.mem.name()));
        }
    }
    if !args.server {
        let sizes = size::parse_sizes(&args.sizes).unwrap_or_else(|e| die(e));
        for t in args.test.iter().flatten() {
            for &s in &sizes {
                if let Err(e) = t.check_size(s) {
                    die(e);
                }
            }
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| die(e));
    let code = rt.block_on(async {
        if args.server {
            server(&args).await
        } else if let Some(addr) = args.client.clone() {
            client(&args, &addr).await
        } else {
            loopback(&args).await
        }
    });
    match code {
        // Whoever read the output stopped reading (`| head`): not an error of the run.
        Err(e) if cli::is_broken_pipe(&*e) => {}
        Err(e) => die(e),
        Ok(()) => {}
    }
}

fn context(args: &Args) -> ucxkit::transport::Result<Context> {
    let b = Context::builder().name("ucxkit-perf");
    match effective_tls(args) {
        Some(tls) => b.transports(tls).build(),
        None => b.build(),
    }
}

fn worker(args: &Args, ctx: &Context) -> ucxkit::transport::Result<Worker> {
    let opts = EndpointOptions {
        error_mode: args.error_mode.mode(),
        require_transports: args.require_transport.clone(),
        ..Default::default()
    };
    ctx.worker().progress_mode(args.progress.mode()).endpoint_options(opts).build()
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Starts a server process of this binary with the same options, reads its port, and
/// runs the client against it.
async fn loopback(args: &Args) -> AnyResult<()> {
    let exe = std::env::current_exe()?;
    let mut cmd = match args.server_cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string()]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(["--server", "--once", "--port", "0", "--bind", "127.0.0.1"])
        .args(["--transport", args.transport.name()])
        .args(["--progress", args.progress.name()])
        .args(["--error-mode", args.error_mode.name()])
        .args(["--mem", &args.mem.name()])
        .args(args.tls.as_ref().map(|t| vec!["--tls".to_string(), t.clone()]).unwrap_or_default())
        .args(if args.require_transport.is_empty() {
            vec![]
        } else {
            vec!["--require-transport".to_string(), args.require_transport.join(",")]
        })
        .args(if args.cm { vec!["--cm"] } else { vec![] })
        .stdout(Stdio::piped())
        .stdin(Stdio::null());
    let mut child = cmd.spawn().map_err(|e| format!("starting the server process: {e}"))?;
    let stdout = child.stdout.take().ok_or("no server stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("listening on port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("unexpected server output {line:?}"))?;
    let r = client(args, &format!("127.0.0.1:{port}")).await;
    if r.is_err() {
        // The server would wait for the next command forever.
        let _ = child.kill();
    }
    // Waited for off this thread: the runtime must go on running, so that the driver
    // destroys this side's worker (its last handles went with `client`). Kept alive
    // unprogressed, its TCP connections stay open, and the server's endpoint close waits
    // for this side (1 s, then 2 s more at its worker's destruction).
    let status = tokio::task::spawn_blocking(move || child.wait()).await??;
    r?;
    if !status.success() {
        return Err(format!("server process failed: {status}").into());
    }
    Ok(())
}

async fn client(args: &Args, addr: &str) -> AnyResult<()> {
    let sizes = size::parse_sizes(&args.sizes)?;
    if args.window == 0 {
        return Err("--window must be at least 1".into());
    }
    let addr: SocketAddr = match addr.parse() {
        Ok(a) => a,
        Err(_) => tokio::net::lookup_host(addr).await?.next().ok_or("cannot resolve server address")?,
    };
    let ctx = context(args)?;
    let w = worker(args, &ctx)?;
    let mut am = w.am_recv(bench::AM_S2C)?;
    let ep = if args.cm {
        w.connect(addr).await?
    } else {
        // Exchange worker addresses over a TCP socket, then connect by address.
        let mut sock = tokio::net::TcpStream::connect(addr).await?;
        write_frame(&mut sock, w.address()?.as_bytes()).await?;
        let theirs = WorkerAddress::from_bytes(&read_frame(&mut sock).await?)?;
        let ep = w.connect_address(&theirs).await?;
        // Wait until the server is connected back to us.
        read_frame(&mut sock).await?;
        ep
    };
    let transport = ep.transports().map(|t| t.join(",")).unwrap_or_else(|_| "?".into());
    let ep_lanes = ep.lanes().unwrap_or_default();
    let lanes = if ep_lanes.is_empty() {
        "?".to_string()
    } else {
        ep_lanes.iter().map(|l| format!("{}/{}", l.transport, l.device)).collect::<Vec<_>>().join(" ")
    };
    // ucx_perftest over the same network devices (the same rails).
    let net_devices = perftest::net_devices(ep_lanes.iter().map(|l| l.device.as_str()));
    let tests: Vec<Test> = args.test.iter().flatten().copied().collect();
    for &t in &tests {
        for &size in &sizes {
            t.check_size(size)?;
        }
    }
    if args.output.table() {
        out!(
            "# ucxkit-perf: server {addr}, lanes {lanes}, progress {:?}, error mode {}, UCX {:?}{}",
            args.progress,
            if ep.uses_peer_error_mode() { "peer" } else { "none" },
            Context::ucx_version(),
            if args.immediate { ", immediate sends" } else { "" }
        )?;
        out!("{}", report::header_line())?;
    } else if args.output.csv {
        out!("{}", report::CSV_HEADER)?;
    }
    let tls = effective_tls(args);
    let perftest_mem = (!args.mem.is_host()).then(|| args.mem.name());
    let compare = perftest::Setup {
        tls: tls.as_deref(),
        peer_mode: ep.uses_peer_error_mode(),
        sleep: args.progress == Progress::Event,
        cpu: args.cpu,
        server_cpu: args.server_cpu,
        window: args.window,
        net_devices: net_devices.as_deref(),
        mem: perftest_mem.as_deref(),
    };
    let mut runs: Vec<(Test, usize)> = Vec::new();
    for &test in &tests {
        if test == Test::AtomicRate {
            // The size does not apply: one run.
            runs.push((test, 8));
            continue;
        }
        runs.extend(sizes.iter().map(|&s| (test, s)));
    }
    let progress = !args.output.quiet && std::io::stderr().is_terminal();
    let mut rows: Vec<Row> = Vec::new();
    let mut side = Side {
        w: &w,
        ep: &ep,
        am: &mut am,
        immediate: args.immediate,
        unwritten: args.unwritten_source,
        mem: args.mem,
    };
    for (k, &(test, size)) in runs.iter().enumerate() {
        if progress {
            eprint!("\r\x1b[K[{}/{}] {} {} ...", k + 1, runs.len(), test.name(), size::format_size(size));
        }
        let shape = timed::Shape { test, size, window: args.window, recv_window: recv_window(args) };
        // --duration: ucx_perftest (with --compare) runs the count estimated for the
        // duration; ucxkit's own run goes on in segments until it has lasted the duration.
        let (iters, warmup, per) = match args.duration {
            Some(d) => {
                let per = timed::per_iter(&shape, d, &mut side).await?;
                let n = timed::iters_in(d, per);
                (n, args.warmup.unwrap_or((n / 10).max(10)), Some((d, per)))
            }
            None => {
                let n = args.iters.unwrap_or_else(|| bench::default_iters(test, size));
                (n, args.warmup.unwrap_or((n / 10).max(10)), None)
            }
        };
        let perftest = || -> AnyResult<Row> {
            if progress {
                eprint!(
                    "\r\x1b[K[{}/{}] {} {} (ucx_perftest) ...",
                    k + 1,
                    runs.len(),
                    test.name(),
                    size::format_size(size)
                );
            }
            perftest::run(test, size, iters, warmup, &compare)
        };
        let perftest_first = args.compare && ((k % 2 == 1) != args.perftest_first);
        let before = if perftest_first { Some(perftest()?) } else { None };
        let measured = match per {
            Some((d, per)) => timed::run_for(&shape, d, (per, warmup), &mut side).await?,
            None => timed::segment(&shape, iters, warmup, &mut side).await?,
        };
        let row = measured.row(test, size, &transport);
        let theirs = match before {
            Some(r) => Some(r),
            None if args.compare => Some(perftest()?),
            None => None,
        };
        if progress {
            eprint!("\r\x1b[K");
        }
        let mut out = vec![row.clone()];
        out.extend(theirs.clone());
        for r in &out {
            if args.output.json {
                let mut v: serde_json::Value = serde_json::from_str(&r.json())?;
                if let (Some(t), "ucxkit") = (&theirs, r.source.as_str()) {
                    v["ratio"] = serde_json::json!(perftest::ratio(test, r, t));
                }
                out!("{v}")?;
            } else if args.output.csv {
                out!("{}", r.csv())?;
            } else {
                out!("{}", report::table_line(r))?;
            }
        }
        if let (Some(t), false, false) = (&theirs, args.output.json, args.output.csv) {
            let what = if test.is_latency() {
                "latency"
            } else if test == Test::AtomicRate {
                "rate"
            } else {
                "bandwidth"
            };
            out!("{}", report::ratio_line(what, perftest::ratio(test, &row, t)))?;
        }
        std::io::stdout().flush()?;
        rows.extend(out);
    }
    send_ctrl(&ep, "bye".into()).await?;
    let _ = bench::recv_ctrl_from(&ep).await?;
    ep.close().await?;
    if let Some(path) = &args.output.plot {
        let title = format!("ucxkit-perf over {transport} ({:?} progress)", args.progress);
        let svg = plot::render(&rows, &title, &|name| Test::from_name(name).is_some_and(Test::is_latency))?;
        std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))?;
        if args.output.table() {
            out!("# plot written to {}", path.display())?;
        }
    }
    Ok(())
}

/// The `UCX_TLS` this run uses, for ucx_perftest (None: UCX's default, from the
/// environment).
fn effective_tls(args: &Args) -> Option<String> {
    args.tls.clone().or_else(|| args.transport.tls()).map(|t| args.mem.with_device_transports(&t))
}

/// The receives a bandwidth server keeps posted (see `Args::recv_window`).
fn recv_window(args: &Args) -> usize {
    args.recv_window.unwrap_or(args.window).max(1)
}

async fn server(args: &Args) -> AnyResult<()> {
    let ctx = context(args)?;
    let w = worker(args, &ctx)?;
    let mut am = w.am_recv(bench::AM_C2S)?;
    let bind = SocketAddr::new(args.bind, args.port);
    if args.cm {
        let listener = w.listen(bind)?;
        out!("listening on port {}", listener.local_addr().port())?;
        std::io::stdout().flush()?;
        loop {
            let ep = listener.accept().await?;
            let r = serve(&mut Side::server(&w, &ep, &mut am)).await;
            if let Err(e) = &r {
                eprintln!("ucxkit-perf server: client {}: {e}", ep.peer());
            }
            drop(ep);
            if args.once {
                return r;
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(bind).await?;
    out!("listening on port {}", listener.local_addr()?.port())?;
    std::io::stdout().flush()?;
    loop {
        let (mut sock, peer) = listener.accept().await?;
        let r = async {
            let theirs = WorkerAddress::from_bytes(&read_frame(&mut sock).await?)?;
            write_frame(&mut sock, w.address()?.as_bytes()).await?;
            let ep = w.connect_address(&theirs).await?;
            write_frame(&mut sock, b"connected").await?;
            serve(&mut Side::server(&w, &ep, &mut am)).await?;
            // The client may already have destroyed its worker: close gracefully if it
            // answers soon, otherwise let the endpoint close in the background.
            let _ = tokio::time::timeout(Duration::from_secs(1), ep.close()).await;
            Ok::<(), Box<dyn std::error::Error>>(())
        }
        .await;
        if let Err(e) = &r {
            eprintln!("ucxkit-perf server: client {peer}: {e}");
        }
        if args.once {
            return r;
        }
    }
}

/// Writes a length-prefixed frame (u32 little-endian length, then the bytes).
async fn write_frame(sock: &mut tokio::net::TcpStream, bytes: &[u8]) -> AnyResult<()> {
    use tokio::io::AsyncWriteExt;
    let len = u32::try_from(bytes.len()).map_err(|_| "frame too large")?;
    sock.write_all(&len.to_le_bytes()).await?;
    sock.write_all(bytes).await?;
    Ok(())
}

/// Reads a frame written by [`write_frame`] (at most 1 MiB).
async fn read_frame(sock: &mut tokio::net::TcpStream) -> AnyResult<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 20 {
        return Err(format!("bootstrap frame of {len} bytes is too large").into());
    }
    let mut buf = vec![0u8; len];
    sock.read_exact(&mut buf).await?;
    Ok(buf)
}

/// Serves one client's commands until it says `bye`.
async fn serve(side: &mut Side<'_>) -> AnyResult<()> {
    loop {
        let cmd = next_command(side.w, side.ep).await?;
        if cmd == "bye" {
            send_ctrl(side.ep, "bye".into()).await?;
            // Let the reply leave before the client closes.
            side.ep.flush().await?;
            return Ok(());
        }
        if let Err(e) = bench::serve_one(&cmd, side).await {
            // Tell the client instead of leaving it waiting; it stops on `error`.
            let _ = send_ctrl(side.ep, format!("error {e}")).await;
            return Err(e);
        }
    }
}

/// Waits for the client's next command without spinning (even in busy-poll mode), so
/// that an idle server leaves the CPU to `--compare`'s ucx_perftest runs.
async fn next_command(w: &Worker, ep: &Endpoint) -> AnyResult<String> {
    // Back off to 20 ms: a few wakeups a second do not disturb a ucx_perftest server
    // pinned to the same CPU.
    let mut nap = Duration::from_micros(50);
    while w.tag_probe(CTRL, tag::EXACT).is_none() {
        if let Some(s) = ep.failure() {
            return Err(format!("the client went away ({s})").into());
        }
        tokio::time::sleep(nap).await;
        nap = (nap * 2).min(Duration::from_millis(20));
    }
    recv_ctrl(w).await
}
