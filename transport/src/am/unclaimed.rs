//! Active messages for ids nobody registered yet: held, within bounds, for the first
//! receiver or handler of their id, routed by a catch-all callback table.

use super::*;

/// How many messages for ids nobody registered a worker holds, at most, waiting for a
/// receiver or handler; later ones are dropped and reported ([`Worker::take_am_errors`]).
/// A held rendezvous message keeps its sender's send pending until the id is registered
/// or [`Worker::am_discard_unclaimed`] lets it go.
pub const UNCLAIMED_MAX_MESSAGES: usize = 4096;
/// How many payload bytes of eager messages for unregistered ids a worker holds, at most
/// (rendezvous payloads stay with their senders and count 0).
pub const UNCLAIMED_MAX_BYTES: usize = 64 << 20;
/// How many dropped-message errors a worker keeps until taken; later ones are only
/// counted ([`Worker::am_dropped`]).
const MAX_KEPT_ERRORS: usize = 1024;

/// The callback arguments that route messages for unregistered ids: one `u16` per id,
/// holding that id, so that UCX's argument for id `i` (`&ids[i]`) tells the callback both
/// the id and, by its offset, where this table (and the worker's State) is.
#[repr(C)]
pub(crate) struct IdTable {
    pub(super) state: *mut State,
    pub(super) ids: [u16; LAST_WIRE_ID as usize + 1],
}

/// Messages for ids nobody registered yet, held for a later [`Worker::am_recv`] or
/// [`Worker::am_handler`].
#[derive(Default)]
pub(crate) struct Unclaimed {
    pub(super) queues: crate::worker::IdMap<u16, VecDeque<Incoming>>,
    pub(super) messages: usize,
    pub(super) bytes: usize,
    pub(super) errors: Vec<Error>,
}

impl Unclaimed {
    pub(super) fn take(&mut self, id: u16) -> VecDeque<Incoming> {
        let q = self.queues.remove(&id).unwrap_or_default();
        self.messages -= q.len();
        self.bytes -= q.iter().map(Incoming::eager_len).sum::<usize>();
        q
    }

    /// Gives every payload UCX still holds for these messages back to it (eager payloads
    /// in its receive buffers, rendezvous payloads not fetched), for a worker about to be
    /// destroyed, and lets the messages go. Without it UCX would find its receive buffers
    /// not returned, and a rendezvous sender would not be told that its payload was let go.
    ///
    /// # Safety
    /// `worker` received these messages and is not destroyed yet; the caller has
    /// exclusive access to it and calls no UCX function from a callback.
    pub(crate) unsafe fn release_all(&mut self, worker: sys::ucp_worker_h) {
        for (_, q) in self.queues.drain() {
            for mut inc in q {
                if let Incoming::Long(l) = &mut inc {
                    if let Payload::Held { desc, .. } | Payload::Rndv { desc, .. } =
                        std::mem::replace(&mut l.meta_mut().payload, Payload::Gone)
                    {
                        // SAFETY: per contract; the descriptor was kept by this worker's
                        // callback and not released yet (the payload is now Gone).
                        unsafe { sys::ucp_am_data_release(worker, desc) };
                    }
                }
            }
        }
        (self.messages, self.bytes) = (0, 0);
    }
}

impl Incoming {
    /// Payload bytes this message holds on this side (0 for a rendezvous payload).
    pub(super) fn eager_len(&self) -> usize {
        match self {
            Incoming::Short(s) => s.len(),
            Incoming::Long(l) if matches!(l.meta().payload, Payload::Rndv { .. }) => 0,
            Incoming::Long(l) => l.len(),
        }
    }
}

/// The callback type UCX calls for an active message.
pub(super) type AmCallback = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// Routes active-message id `id` of worker `handle` to `cb` with `arg`
/// (`ucp_worker_set_am_recv_handler`, whole messages).
///
/// # Safety
/// `handle` is a valid worker used by no other thread during the call; `arg` stays valid
/// for `cb` as long as the registration lasts.
pub(super) unsafe fn set_am_handler(
    handle: sys::ucp_worker_h,
    id: u16,
    cb: AmCallback,
    arg: *mut c_void,
) -> Status {
    let param = sys::ucp_am_handler_param_t {
        field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG.0
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS.0) as u64,
        id: id as u32,
        flags: sys::UCP_AM_FLAG_WHOLE_MSG.0 as u32,
        cb: Some(cb),
        arg,
    };
    // SAFETY: per contract.
    Status(unsafe { sys::ucp_worker_set_am_recv_handler(handle, &param) })
}

