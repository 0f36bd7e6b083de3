//! What a worker keeps of each endpoint and pending connection: the endpoint table,
//! endpoint states, parting closes, handshake waits, listener queues.

use super::*;

/// Hasher for the integer keys of the worker's tables (endpoint ids, request and handle
/// addresses): a multiply-xorshift, much cheaper than SipHash on the per-operation path.
/// The keys are not attacker-chosen.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).rotate_left(5);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

/// `HashMap` keyed by integers, with [`IdHasher`].
pub(crate) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// `HashSet` of integers or addresses, with [`IdHasher`].
pub(crate) type IdSet<K> = std::collections::HashSet<K, std::hash::BuildHasherDefault<IdHasher>>;

/// The worker's endpoints by id. Each [`EpState`] has its own allocation, so the last one
/// looked up is remembered by address: the stream operations of one endpoint, which look
/// it up on every send, receive and completion, find it without hashing.
pub(crate) struct EpTable {
    pub(super) map: IdMap<u64, NonNull<EpState>>,
    /// The last id looked up and its state (id 0, which no endpoint has, for none).
    pub(super) last: Cell<(u64, Option<NonNull<EpState>>)>,
}

// SAFETY: the table owns its states (allocated by `insert`, freed by `remove` or drop)
// as a map of boxes would; it is only used under the worker lock.
unsafe impl Send for EpTable {}

impl Default for EpTable {
    fn default() -> Self {
        EpTable { map: IdMap::default(), last: Cell::new((0, None)) }
    }
}

impl EpTable {
    #[inline]
    pub(super) fn find(&self, id: u64) -> Option<NonNull<EpState>> {
        match self.last.get() {
            (last, p @ Some(_)) if last == id => p,
            _ => {
                let p = self.map.get(&id).copied();
                if p.is_some() {
                    self.last.set((id, p));
                }
                p
            }
        }
    }

    /// The state of endpoint `id`.
    #[inline]
    pub(crate) fn get(&self, id: &u64) -> Option<&EpState> {
        // SAFETY: the pointer is one of the table's live allocations (removed ones are
        // forgotten by `remove`); `&self` keeps them from being freed or written.
        self.find(*id).map(|p| unsafe { p.as_ref() })
    }

    /// The state of endpoint `id`, to change.
    #[inline]
    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut EpState> {
        // SAFETY: as in `get`; `&mut self` makes the access exclusive.
        self.find(*id).map(|mut p| unsafe { p.as_mut() })
    }

    /// Adds endpoint `id` (a new id: ids are never reused).
    pub(crate) fn insert(&mut self, id: u64, e: EpState) {
        let p = NonNull::from(Box::leak(Box::new(e)));
        if let Some(old) = self.map.insert(id, p) {
            self.last.set((0, None));
            // SAFETY: the replaced allocation is the table's, no longer referenced.
            drop(unsafe { Box::from_raw(old.as_ptr()) });
        }
    }

