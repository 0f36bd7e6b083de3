//! Shared-memory lanes: a large transfer between two ranks of one host staged through a
//! region the sender allocated with UCX, instead of a rendezvous message.
//!
//! UCX 1.13 moves a large tag message between processes of one host with `cma` (the
//! receiver's kernel copies from the sender's pages): 4.7-6 GB/s at 16 MiB here, where a
//! get from a region UCX allocated in shared memory (`posix`) is a plain copy, 21 GB/s
//! (`ucxkit-perf -t get_bw,tag_bw --transport shm`). So the sender copies the transfer,
//! piece by piece, into slots of its region (with stores that bypass its cache, see
//! `MemRegion::write_from`) and sends a note per piece; the receiver gets each piece from
//! the slot straight into its buffer and sends a credit back, which frees the slot. Both
//! cores copy at once, and the receiver's combines run piece by piece as the pieces
//! land. The sender keeps timing both ways and sends plain messages where they were
//! faster lately ([`Pace`]).
//!
//! # Protocol
//! Every rank decides alike which transfers go by lane: those of [`LANE_MIN`] bytes or
//! more between ranks the host layout puts on one host, unless that host is crowded
//! (more ranks than processors). Their receiver waits for a note
//! ([`Kind::Note`]) first; the sender's note either says that the bytes follow as one
//! data message (the lane is busy with a concurrent call's transfer, switched off, or
//! the endpoint has no shared-memory transport), or names a piece: its length and place
//! in the region, and, the first time, the region's key. A sender holds its lane to a
//! peer from its first piece until the credit ([`Kind::Credit`]) for its last, so the
//! slots are free between transfers, and a transfer that ends early (an error, an abort,
//! a dropped call) leaves the lane unused for good: its slots may still be read.

mod note;
mod recv;
mod send;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use smallvec::SmallVec;
use ucxkit_transport::{Endpoint, MemRegion, RemoteKey, TagSend};

use super::Wire;
use crate::error::{Error, Result};
use crate::tag::{kind_tag, Kind};

use note::NOTE_HEAD;
pub(crate) use recv::LaneRecv;
pub(crate) use send::LaneSend;

/// Transfers of this many bytes or more between ranks of one host go by lane. (2 ranks,
/// against rendezvous messages: transfers of 64 to 512 KiB by lane took 0.9-1.4x as
/// long, of 1 MiB and more 0.3-1.0x.)
pub(crate) const LANE_MIN: usize = 1 << 20;

/// Slots of a lane's region: the pieces in flight.
const SLOTS: usize = 4;

/// The longest piece.
const PIECE_MAX: usize = 1 << 20;

/// The distance between slots: a piece and a few cache lines more, so that the slots'
/// starts do not all fall in the same cache sets.
const SLOT_STRIDE: usize = PIECE_MAX + 4352;

/// The shortest piece (unless the transfer is shorter).
const PIECE_MIN: usize = 64 << 10;

/// The variable that switches lanes off for the transfers this process sends (`off`);
/// any other value, or none, leaves them on. A receiver follows what each note says, so
/// ranks may differ in it.
pub const LANES_ENV: &str = "UCXKIT_COLL_LANES";

/// The transports whose endpoints reach a region UCX allocated as plain shared memory.
const MAPPED: [&str; 3] = ["posix", "sysv", "xpmem"];

/// Whether `ep` moves data through shared memory UCX maps in both processes (its lanes
/// include one of [`MAPPED`]).
pub(crate) fn mapped(ep: &Endpoint) -> bool {
    ep.transports().is_ok_and(|t| t.iter().any(|t| MAPPED.contains(&t.as_str())))
}

