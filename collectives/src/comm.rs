//! [`Communicator`]: a group of ranks, each with an endpoint to every other, that runs
//! collectives in the collectives namespace of its worker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use std::any::Any;

use ucxkit_transport::{Endpoint, Namespace, ProgressMode};

use crate::abort::{AbortCell, Registry};
use crate::error::{Error, Result};
use crate::exec::lane::{Lanes, LANES_ENV};
use crate::exec::small::SmallKept;
use crate::exec::{Bufs, Eager, Kept};
use crate::hosts::Hosts;
use crate::plan::{self, Algorithm, Costs, Op, Plan};
use crate::schedule::Schedule;
use crate::tag::{MAX_COMMS, MAX_RANKS};
use crate::Element;

/// Per-communicator options: a deadline for every call, and algorithms forced per
/// operation (in addition to the environment's [`plan::ENV`], which they override).
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Every collective of the communicator fails with [`Error::DeadlineExceeded`] when
    /// it takes longer, counted from its start: when the call is made for a small
    /// rooted call that starts then (see the crate's "Calls"), else its first poll.
    pub deadline: Option<Duration>,
    /// Algorithms forced per operation.
    pub algorithm: Vec<(Op, Algorithm)>,
    /// Transfers longer than this many bytes move as several messages of this size
    /// (None: [`SEGMENT_ENV`]'s, else [`DEFAULT_SEGMENT`]).
    pub segment: Option<usize>,
    /// The cost model's constants (when None: [`plan::COSTS_ENV`]'s file, else the
    /// defaults).
    pub costs: Option<Costs>,
}

/// The size of the pieces large transfers move in, by default: none, a transfer moves
/// as one message. With UCX 1.13 over shared memory, pieces of 64 KiB to 4 MiB were
/// no faster at 1 and 16 MiB, and up to 1.4x slower (`UCXKIT_COLL_SEGMENT`, 2 ranks).
pub const DEFAULT_SEGMENT: usize = usize::MAX;

/// The variable that sets the piece size of large transfers, in bytes, for
/// communicators made afterwards (their [`Options::segment`] overrides it).
pub const SEGMENT_ENV: &str = "UCXKIT_COLL_SEGMENT";

/// Tries [`Communicator::split`] makes at agreeing on a free id.
const SPLIT_TRIES: u16 = 4;

/// Plans kept per communicator before the cache starts over.
const PLAN_CACHE: usize = 512;

/// What a plan is cached by: operation, elements, element size, root, forced algorithm,
/// and the handle's own cost constants (0: the communicator's).
type PlanKey = (Op, usize, usize, usize, Option<Algorithm>, u64);

/// Numbers the handles made with cost constants of their own, for the plan cache.
static COSTS_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Plans made so far, and the last one used, for the host layout they were made for.
struct PlanCache {
    map: HashMap<PlanKey, Arc<Planned>>,
    last: Option<(PlanKey, Arc<Planned>)>,
    hosts: Arc<Hosts>,
}

/// A plan, and this rank's schedule for it.
pub(crate) struct Planned {
    pub(crate) plan: Plan,
    pub(crate) sched: Schedule,
    /// The schedule as a one-step call, if it is one (see [`crate::exec::one`]).
    pub(crate) one: Option<crate::exec::one::OneStep>,
}