    /// Removes endpoint `id`.
    pub(crate) fn remove(&mut self, id: &u64) {
        if let Some(p) = self.map.remove(id) {
            if self.last.get().0 == *id {
                self.last.set((0, None));
            }
            // SAFETY: the table's allocation, out of the map and the cache.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }

    /// Every endpoint with its id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&u64, &EpState)> {
        // SAFETY: as in `get`.
        self.map.iter().map(|(id, p)| (id, unsafe { p.as_ref() }))
    }
}

impl Drop for EpTable {
    fn drop(&mut self) {
        for (_, p) in self.map.drain() {
            // SAFETY: the table's allocations, freed once.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }
}

/// The handle of an endpoint, as the worker keeps it: type-erased, so that the worker
/// need not know the endpoint's type (see `Endpoint::from_ref`).
pub(crate) type EndpointRef = std::sync::Weak<dyn std::any::Any + Send + Sync>;

/// A close asked for while stream data was out or operations still ran (or while a
/// flush runs before a forced close): run once they end ([`State::run_deferred_close`]).
pub(super) struct DeferredClose {
    /// The UCX handle, taken out of the endpoint.
    pub(super) handle: sys::ucp_ep_h,
    /// Close forcibly.
    pub(super) force: bool,
    /// It waits for operations ([`State::ops_running`]); counted in
    /// `State::closes_waiting_ops`.
    pub(super) waits_ops: bool,
    /// Nothing refers to the entry any more: removed once the close ran.
    pub(super) orphan: bool,
}

impl EpState {
    /// The endpoint's parting, if it closes through its peer.
    pub(super) fn parting(&self) -> Option<&Parting> {
        self.parting.as_ref()
    }

    /// As [`EpState::parting`], to change it.
    pub(super) fn parting_mut(&mut self) -> Option<&mut Parting> {
        self.parting.as_mut()
    }

    /// Ends the endpoint's parting, giving it back.
    pub(super) fn take_parting(&mut self) -> Option<Parting> {
        self.parting.take()
    }

    /// The endpoint's close waiting to run, if any.
    pub(super) fn deferred(&self) -> Option<&DeferredClose> {
        self.deferred.as_ref()
    }

    /// Whether a close waiting to run waits for operations.
    pub(super) fn close_waits_ops(&self) -> bool {
        self.deferred().is_some_and(|d| d.waits_ops)
    }
}

/// How an endpoint failed ([`State::fail_ep`]): the facts gather, as UCX and ucxkit
/// learn of the failure in either order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Failure {
    /// The status of the first failure.
    pub(crate) status: Status,
    /// The first failure was ucxkit seeing the peer process exit, UCX not knowing.
    pub(super) peer_exited: bool,
    /// UCX reported the endpoint failed (its lanes are dead): closing it makes UCX log
    /// flush errors, which go to `tracing` ([`ucx_log::quietly`]).
    pub(super) lanes_dead: bool,
    /// ucxkit ended operations that UCX still runs (the peer died unseen by UCX): UCX
    /// must not close the endpoint until it fails it itself, which purges them.
    pub(super) poisoned: bool,
}

/// Per-endpoint bookkeeping, under the worker lock.
pub(crate) struct EpState {
    /// NULL once closed.
    pub(crate) handle: sys::ucp_ep_h,
    /// How the endpoint failed, once it has.
    pub(crate) failed: Option<Failure>,
    /// The handle while the endpoint is usable (open and not failed), NULL after; shared
    /// with the [`crate::Endpoint`] so that posting needs no table lookup. Written and
    /// read only under the worker lock.
    pub(crate) usable: Arc<AtomicPtr<sys::ucp_ep>>,
    /// Whether UCX peer error handling is on (UCX then purges requests on failure).
    pub(crate) peer_mode: bool,
    /// Stream bytes written (posted) on this endpoint.
    pub(crate) stream_tx: u64,
    /// Stream bytes received on this endpoint.
    pub(crate) stream_rx: u64,
    /// The peer's stream writer shut down after this many bytes.
    pub(crate) stream_end: Option<u64>,
    /// Stream bytes taken out of UCX because the peer closed (they would go with the
    /// endpoint), from `kept_at` on still unread ([`State::keep_stream`]). Counted in
    /// `stream_rx` already.
    pub(super) kept: Vec<u8>,
    pub(super) kept_at: usize,
    /// Tasks waiting for stream progress (end of stream, failure) or for the endpoint's
    /// failure ([`crate::Endpoint::failed`]).
    pub(crate) stream_waiters: Waiters,
    /// The endpoint's handle, for active-message replies.
    pub(crate) endpoint: EndpointRef,
    /// Zero-copy stream data ([`crate::StreamData`]) handed out and not yet released.
    pub(crate) data_out: usize,
    /// Closed or dropped, closing through the peer ([`State::part`]).
    pub(super) parting: Option<Parting>,
    /// A close waiting to run. A parting endpoint can have one too: the peer's answer
    /// closes it while operations still run on it.
    pub(super) deferred: Option<DeferredClose>,
    /// [`crate::Endpoint::close`] was called: later operations are misuse, even if the
    /// peer's disconnect (asked for by that close) failed the endpoint meanwhile.
    pub(crate) closing: bool,
    /// No [`crate::Endpoint`] stands for it: the peer of another connection's endpoint
    /// that UCX paired with this worker (see [`crate::pairing`]), kept open while that
    /// peer may use it, closed when it fails or the worker goes away.
    pub(crate) hidden: bool,
    /// Made from a worker address (or taken over from one, see [`crate::pairing`]), not
    /// through UCX's connection manager: UCX closes its TCP connection only when both
    /// sides close forcibly (see [`State::close_ep`]).
    pub(crate) by_address: bool,
}

impl EpState {
    pub(crate) fn new(
        handle: sys::ucp_ep_h,
        peer_mode: bool,
        usable: Arc<AtomicPtr<sys::ucp_ep>>,
    ) -> EpState {
        EpState {
            handle,
            failed: None,
            usable,
            peer_mode,
            stream_tx: 0,
            stream_rx: 0,
            stream_end: None,
            kept: Vec::new(),
            kept_at: 0,
            data_out: 0,
            parting: None,
            deferred: None,
            closing: false,
            hidden: false,
            by_address: false,
            stream_waiters: Waiters::default(),
            endpoint: std::sync::Weak::<()>::new(),
        }
    }

