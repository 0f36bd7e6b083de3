//! Watching a peer process on this host through a pidfd (see [`super`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::unix::AsyncFd;

use crate::identity::{self, ProcessIdentity};

/// An open pidfd on a peer process.
pub(crate) struct PidWatch {
    fd: AsyncFd<OwnedFd>,
}

impl PidWatch {
    /// Opens a pidfd on `peer` and checks that it is the same process (start time), not
    /// a later one that reused the pid. Must run inside a tokio runtime.
    pub(crate) fn open(peer: &ProcessIdentity) -> io::Result<PidWatch> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, peer.pid as libc::pid_t, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the syscall returned a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
        // The pidfd now pins the pid: check it is still the peer.
        if identity::start_time(peer.pid) != Some(peer.start_time) {
            return Err(io::Error::new(io::ErrorKind::NotFound, "peer process already exited"));
        }
        // SAFETY: the AsyncFd owns the OwnedFd, so the fd stays open and the same for its
        // whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(PidWatch { fd })
    }

    /// Completes when the process exits.
    pub(crate) async fn exited(&self) {
        match self.fd.readable().await {
            Ok(_guard) => {}
            Err(e) => {
                tracing::warn!(fd = self.fd.get_ref().as_raw_fd(), "pidfd watch failed: {e}");
                std::future::pending::<()>().await
            }
        }
    }
}
