//! Delay and reordering in user space, for kernels without `netem`: a host's outgoing
//! packets are queued to this program by netfilter (an `NFQUEUE` rule), held until their
//! time is due and let go in that order (so a jitter larger than the gap between two
//! packets reorders them). Spoken directly over netlink (`NETLINK_NETFILTER`), one
//! program per host's network namespace.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::payload::Rng;

/// How packets are held.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DelaySpec {
    /// What every packet waits.
    pub delay: Duration,
    /// At most this much more, drawn evenly per packet.
    pub jitter: Duration,
    /// The percentage of packets let go at once, ahead of those waiting (reordering).
    pub reorder: f64,
}

impl DelaySpec {
    /// When a packet that arrives `now` is due, with `rng` for the draws.
    pub(crate) fn due(&self, now: Instant, rng: &mut Rng) -> Instant {
        if self.reorder > 0.0 && (rng.below(10_000) as f64) < self.reorder * 100.0 {
            return now;
        }
        let jitter = match self.jitter.as_nanos() as u64 {
            0 => 0,
            j => rng.next() % (j + 1),
        };
        now + self.delay + Duration::from_nanos(jitter)
    }
}

// Netlink and nfnetlink_queue's wire format (linux/netfilter/nfnetlink_queue.h).
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NF_ACCEPT: u32 = 1;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
/// Packets held at most; more are dropped by the kernel, as a full router queue drops.
const MAX_HELD: u32 = 65_536;

/// A netlink message of nfnetlink_queue's subsystem, built attribute by attribute.
struct Msg(Vec<u8>);

impl Msg {
    fn new(kind: u16, flags: u16, queue: u16) -> Msg {
        let mut b = vec![0u8; 16];
        b[4..6].copy_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
        b[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        // nfgenmsg: family (unspecified), version 0, the queue (big-endian).
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&queue.to_be_bytes());
        Msg(b)
    }

    fn attr(mut self, kind: u16, data: &[u8]) -> Msg {
        self.0.extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(data);
        while self.0.len() % 4 != 0 {
            self.0.push(0);
        }
        self
    }

