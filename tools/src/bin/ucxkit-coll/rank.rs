//! One rank's part: form the group, then for each operation and size time the calls
//! (warm-up, barrier, timed loop; the slowest rank's mean per call), check results on
//! request, and let rank 0 report.

use std::time::{Duration, Instant};

use ucxkit::collectives::store::env;
use ucxkit::collectives::{plan, Communicator, DataType, Element, InitOptions, Options, ReduceOp};

use crate::row::CollRow;
use crate::Args;

type Res<T> = Result<T, String>;

/// The longest a cell's timed loop aims to run.
pub(crate) const CELL_BUDGET: Duration = Duration::from_millis(500);

/// How long every rank idles between forming the group and its first cell (the MPI
/// benchmark too). Small calls in a process's first tenth of a second or so ran several
/// times slower here: 4 ranks on 2 cores, 8 B broadcast in cells of 1,000 calls,
/// 15-35 us per call for the first one to four cells, then 0.55-0.65; 2 ranks, cells of
/// 1-9 us among 0.2-0.3. After an idle 60 ms or more (or 150 ms of spinning) the first
/// cell ran as fast as the later ones; 10-30 ms did not help. Open MPI's ranks showed no
/// such start. The tool measures the calls, not the process's start.
const SETTLE: Duration = Duration::from_millis(150);

/// Forms the group from the launcher's (or `--np`'s) variables and runs every cell.
pub(crate) async fn run(args: &Args) -> Res<()> {
    let launch = env::detect().map_err(|e| format!("{e} (or start ranks with --np N)"))?;
    if crate::spawn::child_rank().is_some() {
        ucxkit_tools::cli::pin_to_cpu(launch.rank);
    }
    let opts = InitOptions {
        progress: args.progress.mode(),
        transports: args.transport.tls(),
        deadline: Duration::from_secs(60),
        ..Default::default()
    };
    let mut comm = Communicator::from_launch(&launch, opts).await.map_err(|e| e.to_string())?;
    if let Some(spec) = &args.algo {
        let algorithm = plan::parse_forced(spec)?;
        comm = comm.with_options(Options { algorithm, ..Default::default() });
    }
    if let Some(crate::Command::Tune { out }) = &args.command {
        return crate::spawn::tune(&comm, out).await;
    }
    tokio::time::sleep(SETTLE).await;
    comm.barrier().await.map_err(|e| e.to_string())?;
    let dtype: DataType = args.dtype.parse()?;
    let redop: ReduceOp = args.redop.parse()?;
    if !redop.applies_to(dtype) {
        return Err(format!("{redop} does not apply to {dtype}"));
    }
    let ops: Vec<String> = if args.op.iter().any(|o| o == "all") {
        [
            "allreduce",
            "broadcast",
            "reduce",
            "allgather",
            "reduce_scatter",
            "alltoall",
            "gather",
            "scatter",
            "barrier",
            "scan",
        ]
        .map(String::from)
        .to_vec()
    } else {
        args.op.clone()
    };
    let device = args.mem == ucxkit_tools::cli::MemKind::Cuda;
    if device {
        if dtype != DataType::F32 {
            return Err(format!("--mem cuda measures f32, not {dtype}"));
        }
        if let Some(op) = ops.iter().find(|o| !crate::device::OPS.contains(&o.as_str())) {
            return Err(format!("--mem cuda runs {}, not {op}", crate::device::OPS.join(", ")));
        }
    }
    let sizes = crate::sizes(&args.sizes)?;
    let machine = crate::spawn::child_rank().is_some() || args.output.json;
    if comm.rank() == 0 && !machine {
        if args.output.csv {
            println!("{}", CollRow::csv_header());
        } else {
            println!("{}", CollRow::table_header());
        }
    }
    for op in &ops {
        let cells: &[usize] = if op == "barrier" { &[0] } else { &sizes };
        for &bytes in cells {
            let row = match dtype {
                _ if device => crate::device::cell(&comm, args, op, bytes, redop).await,
                DataType::I8 => cell::<i8>(&comm, args, op, bytes, redop).await,
                DataType::I16 => cell::<i16>(&comm, args, op, bytes, redop).await,
                DataType::I32 => cell::<i32>(&comm, args, op, bytes, redop).await,
                DataType::I64 => cell::<i64>(&comm, args, op, bytes, redop).await,
                DataType::U8 => cell::<u8>(&comm, args, op, bytes, redop).await,
                DataType::U16 => cell::<u16>(&comm, args, op, bytes, redop).await,
                DataType::U32 => cell::<u32>(&comm, args, op, bytes, redop).await,
                DataType::U64 => cell::<u64>(&comm, args, op, bytes, redop).await,
                DataType::F16 => cell::<ucxkit::collectives::f16>(&comm, args, op, bytes, redop).await,
                DataType::Bf16 => cell::<ucxkit::collectives::bf16>(&comm, args, op, bytes, redop).await,
                DataType::F32 => cell::<f32>(&comm, args, op, bytes, redop).await,
                DataType::F64 => cell::<f64>(&comm, args, op, bytes, redop).await,
            }?;
            if comm.rank() == 0 {
                let line = if machine {
                    row.json()
                } else if args.output.csv {
                    row.csv()
                } else {
                    row.table()
                };
                println!("{line}");
            }
        }
    }
    comm.barrier().await.map_err(|e| e.to_string())
}