/// Registers ucxkit's catch-all callback for every id but the handshake's on a new worker, so
/// that no message is dropped by UCX unseen. Returns the table to free with
/// [`free_id_table`] after the worker is destroyed.
///
/// # Safety
/// `handle` is a new worker whose State is at `state`, which outlives it.
pub(crate) unsafe fn register_catch_all(
    handle: sys::ucp_worker_h,
    state: *mut State,
) -> std::result::Result<*mut IdTable, Status> {
    let table = Box::into_raw(Box::new(IdTable { state, ids: std::array::from_fn(|i| i as u16) }));
    for id in 0..=LAST_WIRE_ID {
        // SAFETY: id is within the array; the pointer keeps the whole table's provenance
        // (derived from the raw Box pointer); the worker is new and the table lives until
        // after it.
        let st = unsafe {
            let arg = std::ptr::addr_of_mut!((*table).ids[id as usize]).cast();
            set_am_handler(handle, id, unclaimed_cb, arg)
        };
        if let Err(e) = st.check() {
            // SAFETY: the worker is destroyed by the caller on error; the table was never
            // handed out otherwise.
            unsafe { free_id_table(table) };
            return Err(e);
        }
    }
    Ok(table)
}

/// Frees a table from [`register_catch_all`].
///
/// # Safety
/// The worker it was registered on is destroyed (or never used it), and this runs once.
pub(crate) unsafe fn free_id_table(table: *mut IdTable) {
    // SAFETY: per contract, the Box from register_catch_all, no longer referenced.
    drop(unsafe { Box::from_raw(table) });
}

/// UCX's callback for ids no application code registered: holds the message (bounded)
/// until a receiver or handler for its id appears; `arg` points at the id's entry of the
/// worker's [`IdTable`].
pub(super) unsafe extern "C" fn unclaimed_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    catch_unwind(AssertUnwindSafe(|| {
        let entry = arg.cast::<u16>();
        // SAFETY: entry points into the ids array of a live IdTable (registered by
        // register_catch_all, freed only after the worker); entry i holds i, so stepping
        // back i entries and then over the table's first field finds the table.
        let st = unsafe {
            let id = *entry;
            let ids = entry.sub(id as usize);
            let table = ids.cast::<u8>().sub(std::mem::offset_of!(IdTable, ids)).cast::<IdTable>();
            &mut *(*table).state
        };
        // SAFETY: as above.
        let (id, param) = unsafe { (*entry, &*param) };
        let held = if is_rndv(len, param) { 0 } else { len };
        if let Some(reg) = tables(st).regs.get_mut(&id).map(|r| &mut **r as *mut AmReg) {
            // Registered since (a registration replaces this callback; should UCX still
            // route a message here, it goes to the registration all the same).
            // SAFETY: forwarded from UCX, under the lock; the registration is boxed (its
            // own allocation, not part of `st`) and its state is this worker's State.
            return unsafe { (*reg).receive(header, header_len, data, len, param) };
        }
        let t = tables(st);
        let u = &mut t.unclaimed;
        if u.messages >= UNCLAIMED_MAX_MESSAGES || u.bytes + held > UNCLAIMED_MAX_BYTES {
            t.dropped += 1;
            if u.errors.len() < MAX_KEPT_ERRORS {
                u.errors.push(Error::AmUnclaimed { id, len });
            }
            tracing::warn!(id, len, "active message for an id nobody registered dropped: too many held");
            // Releases a rendezvous sender.
            return sys::UCS_OK;
        }
        if !u.queues.contains_key(&id) {
            tracing::debug!(id, "holding active messages for an id nobody registered yet");
        }
        // SAFETY: forwarded from UCX, under the lock.
        let (inc, ret) = unsafe { incoming(st, header, header_len, data, len, param) };
        let u = &mut tables(st).unclaimed;
        u.messages += 1;
        u.bytes += held;
        u.queues.entry(id).or_default().push_back(inc);
        ret
    }))
    .unwrap_or(sys::UCS_OK)
}
