//! Safe, async access to UCX (UCP) for tokio programs.
//!
//! ucxkit-transport wraps UCX's workers, endpoints and listeners in owned, `Send + Sync`
//! handles, drives UCX progress from tokio without burning a core, and exposes UCX's
//! point-to-point surface through futures that own their buffers, so that no dropped
//! future can let UCX touch freed memory:
//!
//! - tagged messages ([`tag`]), vectored ones included ([`iov`]);
//! - ordered byte streams and a tokio `AsyncRead + AsyncWrite` adapter ([`stream`]);
//! - active messages with receivers, handlers and replies ([`am`]);
//! - registered memory, remote keys, put/get and 64-bit atomics ([`mem`], [`rma`]);
//! - parts of buffers as operation buffers ([`Slice`]) and regions in place
//!   ([`RegionView`]);
//! - tag and active-message namespaces for layers sharing a worker ([`namespace`]);
//! - CUDA device memory as operation buffers, with the memory type passed to UCX on
//!   every call (module `cuda`, feature `cuda`; [`MemoryType`]).
//!
//! # Quick start
//!
//! Two workers in one process, connected through a listener on loopback, exchange a
//! tagged message:
//!
//! ```
//! use ucxkit_transport::{Context, tag};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> ucxkit_transport::Result<()> {
//! let ctx = Context::builder().transports("tcp,self").build()?;
//! let server = ctx.create_worker()?;
//! let client = ctx.create_worker()?;
//!
//! let listener = server.listen("127.0.0.1:0".parse().unwrap())?;
//! let addr = listener.local_addr();
//! let (accepted, ep) = tokio::join!(listener.accept(), client.connect(addr));
//! let (_accepted, ep) = (accepted?, ep?);
//!
//! let recv = server.tag_recv(42, tag::EXACT, vec![0u8; 64]);
//! let (sent, _buf) = ep.tag_send(42, b"hello, ucx".to_vec()).await;
//! sent?;
//! let (info, buf) = recv.await;
//! assert_eq!(info?.len, 10);
//! assert_eq!(buf, b"hello, ucx");
//! # Ok(())
//! # }
//! ```
//!
//! # System dependency
//! UCX 1.13 or newer, found at build time through pkg-config (`ucx`) or `UCX_DIR`
//! (Debian: `apt-get install libucx-dev`). UCX's configuration comes from `UCX_*`
//! environment variables and from [`ContextBuilder::config`], which overrides them for
//! one context without touching the environment (`.transports("posix,self")`,
//! `.config("NET_DEVICES", "lo")`).
//!
//! # Thread safety
//! Every handle is `Send + Sync`. Workers run in UCX's `SERIALIZED` thread mode and
//! ucxkit holds a per-worker mutex around every UCX call on the worker; completion
//! callbacks only record results, and tasks are woken after the mutex is released. One
//! worker serializes its traffic; use one worker per thread for parallel traffic.
//!
//! # Progress modes
//! [`ProgressMode::Event`] (default): a driver task sleeps on the worker's event fd and
//! progresses when woken, and a waiting future polls the worker for up to
//! [`EVENT_SPIN`] first, which catches a reply already on its way; nothing spins while
//! idle. [`ProgressMode::BusyPoll`]: waiting
//! futures progress the worker themselves in a loop, for the lowest latency at the price
//! of a core while traffic flows (an idle busy-poll worker sleeps like an event-mode one
//! after [`BUSY_IDLE`]).
//!
//! # Cancel safety
//! Every async operation documents what dropping its future means. In short: dropping
//! is always memory-safe. Operations take owned buffers ([`IoBuf`], [`IoBufMut`]); a
//! future dropped while UCX still owns its buffer parks the buffer with the worker until
//! UCX completes the request. Unmatched tag receives are canceled
//! (`ucp_request_cancel`); sends, matched receives, flushes and closes cannot be canceled
//! in UCX and run to completion in the background. `ucp_request_free` is never used as a
//! cancel.
//!
//! # Failed peers
//! [`ErrorMode`] chooses how a dead peer is noticed. With UCX's peer mode, UCX fails
//! the peer's operations itself but cannot use shared memory. With `None` (chosen
//! automatically where shared memory can carry the connection), shared memory is used
//! and ucxkit watches the peer process through a pidfd; when it exits, the endpoint
//! fails, its bound receives are canceled and its sends end with
//! [`Error::ConnectionReset`].
//!
//! # Hostile peers
//! No bytes from the network are meant to crash a ucxkit process: listeners speak a
//! protocol of ucxkit's own before UCX sees anything ([`front`]), worker addresses and
//! remote keys are checked before UCX parses them, and a secret
//! ([`ContextBuilder::secret`]) authenticates peers and seals addresses and keys. The
//! one way in that ucxkit cannot guard is the port UCX's TCP transport listens on; the
//! threat model in [`front`] says what each mode lets a peer do and how to shield that
//! port.
//!
//! # Resource cleanup
//! Handles are reference counted: an endpoint keeps its worker alive, a worker its
//! context. Dropping the last clone of an [`Endpoint`] closes it in the background;
//! [`Endpoint::close`] closes it and waits. A worker is destroyed when its last handle,
//! endpoint, listener and pending operation are gone, after giving in-flight requests a
//! bounded time to finish on the dropping thread; [`Worker::shutdown`] does the same
//! awaited, closing its endpoints and listeners first.

