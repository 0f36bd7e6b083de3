//! `--compare mpi`: the same cells run by Open MPI over UCX. A small C benchmark of this
//! tool's own (`mpi_bench.c`) is built with `mpicc` on first use and started with
//! `mpirun`, with pml ucx forced on the same transports and the same pinning (one core
//! per rank in turn), so that the two measure the same machine in the same run.

use std::path::PathBuf;

use crate::row::CollRow;
use crate::Args;

/// The benchmark's source.
const SOURCE: &str = include_str!("mpi_bench.c");

/// Builds the benchmark (once per source version) and returns its path.
async fn build() -> Result<PathBuf, String> {
    let hash = SOURCE
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let dir = std::env::temp_dir().join(format!("ucxkit-coll-mpi-{hash:016x}"));
    let exe = dir.join("mpi_bench");
    if exe.exists() {
        return Ok(exe);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = dir.join("mpi_bench.c");
    std::fs::write(&src, SOURCE).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = tokio::process::Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .await
        .map_err(|e| format!("mpicc: {e} (apt-get install libopenmpi-dev)"))?;
    if !out.status.success() {
        return Err(format!("mpicc failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(exe)
}

/// Runs every (operation, size) of `ours` under mpirun with `np` ranks.
pub(crate) async fn run(args: &Args, np: usize, ours: &[CollRow]) -> Result<Vec<CollRow>, String> {
    if matches!(args.dtype.as_str(), "f16" | "bf16") {
        return Err(format!("MPI has no {} type to compare with", args.dtype));
    }
    let exe = build().await?;
    let tls = args.transport.tls().unwrap_or_else(|| "all".into());
    let cpus = core_affinity::get_core_ids().map_or(1, |c| c.len());
    let mut ops: Vec<&str> = Vec::new();
    for r in ours {
        if !ops.contains(&r.op.as_str()) && r.op != "exscan" {
            ops.push(&r.op);
        }
    }
    let mut rows = Vec::new();
    for op in ops {
        let sizes: Vec<String> = ours.iter().filter(|r| r.op == op).map(|r| r.bytes.to_string()).collect();
        // Each cell as many timed calls as ucxkit's made (it cuts large cells to half a
        // second).
        let iters: Vec<String> =
            ours.iter().filter(|r| r.op == op).map(|r| r.iters.max(1).to_string()).collect();
        let mut c = tokio::process::Command::new("mpirun");
        c.args(["-np", &np.to_string(), "--allow-run-as-root", "--oversubscribe"])
            .args(["--mca", "pml", "ucx", "--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any"])
            .args(["-x", &format!("UCX_TLS={tls}")]);
        // Rank i on core i mod cpus, as `--np` pins ucxkit's ranks (more ranks than
        // cores share them in turn).
        if np <= cpus {
            c.args(["--bind-to", "core", "--map-by", "core"]);
        } else {
            c.args(["--bind-to", "core:overload-allowed", "--map-by", "core"]);
        }
        if args.progress == ucxkit_tools::cli::Progress::Event {
            // Open MPI progresses by polling; there is no event-driven mode to match.
            eprintln!("ucxkit-coll: Open MPI always polls; its figures are busy-mode figures");
        }
        c.arg(&exe)
            .args([op, &sizes.join(","), &args.dtype, &iters.join(","), &args.warmup.to_string()])
            .arg(args.root.min(np - 1).to_string())
            .arg(&args.redop)
            .kill_on_drop(true);
        let out = c.output().await.map_err(|e| format!("mpirun: {e} (apt-get install openmpi-bin)"))?;
        if !out.status.success() {
            return Err(format!("mpirun failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(mut r) = CollRow::from_json(line, "mpi") {
                if let Some(o) = ours.iter().find(|o| o.op == r.op && o.bytes == r.bytes) {
                    (r.count, r.redop, r.root) = (o.count, o.redop.clone(), o.root);
                }
                rows.push(r);
            }
        }
    }
    Ok(rows)
}
