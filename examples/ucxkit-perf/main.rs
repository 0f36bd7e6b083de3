//! `ucxkit-perf`: latency and bandwidth of ucxkit's transport, in the spirit of
//! `ucx_perftest`.
//!
//! ```text
//! cargo run --release --example ucxkit-perf                        # loopback, both tests
//! cargo run --release --example ucxkit-perf -- --server --port 13337
//! cargo run --release --example ucxkit-perf -- --client HOST:13337 --test tag_bw --sizes 64K,1M
//! ```
//!
//! Without `--server`/`--client` the tool starts its own server process and runs over
//! loopback. Tests: `tag_lat` (ping-pong; one-way latency = round trip / 2) and `tag_bw`
//! (windowed streaming; bandwidth, message rate and time per message).
//!
//! The client drives: for each (test, size) it sends the server a one-line command on
//! the control tag, waits for `ready`, runs warm-up plus measured iterations, and reads
//! the server's `done`.

#![forbid(unsafe_code)]

mod report;
mod size;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use ucxkit::transport::{tag, Context, Endpoint, ErrorMode, ProgressMode, Worker, WorkerAddress};

use report::Row;

/// Control messages (commands and replies).
const CTRL: u64 = 0xC7A1_0000_0000_0000;
/// Data messages client → server.
const DATA_C2S: u64 = 0xDA7A_0000_0000_0001;
/// Data messages server → client.
const DATA_S2C: u64 = 0xDA7A_0000_0000_0002;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Test {
    #[value(name = "tag_lat")]
    /// Ping-pong tagged messages; reports one-way latency.
    TagLat,
    #[value(name = "tag_bw")]
    /// Stream tagged messages with a window of outstanding sends; reports bandwidth.
    TagBw,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::TagLat => "tag_lat",
            Test::TagBw => "tag_bw",
        }
    }
    fn from_name(s: &str) -> Option<Test> {
        match s {
            "tag_lat" => Some(Test::TagLat),
            "tag_bw" => Some(Test::TagBw),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Transport {
    /// Shared memory (`UCX_TLS=posix,cma,tcp,self`; data goes over posix and cma, tcp is
    /// there for `--cm` connection setup).
    Shm,
    /// TCP (`UCX_TLS=tcp,self`).
    Tcp,
    /// Whatever UCX picks (`UCX_TLS` from the environment, default all).
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Progress {
    /// Sleep on the worker's event fd (no CPU while idle).
    Event,
    /// Spin (lowest latency, one core at 100 %).
    Busy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ErrMode {
    /// None for peers on this host, peer mode otherwise.
    Auto,
    /// UCX peer failure detection (no shared memory between processes in UCX 1.13).
    Peer,
    /// No UCX failure detection (same-host peers are watched by ucxkit).
    None,
}

/// Latency and bandwidth of ucxkit's tagged messaging.
#[derive(Parser, Debug, Clone)]
#[command(name = "ucxkit-perf", version)]
struct Args {
    /// Tests to run, comma-separated.
    #[arg(short, long, value_delimiter = ',', default_values = ["tag_lat", "tag_bw"])]
    test: Vec<Test>,
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
    /// Receives the bandwidth server keeps posted, each with its own buffer. Default: the
    /// window for messages up to 8 KiB (eager sizes, which would otherwise be copied out
    /// of UCX's unexpected queue), 4 above (rendezvous messages simply wait for a receive,
    /// and 32 distinct large buffers would stream through memory instead of cache).
    #[arg(long)]
    recv_window: Option<usize>,
    /// UCX transports to use.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    transport: Transport,
    /// Exact UCX transport list (`UCX_TLS`), overriding --transport, e.g. `posix,self`.
    #[arg(long)]
    tls: Option<String>,
    /// Connect through UCX's connection manager (a ucxkit `Listener` on the port) instead
    /// of exchanging worker addresses over a TCP socket on the port (the default, as
    /// ucx_perftest does). The connection manager needs `tcp` among the transports.
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
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Pin this process to a CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// In loopback mode, pin the spawned server to this CPU.
    #[arg(long)]
    server_cpu: Option<usize>,
    /// Serve one client, then exit (used by the loopback mode).
    #[arg(long, hide = true)]
    once: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 2s, 500ms)"))?;
    if v.is_nan() || v <= 0.0 {
        return Err(format!("{s:?}: duration must be positive"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("ucxkit-perf: {msg}");
    std::process::exit(1);
}

fn main() {
    let args = Args::parse();
    if let Some(cpu) = args.cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
            die(format!("cannot pin to CPU {cpu}"));
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
    if let Err(e) = code {
        die(e);
    }
}

fn context(args: &Args) -> ucxkit::transport::Result<Context> {
    let b = Context::builder().name("ucxkit-perf");
    if let Some(tls) = &args.tls {
        return b.transports(tls.as_str()).build();
    }
    match args.transport {
        Transport::Shm => b.transports("posix,cma,tcp,self"),
        Transport::Tcp => b.transports("tcp,self"),
        Transport::Auto => b,
    }
    .build()
}

fn worker(args: &Args, ctx: &Context) -> ucxkit::transport::Result<Worker> {
    let mode = match args.progress {
        Progress::Event => ProgressMode::Event,
        Progress::Busy => ProgressMode::BusyPoll,
    };
    let err = match args.error_mode {
        ErrMode::Auto => ErrorMode::Auto,
        ErrMode::Peer => ErrorMode::Peer,
        ErrMode::None => ErrorMode::None,
    };
    ctx.worker().progress_mode(mode).error_mode(err).build()
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
        .args(["--transport", transport_arg(args.transport)])
        .args(["--progress", if args.progress == Progress::Busy { "busy" } else { "event" }])
        .args(["--error-mode", errmode_arg(args.error_mode)])
        .args(args.tls.as_ref().map(|t| vec!["--tls".to_string(), t.clone()]).unwrap_or_default())
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
    let status = child.wait()?;
    r?;
    if !status.success() {
        return Err(format!("server process failed: {status}").into());
    }
    Ok(())
}

fn transport_arg(t: Transport) -> &'static str {
    match t {
        Transport::Shm => "shm",
        Transport::Tcp => "tcp",
        Transport::Auto => "auto",
    }
}

fn errmode_arg(e: ErrMode) -> &'static str {
    match e {
        ErrMode::Auto => "auto",
        ErrMode::Peer => "peer",
        ErrMode::None => "none",
    }
}

/// Default iterations for a size: enough bytes to be meaningful, bounded for small sizes.
fn default_iters(test: Test, size: usize) -> u64 {
    let budget: u64 = match test {
        Test::TagLat => 256 << 20,
        Test::TagBw => 4 << 30,
    };
    (budget / size.max(1) as u64).clamp(100, 20_000)
}

async fn send_ctrl(ep: &Endpoint, msg: String) -> AnyResult<()> {
    let (r, _) = ep.tag_send(CTRL, msg.into_bytes()).await;
    Ok(r?)
}

async fn recv_ctrl(w: &Worker) -> AnyResult<String> {
    let (_, buf) = w.tag_recv_any(CTRL, tag::EXACT).await?;
    Ok(String::from_utf8(buf)?)
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
    if !args.json {
        println!(
            "# ucxkit-perf: server {addr}, transports {transport}, progress {:?}, error mode {}, UCX {:?}",
            args.progress,
            if ep.uses_peer_error_mode() { "peer" } else { "none" },
            Context::ucx_version()
        );
        println!("{}", report::header_line());
    }
    for &test in &args.test {
        for &size in &sizes {
            let (iters, warmup) = match args.duration {
                Some(d) => calibrate(test, size, d, args, &w, &ep).await?,
                None => {
                    let n = args.iters.unwrap_or_else(|| default_iters(test, size));
                    (n, args.warmup.unwrap_or((n / 10).max(10)))
                }
            };
            let row = run_one(test, size, iters, warmup, args, &w, &ep, &transport).await?;
            if args.json {
                println!("{}", row.json());
            } else {
                println!("{}", report::table_line(&row));
            }
            std::io::stdout().flush()?;
        }
    }
    send_ctrl(&ep, "bye".into()).await?;
    let _ = recv_ctrl(&w).await?;
    ep.close().await?;
    Ok(())
}

/// Picks an iteration count that runs for about `d`, from a short trial.
async fn calibrate(
    test: Test,
    size: usize,
    d: Duration,
    args: &Args,
    w: &Worker,
    ep: &Endpoint,
) -> AnyResult<(u64, u64)> {
    let trial = 20u64.max(args.window as u64);
    let t0 = Instant::now();
    run_one(test, size, trial, 0, args, w, ep, "").await?;
    let per = t0.elapsed().as_secs_f64() / trial as f64;
    let n = ((d.as_secs_f64() / per.max(1e-9)) as u64).clamp(10, 50_000_000);
    Ok((n, args.warmup.unwrap_or((n / 10).max(10))))
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    test: Test,
    size: usize,
    iters: u64,
    warmup: u64,
    args: &Args,
    w: &Worker,
    ep: &Endpoint,
    transport: &str,
) -> AnyResult<Row> {
    let window = args.window;
    let recv_window = args.recv_window.unwrap_or(if size <= 8192 { window } else { window.min(4) }).max(1);
    send_ctrl(ep, format!("{} {size} {} {recv_window}", test.name(), iters + warmup)).await?;
    let ready = recv_ctrl(w).await?;
    if ready != "ready" {
        return Err(format!("server answered {ready:?}").into());
    }
    // The payload lives for the whole run: sends borrow it as `&'static [u8]`, so the
    // hot loop does no reference counting (as a C benchmark would reuse one buffer).
    let payload: &'static [u8] = Vec::leak(vec![0x5au8; size]);
    let mut hist = Histogram::<u64>::new(3)?;
    let elapsed;
    match test {
        Test::TagLat => {
            let mut rbuf = Vec::with_capacity(size);
            let mut start = Instant::now();
            // One clock read per round trip: each iteration is timed from the end of the
            // previous one.
            let mut last = start;
            for i in 0..iters + warmup {
                let recv = w.tag_recv(DATA_S2C, tag::EXACT, rbuf);
                let (s, _) = ep.tag_send(DATA_C2S, payload).await;
                s?;
                let (r, b) = recv.await;
                r?;
                rbuf = b;
                let now = Instant::now();
                if i >= warmup {
                    hist.record((now - last).as_nanos() as u64)?;
                } else if i + 1 == warmup {
                    start = now;
                }
                last = now;
            }
            elapsed = start.elapsed();
        }
        Test::TagBw => {
            let mut inflight = VecDeque::with_capacity(window);
            let mut start = Instant::now();
            let mut last = start;
            for i in 0..iters + warmup {
                if i == warmup {
                    // Drain the warm-up messages before starting the clock.
                    while let Some(f) = inflight.pop_front() {
                        let (r, _) = f.await;
                        r?;
                    }
                    start = Instant::now();
                    last = start;
                }
                if inflight.len() == window {
                    let (r, _) = inflight.pop_front().expect("window is full").await;
                    r?;
                    if i >= warmup {
                        let now = Instant::now();
                        hist.record((now - last).as_nanos() as u64)?;
                        last = now;
                    }
                }
                inflight.push_back(ep.tag_send(DATA_C2S, payload));
            }
            while let Some(f) = inflight.pop_front() {
                let (r, _) = f.await;
                r?;
            }
            // The server acknowledges once everything arrived.
            let (r, _) = w.tag_recv(DATA_S2C, tag::EXACT, Vec::with_capacity(8)).await;
            r?;
            elapsed = start.elapsed();
        }
    }
    let done = recv_ctrl(w).await?;
    if done != "done" {
        return Err(format!("server answered {done:?}").into());
    }
    let secs = elapsed.as_secs_f64();
    let n = iters.max(1) as f64;
    let (lat, p50, p99) = match test {
        // One-way latency: half the round trip.
        Test::TagLat => (
            secs * 1e6 / n / 2.0,
            hist.value_at_quantile(0.5) as f64 / 2e3,
            hist.value_at_quantile(0.99) as f64 / 2e3,
        ),
        Test::TagBw => (
            secs * 1e6 / n,
            hist.value_at_quantile(0.5) as f64 / 1e3,
            hist.value_at_quantile(0.99) as f64 / 1e3,
        ),
    };
    let msg_rate = match test {
        // One message each way per iteration.
        Test::TagLat => 2.0 * n / secs,
        Test::TagBw => n / secs,
    };
    let bw = match test {
        Test::TagLat => size as f64 / (lat * 1e-6) / (1 << 20) as f64,
        Test::TagBw => size as f64 * n / secs / (1 << 20) as f64,
    };
    Ok(Row {
        test: test.name().into(),
        size,
        iters,
        lat_us: lat,
        lat_p50_us: p50,
        lat_p99_us: p99,
        bw_mibps: if size == 0 { 0.0 } else { bw },
        msg_rate,
        transport: transport.into(),
    })
}

async fn server(args: &Args) -> AnyResult<()> {
    let ctx = context(args)?;
    let w = worker(args, &ctx)?;
    let bind = SocketAddr::new(args.bind, args.port);
    if args.cm {
        let listener = w.listen(bind)?;
        println!("listening on port {}", listener.local_addr().port());
        std::io::stdout().flush()?;
        loop {
            let ep = listener.accept().await?;
            if let Err(e) = serve(&w, &ep).await {
                eprintln!("ucxkit-perf server: client {}: {e}", ep.peer());
            }
            drop(ep);
            if args.once {
                return Ok(());
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(bind).await?;
    println!("listening on port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    loop {
        let (mut sock, peer) = listener.accept().await?;
        let r = async {
            let theirs = WorkerAddress::from_bytes(&read_frame(&mut sock).await?)?;
            write_frame(&mut sock, w.address()?.as_bytes()).await?;
            let ep = w.connect_address(&theirs).await?;
            write_frame(&mut sock, b"connected").await?;
            serve(&w, &ep).await?;
            // The client may already have destroyed its worker: close gracefully if it
            // answers soon, otherwise let the endpoint close in the background.
            let _ = tokio::time::timeout(Duration::from_secs(1), ep.close()).await;
            Ok::<(), Box<dyn std::error::Error>>(())
        }
        .await;
        if let Err(e) = r {
            eprintln!("ucxkit-perf server: client {peer}: {e}");
        }
        if args.once {
            return Ok(());
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

async fn serve(w: &Worker, ep: &Endpoint) -> AnyResult<()> {
    loop {
        let cmd = recv_ctrl(w).await?;
        let parts: Vec<&str> = cmd.split_whitespace().collect();
        if parts.first() == Some(&"bye") {
            send_ctrl(ep, "bye".into()).await?;
            // Let the reply leave before the client closes.
            ep.flush().await?;
            return Ok(());
        }
        let (test, size, total, window) = match parts.as_slice() {
            [t, s, n, win] => (
                Test::from_name(t).ok_or_else(|| format!("unknown test {t:?}"))?,
                s.parse::<usize>()?,
                n.parse::<u64>()?,
                win.parse::<usize>()?.max(1),
            ),
            _ => return Err(format!("bad command {cmd:?}").into()),
        };
        send_ctrl(ep, "ready".into()).await?;
        match test {
            Test::TagLat => {
                let payload: &'static [u8] = Vec::leak(vec![0xa5u8; size]);
                let mut rbuf = Vec::with_capacity(size);
                for _ in 0..total {
                    let (r, b) = w.tag_recv(DATA_C2S, tag::EXACT, rbuf).await;
                    r?;
                    rbuf = b;
                    let (s, _) = ep.tag_send(DATA_S2C, payload).await;
                    s?;
                }
            }
            Test::TagBw => {
                let mut posted = VecDeque::with_capacity(window);
                let mut next = 0u64;
                while next < total.min(window as u64) {
                    posted.push_back(w.tag_recv(DATA_C2S, tag::EXACT, Vec::with_capacity(size)));
                    next += 1;
                }
                while let Some(f) = posted.pop_front() {
                    let (r, buf) = f.await;
                    r?;
                    if next < total {
                        posted.push_back(w.tag_recv(DATA_C2S, tag::EXACT, buf));
                        next += 1;
                    }
                }
                let (s, _) = ep.tag_send(DATA_S2C, vec![1u8]).await;
                s?;
            }
        }
        send_ctrl(ep, "done".into()).await?;
    }
}
