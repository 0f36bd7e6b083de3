//! The tests: what the client and the server do for each, and how a run becomes a
//! [`Row`].
//!
//! Latency tests ping-pong one message (one-way latency = round trip / 2). Bandwidth tests
//! keep `window` operations in flight and time each completion. One-sided tests (puts,
//! gets, atomics) target a region the server registers and whose key it sends back with
//! `ready`; `put_lat` also needs the client's region, whose key rides in the command.
//! Regions are allocated by UCX (`Context::alloc`), as ucx_perftest does, so shared-memory
//! transports can map them and put/get run at memory speed.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use clap::ValueEnum;
use hdrhistogram::Histogram;
use ucxkit::transport::{
    tag, AmReceiver, Endpoint, IoBuf, IoBufMut, MemRegion, RegionSlice, RemoteKey, Worker,
};

use crate::clock::Clock;
use crate::device;
use crate::window::{keep_posted, Window};
use crate::AnyResult;
use ucxkit_tools::cli::MemKind;
use ucxkit_tools::cli::{self, Mem};
use ucxkit_tools::report::Row;

/// Control messages (commands and replies).
pub(crate) const CTRL: u64 = 0x47A1_0000_0000_0000;
/// Data messages client → server.
const DATA_C2S: u64 = 0x5A7A_0000_0000_0001;
/// Data messages server → client.
const DATA_S2C: u64 = 0x5A7A_0000_0000_0002;
/// Active-message ids client → server and back.
pub(crate) const AM_C2S: u16 = 1;
pub(crate) const AM_S2C: u16 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Test {
    /// Ping-pong tagged messages; one-way latency.
    #[value(name = "tag_lat")]
    TagLat,
    /// Tagged messages with a window of outstanding sends; bandwidth.
    #[value(name = "tag_bw")]
    TagBw,
    /// Ping-pong on the endpoint's byte stream.
    #[value(name = "stream_lat")]
    StreamLat,
    /// Stream sends with a window of outstanding sends.
    #[value(name = "stream_bw")]
    StreamBw,
    /// Ping-pong active messages (rendezvous payloads fetched on arrival).
    #[value(name = "am_lat")]
    AmLat,
    /// Active messages with a window of outstanding sends.
    #[value(name = "am_bw")]
    AmBw,
    /// Ping-pong puts: each side polls the last byte of its region.
    #[value(name = "put_lat")]
    PutLat,
    /// Puts with a window of outstanding operations, flushed at the end.
    #[value(name = "put_bw")]
    PutBw,
    /// Gets with a window of outstanding operations.
    #[value(name = "get_bw")]
    GetBw,
    /// Remote 64-bit atomic adds with a window of outstanding operations (size ignored).
    #[value(name = "atomic_rate")]
    AtomicRate,
}

impl Test {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Test::TagLat => "tag_lat",
            Test::TagBw => "tag_bw",
            Test::StreamLat => "stream_lat",
            Test::StreamBw => "stream_bw",
            Test::AmLat => "am_lat",
            Test::AmBw => "am_bw",
            Test::PutLat => "put_lat",
            Test::PutBw => "put_bw",
            Test::GetBw => "get_bw",
            Test::AtomicRate => "atomic_rate",
        }
    }

    pub(crate) fn from_name(s: &str) -> Option<Test> {
        Test::value_variants().iter().copied().find(|t| t.name() == s)
    }

    /// Whether the result is a latency (ping-pong) rather than a rate.
    pub(crate) fn is_latency(self) -> bool {
        matches!(self, Test::TagLat | Test::StreamLat | Test::AmLat | Test::PutLat)
    }

    /// The matching `ucx_perftest -t` test.
    pub(crate) fn perftest_name(self) -> &'static str {
        match self {
            Test::TagLat => "tag_lat",
            Test::TagBw => "tag_bw",
            Test::StreamLat => "stream_lat",
            Test::StreamBw => "stream_bw",
            Test::AmLat => "ucp_am_lat",
            Test::AmBw => "ucp_am_bw",
            Test::PutLat => "ucp_put_lat",
            Test::PutBw => "ucp_put_bw",
            Test::GetBw => "ucp_get",
            Test::AtomicRate => "ucp_add",
        }
    }

    /// One-sided (RMA) tests: the target makes no call per operation.
    pub(crate) fn is_one_sided(self) -> bool {
        self.needs_region()
    }

    fn needs_region(self) -> bool {
        matches!(self, Test::PutLat | Test::PutBw | Test::GetBw | Test::AtomicRate)
    }

    /// The size actually used for a requested size.
    pub(crate) fn effective_size(self, size: usize) -> usize {
        match self {
            Test::AtomicRate => 8,
            _ => size,
        }
    }

    /// Sizes this test cannot run with.
    pub(crate) fn check_size(self, size: usize) -> Result<(), String> {
        match self {
            Test::StreamLat | Test::StreamBw | Test::PutLat if size == 0 => {
                Err(format!("{} needs messages of at least 1 byte", self.name()))
            }
            _ => Ok(()),
        }
    }
}