/// The bytes of a piece of a transfer of `total` bytes of `elem`-byte elements, whole
/// elements: a quarter of it, so that both sides copy at once, from [`PIECE_MIN`]; from
/// two [`PIECE_MAX`] up, pieces of that size. (2 ranks, broadcast of 2 MiB in 512 KiB
/// pieces: 185 us, in 1 MiB pieces: 85; 1 MiB in 256 KiB pieces: 92, whole: 99-105.)
fn piece_len(total: usize, elem: usize) -> usize {
    let elem = elem.max(1);
    let want = if total >= 2 * PIECE_MAX { PIECE_MAX } else { (total / SLOTS).max(PIECE_MIN).min(total) };
    (want / elem * elem).max(elem)
}

/// The sending side of a lane to one peer.
enum Out {
    /// Not used yet: the region is made at the first transfer.
    Unused,
    /// Free, with its region, whose key the peer has (from the first transfer).
    Idle { region: MemRegion },
    /// A transfer holds it.
    Busy,
    /// Not usable: no shared-memory transport, or no region.
    Off,
    /// Not usable: a transfer ended early, and the peer may still read its slots, so
    /// the region stays until the communicator goes.
    Broken { _kept: MemRegion },
}

/// How long the transfers to one peer took lately, by lane and as plain data messages
/// (moving averages of nanoseconds per byte; 0: none yet), and the transfers since the
/// way not chosen was last tried. Which way is faster depends on where the two ranks'
/// processors sit: a lane hands freshly written cache lines from one core to the other,
/// which some placements make several times slower than the kernel's copy (measured
/// here: from 2.7x faster to 5x slower, minutes apart), so the sender keeps choosing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Pace {
    lane: f64,
    plain: f64,
    since: u32,
}

/// A transfer in this many goes the way not chosen, to follow a change.
const EXPLORE: u32 = 64;

impl Pace {
    /// Whether the next transfer goes by lane: the faster way, the slower one in every
    /// [`EXPLORE`]th, and each way while it has no measure.
    pub(crate) fn pick_lane(&mut self) -> bool {
        if self.lane == 0.0 {
            return true;
        }
        if self.plain == 0.0 {
            return false;
        }
        let faster = self.lane <= self.plain;
        self.since += 1;
        if self.since >= EXPLORE {
            self.since = 0;
            return !faster;
        }
        faster
    }

    /// Notes that a transfer of `bytes` by lane (or as a plain message) took `took`.
    pub(crate) fn note(&mut self, lane: bool, bytes: usize, took: std::time::Duration) {
        let per_byte = took.as_nanos() as f64 / bytes.max(1) as f64;
        let avg = if lane { &mut self.lane } else { &mut self.plain };
        // A faster transfer counts half, a slower one a quarter: one slow transfer (a
        // rank late to the call) moves the average little, and one that paid for a cold
        // start is soon outweighed.
        let w = if per_byte < *avg { 0.5 } else { 0.25 };
        *avg = if *avg == 0.0 { per_byte.max(f64::MIN_POSITIVE) } else { *avg * (1.0 - w) + per_byte * w };
    }
}

/// The sending side of a lane to one peer, and its pace.
struct OutSlot {
    out: Out,
    pace: Pace,
}

/// A communicator's lanes: per peer, the sending side and the key of the peer's region.
pub(crate) struct Lanes {
    out: Vec<Mutex<OutSlot>>,
    keys: Vec<Mutex<Option<RemoteKey>>>,
    /// Whether each rank is one this rank's large transfers may go by lane with: it
    /// shares this rank's host, as the host layout says, and the host is not crowded.
    /// Replaced whole when the layout changes, so that a call keeps the one it started
    /// with.
    local: Mutex<Arc<[bool]>>,
    /// Whether this rank sends by lane ([`LANES_ENV`]).
    on: bool,
    /// Transfers sent by lane and as plain messages so far.
    by_lane: AtomicU64,
    plain: AtomicU64,
}

/// Which ranks this rank's large transfers may go by lane with (see `Lanes::local`), as
/// a call found it at its start.
pub(crate) struct Layout(Arc<[bool]>);

