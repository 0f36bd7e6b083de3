//! Errors: [`Status`], the raw UCX status code, and [`Error`], what went wrong, where,
//! and with whom.

use std::ffi::CStr;
use std::fmt;
use std::net::SocketAddr;

use ucx_sys as sys;

/// A raw UCX status code (`ucs_status_t`), kept as UCX returned it.
///
/// UCX returns codes that have no name of their own (whole ranges are reserved for link
/// and endpoint failures), so this is a newtype, not an enum. [`fmt::Display`] prints
/// UCX's own message (`ucs_status_string`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub sys::ucs_status_t);

impl Status {
    /// `UCS_OK`.
    pub const OK: Status = Status(sys::UCS_OK);
    /// `UCS_ERR_CANCELED`.
    pub const CANCELED: Status = Status(sys::UCS_ERR_CANCELED);
    /// `UCS_ERR_MESSAGE_TRUNCATED`.
    pub const TRUNCATED: Status = Status(sys::UCS_ERR_MESSAGE_TRUNCATED);
    /// `UCS_ERR_CONNECTION_RESET`.
    pub const CONNECTION_RESET: Status = Status(sys::UCS_ERR_CONNECTION_RESET);
    /// `UCS_ERR_UNREACHABLE`.
    pub const UNREACHABLE: Status = Status(sys::UCS_ERR_UNREACHABLE);
    /// `UCS_ERR_TIMED_OUT`.
    pub const TIMED_OUT: Status = Status(sys::UCS_ERR_TIMED_OUT);
    /// `UCS_ERR_UNSUPPORTED`.
    pub const UNSUPPORTED: Status = Status(sys::UCS_ERR_UNSUPPORTED);
    /// `UCS_ERR_INVALID_PARAM`.
    pub const INVALID_PARAM: Status = Status(sys::UCS_ERR_INVALID_PARAM);
    /// `UCS_ERR_ENDPOINT_TIMEOUT`.
    pub const ENDPOINT_TIMEOUT: Status = Status(sys::UCS_ERR_ENDPOINT_TIMEOUT);
    /// `UCS_ERR_NO_RESOURCE`.
    pub const NO_RESOURCE: Status = Status(sys::UCS_ERR_NO_RESOURCE);

    /// The raw code.
    pub fn raw(self) -> i8 {
        self.0 .0
    }

    /// `UCS_OK`.
    pub fn is_ok(self) -> bool {
        self.0 == sys::UCS_OK
    }

    /// Turns `UCS_OK` into `Ok(())` and anything else into `Err(self)`.
    pub fn check(self) -> Result<(), Status> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(self)
        }
    }

    /// A code in UCX's link-failure range (`UCS_ERR_FIRST_LINK_FAILURE..=LAST`).
    pub fn is_link_failure(self) -> bool {
        (sys::UCS_ERR_LAST_LINK_FAILURE.0..=sys::UCS_ERR_FIRST_LINK_FAILURE.0).contains(&self.raw())
    }

    /// A code in UCX's endpoint-failure range (`UCS_ERR_FIRST_ENDPOINT_FAILURE..=LAST`).
    pub fn is_endpoint_failure(self) -> bool {
        (sys::UCS_ERR_LAST_ENDPOINT_FAILURE.0..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE.0).contains(&self.raw())
    }

    /// The peer went away: connection reset, endpoint timeout, or a code in the link or
    /// endpoint failure ranges.
    pub fn is_peer_failure(self) -> bool {
        matches!(
            self.0,
            sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_ENDPOINT_TIMEOUT
                | sys::UCS_ERR_REJECTED
                | sys::UCS_ERR_NOT_CONNECTED
        ) || self.is_link_failure()
            || self.is_endpoint_failure()
    }

    /// UCX's message for this code (`ucs_status_string`).
    pub fn message(self) -> &'static str {
        // SAFETY: ucs_status_string accepts any code and returns a pointer to a static,
        // NUL-terminated string (UCX prints "Unknown error" for codes without a name).
        let s = unsafe { CStr::from_ptr(sys::ucs_status_string(self.0)) };
        s.to_str().unwrap_or("(non-UTF-8 UCX status message)")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (UCS {})", self.message(), self.raw())
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({}: {})", self.raw(), self.message())
    }
}

impl std::error::Error for Status {}