#![deny(missing_docs)]
// Casts between the integer types of bindgen's newtypes are kept even where they are
// no-ops with one UCX version: the underlying types differ between UCX releases.
#![allow(clippy::unnecessary_cast)]
#![warn(rust_2018_idioms, unreachable_pub)]

mod address;
pub mod am;
mod assemble;
mod auth;
mod buf;
mod connect;
mod context;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod endpoint;
mod error;
pub mod front;
mod handshake;
mod host;
mod identity;
pub mod iov;
mod listener;
pub mod liveness;
mod lock;
pub mod mem;
pub mod namespace;
mod op;
pub mod pairing;
pub mod rma;
mod shutdown;
mod slot;
pub mod stream;
pub mod tag;
mod ucx_address;
mod ucx_key;
mod ucx_log;
mod ucx_posix;
mod worker;

pub use address::WorkerAddress;
pub use am::{AmHandler, AmMessage, AmProto, AmReceiver, AmRecv, AmRecvData, AmSend, AmSendOptions};
pub use auth::{Secret, MIN_SECRET_LEN};
pub use buf::{huge_zeroed, Either, IoBuf, IoBufMut, MemoryType, SharedBuf, SharedSlice, Slice};
pub use context::{Context, ContextBuilder, Features};
pub use endpoint::{Endpoint, Lane};
pub use error::{Error, ErrorKind, Peer, Result, Status};
pub use handshake::AM_ID as HANDSHAKE_AM_ID;
pub use host::host_cpus;
pub use identity::ProcessIdentity;
pub use iov::{PutIov, TagRecvIov, TagSendIov};
pub use listener::{ConnectionRequest, Listener};
pub use liveness::Keepalive;
pub use mem::{MemRegion, RegionSlice, RegionView, RemoteKey};
pub use namespace::Namespace;
pub use op::{RecvOp, SendOp};
pub use rma::{Atomic, Get, Put};
pub use stream::{StreamData, StreamRecv, StreamSend, UcxStream};
pub use tag::{Tag, TagInfo, TagRecv, TagSend};
pub use worker::{
    EndpointOptions, ErrorMode, ProgressMode, Worker, WorkerBuilder, BUSY_IDLE, CROWDED_SPIN, CROWDED_YIELD,
    DEFAULT_BUSY_SPIN, DEFAULT_LINGER, EVENT_SPIN, EVENT_SPIN_QUIET, MAX_CONNECT_PAYLOAD,
};

/// The raw bindings, for what this crate does not wrap yet.
pub use ucx_sys as sys;
