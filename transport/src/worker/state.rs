//! [`State`]: everything a worker keeps under its lock, and what it does under it
//! (endpoint closes and failures, parked requests, notices, chores after progress).

use super::*;

/// The active-message layer's part of a worker's state (`crate::am`'s registrations
/// and held messages): the worker holds it without knowing its type, lets it give back
/// what it holds before the UCX worker is destroyed, and drops it after.
pub(crate) trait AmPart: Send {
    /// Gives UCX back the payloads of messages held for the application.
    ///
    /// # Safety
    /// The UCX worker `worker` received them and is not destroyed yet; the caller has
    /// exclusive access to it.
    unsafe fn release(&mut self, worker: sys::ucp_worker_h);

    /// The part as `Any`, for the layer to find its own type again.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// Code a worker runs after its lock is released (active-message handlers: user code).
pub(crate) trait RunAfter: Send + Sync {
    /// Runs it.
    fn run(&self);
}

/// Everything under the worker lock.
pub(crate) struct State {
    pub(crate) handle: sys::ucp_worker_h,
    /// The worker's keepalive lane, which its handshake messages carry.
    pub(crate) lane: Option<KeepaliveAddr>,
    /// What to do once the lock is released.
    pub(crate) after: Deferred,
    pub(crate) parked: usize,
    /// Close requests of endpoints nobody waits for, parked until they finish
    /// ([`request::park_close`]), by address: thousands of endpoints dropped at once each
    /// leave one, and each is taken out as it finishes.
    pub(crate) closes: IdSet<*mut Slot>,
    /// Probes (`tag_recv_any`, stream data) waiting for any arrival.
    pub(super) probe_waiters: Vec<Waker>,
    /// Whether `probe_waiters`, `outbox`, `failed`, `close_first`, `peer_closing`,
    /// `peer_closed` or `parting` may hold something for [`WorkerInner::progress_locked`] to do after a
    /// progress call.
    pub(super) chores: bool,
    pub(crate) eps: EpTable,
    pub(crate) by_handle: IdMap<usize, u64>,
    pub(crate) next_id: u64,
    pub(super) failed: Vec<(u64, Status)>,
    /// Endpoints whose peer asked this side to close first (`CloseFirst`).
    pub(super) close_first: Vec<u64>,
    /// Endpoints whose accepting peer is closing (`Closing`).
    pub(super) peer_closing: Vec<u64>,
    /// Endpoints whose peer closed its end as asked (`Closed`).
    pub(super) peer_closed: Vec<u64>,
    /// Endpoints closed or dropped, closing through their peer ([`State::part`]).
    pub(crate) partings: Partings,
    /// Endpoints whose close waits for operations still running on them.
    pub(crate) closes_waiting_ops: usize,
    pub(crate) connects: IdMap<u64, HsWait>,
    pub(crate) accepts: IdMap<usize, HsWait>,
    /// Connections accepted through a listener's front, by connection id.
    pub(crate) front_accepts: IdMap<u64, FrontWait>,
    pub(super) outbox: Vec<(sys::ucp_ep_h, Vec<u8>)>,
    pub(crate) listeners: IdMap<u64, ListenerState>,
    pub(crate) bad_handshakes: u64,
    /// The active-message layer's tables ([`AmPart`]), installed when the worker is
    /// built, before its first progress.
    pub(crate) am: Option<Box<dyn AmPart>>,
    /// Event mode: no waiting future spins before this (set after a spin found nothing).
    pub(super) spin_quiet_until: Option<Instant>,
    /// Busy-poll mode: when the last spin that found nothing ended, and the task that
    /// spun ([`WorkerInner::busy_spin_for`]).
    pub(super) busy_spun: Option<(Instant, Waker)>,
    /// Head of the list of pending requests bound to an endpoint (linked through their
    /// slots; see [`request::Request::bind`]).
    pub(crate) bound: *mut Slot,
    /// A completed request not given back to UCX yet (see `request::free_later`).
    pub(crate) spare: *mut Slot,
}

impl State {
    pub(super) fn new(handle: sys::ucp_worker_h) -> State {
        State {
            handle,
            lane: None,
            after: Deferred::default(),
            parked: 0,
            closes: IdSet::default(),
            probe_waiters: Vec::new(),
            chores: false,
            eps: EpTable::default(),
            by_handle: IdMap::default(),
            next_id: 1,
            failed: Vec::new(),
            close_first: Vec::new(),
            peer_closing: Vec::new(),
            peer_closed: Vec::new(),
            closes_waiting_ops: 0,
            partings: Partings::default(),
            connects: IdMap::default(),
            accepts: IdMap::default(),
            front_accepts: IdMap::default(),
            outbox: Vec::new(),
            listeners: IdMap::default(),
            bad_handshakes: 0,
            am: None,
            spin_quiet_until: None,
            busy_spun: None,
            bound: std::ptr::null_mut(),
            spare: std::ptr::null_mut(),
        }
    }