    /// Whether the peer ended its stream and every byte it wrote has been received (and
    /// read).
    pub(crate) fn stream_ended(&self) -> bool {
        self.stream_end.is_some_and(|n| self.stream_rx >= n) && self.kept_at == self.kept.len()
    }

    /// Stream bytes kept from a closed peer and not read yet ([`State::keep_stream`]).
    pub(crate) fn kept(&self) -> &[u8] {
        &self.kept[self.kept_at..]
    }

    /// Marks the first `n` bytes of [`EpState::kept`] read.
    pub(crate) fn consume_kept(&mut self, n: usize) {
        self.kept_at += n;
        if self.kept_at == self.kept.len() {
            self.kept = Vec::new();
            self.kept_at = 0;
        }
    }

    /// Takes the rest of [`EpState::kept`].
    pub(crate) fn take_kept(&mut self) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.kept);
        v.drain(..self.kept_at);
        self.kept_at = 0;
        v
    }
}

/// A pending handshake.
pub(crate) struct HsWait {
    pub(crate) waker: Option<Waker>,
    /// The peer's identity and keepalive lane, or why the handshake failed.
    pub(crate) result: Option<std::result::Result<(ProcessIdentity, Option<KeepaliveAddr>), String>>,
    pub(crate) peer_mode: bool,
    pub(crate) ep: u64,
    /// An accept that takes only a hello with this nonce (the connection id a listener's
    /// front gave the client).
    pub(crate) expect: Option<u64>,
}

/// A connection accepted through a listener's front, waiting for the connecting side's
/// hello (by the connection id of its request on the front, the hello's nonce).
pub(crate) struct FrontWait {
    /// The hellos not taken yet (a collision makes the connecting side send another):
    /// the endpoint each came through (UCX's reply endpoint) and the error mode it says
    /// the connecting side uses, and its keepalive lane.
    pub(crate) hellos: std::collections::VecDeque<(sys::ucp_ep_h, bool, Option<KeepaliveAddr>)>,
    pub(crate) waker: Option<Waker>,
}

/// A listener's queue of connection requests.
#[derive(Default)]
pub(crate) struct ListenerState {
    pub(crate) queue: std::collections::VecDeque<sys::ucp_conn_request_h>,
    pub(crate) waker: Option<Waker>,
}

