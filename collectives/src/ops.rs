//! The collective operations of a [`Communicator`]. Each takes the caller's buffer by
//! value and gives it back (as the result, or inside [`Failed`]); each call takes its
//! sequence number when it is made, so calls made in the same order on every rank match
//! however their futures are polled.

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use ucxkit_transport::tag::EXACT;
use ucxkit_transport::{SharedBuf, SharedSlice};

use crate::comm::Communicator;
use crate::error::{Error, Failed, Result};
use crate::exec::{self, Bufs};
use crate::failure::Outcome;
use crate::plan::{self, Op};
use crate::schedule::{blocks_of, even_blocks, linear, ring, Schedule};
use crate::tag::{tag, P2P_STEP};
use crate::{Element, ReduceOp};

/// How long a point-to-point call that failed waits for the transport to let go of its
/// buffer, to give it back.
const RELEASE_WAIT: Duration = Duration::from_millis(100);

/// An error for a malformed call, with the buffer given back.
fn invalid<T>(buf: Vec<T>, msg: String) -> Failed<T> {
    Failed::new(Error::InvalidArgument(msg), Some(buf))
}

impl Communicator {
    /// A collective call: takes its sequence number now, runs `body` with this
    /// communicator and that number, and ends the call with the result (a failure
    /// aborts the communicator; see [`crate::failure`]).
    fn call<R, F>(
        &self,
        body: impl FnOnce(Communicator, u16) -> F + Send + 'static,
    ) -> impl Future<Output = R> + Send + 'static
    where
        R: Outcome + Send + 'static,
        F: Future<Output = R> + Send + 'static,
    {
        // The sequence number is taken now; the body's future is made where it is
        // awaited, in place, not moved there.
        let call = self.begin();
        async move {
            let r = body(call.comm.clone(), call.seq).await;
            call.done(r)
        }
    }

    /// Runs `sched` on `bufs` under the communicator's deadline.
    async fn execute<T: Element>(
        &self,
        seq: u16,
        sched: &Schedule,
        bufs: &mut Bufs<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let wire = self.wire();
        exec::run(&wire, seq, sched, bufs, op, self.opts.deadline).await
    }

    /// Runs the planned algorithm of `op` in place on `buf` (no input buffer).
    async fn in_place<T: Element>(
        &self,
        seq: u16,
        op: Op,
        root: usize,
        buf: Vec<T>,
        reduce: ReduceOp,
    ) -> Result<Vec<T>, Failed<T>> {
        let elem = std::mem::size_of::<T>();
        let count = buf.len();
        let planned = self.planned(op, count, elem, root);
        let mut bufs = self.bufs(buf, Vec::new(), planned.sched.scratch);
        if op == Op::Allreduce {
            bufs.data_just_written();
        }
        self.finish(seq, &planned.sched, bufs, reduce, true).await
    }

    /// Runs `sched` and gives back the data buffer (on failure: the data buffer when
    /// `data_is_callers`, else the input).
    async fn finish<T: Element>(
        &self,
        seq: u16,
        sched: &Schedule,
        mut bufs: Bufs<T>,
        reduce: ReduceOp,
        data_is_callers: bool,
    ) -> Result<Vec<T>, Failed<T>> {
        // A call on no elements at all moves nothing (every rank knows the sizes): it
        // returns at once, as MPI's do, without a message.
        let nothing = bufs.is_empty();
        let run = if nothing {
            self.aborted().map_or(Ok(()), |a| Err(Error::Aborted(a)))
        } else {
            self.execute(seq, sched, &mut bufs, reduce).await
        };
        let r = match run {
            Ok(()) => bufs.take_data().ok_or_else(|| {
                Failed::new(Error::Internal("the result buffer is still in use".into()), None)
            }),
            Err(e) if data_is_callers => Err(Failed::new(e, bufs.take_data())),
            Err(e) => Err(Failed::new(e, bufs.take_input())),
        };
        self.keep(bufs);
        r
    }

    fn check_reduce<T: Element>(&self, op: ReduceOp) -> Option<String> {
        (!op.applies_to(T::DTYPE)).then(|| format!("{op} does not apply to {}", T::DTYPE))
    }

