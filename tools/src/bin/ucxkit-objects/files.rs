//! `serve` and `get`: move files between two hosts by hand. Neither holds a file in
//! memory: `serve` reads each chunk from its file as it sends it, `get` writes each
//! chunk into the output's directory as it checks out (a file-backed store).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ucxkit::object_push::{FileStore, MemoryStore, ObjectId, ObjectNode};

use ucxkit_tools::size::format_size;

use crate::NodeArgs;

/// `serve`'s arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// The address to listen on.
    #[arg(long, default_value = "0.0.0.0:13340")]
    listen: SocketAddr,
    /// The files to serve, each as the object named by its file name.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    #[command(flatten)]
    node: NodeArgs,
}

/// `get`'s arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct GetArgs {
    /// The serving node.
    #[arg(long)]
    from: SocketAddr,
    /// The object's name.
    name: String,
    /// Where to write it (default: its name, in this directory).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    node: NodeArgs,
}

pub(crate) async fn serve(a: ServeArgs) -> Result<(), String> {
    let worker = a.node.worker()?;
    let node = ObjectNode::new(&worker, Arc::new(MemoryStore::new()), a.node.options())
        .map_err(|e| e.to_string())?;
    for f in &a.files {
        let name =
            f.file_name().and_then(|n| n.to_str()).ok_or_else(|| format!("{}: no file name", f.display()))?;
        let id = ObjectId::try_from(name).map_err(|e| e.to_string())?;
        let o = node.put_file(id, f).await.map_err(|e| e.to_string())?;
        eprintln!("serving {name} ({} bytes)", o.len());
    }
    let listener = worker.listen(a.listen).map_err(|e| format!("listening on {}: {e}", a.listen))?;
    eprintln!("listening on {}", listener.local_addr());
    let mut eps = Vec::new();
    loop {
        match listener.accept().await {
            Ok(ep) => eps.push(ep),
            Err(e) => eprintln!("accept: {e}"),
        }
    }
}

pub(crate) async fn get(a: GetArgs) -> Result<(), String> {
    let out = a.out.unwrap_or_else(|| PathBuf::from(&a.name));
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let store = Arc::new(FileStore::new(dir).map_err(|e| e.to_string())?);
    let worker = a.node.worker()?;
    let node = ObjectNode::new(&worker, store.clone(), a.node.options()).map_err(|e| e.to_string())?;
    let ep = worker.connect(a.from).await.map_err(|e| format!("connecting to {}: {e}", a.from))?;
    let id = ObjectId::try_from(a.name.as_str()).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let o = tokio::select! {
        o = node.pull(id, &ep) => o.map_err(|e| e.to_string())?,
        never = progress_bar(&node, id, t) => match never {},
    };
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[2K");
    }
    let secs = t.elapsed().as_secs_f64();
    if o.file().is_some() {
        store.persist(&id, &out).map_err(|e| e.to_string())?;
    } else {
        // An object of the node's own (put, not received) would be in memory.
        let bytes = o.read(0..o.len() as u64).map_err(|e| e.to_string())?;
        std::fs::write(&out, bytes).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    eprintln!(
        "{} bytes in {:.3} s ({:.0} MiB/s), verified, written to {}; peak memory {} MiB",
        o.len(),
        secs,
        o.len() as f64 / secs / f64::from(1 << 20),
        out.display(),
        crate::role::peak_rss_kib() / 1024
    );
    Ok(())
}

/// Draws the pull of `id`'s progress on stderr, when it is a terminal, every quarter
/// second from half a second on; runs until dropped.
async fn progress_bar(node: &ObjectNode, id: ObjectId, start: Instant) -> std::convert::Infallible {
    let tty = std::io::stderr().is_terminal();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    loop {
        if let Some(p) = node.progress(&id).filter(|p| tty && p.size > 0) {
            const WIDTH: usize = 30;
            let frac = p.done as f64 / p.size as f64;
            let filled = (frac * WIDTH as f64) as usize;
            let rate = p.done as f64 / start.elapsed().as_secs_f64() / f64::from(1 << 20);
            eprint!(
                "\r[{}{}] {:5.1}% {} of {}, {rate:.0} MiB/s",
                "#".repeat(filled),
                " ".repeat(WIDTH - filled.min(WIDTH)),
                frac * 100.0,
                format_size(p.done as usize),
                format_size(p.size as usize)
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
