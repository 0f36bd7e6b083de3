//! Collectives over ucxkit's transport: allreduce, broadcast, all-to-all and the rest of
//! the MPI set, between the ranks of a [`Communicator`] built from live endpoints.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod dtype;
pub mod reduce;
pub mod schedule;

pub use dtype::{bf16, f16, DataType, Element};
pub use reduce::ReduceOp;
