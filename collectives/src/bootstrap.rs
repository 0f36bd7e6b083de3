//! Forming a group: every rank publishes its worker's address and its host
//! ([`crate::hosts::this_host`]) in a [`Store`], reads
//! everyone else's, connects an endpoint to each, and the group holds a barrier before
//! it is handed out, so every rank leaves [`Communicator::bootstrap`] only once all
//! are connected. The whole of it has a deadline, and a rank that never came is named.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ucxkit_transport::{namespace::COLLECTIVES, Context, Keepalive, ProgressMode, Worker, WorkerAddress};

use crate::abort::{pick_id, Registry};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::hosts::Hosts;
use crate::store::env::{self, StoreAddr};
use crate::store::{FileStore, Store, TcpStore, TcpStoreServer};

/// How [`Communicator::init_with`] forms its group.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Forming the group fails past this.
    pub deadline: Duration,
    /// The progress mode of the worker it makes. In busy-poll mode, where this host runs
    /// more of the group's ranks than the host has processors online, the worker's waiting
    /// calls yield the processor after [`CROWDED_SPIN`] fruitless progress calls instead
    /// of the transport's default ([`Worker::set_busy_spin`]), and go on so for
    /// [`CROWDED_YIELD`] before they return to the runtime.
    pub progress: ProgressMode,
    /// UCX transports for the context it makes (`UCX_TLS` syntax; None: UCX's choice).
    pub transports: Option<String>,
    /// The keepalive of the worker it makes, which fails the endpoint to a rank that went
    /// silent across the network, and with it the group's operations (see
    /// [`ucxkit_transport::liveness`]; `None`: off).
    pub keepalive: Option<Keepalive>,
}

impl Default for InitOptions {
    /// 60 s, event-driven progress, UCX's transports, the transport's default keepalive.
    fn default() -> Self {
        InitOptions {
            deadline: Duration::from_secs(60),
            progress: ProgressMode::Event,
            transports: None,
            keepalive: Some(Keepalive::default()),
        }
    }
}

/// Busy-poll progress calls a waiting call makes before it yields the processor, on a
/// worker made by [`Communicator::init_with`] whose host runs more ranks than there are
/// processors: the rank a message waits for is then often not running, and the sooner
/// the waiting one yields, the sooner it runs (Open MPI yields on every idle poll when
/// oversubscribed). 4 ranks on 2 processors, 8 B allreduce: 9.4 -> 5.0 us (Open MPI 5.1)
/// at 32 calls; 4 calls with [`CROWDED_YIELD`] took a third off the 8 B calls of every
/// operation again. The transport's own value for crowded hosts
/// ([`ucxkit_transport::CROWDED_SPIN`]).
pub const CROWDED_SPIN: u32 = ucxkit_transport::CROWDED_SPIN;

/// How long a waiting call on such a worker goes on yielding the processor and spinning
/// within one poll ([`WorkerBuilder::busy_yield`]), rather than returning to its
/// runtime after each yield: the transport's value ([`ucxkit_transport::CROWDED_YIELD`]).
///
/// [`WorkerBuilder::busy_yield`]: ucxkit_transport::WorkerBuilder::busy_yield
pub const CROWDED_YIELD: Duration = ucxkit_transport::CROWDED_YIELD;

/// A rank's record in the store starts with little-endian words: the group's size, its
/// host key, its host's processors online, its share of the communicator's token (see
/// [`crate::leave`]), then the maps of the communicator ids free on its worker
/// ([`ID_MAP_WORDS`] words); its worker address follows.
const RECORD_HEAD: usize = 8 * (4 + ID_MAP_WORDS);

/// The words of a worker's maps of free communicator ids (`Registry::free_map`).
const ID_MAP_WORDS: usize = 2 * (crate::tag::MAX_COMMS as usize / 64);

/// Processor counts above this are not believed.
const MAX_CPUS: usize = 1 << 20;

fn boot(what: impl std::fmt::Display) -> Error {
    Error::Bootstrap(what.to_string())
}

fn addr_key(r: usize) -> String {
    format!("ucxkit/world/addr/{r}")
}

impl Communicator {
    /// Forms a group of `size` ranks, this process being `rank`, meeting at `store`:
    /// `host:port` (rank 0 serves a TCP store there for as long as forming takes) or
    /// `file:DIR`. Makes a context and a worker of its own; see
    /// [`Communicator::bootstrap`] to use yours.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when the store cannot be reached or served, when ranks do not
    /// all come within 60 s (naming those that did not), or when connecting fails.
    pub async fn init(rank: usize, size: usize, store: &str) -> Result<Communicator> {
        Self::init_with(rank, size, store, InitOptions::default()).await
    }