/// Elements per rank's input for `op` on a buffer of `count` elements (nccl-tests'
/// sizes: the operation's larger buffer).
fn input_len(op: &str, count: usize, n: usize, rank: usize, root: usize) -> usize {
    match op {
        "allgather" | "gather" => count / n,
        "scatter" if rank != root => 0,
        "barrier" => 0,
        _ => count,
    }
}

/// This rank's input element i: small integers, exact under every reduction.
pub(crate) fn value<T: Element>(rank: usize, i: usize) -> T {
    T::from_small(((rank * 7 + i * 3) % 5) as u8 + 1)
}

/// One call of an operation [`repeat`] has no loop of its own; returns the buffer to
/// pass to the next (the result, cut or grown back to the input's length).
async fn once<T: Element>(
    c: &Communicator,
    op: &str,
    buf: Vec<T>,
    count: usize,
    redop: ReduceOp,
    root: usize,
) -> Res<Vec<T>> {
    let n = c.size();
    let mut out = result(c, op, buf, count, redop, root).await?;
    match op {
        "gather" => out.truncate(count / n),
        "scatter" if c.rank() == root => out.resize(count, T::zeroed()),
        _ => {}
    }
    Ok(out)
}

/// `iters` calls of `op` back to back, each operation's loop awaiting the library's
/// future directly (no dispatch on the name per call, which costs as much as a small
/// collective), in the forms that allocate nothing per call where there are some, as
/// nccl-tests keep their buffers from call to call: allgather and reduce-scatter on the
/// whole result buffer in place, all-to-all between the same send and receive buffers
/// (a sender's buffer is not the one just received into; the result kept in `spare`).
/// Returns the buffer for the next call.
#[allow(clippy::too_many_arguments)]
async fn repeat<T: Element>(
    c: &Communicator,
    op: &str,
    mut buf: Vec<T>,
    spare: &mut Vec<T>,
    iters: u64,
    count: usize,
    redop: ReduceOp,
    root: usize,
) -> Res<Vec<T>> {
    let err = |f: Box<ucxkit::collectives::Failed<T>>| f.error.to_string();
    match op {
        "allreduce" => {
            for _ in 0..iters {
                buf = c.allreduce(buf, redop).await.map_err(err)?;
            }
        }
        "broadcast" => {
            for _ in 0..iters {
                buf = c.broadcast(buf, root).await.map_err(err)?;
            }
        }
        "reduce" => {
            for _ in 0..iters {
                buf = c.reduce(buf, redop, root).await.map_err(err)?;
            }
        }
        "allgather" => {
            for _ in 0..iters {
                buf = c.allgather_in_place(buf).await.map_err(err)?;
            }
        }
        "reduce_scatter" => {
            for _ in 0..iters {
                buf = c.reduce_scatter_in_place(buf, redop).await.map_err(err)?;
            }
        }
        "alltoall" => {
            for _ in 0..iters {
                let (out, input) = c.alltoall_into(buf, std::mem::take(spare)).await.map_err(err)?;
                (*spare, buf) = (out, input);
            }
        }
        "barrier" => {
            for _ in 0..iters {
                c.barrier().await.map_err(|e| e.to_string())?;
            }
        }
        _ => {
            for _ in 0..iters {
                buf = once(c, op, buf, count, redop, root).await?;
            }
        }
    }
    Ok(buf)
}

