//! The client side of the paired benchmark: it times each chunk, through ucxkit or
//! raw UCX in turn.

use super::*;

/// One latency chunk: per round trip, one send then one receive; the median one-way
/// latency in ns. With a `pause`, each round trip starts after it (and is timed from
/// then); without, each is timed from the end of the previous one (one clock read).
pub(crate) async fn measure_lat(side: &mut PingPong, raw: bool, iters: u64, pause: Duration) -> f64 {
    let mut times = Vec::with_capacity(iters as usize);
    let mut last = Instant::now();
    for _ in 0..iters {
        if !pause.is_zero() {
            while last.elapsed() < pause {
                std::hint::spin_loop();
            }
            last = Instant::now();
        }
        side.send(raw).await;
        side.recv(raw).await;
        let now = Instant::now();
        times.push((now - last).as_nanos() as u64);
        last = now;
    }
    times.sort_unstable();
    times[times.len() / 2] as f64 / 2.0
}

/// One `tag_bw`, `stream_bw` or `am_bw` chunk: up to `window` tag (stream,
/// active-message) sends from `source` in flight, then the server's acknowledgement; MiB/s.
pub(crate) async fn measure_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, source: &MemRegion) -> f64 {
    let test = o.test;
    // What `--immediate` sends from (borrowed, so any memory does), made before the clock.
    let data = if o.immediate { vec![1u8; o.size] } else { Vec::new() };
    let t0 = Instant::now();
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = source.slice(0..o.size).stable_ptr();
        // SAFETY: as in `PingPong::send`; `source` outlives every send, each waited for
        // before this returns.
        unsafe {
            raw_windowed(wh, o.iters, o.window, || match test {
                Test::StreamBw => raw::post_stream_send(eh, ptr, o.size),
                Test::AmBw => raw::post_am_send(eh, Dir::Ping.raw_am_id(), ptr, o.size),
                _ => raw::post_tag_send(eh, ptr, o.size, PING),
            });
        }
    } else if o.immediate {
        windowed_or_immediate(
            o.iters,
            o.window,
            || ep.try_tag_send(PING, &data).expect("immediate send"),
            || ep.tag_send(PING, source.slice(0..o.size)),
        )
        .await;
    } else {
        windowed(o.iters, o.window, || match test {
            Test::StreamBw => ep.stream_send(source.slice(0..o.size)),
            Test::AmBw => ep.am_send(Dir::Ping.am_id(), &[], source.slice(0..o.size)),
            _ => ep.tag_send(PING, source.slice(0..o.size)),
        })
        .await;
    }
    recv_ack(w, raw, PONG).await;
    mib_per_s(o, t0)
}

/// An operation future of ucxkit's, as [`windowed`] keeps it: whether UCX finished it
/// while posting, and the check of its result.
pub(crate) trait WindowOp: std::future::Future + Unpin {
    fn immediate(&self) -> bool;
    fn check(out: Self::Output);
}

impl<B: ucxkit_transport::IoBuf> WindowOp for ucxkit_transport::SendOp<B> {
    fn immediate(&self) -> bool {
        self.completed_immediately()
    }
    fn check(out: Self::Output) {
        out.0.expect("operation");
    }
}

impl<B: ucxkit_transport::IoBufMut> WindowOp for ucxkit_transport::RecvOp<B> {
    fn immediate(&self) -> bool {
        self.completed_immediately()
    }
    fn check(out: Self::Output) {
        out.0.expect("operation");
    }
}

/// Keeps up to `window` of `n` operations in flight, counting only those UCX did not
/// complete at once, the way UCX programs do: `post` posts one. One that completed at
/// once is awaited right away, as application code would.
pub(crate) async fn windowed<F: WindowOp>(n: u64, window: usize, post: impl FnMut() -> F) {
    windowed_or_immediate(n, window, || false, post).await;
}

/// [`windowed`], each operation first tried with `try_now` (true: UCX completed it during
/// the call) and posted with `post` only when that did not complete it.
pub(crate) async fn windowed_or_immediate<F: WindowOp>(
    n: u64,
    window: usize,
    mut try_now: impl FnMut() -> bool,
    mut post: impl FnMut() -> F,
) {
    let mut inflight = VecDeque::with_capacity(window);
    for _ in 0..n {
        if try_now() {
            continue;
        }
        if inflight.len() == window {
            F::check(inflight.pop_front().expect("in flight").await);
        }
        let op = post();
        if op.immediate() {
            F::check(op.await);
        } else {
            inflight.push_back(op);
        }
    }
    while let Some(op) = inflight.pop_front() {
        F::check(op.await);
    }
}

