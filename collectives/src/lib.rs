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
//!
//! # Forming a group
//!
//! ```no_run
//! # async fn f() -> Result<(), ucxkit_collectives::Error> {
//! use ucxkit_collectives::{Communicator, ReduceOp};
//! // Under mpirun, srun or torchrun; UCXKIT_STORE=host:port (rank 0 serves it) or
//! // UCXKIT_STORE=file:DIR where the launcher names no store.
//! let comm = Communicator::from_env().await?;
//! // Or with no launcher: Communicator::init(rank, size, "10.0.0.1:29500").
//! let sum = comm.allreduce(vec![1.0f32; 1 << 20], ReduceOp::Sum).await?;
//! let half = comm.split(Some((comm.rank() % 2) as u32), 0).await?;
//! # let _ = (sum, half); Ok(()) }
//! ```
//!
//! [`Communicator::bootstrap`] forms a group on a worker of your own through any
//! [`store::Store`]; [`Communicator::from_endpoints`] makes one of endpoints you
//! connected yourself.
//!
//! # Calls
//!
//! Every operation takes the caller's buffer by value and gives it back (as the result,
//! or inside [`Failed`] with the error). Calls are futures that may run at once on one
//! communicator, but every rank must make the same calls in the same order (as in MPI;
//! the order of the calls, not of the awaits). A small broadcast or reduce whose plan is
//! one step on this rank (a one-level tree's root or leaf) starts when it is made: its
//! sends go and its receive is posted, and where nothing has to wait (UCX took the
//! sends, the message had arrived) it ends there and its future only hands back the
//! result. Other calls start when first polled, and so does one call in 256 on a
//! communicator, which first has each rank that only receives from a peer tell it that
//! it came to the call (a sender never runs more than 256 calls ahead of a receiver, and
//! its messages never pile up; see `exec::ready`). A deadline for every call of a handle
//! (counted from the call's start):
//! `comm.with_options(Options { deadline: Some(d), ..Default::default() })`.
//!
//! # Failures
//!
//! A call that fails on any rank, or whose future is dropped before it finished, aborts
//! the communicator on every rank ([`abort`]): pending and later calls fail with
//! [`Error::Aborted`], naming the rank that failed, within the transport's time to see a
//! dead peer plus one message (10 to 100 ms for a killed process on one host). The live
//! ranks then call [`Communicator::shrink`] for a communicator of themselves. An aborted
//! communicator's messages that arrive after its drop are thrown away ([`late`]). A rank
//! that drops a communicator ucxkit formed tells the others how many calls it made, and
//! their calls beyond those fail naming it instead of waiting for it ([`leave`]).
//!
//! # Choosing algorithms
//!
//! [`plan`] prices every candidate algorithm's schedule with a cost model and picks the
//! cheapest; [`Communicator::plan`] says what it picked and why. Variables:
//! `UCXKIT_COLL_ALGO=allreduce=ring,broadcast=knomial:4` forces algorithms
//! ([`plan::ENV`]); `UCXKIT_COLL_COSTS=FILE` loads the model's constants measured by
//! `ucxkit-coll tune` ([`plan::COSTS_ENV`]).
//!
//! # Large transfers on one host
//!
//! Transfers of 1 MiB or more between ranks of one host move through shared-memory
//! lanes: staged by the sender in a region UCX allocated, read by the receiver with a
//! plain copy, piece by piece (the module `exec::lane`; `docs/collectives.md` has the
//! figures). [`LANES_ENV`] switches them off for a rank's sends;
//! [`Communicator::lane_counts`] says how its transfers went.
//!
//! # Several hosts
//!
//! A group formed through a store learns which ranks share a host ([`hosts::this_host`]:
//! host name, boot id and network namespace); [`Communicator::set_hosts`] says it for a
//! group made of endpoints. The model then prices messages between hosts with the
//! network's constants and shared ones per host, and where that wins it picks two-level
//! allreduce, broadcast and allgather ([`schedule::hier`]): one leader per host crosses the
//! network.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod abort;
mod bootstrap;
mod call;
mod comm;
#[cfg(feature = "cuda")]
pub mod device;
pub mod dtype;
pub mod error;
mod exec;
mod failure;
pub mod hosts;
pub mod late;
pub mod leave;
mod ops;
pub mod plan;
pub mod reduce;
pub mod schedule;
pub mod store;
pub mod tag;

pub use bootstrap::{InitOptions, CROWDED_SPIN, CROWDED_YIELD};
pub use comm::{Communicator, Options, DEFAULT_SEGMENT, SEGMENT_ENV};
pub use dtype::{bf16, f16, DataType, Element};
pub use error::{CallResult, Error, Failed, Result};
pub use exec::lane::{LaneCounts, LANES_ENV};
pub use hosts::Hosts;
pub use plan::{Algorithm, Op, Plan};
pub use reduce::ReduceOp;
