//! ucxkit: safe, async, fast UCX for Rust.
//!
//! This facade re-exports the workspace's crates under one name:
//!
//! - [`transport`] (`ucxkit-transport`): contexts, workers, endpoints, listeners and
//!   tagged messaging over UCX, driven by tokio, with owned buffers and cancel-safe
//!   futures.
//!
//! - `collectives` (`ucxkit-collectives`, feature `collectives`): allreduce, broadcast,
//!   all-to-all and the rest of the MPI set between the ranks of a communicator.
//!
//! - `object_push` (`ucxkit-object-push`, feature `object-push`): immutable objects
//!   pulled and pushed between nodes in verified chunks.
//!
//! See the [`transport`] crate documentation for a quick start.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub use ucxkit_transport as transport;

#[cfg(feature = "collectives")]
pub use ucxkit_collectives as collectives;

#[cfg(feature = "object-push")]
pub use ucxkit_object_push as object_push;

/// The README's example, compiled as a doctest so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
