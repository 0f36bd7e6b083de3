//! The options of endpoints: how a failed peer is noticed ([`ErrorMode`]), and what a
//! connection waits for ([`EndpointOptions`]).

use super::*;

/// How endpoints handle a failed peer (`ucp_err_handling_mode_t`), applied on both sides
/// of a connection, accepted endpoints included.
///
/// UCX 1.13's shared-memory transports (posix, sysv, cma) have no peer-failure support:
/// with [`ErrorMode::Peer`], two processes on one host talk over TCP loopback instead
/// (about 3× the latency and a fraction of the bandwidth). [`ErrorMode::None`] keeps
/// shared memory; ucxkit then watches a same-host peer process itself (see
/// [`crate::liveness`]), so pending operations still fail when it dies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorMode {
    /// The default: [`ErrorMode::None`] when shared memory can carry the connection (the
    /// peer runs on this host, and both contexts have a shared-memory transport that
    /// carries messages, see [`crate::Context::has_shared_memory`]), [`ErrorMode::Peer`]
    /// otherwise: without a shared-memory lane, UCX's own failure handling loses
    /// nothing, and UCX 1.13 without it can abort a process whose peer dies during a
    /// transfer over TCP. Both sides reach the same choice. Through a listener and by
    /// worker address, "on this host" is what the peer says of itself (same boot id and
    /// pid namespace: two network namespaces of one machine share memory); connecting to
    /// a listener without the handshake, the IP decides (an address of this process's
    /// network namespace).
    #[default]
    Auto,
    /// `UCP_ERR_HANDLING_MODE_PEER`: UCX detects failed peers and fails their
    /// operations; transports without failure support (shared memory) are not used.
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: every transport is allowed. A failed peer on this
    /// host is detected by ucxkit's pidfd watch (needs the handshake); a failed remote
    /// peer is not detected, so use [`ErrorMode::Peer`] for remote peers.
    None,
}

impl ErrorMode {
    /// Resolves `Auto` given whether shared memory can carry the connection (the peer
    /// is on this host and both sides have a shared-memory transport); true means UCX
    /// peer mode.
    pub(crate) fn peer_mode(self, shared_memory: bool) -> bool {
        match self {
            ErrorMode::Auto => !shared_memory,
            ErrorMode::Peer => true,
            ErrorMode::None => false,
        }
    }
}

/// Options for connecting or accepting an endpoint.
#[derive(Clone, Debug)]
pub struct EndpointOptions {
    /// Error handling for the endpoint (default [`ErrorMode::Auto`]).
    pub error_mode: ErrorMode,
    /// Run ucxkit's connection handshake (default true). Turn it off to talk to plain UCX
    /// programs: tagged messages, active messages, streams and remote memory are then
    /// wire-compatible with any UCX application, but no liveness watch runs. Without it,
    /// connecting and accepting through a listener still return only once UCX has wired
    /// the endpoint up (a flush: the peer has to progress its worker), since UCX 1.13
    /// can abort on operations posted before that; connecting to a worker address
    /// returns at once, before the peer is known to exist.
    pub handshake: bool,
    /// How long connecting or accepting may take: the handshake, or without it the
    /// wire-up through a listener (default 10 s).
    pub timeout: Duration,
    /// Transports the endpoint must use (for example `["posix"]` or `["rc_mlx5"]`),
    /// checked once it is connected (see [`crate::Endpoint::transports`]): when UCX did
    /// not pick one of them, connecting or accepting fails with
    /// [`crate::Error::MissingTransport`] instead of silently running over something
    /// slower. Empty (the default) requires nothing.
    pub require_transports: Vec<String>,
    /// Bytes a connect through a listener carries to the accepting side, at most
    /// [`MAX_CONNECT_PAYLOAD`] (default empty): the accepting application reads them
    /// from [`crate::ConnectionRequest::connect_payload`] before it accepts and from
    /// [`crate::Endpoint::connect_payload`] after, to learn who connected (a rank, a
    /// node id). They travel in the listener's protocol, authenticated when the contexts
    /// have a secret. Ignored when accepting; a connect without the handshake, or to a
    /// worker address, refuses a non-empty payload.
    pub connect_payload: Vec<u8>,
}

/// The most bytes [`EndpointOptions::connect_payload`] may hold.
pub const MAX_CONNECT_PAYLOAD: usize = 256;

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            error_mode: ErrorMode::Auto,
            handshake: true,
            timeout: Duration::from_secs(10),
            require_transports: Vec::new(),
            connect_payload: Vec::new(),
        }
    }
}
