//! The test kit of ucxkit's crates: what their integration tests share.
//!
//! - [`workers`]: contexts pinned to a transport set, connected worker pairs and full
//!   meshes in one process;
//! - [`procs`]: several processes of one test binary with ranks, roles and a shared
//!   exchange of addresses;
//! - [`netns`]: two test hosts (of a [`rig`]) and processes run inside hosts, removed
//!   when the test ends (also when it fails);
//! - [`rig`]: several hosts on one bridge, and faults on them (link down, loss, rate,
//!   delay and reordering, frozen or killed processes); the code of `ucxkit-rig`;
//! - [`payload`](mod@payload): deterministic payloads and a small generator;
//! - [`forge`]: ucxkit's envelopes forged as an attacker would, for hostile-input tests;
//! - [`ports`]: ports for servers whose address is handed out before they bind it.
//!
//! The items of `workers`, `payload` and `procs` are also at the crate root, so a test
//! file can say `use ucxkit_testkit as common;` and call `common::pair(...)`.

#![deny(missing_docs)]

pub mod forge;
pub mod netns;
pub mod payload;
pub mod ports;
pub mod procs;
pub mod rig;
pub mod workers;

pub use payload::{payload, Rng};
pub use procs::child_run;
pub use workers::*;