/// Work collected under the worker lock and done by [`WorkerInner::locked`] after it
/// releases the lock: tasks to wake, values to drop (parked buffers whose drop may run
/// user code), a driver kick, active-message handlers to run. `any` says whether there
/// is something, so that the common case costs one test.
#[derive(Default)]
pub(crate) struct Deferred {
    pub(super) any: bool,
    pub(super) wake: Vec<Waker>,
    pub(super) graveyard: Vec<Box<dyn Any + Send>>,
    pub(super) kick: bool,
    pub(super) handlers: Vec<Arc<dyn RunAfter>>,
}

impl Deferred {
    /// Wakes `w` after the lock is released.
    pub(crate) fn wake(&mut self, w: Waker) {
        self.wake.push(w);
        self.any = true;
    }

    /// Wakes every waiter in `ws` (emptied) after the lock is released.
    pub(crate) fn wake_waiters(&mut self, ws: &mut Waiters) {
        if !ws.is_empty() {
            ws.drain_into(&mut self.wake);
            self.any = true;
        }
    }

    /// Wakes every waker in `ws` (emptied) after the lock is released.
    pub(crate) fn wake_all(&mut self, ws: &mut Vec<Waker>) {
        if !ws.is_empty() {
            self.wake.append(ws);
            self.any = true;
        }
    }

    /// Drops `v` after the lock is released.
    pub(crate) fn bury(&mut self, v: Box<dyn Any + Send>) {
        self.graveyard.push(v);
        self.any = true;
    }

    /// Kicks the progress driver after the lock is released: work was queued that no fd
    /// event will announce.
    pub(crate) fn kick(&mut self) {
        self.kick = true;
        self.any = true;
    }

    /// Runs handler `h` over its queued messages after the lock is released (once, however
    /// often it is asked).
    pub(crate) fn run_handler<H: RunAfter + 'static>(&mut self, h: &Arc<H>) {
        if !self.handlers.iter().any(|c| std::ptr::addr_eq(Arc::as_ptr(c), Arc::as_ptr(h))) {
            self.handlers.push(h.clone());
        }
        self.any = true;
    }
}

/// Endpoint error callback (`ucp_err_handler_cb_t`): `arg` is the worker State.
pub(crate) unsafe extern "C" fn ep_err_cb(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: UCX invokes this inside a call made under the worker lock; arg is the State.
    let st = unsafe { &mut *arg.cast::<State>() };
    if let Some(&id) = st.by_handle.get(&(ep as usize)) {
        // Handled after the progress call returns: canceling and closing from inside a
        // UCX callback is not allowed.
        st.failed.push((id, Status(status)));
        st.chores = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parting() -> Parting {
        Parting {
            notice: Kind::Closing,
            phase: Phase::Flushing,
            refused: false,
            deadline: Instant::now(),
            flush: None,
            waiters: Waiters::default(),
        }
    }

    fn deferred(waits_ops: bool) -> DeferredClose {
        DeferredClose { handle: std::ptr::null_mut(), force: false, waits_ops, orphan: false }
    }

    /// What each state of an endpoint's close answers: (parting, deferred close)
    /// -> parting?, deferred?, waits for operations?; taking the parting out leaves the
    /// deferred close alone.
    #[test]
    fn close_states() {
        let table: [(bool, Option<bool>, bool, bool, bool); 5] = [
            (false, None, false, false, false),
            (true, None, true, false, false),
            (false, Some(false), false, true, false),
            (false, Some(true), false, true, true),
            (true, Some(true), true, true, true),
        ];
        for (p, d, is_parting, is_deferred, waits) in table {
            let mut e = EpState::new(std::ptr::null_mut(), false, Arc::default());
            e.parting = p.then(parting);
            e.deferred = d.map(deferred);
            assert_eq!(e.parting().is_some(), is_parting);
            assert_eq!(e.parting_mut().is_some(), is_parting);
            assert_eq!(e.deferred().is_some(), is_deferred);
            assert_eq!(e.close_waits_ops(), waits);
            assert_eq!(e.take_parting().is_some(), is_parting);
            assert!(e.parting().is_none());
            assert_eq!(e.deferred().is_some(), is_deferred);
            assert_eq!(e.close_waits_ops(), waits);
        }
    }
}
