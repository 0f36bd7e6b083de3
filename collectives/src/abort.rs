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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Notify;
use ucxkit_transport::{AmHandler, AmMessage, Endpoint, Namespace};

use crate::error::{Error, Result};
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

/// A communicator's abort state, shared by its handles and found by id by the handler.
#[derive(Default)]
pub(crate) struct AbortCell {
    flag: AtomicBool,
    abort: Mutex<Option<Abort>>,
    pub(crate) notify: Notify,
}

impl AbortCell {
    /// Why it was aborted, if it was.
    pub(crate) fn get(&self) -> Option<Abort> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
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
    comms: Comms,
    /// Kept so that abort messages are taken while any communicator lives.
    _handler: AmHandler,
}

/// The registries of this process's workers, by UCX worker handle.
static REGISTRIES: Mutex<Vec<(usize, Weak<Registry>)>> = Mutex::new(Vec::new());

impl Registry {
    /// The registry of `ns`'s worker, made (and its abort handler installed) on first
    /// use.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the abort id of the namespace is taken by
    /// something else.
    pub(crate) fn of(ns: &Namespace) -> Result<Arc<Registry>> {
        let key = ns.worker().as_raw() as usize;
        let mut all = REGISTRIES.lock().unwrap_or_else(PoisonError::into_inner);
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(r) = all.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
            return Ok(r);
        }
        let comms: Comms = Arc::default();
        let to = comms.clone();
        let handler = ns
            .am_handler(ABORT_AM, move |m: AmMessage| {
                if let Some((comm, abort)) = Abort::decode(m.header()) {
                    let cell =
                        to.lock().unwrap_or_else(PoisonError::into_inner).get(&comm).and_then(Weak::upgrade);
                    if let Some(c) = cell {
                        c.set(abort);
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("taking the collectives' abort messages: {e}")))?;
        let r = Arc::new(Registry { comms, _handler: handler });
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
        }
    }

    /// The ids free on this worker, as a bitmap (1: free).
    pub(crate) fn free_map(&self) -> Vec<u64> {
        let m = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
        let mut map = vec![u64::MAX; usize::from(MAX_COMMS / 64)];
        // Id 0 is the one bootstraps use: never handed out by split.
        map[0] &= !1;
        for (id, w) in m.iter() {
            if w.strong_count() > 0 {
                map[usize::from(id / 64)] &= !(1 << (id % 64));
            }
        }
        map
    }
}

/// Tells every rank in `eps` (None for this rank) that communicator `comm` is aborted.
/// Best effort: a message the transport cannot take at once is sent from a task when a
/// runtime is at hand, and dropped otherwise (the rank then learns of the failure from
/// its own operations or deadline).
pub(crate) fn tell(ns: &Namespace, eps: &[Option<Endpoint>], comm: u16, abort: &Abort) {
    let header = abort.encode(comm);
    for ep in eps.iter().flatten() {
        if matches!(ns.try_am_send(ep, ABORT_AM, &header, &[]), Ok(true)) {
            continue;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (ns, ep, header) = (ns.clone(), ep.clone(), header.clone());
            rt.spawn(async move {
                let _ = ns.am_send(&ep, ABORT_AM, &header, Vec::new()).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
