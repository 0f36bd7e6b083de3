//! The keepalive (see [`super`]): its settings, a worker's socket and thread, and the
//! judgement of each watched endpoint's peer.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use super::wire::{Datagram, Kind};

/// What a keepalive lane watches: an endpoint (implemented where endpoints are).
pub(crate) trait KeepaliveTarget: Send + Sync {
    /// Whether the endpoint still works: once it is closed or failed, it is not watched
    /// any more.
    fn usable(&self) -> bool;
    /// Fails the endpoint: its peer has not answered for `silent`.
    fn silent(self: Arc<Self>, silent: Duration);
}

/// A worker's keepalive settings ([`crate::WorkerBuilder::keepalive`]; see
/// [`crate::liveness`]). An endpoint whose peer went silent fails within `timeout` plus
/// one `interval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// How often each watched peer is pinged (default 1 s; 10 ms to 1 h).
    pub interval: Duration,
    /// How long an endpoint whose peer has answered may then hear nothing before it
    /// fails (default 10 s; at least two intervals, at most 1 h).
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive { interval: Duration::from_secs(1), timeout: Duration::from_secs(10) }
    }
}

/// The shortest interval taken.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The longest interval or timeout taken.
const MAX_SETTING: Duration = Duration::from_secs(3600);

impl Keepalive {
    /// Why these settings cannot work, if they cannot.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.interval < MIN_INTERVAL {
            return Err(format!("a keepalive interval of {:?} is under {MIN_INTERVAL:?}", self.interval));
        }
        if self.interval > MAX_SETTING || self.timeout > MAX_SETTING {
            return Err(format!("keepalive settings over {MAX_SETTING:?}: {self:?}"));
        }
        if self.timeout < self.interval * 2 {
            return Err(format!(
                "a keepalive timeout of {:?} is under two intervals of {:?}",
                self.timeout, self.interval
            ));
        }
        Ok(())
    }

    /// Whether a gap of `gap` between two ticks means that the thread itself did not
    /// run (this process frozen or starved), not that the peers were silent.
    fn stalled(&self, gap: Duration) -> bool {
        gap > (self.interval * 2).max(self.timeout / 2)
    }
}

/// A keepalive lane's address as the handshake carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeepaliveAddr {
    /// Its UDP port (never 0).
    pub(crate) port: u16,
    /// The token its pings must carry.
    pub(crate) token: u64,
}

/// Whether a watched endpoint has heard its peer, and when last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Heard {
    Never,
    At(Instant),
}

/// What a tick does with a watched endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Ping,
    Fail,
}

/// One tick's judgement of a watched endpoint. After a stall of the thread itself, the
/// count starts again.
fn judge(heard: &mut Heard, now: Instant, stalled: bool, timeout: Duration) -> Verdict {
    match *heard {
        Heard::Never => Verdict::Ping,
        Heard::At(_) if stalled => {
            *heard = Heard::At(now);
            Verdict::Ping
        }
        Heard::At(t) if now.saturating_duration_since(t) > timeout => Verdict::Fail,
        Heard::At(_) => Verdict::Ping,
    }
}

/// A peer worker's lane and the endpoints to it: one ping an interval whatever their
/// number, so that a worker with many peers, or many endpoints to one, sends and gets
/// back no more datagrams than it has peer workers.
struct PeerLane {
    /// Where the peer's lane may be (each is pinged: a peer answers from whichever of
    /// its addresses its routing picks).
    to: Vec<SocketAddr>,
    /// The peer lane's token.
    token: u64,
    heard: Heard,
    eps: Vec<Weak<dyn KeepaliveTarget>>,
}

/// At most this many addresses are pinged for one peer.
const MAX_ADDRESSES: usize = 8;
/// Datagrams taken in one go, so that a flood cannot hold off the ticks.
const MAX_TAKEN: usize = 1024;
/// Pings sent between two looks at the answers, so that answers do not overflow the
/// socket's receive buffer while a tick pings many peers.
const PINGS_PER_LOOK: usize = 64;

/// A worker's keepalive lane: its UDP socket, the peers it watches (by the cookie their
/// pings carry), and (in [`KeepaliveLane::start`]) the thread that pings and answers.
pub(crate) struct KeepaliveLane {
    socket: UdpSocket,
    /// The socket is IPv6 (IPv4 addresses are sent to mapped).
    v6: bool,
    addr: KeepaliveAddr,
    cfg: Keepalive,
    peers: Mutex<HashMap<u64, PeerLane>>,
    /// Datagrams that were not a ping for this lane nor an answer for one of its
    /// peers.
    dropped: AtomicU64,
    stop: AtomicBool,
}