    /// The pending requests bound to endpoint `id` ([`request::Request::bind`]), with
    /// what its failure does to each.
    pub(super) fn bound_to(&self, id: u64) -> impl Iterator<Item = (*mut Slot, OpKind)> + '_ {
        let mut s = self.bound;
        std::iter::from_fn(move || {
            while !s.is_null() {
                // SAFETY: the list holds live bound requests (taken out before they are
                // freed); the lock is held (&self comes from it).
                let slot = unsafe { &*s };
                let this = s;
                s = slot.next;
                if slot.bound_ep == id {
                    return Some((this, slot.kind));
                }
            }
            None
        })
    }

    /// Wakes `waker` after the next progress call that finds an event (probes wait for
    /// any arrival).
    pub(crate) fn add_probe_waiter(&mut self, waker: &Waker) {
        self.probe_waiters.push(waker.clone());
        self.chores = true;
    }

    /// Wakes every waiting probe now (after the lock is released), whatever progress
    /// found: the driver does before it sleeps, as a message may have become visible in a
    /// progress call that reported no event.
    pub(crate) fn wake_probes(&mut self) {
        self.after.wake_all(&mut self.probe_waiters);
    }

    /// Counts `n` stream bytes received on endpoint `ep`.
    pub(crate) fn stream_received(&mut self, ep: u64, n: usize) {
        if let Some(e) = self.eps.get_mut(&ep) {
            e.stream_rx += n as u64;
            if e.stream_ended() {
                self.after.wake_waiters(&mut e.stream_waiters);
            }
        }
    }

    pub(crate) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Marks an endpoint failed and ends every operation pending on it:
    /// - bound receives are canceled (`ucp_request_cancel`);
    /// - in UCX peer mode, the endpoint is force-closed and UCX completes its sends with
    ///   an error;
    /// - without peer mode, when UCX itself reported the failure (`peer_exited` false), UCX
    ///   discards the endpoint's lanes and completes its sends with an error on its own;
    /// - without peer mode, when ucxkit's pidfd watch saw the peer process exit
    ///   (`peer_exited` true), UCX 1.13 knows nothing, can neither force-close nor purge
    ///   the endpoint, so its pending operations are finished here with
    ///   `UCS_ERR_CONNECTION_RESET`; their futures then release the requests
    ///   (`ucp_request_free`: UCX keeps them internally and calls back no more). The peer
    ///   process is gone, so nothing will read those buffers any more: on shared memory
    ///   the data waits for the peer's progress (rendezvous, read by the peer) or for room
    ///   in the peer's queue, neither of which can happen. Nothing will write them
    ///   either: the worker is first progressed until idle, which delivers whatever the
    ///   peer sent before it died (stream data, get replies, fetch fragments), and a dead
    ///   process sends nothing more.
    pub(crate) fn fail_ep(&mut self, id: u64, status: Status, peer_exited: bool) {
        if peer_exited
            && self.eps.get(&id).is_some_and(|e| !e.peer_mode)
            && self.bound_to(id).next().is_some()
        {
            // Everything the dead peer ever sent is already here (in our shared-memory
            // queues or socket buffers): let UCX deliver it now, so that no operation
            // finished below can be written into afterwards (a stream receive, a get
            // reply, a rendezvous fragment).
            for _ in 0..100_000 {
                // SAFETY: the worker is valid and the lock is held (st comes from it);
                // this is not inside a UCX callback.
                if unsafe { sys::ucp_worker_progress(self.handle) } == 0 {
                    break;
                }
            }
        }
        let Some(e) = self.eps.get_mut(&id) else { return };
        if e.failed.is_none() {
            e.failed = Some(Failure { status, peer_exited, lanes_dead: false, poisoned: false });
        }
        e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
        tracing::debug!(ep = id, %status, "endpoint failed");
        let peer_mode = e.peer_mode;
        self.after.wake_waiters(&mut e.stream_waiters);
        // Collected first: canceling one can complete and unlink it.
        let bound: Vec<_> = self.bound_to(id).collect();
        if !peer_mode && peer_exited && bound.iter().any(|&(_, kind)| kind != OpKind::Cancel) {
            if let Some(f) = self.eps.get_mut(&id).and_then(|e| e.failed.as_mut()) {
                f.poisoned = true;
            }
        }
        for (r, kind) in bound {
            if kind == OpKind::Cancel {
                // SAFETY: r is a live pending tag receive of this worker (bound requests
                // are unbound before they are freed, and canceling one completes only
                // that one); the lock is held.
                unsafe { sys::ucp_request_cancel(self.handle, r.cast()) };
            } else if !peer_mode && peer_exited {
                // SAFETY: as above, for a bound send.
                unsafe { request::fail_pending(r, Status::CONNECTION_RESET, self) };
            }
        }
        for w in self.connects.values_mut().filter(|w| w.ep == id) {
            if let Some(k) = w.waker.take() {
                self.after.wake(k);
            }
        }
        if peer_mode {
            // Failed in peer mode: closed forcibly.
            self.close_unwaited(id);
        }
        if self.eps.get(&id).is_some_and(|e| e.hidden) {
            // Nobody uses it but its peer, which failed.
            self.close_unwaited(id);
            self.forget_ep(id);
            return;
        }
        if self.eps.get(&id).is_some_and(|e| e.parting().is_some() || e.close_waits_ops()) {
            // Most likely the peer closing, as asked; a deferred close waits no more for
            // operations UCX purges (or ucxkit finished above).
            self.partings.news.push(id);
            self.chores = true;
        }
        self.after.kick();
    }

