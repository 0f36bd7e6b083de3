//! Messages of an aborted communicator that arrive after its drop. A peer that had not
//! heard of the abort yet may have sent for the call it was in; its message can still
//! be on its way when this rank drops the communicator (the drop takes those already
//! here). Left in UCX's queue, such a message would keep its sender's send, and the
//! buffer under it, pending for as long as the sender's worker lives (and a worker whose
//! sends never end is leaked at its drop). So, where a runtime runs, the id of an
//! aborted communicator stays held for [`LATE_GRACE`] after its drop while its late
//! messages are taken and thrown away every [`LATE_SWEEP`]; no new communicator can take
//! the id meanwhile, so nothing of one is thrown away. A communicator dropped without an
//! abort gives its id back at once: in a correct program its peers made the same calls,
//! all of whose messages it took (a peer's call beyond them fails once it hears of the
//! drop, see [`crate::leave`], but what that call sent before may stay queued).

use std::sync::Arc;
use std::time::Duration;

use ucxkit_transport::namespace::Discarder;

use crate::abort::{AbortCell, Registry};
use crate::tag::{comm_tag, COMM_MASK};

/// How long an aborted communicator's id is held after its drop.
pub const LATE_GRACE: Duration = Duration::from_secs(2);

/// How often its late messages are looked for meanwhile.
pub const LATE_SWEEP: Duration = Duration::from_millis(10);

/// A communicator's id, held in its worker's registry until this is dropped.
pub(crate) struct HeldId {
    pub(crate) registry: Arc<Registry>,
    pub(crate) cell: Arc<AbortCell>,
    pub(crate) id: u16,
}

impl Drop for HeldId {
    fn drop(&mut self) {
        self.registry.release(self.id, &self.cell);
    }
}

/// Throws away `held`'s messages that arrive (through `discard`, which does not keep the
/// namespace claimed: the worker may form another group meanwhile) until `end` or the
/// worker's shutdown, then gives the id back (also when the task is dropped, as its
/// runtime shuts down). What it held is let go on the blocking pool: it may be the
/// worker's last handle, whose drop can wait for UCX.
pub(crate) async fn sweep(discard: Discarder, held: HeldId, end: tokio::time::Instant) {
    while tokio::time::Instant::now() < end {
        tokio::time::sleep(LATE_SWEEP).await;
        match discard.tag_discard(comm_tag(held.id), COMM_MASK) {
            Ok(n) if n > 0 => tracing::debug!(id = held.id, n, "late messages of an aborted communicator"),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    drop(tokio::task::spawn_blocking(move || drop((discard, held))));
}