impl Layout {
    /// Whether a transfer of `bytes` to or from `peer` goes by lane (alike on both
    /// sides: see the module docs).
    #[inline]
    pub(crate) fn takes(&self, peer: usize, bytes: usize) -> bool {
        bytes >= LANE_MIN && self.0.get(peer).copied().unwrap_or(false)
    }
}

/// How many of the transfers a rank sent to ranks of its host that were long enough for
/// a lane (1 MiB or more) went by lane, and how many as plain messages (after a note
/// that says so). A crowded host's transfers are neither: they go as plain messages
/// without a note.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneCounts {
    /// Sent through a shared-memory lane.
    pub by_lane: u64,
    /// Sent as one plain message (the lane busy, off, unusable or slower lately).
    pub plain: u64,
}

impl Lanes {
    /// Lanes to `size` ranks, none of them on this host until [`Lanes::set_local`];
    /// this rank sends by lane when `on`.
    pub(crate) fn new(size: usize, on: bool) -> Lanes {
        Lanes {
            out: (0..size).map(|_| Mutex::new(OutSlot { out: Out::Unused, pace: Pace::default() })).collect(),
            keys: (0..size).map(|_| Mutex::new(None)).collect(),
            local: Mutex::new(vec![false; size].into()),
            on,
            by_lane: AtomicU64::new(0),
            plain: AtomicU64::new(0),
        }
    }

    /// Whether this rank sends by lane.
    pub(crate) fn on(&self) -> bool {
        self.on
    }

    /// Whether lanes are on for [`LANES_ENV`]'s value.
    pub(crate) fn on_for(var: Option<&str>) -> bool {
        !var.is_some_and(|v| v.trim().eq_ignore_ascii_case("off"))
    }

    /// Says which ranks this rank's large transfers may go by lane with (`local[r]`:
    /// they share a host that is not crowded), for the calls made from now on.
    pub(crate) fn set_local(&self, local: impl Iterator<Item = bool>) {
        *self.local.lock().unwrap_or_else(PoisonError::into_inner) = local.collect();
    }

    /// Which ranks lanes may join this rank with, for a call to take at its start: every step
    /// of it then decides by the same layout as its peers' steps, whatever a concurrent
    /// [`crate::Communicator::set_hosts`] does meanwhile.
    pub(crate) fn layout(&self) -> Layout {
        Layout(self.local.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    /// The transfers sent so far, by way.
    pub(crate) fn counts(&self) -> LaneCounts {
        LaneCounts {
            by_lane: self.by_lane.load(Ordering::Relaxed),
            plain: self.plain.load(Ordering::Relaxed),
        }
    }

    /// How the next transfer to `peer` goes (see [`Lanes::pick`]), counted.
    fn choose(&self, peer: usize, ep: &Endpoint) -> Choice<'_> {
        let c = self.pick(peer, ep);
        let n = if matches!(c, Choice::Lane(_)) { &self.by_lane } else { &self.plain };
        n.fetch_add(1, Ordering::Relaxed);
        c
    }

    /// How the next transfer to `peer` goes: by its lane when the lane is usable, free
    /// and the faster way lately (its region made at the first transfer), else as a
    /// plain message.
    fn pick(&self, peer: usize, ep: &Endpoint) -> Choice<'_> {
        let Some(slot) = self.out.get(peer).filter(|_| self.on) else { return Choice::Plain(None) };
        let mut guard = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let OutSlot { out, pace } = &mut *guard;
        match out {
            Out::Off | Out::Broken { .. } => return Choice::Plain(None),
            Out::Busy => return Choice::Plain(Some(slot)),
            Out::Unused | Out::Idle { .. } if !pace.pick_lane() => return Choice::Plain(Some(slot)),
            _ => {}
        }
        let (region, key_sent) = match std::mem::replace(out, Out::Busy) {
            Out::Idle { region } => (region, true),
            _ => {
                // A region only where the endpoint maps it.
                match mapped(ep).then(|| ep.worker().context().alloc(SLOTS * SLOT_STRIDE)) {
                    Some(Ok(region)) => (region, false),
                    _ => {
                        *out = Out::Off;
                        return Choice::Plain(None);
                    }
                }
            }
        };
        Choice::Lane(Held { slot, region: Some(region), key_sent })
    }

