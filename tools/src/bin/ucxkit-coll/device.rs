//! `--mem cuda`: cells whose buffers live on CUDA device 0 (f32), each call staged
//! through host memory by `ucxkit_collectives::device::staged`, the route the `algorithm`
//! column names after the planner's choice. The operations that keep their buffer's
//! length run so (allreduce, broadcast, reduce, alltoall, scan); each timed call
//! includes both copies.

use ucxkit::collectives::{Communicator, ReduceOp};

use crate::row::CollRow;
use crate::Args;

type Res<T> = Result<T, String>;

/// The operations `--mem cuda` runs.
pub(crate) const OPS: [&str; 5] = ["allreduce", "broadcast", "reduce", "alltoall", "scan"];

#[cfg(feature = "cuda")]
pub(crate) async fn cell(
    c: &Communicator,
    args: &Args,
    op: &str,
    bytes: usize,
    redop: ReduceOp,
) -> Res<CollRow> {
    use std::sync::Arc;

    use ucxkit::collectives::device::{self, ROUTE};
    use ucxkit::transport::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use ucxkit::transport::cuda::error;

    let e = |e| error(e).to_string();
    let (n, r, root) = (c.size(), c.rank(), args.root.min(c.size() - 1));
    let mut count = (bytes / 4).max(1);
    if op == "alltoall" {
        count = (count - count % n).max(n);
    }
    ucxkit::transport::cuda::probe().map_err(|e| e.to_string())?;
    let stream: Arc<CudaStream> = CudaContext::new(0).map_err(e)?.default_stream();
    let input: Vec<f32> = (0..count).map(|i| crate::rank::value(r, i)).collect();
    let fresh = || stream.clone_htod(&input).map_err(e);
    let call = |d: CudaSlice<f32>| async move {
        let out = match op {
            "allreduce" => device::staged(d, |v| c.allreduce(v, redop)).await,
            "broadcast" => device::staged(d, |v| c.broadcast(v, root)).await,
            "reduce" => device::staged(d, |v| c.reduce(v, redop, root)).await,
            "alltoall" => device::staged(d, |v| c.alltoall(v)).await,
            "scan" => device::staged(d, |v| c.scan(v, redop)).await,
            other => return Err(format!("--mem cuda runs {}, not {other}", OPS.join(", "))),
        };
        out.map_err(|f| f.error.to_string())
    };
    let run = |mut d: CudaSlice<f32>, k: u64| async move {
        for _ in 0..k {
            d = call(d).await?;
        }
        Ok(d)
    };
    let (slowest, iters) = crate::rank::timed(c, args, fresh()?, run).await?;
    let wrong = if args.check {
        let got = stream.clone_dtoh(&call(fresh()?).await?).map_err(e)?;
        stream.synchronize().map_err(e)?;
        let w = crate::rank::wrong(op, &got, n, r, count, redop, root);
        Some(c.allreduce(vec![w], ReduceOp::Sum).await.map_err(|f| f.error.to_string())?[0])
    } else {
        None
    };
    let algo = crate::rank::planned(c, op, count, 4, root);
    Ok(CollRow {
        op: op.into(),
        bytes: count * 4,
        count,
        dtype: "f32".into(),
        redop: redop.name().into(),
        root,
        np: n,
        algo: format!("{algo}+{ROUTE}"),
        time_us: slowest * 1e6,
        wrong,
        iters,
        source: "ucxkit".into(),
    })
}

#[cfg(not(feature = "cuda"))]
pub(crate) async fn cell(_: &Communicator, _: &Args, _: &str, _: usize, _: ReduceOp) -> Res<CollRow> {
    Err("--mem cuda: this ucxkit-coll was built without the `cuda` feature".into())
}