impl KeepaliveLane {
    /// Opens the socket (IPv6 with IPv4 mapped where the host has it, else IPv4) and
    /// starts the thread, which runs in `rt`'s context (failing an endpoint may spawn).
    pub(crate) fn start(cfg: Keepalive, rt: tokio::runtime::Handle) -> io::Result<Arc<KeepaliveLane>> {
        let socket = match UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)) {
            Ok(s) if takes_ipv4(&s) => s,
            _ => UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?,
        };
        socket.set_nonblocking(true)?;
        let local = socket.local_addr()?;
        let (port, v6) = (local.port(), local.is_ipv6());
        let token = crate::auth::nonce();
        let lane = Arc::new(KeepaliveLane {
            socket,
            v6,
            addr: KeepaliveAddr { port, token },
            cfg,
            peers: Mutex::default(),
            dropped: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let run = lane.clone();
        std::thread::Builder::new().name("ucxkit-keepalive".into()).spawn(move || {
            let _rt = rt.enter();
            run.run();
        })?;
        Ok(lane)
    }

    /// The lane's address for the handshake.
    pub(crate) fn addr(&self) -> KeepaliveAddr {
        self.addr
    }

    /// Datagrams dropped so far.
    #[cfg(test)]
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// How many peers it watches, and how many of them it has heard.
    #[cfg(test)]
    pub(crate) fn watching(&self) -> (usize, usize) {
        let p = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        (p.len(), p.values().filter(|t| t.heard != Heard::Never).count())
    }

    /// The token and cookie of a peer it watches.
    #[cfg(test)]
    pub(crate) fn some_peer(&self) -> Option<(u64, u64)> {
        let p = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        p.iter().next().map(|(&cookie, t)| (t.token, cookie))
    }

    /// Watches `ep`, whose peer's lane is `peer` at one of `ips`, until it is closed,
    /// failed or dropped. A peer not watched yet is pinged at once (it is judged only
    /// once it has answered).
    pub(crate) fn watch(&self, ips: &[IpAddr], peer: KeepaliveAddr, ep: Weak<dyn KeepaliveTarget>) {
        let mut to: Vec<SocketAddr> = Vec::new();
        for &ip in ips {
            let a = SocketAddr::new(ip.to_canonical(), peer.port);
            if !to.contains(&a) && to.len() < MAX_ADDRESSES {
                to.push(a);
            }
        }
        if to.is_empty() {
            return;
        }
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = peers.values_mut().find(|p| p.token == peer.token) {
            for a in to {
                if !p.to.contains(&a) && p.to.len() < MAX_ADDRESSES {
                    p.to.push(a);
                }
            }
            p.eps.push(ep);
            return;
        }
        let mut cookie = crate::auth::nonce();
        while peers.contains_key(&cookie) {
            cookie = crate::auth::nonce();
        }
        let ping = Datagram { kind: Kind::Ping, token: peer.token, cookie }.encode();
        for &a in &to {
            let _ = self.send(&ping, a);
        }
        peers.insert(cookie, PeerLane { to, token: peer.token, heard: Heard::Never, eps: vec![ep] });
    }

    /// Ends the thread (within one interval, at once where loopback works).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        for ip in [IpAddr::V6(Ipv6Addr::LOCALHOST), IpAddr::V4(Ipv4Addr::LOCALHOST)] {
            let _ = self.send(&[0], SocketAddr::new(ip, self.addr.port));
        }
    }

    /// The thread: answers and ticks until stopped; what arrived is always taken in
    /// before a tick judges.
    fn run(&self) {
        let mut last_tick = Instant::now();
        let mut next = last_tick;
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= next {
                self.take_all();
                let now = Instant::now();
                self.tick(now, now - last_tick);
                last_tick = now;
                next = now + self.cfg.interval;
                continue;
            }
            if let Err(e) = readable(&self.socket, next - now) {
                tracing::debug!("keepalive wait: {e}");
                std::thread::sleep(MIN_INTERVAL);
            }
            self.take_all();
        }
    }

    /// Takes in what arrived (at most [`MAX_TAKEN`] datagrams).
    fn take_all(&self) {
        let mut buf = [0u8; 64];
        for _ in 0..MAX_TAKEN {
            match self.socket.recv_from(&mut buf) {
                Ok((n, from)) => self.take(&buf[..n], from),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        tracing::debug!("keepalive receive: {e}");
                    }
                    return;
                }
            }
        }
    }

    /// Takes one datagram from `from`: answers a ping with this lane's token (to
    /// whoever sent it), notes an answer for one of its peers.
    fn take(&self, b: &[u8], from: SocketAddr) {
        let from = SocketAddr::new(from.ip().to_canonical(), from.port());
        match Datagram::decode(b) {
            Ok(d) if d.kind == Kind::Ping && d.token == self.addr.token => {
                let _ = self.send(&Datagram { kind: Kind::Answer, ..d }.encode(), from);
            }
            Ok(d) if d.kind == Kind::Answer => {
                let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
                match peers.get_mut(&d.cookie) {
                    Some(p) if p.token == d.token => p.heard = Heard::At(Instant::now()),
                    _ => {
                        self.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            _ => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Pings every watched peer, fails the endpoints of those silent past the timeout
    /// and forgets endpoints closed, failed or dropped (and peers left with none).
    /// `gap`: the time since the last tick.
    fn tick(&self, now: Instant, gap: Duration) {
        let stalled = self.cfg.stalled(gap);
        let mut pings = Vec::new();
        let mut silent = Vec::new();
        self.peers.lock().unwrap_or_else(PoisonError::into_inner).retain(|&cookie, p| {
            p.eps.retain(|ep| ep.upgrade().is_some_and(|ep| ep.usable()));
            if p.eps.is_empty() {
                return false;
            }
            match judge(&mut p.heard, now, stalled, self.cfg.timeout) {
                Verdict::Ping => {
                    let d = Datagram { kind: Kind::Ping, token: p.token, cookie }.encode();
                    pings.extend(p.to.iter().map(|&a| (a, d)));
                    true
                }
                Verdict::Fail => {
                    silent.append(&mut p.eps);
                    false
                }
            }
        });
        for (i, (to, d)) in pings.into_iter().enumerate() {
            if i % PINGS_PER_LOOK == PINGS_PER_LOOK - 1 {
                self.take_all();
            }
            if let Err(e) = self.send(&d, to) {
                tracing::trace!(%to, "keepalive ping: {e}");
            }
        }
        for ep in silent {
            if let Some(ep) = ep.upgrade() {
                ep.silent(self.cfg.timeout);
            }
        }
    }

    /// Sends `b` to `to` (an IPv4 address mapped on an IPv6 socket).
    fn send(&self, b: &[u8], to: SocketAddr) -> io::Result<usize> {
        let to = match to {
            SocketAddr::V4(a) if self.v6 => SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port()),
            a => a,
        };
        self.socket.send_to(b, to)
    }
}

/// Waits until `s` is readable or `limit` has passed (`poll(2)`).
fn readable(s: &UdpSocket, limit: Duration) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = libc::c_int::try_from(limit.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd for the call.
    if unsafe { libc::poll(&mut fd, 1, ms) } < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether an IPv6 socket also takes IPv4 (mapped): `IPV6_V6ONLY` off, as Linux has it
/// unless `net.ipv6.bindv6only` is set.
fn takes_ipv4(s: &UdpSocket) -> bool {
    use std::os::fd::AsRawFd;
    let mut only: libc::c_int = 1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket fd, an int out-parameter and its length.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&mut only as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    r == 0 && only == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each state under each circumstance of a tick: what it does and what it becomes.
    #[test]
    fn judgement_table() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let s = Duration::from_secs;
        let at = |d: u64| Heard::At(t0 + s(d));
        let now = t0 + s(20);
        // (state, stalled, verdict, state after)
        let table = [
            (Heard::Never, false, Verdict::Ping, Heard::Never),
            (Heard::Never, true, Verdict::Ping, Heard::Never),
            (at(15), false, Verdict::Ping, at(15)),
            (at(10), false, Verdict::Ping, at(10)),
            (at(9), false, Verdict::Fail, at(9)),
            (at(9), true, Verdict::Ping, Heard::At(now)),
            (at(0), true, Verdict::Ping, Heard::At(now)),
        ];
        for (i, (mut heard, stalled, verdict, after)) in table.into_iter().enumerate() {
            assert_eq!(judge(&mut heard, now, stalled, timeout), verdict, "row {i}");
            assert_eq!(heard, after, "row {i}");
        }
    }

    #[test]
    fn settings_are_checked() {
        let ms = Duration::from_millis;
        assert!(Keepalive::default().check().is_ok());
        for (interval, timeout, ok) in [
            (ms(10), ms(20), true),
            (ms(9), ms(100), false),
            (ms(100), ms(199), false),
            (ms(0), ms(0), false),
            (ms(1_800_000), ms(3_600_000), true),
            (ms(1000), ms(3_600_001), false),
            (Duration::MAX, Duration::MAX, false),
        ] {
            assert_eq!(Keepalive { interval, timeout }.check().is_ok(), ok, "{interval:?} / {timeout:?}");
        }
    }

    #[test]
    fn a_stall_is_longer_than_two_intervals_and_half_the_timeout() {
        let ms = Duration::from_millis;
        let k = Keepalive { interval: ms(200), timeout: ms(1500) };
        assert!(!k.stalled(ms(250)));
        assert!(!k.stalled(ms(750)));
        assert!(k.stalled(ms(751)));
        let tight = Keepalive { interval: ms(100), timeout: ms(200) };
        assert!(!tight.stalled(ms(150)), "a late tick of the tightest settings is no stall");
        assert!(tight.stalled(ms(201)));
    }
}