/// The same through raw UCX: `post` returns what the `*_nbx` call returned.
///
/// # Safety
/// As for [`raw::wait`], for every operation `post` posts on `w`.
pub(crate) unsafe fn raw_windowed(
    w: sys::ucp_worker_h,
    n: u64,
    window: usize,
    mut post: impl FnMut() -> sys::ucs_status_ptr_t,
) {
    let mut inflight = VecDeque::with_capacity(window);
    // SAFETY: per contract.
    unsafe {
        for _ in 0..n {
            if inflight.len() == window {
                raw::wait(w, inflight.pop_front().expect("in flight"));
            }
            let s = post();
            assert!(!sys::UCS_PTR_IS_ERR(s), "raw operation failed");
            if sys::UCS_PTR_IS_PTR(s) {
                inflight.push_back(s);
            }
        }
        while let Some(s) = inflight.pop_front() {
            raw::wait(w, s);
        }
    }
}

/// The server's region, as both paths reach it.
pub(crate) struct Remote {
    key: ucxkit_transport::RemoteKey,
    raw_key: raw::RawRkey,
    raw_addr: u64,
}

/// One `put_bw` or `get_bw` chunk: up to `window` puts from (gets into) `source` in
/// flight, a flush, then an end-of-chunk exchange with the server; MiB/s.
pub(crate) async fn measure_rma_bw(
    w: &Worker,
    ep: &Endpoint,
    raw: bool,
    o: &Opts,
    source: &MemRegion,
    remote: &Remote,
) -> f64 {
    let get = o.test == Test::GetBw;
    let data = if o.immediate { vec![1u8; o.size] } else { Vec::new() };
    let t0 = Instant::now();
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = source.slice(0..o.size).stable_ptr().cast_mut();
        // SAFETY: as in `PingPong::send`; `source` and the server's region outlive every
        // operation, each waited for; the key belongs to `ep` and covers `size` bytes.
        unsafe {
            raw_windowed(wh, o.iters, o.window, || {
                raw::post_rma(eh, get, ptr, o.size, remote.raw_addr, &remote.raw_key)
            });
            raw::flush(wh, eh);
        }
    } else {
        if get {
            windowed(o.iters, o.window, || ep.get(source.slice(0..o.size), o.size, &remote.key, 0)).await;
        } else if o.immediate {
            windowed_or_immediate(
                o.iters,
                o.window,
                || ep.try_put(&data, &remote.key, 0).expect("immediate put"),
                || ep.put(source.slice(0..o.size), &remote.key, 0),
            )
            .await;
        } else {
            windowed(o.iters, o.window, || ep.put(source.slice(0..o.size), &remote.key, 0)).await;
        }
        ep.flush().await.expect("flush");
    }
    send_ack(ep, raw, PING).await;
    recv_ack(w, raw, PONG).await;
    mib_per_s(o, t0)
}

/// A chunk's bandwidth in MiB/s, from its start.
pub(crate) fn mib_per_s(o: &Opts, t0: Instant) -> f64 {
    (o.size as f64 * o.iters as f64) / t0.elapsed().as_secs_f64() / (1 << 20) as f64
}

/// The measuring side: each chunk's figure.
pub(crate) fn client(o: Opts, link: Link) -> Vec<f64> {
    pin(o.cpus[1]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, &link).await;
        let mut side = (!o.test.is_bw()).then(|| PingPong::new(w.clone(), ep.clone(), &o, Dir::Pong, 1));
        let source = w.context().alloc(o.size.max(1)).expect("send buffer");
        source.write_at(0, &vec![1u8; o.size]);
        let keys = o.test.is_rma().then(|| {
            let key = ep.unpack_key(&link.recv("key")).expect("unpack key");
            // SAFETY: no ucxkit operation is pending and this thread is the worker's only
            // user; the key is dropped before the endpoint closes.
            let raw_key = unsafe { raw::RawRkey::unpack(ep.as_raw(), &link.recv("raw key")) };
            let addr = link.recv("region address");
            let raw_addr = u64::from_le_bytes(addr.try_into().expect("an address of 8 bytes"));
            Remote { key, raw_key, raw_addr }
        });
        let mut figures = Vec::with_capacity(o.chunks as usize);
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            let raw = is_raw(chunk);
            figures.push(match (o.test, &keys, &mut side) {
                (Test::TagBw | Test::StreamBw | Test::AmBw, ..) => {
                    measure_bw(&w, &ep, raw, &o, &source).await
                }
                (Test::PutBw | Test::GetBw, Some(k), _) => measure_rma_bw(&w, &ep, raw, &o, &source, k).await,
                (_, _, Some(side)) => measure_lat(side, raw, o.iters, o.pause).await,
                _ => unreachable!("a latency test has its ping-pong side, a one-sided one its keys"),
            });
        }
        drop(keys);
        match side {
            Some(side) => {
                drop(ep);
                side.finish().await;
            }
            None => ep.close().await.unwrap_or(()),
        }
        figures
    })
}
