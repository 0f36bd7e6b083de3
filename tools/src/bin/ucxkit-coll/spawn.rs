//! `--np N`: start N ranks of this program on this host (torchrun-style variables, each
//! pinned to a CPU in turn), gather rank 0's rows, run the comparison, print; and
//! `tune`, which measures the cost model's constants.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use ucxkit::collectives::plan::{Costs, CACHED_CALL};
use ucxkit::collectives::reduce::Kernels;
use ucxkit::collectives::{Communicator, ReduceOp};

use crate::row::CollRow;
use crate::Args;

/// Set in the ranks `--np` starts: the rank.
const CHILD: &str = "UCXKIT_COLL_CHILD";

/// This process's rank when `--np` started it.
pub(crate) fn child_rank() -> Option<usize> {
    std::env::var(CHILD).ok()?.parse().ok()
}

/// Starts `np` ranks, gathers rank 0's rows, adds the comparison's, prints them all.
pub(crate) async fn run(args: &Args, np: usize, limit: Duration) -> Result<(), String> {
    if np == 0 {
        return Err("--np needs at least one rank".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let port = ucxkit_tools::cli::free_port()?.to_string();
    let mut children = Vec::new();
    for r in 0..np {
        let mut c = tokio::process::Command::new(&exe);
        c.args(std::env::args_os().skip(1))
            .env(CHILD, r.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", np.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env_remove("UCXKIT_STORE")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .env_remove("SLURM_PROCID")
            .stdin(Stdio::null())
            .stdout(if r == 0 { Stdio::piped() } else { Stdio::null() })
            .kill_on_drop(true);
        children.push(c.spawn().map_err(|e| format!("starting rank {r}: {e}"))?);
    }
    let out = children[0].stdout.take().ok_or("rank 0's output")?;
    let mut lines = BufReader::new(out).lines();
    let mut rows = Vec::new();
    let end = Instant::now() + limit;
    let mut quiet = false;
    let print = |r: &CollRow, header: &mut bool| {
        if !args.output.table() || args.compare.is_some() {
            return;
        }
        if !*header {
            println!("{}", CollRow::table_header());
            *header = true;
        }
        println!("{}", r.table());
    };
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(end.into(), lines.next_line()).await {
        match CollRow::from_json(&line, "ucxkit") {
            Some(r) => {
                print(&r, &mut quiet);
                rows.push(r);
            }
            // What rank 0 says besides rows (tune's constants).
            None => println!("{line}"),
        }
    }
    let mut failed = Vec::new();
    for (r, c) in children.iter_mut().enumerate() {
        match tokio::time::timeout_at(end.into(), c.wait()).await {
            Ok(Ok(s)) if s.success() => {}
            Ok(Ok(s)) => failed.push(format!("rank {r}: {s}")),
            _ => failed.push(format!("rank {r} did not finish")),
        }
    }
    if !failed.is_empty() {
        return Err(failed.join("; "));
    }
    let theirs = match args.compare.as_deref() {
        None => Vec::new(),
        Some("mpi") => crate::mpi::run(args, np, &rows).await?,
        Some(other) => return Err(format!("--compare {other}: only mpi is known")),
    };
    report(args, &rows, &theirs)
}

/// Prints ucxkit's rows and the comparison's, with a ratio per cell.
fn report(args: &Args, ours: &[CollRow], theirs: &[CollRow]) -> Result<(), String> {
    let matching = |r: &CollRow| theirs.iter().find(|t| t.op == r.op && t.bytes == r.bytes);
    if args.output.json {
        for r in ours.iter().chain(theirs) {
            println!("{}", r.json());
        }
    } else if args.output.csv {
        println!("{}", CollRow::csv_header());
        for r in ours.iter().chain(theirs) {
            println!("{}", r.csv());
        }
    } else if !theirs.is_empty() {
        println!("{}  {:>7}", CollRow::table_header(), "ratio");
        for r in ours {
            println!("{}", r.table());
            if let Some(t) = matching(r) {
                println!("{}  {:>7.2}", t.table(), r.time_us / t.time_us.max(1e-9));
            }
        }
    }
    if let Some(path) = &args.output.plot {
        let rows: Vec<ucxkit_tools::report::Row> = ours.iter().chain(theirs).flat_map(plot_rows).collect();
        let svg = ucxkit_tools::plot::render(&rows, "ucxkit-coll", &|t: &str| t.ends_with(" time"))?;
        std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// A cell as the plotting module's rows: bus bandwidth, and time per call.
fn plot_rows(r: &CollRow) -> [ucxkit_tools::report::Row; 2] {
    use ucxkit_tools::report::Row;
    [
        Row::point(r.op.clone(), r.bytes, 0.0, r.busbw() * 1e9 / (1 << 20) as f64, r.source.clone()),
        Row::point(format!("{} time", r.op), r.bytes, r.time_us, 0.0, r.source.clone()),
    ]
}

/// What [`links`] measures of one group of ranks: per-step latency, rendezvous step
/// latency, bandwidth.
struct Links {
    latency: f64,
    rndv_latency: f64,
    bandwidth: f64,
}

/// Measures the links of `c`'s ranks: the per-step latency (a barrier's time over its
/// steps), the bandwidth (a ring allgather of 16 MiB) and a rendezvous step's latency (a
/// ring allgather of blocks at the rendezvous threshold, less their bytes' time).
async fn links(c: &Communicator) -> Result<Links, String> {
    let n = c.size();
    let e = |e: ucxkit::collectives::Error| e.to_string();
    let steps = (n as f64).log2().ceil().max(1.0);
    let t = Instant::now();
    let iters = 2000;
    for _ in 0..iters {
        c.barrier().await.map_err(e)?;
    }
    let latency = t.elapsed().as_secs_f64() / iters as f64 / steps;
    let per = (16 << 20) / 4 / n.max(1);
    let mut buf = vec![1f32; per * n];
    let reps = 5;
    // One untimed call first: the pages of the buffer, and UCX's caches, settle.
    buf = c.allgather_in_place(buf).await.map_err(|f| f.error.to_string())?;
    let t = Instant::now();
    for _ in 0..reps {
        buf = c.allgather_in_place(buf).await.map_err(|f| f.error.to_string())?;
    }
    drop(buf);
    let ring = t.elapsed().as_secs_f64() / reps as f64;
    let moved = (n.saturating_sub(1) * per * 4) as f64;
    let bandwidth = if n > 1 { moved / (ring - (n - 1) as f64 * latency).max(1e-9) } else { 1e10 };
    // A rendezvous step: an allgather of blocks at the threshold, less what its bytes take.
    let rndv = Costs::default().rndv_threshold.div_ceil(4);
    let mut small = vec![1f32; rndv * n];
    small = c.allgather_in_place(small).await.map_err(|f| f.error.to_string())?;
    let t = Instant::now();
    let reps = 200;
    for _ in 0..reps {
        small = c.allgather_in_place(small).await.map_err(|f| f.error.to_string())?;
    }
    drop(small);
    let per_step = t.elapsed().as_secs_f64() / reps as f64 / n.saturating_sub(1).max(1) as f64;
    let rndv_latency = (per_step - (rndv * 4) as f64 / bandwidth).max(latency);
    Ok(Links { latency, rndv_latency, bandwidth })
}

/// `tune`: measures the cost model's constants and has rank 0 write them where
/// communicators read them (`UCXKIT_COLL_COSTS`). Inside a host: [`links`] over the
/// ranks of each host that has several (all of them when the group is on one host);
/// between hosts, when it spans several: [`links`] over one rank per host (the network's
/// latency and bandwidth). The reduction rates: f32 sums in memory and in cache.
/// Constants nobody could measure (no host with two ranks, or one host) keep their
/// defaults.
pub(crate) async fn tune(c: &Communicator, out: &std::path::Path) -> Result<(), String> {
    let e = |e: ucxkit::collectives::Error| e.to_string();
    let hosts = c.hosts();
    let (h, rank) = (hosts.of(c.rank()), c.rank());
    let local = c.split(Some(h as u32), rank as i64).await.map_err(e)?.ok_or("no host group")?;
    let leader = hosts.members(h)[0] == rank;
    let leaders = c.split(leader.then_some(0), rank as i64).await.map_err(e)?;
    // What this rank measured; neutral values (0 for the maxima, infinity for the minima)
    // where it measured nothing.
    let mut slow = [0.0f64; 3];
    let mut fast = [f64::INFINITY; 4];
    if local.size() > 1 {
        let l = links(&local).await?;
        (slow[0], slow[1], fast[0]) = (l.latency, l.rndv_latency, l.bandwidth);
    }
    if let Some(net) = leaders.filter(|l| l.size() > 1) {
        let l = links(&net).await?;
        (slow[2], fast[2]) = (l.latency, l.bandwidth);
    }
    let mut a = vec![1f32; 4 << 20];
    let b = vec![2f32; 4 << 20];
    let t = Instant::now();
    for _ in 0..5 {
        f32::reduce(ReduceOp::Sum, &mut a, &b);
    }
    fast[1] = (5 * a.len() * 4) as f64 / t.elapsed().as_secs_f64();
    // In cache: a call's worth of data (CACHED_CALL) reduced again and again.
    let (mut a, b) = (vec![1f32; CACHED_CALL / 4], vec![2f32; CACHED_CALL / 4]);
    let t = Instant::now();
    for _ in 0..2000 {
        f32::reduce(ReduceOp::Sum, &mut a, &b);
    }
    fast[3] = (2000 * CACHED_CALL) as f64 / t.elapsed().as_secs_f64();
    // Every rank's view, made one: the slowest latencies, the lowest rates.
    let slow = c.allreduce(slow.to_vec(), ReduceOp::Max).await.map_err(|f| f.error.to_string())?;
    let fast = c.allreduce(fast.to_vec(), ReduceOp::Min).await.map_err(|f| f.error.to_string())?;
    let d = Costs::default();
    let time = |v: f64, or: Duration| if v > 0.0 && v.is_finite() { Duration::from_secs_f64(v) } else { or };
    let rate = |v: f64, or: f64| if v > 0.0 && v.is_finite() { v } else { or };
    let costs = Costs {
        latency: time(slow[0], d.latency),
        rndv_latency: time(slow[1], d.rndv_latency),
        bandwidth: rate(fast[0], d.bandwidth),
        reduce_rate: rate(fast[1], d.reduce_rate),
        cached_reduce_rate: rate(fast[3], d.cached_reduce_rate),
        net_latency: time(slow[2], d.net_latency),
        net_bandwidth: rate(fast[2], d.net_bandwidth),
        ..d
    };
    if c.rank() == 0 {
        std::fs::write(out, costs.to_text()).map_err(|e| format!("writing {}: {e}", out.display()))?;
        println!(
            "{} (load with UCXKIT_COLL_COSTS={})",
            costs.to_text().trim().replace('\n', ", "),
            out.display()
        );
    }
    Ok(())
}
