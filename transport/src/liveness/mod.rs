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
//! - An endpoint in UCX's peer error mode whose peer has a lane pings it every
//!   [`Keepalive::interval`], at the peer's address: the address the connect reached,
//!   the client's address for an accepted endpoint, the addresses of the tcp devices in
//!   a worker address.
//! - Once it has heard its peer, an endpoint that hears nothing for
//!   [`Keepalive::timeout`] fails with [`crate::Status::ENDPOINT_TIMEOUT`]
//!   ([`crate::ErrorKind::ConnectionReset`]), as a killed peer's would: pending
//!   operations end, [`crate::Endpoint::failed`] resolves. The bound is the timeout plus
//!   one interval.
//! - Pings and answers never queue behind bulk data: they have their own socket and
//!   thread, so a connection that is merely slow (a saturated or rate-limited link) is
//!   not failed while its peer answers. Nor does a busy tokio runtime delay them.
//! - A lane never heard from (UDP filtered between the hosts, a peer without a lane)
//!   fails nothing: the endpoint then has no bound but UCX's own. A gap in the thread's
//!   own schedule longer than half the timeout (this process was frozen or starved)
//!   starts every count again.
//! - Endpoints without peer error handling (shared memory with a peer on this host)
//!   have the pidfd watch instead.
//!
//! Datagrams are 24 bytes; anything else, or one with a wrong token or from another
//! address than the peer's, is dropped.

mod keepalive;
mod pidfd;
pub(crate) mod wire;

pub use keepalive::Keepalive;
pub(crate) use keepalive::{KeepaliveAddr, KeepaliveLane, KeepaliveTarget};
pub(crate) use pidfd::PidWatch;
