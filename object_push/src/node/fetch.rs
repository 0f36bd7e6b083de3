//! Fetching an object's chunks from one or several holders: a window of chunks in
//! flight per holder, each received into its own piece of the object's buffer (split
//! off in order, joined back without a copy) and checked on the blocking pool while the
//! next arrive (the receiving thread does the copy itself on one host, so a check there
//! would delay the transfer by its own time). A holder that fails leaves its chunks to
//! the others; a corrupt chunk is fetched again, from another holder where there is one.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;
use ucxkit_transport::am::AmSendOptions;
use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{AmMessage, Endpoint, ErrorKind, TagInfo};

use super::budget::{Held, Priority};
use super::pull::{Found, Registered};
use super::sink::{self, Dest, Finish, Sink};
use super::{chunk_tag, Inner, REQUEST};
use crate::device::{self, Piece};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::Object;
use crate::sums::Layout;
use crate::wire::Msg;

/// A boxed future of the transfer's.
pub(super) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A chunk's receive ended: its source, its index, and the result with its piece, or
/// `None` when it was abandoned because its source failed (the piece stays with the
/// transport until UCX lets go of it); with the room it holds until it is checked.
type Landed<'a> = (usize, u64, Option<(ucxkit_transport::Result<TagInfo>, Piece)>, Held<'a>);

/// A checked chunk: its source, its index, whether it is as sealed, and its piece.
type Checked = (usize, u64, bool, Piece);

/// One holder, as a source of chunks.
struct Source<'a> {
    ep: &'a Endpoint,
    /// Whether its chunks are checked against their checksums ([`super::Verify`]).
    check: bool,
    /// Chunks in flight it is given, at most: `NodeOptions::window`, held to
    /// `NodeOptions::network_window` bytes in a relayed transfer where UCX reaches it
    /// over a network only ([`window_of`]).
    window: u64,
    /// While it serves this transfer.
    live: Option<Live<'a>>,
    inflight: u64,
}

/// A holder's part in a transfer: its request (the chunks' tags carry it), the signal
/// that abandons its receives when it fails, and the chunks asked of it and not landed.
/// Dropped with chunks outstanding (the holder failed, or the transfer ended early), it
/// tells the holder to stop sending the request's chunks, and takes in (into scratch,
/// for at most the node's deadline) those it may have sent already: UCX cannot take back
/// a rendezvous send once its announcement left, so the holder would keep each such
/// chunk, and its object's memory, until the endpoint closed. With none outstanding the
/// holder's sends have all ended: nothing to say.
struct Live<'a> {
    reg: Registered<'a>,
    dead: watch::Sender<bool>,
    ep: &'a Endpoint,
    /// Chunk index -> length, for the chunks asked for and not landed.
    outstanding: HashMap<u64, usize>,
}

impl Drop for Live<'_> {
    fn drop(&mut self) {
        if self.outstanding.is_empty() {
            return;
        }
        // Done by a task (the cancel with the reply flag, which names this endpoint to
        // the holder), where a runtime runs one.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let node = self.reg.node;
        let (req, limit) = (self.reg.req, node.opts.deadline);
        let cancel = Msg::Cancel { req }.encode();
        let (ns, ep) = (node.ns.clone(), self.ep.clone());
        let outstanding = std::mem::take(&mut self.outstanding);
        rt.spawn(async move {
            let opts = AmSendOptions { reply: true, ..Default::default() };
            let _ = ns.am_send_with(&ep, REQUEST, &cancel, Bytes::new(), opts).await;
            let drains = outstanding
                .into_iter()
                .map(|(k, len)| ns.tag_recv_from(&ep, chunk_tag(req, k), EXACT, Vec::with_capacity(len)));
            let _ = tokio::time::timeout(limit, futures_util::future::join_all(drains)).await;
        });
    }
}