    /// The key of `peer`'s region: `packed` unpacked when given (the first piece),
    /// otherwise the one kept.
    fn key(&self, peer: usize, ep: &Endpoint, packed: &[u8]) -> Result<RemoteKey> {
        let kept = self.keys.get(peer).ok_or_else(|| bad(peer, "a lane note from outside the group"))?;
        let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
        if !packed.is_empty() {
            let key = ep.unpack_key(packed).map_err(|source| Error::Transport { rank: peer, source })?;
            *kept = Some(key);
        }
        kept.clone().ok_or_else(|| bad(peer, "a lane piece before the lane's key"))
    }
}

#[cold]
fn bad(peer: usize, what: &str) -> Error {
    Error::Protocol { rank: peer, reason: what.to_string() }
}

/// How one transfer goes: by a lane held for it, or as a plain message (with the slot
/// whose pace it counts in, where the way was chosen).
enum Choice<'a> {
    Lane(Held<'a>),
    Plain(Option<&'a Mutex<OutSlot>>),
}

/// A lane held for one transfer: given back free when the transfer finished
/// ([`Held::finish`]), unusable for good when dropped before (its region kept).
/// `key_sent`: the peer has the region's key (false for the lane's first transfer).
struct Held<'a> {
    slot: &'a Mutex<OutSlot>,
    region: Option<MemRegion>,
    key_sent: bool,
}

impl Held<'_> {
    /// Gives the lane back free, noting that the transfer of `bytes` took `took` (the
    /// first one, which made the region and its mapping, is not counted).
    fn finish(mut self, bytes: usize, took: std::time::Duration) {
        if let Some(region) = self.region.take() {
            let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
            slot.out = Out::Idle { region };
            if self.key_sent {
                slot.pace.note(true, bytes, took);
            }
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.slot.lock().unwrap_or_else(PoisonError::into_inner).out = Out::Broken { _kept: region };
        }
    }
}

/// Where a lane transfer stands: its call and step, its peer.
#[derive(Clone, Copy)]
pub(crate) struct LaneAt {
    pub(crate) seq: u16,
    pub(crate) step: u16,
    pub(crate) peer: usize,
}

impl LaneAt {
    fn tag(&self, w: &Wire<'_>, src: usize, kind: Kind) -> u64 {
        kind_tag(w.comm, self.seq, self.step, src, kind)
    }
}

/// Sends that UCX could not finish during the call, polled to the end.
type Pending = SmallVec<[TagSend<Vec<u8>>; 2]>;

/// Sends `msg` to `peer` with tag `t`: during the call where UCX can, otherwise as a
/// send kept in `pending`.
fn send_small(
    w: &Wire<'_>,
    peer: usize,
    t: u64,
    msg: SmallVec<[u8; NOTE_HEAD]>,
    pending: &mut Pending,
) -> Result<()> {
    let ep = w.ep(peer)?;
    let sent = w.ns.try_tag_send(ep, t, &msg).map_err(|source| Error::Transport { rank: peer, source })?;
    if !sent {
        pending.push(w.ns.tag_send(ep, t, msg.to_vec()));
    }
    Ok(())
}

/// Polls the sends in `pending`, dropping those done: ready once all are.
fn poll_pending(pending: &mut Pending, peer: usize, cx: &mut Context<'_>) -> Poll<Result<()>> {
    let mut i = 0;
    while i < pending.len() {
        match Pin::new(&mut pending[i]).poll(cx) {
            Poll::Pending => i += 1,
            Poll::Ready((r, _)) => {
                r.map_err(|source| Error::Transport { rank: peer, source })?;
                drop(pending.swap_remove(i));
            }
        }
    }
    if pending.is_empty() {
        Poll::Ready(Ok(()))
    } else {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests;
