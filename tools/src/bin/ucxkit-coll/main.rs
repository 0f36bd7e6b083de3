//! `ucxkit-coll`: collective benchmarks in the manner of nccl-tests, for every operation
//! of `ucxkit-collectives`, side by side with Open MPI over UCX (`--compare mpi`).
//!
//! Ranks come from `--np N` (started here, on this host) or from a launcher
//! (`mpirun`, `srun`, torchrun: see `ucxkit_collectives::store::env`). `tune` measures
//! the cost model's constants on the ranks' links and writes them to a file the
//! communicator loads (`UCXKIT_COLL_COSTS`).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ucxkit_tools::cli::{self, Output, Progress, Transport};
use ucxkit_tools::size::parse_sizes;

mod device;
mod mpi;
mod rank;
mod row;
mod spawn;

/// Collective benchmarks (nccl-tests' columns), optionally beside Open MPI.
#[derive(Parser, Debug, Clone)]
#[command(name = "ucxkit-coll", version)]
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// Operations, comma-separated, or `all`: allreduce, broadcast, reduce, allgather,
    /// reduce_scatter, alltoall, gather, scatter, barrier, scan.
    #[arg(long, default_value = "allreduce", value_delimiter = ',')]
    pub(crate) op: Vec<String>,
    /// Sizes in bytes (nccl-tests' convention: the operation's larger buffer), a list
    /// (`8,64K,1M`) or a doubling range (`8:16M`).
    #[arg(long, default_value = "8:1M")]
    pub(crate) sizes: String,
    /// Element type: i8..i64, u8..u64, f16, bf16, f32, f64.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// Reduction: sum, prod, min, max, band, bor, bxor.
    #[arg(long, default_value = "sum")]
    pub(crate) redop: String,
    /// Root of the rooted operations.
    #[arg(long, default_value_t = 0)]
    pub(crate) root: usize,
    /// Start this many ranks on this host (each pinned to a CPU in turn).
    #[arg(long)]
    pub(crate) np: Option<usize>,
    /// Timed iterations per cell (fewer for large sizes: at most about 0.5 s a cell).
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub(crate) iters: u64,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 20)]
    pub(crate) warmup: u64,
    /// Verify every result against a reference; the `wrong` column counts bad elements.
    #[arg(long)]
    pub(crate) check: bool,
    /// Progress mode of the ranks' workers.
    #[arg(long, value_enum, default_value = "busy")]
    pub(crate) progress: Progress,
    /// UCX transports.
    #[arg(long, value_enum, default_value = "shm")]
    pub(crate) transport: Transport,
    /// Force algorithms: `op=algorithm,...` (as UCXKIT_COLL_ALGO).
    #[arg(long)]
    pub(crate) algo: Option<String>,
    /// Ranks wait this long, times their rank, before each timed cell (a receiver that
    /// arrives late), microseconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) skew_us: u64,
    /// Where the buffers live: `host`, or `cuda` (device 0, f32; each call staged through
    /// host memory; needs a build with the `cuda` feature).
    #[arg(long, value_parser = parse_mem_kind, default_value = "host")]
    pub(crate) mem: cli::MemKind,
    /// Also run Open MPI (`mpi`: mpirun with pml ucx on the same transports and pinning)
    /// and print the ratio per cell.
    #[arg(long)]
    pub(crate) compare: Option<String>,
    #[command(flatten)]
    pub(crate) output: Output,
}

#[derive(Subcommand, Debug, Clone)]
pub(crate) enum Command {
    /// Measure the cost model's constants (latency, bandwidth, reduction rate) and write
    /// them to FILE (load them with UCXKIT_COLL_COSTS=FILE).
    Tune {
        /// Where to write the constants.
        #[arg(long, default_value = "ucxkit-coll-costs.json")]
        out: PathBuf,
    },
}

/// `--mem`: one memory type for every buffer.
fn parse_mem_kind(s: &str) -> Result<cli::MemKind, String> {
    let m = cli::parse_mem(s)?;
    if m.send != m.recv {
        return Err("ucxkit-coll takes one memory type (host or cuda)".into());
    }
    Ok(m.send)
}

/// Sizes from `8,64K` or `8:1M` (doubling).
pub(crate) fn sizes(s: &str) -> Result<Vec<usize>, String> {
    if let Some((lo, hi)) = s.split_once(':') {
        let (lo, hi) = (ucxkit_tools::size::parse_size(lo)?, ucxkit_tools::size::parse_size(hi)?);
        let mut v = Vec::new();
        let mut x = lo.max(1);
        while x <= hi {
            v.push(x);
            x *= 2;
        }
        return Ok(v);
    }
    parse_sizes(s)
}

fn main() {
    let args = Args::parse();
    if args.mem == cli::MemKind::Cuda {
        if args.compare.is_some() {
            cli::die("ucxkit-coll", "--compare runs Open MPI on host buffers; use it without --mem cuda");
        }
        if !cfg!(feature = "cuda") {
            cli::die("ucxkit-coll", "--mem cuda: this ucxkit-coll was built without the `cuda` feature");
        }
        #[cfg(feature = "cuda")]
        if let Err(e) = ucxkit::transport::cuda::probe() {
            cli::die("ucxkit-coll", format!("--mem cuda: {e}"));
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| cli::die("ucxkit-coll", e));
    let code = rt.block_on(async move {
        match (spawn::child_rank(), args.np) {
            // A rank started by --np, or by a launcher.
            (Some(_), _) | (None, None) => rank::run(&args).await,
            (None, Some(np)) => spawn::run(&args, np, Duration::from_secs(600)).await,
        }
    });
    std::process::exit(match code {
        Ok(()) => 0,
        Err(e) => cli::die("ucxkit-coll", e),
    });
}