    /// Starts closing an endpoint (`ucp_ep_close_nbx`, forcibly if `force`) and returns
    /// the close request, if any, for the caller to wait for or hand to
    /// [`State::finish_close`]; None if it was closed already or the close waits for
    /// borrowed stream data (`release_stream_data` finishes it).
    pub(crate) fn close_ep(&mut self, id: u64, force: bool) -> Option<request::Posted> {
        let ops = !force
            && (self.ops_running(id)
                || self.eps.get(&id).is_some_and(|e| e.failed.is_some_and(|f| f.poisoned)));
        let e = self.eps.get_mut(&id)?;
        let h = std::mem::replace(&mut e.handle, std::ptr::null_mut());
        e.usable.store(std::ptr::null_mut(), Ordering::Relaxed);
        if h.is_null() {
            return None;
        }
        if e.data_out > 0 || ops {
            // Borrowed stream data still points into UCX's buffers of this endpoint, or
            // operations still run on it (a send the peer has not taken yet): UCX must
            // not close an endpoint with sends running (1.13 asserts, or frees the
            // endpoint they point to). Closed once the data is released and the
            // operations have finished, or failed (UCX purges them when the endpoint
            // fails). The handle stays known for the endpoint's failure.
            e.deferred = Some(DeferredClose { handle: h, force, waits_ops: ops, orphan: false });
            if ops {
                self.closes_waiting_ops += 1;
            }
            tracing::debug!(ep = id, ops, "close deferred");
            return None;
        }
        self.close_now(id, h, force)
    }

