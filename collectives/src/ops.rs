//! The collective operations of a [`Communicator`]. Each takes the caller's buffer by
//! value and gives it back (as the result, or inside [`Failed`]); each call takes its
//! sequence number when it is made, so calls made in the same order on every rank match
//! however their futures are polled. How a call runs once it has its schedule is
//! `crate::call`'s: small rooted calls start when they are made.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{SharedBuf, SharedSlice};

use crate::call::ended;
use crate::comm::{Communicator, Planned};
use crate::error::{CallResult, Error, Failed, Result};
use crate::exec::{self, one::OneStep};
use crate::plan::{self, Op};
use crate::schedule::{blocks_of, even_blocks, linear, ring, Schedule};
use crate::tag::{tag, P2P_STEP};
use crate::{Element, ReduceOp};

/// How long a point-to-point call that failed waits for the transport to let go of its
/// buffer, to give it back.
const RELEASE_WAIT: Duration = Duration::from_millis(100);

/// `out`'s elements `block` (within it: a schedule's block of its own buffer), moved to
/// its front, the rest cut off.
fn to_front<T: Element>(mut out: Vec<T>, block: std::ops::Range<usize>) -> Vec<T> {
    out.copy_within(block.clone(), 0);
    out.truncate(block.len());
    out
}

/// A call's schedule: the cached plan's, or one made for the call (`_v` forms, uneven
/// blocks), with its one-step shape where it has one.
enum Sched {
    Planned(Arc<Planned>),
    Made(Schedule, Option<OneStep>),
}

impl Sched {
    fn made(sched: Schedule) -> Sched {
        let one = OneStep::of(&sched);
        Sched::Made(sched, one)
    }

    /// The schedule and its one-step shape, as [`Communicator::run`] takes them.
    fn parts(&self) -> (&Schedule, Option<&OneStep>) {
        match self {
            Sched::Planned(p) => (&p.sched, p.one.as_ref()),
            Sched::Made(s, one) => (s, one.as_ref()),
        }
    }
}

/// An error for a malformed call, with the buffer given back.
fn invalid<T>(buf: Vec<T>, msg: String) -> Box<Failed<T>> {
    Failed::new(Error::InvalidArgument(msg), Some(buf))
}

/// A collective call's future: takes the call's sequence number now, then runs `$body`
/// with `$comm` (the communicator) and `$seq` (that number) and ends the call with the
/// body's result (a failure aborts the communicator; see [`crate::failure`]). The body
/// leaves early with `break $label value`, never with `return` or `?`, which would skip
/// the ending (and abort the communicator as a dropped call). One future, not a body
/// future nested in a call's: a small call costs about as much as moving futures.
macro_rules! collective {
    ($this:expr, $label:lifetime, |$comm:ident, $seq:ident| { $($body:tt)* }) => {{
        let call = $this.begin();
        async move {
            let ($comm, $seq) = (&call.comm, call.seq);
            #[allow(unused_labels)]
            let r = $label: { $($body)* };
            call.done(r)
        }
    }};
}

impl Communicator {
    fn check_reduce<T: Element>(&self, op: ReduceOp) -> Option<String> {
        (!op.applies_to(T::DTYPE)).then(|| format!("{op} does not apply to {}", T::DTYPE))
    }

    #[inline]
    fn check_root(&self, root: usize) -> Option<String> {
        (root >= self.size()).then(|| self.outside_group(root))
    }

    /// The message for a root outside the group (kept out of line: calls pass it).
    #[cold]
    fn outside_group(&self, root: usize) -> String {
        format!("root {root} is outside a group of {}", self.size())
    }

    fn check_counts(&self, counts: &[usize]) -> Option<String> {
        if counts.len() != self.size() {
            return Some(format!("{} counts for a group of {}", counts.len(), self.size()));
        }
        counts
            .iter()
            .try_fold(0usize, |a, &c| a.checked_add(c))
            .is_none()
            .then(|| "the counts add up to more than a buffer can hold".to_string())
    }