    fn done(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// A bound queue's socket.
struct Queue {
    fd: OwnedFd,
    queue: u16,
}

impl Queue {
    /// Binds queue `queue` of this thread's network namespace, asking for packets'
    /// metadata only.
    fn bind(queue: u16) -> Result<Queue, String> {
        let err = |what: &str| format!("NFQUEUE {queue}: {what}: {}", std::io::Error::last_os_error());
        // SAFETY: plain system calls on a descriptor this function owns.
        let raw = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_NETFILTER)
        };
        if raw < 0 {
            return Err(err("socket"));
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let q = Queue { fd: unsafe { OwnedFd::from_raw_fd(raw) }, queue };
        // SAFETY: an all-zero sockaddr_nl is valid; its family is set below.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        let size = std::mem::size_of::<libc::sockaddr_nl>() as u32;
        // SAFETY: `addr` is a sockaddr_nl of `size` bytes.
        if unsafe { libc::bind(raw, (&addr as *const libc::sockaddr_nl).cast(), size) } != 0 {
            return Err(err("bind"));
        }
        // A burst larger than the socket's buffer is dropped, not reported as an error.
        let on: libc::c_int = 1;
        let buf: libc::c_int = 8 << 20;
        // SAFETY: options of this socket, each given a c_int.
        unsafe {
            libc::setsockopt(
                raw,
                libc::SOL_NETLINK,
                libc::NETLINK_NO_ENOBUFS,
                (&on as *const libc::c_int).cast(),
                4,
            );
            libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&buf as *const libc::c_int).cast(),
                4,
            );
        }
        let cmd = [NFQNL_CFG_CMD_BIND, 0, 0, 0];
        q.request(Msg::new(NFQNL_MSG_CONFIG, NLM_F_ACK, queue).attr(NFQA_CFG_CMD, &cmd).done())?;
        let mut params = 0u32.to_be_bytes().to_vec();
        params.push(NFQNL_COPY_META);
        let cfg = Msg::new(NFQNL_MSG_CONFIG, NLM_F_ACK, queue)
            .attr(NFQA_CFG_PARAMS, &params)
            .attr(NFQA_CFG_QUEUE_MAXLEN, &MAX_HELD.to_be_bytes());
        q.request(cfg.done())?;
        Ok(q)
    }

    fn send(&self, b: &[u8]) -> Result<(), String> {
        // SAFETY: sends `b`, which outlives the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), b.as_ptr().cast(), b.len(), 0) };
        if n < 0 {
            return Err(format!("NFQUEUE {}: send: {}", self.queue, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Sends a configuration message and reads the kernel's acknowledgement.
    fn request(&self, b: Vec<u8>) -> Result<(), String> {
        self.send(&b)?;
        let mut buf = vec![0u8; 8192];
        let n = self.recv(&mut buf, 0)?;
        for (kind, body) in messages(&buf[..n]) {
            if kind == NLMSG_ERROR {
                let code = body.get(..4).map_or(0, |c| i32::from_ne_bytes(c.try_into().unwrap()));
                if code != 0 {
                    let e = std::io::Error::from_raw_os_error(-code);
                    return Err(format!("NFQUEUE {}: configuring: {e}", self.queue));
                }
            }
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8], flags: libc::c_int) -> Result<usize, String> {
        // SAFETY: receives into `buf`, at most its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n < 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        Ok(n as usize)
    }

    /// Waits at most `limit` for something to read.
    fn wait(&self, limit: Duration) {
        let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = limit.as_millis().min(100) as libc::c_int;
        // SAFETY: polls one pollfd that lives on this stack.
        unsafe { libc::poll(&mut p, 1, ms) };
    }
}

/// The (type, body) of each netlink message in `buf`, stopping at the first malformed one.
fn messages(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = u32::from_ne_bytes(buf.get(..4)?.try_into().ok()?) as usize;
        if len < 16 || len > buf.len() {
            return None;
        }
        let kind = u16::from_ne_bytes(buf[4..6].try_into().ok()?);
        let body = &buf[16..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind & 0xff, body))
    })
}

/// Appends the verdict that lets packet `id` of `queue` go (written in place: one per
/// packet, so no message of its own).
fn accept(out: &mut Vec<u8>, queue: u16, id: u32) {
    const LEN: u32 = 16 + 4 + 4 + 8;
    out.extend_from_slice(&LEN.to_ne_bytes());
    out.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT).to_ne_bytes());
    out.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    out.extend_from_slice(&[0; 8]); // sequence number and port id
    out.extend_from_slice(&[0, 0]); // nfgenmsg: family, version
    out.extend_from_slice(&queue.to_be_bytes());
    out.extend_from_slice(&(4u16 + 8).to_ne_bytes());
    out.extend_from_slice(&NFQA_VERDICT_HDR.to_ne_bytes());
    out.extend_from_slice(&NF_ACCEPT.to_be_bytes());
    out.extend_from_slice(&id.to_be_bytes());
}

/// The packet id of a queued packet's message body (after its nfgenmsg), if it has one.
fn packet_id(body: &[u8]) -> Option<u32> {
    let mut attrs = body.get(4..)?;
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes(attrs[..2].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(attrs[2..4].try_into().ok()?) & 0x7fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == NFQA_PACKET_HDR {
            return Some(u32::from_be_bytes(attrs.get(4..8)?.try_into().ok()?));
        }
        attrs = &attrs[len.next_multiple_of(4).min(attrs.len())..];
    }
    None
}