/// Default iterations for a size: enough bytes to be meaningful, bounded for small sizes.
pub(crate) fn default_iters(test: Test, size: usize) -> u64 {
    let budget: u64 = if test.is_latency() { 256 << 20 } else { 4 << 30 };
    (budget / size.max(1) as u64).clamp(100, 20_000)
}

pub(crate) async fn send_ctrl(ep: &Endpoint, msg: String) -> AnyResult<()> {
    let (r, _) = ep.tag_send(CTRL, msg.into_bytes()).await;
    Ok(r?)
}

pub(crate) async fn recv_ctrl(w: &Worker) -> AnyResult<String> {
    let (_, buf) = w.tag_recv_any(CTRL, tag::EXACT).await?;
    let msg = String::from_utf8(buf)?;
    match msg.strip_prefix("error ") {
        Some(e) => Err(format!("the peer failed: {e}").into()),
        None => Ok(msg),
    }
}

/// Receives the peer's next control message on `ep`: bound to the endpoint, so a peer
/// that dies ends the wait with an error instead of leaving it forever.
pub(crate) async fn recv_ctrl_from(ep: &Endpoint) -> AnyResult<String> {
    let (r, buf) = ep.tag_recv(CTRL, tag::EXACT, Vec::with_capacity(64 * 1024)).await;
    r?;
    let msg = String::from_utf8(buf)?;
    match msg.strip_prefix("error ") {
        Some(e) => Err(format!("the peer failed: {e}").into()),
        None => Ok(msg),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> AnyResult<Vec<u8>> {
    if s.len() % 2 != 0 {
        return Err("odd-length hex".into());
    }
    (0..s.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?)).collect()
}

/// Everything one side needs for a run.
pub(crate) struct Side<'a> {
    pub(crate) w: &'a Worker,
    pub(crate) ep: &'a Endpoint,
    pub(crate) am: &'a mut AmReceiver,
    /// Client, bandwidth tests: send what UCX completes during the call with the
    /// borrowed-buffer `try_*` calls (`--immediate`).
    pub(crate) immediate: bool,
    /// Client, bandwidth tests: move data out of memory never written
    /// (`--unwritten-source`).
    pub(crate) unwritten: bool,
    /// Client: where the send and receive buffers live (`--mem`), told to the server
    /// with each test.
    pub(crate) mem: Mem,
}