/// One transfer's state.
pub(super) struct Transfer<'a> {
    node: &'a Inner,
    id: ObjectId,
    layout: Arc<Layout>,
    sources: Vec<Source<'a>>,
    /// Where the chunks go.
    sink: Sink<'a>,
    /// The first chunk never asked for.
    next: u64,
    /// Chunks to ask for again, with their piece and the source to avoid.
    again: VecDeque<(u64, Piece, Option<usize>)>,
    tries: HashMap<u64, u32>,
    done: u64,
    limit_ms: u32,
    receiving: FuturesUnordered<Boxed<'a, Landed<'a>>>,
    checking: FuturesUnordered<Boxed<'a, Result<Checked>>>,
    answers: FuturesUnordered<Boxed<'a, (usize, Option<Msg>)>>,
    /// The last reason a source failed.
    last: Option<Error>,
    priority: Priority,
    /// Whether the node's room for chunks in flight ran out at the last assignment.
    starved: bool,
    /// The first this many sources serve; the others stand by (see [`Transfer::choose`]).
    first: usize,
    /// The first sources whose lookups are not answered yet.
    unanswered: usize,
    /// Sources with the object standing by.
    standby: Vec<usize>,
    /// Bytes checked, as [`super::ObjectNode::progress`] reports them.
    progress: Counted<'a>,
    /// A piece to receive into could not be had (device memory): the transfer ends.
    broken: Option<Error>,
}

/// A transfer's bytes checked, listed in the node's progress while the transfer lasts.
struct Counted<'a> {
    node: &'a Inner,
    id: ObjectId,
    done: Arc<std::sync::atomic::AtomicU64>,
}

impl<'a> Counted<'a> {
    fn new(node: &'a Inner, id: ObjectId, size: u64) -> Counted<'a> {
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        node.progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, (done.clone(), size));
        Counted { node, id, done }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let mut p = self.node.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if p.get(&self.id).is_some_and(|(d, _)| Arc::ptr_eq(d, &self.done)) {
            p.remove(&self.id);
        }
    }
}

/// The chunks in flight per holder reached over a network: `window`, fewer where they
/// would be over `bytes` together, at least one.
pub(super) fn window_for(window: u32, bytes: u64, chunk: u32) -> u64 {
    u64::from(window).min(bytes / u64::from(chunk).max(1)).max(1)
}

/// A holder's window: `far` ([`window_for`]) in a `relayed` transfer from a holder
/// reached over a network only (`networked`, asked only where `far` is the smaller),
/// else `window`. Over TCP a window's chunks share one connection and arrive together,
/// so a relay can pass none on until the whole window is in: each relay of a broadcast
/// lags a window. A pull from one holder relays nothing; the whole window keeps its
/// connection full (256 MiB over TCP loopback: about 15 % faster with 8 chunks of 4 MiB
/// than with 2).
pub(super) fn window_of(window: u32, far: u64, relayed: bool, networked: impl FnOnce() -> bool) -> u64 {
    let window = u64::from(window);
    if relayed && far < window && networked() {
        far
    } else {
        window
    }
}