/// One call of `op`: its result as the operation gives it.
async fn result<T: Element>(
    c: &Communicator,
    op: &str,
    buf: Vec<T>,
    count: usize,
    redop: ReduceOp,
    root: usize,
) -> Res<Vec<T>> {
    let n = c.size();
    let err = |f: Box<ucxkit::collectives::Failed<T>>| f.error.to_string();
    Ok(match op {
        "allreduce" => c.allreduce(buf, redop).await.map_err(err)?,
        "broadcast" => c.broadcast(buf, root).await.map_err(err)?,
        "reduce" => c.reduce(buf, redop, root).await.map_err(err)?,
        "scan" => c.scan(buf, redop).await.map_err(err)?,
        "alltoall" => c.alltoall(buf).await.map_err(err)?,
        "allgather" => c.allgather(buf).await.map_err(err)?,
        "gather" => c.gather(buf, root).await.map_err(err)?,
        "reduce_scatter" => c.reduce_scatter(buf, redop).await.map_err(err)?,
        "scatter" => c.scatter(buf, count / n, root).await.map_err(err)?,
        "barrier" => {
            c.barrier().await.map_err(|e| e.to_string())?;
            buf
        }
        other => return Err(format!("unknown operation {other}")),
    })
}

/// Elements of `got` (this rank's result of one call on the reference inputs) that
/// differ from what the operation must give.
pub(crate) fn wrong<T: Element>(
    op: &str,
    got: &[T],
    n: usize,
    rank: usize,
    count: usize,
    redop: ReduceOp,
    root: usize,
) -> u64 {
    let input = |r: usize, len: usize| -> Vec<T> { (0..len).map(|i| value(r, i)).collect() };
    let reduced = |upto: usize, len: usize| {
        let mut acc = input(0, len);
        for r in 1..upto {
            T::reduce(redop, &mut acc, &input(r, len));
        }
        acc
    };
    let per = count / n;
    let want: Vec<T> = match op {
        "allreduce" => reduced(n, count),
        "reduce" if rank == root => reduced(n, count),
        "scan" => reduced(rank + 1, count),
        "broadcast" => input(root, count),
        "allgather" => (0..n).flat_map(|r| input(r, per)).collect(),
        "gather" if rank == root => (0..n).flat_map(|r| input(r, per)).collect(),
        "reduce_scatter" => reduced(n, count)[rank * per..(rank + 1) * per].to_vec(),
        "alltoall" => (0..n).flat_map(|r| input(r, count)[rank * per..(rank + 1) * per].to_vec()).collect(),
        "scatter" => input(root, count)[rank * per..(rank + 1) * per].to_vec(),
        _ => return 0,
    };
    let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    (diff + got.len().abs_diff(want.len())) as u64
}

/// Measures one cell; every rank returns the row (rank 0's is printed).
async fn cell<T: Element>(
    c: &Communicator,
    args: &Args,
    op: &str,
    bytes: usize,
    redop: ReduceOp,
) -> Res<CollRow> {
    let (n, r, root) = (c.size(), c.rank(), args.root.min(c.size() - 1));
    let elem = std::mem::size_of::<T>();
    let mut count = bytes / elem;
    if matches!(op, "allgather" | "gather" | "scatter" | "reduce_scatter" | "alltoall") {
        // Whole blocks, at least one element per rank.
        count = (count - count % n).max(n);
    }
    let fresh = || -> Vec<T> { (0..input_len(op, count, n, r, root)).map(|i| value(r, i)).collect() };
    let mut buf = fresh();
    if op == "allgather" {
        // Timed in place: the whole result buffer, this rank's block where it belongs.
        let per = buf.len();
        buf.resize(count, T::zeroed());
        buf.copy_within(0..per, r * per);
    }
    let run = |(buf, mut spare): (Vec<T>, Vec<T>), k| async move {
        let buf = repeat(c, op, buf, &mut spare, k, count, redop, root).await?;
        Ok((buf, spare))
    };
    let (slowest, iters) = timed(c, args, (buf, Vec::new()), run).await?;
    let wrong = if args.check {
        let got = result(c, op, fresh(), count, redop, root).await?;
        let w = wrong(op, &got, n, r, count, redop, root);
        Some(c.allreduce(vec![w], ReduceOp::Sum).await.map_err(|f| f.error.to_string())?[0])
    } else {
        None
    };
    Ok(CollRow {
        op: op.into(),
        bytes: count * elem,
        count,
        dtype: T::DTYPE.name().into(),
        redop: redop.name().into(),
        root,
        np: n,
        algo: planned(c, op, count, elem, root),
        time_us: slowest * 1e6,
        wrong,
        iters,
        source: "ucxkit".into(),
    })
}