pub(crate) struct Inner {
    pub(crate) ns: Namespace,
    pub(crate) eps: Vec<Option<Endpoint>>,
    pub(crate) rank: usize,
    pub(crate) id: u16,
    plans: Mutex<PlanCache>,
    /// The buffers the last call of each element type left (a `Kept<T>` each).
    kept: Mutex<Vec<Box<dyn Any + Send>>>,
    /// What small calls keep (see `exec::small`).
    small: Mutex<SmallKept>,
    forced_env: Vec<(Op, Algorithm)>,
    /// The cost model's constants: the defaults, or [`plan::COSTS_ENV`]'s.
    costs: Costs,
    /// The piece size of large transfers: [`DEFAULT_SEGMENT`], or [`SEGMENT_ENV`]'s.
    segment: usize,
    /// The shared-memory lanes to the ranks of this host.
    lanes: Lanes,
    /// Per rank, whether the endpoint reaches it through shared memory, where mid-size
    /// messages go eagerly (see `exec::eager`).
    eager_to: Box<[bool]>,
    /// Which do (an `exec::Eager` as `u8`), by the host's crowding and the worker's
    /// progress mode.
    eager: AtomicU8,
    /// The worker's communicators, where this one's id is held.
    pub(crate) registry: Arc<Registry>,
    /// Whether (and why) the communicator was aborted.
    pub(crate) abort: Arc<AbortCell>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Messages of this communicator no call will take (a peer's, sent before it heard
        // of an abort, or for a call this rank never made) are received and thrown away:
        // left in UCX's queue, they would keep the sender's send, and its buffer, pending
        // for ever. (A worker shut down has nothing left to take.)
        let _ = self.ns.tag_discard(crate::tag::comm_tag(self.id), crate::tag::COMM_MASK);
        // The id goes back as `held` drops: here, or where an aborted one's messages may
        // still be on their way, at the end of the task that throws them away (`late`).
        let aborted = self.abort.is_set();
        let calls = &self.abort.calls;
        if !aborted && calls.token() != 0 {
            // Formed, and every call this rank made ended: the others learn how many.
            let l = crate::leave::Leave { rank: self.rank, made: calls.made(), token: calls.token() };
            crate::leave::tell(&self.ns, &self.eps, self.id, l);
        }
        let held =
            crate::late::HeldId { registry: self.registry.clone(), cell: self.abort.clone(), id: self.id };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if aborted => {
                let end = tokio::time::Instant::now() + crate::late::LATE_GRACE;
                rt.spawn(crate::late::sweep(self.ns.discarder(), held, end));
            }
            _ => drop(held),
        }
    }
}

/// What a communicator reads from the environment when it is made from endpoints, and
/// what the communicators split from it inherit.
#[derive(Clone)]
pub(crate) struct Settings {
    forced_env: Vec<(Op, Algorithm)>,
    costs: Costs,
    segment: usize,
    /// Whether this rank sends large transfers to ranks of its host by lane.
    lanes: bool,
}

impl Settings {
    /// [`plan::ENV`], [`plan::COSTS_ENV`], [`SEGMENT_ENV`] and [`LANES_ENV`], as they are
    /// now.
    fn from_env() -> Result<Settings> {
        let forced_env = match std::env::var(plan::ENV) {
            Ok(spec) => plan::parse_forced(&spec)
                .map_err(|e| Error::InvalidArgument(format!("{}: {e}", plan::ENV)))?,
            Err(_) => Vec::new(),
        };
        let costs = match std::env::var_os(plan::COSTS_ENV) {
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    Error::InvalidArgument(format!("{}={}: {e}", plan::COSTS_ENV, path.to_string_lossy()))
                })?;
                Costs::from_text(&text)
                    .map_err(|e| Error::InvalidArgument(format!("{}: {e}", plan::COSTS_ENV)))?
            }
            None => Costs::default(),
        };
        let segment = match std::env::var(SEGMENT_ENV) {
            Ok(v) => v.trim().parse::<usize>().ok().filter(|&s| s > 0).ok_or_else(|| {
                Error::InvalidArgument(format!("{SEGMENT_ENV}={v:?} is not a positive number of bytes"))
            })?,
            Err(_) => DEFAULT_SEGMENT,
        };
        let lanes = Lanes::on_for(std::env::var(LANES_ENV).ok().as_deref());
        Ok(Settings { forced_env, costs, segment, lanes })
    }

    /// A communicator's own, for one split from it.
    pub(crate) fn of(c: &Communicator) -> Settings {
        Settings {
            forced_env: c.h.inner.forced_env.clone(),
            costs: c.h.inner.costs,
            segment: c.h.inner.segment,
            lanes: c.h.inner.lanes.on(),
        }
    }
}

/// A group of `size()` ranks that run collectives together; this process is rank
/// `rank()`. Cheap to clone (clones share the group).
///
/// Collectives are futures that may run concurrently, but, as in MPI, every rank must
/// start the same collectives in the same order (the order of the calls, not of the
/// awaits: each call takes its sequence number when it is made).
#[derive(Clone)]
pub struct Communicator {
    pub(crate) h: Arc<Handle>,
}