    fn check_root(&self, root: usize) -> Option<String> {
        (root >= self.size()).then(|| format!("root {root} is outside a group of {}", self.size()))
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
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            if let Some(m) = comm.check_reduce::<T>(op) {
                return Err(invalid(buf, m));
            }
            comm.in_place(seq, Op::Allreduce, 0, buf, op).await
        })
    }

    /// Every rank ends with `root`'s `buf`; every rank passes a buffer of the same length
    /// (what the others' hold is overwritten).
    pub fn broadcast<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            if let Some(m) = comm.check_root(root) {
                return Err(invalid(buf, m));
            }
            comm.in_place(seq, Op::Broadcast, root, buf, ReduceOp::Sum).await
        })
    }

    /// `root` ends with the reduction of all ranks' `buf`; the others get their buffer
    /// back holding a partial result.
    pub fn reduce<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            if let Some(m) = comm.check_reduce::<T>(op).or_else(|| comm.check_root(root)) {
                return Err(invalid(buf, m));
            }
            comm.in_place(seq, Op::Reduce, root, buf, op).await
        })
    }

    /// Every rank ends with all ranks' `buf`s (of the same length) one after the other,
    /// in rank order.
    pub fn allgather<T: Element>(
        &self,
        buf: Vec<T>,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        let counts = vec![buf.len(); self.size()];
        self.allgather_v(buf, counts)
    }

    /// [`Communicator::allgather`] where rank i contributes `counts[i]` elements (this
    /// rank's `buf` holds `counts[rank]`).
    pub fn allgather_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_counts(&counts) {
                return Err(invalid(buf, m));
            }
            if buf.len() != counts[r] {
                let m = format!("this rank's count is {} but it passes {}", counts[r], buf.len());
                return Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let mut data = vec![T::zeroed(); blocks.last().map_or(0, |b| b.end)];
            data[blocks[r].clone()].copy_from_slice(&buf);
            // Equal blocks go by the plan; others by the ring.
            if counts.iter().all(|&c| c == counts[0]) {
                let planned = comm.planned(Op::Allgather, counts[0], std::mem::size_of::<T>(), 0);
                let bufs = comm.bufs(data, buf, planned.sched.scratch);
                return comm.finish(seq, &planned.sched, bufs, ReduceOp::Sum, false).await;
            }
            let sched = ring::allgather(n, r, &blocks);
            comm.finish(seq, &sched, comm.bufs(data, buf, 0), ReduceOp::Sum, false).await
        })
    }

    /// [`Communicator::allgather`] in place: `buf` holds `size()` blocks of equal length,
    /// this rank's (block `rank`) filled in; every block is filled on return. No buffer
    /// is allocated but the two-level form's room to pack hosts' blocks in.
    pub fn allgather_in_place<T: Element>(
        &self,
        buf: Vec<T>,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let n = comm.size();
            if buf.len() % n != 0 {
                let m = format!(
                    "an in-place allgather's buffer holds a multiple of {n} elements, not {}",
                    buf.len()
                );
                return Err(invalid(buf, m));
            }
            let elem = std::mem::size_of::<T>();
            let planned = comm.planned(Op::Allgather, buf.len() / n, elem, 0);
            let bufs = comm.bufs(buf, Vec::new(), planned.sched.scratch);
            comm.finish(seq, &planned.sched, bufs, ReduceOp::Sum, true).await
        })
    }

    /// Reduces all ranks' `buf` (of the same length) and leaves rank i block i of the
    /// result: the length cut into `size()` blocks as evenly as possible, the first
    /// `len % size` one element longer.
    pub fn reduce_scatter<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        let counts = even_blocks(buf.len(), self.size()).iter().map(|b| b.len()).collect();
        self.reduce_scatter_v(buf, counts, op)
    }

    /// [`Communicator::reduce_scatter`] with rank i's block `counts[i]` elements long
    /// (`buf` holds their sum).
    pub fn reduce_scatter_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_reduce::<T>(op).or_else(|| comm.check_counts(&counts)) {
                return Err(invalid(buf, m));
            }
            if counts.iter().sum::<usize>() != buf.len() {
                let m = format!(
                    "the counts add up to {}, the buffer holds {}",
                    counts.iter().sum::<usize>(),
                    buf.len()
                );
                return Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let elem = std::mem::size_of::<T>();
            let even = even_blocks(buf.len(), n) == blocks;
            let alg = if even {
                comm.plan(Op::ReduceScatter, buf.len() / n.max(1) * elem, elem, 0).algorithm
            } else {
                plan::Algorithm::Ring
            };
            let sched = match alg {
                plan::Algorithm::RingBidir => ring::reduce_scatter_bidir(n, r, &blocks),
                _ => ring::reduce_scatter(n, r, &blocks),
            };
            let mut out =
                comm.finish(seq, &sched, comm.bufs(buf, Vec::new(), sched.scratch), op, true).await?;
            // This rank's block to the front, the rest cut off.
            out.copy_within(blocks[r].clone(), 0);
            out.truncate(blocks[r].len());
            Ok(out)
        })
    }

    /// [`Communicator::reduce_scatter`] in place: the whole buffer comes back, with this
    /// rank's block (as `reduce_scatter` cuts them) reduced and the rest holding partial
    /// results. No buffer is allocated or moved.
    pub fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            if let Some(m) = comm.check_reduce::<T>(op) {
                return Err(invalid(buf, m));
            }
            let (n, r) = (comm.size(), comm.rank());
            let elem = std::mem::size_of::<T>();
            let sched_owned;
            let planned;
            let sched = if buf.len() % n == 0 {
                planned = comm.planned(Op::ReduceScatter, buf.len() / n, elem, 0);
                &planned.sched
            } else {
                sched_owned = ring::reduce_scatter(n, r, &even_blocks(buf.len(), n));
                &sched_owned
            };
            let bufs = comm.bufs(buf, Vec::new(), sched.scratch);
            comm.finish(seq, sched, bufs, op, true).await
        })
    }

    /// `root` ends with all ranks' `buf` (of the same length) one after the other; the
    /// others get their buffer back.
    pub fn gather<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        let counts = vec![buf.len(); self.size()];
        self.gather_v(buf, counts, root)
    }

    /// [`Communicator::gather`] where rank i contributes `counts[i]` elements.
    pub fn gather_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_root(root).or_else(|| comm.check_counts(&counts)) {
                return Err(invalid(buf, m));
            }
            if buf.len() != counts[r] {
                let m = format!("this rank's count is {} but it passes {}", counts[r], buf.len());
                return Err(invalid(buf, m));
            }
            let blocks = blocks_of(&counts);
            let sched = linear::gather(n, r, root, &blocks);
            if r != root {
                let mut bufs = comm.bufs(Vec::new(), buf, 0);
                let r = match comm.execute(seq, &sched, &mut bufs, ReduceOp::Sum).await {
                    Ok(()) => bufs.take_input().ok_or_else(|| {
                        Failed::new(Error::Internal("the input is still in use".into()), None)
                    }),
                    Err(e) => Err(Failed::new(e, bufs.take_input())),
                };
                comm.keep(bufs);
                return r;
            }
            let data = vec![T::zeroed(); blocks.last().map_or(0, |b| b.end)];
            comm.finish(seq, &sched, comm.bufs(data, buf, 0), ReduceOp::Sum, false).await
        })
    }

    /// Rank i ends with elements `i * count..(i + 1) * count` of `root`'s `buf` (which
    /// holds `size() * count`); the others' `buf` only lends its allocation.
    pub fn scatter<T: Element>(
        &self,
        buf: Vec<T>,
        count: usize,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        let counts = vec![count; self.size()];
        self.scatter_v(buf, counts, root)
    }

    /// [`Communicator::scatter`] with rank i's part `counts[i]` elements long.
    pub fn scatter_v<T: Element>(
        &self,
        buf: Vec<T>,
        counts: Vec<usize>,
        root: usize,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_root(root).or_else(|| comm.check_counts(&counts)) {
                return Err(invalid(buf, m));
            }
            let total: usize = counts.iter().sum();
            if r == root && buf.len() != total {
                let m = format!("the root's buffer holds {}, the counts add up to {total}", buf.len());
                return Err(invalid(buf, m));
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
            comm.finish(seq, &sched, comm.bufs(data, input, 0), ReduceOp::Sum, r != root).await
        })
    }

    /// Rank r sends block i of its `buf` (`size()` blocks of equal length) to rank i and
    /// ends with block r of every rank's, in rank order.
    pub fn alltoall<T: Element>(
        &self,
        buf: Vec<T>,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        let n = self.size();
        let each = buf.len() / n.max(1);
        let counts = if buf.len() % n.max(1) == 0 { vec![each; n] } else { Vec::new() };
        self.alltoall_v(buf, counts.clone(), counts)
    }

    /// All-to-all with this rank's block for rank i `send_counts[i]` elements long and
    /// the block from rank i `recv_counts[i]` long (each rank's send counts must match
    /// its peers' receive counts).
    pub fn alltoall_v<T: Element>(
        &self,
        buf: Vec<T>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let (n, r) = (comm.size(), comm.rank());
            if let Some(m) = comm.check_counts(&send_counts).or_else(|| comm.check_counts(&recv_counts)) {
                return Err(invalid(
                    buf,
                    format!("{m} (an all-to-all buffer's length must be a multiple of the group's size)"),
                ));
            }
            if send_counts.iter().sum::<usize>() != buf.len() {
                return Err(invalid(buf, "the send counts do not add up to the buffer's length".into()));
            }
            let (send, recv) = (blocks_of(&send_counts), blocks_of(&recv_counts));
            let sched = linear::pairwise_alltoall(n, r, &send, &recv);
            let data = vec![T::zeroed(); recv_counts.iter().sum()];
            comm.finish(seq, &sched, comm.bufs(data, buf, 0), ReduceOp::Sum, false).await
        })
    }

    /// [`Communicator::alltoall`] into `out`, which comes back holding the result (its
    /// allocation reused when large enough), with `buf`: `(result, buf)`. On failure,
    /// [`Failed::output`] holds `out` when it could be given back.
    pub fn alltoall_into<T: Element>(
        &self,
        buf: Vec<T>,
        mut out: Vec<T>,
    ) -> impl Future<Output = Result<(Vec<T>, Vec<T>), Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            let n = comm.size();
            if buf.len() % n != 0 {
                let m = format!("an all-to-all buffer holds a multiple of {n} elements, not {}", buf.len());
                return Err(Failed { output: Some(out), ..invalid(buf, m) });
            }
            out.resize(buf.len(), T::zeroed());
            let planned = comm.planned(Op::Alltoall, buf.len() / n, std::mem::size_of::<T>(), 0);
            let mut bufs = comm.bufs(out, buf, planned.sched.scratch);
            let r = if bufs.is_empty() {
                comm.aborted().map_or(Ok(()), |a| Err(Error::Aborted(a)))
            } else {
                comm.execute(seq, &planned.sched, &mut bufs, ReduceOp::Sum).await
            };
            let (input, output) = (bufs.take_input(), bufs.take_data());
            comm.keep(bufs);
            match (r, output, input) {
                (Ok(()), Some(o), Some(i)) => Ok((o, i)),
                (Ok(()), output, input) => Err(Failed {
                    error: Error::Internal("a buffer is still in use".into()),
                    buf: input,
                    output,
                }),
                (Err(error), output, input) => Err(Failed { error, buf: input, output }),
            }
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        self.call(move |comm, seq| async move {
            // Planned like the others (cached, and forced by options or the variable).
            let planned = comm.planned(Op::Barrier, 0, 1, 0);
            let sched = &planned.sched;
            let mut bufs: Bufs<u8> = comm.bufs(Vec::new(), Vec::new(), 0);
            let r = comm.execute(seq, sched, &mut bufs, ReduceOp::Sum).await;
            comm.keep(bufs);
            r
        })
    }

    /// Rank r ends with the reduction of ranks `0..=r`'s `buf`.
    pub fn scan<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.scan_inner(buf, op, false)
    }

    /// Rank r ends with the reduction of ranks `0..r`'s `buf`; rank 0 gets its buffer
    /// back as it was.
    pub fn exscan<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.scan_inner(buf, op, true)
    }

    fn scan_inner<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
        exclusive: bool,
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
        self.call(move |comm, seq| async move {
            if let Some(m) = comm.check_reduce::<T>(op) {
                return Err(invalid(buf, m));
            }
            let sched = crate::schedule::doubling::scan(comm.size(), comm.rank(), buf.len(), exclusive);
            let bufs = comm.bufs(buf, Vec::new(), sched.scratch);
            comm.finish(seq, &sched, bufs, op, true).await
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
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
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
    ) -> impl Future<Output = Result<Vec<T>, Failed<T>>> + Send + 'static {
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
    ) -> Result<Vec<T>, Failed<T>>
    where
        F: Future<Output = (ucxkit_transport::Result<O>, SharedSlice<T>)>,
    {
        let Some(ep) = self.endpoint(peer) else {
            let m = format!("no rank {peer} to {what} (this is rank {})", self.rank());
            return Err(invalid(buf, m));
        };
        let abort = &self.inner.abort;
        if let Some(a) = abort.get() {
            return Err(Failed::new(Error::Aborted(a), Some(buf)));
        }
        let b = SharedBuf::new(buf);
        let r = {
            let mut transfer = std::pin::pin!(post(&self.inner.ns, ep, b.whole()));
            let mut watch = exec::Watch::new(abort, self.opts.deadline);
            std::future::poll_fn(|cx| {
                if let Poll::Ready((r, slice)) = transfer.as_mut().poll(cx) {
                    drop(slice);
                    return Poll::Ready(Ok(r));
                }
                watch.poll_end(cx).map(Err)
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
