//! What ucxkit's command-line tools share: their command-line conventions ([`cli`]),
//! message sizes ([`size`]), result rows and their writers ([`report`]: table, JSON
//! lines, CSV) and SVG plots ([`plot`]).
//!
//! The tools themselves are this package's binaries; `ucxkit-perf` measures latency and
//! bandwidth side by side with `ucx_perftest` (see the package's README).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod cli;
pub mod perftest;
pub mod plot;
pub mod report;
pub mod size;