    /// [`Communicator::init`] with options.
    ///
    /// # Errors
    /// As for [`Communicator::init`].
    pub async fn init_with(rank: usize, size: usize, store: &str, opts: InitOptions) -> Result<Communicator> {
        let addr: StoreAddr = store.parse()?;
        let mut ctx = Context::builder();
        if let Some(t) = &opts.transports {
            ctx = ctx.transports(t);
        }
        let ctx = ctx.build().map_err(|e| boot(format!("making a UCX context: {e}")))?;
        let worker = ctx
            .worker()
            .progress_mode(opts.progress)
            .keepalive(opts.keepalive)
            .build()
            .map_err(|e| boot(format!("making a worker: {e}")))?;
        let (store, _server) = open(&addr, rank, opts.deadline).await?;
        let comm = Self::bootstrap(&worker, rank, size, &*store, opts.deadline).await?;
        let hosts = comm.hosts();
        if hosts.crowded(hosts.of(rank)) {
            worker.set_busy_spin(CROWDED_SPIN);
            worker.set_busy_yield(CROWDED_YIELD);
        }
        Ok(comm)
    }

    /// Forms the group its launcher describes (`mpirun`, `srun`, torchrun; see
    /// [`crate::store::env`]), with [`InitOptions::default`].
    ///
    /// # Errors
    /// As for [`crate::store::env::detect`] and [`Communicator::init`].
    pub async fn from_env() -> Result<Communicator> {
        Self::from_launch(&env::detect()?, InitOptions::default()).await
    }

    /// Forms the group `launch` describes (see [`crate::store::env::detect_from`]).
    ///
    /// # Errors
    /// As for [`Communicator::init`].
    pub async fn from_launch(launch: &env::Launch, opts: InitOptions) -> Result<Communicator> {
        let store = match &launch.store {
            StoreAddr::Tcp(a) => a.clone(),
            StoreAddr::File(d) => format!("file:{}", d.display()),
        };
        Self::init_with(launch.rank, launch.size, &store, opts).await
    }

