//! The keepalive ([`crate::liveness`]) between real workers: silent peers failed in
//! bound, live ones kept, endpoints forgotten, peers shared, foreign datagrams dropped.

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::error::Status;
use crate::liveness::wire::{Datagram, Kind};
use crate::liveness::{Keepalive, KeepaliveAddr, KeepaliveLane};
use crate::{Context, Endpoint, ErrorKind, Worker};

const FAST: Keepalive =
    Keepalive { interval: Duration::from_millis(50), timeout: Duration::from_millis(300) };

fn worker(k: Option<Keepalive>) -> Worker {
    let ctx = Context::builder().transports("tcp,self").config("NET_DEVICES", "lo").build().unwrap();
    ctx.worker().keepalive(k).build().unwrap()
}

fn lane(w: &Worker) -> &Arc<KeepaliveLane> {
    w.shared.lane.as_ref().expect("a keepalive lane")
}

/// Connects a client to a server through a listener (TCP: UCX's peer error mode).
async fn pair(server: &Worker, client: &Worker) -> (Endpoint, Endpoint) {
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let (s, c) = tokio::join!(l.accept(), client.connect(l.local_addr()));
    (s.unwrap(), c.unwrap())
}

/// Waits until `w`'s lane watches `n` endpoints that have all heard their peers.
async fn all_heard(w: &Worker, n: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    while lane(w).watching() != (n, n) {
        assert!(Instant::now() < end, "watching {:?}, not {n} heard", lane(w).watching());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Both ends of a connection watch each other; when one side's lane goes quiet (as a
/// frozen or cut-off peer's does), the other's endpoint fails within the timeout
/// plus an interval, pending operations included, with the endpoint-timeout reason.
#[tokio::test]
async fn a_silent_peer_fails_the_endpoint_in_bound() {
    let (server, client) = (worker(Some(FAST)), worker(Some(FAST)));
    let (accepted, ep) = pair(&server, &client).await;
    all_heard(&server, 1).await;
    all_heard(&client, 1).await;
    // Every bit of the tag matched.
    let recv = ep.tag_recv(7, u64::MAX, vec![0u8; 8]);
    lane(&server).stop();
    let quiet = Instant::now();
    let status =
        tokio::time::timeout(Duration::from_secs(10), ep.failed()).await.expect("the endpoint fails");
    let took = quiet.elapsed();
    assert_eq!(status, Status::ENDPOINT_TIMEOUT);
    // Detection takes the timeout plus at most an interval; the rest is scheduling.
    assert!(took >= FAST.timeout - FAST.interval, "failed after {took:?}");
    assert!(took < FAST.timeout + FAST.interval + Duration::from_secs(2), "failed after {took:?}");
    let (r, _) = recv.await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset);
    // Failed: no longer watched. (The forced close resets the server's side.)
    tokio::time::sleep(FAST.interval * 3).await;
    assert_eq!(lane(&client).watching(), (0, 0));
    drop(accepted);
}

/// A connection whose peer answers stays up however long it idles; endpoints dropped
/// or closed are forgotten.
#[tokio::test]
async fn a_live_peer_is_kept_and_a_closed_endpoint_forgotten() {
    let (server, client) = (worker(Some(FAST)), worker(Some(FAST)));
    let (accepted, ep) = pair(&server, &client).await;
    all_heard(&client, 1).await;
    tokio::time::sleep(FAST.timeout * 4).await;
    assert!(ep.failure().is_none() && accepted.failure().is_none());
    ep.close().await.unwrap();
    drop(accepted);
    tokio::time::sleep(FAST.interval * 3).await;
    assert_eq!(lane(&client).watching(), (0, 0));
    assert_eq!(lane(&server).watching(), (0, 0));
}

/// Several endpoints between the same two workers make one peer to ping; it is
/// forgotten with the last of them.
#[tokio::test]
async fn endpoints_to_one_worker_share_its_pings() {
    let (server, client) = (worker(Some(FAST)), worker(Some(FAST)));
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut eps = Vec::new();
    for _ in 0..3 {
        let (s, c) = tokio::join!(l.accept(), client.connect(l.local_addr()));
        eps.push((s.unwrap(), c.unwrap()));
    }
    all_heard(&client, 1).await;
    all_heard(&server, 1).await;
    eps.truncate(1);
    tokio::time::sleep(FAST.interval * 3).await;
    assert_eq!(lane(&client).watching(), (1, 1));
    eps.clear();
    let end = Instant::now() + Duration::from_secs(10);
    while lane(&client).watching() != (0, 0) || lane(&server).watching() != (0, 0) {
        assert!(Instant::now() < end, "peers kept after their endpoints went");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A peer whose lane never answers (UDP filtered, say) is never judged: the
/// endpoint lives.
#[tokio::test]
async fn a_lane_never_heard_fails_nothing() {
    let (server, client) = (worker(Some(FAST)), worker(None));
    assert_eq!(client.keepalive_port(), None);
    let (accepted, ep) = pair(&server, &client).await;
    // The client sent no lane: the server watches nothing.
    assert_eq!(lane(&server).watching(), (0, 0));
    // Watched at a port where nobody answers.
    let nobody = UdpSocket::bind("127.0.0.1:0").unwrap();
    let silent = KeepaliveAddr { port: nobody.local_addr().unwrap().port(), token: 1 };
    let target: Weak<crate::endpoint::EndpointInner> = Arc::downgrade(&accepted.inner);
    lane(&server).watch(&["127.0.0.1".parse().unwrap()], silent, target);
    tokio::time::sleep(FAST.timeout * 3).await;
    assert_eq!(lane(&server).watching(), (1, 0));
    assert!(accepted.failure().is_none() && ep.failure().is_none());
}

/// Whatever arrives at a lane is dropped unless it is a ping with its token or an
/// answer with one of its peers' token and cookie: garbage, forged answers and
/// foreign pings change nothing, and no answer goes to a wrong token.
#[tokio::test]
async fn foreign_datagrams_are_dropped() {
    let (server, client) = (worker(Some(FAST)), worker(Some(FAST)));
    let (_accepted, ep) = pair(&server, &client).await;
    all_heard(&client, 1).await;
    let target = SocketAddr::from(([127, 0, 0, 1], client.keepalive_port().unwrap()));
    let (token, cookie) = lane(&client).some_peer().expect("a watched peer");
    let before = lane(&client).dropped();
    let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
    sender.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let garbage: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xff; 24],
        vec![0; 1000],
        // A ping with a wrong token, and answers with a wrong token or cookie.
        Datagram { kind: Kind::Ping, token: lane(&client).addr().token ^ 1, cookie: 9 }.encode().to_vec(),
        Datagram { kind: Kind::Answer, token: token ^ 1, cookie }.encode().to_vec(),
        Datagram { kind: Kind::Answer, token, cookie: cookie ^ 1 }.encode().to_vec(),
    ];
    for g in &garbage {
        sender.send_to(g, target).unwrap();
    }
    let end = Instant::now() + Duration::from_secs(5);
    while lane(&client).dropped() < before + garbage.len() as u64 {
        assert!(Instant::now() < end, "{} of {} dropped", lane(&client).dropped() - before, garbage.len());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut buf = [0u8; 64];
    assert!(sender.recv_from(&mut buf).is_err(), "a foreign ping was answered");
    // A ping with the lane's token is answered, to whoever sent it.
    let ping = Datagram { kind: Kind::Ping, token: lane(&client).addr().token, cookie: 5 };
    sender.send_to(&ping.encode(), target).unwrap();
    let (n, _) = sender.recv_from(&mut buf).unwrap();
    assert_eq!(Datagram::decode(&buf[..n]), Ok(Datagram { kind: Kind::Answer, ..ping }));
    assert!(ep.failure().is_none());
}

#[tokio::test]
async fn settings_that_cannot_work_are_refused_at_build() {
    let ctx = Context::builder().transports("tcp,self").build().unwrap();
    let bad = Keepalive { interval: Duration::from_secs(1), timeout: Duration::from_secs(1) };
    let e = ctx.worker().keepalive(Some(bad)).build().unwrap_err();
    assert!(matches!(e, crate::Error::ApiMisuse(_)), "{e}");
    assert!(ctx.create_worker().unwrap().keepalive_port().is_some(), "on by default");
}
