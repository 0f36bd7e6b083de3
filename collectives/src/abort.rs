//! Failures that every rank learns of. When a collective fails on one rank (a peer's
//! endpoint failed, a message had the wrong size, its deadline passed, or its future was
//! dropped before it finished), that rank aborts the communicator: it marks it aborted,
//! and tells every other rank with an active message in the collectives namespace
//! (id [`ABORT_AM`]). A rank that hears of it, or of a peer's failure itself, fails every
//! collective pending on that communicator and every later one with
//! [`crate::Error::Aborted`], which names the rank that failed when one did. So no rank
//! waits for a message that will never come: a failure ends the pending collectives of
//! every surviving rank within the time the transport takes to notice a dead peer plus
//! one message. A communicator stays aborted; [`crate::Communicator::shrink`] makes a
//! new one of the ranks still alive.
//!
//! The abort message: communicator id (u16), failed rank (u32, `u32::MAX` for none),
//! aborting rank (u32), then the reason (UTF-8, at most [`MAX_REASON`] bytes), all
//! little-endian. A malformed one is ignored.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Notify;
use ucxkit_transport::{AmHandler, AmMessage, Endpoint, Namespace};

use crate::error::{Error, Result};
use crate::leave::{Calls, Leave, LEAVE_AM};
use crate::tag::MAX_COMMS;

/// The collectives namespace's active-message id of abort messages.
pub const ABORT_AM: u16 = 0;
/// The longest reason an abort message carries, in bytes.
pub const MAX_REASON: usize = 256;

/// Why a communicator was aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The rank that failed (died, or whose messages went wrong), when one did.
    pub failed: Option<usize>,
    /// The rank that aborted the communicator.
    pub by: usize,
    /// What happened.
    pub reason: String,
}

impl Abort {
    fn encode(&self, comm: u16) -> Vec<u8> {
        let mut b = comm.to_le_bytes().to_vec();
        b.extend_from_slice(&self.failed.map_or(u32::MAX, |r| r as u32).to_le_bytes());
        b.extend_from_slice(&(self.by as u32).to_le_bytes());
        let mut end = self.reason.len().min(MAX_REASON);
        while !self.reason.is_char_boundary(end) {
            end -= 1;
        }
        b.extend_from_slice(&self.reason.as_bytes()[..end]);
        b
    }

    fn decode(b: &[u8]) -> Option<(u16, Abort)> {
        if b.len() < 10 || b.len() > 10 + MAX_REASON {
            return None;
        }
        let comm = u16::from_le_bytes([b[0], b[1]]);
        let failed = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let by = u32::from_le_bytes([b[6], b[7], b[8], b[9]]) as usize;
        let reason = std::str::from_utf8(&b[10..]).ok()?.to_string();
        (comm < MAX_COMMS)
            .then_some((comm, Abort { failed: (failed != u32::MAX).then_some(failed as usize), by, reason }))
    }
}

/// A communicator's abort state and call numbers, shared by its handles and found by id
/// by the handlers of abort and departure messages.
#[derive(Default)]
pub(crate) struct AbortCell {
    flag: AtomicBool,
    abort: Mutex<Option<Abort>>,
    pub(crate) notify: Notify,
    /// Its calls' numbers and the ranks that left it (see [`crate::leave`]).
    pub(crate) calls: Calls,
}

impl AbortCell {
    /// The state of a communicator of `size` ranks, not aborted.
    pub(crate) fn new(size: usize) -> AbortCell {
        AbortCell { calls: Calls::new(size), ..AbortCell::default() }
    }

    /// Why it was aborted, if it was (one load when it was not: every call asks).
    #[inline]
    pub(crate) fn get(&self) -> Option<Abort> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        self.reason()
    }

    /// The abort's reason, under its lock.
    #[cold]
    fn reason(&self) -> Option<Abort> {
        self.abort.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether it was aborted (one load).
    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Marks it aborted (the first reason stays) and wakes its pending collectives;
    /// true when this call was the first.
    pub(crate) fn set(&self, a: Abort) -> bool {
        let first = {
            let mut g = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
            let first = g.is_none();
            if first {
                *g = Some(a);
            }
            first
        };
        self.flag.store(true, Ordering::Release);
        self.notify.notify_waiters();
        first
    }
}

