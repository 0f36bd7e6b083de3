//! Closing and shutting down, as UCX reports them: endpoints dropped, then their workers
//! at once (each close must finish before its worker is destroyed, with no error or leak
//! report from UCX); connections closed every ordinary way (no UCX error lines); a
//! dropped endpoint whose peer never answers (closed when its wait is up); a close while
//! large sends are in flight (they arrive); messages received through an endpoint after
//! its peer closed it; a rendezvous message from an endpoint closed
//! since (an error, not a read of freed memory). UCX and
//! ucxkit's `tracing` write to the process's output, so the scenarios that check it run
//! in a child process (this test binary again, with a variable set) whose output the
//! parent reads.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{child_run, ctx, loopback, wait_parked_zero};
use ucxkit::transport::{tag, AmProto, AmSendOptions, EndpointOptions, ErrorKind, ErrorMode, ProgressMode};

/// The child: per transport, two workers of one single-thread runtime connect through a
/// listener and exchange an eager and a rendezvous message each way; then one endpoint's
/// close is abandoned, the other endpoint is dropped, and both workers are dropped at once.
#[tokio::test]
#[ignore = "the child half of drop_without_close_is_clean; the parent runs it"]
async fn shutdown_child() {
    if std::env::var_os("UCXKIT_SHUTDOWN_CHILD").is_none() {
        return;
    }
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let c = ctx(tls);
        // No linger: the driver sleeps as soon as the worker is idle.
        let a = c.worker().event_linger(Duration::ZERO).build().unwrap();
        let b = c.worker().event_linger(Duration::ZERO).build().unwrap();
        let l = a.listen(loopback()).unwrap();
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        for len in [64, 1 << 20] {
            let recv = a.tag_recv(1, tag::EXACT, Vec::with_capacity(len));
            ep.tag_send(1, vec![7u8; len]).await.0.unwrap();
            assert_eq!(recv.await.1, vec![7u8; len]);
            let recv = b.tag_recv(2, tag::EXACT, Vec::with_capacity(len));
            acc.tag_send(2, vec![9u8; len]).await.0.unwrap();
            assert_eq!(recv.await.1, vec![9u8; len]);
        }
        // The peer of each close is the other worker, which only this thread progresses.
        // One endpoint's close() is started, then given up on (as a timeout around it
        // would); the other endpoint is dropped.
        let mut close = Box::pin(ep.close());
        assert!(futures_util::poll!(&mut close).is_pending(), "a close to a live peer finished at once");
        drop(close);
        drop((acc, l));
        drop(b);
        drop(a);
    }
}

#[test]
fn drop_without_close_is_clean() {
    let t = Instant::now();
    let text = child("shutdown_child", "UCXKIT_SHUTDOWN_CHILD");
    let reports: Vec<&str> =
        text.lines().filter(|l| l.contains("UCX  ERROR") || l.contains("UCX  WARN")).collect();
    assert!(reports.is_empty(), "UCX reported problems at shutdown:\n{}", reports.join("\n"));
    // The closes finished rather than being given up: a worker waits up to 2 s for its
    // closes before it gives up (the child takes about 0.1 s when none is).
    let took = t.elapsed();
    assert!(took < Duration::from_millis(1500), "the child took {took:?}: a close was waited out");
}

/// Runs the child test `name` (this test binary again, with `env` set) and returns its
/// stdout and stderr, having checked that it ran and passed.
fn child(name: &str, env: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture"])
        .env(env, "1")
        .output()
        .unwrap();
    // UCX logs to stdout unless told otherwise.
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed: {}\n{text}", out.status);
    assert!(text.contains("1 passed"), "the child ran nothing:\n{text}");
    text
}