/// Who an endpoint talks to, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// Reached through a socket address.
    Socket(SocketAddr),
    /// Reached through a worker address (shown by its short fingerprint).
    Address(String),
    /// A connection accepted by a listener, from this client address.
    Accepted(Option<SocketAddr>),
    /// Any peer (a worker-level receive).
    Any,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Socket(a) => write!(f, "{a}"),
            Peer::Address(fp) => write!(f, "worker {fp}"),
            Peer::Accepted(Some(a)) => write!(f, "client {a}"),
            Peer::Accepted(None) => write!(f, "client (address unknown)"),
            Peer::Any => write!(f, "any peer"),
        }
    }
}

/// Everything that can go wrong in ucxkit's transport.
///
/// Variants are named after the operation that failed and carry the raw [`Status`]
/// as their source. Callers that need to branch on *why* use the classification
/// variants ([`Error::Truncated`], [`Error::Canceled`], [`Error::ConnectionReset`],
/// [`Error::Timeout`], [`Error::Unreachable`], [`Error::Unsupported`]) or
/// [`Error::kind`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or changing UCX configuration failed (`ucp_config_read`/`ucp_config_modify`).
    #[error("UCX configuration {name}={value}: {source}")]
    Config {
        /// Variable name (without the `UCX_` prefix).
        name: String,
        /// Requested value.
        value: String,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// A configuration name UCX does not know (given to [`crate::ContextBuilder::config`]):
    /// UCX would ignore it silently.
    #[error("UCX has no setting named {name} (UCX_{name}); `ucx_info -c -f` lists them")]
    UnknownSetting {
        /// The name, without the `UCX_` prefix.
        name: String,
    },
    /// `ucp_init` failed.
    #[error("creating the UCX context: {0}")]
    CreateContext(#[source] Status),
    /// `ucp_worker_create` or the worker's event setup failed.
    #[error("creating a UCX worker: {0}")]
    CreateWorker(#[source] Status),
    /// Setting up a listener on a socket address failed.
    #[error("listening on {addr}: {source}")]
    Listen {
        /// The requested address.
        addr: SocketAddr,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// Creating an endpoint or reaching the peer failed for a reason not classified below.
    #[error("connecting to {peer}: {source}")]
    Connect {
        /// The peer.
        peer: Peer,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// The peer could not be reached (nothing listens there, no route, no common transport).
    #[error("{peer} is unreachable: {source}")]
    Unreachable {
        /// The peer.
        peer: Peer,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// The peer failed or closed the connection while an operation was pending or
    /// posted: the process died, the link went down, or the endpoint was closed.
    #[error("{op} with {peer}: connection reset ({source})")]
    ConnectionReset {
        /// The operation that failed.
        op: &'static str,
        /// The peer.
        peer: Peer,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// A receive buffer was smaller than the message that matched it. The message is
    /// lost; the worker keeps working.
    #[error("message truncated: {len} byte message into a {capacity} byte buffer (tag {tag:#x})")]
    Truncated {
        /// Receive buffer capacity.
        capacity: usize,
        /// Length of the message as far as UCX reported it (at least `capacity`).
        len: usize,
        /// The sender's tag.
        tag: u64,
    },
    /// The operation was canceled before it completed.
    #[error("{op} canceled")]
    Canceled {
        /// The operation.
        op: &'static str,
    },
    /// The operation did not complete in time.
    #[error("{op} with {peer} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The peer.
        peer: Peer,
        /// How long it waited.
        after: std::time::Duration,
    },
    /// UCX or this build does not support what was asked.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// A CUDA driver call failed (synchronising a device buffer's stream, retaining a
    /// device's context).
    #[error("CUDA: {what}")]
    Device {
        /// The driver's error.
        what: String,
    },
    /// A worker address that is not one (wrong magic, version, length or checksum).
    #[error("malformed worker address: {reason}")]
    BadAddress {
        /// What is wrong with it.
        reason: String,
    },
    /// The listener refused the connection: its application rejected it, it had too many
    /// waiting, the two sides asked for different error modes, or it was closed.
    #[error("{peer} refused the connection: {reason}")]
    Refused {
        /// The peer.
        peer: Peer,
        /// Why, as the listener said.
        reason: String,
    },
    /// The two sides do not share a secret ([`crate::ContextBuilder::secret`]): one has
    /// none, or the other's proof was wrong.
    #[error("authentication with {peer} failed: {reason}")]
    Authentication {
        /// The peer.
        peer: Peer,
        /// What went wrong.
        reason: String,
    },
    /// The connection handshake failed: the peer sent something that is not a valid
    /// ucxkit handshake, or refused ours.
    #[error("handshake with {peer}: {reason}")]
    Handshake {
        /// The peer.
        peer: Peer,
        /// What went wrong.
        reason: String,
    },
    /// An operation failed with a UCX status not classified above.
    #[error("{op} with {peer}: {source}")]
    Op {
        /// The operation.
        op: &'static str,
        /// The peer, where the operation has one.
        peer: Peer,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// A worker-level operation (no single peer) failed.
    #[error("{op}: {source}")]
    Worker {
        /// The operation.
        op: &'static str,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// Packed remote-key bytes that are not one (wrong magic, version, length or
    /// checksum), or that UCX refused to unpack.
    #[error("malformed remote key: {reason}")]
    BadRemoteKey {
        /// What is wrong with it.
        reason: String,
    },
    /// A remote access outside the region its key describes, or misaligned for an
    /// atomic operation.
    #[error("{op}: {len} bytes at offset {offset} do not fit a {region_len} byte remote region{extra}")]
    OutOfBounds {
        /// The operation.
        op: &'static str,
        /// Offset into the region.
        offset: u64,
        /// Bytes accessed.
        len: u64,
        /// The region's length.
        region_len: u64,
        /// More detail (alignment), or empty.
        extra: &'static str,
    },
    /// Registering or allocating memory with UCX failed (`ucp_mem_map`).
    #[error("registering {len} bytes of memory: {source}")]
    MemMap {
        /// Bytes asked for.
        len: usize,
        /// UCX's status.
        #[source]
        source: Status,
    },
    /// An active-message handler panicked; the message it was handling is dropped.
    #[error("active-message handler for id {id} panicked: {message}")]
    HandlerPanicked {
        /// The active-message id.
        id: u16,
        /// The panic message.
        message: String,
    },
    /// An active message arrived for an id nobody registered on this worker, and the
    /// worker already held as many such messages as it keeps for a later registration
    /// ([`crate::am::UNCLAIMED_MAX_MESSAGES`], [`crate::am::UNCLAIMED_MAX_BYTES`]); the
    /// message was dropped (a rendezvous sender is released).
    #[error("active message for id {id} ({len} bytes) dropped: no receiver or handler is registered for the id, and the worker already holds the most messages it keeps for unregistered ids")]
    AmUnclaimed {
        /// The active-message id.
        id: u16,
        /// Payload length in bytes.
        len: usize,
    },
    /// An endpoint does not use a transport the caller required
    /// ([`crate::EndpointOptions::require_transports`]).
    #[error("{peer}: required transport {required:?} is not in use (the endpoint uses {selected:?})")]
    MissingTransport {
        /// The peer.
        peer: Peer,
        /// The required transport that is missing.
        required: String,
        /// The transports the endpoint's lanes use.
        selected: Vec<String>,
    },
    /// The API was used in a way it does not allow (for example an operation on a
    /// closed endpoint, or a worker without a tokio runtime).
    #[error("API misuse: {0}")]
    ApiMisuse(String),
    /// An I/O error from the operating system (event fd registration, process watch).
    #[error("{op}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The broad class of an [`Error`], for callers that branch on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// [`Error::Truncated`].
    Truncated,
    /// [`Error::Canceled`].
    Canceled,
    /// [`Error::ConnectionReset`]: the peer failed.
    ConnectionReset,
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::Unreachable`].
    Unreachable,
    /// [`Error::Unsupported`].
    Unsupported,
    /// [`Error::Refused`]: the listener said no.
    Refused,
    /// [`Error::Authentication`]: no shared secret.
    Authentication,
    /// Bad input: a malformed address or handshake, a setting UCX does not know or
    /// refuses, or API misuse.
    InvalidInput,
    /// Anything else.
    Other,
}

impl Error {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Truncated { .. } => ErrorKind::Truncated,
            Error::Canceled { .. } => ErrorKind::Canceled,
            Error::ConnectionReset { .. } => ErrorKind::ConnectionReset,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Unreachable { .. } => ErrorKind::Unreachable,
            Error::Unsupported { .. } | Error::MissingTransport { .. } => ErrorKind::Unsupported,
            Error::Refused { .. } => ErrorKind::Refused,
            Error::Authentication { .. } => ErrorKind::Authentication,
            Error::BadAddress { .. }
            | Error::Config { .. }
            | Error::UnknownSetting { .. }
            | Error::BadRemoteKey { .. }
            | Error::OutOfBounds { .. }
            | Error::Handshake { .. }
            | Error::AmUnclaimed { .. }
            | Error::ApiMisuse(_) => ErrorKind::InvalidInput,
            _ => ErrorKind::Other,
        }
    }

    /// The raw UCX status behind this error, where there is one.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Config { source, .. }
            | Error::Listen { source, .. }
            | Error::Connect { source, .. }
            | Error::Unreachable { source, .. }
            | Error::ConnectionReset { source, .. }
            | Error::Op { source, .. }
            | Error::Worker { source, .. }
            | Error::MemMap { source, .. } => Some(*source),
            Error::CreateContext(s) | Error::CreateWorker(s) => Some(*s),
            Error::Truncated { .. } => Some(Status::TRUNCATED),
            Error::Canceled { .. } => Some(Status::CANCELED),
            _ => None,
        }
    }

    /// Classifies a failed operation's status into the matching variant. An I/O error is
    /// the transport failing to move the operation's data to or from the peer (a shared
    /// memory copy from a process that is gone, a socket that broke): a reset, as on
    /// every other transport.
    pub(crate) fn from_op(op: &'static str, peer: &Peer, status: Status) -> Error {
        match status.0 {
            sys::UCS_ERR_CANCELED => Error::Canceled { op },
            sys::UCS_ERR_UNREACHABLE => Error::Unreachable { peer: peer.clone(), source: status },
            sys::UCS_ERR_UNSUPPORTED => Error::Unsupported { what: format!("{op}: {status}") },
            sys::UCS_ERR_IO_ERROR => Error::ConnectionReset { op, peer: peer.clone(), source: status },
            _ if status.is_peer_failure() => {
                Error::ConnectionReset { op, peer: peer.clone(), source: status }
            }
            _ => Error::Op { op, peer: peer.clone(), source: status },
        }
    }

    /// Classifies the failure of a receive bound to no endpoint (a worker-level tag
    /// receive, the fetch of an active message's payload). Nothing but its sender's
    /// failure ends such a receive with UCX's cancellation (a receive of this process
    /// is canceled only when its future is dropped, and then nobody sees the result),
    /// so that too is a reset.
    pub(crate) fn from_unbound_recv(op: &'static str, status: Status) -> Error {
        match status.0 {
            sys::UCS_ERR_CANCELED => Error::ConnectionReset { op, peer: Peer::Any, source: status },
            _ => Error::from_op(op, &Peer::Any, status),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            ErrorKind::ConnectionReset => K::ConnectionReset,
            ErrorKind::Timeout => K::TimedOut,
            ErrorKind::Unreachable | ErrorKind::Refused => K::ConnectionRefused,
            ErrorKind::Authentication => K::PermissionDenied,
            ErrorKind::Unsupported => K::Unsupported,
            ErrorKind::InvalidInput => K::InvalidInput,
            ErrorKind::Canceled => K::Interrupted,
            _ => K::Other,
        };
        std::io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_display_has_ucx_message_and_code() {
        let s = Status::CANCELED.to_string();
        assert!(s.contains("canceled"), "{s}");
        assert!(s.contains("-16"), "{s}");
    }

    #[test]
    fn classification() {
        let p = Peer::Socket("127.0.0.1:1".parse().unwrap());
        assert_eq!(Error::from_op("x", &p, Status::CANCELED).kind(), ErrorKind::Canceled);
        assert_eq!(Error::from_op("x", &p, Status::CONNECTION_RESET).kind(), ErrorKind::ConnectionReset);
        assert_eq!(Error::from_op("x", &p, Status::ENDPOINT_TIMEOUT).kind(), ErrorKind::ConnectionReset);
        // An unnamed code in the endpoint failure range is still a peer failure.
        let unnamed = Status(sys::ucs_status_t(sys::UCS_ERR_FIRST_ENDPOINT_FAILURE.0 - 3));
        assert!(unnamed.is_endpoint_failure());
        assert_eq!(Error::from_op("x", &p, unnamed).kind(), ErrorKind::ConnectionReset);
        assert_eq!(Error::from_op("x", &p, Status::UNREACHABLE).kind(), ErrorKind::Unreachable);
        let io = Status(sys::UCS_ERR_IO_ERROR);
        assert_eq!(Error::from_op("x", &p, io).kind(), ErrorKind::ConnectionReset);
        assert_eq!(Error::from_unbound_recv("x", io).kind(), ErrorKind::ConnectionReset);
        assert_eq!(Error::from_unbound_recv("x", Status::CANCELED).kind(), ErrorKind::ConnectionReset);
        assert_eq!(Error::from_unbound_recv("x", Status::INVALID_PARAM).kind(), ErrorKind::Other);
        assert_eq!(Error::from_op("x", &p, Status::INVALID_PARAM).kind(), ErrorKind::Other);
        assert_eq!(Error::from_op("x", &p, Status::INVALID_PARAM).status(), Some(Status::INVALID_PARAM));
    }
}