impl<'a> Side<'a> {
    /// The server's side of a connection: what a test runs with comes with its command.
    pub(crate) fn server(w: &'a Worker, ep: &'a Endpoint, am: &'a mut AmReceiver) -> Side<'a> {
        Side { w, ep, am, immediate: false, unwritten: false, mem: Mem::HOST }
    }
}

/// Waits until the last byte of `region` reads `marker`, progressing the worker.
async fn wait_marker(w: &Worker, region: &MemRegion, marker: u8) {
    let last = region.len() - 1;
    let mut b = [0u8; 1];
    let mut spins = 0u32;
    loop {
        region.read_at(last, &mut b);
        if b[0] == marker {
            return;
        }
        w.progress();
        spins += 1;
        if spins % 4096 == 0 {
            tokio::task::yield_now().await;
        }
    }
}

/// Runs `f` unless the connection `ep` fails first, which ends it with an error: the hot
/// loops receive on the worker, which a dead server would otherwise leave waiting forever.
pub(crate) async fn unless_failed<T>(
    ep: &Endpoint,
    f: impl std::future::Future<Output = AnyResult<T>>,
) -> AnyResult<T> {
    tokio::select! {
        r = f => r,
        status = ep.failed() => Err(format!("the connection to the server failed: {status}").into()),
    }
}

/// What one run measured: its timed iterations, how long they took, and each interval
/// (one round trip, or one operation's share of a batch) in nanoseconds.
pub(crate) struct Measured {
    /// Timed iterations.
    pub(crate) iters: u64,
    /// The timed part's length.
    pub(crate) elapsed: Duration,
    /// The intervals, in nanoseconds.
    pub(crate) hist: Histogram<u64>,
}

impl Measured {
    /// Adds `other`'s iterations, time and intervals to these (runs measured in parts).
    pub(crate) fn add(&mut self, other: &Measured) -> AnyResult<()> {
        self.iters += other.iters;
        self.elapsed += other.elapsed;
        self.hist.add(&other.hist)?;
        Ok(())
    }

    /// Seconds per iteration (a round trip, or an operation), from the wall clock.
    pub(crate) fn secs_per_iter(&self) -> f64 {
        self.elapsed.as_secs_f64() / self.iters.max(1) as f64
    }

    /// The median interval's seconds (NaN when nothing was timed).
    pub(crate) fn typical_secs_per_iter(&self) -> f64 {
        if self.hist.is_empty() {
            return f64::NAN;
        }
        self.hist.value_at_quantile(0.5) as f64 * 1e-9
    }