    /// Closes endpoint `id`'s handle `h`, already taken out of the endpoint: at once, or,
    /// for an endpoint made from a worker address in peer mode, after a flush, forcibly.
    /// UCX (1.13 and 1.22) keeps the TCP connection of such an endpoint unless both sides
    /// close it forcibly (a flushing close leaves two descriptors behind for every
    /// connection), which the peer's side does too. `None` while the flush runs (the
    /// close is deferred to its end).
    pub(super) fn close_now(
        &mut self,
        id: u64,
        h: sys::ucp_ep_h,
        mut force: bool,
    ) -> Option<request::Posted> {
        let e = self.eps.get(&id)?;
        if !force && e.peer_mode && e.by_address && e.failed.is_none() {
            let param = self.flagged_param(0);
            // SAFETY: h is live; the lock is held; the request is bound and parked below,
            // before any progress call.
            let p = unsafe { sys::ucp_ep_flush_nbx(h, &param) };
            let posted = request::Posted::from_ptr(p, request::Completion::OK, false);
            if let request::Posted::Pending(r) = &posted {
                r.bind(self, id, OpKind::Finish);
                let e = self.eps.get_mut(&id)?;
                e.deferred = Some(DeferredClose { handle: h, force: true, waits_ops: true, orphan: false });
                self.closes_waiting_ops += 1;
                self.park(posted, Box::new(()));
                tracing::debug!(ep = id, "flushing, then closing forcibly");
                return None;
            }
            force = true;
        }
        let lanes_failed = self.eps.get(&id).is_some_and(|e| e.failed.is_some_and(|f| f.lanes_dead));
        self.by_handle.remove(&(h as usize));
        self.accepts.remove(&(h as usize));
        Some(self.close_handle(h, force, lanes_failed))
    }

    /// Runs endpoint `id`'s deferred close once nothing holds it any more (no stream data
    /// out, no operation running); forcibly if it failed in peer mode meanwhile. Removes
    /// an orphaned entry after.
    pub(crate) fn run_deferred_close(&mut self, id: u64) {
        let Some(e) = self.eps.get(&id) else { return };
        // (Operations ucxkit ended for a peer that died unseen by UCX still run in UCX
        // until UCX fails the endpoint itself, if it ever does.)
        let stuck = e.failed.is_some_and(|f| f.poisoned && !f.lanes_dead);
        let waits = e.close_waits_ops() && (stuck || self.ops_running(id));
        if e.deferred().is_none() || e.data_out > 0 || waits {
            return;
        }
        self.close_deferred(id, false);
    }

