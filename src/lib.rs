//! ucxkit: safe, async, fast UCX for Rust.
//!
//! This facade re-exports the workspace's crates under one name:
//!
//! - [`transport`] (`ucxkit-transport`): contexts, workers, endpoints, listeners and
//!   tagged messaging over UCX, driven by tokio, with owned buffers and cancel-safe
//!   futures.
//!
//! Collectives and large-object push/pull are built on `transport` and will appear here
//! as the `collectives` and `object-push` features.
//!
//! See the [`transport`] crate documentation for a quick start.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub use ucxkit_transport as transport;

/// The README's example, compiled as a doctest so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