    /// Every rank ends with the element-wise reduction of all ranks' `buf` (all of the
    /// same length).
    pub fn allreduce<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            if let Some(m) = comm.check_reduce::<T>(op) {
                break 'call Err(invalid(buf, m));
            }
            let planned = comm.planned(Op::Allreduce, buf.len(), std::mem::size_of::<T>(), 0);
            // The buffer holds what this core just computed, in practice.
            comm.run(seq, &planned.sched, planned.one.as_ref(), buf, Vec::new(), op, true).await.data_back(true)
        })
    }

    /// Every rank ends with `root`'s `buf`; every rank passes a buffer of the same length
    /// (what the others' hold is overwritten).
    pub fn broadcast<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let call = self.begin_here();
        if let Some(m) = self.check_root(root) {
            return ended(call.done(Err(invalid(buf, m))));
        }
        let planned = self.planned(Op::Broadcast, buf.len(), std::mem::size_of::<T>(), root);
        self.rooted_call(call, planned, buf, ReduceOp::Sum)
    }

    /// `root` ends with the reduction of all ranks' `buf`; the others get their buffer
    /// back holding a partial result.
    pub fn reduce<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let call = self.begin_here();
        if let Some(m) = self.check_reduce::<T>(op).or_else(|| self.check_root(root)) {
            return ended(call.done(Err(invalid(buf, m))));
        }
        let planned = self.planned(Op::Reduce, buf.len(), std::mem::size_of::<T>(), root);
        self.rooted_call(call, planned, buf, op)
    }

    /// Every rank ends with all ranks' `buf`s (of the same length) one after the other,
    /// in rank order.
    pub fn allgather<T: Element>(&self, buf: Vec<T>) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let (n, r, count) = (comm.size(), comm.rank(), buf.len());
            let Some(total) = count.checked_mul(n) else {
                break 'call Err(invalid(buf, "the blocks add up to more than a buffer can hold".into()));
            };
            let mut data = vec![T::zeroed(); total];
            data[r * count..(r + 1) * count].copy_from_slice(&buf);
            let planned = comm.planned(Op::Allgather, count, std::mem::size_of::<T>(), 0);
            comm.run(seq, &planned.sched, planned.one.as_ref(), data, buf, ReduceOp::Sum, false).await.data_back(false)
        })
    }

    /// [`Communicator::allgather`] where rank i contributes `counts[i]` elements (this
    /// rank's `buf` holds `counts[rank]`).
    pub fn allgather_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_counts(&counts) {
                break 'call Err(invalid(buf, m));
            }
            if buf.len() != counts[r] {
                let m = format!("this rank's count is {} but it passes {}", counts[r], buf.len());
                break 'call Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let mut data = vec![T::zeroed(); blocks.last().map_or(0, |b| b.end)];
            data[blocks[r].clone()].copy_from_slice(&buf);
            // Equal blocks go by the plan; others by the ring.
            let sched = if counts.iter().all(|&c| c == counts[0]) {
                Sched::Planned(comm.planned(Op::Allgather, counts[0], std::mem::size_of::<T>(), 0))
            } else {
                Sched::made(ring::allgather(n, r, &blocks))
            };
            let (sched, one) = sched.parts();
            comm.run(seq, sched, one, data, buf, ReduceOp::Sum, false).await.data_back(false)
        })
    }

    /// [`Communicator::allgather`] in place: `buf` holds `size()` blocks of equal length,
    /// this rank's (block `rank`) filled in; every block is filled on return. No buffer
    /// is allocated but the two-level form's room to pack hosts' blocks in.
    pub fn allgather_in_place<T: Element>(
        &self,
        buf: Vec<T>,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let n = comm.size();
            if buf.len() % n != 0 {
                let m = format!(
                    "an in-place allgather's buffer holds a multiple of {n} elements, not {}",
                    buf.len()
                );
                break 'call Err(invalid(buf, m));
            }
            let elem = std::mem::size_of::<T>();
            let planned = comm.planned(Op::Allgather, buf.len() / n, elem, 0);
            comm.run(seq, &planned.sched, planned.one.as_ref(), buf, Vec::new(), ReduceOp::Sum, false).await.data_back(true)
        })
    }

    /// Reduces all ranks' `buf` (of the same length) and leaves rank i block i of the
    /// result: the length cut into `size()` blocks as evenly as possible, the first
    /// `len % size` one element longer.
    pub fn reduce_scatter<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            if let Some(m) = comm.check_reduce::<T>(op) {
                break 'call Err(invalid(buf, m));
            }
            let (sched, block) = comm.reduce_scatter_even(buf.len(), std::mem::size_of::<T>());
            let (sched, one) = sched.parts();
            comm.run(seq, sched, one, buf, Vec::new(), op, false).await.data_back(true).map(|out| to_front(out, block))
        })
    }

    /// The schedule of a reduce-scatter of `len` elements of `elem` bytes cut into even
    /// blocks (as [`Communicator::reduce_scatter`] cuts them), and this rank's block: the
    /// cached plan's where the group divides the length, else one made for the call (the
    /// one `reduce_scatter_v` makes for those blocks).
    fn reduce_scatter_even(&self, len: usize, elem: usize) -> (Sched, std::ops::Range<usize>) {
        let (n, r) = (self.size(), self.rank());
        if len % n == 0 {
            let count = len / n;
            (Sched::Planned(self.planned(Op::ReduceScatter, count, elem, 0)), r * count..(r + 1) * count)
        } else {
            let blocks = even_blocks(len, n);
            let block = blocks[r].clone();
            (Sched::made(self.reduce_scatter_sched(&blocks, len, elem)), block)
        }
    }

    /// This rank's schedule of a reduce-scatter of `len` elements of `elem` bytes into
    /// `blocks`: even blocks by the planned algorithm, others by the ring.
    fn reduce_scatter_sched(&self, blocks: &[std::ops::Range<usize>], len: usize, elem: usize) -> Schedule {
        let (n, r) = (self.size(), self.rank());
        let alg = if even_blocks(len, n) == blocks {
            // The cached plan's algorithm (not `plan`, which clones the plan's pricing).
            self.planned(Op::ReduceScatter, len / n.max(1), elem, 0).plan.algorithm
        } else {
            plan::Algorithm::Ring
        };
        match alg {
            plan::Algorithm::RingBidir => ring::reduce_scatter_bidir(n, r, blocks),
            plan::Algorithm::Direct => linear::direct_reduce_scatter(n, r, blocks),
            _ => ring::reduce_scatter(n, r, blocks),
        }
    }

    /// [`Communicator::reduce_scatter`] with rank i's block `counts[i]` elements long
    /// (`buf` holds their sum).
    pub fn reduce_scatter_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let r = comm.rank();
            if let Some(m) = comm.check_reduce::<T>(op).or_else(|| comm.check_counts(&counts)) {
                break 'call Err(invalid(buf, m));
            }
            if counts.iter().sum::<usize>() != buf.len() {
                let m = format!(
                    "the counts add up to {}, the buffer holds {}",
                    counts.iter().sum::<usize>(),
                    buf.len()
                );
                break 'call Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let sched = comm.reduce_scatter_sched(&blocks, buf.len(), std::mem::size_of::<T>());
            let block = blocks[r].clone();
            comm.run(seq, &sched, OneStep::of(&sched).as_ref(), buf, Vec::new(), op, false).await.data_back(true).map(|out| to_front(out, block))
        })
    }

    /// [`Communicator::reduce_scatter`] in place: the whole buffer comes back, with this
    /// rank's block (as `reduce_scatter` cuts them) reduced and the rest holding partial
    /// results. No buffer is allocated or moved.
    pub fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            if let Some(m) = comm.check_reduce::<T>(op) {
                break 'call Err(invalid(buf, m));
            }
            // The same schedule as `reduce_scatter`'s, the buffer given back whole.
            let (sched, _) = comm.reduce_scatter_even(buf.len(), std::mem::size_of::<T>());
            let (sched, one) = sched.parts();
            comm.run(seq, sched, one, buf, Vec::new(), op, false).await.data_back(true)
        })
    }

    /// `root` ends with all ranks' `buf` (of the same length) one after the other; the
    /// others get their buffer back.
    pub fn gather<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let counts = vec![buf.len(); self.size()];
        self.gather_v(buf, counts, root)
    }

    /// [`Communicator::gather`] where rank i contributes `counts[i]` elements.
    pub fn gather_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_root(root).or_else(|| comm.check_counts(&counts)) {
                break 'call Err(invalid(buf, m));
            }
            if buf.len() != counts[r] {
                let m = format!("this rank's count is {} but it passes {}", counts[r], buf.len());
                break 'call Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let sched = linear::gather(n, r, root, &blocks);
            if r != root {
                let ran = comm.run(seq, &sched, OneStep::of(&sched).as_ref(), Vec::new(), buf, ReduceOp::Sum, false).await;
                break 'call match (ran.result, ran.input) {
                    (Ok(()), Some(i)) => Ok(i),
                    (Ok(()), None) => Err(Failed::new(Error::Internal("the input is still in use".into()), None)),
                    (Err(e), i) => Err(Failed::new(*e, i)),
                };
            }
            let data = vec![T::zeroed(); blocks.last().map_or(0, |b| b.end)];
            comm.run(seq, &sched, OneStep::of(&sched).as_ref(), data, buf, ReduceOp::Sum, false).await.data_back(false)
        })
    }

    /// Rank i ends with elements `i * count..(i + 1) * count` of `root`'s `buf` (which
    /// holds `size() * count`); the others' `buf` only lends its allocation.
    pub fn scatter<T: Element>(
        &self,
        buf: Vec<T>,
        count: usize,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let counts = vec![count; self.size()];
        self.scatter_v(buf, counts, root)
    }

    /// [`Communicator::scatter`] with rank i's part `counts[i]` elements long.
    pub fn scatter_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        root: usize,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_root(root).or_else(|| comm.check_counts(&counts)) {
                break 'call Err(invalid(buf, m));
            }
            let total: usize = counts.iter().sum();
            if r == root && buf.len() != total {
                let m = format!("the root's buffer holds {}, the counts add up to {total}", buf.len());
                break 'call Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let sched = linear::scatter(n, r, root, &blocks);
            let (data, input) = if r == root {
                (vec![T::zeroed(); counts[r]], buf)
            } else {
                let mut b = buf;
                b.clear();
                b.resize(counts[r], T::zeroed());
                (b, Vec::new())
            };
            comm.run(seq, &sched, OneStep::of(&sched).as_ref(), data, input, ReduceOp::Sum, false).await.data_back(r != root)
        })
    }

    /// Rank r sends block i of its `buf` (`size()` blocks of equal length) to rank i and
    /// ends with block r of every rank's, in rank order.
    pub fn alltoall<T: Element>(&self, buf: Vec<T>) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let call = self.alltoall_into(buf, Vec::new());
        async move { call.await.map(|(out, _)| out).map_err(|f| Box::new(Failed { output: None, ..*f })) }
    }

    /// All-to-all with this rank's block for rank i `send_counts[i]` elements long and
    /// the block from rank i `recv_counts[i]` long (each rank's send counts must match
    /// its peers' receive counts).
    pub fn alltoall_v<T: Element>(
        &self,
        buf: Vec<T>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_counts(&send_counts).or_else(|| comm.check_counts(&recv_counts)) {
                break 'call Err(invalid(
                    buf,
                    format!("{m} (an all-to-all buffer's length must be a multiple of the group's size)"),
                ));
            }
            if send_counts.iter().sum::<usize>() != buf.len() {
                break 'call Err(invalid(buf, "the send counts do not add up to the buffer's length".into()));
            }
            let (send, recv) = (blocks_of(&send_counts), blocks_of(&recv_counts));
            // Every block at once (see `linear::direct_alltoall`).
            let sched = linear::direct_alltoall(n, r, &send, &recv);
            let data = vec![T::zeroed(); recv_counts.iter().sum()];
            comm.run(seq, &sched, OneStep::of(&sched).as_ref(), data, buf, ReduceOp::Sum, false).await.data_back(false)
        })
    }

    /// [`Communicator::alltoall`] into `out`, which comes back holding the result (its
    /// allocation reused when large enough), with `buf`: `(result, buf)`. On failure,
    /// [`Failed::output`] holds `out` when it could be given back.
    pub fn alltoall_into<T: Element>(
        &self,
        buf: Vec<T>,
        mut out: Vec<T>,
    ) -> impl Future<Output = CallResult<T, (Vec<T>, Vec<T>)>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            let n = comm.size();
            if buf.len() % n != 0 {
                let m = format!("an all-to-all buffer holds a multiple of {n} elements, not {}", buf.len());
                break 'call Err(Box::new(Failed { output: Some(out), ..*invalid(buf, m) }));
            }
            out.resize(buf.len(), T::zeroed());
            let planned = comm.planned(Op::Alltoall, buf.len() / n, std::mem::size_of::<T>(), 0);
            let ran = comm.run(seq, &planned.sched, planned.one.as_ref(), out, buf, ReduceOp::Sum, false).await;
            match (ran.result, ran.data, ran.input) {
                (Ok(()), Some(o), Some(i)) => Ok((o, i)),
                (Ok(()), output, input) => Err(Box::new(Failed {
                    error: Error::Internal("a buffer is still in use".into()),
                    buf: input,
                    output,
                })),
                (Err(error), output, input) => Err(Box::new(Failed { error: *error, buf: input, output })),
            }
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            // Planned like the others (cached, and forced by options or the variable).
            let planned = comm.planned(Op::Barrier, 0, 1, 0);
            comm.run::<u8>(seq, &planned.sched, planned.one.as_ref(), Vec::new(), Vec::new(), ReduceOp::Sum, false).await.result.map_err(|e| *e)
        })
    }

    /// Rank r ends with the reduction of ranks `0..=r`'s `buf`.
    pub fn scan<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        self.scan_inner(buf, op, false)
    }

    /// Rank r ends with the reduction of ranks `0..r`'s `buf`; rank 0 gets its buffer
    /// back as it was.
    pub fn exscan<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        self.scan_inner(buf, op, true)
    }

    fn scan_inner<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
        exclusive: bool,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        collective!(self, 'call, |comm, seq| {
            if let Some(m) = comm.check_reduce::<T>(op) {
                break 'call Err(invalid(buf, m));
            }
            let sched = crate::schedule::doubling::scan(comm.size(), comm.rank(), buf.len(), exclusive);
            comm.run(seq, &sched, OneStep::of(&sched).as_ref(), buf, Vec::new(), op, false).await.data_back(true)
        })
    }

    /// Sends `buf` to rank `peer` with `tag` (point to point, matched by
    /// [`Communicator::recv`] on `peer` with this rank and the same tag, in order).
    /// Not a collective: a failure does not abort the communicator, but an aborted
    /// communicator fails it ([`Error::Aborted`]), and so does the handle's deadline
    /// ([`Error::DeadlineExceeded`]); the buffer comes back unless the transport still
    /// holds it after that (a send UCX has not finished). A send given up that way is
    /// not canceled and may still arrive: a retry can deliver the message twice.
    pub fn send<T: Element>(
        &self,
        buf: Vec<T>,
        peer: usize,
        tag_: u16,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let comm = self.clone();
        async move {
            let t = tag(comm.id(), tag_, P2P_STEP, comm.rank());
            comm.p2p(buf, peer, "send to", |ns, ep, b| ns.tag_send(ep, t, b), |()| Ok(())).await
        }
    }

    /// Receives into `buf` (exactly its length) what rank `peer` sends with `tag`. Ends
    /// on an abort of the communicator and at the handle's deadline as
    /// [`Communicator::send`] does (a receive given up is canceled).
    pub fn recv<T: Element>(
        &self,
        buf: Vec<T>,
        peer: usize,
        tag_: u16,
    ) -> impl Future<Output = CallResult<T>> + Send + 'static {
        let comm = self.clone();
        async move {
            let want = std::mem::size_of_val(&buf[..]);
            let t = tag(comm.id(), tag_, P2P_STEP, peer);
            let exact = move |info: ucxkit_transport::TagInfo| match info.len {
                n if n == want => Ok(()),
                n => Err(Error::Mismatch { rank: peer, got: Some(n), want }),
            };
            comm.p2p(buf, peer, "receive from", |ns, ep, b| ns.tag_recv_from(ep, t, EXACT, b), exact).await
        }
    }

    /// A point-to-point transfer of `buf` with rank `peer`: `post` starts it on the
    /// whole buffer, `check` judges what it reported; the buffer comes back either way.
    async fn p2p<T: Element, O, F>(
        &self,
        buf: Vec<T>,
        peer: usize,
        what: &str,
        post: impl FnOnce(&ucxkit_transport::Namespace, &ucxkit_transport::Endpoint, SharedSlice<T>) -> F,
        check: impl FnOnce(O) -> Result<()>,
    ) -> CallResult<T>
    where
        F: Future<Output = (ucxkit_transport::Result<O>, SharedSlice<T>)>,
    {
        let Some(ep) = self.endpoint(peer) else {
            let m = format!("no rank {peer} to {what} (this is rank {})", self.rank());
            return Err(invalid(buf, m));
        };
        let abort = &self.h.inner.abort;
        if let Some(a) = abort.get() {
            return Err(Failed::new(Error::Aborted(a), Some(buf)));
        }
        let b = SharedBuf::new(buf);
        let r = {
            let mut transfer = std::pin::pin!(post(&self.h.inner.ns, ep, b.whole()));
            let mut watch = exec::Watch::new(abort, self.h.opts.deadline);
            std::future::poll_fn(|cx| {
                if let Poll::Ready((r, slice)) = transfer.as_mut().poll(cx) {
                    drop(slice);
                    return Poll::Ready(Ok(r));
                }
                watch.poll_end(cx, || [peer]).map(Err)
            })
            .await
        };
        let r = match r {
            Ok(Ok(o)) => check(o),
            Ok(Err(ucxkit_transport::Error::Truncated { .. })) => {
                Err(Error::Mismatch { rank: peer, got: None, want: b.len() * std::mem::size_of::<T>() })
            }
            Ok(Err(source)) => Err(Error::Transport { rank: peer, source }),
            Err(e) => Err(e),
        };
        // A transfer given up (dropped above) lets go of the buffer once UCX has
        // canceled or finished it, normally at the worker's next progress call.
        if r.is_err() && b.in_use() {
            let _ = tokio::time::timeout(RELEASE_WAIT, async {
                while b.in_use() {
                    tokio::time::sleep(Duration::from_micros(100)).await;
                }
            })
            .await;
        }
        match (r, b.try_into_vec().ok()) {
            (Ok(()), Some(v)) => Ok(v),
            (Ok(()), None) => Err(Failed::new(Error::Internal("the buffer is still in use".into()), None)),
            (Err(e), v) => Err(Failed::new(e, v)),
        }
    }
}