/// The child of `closes_are_quiet`: per transport, connections through a listener closed
/// every ordinary way (the connecting side first, through ucxkit's close-first exchange;
/// the accepting side first, through its closing exchange; with the handshake off,
/// either side first; each in both error modes), each side
/// closing after it has seen the other's close. UCX's lines go to stdout and ucxkit's
/// `tracing` output (debug) to stderr.
#[tokio::test]
#[ignore = "the child half of closes_are_quiet; the parent runs it"]
async fn close_child() {
    if !child_run("UCXKIT_CLOSE_CHILD", "ucxkit::ucx=debug") {
        return;
    }
    const LIMIT: Duration = Duration::from_secs(20);
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let c = ctx(tls);
        let a = c.create_worker().unwrap();
        let b = c.create_worker().unwrap();
        let l = a.listen(loopback()).unwrap();
        // Plain UCX clients (no handshake) connect to UCX's own listener.
        let plain = ucxkit::transport::EndpointOptions { handshake: false, ..Default::default() };
        let lp = a.listen_with(loopback(), plain).unwrap();
        let cases = [true, false].into_iter().flat_map(|h| {
            [true, false].into_iter().flat_map(move |c| [ErrorMode::Auto, ErrorMode::Peer].map(|m| (h, c, m)))
        });
        for (handshake, connecting_first, error_mode) in cases {
            let opts = ucxkit::transport::EndpointOptions { handshake, error_mode, ..Default::default() };
            let l = if handshake { &l } else { &lp };
            let (acc, ep) = tokio::join!(
                async { l.next().await.unwrap().accept_with(opts.clone()).await },
                b.connect_with(l.local_addr(), opts.clone())
            );
            let (acc, ep) = (acc.unwrap(), ep.unwrap());
            let recv = a.tag_recv(1, tag::EXACT, Vec::with_capacity(64));
            ep.tag_send(1, vec![7u8; 64]).await.0.unwrap();
            assert_eq!(recv.await.1, vec![7u8; 64]);
            let (first, second) = if connecting_first { (ep, acc) } else { (acc, ep) };
            let case = format!(
                "{tls}, handshake {handshake}, connecting side first {connecting_first}, {error_mode:?}"
            );
            tokio::time::timeout(LIMIT, first.close()).await.expect(&case).expect(&case);
            tokio::time::timeout(LIMIT, second.failed()).await.expect(&case);
            tokio::time::timeout(LIMIT, second.close()).await.expect(&case).expect(&case);
        }
        // The connecting side drops its endpoint, which waits for the peer to close first
        // and then closes (UCX has failed it by then: its flush errors are quieted).
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        drop(ep);
        tokio::time::timeout(LIMIT, acc.failed()).await.expect(tls);
        wait_parked_zero(&b, LIMIT).await;
        tokio::time::timeout(LIMIT, acc.close()).await.expect(tls).expect(tls);
        // Again, and at once its worker is dropped too, which closes the endpoint without
        // waiting.
        let b = c.create_worker().unwrap();
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        drop(ep);
        // (The close-first notice may be in flight too.)
        assert!(b.parked_requests() >= 1, "{tls}: the dropped endpoint waits for its peer");
        drop(b);
        tokio::time::timeout(LIMIT, acc.failed()).await.expect(tls);
        tokio::time::timeout(LIMIT, acc.close()).await.expect(tls).expect(tls);
    }
}

/// Closing connections in the ordinary ways makes UCX print nothing: the error lines UCX
/// logs when the side closing second flushes its dead lanes go to ucxkit's `tracing`
/// output instead (and show up there, so the scenario did produce them).
#[test]
fn closes_are_quiet() {
    let text = child("close_child", "UCXKIT_CLOSE_CHILD");
    let reports: Vec<&str> =
        text.lines().filter(|l| l.contains("UCX  ERROR") || l.contains("UCX  WARN")).collect();
    assert!(reports.is_empty(), "UCX reported problems on close:\n{}", reports.join("\n"));
    assert!(
        text.contains("expected UCX error: req"),
        "no UCX flush error reached tracing: the scenario no longer closes a failed endpoint\n{text}"
    );
}