    /// Forms a group of `size` ranks on `worker` through `store`: claims the worker's
    /// collectives namespace (so at most one group per worker forms this way at a
    /// time; more come from [`Communicator::split`] and [`Communicator::dup`]),
    /// publishes the worker's address, connects to every other rank and holds a
    /// barrier, all within `deadline`.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] naming the ranks that never published their address, or what
    /// failed; [`Error::InvalidArgument`] for a rank outside the group or too many ranks.
    pub async fn bootstrap(
        worker: &Worker,
        rank: usize,
        size: usize,
        store: &dyn Store,
        deadline: Duration,
    ) -> Result<Communicator> {
        if rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is outside a group of {size}")));
        }
        if size > crate::tag::MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "{size} ranks are more than the {} a communicator can have",
                crate::tag::MAX_RANKS
            )));
        }
        let end = Instant::now() + deadline;
        let left = || end.saturating_duration_since(Instant::now());
        let ns = worker
            .namespace(COLLECTIVES)
            .map_err(|e| boot(format!("claiming the collectives namespace: {e}")))?;
        let me = worker.address().map_err(|e| boot(format!("reading the worker address: {e}")))?;
        // size, host key, processors online, token share, free ids, address.
        let mut value = (size as u64).to_le_bytes().to_vec();
        value.extend_from_slice(&crate::hosts::this_host().to_le_bytes());
        value.extend_from_slice(&(crate::hosts::host_cpus() as u64).to_le_bytes());
        value.extend_from_slice(&crate::leave::random_word().to_le_bytes());
        // Held until the communicator holds it too (its abort handler is installed once).
        let registry = Registry::of(&ns)?;
        let free = registry.free_map();
        if free.len() != ID_MAP_WORDS {
            return Err(Error::Internal(format!("{} words of free ids, not {ID_MAP_WORDS}", free.len())));
        }
        for w in &free {
            value.extend_from_slice(&w.to_le_bytes());
        }
        value.extend_from_slice(me.as_bytes());
        store.set(&addr_key(rank), &value).await?;
        let keys: Vec<String> = (0..size).map(addr_key).collect();
        let values = match store.wait(&keys, left()).await {
            Ok(v) => v,
            Err(e) => return Err(absent(store, size, deadline, e).await),
        };
        let mut addrs = Vec::with_capacity(size);
        let mut hosts = Vec::with_capacity(size);
        let mut cpus = Vec::with_capacity(size);
        let mut shares = Vec::with_capacity(size);
        // The ids free on every rank's worker.
        let mut free = vec![u64::MAX; ID_MAP_WORDS];
        for (r, v) in values.iter().enumerate() {
            if v.len() < RECORD_HEAD {
                return Err(boot(format!(
                    "rank {r} published {} bytes, not a group member's record",
                    v.len()
                )));
            }
            let (head, a) = v.split_at(RECORD_HEAD);
            let word = |i: usize| u64::from_le_bytes(head[8 * i..8 * i + 8].try_into().unwrap_or_default());
            let n = word(0);
            if n != size as u64 {
                return Err(boot(format!("rank {r} forms a group of {n}, this rank ({rank}) one of {size}")));
            }
            hosts.push(word(1));
            // A count past any machine's is no count (0: not known).
            cpus.push(usize::try_from(word(2)).ok().filter(|&c| c <= MAX_CPUS).unwrap_or(0));
            shares.push(word(3));
            for (i, f) in free.iter_mut().enumerate() {
                *f &= word(4 + i);
            }
            addrs.push(
                WorkerAddress::from_bytes(a).map_err(|e| boot(format!("rank {r}'s worker address: {e}")))?,
            );
        }
        let connects = (0..size).map(|r| {
            let a = &addrs[r];
            async move {
                if r == rank {
                    return Ok(None);
                }
                worker
                    .connect_address(a)
                    .await
                    .map(Some)
                    .map_err(|e| boot(format!("connecting to rank {r}: {e}")))
            }
        });
        let eps = tokio::time::timeout(left(), join_all(connects))
            .await
            .map_err(|_| boot(format!("connecting to every rank took over {deadline:?}")))?
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        // Every rank picks the same id from the same maps; one given back recently on any
        // of the workers only when no other is free (see `abort::pick_id`).
        let id = pick_id(&free, 0).map_err(boot)?;
        let comm = Communicator::from_endpoints(&ns, id, rank, eps)?;
        comm.put_hosts(Hosts::from_keys(&hosts).with_cpus(&cpus));
        match tokio::time::timeout(left(), comm.barrier()).await {
            Ok(Ok(())) => {
                comm.formed(crate::leave::token_of(std::iter::once(u64::from(id)).chain(shares)));
                Ok(comm)
            }
            Ok(Err(e)) => Err(boot(format!("the group's first barrier failed: {e}"))),
            Err(_) => Err(boot(format!("the group's first barrier did not finish within {deadline:?}"))),
        }
    }
}

/// How long [`absent`] looks for the addresses that did not come.
const ABSENT_LOOK: Duration = Duration::from_secs(2);

/// When waiting for every rank's address failed with `failure`: the error naming the
/// ranks whose address is missing, or `failure` itself when the store cannot say (it
/// fails to answer) or every address is there after all.
async fn absent(store: &dyn Store, size: usize, deadline: Duration, failure: Error) -> Error {
    let look = async {
        let mut missing = Vec::new();
        for r in 0..size {
            match store.get(&addr_key(r)).await {
                Ok(Some(_)) => {}
                Ok(None) => missing.push(r.to_string()),
                Err(_) => return None,
            }
        }
        Some(missing)
    };
    // A store that stopped answering may take its own long limit to say so.
    let Ok(Some(missing)) = tokio::time::timeout(ABSENT_LOOK, look).await else { return failure };
    if missing.is_empty() {
        return failure;
    }
    boot(format!("ranks {} never came within {deadline:?}", missing.join(", ")))
}

/// Opens the store at `addr`: rank 0 serves a TCP one first.
async fn open(
    addr: &StoreAddr,
    rank: usize,
    deadline: Duration,
) -> Result<(Box<dyn Store>, Option<TcpStoreServer>)> {
    match addr {
        StoreAddr::File(dir) => Ok((Box::new(FileStore::new(dir)?), None)),
        StoreAddr::Tcp(a) => {
            let server = if rank == 0 { Some(TcpStoreServer::bind(a.as_str()).await?) } else { None };
            let at = server.as_ref().map_or_else(|| a.clone(), |s| s.local_addr().to_string());
            Ok((Box::new(TcpStore::connect(&at, deadline).await?), server))
        }
    }
}