    /// The report row of `test` at `size` over `transport`.
    pub(crate) fn row(&self, test: Test, size: usize, transport: &str) -> Row {
        row(test, size, self.iters, self.elapsed, &self.hist, transport)
    }
}

/// Runs one (test, size) from the client side: `warmup` untimed iterations, then `iters`
/// timed ones.
pub(crate) async fn run_client(
    test: Test,
    size: usize,
    iters: u64,
    warmup: u64,
    window: usize,
    recv_window: usize,
    side: &mut Side<'_>,
) -> AnyResult<Measured> {
    let (w, ep) = (side.w, side.ep);
    let total = iters + warmup;
    // put_lat: the server puts into a region of ours.
    let mine = if test == Test::PutLat { Some(w.context().alloc(size)?) } else { None };
    let mut cmd = format!("{} {size} {total} {recv_window}", test.name());
    if test == Test::GetBw && side.unwritten {
        // The server's region is what get_bw moves.
        cmd += &format!(" {UNWRITTEN}");
    }
    if !side.mem.is_host() {
        cmd += &format!(" {MEM}{}", side.mem.name());
    }
    if let Some(r) = &mine {
        cmd += &format!(" {}", hex(&r.pack_key()?));
    }
    send_ctrl(ep, cmd).await?;
    let ready = recv_ctrl_from(ep).await?;
    let mut words = ready.split_whitespace();
    if words.next() != Some("ready") {
        return Err(format!("server answered {ready:?}").into());
    }
    let key: Option<RemoteKey> = match words.next() {
        Some(k) => Some(ep.unpack_key(&unhex(k)?)?),
        None if test.needs_region() => return Err("server sent no key".into()),
        None => None,
    };
    // Registered source/sink for one-sided bandwidth tests (as ucx_perftest uses).
    // put_bw's source is left as UCX allocated it with --unwritten-source.
    let local = if test.needs_region() {
        Some(alloc_region(w, size.max(8), !(test == Test::PutBw && side.unwritten))?)
    } else {
        None
    };
    // Large messages of the two-sided bandwidth tests are sent from memory UCX
    // allocated, as ucx_perftest sends from its mapped buffer (UCX may back it with huge
    // pages, which copies of many MiB feel), written before the clock runs (real data in
    // pages in place) unless --unwritten-source leaves it as allocated.
    let two_sided = matches!(test, Test::TagBw | Test::StreamBw | Test::AmBw);
    let host_send = side.mem.send == MemKind::Host;
    let region_source = if two_sided && host_send && size >= REGION_SEND_MIN {
        Some(alloc_region(w, size, !side.unwritten)?)
    } else {
        None
    };
    let payload = match &region_source {
        Some(_) => &[][..],
        None if two_sided && side.unwritten => unwritten(size),
        None => payload(size, 0x5a, 0x5a),
    };
    let mut clock = Clock::new(warmup)?;
    match test {
        // Each iteration posts its message first (as ucx_perftest does) and reads the
        // clock for the previous iteration only then, so that the clock read is not on
        // the round trip's critical path; the time between reads is still one round trip.
        Test::TagLat if side.mem.is_host() => {
            tag_lat_client(side, &mut clock, total, payload, Vec::with_capacity(size)).await?
        }
        Test::TagLat => device::tag_lat_client(side, &mut clock, total, size).await?,
        Test::StreamLat => {
            let mut rbuf: Box<[u8]> = vec![0u8; size].into();
            for i in 0..total {
                let send = ep.stream_send(payload);
                clock.tick_before(i)?;
                send.await.0?;
                let (r, b) = ep.stream_recv_exact(rbuf).await;
                r?;
                rbuf = b;
            }
            clock.tick_before(total)?;
        }
        Test::AmLat => {
            let mut rbuf: Vec<u8> = Vec::with_capacity(size);
            for i in 0..total {
                let send = ep.am_send(AM_C2S, &[], payload);
                clock.tick_before(i)?;
                send.await.0?;
                let m = side.am.recv().await;
                if m.is_rendezvous() {
                    let (r, b) = m.recv_data(rbuf).await;
                    r?;
                    rbuf = b;
                }
            }
            clock.tick_before(total)?;
        }
        Test::PutLat => {
            let key = key.as_ref().ok_or("no key")?;
            let mine = mine.as_ref().ok_or("no region")?;
            let bufs: [&'static [u8]; 2] = [marked(size, 1), marked(size, 2)];
            for i in 0..total {
                let m = 1 + (i % 2) as u8;
                let send = ep.put(bufs[(i % 2) as usize], key, 0);
                clock.tick_before(i)?;
                send.await.0?;
                wait_marker(w, mine, m).await;
            }
            clock.tick_before(total)?;
        }
        Test::TagBw | Test::StreamBw | Test::AmBw | Test::PutBw | Test::GetBw | Test::AtomicRate => {
            let key = key.as_ref();
            // --immediate: a message UCX sends during the call needs no operation.
            let immediate = side.immediate && size <= IMMEDIATE_MAX;
            let try_now = || if immediate { sent_now(test, ep, payload, key) } else { Ok(false) };
            let run = Window { clock: &mut clock, total, warmup, window };
            match test {
                // Only a device side differs: host messages go out as they do without --mem.
                Test::TagBw if !host_send => device::tag_bw_client(run, ep, size).await?,
                Test::TagBw | Test::StreamBw | Test::AmBw => match &region_source {
                    Some(r) => run.keep(try_now, || send(test, ep, r.slice(0..size))).await?,
                    None => run.keep(try_now, || send(test, ep, payload)).await?,
                },
                Test::PutBw => {
                    let (src, key) = (local.as_ref().ok_or("no region")?, key.ok_or("no key")?);
                    run.keep(try_now, || ep.put(src.slice(0..size), key, 0)).await?
                }
                Test::GetBw => {
                    let (dst, key) = (local.as_ref().ok_or("no region")?, key.ok_or("no key")?);
                    run.keep(try_now, || ep.get(dst.slice(0..size), size, key, 0)).await?
                }
                _ => {
                    let key = key.ok_or("no key")?;
                    run.keep(try_now, || ep.atomic_add(key, 0, 1)).await?
                }
            }
            if matches!(test, Test::PutBw | Test::AtomicRate) {
                // Complete at the target, not only locally.
                ep.flush().await?;
            }
            if matches!(test, Test::TagBw | Test::StreamBw | Test::AmBw) {
                // The server acknowledges once everything arrived (bound to the endpoint:
                // a server that died ends the wait).
                let (r, _) = ep.tag_recv(DATA_S2C, tag::EXACT, Vec::with_capacity(8)).await;
                r?;
            }
        }
    }
    let elapsed = clock.start.elapsed();
    if test.needs_region() {
        send_ctrl(ep, "fin".into()).await?;
    }
    let done = recv_ctrl_from(ep).await?;
    if done != "done" {
        return Err(format!("server answered {done:?}").into());
    }
    Ok(Measured { iters, elapsed, hist: clock.histogram()?.clone() })
}

/// The client's tag_lat loop: sends `sbuf` (a clone each time), receives into `rbuf`.
/// Generic, so that host and device buffers run the same loop.
pub(crate) async fn tag_lat_client<S: IoBuf + Clone, R: IoBufMut>(
    side: &Side<'_>,
    clock: &mut Clock,
    total: u64,
    sbuf: S,
    mut rbuf: R,
) -> AnyResult<()> {
    let (w, ep) = (side.w, side.ep);
    for i in 0..total {
        let send = ep.tag_send(DATA_C2S, sbuf.clone());
        let recv = w.tag_recv(DATA_S2C, tag::EXACT, rbuf);
        clock.tick_before(i)?;
        send.await.0?;
        let (r, b) = recv.await;
        r?;
        rbuf = b;
    }
    clock.tick_before(total)?;
    Ok(())
}

/// The server's tag_lat loop (see [`tag_lat_client`]).
pub(crate) async fn tag_lat_server<S: IoBuf + Clone, R: IoBufMut>(
    side: &Side<'_>,
    total: u64,
    sbuf: S,
    mut rbuf: R,
) -> AnyResult<()> {
    let (w, ep) = (side.w, side.ep);
    for _ in 0..total {
        let (r, b) = w.tag_recv(DATA_C2S, tag::EXACT, rbuf).await;
        r?;
        rbuf = b;
        let (s, _) = ep.tag_send(DATA_S2C, sbuf.clone()).await;
        s?;
    }
    Ok(())
}

/// The server's tag_bw receives: `window` kept posted, each into a buffer from `buf`,
/// until `total` arrived; then the acknowledgement.
pub(crate) async fn tag_bw_server<R: IoBufMut>(
    side: &Side<'_>,
    total: u64,
    window: usize,
    buf: impl FnMut() -> R,
) -> AnyResult<()> {
    let w = side.w;
    keep_posted(total, window, buf, |b| w.tag_recv(DATA_C2S, tag::EXACT, b)).await?;
    side.ep.tag_send(DATA_S2C, vec![1u8]).await.0?;
    Ok(())
}

/// Messages of the two-sided bandwidth tests from this size on are sent from a region
/// UCX allocated (see `run_client`).
const REGION_SEND_MIN: usize = 64 << 10;

/// The largest message `--immediate` offers to the borrowed-buffer calls: UCX's short
/// protocols stop well below it, and a longer one would only cost a refused call each.
const IMMEDIATE_MAX: usize = 8 << 10;

/// Sends one message of a bandwidth test with the borrowed-buffer call if UCX completes
/// it during the call (`--immediate`); false when it did not, and nothing was sent.
fn sent_now(test: Test, ep: &Endpoint, payload: &[u8], key: Option<&RemoteKey>) -> AnyResult<bool> {
    Ok(match test {
        Test::TagBw => ep.try_tag_send(DATA_C2S, payload)?,
        Test::AmBw => ep.try_am_send(AM_C2S, &[], payload)?,
        Test::PutBw => ep.try_put(payload, key.ok_or("no key")?, 0)?,
        _ => false,
    })
}

/// The send of a two-sided bandwidth test.
pub(crate) fn send<B: IoBuf>(test: Test, ep: &Endpoint, buf: B) -> ucxkit::transport::SendOp<B> {
    match test {
        Test::TagBw => ep.tag_send(DATA_C2S, buf),
        Test::StreamBw => ep.stream_send(buf),
        _ => ep.am_send(AM_C2S, &[], buf),
    }
}

/// A payload of `size` bytes of `fill` whose last byte is `last`, made once per process
/// and kept: sends borrow it as `&'static [u8]`, so the hot loop does no reference
/// counting (as a C benchmark reuses one buffer), and a long-lived server does not grow.
pub(crate) fn payload(size: usize, fill: u8, last: u8) -> &'static [u8] {
    type Key = (usize, u8, u8);
    static CACHE: Mutex<Vec<(Key, &'static [u8])>> = Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = cache.iter().find(|(k, _)| *k == (size, fill, last)) {
        return p;
    }
    // `vec![0; n]` is a zeroed allocation, not a fill: its pages stay untouched.
    let mut v = vec![fill; size];
    if last != fill {
        if let Some(b) = v.last_mut() {
            *b = last;
        }
    }
    let p: &'static [u8] = Vec::leak(v);
    cache.push(((size, fill, last), p));
    p
}

/// `size` bytes never written, kept for the rest of the run (two-sided messages below
/// `REGION_SEND_MIN` with `--unwritten-source`): a zeroed allocation, which is not a fill.
fn unwritten(size: usize) -> &'static [u8] {
    payload(size, 0, 0)
}

