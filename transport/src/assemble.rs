//! Building a worker: the core ([`crate::worker`]) with the active-message layer's
//! tables ([`crate::am`]) installed before its first progress, so that no message
//! arrives unseen.

use crate::error::Result;
use crate::worker::{Worker, WorkerBuilder};

impl WorkerBuilder {
    /// Creates the worker and spawns its progress driver on the current tokio runtime.
    ///
    /// # Errors
    /// [`crate::Error::ApiMisuse`] outside a tokio runtime; [`crate::Error::CreateWorker`]
    /// when UCX fails.
    pub fn build(self) -> Result<Worker> {
        self.build_with(crate::am::install)
    }
}