/// The child of `a_silent_peer_is_closed_at_the_deadline`: the accepting worker runs on a
/// thread of its own, which stops progressing it once the connection is made; the
/// connecting side drops its endpoint, which waits for the peer to close first, and is
/// closed when the wait is up. ucxkit's `tracing` output (debug) goes to stderr.
#[tokio::test]
#[ignore = "the child half of a_silent_peer_is_closed_at_the_deadline; the parent runs it"]
async fn silent_peer_child() {
    if !child_run("UCXKIT_SILENT_PEER_CHILD", "ucxkit_transport=debug") {
        return;
    }
    let c = ctx("posix,cma,tcp,self");
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (connected_tx, connected_rx) = tokio::sync::oneshot::channel::<()>();
    let (blocked_tx, blocked_rx) = std::sync::mpsc::channel::<()>();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let server_ctx = c.clone();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let w = server_ctx.create_worker().unwrap();
            let l = w.listen(loopback()).unwrap();
            addr_tx.send(l.local_addr()).unwrap();
            let acc = l.accept().await.unwrap();
            // Progressing until the client has its answer (UCX may need this side's
            // progress to deliver it)...
            let _ = connected_rx.await;
            // ...then the only thread that progresses this worker blocks: the peer is
            // silent.
            blocked_tx.send(()).unwrap();
            resume_rx.recv().unwrap();
            drop((acc, l, w));
        });
    });
    // Blocking this runtime's thread is harmless here: nothing of it runs yet.
    let addr = addr_rx.recv().unwrap();
    let w = c.create_worker().unwrap();
    let ep = tokio::time::timeout(Duration::from_secs(20), w.connect(addr)).await.unwrap().unwrap();
    connected_tx.send(()).unwrap();
    // Blocking this thread until the server's blocks: nothing of this runtime needs to
    // run meanwhile.
    blocked_rx.recv().unwrap();
    drop(ep);
    assert!(w.parked_requests() >= 1, "the dropped endpoint waits for its peer");
    // Past the one second wait, with the driver's fallback wake-ups to notice it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    resume_tx.send(()).unwrap();
    drop(w);
    server.join().unwrap();
}

/// A dropped endpoint whose peer never closes first is closed once the wait is up, with
/// no event from the peer to prompt it.
#[test]
fn a_silent_peer_is_closed_at_the_deadline() {
    let text = child("silent_peer_child", "UCXKIT_SILENT_PEER_CHILD");
    assert!(
        text.contains("the peer did not answer in time"),
        "the dropped endpoint was not closed at its deadline:\n{text}"
    );
}

/// The in-process tests below, one at a time: their connections come and go in several
/// workers of this process at once, which UCX before 1.18 can abort on (see README,
/// "Several workers in one process").
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Large sends still in flight when their endpoint is closed reach the peer: the close
/// (through the peer, from either side) waits for them until the peer's receives take
/// them, here posted a while after the close began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_sends_in_flight() {
    let _serial = SERIAL.lock().await;
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        for accepting_sends in [false, true] {
            let case = format!("{tls}, accepting side sends: {accepting_sends}");
            let (sw, cw, sep, cep) = common::pair(tls).await;
            let (sender, receiver) = if accepting_sends { (sep, &cw) } else { (cep, &sw) };
            let data = common::payload(21, 4 << 20);
            let mut am = receiver.am_recv(9).unwrap();
            let tag_send = sender.tag_send(5, data.clone());
            let opts = AmSendOptions { proto: AmProto::Rendezvous, ..Default::default() };
            let am_send = sender.am_send_with(9, b"h", data.clone(), opts);
            let close = tokio::spawn(sender.close());
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (r, got) = receiver.tag_recv(5, tag::EXACT, Vec::with_capacity(data.len())).await;
            r.unwrap_or_else(|e| panic!("{case}: tag receive: {e}"));
            assert!(got == data, "{case}: tag bytes differ");
            let m = tokio::time::timeout(Duration::from_secs(20), am.recv()).await.expect(&case);
            let (r, got) = m.into_vec().await;
            r.unwrap_or_else(|e| panic!("{case}: active-message fetch: {e}"));
            assert!(got == data, "{case}: active-message bytes differ");
            tag_send.await.0.unwrap_or_else(|e| panic!("{case}: tag send: {e}"));
            am_send.await.0.unwrap_or_else(|e| panic!("{case}: active-message send: {e}"));
            close.await.unwrap().unwrap_or_else(|e| panic!("{case}: close: {e}"));
        }
    }
}