/// The word of a command that asks the server for a region never written (get_bw with
/// `--unwritten-source`).
const UNWRITTEN: &str = "unwritten";

/// Prefix of the command word that gives a test's memory types (`mem=cuda,host`).
const MEM: &str = "mem=";

/// A put_lat payload whose last byte is `marker`.
fn marked(size: usize, marker: u8) -> &'static [u8] {
    payload(size, 0x5a, marker)
}

/// A region of `len` bytes allocated by UCX, as ucx_perftest allocates its buffers,
/// [`fill`]ed if `written`, else left as allocated (zeros, in pages never written where
/// the memory is fresh from the kernel).
fn alloc_region(w: &Worker, len: usize, written: bool) -> AnyResult<MemRegion> {
    let r = w.context().alloc(len)?;
    if written {
        fill(&r);
    }
    Ok(r)
}

/// Writes a pattern over all of `r`, so that its pages are in place before the clock
/// runs and hold real data (memory never written reads as the kernel's shared zero page,
/// which stays in cache: ucx_perftest's UCP tests, which never write their buffers, send
/// from it).
fn fill(r: &MemRegion) {
    let chunk = payload(REGION_SEND_MIN, 0x5a, 0x5a);
    for at in (0..r.len()).step_by(chunk.len()) {
        r.write_at(at, &chunk[..chunk.len().min(r.len() - at)]);
    }
}