/// A handle on a group: the group, and the options of the calls made through it (one
/// allocation, so that a clone costs one reference count).
pub(crate) struct Handle {
    pub(crate) inner: Arc<Inner>,
    pub(crate) opts: Options,
    /// Which cost constants the handle's plans are made with (0: the communicator's).
    costs_id: u64,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("id", &self.h.inner.id)
            .finish()
    }
}

impl Inner {
    /// Sets what follows from the host layout `hosts`: which ranks large transfers go by
    /// lane with, and which mid-size sends go eagerly (see `exec::eager`). A lane's every
    /// piece waits for its receiver to run (see `exec::lane`): on a crowded host plain
    /// messages are faster. Four ranks on two cores, 16 MiB, medians of 3 alternated runs,
    /// lanes on -> off: allgather 5.8 -> 3.6 ms, all-to-all 9.8 -> 7.1, allreduce 16.0 ->
    /// 13.4, reduce-scatter 8.5 -> 6.8, broadcast alike. Every rank of a host finds it
    /// crowded alike (judged by this communicator's ranks, as the planner judges).
    fn follow(&self, hosts: &Hosts) {
        let rank = self.rank;
        let crowded = hosts.crowded(hosts.of(rank));
        let local = (0..hosts.ranks()).map(|r| !crowded && r != rank && hosts.of(r) == hosts.of(rank));
        self.lanes.set_local(local);
        let busy = self.ns.worker().progress_mode() == ProgressMode::BusyPoll;
        self.eager.store(Eager::of(crowded, busy) as u8, Ordering::Relaxed);
    }
}