/// Times a cell's calls, every cell alike: `run(state, k)` makes `k` calls. A warm-up,
/// then as many iterations as fit the cell's budget (judged from the warm-up's second
/// half and agreed on: every rank must make the same calls), after a barrier; with
/// `--skew-us`, each call after a barrier and this rank's skew. The slowest rank's
/// seconds per call and the iterations.
pub(crate) async fn timed<S, F, Fut>(c: &Communicator, args: &Args, state: S, mut run: F) -> Res<(f64, u64)>
where
    F: FnMut(S, u64) -> Fut,
    Fut: std::future::Future<Output = Res<S>>,
{
    // Judged from the warm-up's second half only: its first calls run several times
    // slower (cold caches, a young process), and a cell judged by them ran a few
    // thousand calls where a million were asked for and fitted.
    let first = args.warmup / 2;
    let state = run(state, first).await?;
    let t = Instant::now();
    let mut state = run(state, args.warmup - first).await?;
    let per_call = t.elapsed().as_secs_f64() / (args.warmup - first).max(1) as f64;
    let fit = (CELL_BUDGET.as_secs_f64() / per_call.max(1e-9)) as u64;
    let iters = c
        .allreduce(vec![args.iters.min(fit).max(5)], ReduceOp::Min)
        .await
        .map_err(|f| f.error.to_string())?[0];
    c.barrier().await.map_err(|e| e.to_string())?;
    let skew = Duration::from_micros(args.skew_us * c.rank() as u64);
    let mut spent = Duration::ZERO;
    if args.skew_us == 0 {
        let t = Instant::now();
        run(state, iters).await?;
        spent = t.elapsed();
    } else {
        for _ in 0..iters {
            // Every rank takes the same path (rank 0's own skew is zero).
            c.barrier().await.map_err(|e| e.to_string())?;
            let s = Instant::now();
            while s.elapsed() < skew {
                std::hint::spin_loop();
            }
            state = run(state, 1).await?;
            spent += s.elapsed();
        }
    }
    let mine = spent.as_secs_f64() / iters as f64;
    let slowest = c.allreduce(vec![mine], ReduceOp::Max).await.map_err(|f| f.error.to_string())?[0];
    Ok((slowest, iters))
}

/// The algorithm a call of `op` on `count` elements of `elem` bytes takes.
pub(crate) fn planned(c: &Communicator, op: &str, count: usize, elem: usize, root: usize) -> String {
    match plan_op(op) {
        Some(o) => c.plan(o, plan_bytes(op, count, c.size()) * elem, elem, root).algorithm.to_string(),
        None => fixed_algo(op).into(),
    }
}

/// The planner's name for `op`, where the planner chooses.
fn plan_op(op: &str) -> Option<plan::Op> {
    match op {
        "allreduce" => Some(plan::Op::Allreduce),
        "broadcast" => Some(plan::Op::Broadcast),
        "reduce" => Some(plan::Op::Reduce),
        "reduce_scatter" => Some(plan::Op::ReduceScatter),
        "allgather" => Some(plan::Op::Allgather),
        "alltoall" => Some(plan::Op::Alltoall),
        "barrier" => Some(plan::Op::Barrier),
        _ => None,
    }
}

/// The elements per rank (per block, for the operations that cut the buffer into a
/// block per rank) the planner is asked about.
fn plan_bytes(op: &str, count: usize, n: usize) -> usize {
    match op {
        "reduce_scatter" | "allgather" | "alltoall" => count / n,
        _ => count,
    }
}

/// The algorithm of the operations the planner does not choose for.
fn fixed_algo(op: &str) -> &'static str {
    match op {
        "gather" | "scatter" => "direct",
        _ => "doubling",
    }
}