fn row(
    test: Test,
    size: usize,
    iters: u64,
    elapsed: Duration,
    hist: &Histogram<u64>,
    transport: &str,
) -> Row {
    let secs = elapsed.as_secs_f64().max(1e-12);
    let n = iters.max(1) as f64;
    let size = test.effective_size(size);
    let (lat, p50, p99, msg_rate, bw) = if test.is_latency() {
        // One-way latency: half the round trip; one message each way per iteration.
        let lat = secs * 1e6 / n / 2.0;
        let bw = size as f64 / (lat * 1e-6) / (1 << 20) as f64;
        (
            lat,
            hist.value_at_quantile(0.5) as f64 / 2e3,
            hist.value_at_quantile(0.99) as f64 / 2e3,
            2.0 * n / secs,
            bw,
        )
    } else {
        let bw = size as f64 * n / secs / (1 << 20) as f64;
        (
            secs * 1e6 / n,
            hist.value_at_quantile(0.5) as f64 / 1e3,
            hist.value_at_quantile(0.99) as f64 / 1e3,
            n / secs,
            bw,
        )
    };
    Row {
        test: test.name().into(),
        size,
        iters,
        lat_us: lat,
        lat_p50_us: p50,
        lat_p99_us: p99,
        bw_mibps: if size == 0 { 0.0 } else { bw },
        msg_rate,
        transport: transport.into(),
        source: "ucxkit".into(),
    }
}