impl Communicator {
    /// A communicator over endpoints already connected: `eps[i]` reaches rank `i` (None
    /// for this rank itself), all of the worker `ns` was claimed from, and every rank
    /// passes the same `id` (0..1024, unique among the communicators sharing a worker;
    /// an aborted communicator's id stays taken for [`crate::late::LATE_GRACE`] after
    /// its drop).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank outside the group, a missing endpoint, an
    /// endpoint of another worker, too many ranks, an id out of range or taken, and for
    /// a malformed [`plan::ENV`].
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
        Communicator::new(ns, id, rank, eps, Settings::from_env()?)
    }

    /// A communicator with id `id` on `ns`'s worker, whose endpoints were checked, with
    /// the settings `set` (read from the environment, or a parent's).
    pub(crate) fn new(
        ns: &Namespace,
        id: u16,
        rank: usize,
        eps: Vec<Option<Endpoint>>,
        set: Settings,
    ) -> Result<Communicator> {
        let Settings { forced_env, costs, segment, lanes } = set;
        let size = eps.len();
        let eager_to = eps.iter().map(|e| e.as_ref().is_some_and(crate::exec::lane::mapped)).collect();
        let registry = Registry::of(ns)?;
        let abort = Arc::new(AbortCell::new(size));
        if !registry.claim(id, &abort) {
            return Err(Error::InvalidArgument(format!(
                "communicator id {id} is taken on this worker (live, or dropped aborted under {:?} ago)",
                crate::late::LATE_GRACE
            )));
        }
        let inner = Arc::new(Inner {
            ns: ns.clone(),
            eps,
            rank,
            id,
            plans: Mutex::new(PlanCache {
                map: HashMap::new(),
                last: None,
                hosts: Arc::new(Hosts::flat(size)),
            }),
            kept: Mutex::new(Vec::new()),
            small: Mutex::new(SmallKept::default()),
            forced_env,
            costs,
            segment,
            lanes: Lanes::new(size, lanes),
            eager_to,
            eager: AtomicU8::new(Eager::Off as u8),
            registry,
            abort,
        });
        inner.follow(&Hosts::flat(size));
        Ok(Communicator { h: Arc::new(Handle { inner, opts: Options::default(), costs_id: 0 }) })
    }

    /// Splits the group: the ranks that pass the same `color` form a new communicator,
    /// ordered by `key` (ties by rank here); a rank passing None takes part but gets
    /// none. Every rank of this communicator must call it (it is a collective: a few of
    /// them run on this communicator, for the colours, a free id and the outcome).
    /// Endpoints are shared with this communicator: nothing new is connected.
    ///
    /// Splits running at once on one worker may pick the same id; a rank that finds its
    /// id taken tells the others, and they all pick again (four tries in all; splits of
    /// different communicators look from different ids first).
    ///
    /// # Errors
    /// What the collectives report, or [`Error::InvalidArgument`] when every
    /// communicator id is taken or the id stayed contended.
    pub async fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        // Colour, key, and this rank's share of the new communicator's token.
        let mine = vec![color.map_or(u64::MAX, u64::from), key as u64, crate::leave::random_word()];
        let everyone = self.allgather(mine).await?;
        let members: Option<Vec<usize>> = color.map(|color| {
            let mut m: Vec<(i64, usize)> = everyone
                .chunks_exact(3)
                .enumerate()
                .filter(|(_, c)| c[0] == u64::from(color))
                .map(|(r, c)| (c[1] as i64, r))
                .collect();
            m.sort_unstable();
            m.into_iter().map(|(_, r)| r).collect()
        });
        let mut taken = String::new();
        for attempt in 0..SPLIT_TRIES {
            let free = self.h.inner.registry.free_map();
            let free = self.allreduce(free, crate::ReduceOp::Band).await?;
            let id = crate::abort::pick_id(&free, crate::abort::first_look(self.id(), attempt))?;
            let made = match &members {
                Some(ranks) => {
                    let rank = ranks.iter().position(|&r| r == self.rank()).unwrap_or_default();
                    let eps = ranks.iter().map(|&r| self.h.inner.eps[r].clone()).collect();
                    Some(Communicator::new(&self.h.inner.ns, id, rank, eps, Settings::of(self)))
                }
                None => None,
            };
            // Every rank learns whether every other could take the id.
            let ok = u8::from(!matches!(made, Some(Err(_))));
            let all = self.allreduce(vec![ok], crate::ReduceOp::Min).await?;
            match (made, all.first()) {
                (Some(Ok(c)), Some(1)) => {
                    let shares = members.iter().flatten().map(|&r| everyone[3 * r + 2]);
                    c.formed(crate::leave::token_of(std::iter::once(u64::from(id)).chain(shares)));
                    c.put_hosts(self.hosts().restrict(members.as_deref().unwrap_or_default()));
                    return Ok(Some(c.with_options(self.h.opts.clone())));
                }
                (None, Some(1)) => return Ok(None),
                // Someone's id was taken: this try's communicators go (their ids cool).
                (Some(Err(e)), _) => taken = e.to_string(),
                _ => taken = format!("id {id} was taken on another rank's worker"),
            }
        }
        Err(Error::InvalidArgument(format!(
            "no communicator id free on every rank after {SPLIT_TRIES} tries: {taken}"
        )))
    }

    /// A second communicator over the same ranks, in the same order, whose collectives
    /// never match this one's. A collective over this communicator.
    ///
    /// # Errors
    /// As for [`Communicator::split`].
    pub async fn dup(&self) -> Result<Communicator> {
        match self.split(Some(0), self.rank() as i64).await? {
            Some(c) => Ok(c),
            None => Err(Error::Internal("dup gave no communicator".into())),
        }
    }

    /// This communicator with `opts` for the calls made through the returned handle
    /// (the group and its call order are shared).
    pub fn with_options(&self, opts: Options) -> Communicator {
        let costs_id = if opts.costs.is_some() { COSTS_IDS.fetch_add(1, Ordering::Relaxed) } else { 0 };
        Communicator { h: Arc::new(Handle { inner: self.h.inner.clone(), opts, costs_id }) }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.h.inner.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.h.inner.eps.len()
    }

    /// The communicator's id (the tag field that keeps its messages apart).
    pub fn id(&self) -> u16 {
        self.h.inner.id
    }

    /// The endpoint to rank `r` (None for this rank).
    pub fn endpoint(&self, r: usize) -> Option<&Endpoint> {
        self.h.inner.eps.get(r).and_then(Option::as_ref)
    }

    /// Which ranks share a host: by default, as the group's bootstrap found out (all on
    /// one host for a communicator made of endpoints, until [`Communicator::set_hosts`]).
    pub fn hosts(&self) -> Arc<Hosts> {
        self.h.inner.plans.lock().unwrap_or_else(PoisonError::into_inner).hosts.clone()
    }

    /// Says which ranks share a host: `keys[r]` is rank r's host (any value, equal for
    /// ranks on one host), for example [`crate::hosts::this_host`] gathered from every
    /// rank. Every rank must pass the same keys before its next collective (the planner
    /// picks algorithms by them, and all ranks must pick alike). The processors each
    /// rank reported when the group formed stay with it (a communicator made of
    /// endpoints knows none, and counts no host as crowded).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless there is one key per rank.
    pub fn set_hosts<K: Eq + std::hash::Hash>(&self, keys: &[K]) -> Result<()> {
        if keys.len() != self.size() {
            return Err(Error::InvalidArgument(format!(
                "{} host keys for a group of {} ranks",
                keys.len(),
                self.size()
            )));
        }
        let hosts = self.hosts();
        let cpus: Vec<usize> = (0..self.size()).map(|r| hosts.cpus_of(r)).collect();
        self.put_hosts(Hosts::from_keys(keys).with_cpus(&cpus));
        Ok(())
    }

    /// Sets the host layout and forgets the plans made for another.
    pub(crate) fn put_hosts(&self, hosts: Hosts) {
        let mut cache = self.h.inner.plans.lock().unwrap_or_else(PoisonError::into_inner);
        if *cache.hosts != hosts {
            self.h.inner.follow(&hosts);
            cache.hosts = Arc::new(hosts);
            cache.map.clear();
            cache.last = None;
        }
    }

    /// How this rank's large transfers to ranks of its host went so far: through
    /// shared-memory lanes or as plain messages (see [`crate::LANES_ENV`]; a crowded
    /// host's count as neither).
    pub fn lane_counts(&self) -> crate::LaneCounts {
        self.h.inner.lanes.counts()
    }

    /// Takes the next call's sequence number (wrapping at 2^16, as the tag's field
    /// does), aborting the communicator when a rank that left made fewer calls (see
    /// [`crate::leave`]).
    pub(crate) fn next_seq(&self) -> u16 {
        let (seq, left) = self.h.inner.abort.calls.begin();
        if let Some(a) = left {
            self.abort_with(a);
        }
        seq
    }

    /// Marks the communicator formed on every rank, with the token they agreed on: from
    /// now on its drop tells the others, and it hears of theirs (see [`crate::leave`]).
    pub(crate) fn formed(&self, token: u64) {
        self.h.inner.abort.calls.set_formed(token);
    }

    /// The token the ranks agreed on when this communicator formed (0 for one made by
    /// [`Communicator::from_endpoints`]).
    pub(crate) fn token(&self) -> u64 {
        self.h.inner.abort.calls.token()
    }

    /// What runs `op` on `bytes` bytes per rank of `elem`-byte elements with `root` (0
    /// where there is none), and why.
    pub fn plan(&self, op: Op, bytes: usize, elem: usize, root: usize) -> Plan {
        self.planned(op, bytes / elem.max(1), elem, root).plan.clone()
    }

    /// The plan for `op` on `count` elements of `elem` bytes with `root`, with this
    /// rank's schedule for it, from the cache when it was made before.
    #[inline]
    pub(crate) fn planned(&self, op: Op, count: usize, elem: usize, root: usize) -> Arc<Planned> {
        let elem = elem.max(1);
        let key = (op, count, elem, root, self.forced(op), self.h.costs_id);
        {
            let cache = self.h.inner.plans.lock().unwrap_or_else(PoisonError::into_inner);
            // The last plan first: a loop of one collective hashes nothing.
            if let Some((k, p)) = &cache.last {
                if *k == key {
                    return p.clone();
                }
            }
        }
        self.plan_anew(key)
    }

    /// The algorithm forced for `op`, if any: by the options, else by the variable. One
    /// counts only where it can run the operation (the variable's are checked when read;
    /// options' here).
    #[inline]
    fn forced(&self, op: Op) -> Option<Algorithm> {
        if self.h.opts.algorithm.is_empty() && self.h.inner.forced_env.is_empty() {
            return None;
        }
        self.h
            .opts
            .algorithm
            .iter()
            .chain(&self.h.inner.forced_env)
            .find(|(o, a)| *o == op && op.candidates().contains(a))
            .map(|(_, a)| *a)
    }

    /// [`Communicator::planned`] for a key other than the last one's: from the cache, or
    /// planned and kept. It takes the cache's lock again: handing it the hit path's guard
    /// cost that path 23-29 instructions a call pair (`broadcast_2ranks_8B_ahead`).
    #[inline(never)]
    fn plan_anew(&self, key: PlanKey) -> Arc<Planned> {
        let (op, count, elem, root, forced, _) = key;
        let mut cache = self.h.inner.plans.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cache.map.get(&key).cloned() {
            cache.last = Some((key, p.clone()));
            return p;
        }
        if cache.map.len() >= PLAN_CACHE {
            cache.map.clear();
        }
        let costs = self.h.opts.costs.unwrap_or(self.h.inner.costs);
        let hosts = cache.hosts.clone();
        let plan = match forced {
            Some(algorithm) => Plan {
                op,
                bytes: count * elem,
                algorithm,
                forced: true,
                priced: Vec::new(),
                phases: (algorithm == Algorithm::TwoLevel)
                    .then(|| plan::Phases::choose(op, &hosts, root, count, elem, &costs)),
            },
            None => plan::choose(op, &hosts, root, count, elem, &costs),
        };
        let sched = plan::schedule(
            op,
            plan.algorithm,
            &hosts,
            self.rank(),
            root,
            count,
            elem,
            plan.phases.as_ref(),
            &costs,
        );
        let one = crate::exec::one::OneStep::of(&sched);
        let p = Arc::new(Planned { plan, sched, one });
        cache.map.insert(key, p.clone());
        cache.last = Some((key, p.clone()));
        p
    }

    /// Buffers for a call (see [`Bufs::new`]), in those the last call of this element
    /// type left.
    pub(crate) fn bufs<T: Element>(&self, data: Vec<T>, input: Vec<T>, scratch: usize) -> Bufs<T> {
        let kept = {
            let mut slots = self.h.inner.kept.lock().unwrap_or_else(PoisonError::into_inner);
            slots.iter_mut().find_map(|b| b.downcast_mut::<Kept<T>>()).map(std::mem::take).unwrap_or_default()
        };
        Bufs::new(kept, data, input, scratch)
    }

    /// Keeps a finished call's buffers for the next call of its element type (each type
    /// has its own, so a barrier between allreduces costs them nothing). Buffers a
    /// transfer still holds stay unused until it lets go.
    pub(crate) fn keep<T: Element>(&self, bufs: Bufs<T>) {
        let kept = bufs.into_kept();
        let mut slots = self.h.inner.kept.lock().unwrap_or_else(PoisonError::into_inner);
        match slots.iter_mut().find_map(|b| b.downcast_mut::<Kept<T>>()) {
            Some(k) => *k = kept,
            None => slots.push(Box::new(kept)),
        }
    }

    /// What the last small call left (empty while another small call has it).
    pub(crate) fn take_small(&self) -> SmallKept {
        std::mem::take(&mut *self.h.inner.small.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Keeps a small call's scratch and landing vectors for the next.
    pub(crate) fn keep_small(&self, kept: SmallKept) {
        *self.h.inner.small.lock().unwrap_or_else(PoisonError::into_inner) = kept;
    }

    #[inline]
    pub(crate) fn wire(&self) -> crate::exec::Wire<'_> {
        crate::exec::Wire {
            ns: &self.h.inner.ns,
            segment: self.h.opts.segment.unwrap_or(self.h.inner.segment).max(1),
            abort: &self.h.inner.abort,
            eps: &self.h.inner.eps,
            rank: self.h.inner.rank,
            comm: self.h.inner.id,
            lanes: &self.h.inner.lanes,
            eager_to: &self.h.inner.eager_to,
            eager: Eager::from_u8(self.h.inner.eager.load(Ordering::Relaxed)),
            small: &self.h.inner.small,
        }
    }
}
