//! The processes `bench` starts: the holder, which seals one object per size, serves
//! them and broadcasts them on command (`broadcast SIZE SHAPE|auto` on stdin: it prints
//! the microseconds the broadcast took and the shape it took), and the receivers, which
//! pull on command (`pull SIZE`: they print their time in microseconds and their peak
//! resident memory in KiB) and relay what they receive (`release SIZE` after a
//! broadcast: they check it where asked, drop it and print their peak resident memory).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, BufReader};
use ucxkit::object_push::{MemoryStore, ObjectId, ObjectNode, Shape};

use crate::NodeArgs;

/// A role's arguments.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct RoleArgs {
    /// The holder's port.
    #[arg(long)]
    pub(crate) port: u16,
    /// The holder's address.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) holder_ip: IpAddr,
    /// This process's address: it listens there (the holder for receivers, a receiver
    /// for the receivers it relays to).
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) ip: IpAddr,
    /// The object sizes, in bytes, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub(crate) sizes: Vec<usize>,
    /// The CPU to run on.
    #[arg(long)]
    pub(crate) cpu: Option<usize>,
    /// Check every pulled object's bytes (outside the time).
    #[arg(long)]
    pub(crate) check: bool,
    #[command(flatten)]
    pub(crate) node: NodeArgs,
}

/// The object of `size` bytes.
pub(crate) fn object_id(size: usize) -> ObjectId {
    ObjectId::new(format!("bench/{size}").as_bytes()).unwrap_or_else(|_| unreachable!("a short id"))
}

/// Byte `i` of every bench object.
fn pattern_byte(i: usize) -> u8 {
    (i as u64).wrapping_mul(0x9e37_79b9).rotate_right(13) as u8
}

/// The bytes of the object of `size` bytes (written, so no page is the shared zero page),
/// on huge pages where the kernel gives them, as a runtime would keep large objects.
pub(crate) fn pattern(size: usize) -> Vec<u8> {
    let mut v = ucxkit::transport::huge_zeroed(size);
    for (i, b) in v.iter_mut().enumerate() {
        *b = pattern_byte(i);
    }
    v
}

/// Whether `bytes` are an object's pattern (checked in place: no second copy in memory).
fn is_pattern(bytes: &[u8]) -> bool {
    bytes.iter().enumerate().all(|(i, &b)| b == pattern_byte(i))
}

/// This process's peak resident memory (`VmHWM`), KiB; 0 where the kernel does not say.
pub(crate) fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmHWM:").and_then(|v| v.trim().strip_suffix("kB"))?.trim().parse().ok()
            })
        })
        .unwrap_or(0)
}

fn pin(cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        ucxkit_tools::cli::pin_to_cpu(cpu);
    }
}

/// Holds one object per size and serves them until stdin closes.
pub(crate) async fn holder(a: RoleArgs) -> Result<(), String> {
    pin(a.cpu);
    let worker = a.node.worker()?;
    let node = ObjectNode::new(&worker, Arc::new(MemoryStore::new()), a.node.options())
        .map_err(|e| e.to_string())?;
    for &s in &a.sizes {
        node.put(object_id(s), Bytes::from(pattern(s))).map_err(|e| e.to_string())?;
    }
    let listener =
        worker.listen(SocketAddr::new(a.ip, a.port)).map_err(|e| format!("listening on {}: {e}", a.port))?;
    println!("ready");
    let eps = Arc::new(std::sync::Mutex::new(Vec::new()));
    let accept = tokio::spawn({
        let eps = eps.clone();
        async move {
            loop {
                match listener.accept().await {
                    Ok(ep) => eps.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(ep),
                    Err(e) => eprintln!("ucxkit-objects holder: accept: {e}"),
                }
            }
        }
    });
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = stdin.next_line().await {
        let bad = || format!("unknown command {line:?}");
        let mut words = line.strip_prefix("broadcast ").ok_or_else(bad)?.split(' ');
        let size = words.next().and_then(|s| s.parse::<usize>().ok()).ok_or_else(bad)?;
        let shape = match words.next().ok_or_else(bad)? {
            "auto" => None,
            s => Some(s.parse::<Shape>()?),
        };
        let to = eps.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let t = Instant::now();
        let b = match shape {
            Some(shape) => node.broadcast(object_id(size), &to, shape).await,
            None => node.broadcast_auto(object_id(size), &to).await,
        };
        let b = b.map_err(|e| e.to_string())?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Some((i, e)) = b.first_error() {
            return Err(format!("broadcast of {size} B to receiver {i}: {e}"));
        }
        println!("{us:.1} {}", b.shape);
    }
    accept.abort();
    Ok(())
}