/// Serves queue `queue` of this thread's network namespace, holding each packet as
/// `spec` says, until `stop` is set; then lets every held packet go and returns.
/// `ready` is called once the queue is bound.
pub fn serve(queue: u16, spec: DelaySpec, stop: &AtomicBool, ready: impl FnOnce()) -> Result<(), String> {
    let q = Queue::bind(queue)?;
    ready();
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut rng = Rng::new(u64::from(std::process::id()) ^ clock.as_nanos() as u64);
    // Held packets by due time, then arrival (ties keep their order).
    let mut held: BinaryHeap<Reverse<(Instant, u64, u32)>> = BinaryHeap::new();
    let mut arrivals = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    let mut verdicts = Vec::new();
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        let now = Instant::now();
        while let Some(Reverse((due, _, id))) = held.peek().copied() {
            if due > now && !stopping {
                break;
            }
            held.pop();
            accept(&mut verdicts, queue, id);
            if verdicts.len() > 32 << 10 {
                q.send(&verdicts)?;
                verdicts.clear();
            }
        }
        if !verdicts.is_empty() {
            q.send(&verdicts)?;
            verdicts.clear();
        }
        if stopping {
            return Ok(());
        }
        let next = held
            .peek()
            .map_or(Duration::from_millis(100), |Reverse((due, ..))| due.saturating_duration_since(now));
        if next > Duration::ZERO {
            q.wait(next);
        }
        // Everything queued now, without blocking.
        while let Ok(n) = q.recv(&mut buf, libc::MSG_DONTWAIT) {
            let now = Instant::now();
            for (kind, body) in messages(&buf[..n]) {
                if kind != NFQNL_MSG_PACKET {
                    continue;
                }
                if let Some(id) = packet_id(body) {
                    held.push(Reverse((spec.due(now, &mut rng), arrivals, id)));
                    arrivals += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_framed_and_packet_ids_read() {
        let hdr = [0, 0, 1, 2, 8, 0, 3, 0];
        let m = Msg::new(NFQNL_MSG_PACKET, 0, 5).attr(7, &[9; 3]).attr(NFQA_PACKET_HDR, &hdr).done();
        let two: Vec<u8> = m.iter().chain(m.iter()).copied().collect();
        let got: Vec<_> = messages(&two).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, NFQNL_MSG_PACKET);
        assert_eq!(packet_id(got[0].1), Some(0x0102));
        // Truncated or lying lengths end the walk instead of reading past the buffer.
        assert_eq!(messages(&m[..m.len() - 1]).count(), 0);
        let mut lying = m.clone();
        lying[20..22].copy_from_slice(&200u16.to_ne_bytes());
        assert_eq!(packet_id(&lying[16..]), None);
        assert_eq!(packet_id(&[]), None);
    }

    #[test]
    fn verdicts_written_in_place_are_whole_messages() {
        let mut out = vec![1, 2, 3];
        accept(&mut out, 7, 0xabcd);
        let mut v = NF_ACCEPT.to_be_bytes().to_vec();
        v.extend_from_slice(&0xabcdu32.to_be_bytes());
        let built = Msg::new(NFQNL_MSG_VERDICT, 0, 7).attr(NFQA_VERDICT_HDR, &v).done();
        assert_eq!(out[3..], built[..]);
    }

    #[test]
    fn due_times_follow_the_spec() {
        let now = Instant::now();
        let mut rng = Rng::new(3);
        let ms = Duration::from_millis;
        let table = [
            // (delay, jitter, reorder %, earliest, latest)
            (ms(10), ms(0), 0.0, ms(10), ms(10)),
            (ms(10), ms(5), 0.0, ms(10), ms(15)),
            (ms(10), ms(0), 100.0, ms(0), ms(0)),
        ];
        for (delay, jitter, reorder, lo, hi) in table {
            let spec = DelaySpec { delay, jitter, reorder };
            for _ in 0..100 {
                let d = spec.due(now, &mut rng) - now;
                assert!(d >= lo && d <= hi, "{spec:?}: {d:?}");
            }
        }
        let half = DelaySpec { delay: ms(10), jitter: ms(0), reorder: 50.0 };
        let early = (0..1000).filter(|_| half.due(now, &mut rng) == now).count();
        assert!((350..650).contains(&early), "{early} of 1000 let go at once");
    }
}