/// Messages a peer sent just before closing (or dropping) its end can still be received
/// through the endpoint after the close reached this side, plainly and vectored; a
/// receive with no such message ends with `ConnectionReset`, and after this side's own
/// close it is misuse. Either side sending, both error modes, shared memory and TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_sent_before_the_peer_closed_are_received_after() {
    let _serial = SERIAL.lock().await;
    const LIMIT: Duration = Duration::from_secs(20);
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        for mode in [ErrorMode::Auto, ErrorMode::Peer] {
            for accepting_sends in [false, true] {
                for drop_it in [false, true] {
                    let case =
                        format!("{tls} {mode:?}, accepting side sends: {accepting_sends}, drop: {drop_it}");
                    let (_sw, _cw, sep, cep) = common::pair_with(tls, mode, ProgressMode::Event).await;
                    let (sender, receiver) = if accepting_sends { (sep, cep) } else { (cep, sep) };
                    let (short, long) = (common::payload(24, 100), common::payload(25, 4000));
                    sender.tag_send(5, short.clone()).await.0.expect(&case);
                    sender.tag_send(6, long.clone()).await.0.expect(&case);
                    if drop_it {
                        drop(sender);
                    } else {
                        tokio::time::timeout(LIMIT, sender.close()).await.expect(&case).expect(&case);
                    }
                    tokio::time::timeout(LIMIT, receiver.failed()).await.expect(&case);
                    let (r, got) = receiver.tag_recv(5, tag::EXACT, Vec::with_capacity(200)).await;
                    assert_eq!(r.expect(&case).len, short.len(), "{case}");
                    assert!(got == short, "{case}: bytes differ");
                    let bufs = vec![Vec::with_capacity(1000), Vec::with_capacity(3000)];
                    let (r, got) = receiver.tag_recv_iov(6, tag::EXACT, bufs).await;
                    assert_eq!(r.expect(&case).len, long.len(), "{case}");
                    assert!(got.concat() == long, "{case}: vectored bytes differ");
                    let (r, _) = receiver.tag_recv(5, tag::EXACT, Vec::with_capacity(200)).await;
                    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{case}: none left");
                    let clone = receiver.clone();
                    tokio::time::timeout(LIMIT, receiver.close()).await.expect(&case).expect(&case);
                    let (r, _) = clone.tag_recv(5, tag::EXACT, Vec::with_capacity(200)).await;
                    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput, "{case}: after the close");
                }
            }
        }
    }
}

/// A rendezvous message (tagged, or an active message's payload) that arrived from an
/// endpoint this side then closed is matched or fetched with an error, and the worker
/// goes on: UCX names the endpoint in such messages, and by default (without peer error
/// handling) by its address, which the close freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_from_a_closed_endpoint_fails_safely() {
    let _serial = SERIAL.lock().await;
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let c = ctx(tls);
        let opts = EndpointOptions { handshake: false, ..Default::default() };
        let a = c.worker().endpoint_options(opts.clone()).build().unwrap();
        let b = c.worker().endpoint_options(opts).build().unwrap();
        let l = a.listen(loopback()).unwrap();
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        let mut am = a.am_recv(9).unwrap();
        let data = common::payload(22, 4 << 20);
        let opts = AmSendOptions { proto: AmProto::Rendezvous, ..Default::default() };
        let sends = (ep.tag_send(5, data.clone()), ep.am_send_with(9, b"h", data.clone(), opts));
        let m = tokio::time::timeout(Duration::from_secs(20), am.recv()).await.expect(tls);
        let deadline = Instant::now() + Duration::from_secs(20);
        while a.tag_probe(5, tag::EXACT).is_none() {
            assert!(Instant::now() < deadline, "{tls}: the tagged message arrives");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::timeout(Duration::from_secs(20), acc.close()).await.expect(tls).expect(tls);
        let (r, _) = a.tag_recv(5, tag::EXACT, Vec::with_capacity(data.len())).await;
        assert!(r.is_err(), "{tls}: a message from a closed endpoint");
        let (r, _) = m.into_vec().await;
        assert!(r.is_err(), "{tls}: a payload from a closed endpoint");
        drop((sends, ep));
        // The worker still works.
        let (acc, ep) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (acc, ep) = (acc.unwrap(), ep.unwrap());
        let recv = acc.tag_recv(6, tag::EXACT, Vec::with_capacity(data.len()));
        ep.tag_send(6, data.clone()).await.0.unwrap();
        let (r, got) = recv.await;
        r.unwrap();
        assert!(got == data, "{tls}: after the failed message");
    }
}

