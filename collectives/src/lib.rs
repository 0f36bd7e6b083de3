//! Collectives over ucxkit's transport: allreduce, broadcast, all-to-all and the rest of
//! the MPI set, between the ranks of a [`Communicator`] built from live endpoints.
//!
//! Layers, from the bottom: [`dtype`] and [`reduce`] (element types and the kernels
//! that combine them), [`schedule`] (every algorithm as a pure function to a step-by-step
//! plan of transfers, tested on its own), [`plan`] (the cost model that picks one), the
//! executor that runs a schedule over the transport, and [`Communicator`], whose
//! operations tie them together. Messages travel in the worker's collectives namespace
//! (`ucxkit_transport::namespace::COLLECTIVES`), tagged as [`tag`] lays out, so they
//! never match the application's or another layer's.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod abort;
mod bootstrap;
mod comm;
pub mod dtype;
pub mod error;
mod exec;
mod failure;
mod ops;
pub mod plan;
pub mod reduce;
pub mod schedule;
pub mod store;
pub mod tag;

pub use bootstrap::InitOptions;
pub use comm::{Communicator, Options};
pub use dtype::{bf16, f16, DataType, Element};
pub use error::{Error, Failed, Result};
pub use plan::{Algorithm, Op, Plan};
pub use reduce::ReduceOp;