/// The communicators of one worker, by id.
type Comms = Arc<Mutex<HashMap<u16, Weak<AbortCell>>>>;

/// What one worker's collectives share: the communicators by id (for abort messages,
/// and so that no two live ones share an id).
pub(crate) struct Registry {
    /// The worker's key in [`REGISTRIES`] and [`COOLING_IDS`].
    key: usize,
    comms: Comms,
    /// The handlers of abort and departure messages, kept so that those are taken while
    /// any communicator lives (taken out and dropped by the registry's drop, under the
    /// [`REGISTRIES`] lock).
    handlers: Vec<AmHandler>,
}

impl Drop for Registry {
    /// Removes the handlers, then the registry's entry, under the [`REGISTRIES`] lock: a
    /// registry made next for the worker (which waits while the entry is there) finds
    /// the handlers' ids free. The last holder may drop it on any thread, a
    /// late-message sweep's end among them (see `late`).
    fn drop(&mut self) {
        let mut all = REGISTRIES.lock().unwrap_or_else(PoisonError::into_inner);
        self.handlers.clear();
        all.retain(|(k, w)| *k != self.key || w.strong_count() > 0);
    }
}

/// Ids kept cooling after they are given back.
const COOLING: usize = 768;

/// The registries of this process's workers, by UCX worker handle.
static REGISTRIES: Mutex<Vec<(usize, Weak<Registry>)>> = Mutex::new(Vec::new());

/// Ids given back on each worker (by UCX worker handle), the most recent last (at most
/// [`COOLING`]): new communicators take others first, so that messages of a
/// communicator that ended mid-call, still on their way when it was dropped (those that
/// had arrived it threw away), meet no communicator of the same id until hundreds of
/// others were made. Kept apart from the registries, which end with a worker's last
/// communicator, for the last [`COOLING_WORKERS`] workers that gave an id back.
static COOLING_IDS: Mutex<Vec<(usize, VecDeque<u16>)>> = Mutex::new(Vec::new());

/// Workers whose given-back ids are kept.
const COOLING_WORKERS: usize = 64;

/// Runs `f` on the ids worker `key` gave back (made, and the list of workers bounded,
/// when `add`; an empty list otherwise).
fn cooling_of<R>(key: usize, add: bool, f: impl FnOnce(&mut VecDeque<u16>) -> R) -> R {
    let mut all = COOLING_IDS.lock().unwrap_or_else(PoisonError::into_inner);
    match all.iter().position(|(k, _)| *k == key) {
        Some(i) => f(&mut all[i].1),
        None if add => {
            if all.len() == COOLING_WORKERS {
                all.remove(0);
            }
            all.push((key, VecDeque::new()));
            let last = all.len() - 1;
            f(&mut all[last].1)
        }
        None => f(&mut VecDeque::new()),
    }
}

