//! [`Communicator`]: a group of ranks, each with an endpoint to every other, that runs
//! collectives in the collectives namespace of its worker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ucxkit_transport::{Endpoint, Namespace};

use crate::error::{Error, Result};
use crate::plan::{self, Algorithm, Costs, Op, Plan};
use crate::tag::{MAX_COMMS, MAX_RANKS};

/// Per-communicator options: a deadline for every call, and algorithms forced per
/// operation (in addition to the environment's [`plan::ENV`], which they override).
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Every collective of the communicator fails with [`Error::DeadlineExceeded`] when
    /// it takes longer.
    pub deadline: Option<Duration>,
    /// Algorithms forced per operation.
    pub algorithm: Vec<(Op, Algorithm)>,
    /// The cost model's constants (the defaults when None).
    pub costs: Option<Costs>,
}

/// Plans kept per communicator before the cache starts over.
const PLAN_CACHE: usize = 512;

pub(crate) struct Inner {
    pub(crate) ns: Namespace,
    pub(crate) eps: Vec<Option<Endpoint>>,
    pub(crate) rank: usize,
    pub(crate) id: u16,
    /// The next call's sequence number.
    seq: Mutex<u16>,
    plans: Mutex<HashMap<(Op, usize, usize, usize), Plan>>,
    forced_env: Vec<(Op, Algorithm)>,
}

/// A group of `size()` ranks that run collectives together; this process is rank
/// `rank()`. Cheap to clone (clones share the group).
///
/// Collectives are futures that may run concurrently, but, as in MPI, every rank must
/// start the same collectives in the same order (the order of the calls, not of the
/// awaits: each call takes its sequence number when it is made).
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
    pub(crate) opts: Arc<Options>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Communicator {
    /// A communicator over endpoints already connected: `eps[i]` reaches rank `i` (None
    /// for this rank itself), all of the worker `ns` was claimed from, and every rank
    /// passes the same `id` (0..1024, unique among the communicators sharing a worker).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank outside the group, a missing endpoint, an
    /// endpoint of another worker, too many ranks or an id out of range, and for a
    /// malformed [`plan::ENV`].
    pub fn from_endpoints(
        ns: &Namespace,
        id: u16,
        rank: usize,
        eps: Vec<Option<Endpoint>>,
    ) -> Result<Communicator> {
        let size = eps.len();
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if rank >= size {
            return bad(format!("rank {rank} is outside a group of {size}"));
        }
        if size > MAX_RANKS {
            return bad(format!("{size} ranks are more than the {MAX_RANKS} a communicator can have"));
        }
        if id >= MAX_COMMS {
            return bad(format!("communicator id {id} is not below {MAX_COMMS}"));
        }
        for (i, ep) in eps.iter().enumerate() {
            match ep {
                None if i != rank => return bad(format!("no endpoint to rank {i}")),
                Some(_) if i == rank => return bad(format!("an endpoint to this rank ({rank}) itself")),
                Some(ep) if !ep.worker().same_as(ns.worker()) => {
                    return bad(format!(
                        "the endpoint to rank {i} belongs to another worker than the namespace"
                    ))
                }
                _ => {}
            }
        }
        let forced_env = match std::env::var(plan::ENV) {
            Ok(spec) => plan::parse_forced(&spec)
                .map_err(|e| Error::InvalidArgument(format!("{}: {e}", plan::ENV)))?,
            Err(_) => Vec::new(),
        };
        Ok(Communicator {
            inner: Arc::new(Inner {
                ns: ns.clone(),
                eps,
                rank,
                id,
                seq: Mutex::new(0),
                plans: Mutex::new(HashMap::new()),
                forced_env,
            }),
            opts: Arc::new(Options::default()),
        })
    }

    /// This communicator with `opts` for the calls made through the returned handle
    /// (the group and its call order are shared).
    pub fn with_options(&self, opts: Options) -> Communicator {
        Communicator { inner: self.inner.clone(), opts: Arc::new(opts) }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.eps.len()
    }

    /// The communicator's id (the tag field that keeps its messages apart).
    pub fn id(&self) -> u16 {
        self.inner.id
    }

    /// The endpoint to rank `r` (None for this rank).
    pub fn endpoint(&self, r: usize) -> Option<&Endpoint> {
        self.inner.eps.get(r).and_then(Option::as_ref)
    }

    /// Takes the next call's sequence number.
    pub(crate) fn next_seq(&self) -> u16 {
        let mut s = self.inner.seq.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *s;
        *s = s.wrapping_add(1);
        seq
    }

    /// What runs `op` on `bytes` bytes per rank of `elem`-byte elements with `root` (0
    /// where there is none), and why.
    pub fn plan(&self, op: Op, bytes: usize, elem: usize, root: usize) -> Plan {
        let elem = elem.max(1);
        let forced =
            self.opts.algorithm.iter().chain(&self.inner.forced_env).find(|(o, _)| *o == op).map(|(_, a)| *a);
        if let Some(algorithm) = forced {
            return Plan { op, bytes, algorithm, forced: true, priced: Vec::new() };
        }
        let key = (op, bytes, elem, root);
        let mut cache = self.inner.plans.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        if cache.len() >= PLAN_CACHE {
            cache.clear();
        }
        let costs = self.opts.costs.unwrap_or_default();
        let p = plan::choose(op, self.size(), root, bytes / elem, elem, &costs);
        cache.insert(key, p.clone());
        p
    }

    pub(crate) fn wire(&self) -> crate::exec::Wire<'_> {
        crate::exec::Wire {
            ns: &self.inner.ns,
            eps: &self.inner.eps,
            rank: self.inner.rank,
            comm: self.inner.id,
        }
    }
}