impl<'a> Transfer<'a> {
    /// A transfer of an object of `layout` from `holders` (each taking part once it
    /// [`Transfer::join`]s) into `into`: a file, or a buffer of the object's size.
    /// `relayed`: its chunks may pass through relays (see [`window_of`]).
    pub(super) fn new(
        node: &'a Inner,
        id: ObjectId,
        holders: &'a [Endpoint],
        layout: Layout,
        into: Dest,
        priority: Priority,
        relayed: bool,
    ) -> Transfer<'a> {
        let opts = &node.opts;
        let far = window_for(opts.window, opts.network_window, layout.chunk());
        let sources = holders
            .iter()
            .map(|ep| Source {
                ep,
                check: opts.verify.checks(ep),
                window: window_of(opts.window, far, relayed, || !super::without_network(ep)),
                live: None,
                inflight: 0,
            })
            .collect();
        let limit_ms = u32::try_from(node.opts.deadline.as_millis()).unwrap_or(u32::MAX);
        let layout_size = layout.size();
        let layout = Arc::new(layout);
        let sink = match into {
            Dest::File(file) => Sink::file(node, id, file),
            Dest::Memory(buf) => Sink::memory(node, id, layout.clone(), buf),
            Dest::Device(buf) => Sink::device(node, id, buf),
        };
        Transfer {
            node,
            id,
            layout,
            sources,
            sink,
            next: 0,
            again: VecDeque::new(),
            tries: HashMap::new(),
            done: 0,
            limit_ms,
            receiving: FuturesUnordered::new(),
            checking: FuturesUnordered::new(),
            answers: FuturesUnordered::new(),
            last: None,
            priority,
            starved: false,
            first: usize::MAX,
            unanswered: 0,
            standby: Vec::new(),
            progress: Counted::new(node, id, layout_size),
            broken: None,
        }
    }

    /// Lets the first `first` sources serve, the others only once none of those does;
    /// `unanswered` of the first have not answered their lookups yet.
    pub(super) fn choose(&mut self, first: usize, unanswered: usize) {
        (self.first, self.unanswered) = (first, unanswered);
    }

    /// Source `s` has the object: it serves, or stands by.
    pub(super) fn found(&mut self, s: usize) {
        if s < self.first {
            self.join(s);
        } else if !self.standby.contains(&s) {
            self.standby.push(s);
        }
    }

    /// Sends in the sources standing by once none of the first serves or can.
    fn call_standby(&mut self) {
        if self.live() == 0 && self.unanswered == 0 {
            for s in std::mem::take(&mut self.standby) {
                self.join(s);
            }
        }
    }

    /// Whether `layout` (a holder's answer) is this transfer's.
    pub(super) fn same(&self, layout: &Layout) -> bool {
        *self.layout == *layout
    }

    /// Makes holder `s` a source of this transfer.
    pub(super) fn join(&mut self, s: usize) {
        if self.sources[s].live.is_some() {
            return;
        }
        let (req, rx) = self.node.register();
        let (dead, _) = watch::channel(false);
        let ep = self.sources[s].ep;
        let reg = Registered { node: self.node, req };
        self.sources[s].live = Some(Live { reg, dead, ep, outstanding: HashMap::new() });
        tracing::debug!(id = %self.id, source = s, done = self.done, "a holder serves the transfer");
        self.answers.push(Box::pin(async move { (s, rx.await.ok().map(|(m, _): (Msg, AmMessage)| m)) }));
    }

    fn live(&self) -> usize {
        self.sources.iter().filter(|s| s.live.is_some()).count()
    }

    /// Ends source `s`'s part: its receives are abandoned and its chunks go to others.
    fn fail(&mut self, s: usize, why: Error) {
        if let Some(live) = self.sources[s].live.take() {
            let dead = &live.dead;
            self.node.holders_failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(id = %self.id, source = s, %why, "a holder failed; its chunks go to the others");
            dead.send_replace(true);
        }
        self.sources[s].inflight = 0;
        self.last = Some(why);
    }

    /// Runs the transfer to its end, taking further holders' answers from `lookups` as
    /// they come; the object, verified (the caller seals it before it drops the
    /// transfer, so that relays waiting for its chunks find it sealed).
    pub(super) async fn run(
        &mut self,
        mut lookups: FuturesUnordered<Boxed<'a, (usize, Result<Found>)>>,
    ) -> Result<Object> {
        let count = self.layout.count();
        loop {
            if self.done == count {
                if let Some(object) = self.finish().await? {
                    return Ok(object);
                }
                continue;
            }
            self.call_standby();
            let node = self.node;
            // Made before the assignment looks for room, so that no release is missed.
            let freed = node.budget.freed();
            self.assign().await;
            if let Some(e) = self.broken.take() {
                return Err(e);
            }
            if self.live() == 0 && lookups.is_empty() && self.receiving.is_empty() && self.checking.is_empty()
            {
                return Err(self.last.take().unwrap_or_else(|| Error::Remote("every holder failed".into())));
            }
            tokio::select! {
                Some(landed) = self.receiving.next() => self.landed(landed)?,
                Some(checked) = self.checking.next() => self.checked(checked?)?,
                Some((s, answer)) = self.answers.next() => {
                    if self.sources[s].live.is_some() {
                        let why = match answer {
                            Some(Msg::Failed { reason, .. }) => Error::Remote(reason),
                            Some(other) => Error::Protocol(format!("{other:?} during a fetch")),
                            None => Error::Remote("the node is closing".into()),
                        };
                        self.fail(s, why);
                    }
                }
                Some((s, found)) = lookups.next() => {
                    if s < self.first {
                        self.unanswered -= 1;
                    }
                    match found {
                        Ok(Found::Layout(l)) if self.same(&l) => self.found(s),
                        Ok(_) => {}
                        Err(e) => self.last = Some(e),
                    }
                }
                () = freed, if self.starved => {}
            }
        }
    }

    /// Gives each live source chunks up to its window: chunks to fetch again first
    /// (one request each), then new ones (one request for a run).
    async fn assign(&mut self) {
        self.starved = false;
        for s in 0..self.sources.len() {
            let window = self.sources[s].window;
            while self.sources[s].live.is_some() && self.sources[s].inflight < window {
                let free = window - self.sources[s].inflight;
                if let Some(i) =
                    self.again.iter().position(|(_, _, avoid)| *avoid != Some(s) || self.live() == 1)
                {
                    let Some(held) = self.room(self.again[i].0) else { break };
                    let Some((k, piece, _)) = self.again.remove(i) else { break };
                    self.post(s, k, piece, held);
                    self.fetch(s, k, 1).await;
                } else if self.next < self.layout.count()
                    && (free * 2 >= window || self.layout.count() - self.next <= free)
                {
                    let first = self.next;
                    let mut n = 0;
                    while n < free.min(self.layout.count() - first).min(u64::from(crate::wire::MAX_FETCH)) {
                        let k = first + n;
                        let Some(held) = self.room(k) else { break };
                        let piece = match self.sink.piece(self.layout.range(k)) {
                            Ok(p) => p,
                            Err(e) => {
                                self.broken = Some(e);
                                break;
                            }
                        };
                        self.post(s, k, piece, held);
                        n += 1;
                    }
                    if n == 0 {
                        break;
                    }
                    self.next += n;
                    self.fetch(s, first, n).await;
                } else {
                    break;
                }
            }
        }
    }

    /// Room in the node's budget for chunk `k`, or `None` (the transfer then waits for
    /// room given back).
    fn room(&mut self, k: u64) -> Option<Held<'a>> {
        let held = self.node.budget.try_take(self.layout.range(k).len() as u64, self.priority);
        self.starved |= held.is_none();
        held
    }

    /// Posts the receive of chunk `k` from source `s` into `piece`, holding `held` of the
    /// node's room until it ends.
    fn post(&mut self, s: usize, k: u64, piece: Piece, held: Held<'a>) {
        let ep = self.sources[s].ep;
        let Some(live) = &mut self.sources[s].live else { return };
        live.outstanding.insert(k, device::piece_len(&piece));
        let mut dead = live.dead.subscribe();
        let recv = self.node.ns.tag_recv_from(ep, chunk_tag(live.reg.req, k), EXACT, piece);
        self.sources[s].inflight += 1;
        self.receiving.push(Box::pin(async move {
            tokio::select! {
                landed = recv => (s, k, Some(landed), held),
                _ = dead.wait_for(|d| *d) => (s, k, None, held),
            }
        }));
    }

    /// Asks source `s` for chunks `first..first + n`; a source that cannot be asked fails.
    async fn fetch(&mut self, s: usize, first: u64, n: u64) {
        let Some(live) = &self.sources[s].live else { return };
        // Both fit: indexes stay below MAX_CHUNKS.
        let msg = Msg::Fetch {
            req: live.reg.req,
            id: self.id,
            first: first as u32,
            count: n as u32,
            limit_ms: self.limit_ms,
        };
        let opts = AmSendOptions { reply: true, ..Default::default() };
        let (r, _) =
            self.node.ns.am_send_with(self.sources[s].ep, REQUEST, &msg.encode(), Bytes::new(), opts).await;
        if let Err(e) = r {
            self.fail(s, e.into());
        }
    }

    /// A receive ended: checked (and written, into a file) on the blocking pool, holding
    /// its room until then, or (failed, abandoned) given to another source.
    fn landed(&mut self, (s, k, landed, held): Landed<'a>) -> Result<()> {
        let want = self.layout.range(k).len();
        if let Some(live) = &mut self.sources[s].live {
            live.outstanding.remove(&k);
        }
        let Some((r, piece)) = landed else {
            // Abandoned: the transport keeps its piece until UCX lets go of it (a fresh
            // one takes its place; the join then copies).
            self.again.push_back((k, self.sink.fresh(want)?, Some(s)));
            return Ok(());
        };
        if self.sources[s].live.is_some() {
            self.sources[s].inflight -= 1;
        }
        match r {
            Ok(info) if info.len == want => {
                let (file, verify) = (self.sink.target(), self.sources[s].check);
                if !verify && file.is_none() {
                    // Not checked (a holder on this host, see `Verify`), nothing to write.
                    drop(held);
                    return self.checked((s, k, true, piece));
                }
                let layout = self.layout.clone();
                let check = tokio::task::spawn_blocking(move || {
                    sink::check(&layout, k, &piece, verify, file.as_deref()).map(|good| (s, k, good, piece))
                });
                self.checking.push(Box::pin(async move {
                    let checked = check.await.map_err(|e| Error::Store(format!("checking a chunk: {e}")));
                    drop(held);
                    checked?
                }));
            }
            Ok(info) => {
                let why = Error::Protocol(format!("chunk {k} of {} bytes, not {want}", info.len));
                self.fail(s, why);
                self.again.push_back((k, piece, Some(s)));
            }
            Err(e) => {
                let why = match e.kind() {
                    ErrorKind::Truncated => Error::Protocol(format!("chunk {k} longer than its layout")),
                    _ => Error::Transport(e),
                };
                self.fail(s, why);
                self.again.push_back((k, piece, Some(s)));
            }
        }
        Ok(())
    }

    /// A chunk was checked: kept, or fetched again (from another source where there is
    /// one) until the node's tries are spent.
    fn checked(&mut self, (s, k, good, piece): Checked) -> Result<()> {
        if good {
            tracing::trace!(id = %self.id, chunk = k, source = s, "chunk checked");
            self.sink.keep(k, self.layout.range(k).start, piece)?;
            self.done += 1;
            self.progress.done.fetch_add(self.layout.range(k).len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        let t = self.tries.entry(k).or_insert(1);
        if *t >= self.node.opts.tries {
            return Err(Error::Corrupt { id: self.id, chunk: k, tries: *t });
        }
        *t += 1;
        self.node.refetched.fetch_add(1, Ordering::Relaxed);
        self.again.push_back((k, piece, Some(s)));
        Ok(())
    }

    /// The object, its pieces back from the relays; `None` (the caller goes on) when a
    /// relay kept a piece too long: those chunks are fetched again.
    async fn finish(&mut self) -> Result<Option<Object>> {
        match self.sink.finish(&self.layout).await? {
            Finish::Whole(object) => Ok(Some(object)),
            Finish::Missing(chunks) => {
                for k in chunks {
                    let want = self.layout.range(k).len();
                    self.again.push_back((k, self.sink.fresh(want)?, None));
                    self.done -= 1;
                    self.progress.done.fetch_sub(want as u64, Ordering::Relaxed);
                }
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{window_for, window_of};

    #[test]
    fn far_windows_hold_to_their_bytes() {
        let table = [
            // (window, bytes, chunk, chunks in flight)
            (8, 8 << 20, 1 << 20, 8),
            (8, 8 << 20, 4 << 20, 2),
            (8, 8 << 20, 16 << 20, 1),
            (4, 8 << 20, 64 << 10, 4),
            (8, 0, 1 << 20, 1),
            (8, u64::MAX, 4096, 8),
        ];
        for (window, bytes, chunk, want) in table {
            assert_eq!(window_for(window, bytes, chunk), want, "{window} {bytes} {chunk}");
        }
    }

    #[test]
    fn only_relayed_networked_holders_get_the_far_window() {
        let table = [
            // (window, far, relayed, networked, chunks in flight, whether the lanes were asked)
            (8, 2, true, true, 2, true),
            (8, 2, true, false, 8, true),
            (8, 2, false, true, 8, false),
            (4, 4, true, true, 4, false),
            (1, 1, false, false, 1, false),
        ];
        for (window, far, relayed, networked, want, asks) in table {
            let asked = std::cell::Cell::new(false);
            let got = window_of(window, far, relayed, || {
                asked.set(true);
                networked
            });
            assert_eq!((got, asked.get()), (want, asks), "{window} {far} {relayed} {networked}");
        }
    }
}
