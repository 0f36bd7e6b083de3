//! How ucxkit finds out that a peer is gone when UCX does not tell it.
//!
//! **A peer process on this host.** UCX 1.13's shared-memory transports have no
//! peer-failure handler, so an endpoint that uses them (error mode
//! [`crate::ErrorMode::None`]) would wait forever on a dead peer. When the handshake
//! shows that the peer is a process on this host in this pid namespace, ucxkit opens a
//! pidfd on it (`pidfd_open(2)`, Linux 5.3+) and watches it with tokio: the moment the
//! process exits, the endpoint is failed, its bound receives are canceled and the
//! endpoint is force-closed, so every pending operation on it ends with
//! [`crate::Error::ConnectionReset`]. Detection is as fast as the kernel reaps the
//! process (well under a second), costs nothing while the peer lives, and works
//! whatever transport the endpoint uses.
//!
//! **A peer across the network: the keepalive.** A peer cut off from the network (its
//! link down, its host powered off or frozen) sends no reset. TCP retransmits for about
//! 15 minutes before it gives up, UCX before 1.22 has no TCP user timeout to shorten
//! that, and no TCP-level probe sees a frozen process, whose kernel still acknowledges
//! every segment. So each worker has a keepalive lane of its own ([`Keepalive`], on by
//! default): a UDP socket bound when the worker is built, whose port and a random token
//! travel in the handshake, and a thread that answers pings on it and sends the pings
//! of the worker's endpoints.
//!
//! - An endpoint in UCX's peer error mode, made with ucxkit's handshake, whose peer has
//!   a lane, is watched: its peer worker is pinged every [`Keepalive::interval`] (once
//!   for all the endpoints to it), at the peer's addresses: the address the connect
//!   reached, the client's address for an accepted endpoint, the addresses of the tcp
//!   devices in a worker address (a worker address without any, InfiniBand only say,
//!   is not watched).
//! - Once its peer has answered, an endpoint whose peer then does not answer for
//!   [`Keepalive::timeout`] fails with [`crate::Status::ENDPOINT_TIMEOUT`]
//!   ([`crate::ErrorKind::ConnectionReset`]), as a killed peer's would: pending
//!   operations end, [`crate::Endpoint::failed`] resolves. The bound is the timeout plus
//!   one interval.
//! - Pings and answers do not queue behind the connection's data in UCX or TCP: they
//!   have their own socket and thread, so a connection that is merely slow is not failed
//!   while its peer answers, nor does a busy tokio runtime delay them. They do share the
//!   links and their queues: a link that drops most datagrams for a whole timeout fails
//!   the endpoints over it.
//! - A peer never heard from (UDP filtered between the hosts, an older ucxkit without a
//!   lane) fails nothing: such an endpoint has no bound but UCX's own. A gap in the
//!   thread's own schedule of more than two intervals and half the timeout (this
//!   process was frozen or starved) starts every count again, and what arrived during
//!   it is taken in first.
//! - Endpoints without peer error handling (shared memory with a peer on this host)
//!   have the pidfd watch instead.
//!
//! Datagrams are 24 bytes. A lane answers pings with its token, to whoever sent them;
//! an answer counts with the peer's token and the cookie of its pings. Anything else is
//! dropped.

mod keepalive;
mod pidfd;
pub(crate) mod wire;

pub use keepalive::Keepalive;
pub(crate) use keepalive::{KeepaliveAddr, KeepaliveLane, KeepaliveTarget};
pub(crate) use pidfd::PidWatch;
