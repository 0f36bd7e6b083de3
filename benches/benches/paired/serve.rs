//! The server side of the paired benchmark: it answers ping-pongs and takes windowed
//! transfers, through ucxkit or raw UCX as each chunk says.

use super::*;

/// The answering side of one latency chunk: per round trip, one receive then one send.
pub(crate) async fn serve_lat(side: &mut PingPong, raw: bool, iters: u64) {
    for _ in 0..iters {
        side.recv(raw).await;
        side.send(raw).await;
    }
}

/// The receiving side of one bandwidth chunk: `window` receives kept posted, all into
/// `sink`, then an acknowledgement.
pub(crate) async fn serve_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, sink: &MemRegion) {
    let n = o.iters as usize;
    if raw {
        let (wh, ptr) = (w.as_raw(), sink.slice(0..o.size).stable_ptr().cast_mut());
        let mut posted = VecDeque::with_capacity(o.window);
        // SAFETY: as in `PingPong::send`; `sink` outlives every receive, each waited for
        // before this returns.
        unsafe {
            for _ in 0..n.min(o.window) {
                posted.push_back(raw::post_tag_recv(wh, ptr, o.size, PING, None));
            }
            for i in 0..n {
                raw::wait(wh, posted.pop_front().expect("posted"));
                if i + o.window < n {
                    posted.push_back(raw::post_tag_recv(wh, ptr, o.size, PING, None));
                }
            }
        }
    } else {
        let mut posted = VecDeque::with_capacity(o.window);
        for _ in 0..n.min(o.window) {
            posted.push_back(w.tag_recv(PING, tag::EXACT, sink.slice(0..o.size)));
        }
        for i in 0..n {
            posted.pop_front().expect("posted").await.0.expect("data");
            if i + o.window < n {
                posted.push_back(w.tag_recv(PING, tag::EXACT, sink.slice(0..o.size)));
            }
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The receiving side of one `stream_bw` chunk: the chunk's sends, each received whole
/// into `sink` (`WAITALL`), then an acknowledgement.
pub(crate) async fn serve_stream_bw(w: &Worker, ep: &Endpoint, raw: bool, o: &Opts, sink: &MemRegion) {
    if raw {
        let (wh, eh) = (w.as_raw(), ep.as_raw());
        let ptr = sink.slice(0..o.size).stable_ptr().cast_mut();
        // SAFETY: as in `PingPong::send`; `sink` outlives every receive, each waited for.
        unsafe {
            for _ in 0..o.iters {
                raw::stream_recv_exact(wh, eh, ptr, o.size);
            }
        }
    } else {
        for _ in 0..o.iters {
            ep.stream_recv_exact(sink.slice(0..o.size)).await.0.expect("stream data");
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The receiving side of one `am_bw` chunk: the chunk's messages, each taken whole into
/// `sink` (see the module docs), then an acknowledgement. The raw path's handler, set up
/// by [`AmBwServer::new`], takes them on its own while the worker progresses.
pub(crate) async fn serve_am_bw(ep: &Endpoint, raw: bool, o: &Opts, am: &mut AmBwServer) {
    if raw {
        let want = am.raw.done.get() + o.iters;
        // SAFETY: this thread is the worker's only user and no ucxkit operation is pending.
        unsafe {
            while am.raw.done.get() < want {
                sys::ucp_worker_progress(am.raw.worker);
            }
        }
    } else {
        let mut fetching: VecDeque<ucxkit_transport::AmRecvData<_>> = VecDeque::with_capacity(o.window);
        for _ in 0..o.iters {
            let m = am.ucxkit.recv().await;
            if !m.is_rendezvous() {
                continue;
            }
            if fetching.len() == o.window {
                fetching.pop_front().expect("full").await.0.expect("fetch");
            }
            fetching.push_back(m.recv_data(am.sink.slice(0..o.size)));
        }
        while let Some(f) = fetching.pop_front() {
            f.await.0.expect("fetch");
        }
    }
    send_ack(ep, raw, PONG).await;
}

/// The server's two ways of taking `am_bw` messages. Dropping it removes the raw
/// handler, before the region its buffer points into can go.
pub(crate) struct AmBwServer {
    ucxkit: ucxkit_transport::AmReceiver,
    /// The raw handler's state (for the whole program: it must outlive the handler's
    /// registration even if a chunk panics).
    raw: &'static raw::AmSink,
    sink: MemRegion,
}

impl Drop for AmBwServer {
    fn drop(&mut self) {
        // SAFETY: this thread is the worker's only user, and the worker is alive (the
        // server drops this before its worker handle).
        unsafe { raw::count_am(self.raw.worker, Dir::Ping.raw_am_id(), None) };
    }
}

impl AmBwServer {
    fn new(w: &Worker, sink: &MemRegion) -> AmBwServer {
        let raw: &'static raw::AmSink = Box::leak(Box::new(raw::AmSink {
            worker: w.as_raw(),
            buf: sink.slice(0..sink.len()).stable_ptr().cast_mut(),
            len: sink.len(),
            done: Cell::new(0),
        }));
        // SAFETY: no ucxkit operation is pending and this thread is the worker's only
        // user; the region stays mapped (a clone is kept in `self`) until `drop` removes
        // the handler.
        unsafe { raw::sink_am(Dir::Ping.raw_am_id(), raw) };
        AmBwServer { ucxkit: w.am_recv(Dir::Ping.am_id()).expect("am_recv"), raw, sink: sink.clone() }
    }
}

/// The passive side of one one-sided chunk: it only answers the client's end-of-chunk
/// message, progressing its worker meanwhile (UCX's TCP transport carries puts and gets
/// as messages the target handles).
pub(crate) async fn acknowledge(w: &Worker, ep: &Endpoint, raw: bool) {
    recv_ack(w, raw, PING).await;
    send_ack(ep, raw, PONG).await;
}

/// The answering side.
pub(crate) fn server(o: Opts, link: Link) {
    pin(o.cpus[0]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (w, ep) = connect(&o.tls, &link).await;
        let sink = w.context().alloc(o.size.max(1)).expect("receive buffer");
        // One-sided tests: the client reaches `sink` through a ucxkit key and through a
        // key packed with raw UCX.
        if o.test.is_rma() {
            link.send("key", sink.pack_key().expect("pack key"));
            // SAFETY: the context and the region are alive.
            link.send("raw key", unsafe { raw::pack_rkey(w.context().as_raw(), sink.as_raw()) });
            link.send("region address", sink.addr().to_le_bytes().to_vec());
        }
        let mut side = (!o.test.is_bw()).then(|| PingPong::new(w.clone(), ep.clone(), &o, Dir::Ping, 2));
        let mut am = (o.test == Test::AmBw).then(|| AmBwServer::new(&w, &sink));
        for chunk in 0..o.chunks + WARMUP_CHUNKS {
            let raw = is_raw(chunk);
            match (o.test, &mut side) {
                (Test::TagBw, _) => serve_bw(&w, &ep, raw, &o, &sink).await,
                (Test::StreamBw, _) => serve_stream_bw(&w, &ep, raw, &o, &sink).await,
                (Test::AmBw, _) => serve_am_bw(&ep, raw, &o, am.as_mut().expect("am_bw server")).await,
                (Test::PutBw | Test::GetBw, _) => acknowledge(&w, &ep, raw).await,
                (_, Some(side)) => serve_lat(side, raw, o.iters).await,
                (_, None) => unreachable!("a latency test has its ping-pong side"),
            }
        }
        match side {
            Some(side) => {
                drop(ep);
                side.finish().await;
            }
            None => ep.close().await.unwrap_or(()),
        }
    });
}