    /// Runs endpoint `id`'s deferred close now, forcibly if `force` (the worker is going
    /// away and the close cannot wait any more).
    pub(super) fn close_deferred(&mut self, id: u64, force: bool) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        if e.deferred().is_none() {
            return;
        }
        let Some(d) = e.deferred.take() else { return };
        if d.waits_ops {
            self.closes_waiting_ops -= 1;
        }
        let (h, asked_force) = (d.handle, d.force);
        // Forced in peer mode once UCX found the lanes dead (not when ucxkit marked it
        // failed on the peer's request to close first: that close flushes).
        let force =
            force || asked_force || (e.peer_mode && e.failed.is_some_and(|f| f.lanes_dead || f.peer_exited));
        tracing::debug!(ep = id, force, "deferred close runs");
        // (Deferred again while an endpoint made from an address is flushed first.)
        let Some(p) = self.close_now(id, h, force) else {
            // Deferred again (a flush runs first): still nobody's.
            if let Some(again) = self.eps.get_mut(&id).and_then(|e| e.deferred.as_mut()) {
                again.orphan |= d.orphan;
            }
            return;
        };
        self.finish_close(id, p);
        if d.orphan {
            self.eps.remove(&id);
        }
    }

    /// Fails the endpoints UCX reported failed ([`ep_err_cb`]), noting that their lanes are
    /// dead (closing them then makes UCX log flush errors, which go to `tracing`).
    pub(super) fn fail_reported(&mut self) {
        for (id, status) in std::mem::take(&mut self.failed) {
            if let Some(e) = self.eps.get_mut(&id) {
                // Marked before fail_ep, whose closes are then quiet.
                match &mut e.failed {
                    Some(f) => f.lanes_dead = true,
                    None => {
                        e.failed =
                            Some(Failure { status, peer_exited: false, lanes_dead: true, poisoned: false })
                    }
                }
            }
            self.fail_ep(id, status, false);
        }
    }

    /// Forgets endpoint `id` (its last handle is gone, or it stopped parting): removes
    /// its entry, or leaves that to its deferred close.
    pub(crate) fn forget_ep(&mut self, id: u64) {
        match self.eps.get_mut(&id) {
            Some(e) if e.deferred().is_some() => {
                if let Some(d) = &mut e.deferred {
                    d.orphan = true;
                }
            }
            Some(_) => {
                self.eps.remove(&id);
            }
            None => {}
        }
    }

    /// `ucp_ep_close_nbx` on a handle already taken out of the tables. The flushing close
    /// of an endpoint whose `lanes_failed` (UCX reported it failed) makes UCX log an error
    /// for each of its dead lanes: those lines go to `tracing` ([`ucx_log::quietly`]).
    pub(super) fn close_handle(
        &mut self,
        h: sys::ucp_ep_h,
        force: bool,
        lanes_failed: bool,
    ) -> request::Posted {
        let param = self.flagged_param(if force { sys::UCP_EP_CLOSE_FLAG_FORCE.0 as u32 } else { 0 });
        // SAFETY: h is a live endpoint of this worker, closed once (its handle was just
        // taken out of the table); the lock is held.
        let close = || unsafe { sys::ucp_ep_close_nbx(h, &param) };
        let p = if lanes_failed { ucx_log::quietly(close) } else { close() };
        request::Posted::from_ptr(p, request::Completion::OK, false)
    }

    /// Gives a piece of zero-copy stream data back to UCX (`ucp_stream_data_release`) and
    /// finishes a close that waited for it.
    ///
    /// # Safety
    /// `h` and `data` come from one `ucp_stream_recv_data_nb` on endpoint `id` of this
    /// worker, released once; the lock is held.
    pub(crate) unsafe fn release_stream_data(&mut self, id: u64, h: sys::ucp_ep_h, data: *mut c_void) {
        // SAFETY: per contract; the endpoint is not closed while data is out.
        unsafe { sys::ucp_stream_data_release(h, data) };
        let Some(e) = self.eps.get_mut(&id) else { return };
        e.data_out -= 1;
        if e.data_out == 0 {
            self.run_deferred_close(id);
        }
    }

    /// Takes every stream byte UCX holds for endpoint `id` into the endpoint's own buffer
    /// ([`EpState::kept`]), where receives find it first: the peer is closing, and UCX
    /// discards an endpoint's unread stream bytes when it fails or closes. Everything the
    /// peer sent before its close notice has arrived (the notice came after it), so
    /// nothing is left behind in UCX.
    pub(crate) fn keep_stream(&mut self, id: u64) {
        let Some(e) = self.eps.get_mut(&id) else { return };
        let h = e.handle;
        if h.is_null() || e.closing || e.parting().is_some() {
            // (Closed by this side too: nobody reads any more.)
            return;
        }
        let mut took = false;
        loop {
            let mut len = 0usize;
            // SAFETY: h is a live endpoint of this worker; the lock is held; this is not
            // inside a UCX callback. Without the stream feature UCX returns an error or
            // nothing.
            let p = unsafe { sys::ucp_stream_recv_data_nb(h, &mut len) };
            if p.is_null() || sys::UCS_PTR_IS_ERR(p) {
                break;
            }
            // SAFETY: UCX handed out `len` readable bytes at p, valid until released.
            e.kept.extend_from_slice(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) });
            // SAFETY: p comes from the call above on h, released once.
            unsafe { sys::ucp_stream_data_release(h, p) };
            e.stream_rx += len as u64;
            took = true;
        }
        if took {
            tracing::debug!(ep = id, bytes = e.kept().len(), "stream bytes kept from a closing peer");
            self.after.wake_waiters(&mut e.stream_waiters);
        }
    }

    /// Releases a request that owns no memory and that nobody waits for.
    pub(crate) fn release(&mut self, posted: request::Posted) {
        if let request::Posted::Pending(r) = posted {
            // SAFETY: our request, nothing parked in it, under the lock.
            unsafe { request::release(self, r.raw().cast::<Slot>()) };
        }
    }

    /// Closes endpoint `id` for an owner that does not wait: flushing, or forcibly when
    /// the endpoint failed in peer mode (a dead peer will not answer a flush; UCX allows
    /// forcing only in peer mode). [`State::finish_close`] takes the close request.
    pub(crate) fn close_unwaited(&mut self, id: u64) {
        let Some(e) = self.eps.get(&id) else { return };
        let force = e.failed.is_some() && e.peer_mode;
        if let Some(p) = self.close_ep(id, force) {
            self.finish_close(id, p);
        }
    }

    /// Whether endpoint `id` failed because its peer process died unseen by UCX (same
    /// host, no peer error handling): UCX then never ends what that peer left half sent.
    pub(crate) fn peer_died_unseen(&self, id: u64) -> bool {
        self.eps.get(&id).is_some_and(|e| e.failed.is_some_and(|f| f.peer_exited) && !e.peer_mode)
    }

    /// Whether an operation that a closing endpoint waits for (a send, RMA, a fetch; not
    /// a receive) is still running on endpoint `id`.
    pub(super) fn ops_running(&self, id: u64) -> bool {
        // SAFETY: bound_to yields live bound requests; the lock is held.
        self.bound_to(id).any(|(r, kind)| kind == OpKind::Finish && unsafe { request::is_running(r) })
    }

    /// Sends a handshake notice of `kind` (after the handshake, or a refusal) on `ep`.
    pub(crate) fn send_notice(&mut self, ep: sys::ucp_ep_h, kind: Kind, peer_mode: bool, nonce: u64) {
        let m = Message { kind, peer_mode, nonce, identity: ProcessIdentity::current(), lane: None };
        self.send_handshake(ep, m.encode(), true);
    }

    /// Sends the answer to a hello on `ep`, with this worker's keepalive lane when
    /// `lane` (the hello had one: its sender reads version 2).
    pub(crate) fn send_ack(&mut self, ep: sys::ucp_ep_h, peer_mode: bool, nonce: u64, lane: bool) {
        let lane = if lane { self.lane } else { None };
        let m = Message { kind: Kind::Ack, peer_mode, nonce, identity: ProcessIdentity::current(), lane };
        self.send_handshake(ep, m.encode(), true);
    }

    /// Lets the close request of endpoint `id` that nobody waits for finish in the
    /// background ([`request::park_close`]), so that destroying the worker does not cut
    /// it off inside UCX, which reports such a close as failed and its request as leaked.
    /// The flushing close of an endpoint whose peer process ucxkit saw exit, without peer
    /// error handling (UCX does not know), may never finish: that one is released to UCX
    /// at once instead. Other failed endpoints' closes finish: UCX discards lanes it
    /// found dead, and a peer that asked to be closed first waits for the disconnect.
    pub(crate) fn finish_close(&mut self, id: u64, posted: request::Posted) {
        let hopeless =
            self.eps.get(&id).is_some_and(|e| e.failed.is_some_and(|f| f.peer_exited) && !e.peer_mode);
        match posted {
            request::Posted::Pending(r) if !hopeless && !r.is_done(self) => {
                // SAFETY: a pending close request of ours, under the lock.
                unsafe { request::park_close(self, r.raw().cast::<Slot>()) }
            }
            other => self.release(other),
        }
    }

    /// Parks a request whose owner does not wait for it.
    pub(crate) fn park(&mut self, posted: request::Posted, keep: Box<dyn Any + Send>) {
        match posted {
            request::Posted::Done(_) => self.after.bury(keep),
            request::Posted::Pending(r) => {
                let slot = r.raw().cast::<Slot>();
                // SAFETY: a pending request of ours, under the lock.
                unsafe { request::park_slot(slot, keep) };
                self.parked += 1;
            }
        }
    }

    /// Queues a handshake message to send on `ep` after the current progress call.
    pub(super) fn reply(&mut self, ep: sys::ucp_ep_h, m: Message) {
        self.outbox.push((ep, m.encode()));
        self.chores = true;
    }

    /// Parameters for a send-type request of this worker with operation flags.
    pub(super) fn flagged_param(&mut self, flags: u32) -> sys::ucp_request_param_t {
        super::param::send(self, 0, flags)
    }

    /// Sends a handshake message now (outside any callback).
    pub(crate) fn send_handshake(&mut self, ep: sys::ucp_ep_h, bytes: Vec<u8>, reply: bool) {
        let param = self.flagged_param(if reply { sys::UCP_AM_SEND_FLAG_REPLY.0 as u32 } else { 0 });
        // SAFETY: ep is a live endpoint of this worker; the buffer stays alive until the
        // request completes (parked below); the lock is held.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                handshake::AM_ID,
                std::ptr::null(),
                0,
                bytes.as_ptr().cast(),
                bytes.len(),
                &param,
            )
        };
        let posted = request::Posted::from_ptr(p, request::Completion::OK, false);
        if let request::Posted::Done(c) = &posted {
            if !c.status().is_ok() {
                tracing::debug!(status = %c.status(), "handshake send failed");
            }
        }
        self.park(posted, Box::new(bytes));
    }
}