impl Registry {
    /// The registry of `ns`'s worker, made (and its abort and departure handlers
    /// installed) on first use.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the abort or departure id of the namespace is
    /// taken by something else.
    pub(crate) fn of(ns: &Namespace) -> Result<Arc<Registry>> {
        let key = ns.worker().as_raw() as usize;
        let mut all = loop {
            let all = REGISTRIES.lock().unwrap_or_else(PoisonError::into_inner);
            match all.iter().find(|(k, _)| *k == key).map(|(_, w)| w.upgrade()) {
                Some(Some(r)) => return Ok(r),
                // Being dropped on another thread: its drop removes its handler, then
                // its entry (a moment).
                Some(None) => {
                    drop(all);
                    std::thread::yield_now();
                }
                None => break all,
            }
        };
        let comms: Comms = Arc::default();
        let cell_of = |comms: &Comms, comm: u16| {
            comms.lock().unwrap_or_else(PoisonError::into_inner).get(&comm).and_then(Weak::upgrade)
        };
        let to = comms.clone();
        let aborts = ns
            .am_handler(ABORT_AM, move |m: AmMessage| {
                if let Some((comm, abort)) = Abort::decode(m.header()) {
                    if let Some(c) = cell_of(&to, comm) {
                        c.set(abort);
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("taking the collectives' abort messages: {e}")))?;
        let to = comms.clone();
        let departures = ns
            .am_handler(LEAVE_AM, move |m: AmMessage| {
                if let Some((comm, leave)) = Leave::decode(m.header()) {
                    if let Some(c) = cell_of(&to, comm) {
                        if let Some(a) = c.calls.heard(leave) {
                            c.set(a);
                        }
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("taking the collectives' departure notices: {e}")))?;
        let r = Arc::new(Registry { key, comms, handlers: vec![aborts, departures] });
        all.push((key, Arc::downgrade(&r)));
        Ok(r)
    }

    /// Takes id `id` for a new communicator; false when a live one has it.
    pub(crate) fn claim(&self, id: u16, cell: &Arc<AbortCell>) -> bool {
        let mut m = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
        if m.get(&id).is_some_and(|w| w.strong_count() > 0) {
            return false;
        }
        m.insert(id, Arc::downgrade(cell));
        true
    }

    /// Gives id `id`, held by `cell`, back.
    pub(crate) fn release(&self, id: u16, cell: &Arc<AbortCell>) {
        let mut m = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
        if m.get(&id).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(cell))) {
            m.remove(&id);
            cooling_of(self.key, true, |c| cool(c, id));
        }
    }

    /// The ids free on this worker, as two bitmaps (1: free) one after the other: all
    /// free ids, then those of them not given back recently. Ranks AND their maps
    /// together and pick with [`pick_id`].
    pub(crate) fn free_map(&self) -> Vec<u64> {
        let m = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
        let live = m.iter().filter(|(_, w)| w.strong_count() > 0).map(|(id, _)| *id);
        cooling_of(self.key, false, |c| id_maps(live, c))
    }
}

/// Notes `id` as given back last.
fn cool(cooling: &mut VecDeque<u16>, id: u16) {
    cooling.retain(|&c| c != id);
    if cooling.len() == COOLING {
        cooling.pop_front();
    }
    cooling.push_back(id);
}

/// The two maps of [`Registry::free_map`] for the ids `live` in use and those `cooling`.
/// Id 0 is left to communicators made of endpoints with ids of their own.
fn id_maps(live: impl Iterator<Item = u16>, cooling: &VecDeque<u16>) -> Vec<u64> {
    let words = usize::from(MAX_COMMS / 64);
    let mut map = vec![u64::MAX; 2 * words];
    let mut take = |id: u16, from: usize| map[from + usize::from(id / 64)] &= !(1 << (id % 64));
    take(0, 0);
    take(0, words);
    for id in live.filter(|&id| id < MAX_COMMS) {
        take(id, 0);
        take(id, words);
    }
    for &id in cooling.iter().filter(|&&id| id < MAX_COMMS) {
        take(id, words);
    }
    map
}

/// Where a communicator made from communicator `parent` looks for a free id first, on
/// its `attempt`: the same on every rank, apart for different parents, so that splits
/// and shrinks of several communicators at once on one worker seldom pick alike.
pub(crate) fn first_look(parent: u16, attempt: u16) -> u16 {
    ((u32::from(parent) * 131 + u32::from(attempt) * 257) % u32::from(MAX_COMMS)) as u16
}

/// The id a new communicator takes, from maps as [`Registry::free_map`] gives them
/// (ANDed over its ranks): the first free one from `start` on (wrapping) not given back
/// recently, else the first free one.
///
/// # Errors
/// [`Error::InvalidArgument`] when every id is taken.
pub(crate) fn pick_id(map: &[u64], start: u16) -> Result<u16> {
    let (free, fresh) = map.split_at(map.len() / 2);
    let set = |m: &[u64], id: u16| m.get(usize::from(id / 64)).is_some_and(|w| w & (1 << (id % 64)) != 0);
    let from = |m: &[u64]| (0..MAX_COMMS).map(|i| (start % MAX_COMMS + i) % MAX_COMMS).find(|&id| set(m, id));
    from(fresh)
        .or_else(|| from(free))
        .ok_or_else(|| Error::InvalidArgument("every communicator id is taken on some rank's worker".into()))
}

/// Tells every rank in `eps` (None for this rank) that communicator `comm` is aborted
/// ([`to_every_rank`], keeping what UCX does not take at once).
pub(crate) fn tell(ns: &Namespace, eps: &[Option<Endpoint>], comm: u16, abort: &Abort) {
    to_every_rank(ns, eps, ABORT_AM, &abort.encode(comm), true);
}

/// Sends `header` as the collectives namespace's active message `id` to every rank in
/// `eps` (None for this rank), best effort: during the call where UCX takes it; else,
/// when `keep`, as an owned send awaited by a task where a runtime is at hand (else the
/// transport keeps it until UCX is done), a task holding no [`Namespace`], so the
/// namespace's claim ends with its last user, not with the send. An endpoint that cannot
/// send is skipped (that rank learns of it from its own operations or deadline).
pub(crate) fn to_every_rank(ns: &Namespace, eps: &[Option<Endpoint>], id: u16, header: &[u8], keep: bool) {
    for ep in eps.iter().flatten() {
        let taken = ns.try_am_send(ep, id, header, &[]);
        if !keep || !matches!(taken, Ok(false)) {
            continue;
        }
        let send = ns.am_send(ep, id, header, Vec::new());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = send.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// New ids skip those given back recently while others are free, and fall back to
    /// them when none is; live ids and id 0 are never picked; the cooling list keeps the
    /// most recent ones.
    #[test]
    fn given_back_ids_cool_before_reuse() {
        let mut cooling = VecDeque::new();
        let pick =
            |live: &[u16], cooling: &VecDeque<u16>| pick_id(&id_maps(live.iter().copied(), cooling), 0).ok();
        assert_eq!(pick(&[], &cooling), Some(1));
        cool(&mut cooling, 1);
        cool(&mut cooling, 2);
        assert_eq!(pick(&[3], &cooling), Some(4));
        // All others live: the cooling ones are used after all, lowest first.
        let all_but: Vec<u16> = (1..MAX_COMMS).filter(|&i| i != 1 && i != 2).collect();
        assert_eq!(pick(&all_but, &cooling), Some(1));
        let all: Vec<u16> = (1..MAX_COMMS).collect();
        assert_eq!(pick(&all, &cooling), None);
        // Two ranks' maps ANDed: an id cooling on either is skipped.
        let mut other = VecDeque::new();
        cool(&mut other, 4);
        let (a, b) = (id_maps([3].into_iter(), &cooling), id_maps(std::iter::empty(), &other));
        let both: Vec<u64> = a.iter().zip(&b).map(|(x, y)| x & y).collect();
        assert_eq!(pick_id(&both, 0).ok(), Some(5));
        // From a start, wrapping past the last id.
        assert_eq!(pick_id(&both, 700).ok(), Some(700));
        let high: Vec<u16> = (600..MAX_COMMS).collect();
        assert_eq!(pick_id(&id_maps(high.into_iter(), &VecDeque::new()), 700).ok(), Some(1));
        // Giving an id back again moves it last; the list is bounded.
        cool(&mut cooling, 1);
        assert_eq!(cooling, [2, 1]);
        for id in 0..2000u16 {
            cool(&mut cooling, id % MAX_COMMS);
        }
        assert_eq!(cooling.len(), COOLING);
        assert_eq!(cooling.back(), Some(&(1999 % MAX_COMMS)));
    }

    #[test]
    fn abort_messages_round_trip_and_junk_is_ignored() {
        let a = Abort { failed: Some(3), by: 1, reason: "rank 3: connection reset".into() };
        assert_eq!(Abort::decode(&a.encode(7)), Some((7, a.clone())));
        let none = Abort { failed: None, by: 0, reason: "é".repeat(200) };
        let (_, back) = Abort::decode(&none.encode(1)).expect("decodes");
        assert!(back.reason.len() <= MAX_REASON && back.failed.is_none());
        assert!(Abort::decode(&[0; 9]).is_none());
        assert!(Abort::decode(&[0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]).is_none(), "comm id out of range");
        assert!(Abort::decode(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff]).is_none(), "not UTF-8");
        assert!(Abort::decode(&vec![b'a'; 10 + MAX_REASON + 1]).is_none());
    }

    #[test]
    fn the_first_abort_stays() {
        let c = AbortCell::default();
        assert!(!c.is_set() && c.get().is_none());
        assert!(c.set(Abort { failed: Some(1), by: 0, reason: "a".into() }));
        assert!(!c.set(Abort { failed: None, by: 2, reason: "b".into() }));
        assert_eq!(c.get().map(|a| a.failed), Some(Some(1)));
    }
}
