//! The active-message layer's part of a worker's state ([`AmTables`]): registrations,
//! held messages and the catch-all routing table, installed when the worker is built.

use super::*;

/// What the active-message layer keeps in a worker's state (its [`AmPart`]).
pub(crate) struct AmTables {
    /// Registered ids.
    pub(crate) regs: IdMap<u16, Box<AmReg>>,
    /// Messages dropped because their id was unregistered or too many were held.
    pub(crate) dropped: u64,
    /// Messages held for ids nobody registered yet.
    pub(crate) unclaimed: Unclaimed,
    /// The catch-all routing table of [`register_catch_all`], freed after the worker.
    ids: *mut IdTable,
}

// SAFETY: the tables are only used under their worker's lock; the routing table pointer
// is UCX's argument for the catch-all callback, which runs under the same lock.
unsafe impl Send for AmTables {}

impl AmPart for AmTables {
    unsafe fn release(&mut self, worker: sys::ucp_worker_h) {
        // SAFETY: per contract.
        unsafe { self.unclaimed.release_all(worker) }
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl Drop for AmTables {
    fn drop(&mut self) {
        if !self.ids.is_null() {
            // SAFETY: the tables go with the worker's state, after the UCX worker that used
            // the routing table was destroyed (a leaked worker forgets them instead).
            unsafe { free_id_table(self.ids) };
        }
    }
}

/// Makes a new worker's tables and registers the catch-all callback for every id
/// (called by `WorkerBuilder::build`, before anything progresses the worker, whose state
/// is at `state` and outlives it).
pub(crate) fn install(
    handle: sys::ucp_worker_h,
    state: *mut State,
) -> std::result::Result<Box<dyn AmPart>, Status> {
    // SAFETY: the worker is new and not yet shared; its State outlives it.
    let ids = unsafe { register_catch_all(handle, state) }?;
    Ok(Box::new(AmTables { regs: IdMap::default(), dropped: 0, unclaimed: Unclaimed::default(), ids }))
}

/// The active-message tables of the worker whose state is `st`.
#[inline]
pub(crate) fn tables(st: &mut State) -> &mut AmTables {
    st.am
        .as_mut()
        .and_then(|a| a.as_any_mut().downcast_mut())
        .expect("invariant: a built worker has its active-message tables")
}
