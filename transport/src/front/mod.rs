//! The listener front: how ucxkit connects through a socket address without handing
//! UCX a byte from whoever reaches the listener's port.
//!
//! A [`crate::Listener`] made with the handshake on (the default) is a TCP listener of
//! ucxkit's own, not UCX's connection manager, whose parser a few bytes from anyone
//! could make abort the process. A client and the listener exchange short messages of
//! a versioned format (`front::wire`), checked field by field: hellos with fresh nonces,
//! then, when their contexts share a secret, an HMAC-SHA256 challenge-response both
//! ways and a MAC on every later frame (`front::auth`); the client's request (who it is,
//! which error mode it wants); the application's accept or reject; and, on accept, the
//! listener's worker address and, when both contexts have UCX's connection manager
//! (tcp), the port of a UCX listener opened for this client alone. The client connects
//! there (or, without a connection manager, creates its endpoint from the address) and
//! sends ucxkit's handshake over the new endpoint; the listener takes only the endpoint
//! whose hello carries this client's connection id, and never hands UCX an address the
//! client sent ([`crate::pairing`]). `front::server` says why the connection manager is
//! preferred.
//!
//! # Threat model
//! What someone who can send bytes to a ucxkit process can do, by where they send them:
//!
//! - **A listener's port**, in every mode: only this module's parser sees the bytes.
//!   Bytes that are not the protocol end that TCP connection, at any point; a listener
//!   holds a bounded number of half-open connections and unanswered requests
//!   (`tests/front.rs` throws thousands of random and damaged openings, with and
//!   without a secret).
//! - **Without a secret**, any client that speaks the protocol connects and learns the
//!   listener worker's address, and any worker address or remote key can be handed to
//!   [`crate::Worker::connect_address`] and [`crate::Endpoint::unpack_key`]. ucxkit
//!   checks both before UCX parses them (layout and lengths, the format, the
//!   memory-domain map and each transport's part against this context's own, a
//!   shared-memory key's segment against the range it is used for), so forged ones are
//!   refused or do no harm (`tests/forged.rs`). What a transport's part names is the
//!   sender's word, as it is to UCX: the host and port to connect to, the shared-memory
//!   segment to map, the process whose memory cma reads and writes (the kernel allows
//!   that only where this process may trace that one). Take addresses and keys from
//!   peers you trust, or use a secret.
//! - **With a secret** ([`crate::ContextBuilder::secret`]), only peers that prove they
//!   hold it get anything: a client without it is refused before the listener gives out
//!   its address, a listener without it is refused before the client gives out
//!   anything, and the frames after the proofs cannot be changed or replayed. The worker
//!   addresses and remote keys the context hands out carry a MAC; ones without a valid
//!   MAC are refused.
//! - **UCX's own TCP port**, in every mode, when `tcp` is among the transports: UCX's
//!   TCP transport listens on a port of its own for each worker, on each device it uses,
//!   and parses what arrives there (its connection requests, then UCP's wire-up messages
//!   with worker addresses in them) without ucxkit in between; so does its connection
//!   manager on the one-shot port a listener opens for each client it accepted, until
//!   that client is in (see `front::server`). On UCX built with
//!   assertions, as Debian's 1.13 is, 17 bytes there (UCX's magic number and a
//!   connection request of the wrong length) abort the process; ucxkit cannot keep them
//!   from UCX. The 1.22 build tested here logs an error for them and goes on, but UCX
//!   does not authenticate that port in any version, and a secret does not close it (it
//!   keeps the worker's address from strangers; a port scan finds the port). So keep
//!   UCX's TCP transport off networks you do not trust: bind it to chosen devices
//!   (`.config("NET_DEVICES", "eth1")`), pin its ports to a range
//!   (`.config("TCP_PORT_RANGE", "40000-40999")`, UCX 1.17 and later; `UCX_TCP_PORT_RANGE`
//!   in the environment before) that a firewall opens only to the cluster's hosts, or
//!   leave `tcp` out of the transports (listeners do not need it).
//! - **A connected peer** talks to this process's UCX directly: UCX trusts the protocol
//!   messages a peer's UCX sends on an established connection (ucxkit checks only what
//!   it hands UCX itself). A peer running a changed UCX, or a plain UCX program sending
//!   what ucxkit never sends, can make Debian's UCX 1.13 abort: an empty stream message
//!   with no receive posted does (`stream_recv.c`, `length > 0`). Connect only peers you
//!   trust; a secret keeps out those that cannot prove they hold it.
//! - Nothing is encrypted: run over networks where being read is acceptable.

pub(crate) mod client;
pub(crate) mod conn;
pub(crate) mod server;
pub(crate) mod wire;

use crate::worker::ErrorMode;

pub(crate) use crate::handshake::MAX_COLLISIONS;

/// Whether a context can connect through UCX's connection manager (its sockets ride
/// UCX's tcp transport).
pub(crate) fn has_connection_manager(ctx: &crate::Context) -> bool {
    ctx.resources().iter().any(|(tl, _)| tl == "tcp")
}

/// The error mode both sides use (true: UCX's peer mode), from what each asked for and
/// whether shared memory can carry the connection; `None` when they asked for
/// different explicit modes.
pub(crate) fn resolve_mode(client: ErrorMode, server: ErrorMode, shared_memory: bool) -> Option<bool> {
    match (client, server) {
        (ErrorMode::Auto, ErrorMode::Auto) => Some(!shared_memory),
        (ErrorMode::Auto, m) | (m, ErrorMode::Auto) => Some(m == ErrorMode::Peer),
        (a, b) if a == b => Some(a == ErrorMode::Peer),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_modes_resolve_symmetrically() {
        use ErrorMode::*;
        let table = [
            (Auto, Auto, true, Some(false)),
            (Auto, Auto, false, Some(true)),
            (Auto, Peer, true, Some(true)),
            (None, Auto, false, Some(false)),
            (Peer, Peer, true, Some(true)),
            (None, None, false, Some(false)),
            (Peer, None, true, Option::None),
            (None, Peer, false, Option::None),
        ];
        for (c, s, shm, want) in table {
            assert_eq!(resolve_mode(c, s, shm), want, "{c:?} {s:?} shm={shm}");
            assert_eq!(resolve_mode(s, c, shm), want, "{s:?} {c:?} shm={shm} (swapped)");
        }
    }
}
