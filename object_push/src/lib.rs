//! ucxkit-object-push: immutable objects moved between nodes over ucxkit's transport.
//!
//! An [`ObjectNode`] on a worker serves the objects of its [`ObjectStore`] to the peers
//! that ask, and pulls objects from peers into its store. Small objects come inline in
//! the answer to a lookup; larger ones in chunks, a window of them in flight, each
//! received straight into its place in the new object's buffer (a rendezvous tagged
//! message: no copy of the node's own on either side). Every chunk has a checksum its
//! holder computed when it sealed the object (64-bit XXH3), checked before the puller
//! seals: an object is visible only once complete and verified. A node relays the
//! objects it is still receiving, chunk by chunk, so receivers can pull from one
//! another: [`ObjectNode::broadcast`] sends one object to many receivers directly, in
//! a chain or in a tree ([`Shape`], picked by [`Shape::choose`]'s cost model).
//!
//! ```no_run
//! # async fn demo(worker: ucxkit_transport::Worker, holder: ucxkit_transport::Endpoint)
//! # -> ucxkit_object_push::Result<()> {
//! use std::sync::Arc;
//! use ucxkit_object_push::{MemoryStore, NodeOptions, ObjectId, ObjectNode};
//!
//! let node = ObjectNode::new(&worker, Arc::new(MemoryStore::new()), NodeOptions::default())?;
//! let object = node.pull(ObjectId::try_from("weights/7")?, &holder).await?;
//! println!("{} bytes", object.len());
//! # Ok(()) }
//! ```
//!
//! The protocol (messages, fields, checks) is described in [`wire`]; the design, its
//! failure handling and measured figures in the repository's `docs/objects.md`.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod device;
mod error;
mod file;
mod id;
mod node;
mod shape;
mod store;
pub mod sums;
pub mod wire;

pub use error::{Error, Result};
pub use file::{FileStore, ObjectFile};
pub use id::ObjectId;
pub use node::{Broadcast, NodeOptions, NodeStats, ObjectNode, Priority, Progress, Verify};
pub use shape::{LinkCost, Shape};
pub use store::{MemoryStore, Object, ObjectStore};
pub use sums::Layout;