/// Up to this size each receive of a bandwidth server has its own buffer (eager messages
/// are copied out of UCX's unexpected queue otherwise); larger messages all land in one
/// registered buffer, as with ucx_perftest's receiver, so that a deep window of posted
/// receives does not stream distinct large buffers through memory.
const OWN_BUFFERS_MAX: usize = 8192;

/// Serves one command from the client (already received as `cmd`).
pub(crate) async fn serve_one(cmd: &str, side: &mut Side<'_>) -> AnyResult<()> {
    let (w, ep) = (side.w, side.ep);
    let parts: Vec<&str> = cmd.split_whitespace().collect();
    // test size total window [unwritten] [mem=SEND,RECV] [key]
    let (test, size, total, window, unwritten, mem, their_key) = match parts.as_slice() {
        [t, s, n, win, rest @ ..] => {
            let (unwritten, rest) = match rest {
                [UNWRITTEN, rest @ ..] => (true, rest),
                _ => (false, rest),
            };
            let (mem, rest) = match rest {
                [m, rest @ ..] if m.starts_with(MEM) => (cli::parse_mem(&m[MEM.len()..])?, rest),
                _ => (Mem::HOST, rest),
            };
            if rest.len() > 1 {
                return Err(format!("bad command {cmd:?}").into());
            }
            (
                Test::from_name(t).ok_or_else(|| format!("unknown test {t:?}"))?,
                s.parse::<usize>()?,
                n.parse::<u64>()?,
                win.parse::<usize>()?.max(1),
                unwritten,
                mem,
                rest.first().copied(),
            )
        }
        _ => return Err(format!("bad command {cmd:?}").into()),
    };
    test.check_size(size)?;
    if !mem.is_host() && !matches!(test, Test::TagLat | Test::TagBw) {
        return Err(format!("{} does not run with --mem {}", test.name(), mem.name()).into());
    }
    // put_lat polls the last byte the client's put writes: exactly `size` bytes.
    let region = match test {
        Test::PutLat => Some(w.context().alloc(size)?),
        // get_bw's source is written first unless the client asked otherwise.
        t if t.needs_region() => Some(alloc_region(w, size.max(8), test == Test::GetBw && !unwritten)?),
        _ => None,
    };
    let their_key = match their_key {
        Some(k) => Some(ep.unpack_key(&unhex(k)?)?),
        None => None,
    };
    match &region {
        Some(r) => send_ctrl(ep, format!("ready {}", hex(&r.pack_key()?))).await?,
        None => send_ctrl(ep, "ready".into()).await?,
    }
    let payload = payload(size, 0xa5, 0xa5);
    match test {
        Test::TagLat if mem.is_host() => {
            tag_lat_server(side, total, payload, Vec::with_capacity(size)).await?
        }
        Test::TagLat => device::tag_lat_server(side, mem, total, size).await?,
        Test::TagBw if mem.recv != MemKind::Host => device::tag_bw_server(side, total, window, size).await?,
        Test::StreamLat => {
            let mut rbuf: Box<[u8]> = vec![0u8; size].into();
            for _ in 0..total {
                let (r, b) = ep.stream_recv_exact(rbuf).await;
                r?;
                rbuf = b;
                let (s, _) = ep.stream_send(payload).await;
                s?;
            }
        }
        Test::AmLat => {
            let mut rbuf: Vec<u8> = Vec::with_capacity(size);
            for _ in 0..total {
                let m = side.am.recv().await;
                if m.is_rendezvous() {
                    let (r, b) = m.recv_data(rbuf).await;
                    r?;
                    rbuf = b;
                }
                let (s, _) = ep.am_send(AM_S2C, &[], payload).await;
                s?;
            }
        }
        Test::PutLat => {
            let key = their_key.as_ref().ok_or("put_lat needs the client's key")?;
            let region = region.as_ref().ok_or("no region")?;
            let bufs: [&'static [u8]; 2] = [marked(size, 1), marked(size, 2)];
            for i in 0..total {
                let m = 1 + (i % 2) as u8;
                wait_marker(w, region, m).await;
                let (s, _) = ep.put(bufs[(i % 2) as usize], key, 0).await;
                s?;
            }
        }
        Test::TagBw => {
            if size > OWN_BUFFERS_MAX {
                let shared = w.context().alloc(size)?;
                tag_bw_server(side, total, window, || shared.slice(0..size)).await?;
            } else {
                tag_bw_server(side, total, window, || Vec::with_capacity(size)).await?;
            }
        }
        Test::StreamBw => {
            if size > OWN_BUFFERS_MAX {
                let shared = w.context().alloc(size)?;
                keep_posted(total, window, || shared.slice(0..size), |b| ep.stream_recv_exact(b)).await?;
            } else {
                keep_posted(
                    total,
                    window,
                    || Box::<[u8]>::from(vec![0u8; size]),
                    |b| ep.stream_recv_exact(b),
                )
                .await?;
            }
            ep.tag_send(DATA_S2C, vec![1u8]).await.0?;
        }
        Test::AmBw => {
            // Rendezvous payloads are all fetched into one registered buffer.
            let shared = w.context().alloc(size.max(1))?;
            let mut fetching = VecDeque::with_capacity(window);
            for _ in 0..total {
                let m = side.am.recv().await;
                if !m.is_rendezvous() {
                    continue;
                }
                if fetching.len() == window {
                    let f: ucxkit::transport::AmRecvData<RegionSlice> = fetching.pop_front().expect("full");
                    f.await.0?;
                }
                fetching.push_back(m.recv_data(shared.slice(0..size)));
            }
            while let Some(f) = fetching.pop_front() {
                f.await.0?;
            }
            ep.tag_send(DATA_S2C, vec![1u8]).await.0?;
        }
        Test::PutBw | Test::GetBw | Test::AtomicRate => {
            // Passive target: wait for the client to finish.
            let fin = recv_ctrl_from(ep).await?;
            if fin != "fin" {
                return Err(format!("expected fin, got {fin:?}").into());
            }
        }
    }
    if test == Test::PutLat {
        let fin = recv_ctrl_from(ep).await?;
        if fin != "fin" {
            return Err(format!("expected fin, got {fin:?}").into());
        }
    }
    send_ctrl(ep, "done".into()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(iters: u64, micros: u64, interval_ns: u64) -> Measured {
        let mut hist = Histogram::new(3).expect("histogram");
        hist.record_n(interval_ns, iters).expect("record");
        Measured { iters, elapsed: Duration::from_micros(micros), hist }
    }

    /// Runs measured in parts add up: iterations, time and intervals; the time per
    /// iteration is the whole's, the typical one the median interval.
    #[test]
    fn measured_parts_add_up() {
        let mut m = measured(1000, 1000, 900);
        assert!((m.secs_per_iter() - 1e-6).abs() < 1e-12);
        m.add(&measured(3000, 9000, 2900)).expect("add");
        assert_eq!(m.iters, 4000);
        assert_eq!(m.elapsed, Duration::from_micros(10_000));
        assert!((m.secs_per_iter() - 2.5e-6).abs() < 1e-12);
        assert_eq!(m.hist.len(), 4000);
        assert!((m.typical_secs_per_iter() - 2.9e-6).abs() < 1e-8);
        let row = m.row(Test::TagLat, 8, "posix");
        assert_eq!(row.iters, 4000);
        // One-way latency: half of the round trip.
        assert!((row.lat_us - 1.25).abs() < 1e-9);
        let empty =
            Measured { iters: 0, elapsed: Duration::ZERO, hist: Histogram::new(3).expect("histogram") };
        assert!(empty.typical_secs_per_iter().is_nan());
    }
}