/// The peer closes (or drops) its end while this side's large sends to it are still
/// running, never to be received: the sends end with `ConnectionReset` (UCX purges
/// them when the peer's disconnect fails the endpoint; this side never asks UCX to
/// close an endpoint with sends running), and the workers go on making connections.
/// Either side sending, both error modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_closes_while_sends_run() {
    let _serial = SERIAL.lock().await;
    const LIMIT: Duration = Duration::from_secs(20);
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        for mode in [ErrorMode::Auto, ErrorMode::Peer] {
            let c = ctx(tls);
            let opts = EndpointOptions { error_mode: mode, ..Default::default() };
            let sw = c.worker().endpoint_options(opts.clone()).build().unwrap();
            let cw = c.worker().endpoint_options(opts).build().unwrap();
            let l = sw.listen(loopback()).unwrap();
            for accepting_sends in [false, true] {
                for drop_it in [false, true] {
                    let case =
                        format!("{tls} {mode:?}, accepting side sends: {accepting_sends}, drop: {drop_it}");
                    let (sep, cep) = tokio::join!(l.accept(), cw.connect(l.local_addr()));
                    let (sep, cep) = (sep.expect(&case), cep.expect(&case));
                    let (sender, closer) = if accepting_sends { (sep, cep) } else { (cep, sep) };
                    let data = common::payload(23, 4 << 20);
                    let opts = AmSendOptions { proto: AmProto::Rendezvous, ..Default::default() };
                    let sends = (sender.tag_send(5, data.clone()), sender.am_send_with(9, b"h", data, opts));
                    if drop_it {
                        drop(closer);
                    } else {
                        tokio::time::timeout(LIMIT, closer.close()).await.expect(&case).expect(&case);
                    }
                    let (r, _) = tokio::time::timeout(LIMIT, sends.0).await.expect(&case);
                    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{case}: tag send");
                    let (r, _) = tokio::time::timeout(LIMIT, sends.1).await.expect(&case);
                    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{case}: am send");
                    tokio::time::timeout(LIMIT, sender.close()).await.expect(&case).expect(&case);
                    for w in [&sw, &cw] {
                        wait_parked_zero(w, LIMIT).await;
                    }
                }
            }
            // The workers still connect and talk.
            let (a, b) = tokio::join!(l.accept(), cw.connect(l.local_addr()));
            let (a, b) = (a.unwrap(), b.unwrap());
            let recv = a.tag_recv(7, tag::EXACT, Vec::with_capacity(3));
            b.tag_send(7, b"abc".to_vec()).await.0.unwrap();
            assert_eq!(recv.await.1, b"abc", "{tls} {mode:?}");
        }
    }
}

/// The child of `stuck_sends_both_ways_do_not_abort`: per transport, both sides of a
/// connection without peer error handling hold a large send the other never receives;
/// one side closes, then both workers are dropped. ucxkit's `tracing` output (warn) goes
/// to stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of stuck_sends_both_ways_do_not_abort; the parent runs it"]
async fn stuck_sends_child() {
    if !child_run("UCXKIT_STUCK_SENDS_CHILD", "ucxkit_transport=warn") {
        return;
    }
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        let (sw, cw, sep, cep) = common::pair_with(tls, ErrorMode::None, ProgressMode::Event).await;
        let data = common::payload(24, 4 << 20);
        let sends = (sep.tag_send(5, data.clone()), cep.tag_send(6, data));
        tokio::time::timeout(Duration::from_secs(10), cep.close()).await.expect(tls).expect(tls);
        drop((sends, sep, sw, cw));
    }
    // The workers' drops wait up to 2 s for the sends.
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!("stuck sends: done");
}

/// Closing a connection on which both sides hold a rendezvous send the other never
/// receives, without peer error handling: UCX has no way to end those sends, and must not
/// be asked to close the endpoints; dropping the workers leaks them (with a warning)
/// rather than letting UCX destroy endpoints with sends running, which aborts the
/// process in UCX 1.13 (`ucp_ep_destroy_base: proto_reqs`).
#[test]
fn stuck_sends_both_ways_do_not_abort() {
    let text = child("stuck_sends_child", "UCXKIT_STUCK_SENDS_CHILD");
    assert!(text.contains("stuck sends: done"), "{text}");
    assert_eq!(text.matches("the UCX worker and its context are leaked").count(), 4, "{text}");
}