/// Connects to the holder and says where it listens, which lanes UCX chose to the
/// holder and the connection's error mode (`connected ADDR TRANSPORT/DEVICE,...
/// peer|none`), then pulls each object stdin names:
/// `pull SIZE` from the holder (prints the microseconds it took and its peak memory,
/// and releases it), `swarm SIZE [ADDR,...]` from the holder and the receivers
/// listening at those addresses, chunks spread over all of them (prints the same, keeps
/// it for the others until `release SIZE`).
pub(crate) async fn receiver(a: RoleArgs) -> Result<(), String> {
    pin(a.cpu);
    let worker = a.node.worker()?;
    let node = ObjectNode::new(&worker, Arc::new(MemoryStore::new()), a.node.options())
        .map_err(|e| e.to_string())?;
    let me = node.listen(SocketAddr::new(a.ip, 0)).map_err(|e| format!("listening for receivers: {e}"))?;
    let holder = SocketAddr::new(a.holder_ip, a.port);
    let ep = worker.connect(holder).await.map_err(|e| format!("connecting to the holder: {e}"))?;
    let lanes = ep.lanes().map_err(|e| format!("lanes to the holder: {e}"))?;
    let lanes: Vec<String> = lanes.iter().map(|l| format!("{}/{}", l.transport, l.device)).collect();
    let mode = if ep.uses_peer_error_mode() { "peer" } else { "none" };
    println!("connected {me} {} {mode}", lanes.join(","));
    let mut peers = std::collections::HashMap::new();
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = stdin.next_line().await {
        if let Some(size) = line.strip_prefix("release ").and_then(|s| s.trim().parse::<usize>().ok()) {
            let id = object_id(size);
            let o = node.get(&id).ok_or_else(|| format!("the broadcast of {size} B did not arrive"))?;
            if a.check && !o.bytes().is_some_and(|b| is_pattern(b)) {
                return Err(format!("the object of {size} B arrived different"));
            }
            drop(o);
            node.release(&id);
            println!("{}", peak_rss_kib());
            continue;
        }
        let (size, from) = match line.split_once(' ') {
            Some(("pull", size)) => (size, None),
            Some(("swarm", rest)) => {
                let (size, addrs) = rest.split_once(' ').unwrap_or((rest, ""));
                (size, Some(addrs))
            }
            _ => return Err(format!("unknown command {line:?}")),
        };
        let size = size.trim().parse::<usize>().map_err(|_| format!("unknown command {line:?}"))?;
        let mut holders = vec![ep.clone()];
        for addr in from.unwrap_or("").split(',').filter(|s| !s.is_empty()) {
            let addr: SocketAddr = addr.parse().map_err(|_| format!("not an address: {addr}"))?;
            let peer = match peers.entry(addr) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(
                    worker.connect(addr).await.map_err(|err| format!("connecting to {addr}: {err}"))?,
                ),
            };
            holders.push(peer.clone());
        }
        let id = object_id(size);
        let t = Instant::now();
        let o = node.pull_from(id, &holders).await.map_err(|e| format!("pull of {size} B: {e}"))?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        if a.check && !o.bytes().is_some_and(|b| is_pattern(b)) {
            return Err(format!("the object of {size} B arrived different"));
        }
        drop(o);
        if from.is_none() {
            node.release(&id);
        }
        println!("{us:.1} {}", peak_rss_kib());
    }
    Ok(())
}
