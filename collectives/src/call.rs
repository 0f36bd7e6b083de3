//! How a call runs once its operation made its schedule: a small call of one step
//! starts in plain code where it is made or polled (`exec::one`), and ends there when its
//! messages are already in; every other call runs the step loop. One call in
//! [`exec::ready::READY_EVERY`] first exchanges ready messages (`exec::ready`). Either
//! way the call's buffers come back where the transport let go of them ([`Ran`]).

use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::Arc;

use futures_util::future::Either;

use crate::comm::{Communicator, Planned};
use crate::error::{CallResult, Error, Failed};
use crate::exec::{self, one::OneStep, one::Waiting};
use crate::failure::Call;
use crate::schedule::Schedule;
use crate::{Element, ReduceOp};

/// A call's future: its result where the function that made it ended it, else the
/// rest of it, boxed. Either way a few words long, so that returning it costs nothing
/// much: the futures that hold a call's whole state are large, and an 8-byte broadcast
/// that returned one spent a fifth of its instructions copying it.
pub(crate) type CallFuture<T> =
    Either<Ready<CallResult<T>>, Pin<Box<dyn Future<Output = CallResult<T>> + Send>>>;

/// A call that ended (or was refused) when it was made, as its future.
pub(crate) fn ended<T: Element>(r: CallResult<T>) -> CallFuture<T> {
    Either::Left(ready(r))
}

/// How a call stands after [`Communicator::start`].
enum Started<T: Element> {
    /// A small one-step call that ended.
    Ended(Ran<T>),
    /// A small one-step call waiting for its messages, with its data (`None` while lent
    /// to its receive) and its input.
    Waiting(Waiting<T>, Option<Vec<T>>, Vec<T>),
    /// Any other call, not started: its data and input, for the step loop.
    Steps(Vec<T>, Vec<T>),
}

/// A call's buffers after its schedule ran: how it went, and the data and input
/// buffers where the transport let go of them.
pub(crate) struct Ran<T> {
    /// Boxed, as in the calls' results: the error is large, and a result is moved several
    /// times on its way out (at 8 bytes those moves were a tenth of a broadcast's time).
    pub(crate) result: std::result::Result<(), Box<Error>>,
    pub(crate) data: Option<Vec<T>>,
    pub(crate) input: Option<Vec<T>>,
}

impl<T> Ran<T> {
    /// How a one-step call ended (`result`), with its data (`None` where the transport
    /// still holds it) and its input.
    #[inline(always)]
    fn ended(result: crate::error::Result<()>, data: Option<Vec<T>>, input: Vec<T>) -> Ran<T> {
        Ran { result: result.map_err(Box::new), data, input: Some(input) }
    }

    /// The data buffer, or the error with the caller's buffer (the data buffer when
    /// `data_is_callers`, else the input).
    #[inline]
    pub(crate) fn data_back(self, data_is_callers: bool) -> CallResult<T> {
        match (self.result, self.data) {
            (Ok(()), Some(d)) => Ok(d),
            (Ok(()), None) => {
                Err(Failed::new(Error::Internal("the result buffer is still in use".into()), None))
            }
            (Err(e), d) if data_is_callers => Err(Failed::new(*e, d)),
            (Err(e), _) => Err(Failed::new(*e, self.input)),
        }
    }
}

impl Communicator {
    /// Runs `sched` for call `seq` on `data` (written) and `input` (read) under the
    /// communicator's deadline, and gives back both where the transport let go of them.
    /// `fresh`: the data buffer holds values this core just wrote (see
    /// `Bufs::data_just_written`). A small call runs on the vectors themselves
    /// (`exec::small`); others on shared buffers, kept from call to call. A call that
    /// [`exec::ready::due`] names first exchanges ready messages.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn run<T: Element>(
        &self,
        seq: u16,
        sched: &Schedule,
        one: Option<&OneStep>,
        data: Vec<T>,
        input: Vec<T>,
        op: ReduceOp,
        fresh: bool,
    ) -> Ran<T> {
        if exec::ready::due(seq) {
            if let Err(e) = exec::ready::exchange(&self.wire(), seq, sched, self.h.opts.deadline).await {
                return Ran { result: Err(Box::new(e)), data: Some(data), input: Some(input) };
            }
        }
        match self.start(seq, sched, one, data, input, op) {
            Started::Ended(ran) => ran,
            Started::Waiting(mut waiting, mut data, input) => {
                let r = exec::one::finish_one(&self.wire(), sched, &mut waiting, &mut data, op).await;
                Ran::ended(r, data, input)
            }
            Started::Steps(data, input) => self.run_steps(seq, sched, data, input, op, fresh).await,
        }
    }

    /// Starts call `seq` of `sched` on `data` and `input` in plain code where it is a
    /// small call of one step (shape `one`; see [`exec::one::start_one`]): ended, or
    /// waiting for its messages. Other calls are left to the step loop.
    #[inline(always)]
    fn start<T: Element>(
        &self,
        seq: u16,
        sched: &Schedule,
        one: Option<&OneStep>,
        data: Vec<T>,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Started<T> {
        let wire = self.wire();
        let elems = data.len() + input.len() + sched.scratch;
        let Some(one) = one.filter(|_| exec::small::fits(elems, std::mem::size_of::<T>(), wire.segment))
        else {
            return Started::Steps(data, input);
        };
        let mut data = Some(data);
        match exec::one::start_one(&wire, seq, sched, one, &mut data, &input, op, self.h.opts.deadline) {
            Ok(Some(waiting)) => Started::Waiting(waiting, data, input),
            r => Started::Ended(Ran::ended(r.map(|_| ()), data, input)),
        }
    }

    /// [`Communicator::run`] by the step loop (every call but a small one-step one).
    async fn run_steps<T: Element>(
        &self,
        seq: u16,
        sched: &Schedule,
        mut data: Vec<T>,
        input: Vec<T>,
        op: ReduceOp,
        fresh: bool,
    ) -> Ran<T> {
        let wire = self.wire();
        let limit = self.h.opts.deadline;
        let elems = data.len() + input.len() + sched.scratch;
        if exec::small::fits(elems, std::mem::size_of::<T>(), wire.segment) {
            let mut kept = self.take_small();
            let result = exec::small::run(&wire, seq, sched, &mut data, &input, &mut kept, op, limit).await;
            self.keep_small(kept);
            return Ran { result: result.map_err(Box::new), data: Some(data), input: Some(input) };
        }
        let mut bufs = self.bufs(data, input, sched.scratch);
        if fresh {
            bufs.data_just_written();
        }
        // Boxed: a large call's future is large, and every call's future would otherwise
        // carry (and move) its room.
        let result = Box::pin(exec::run(&wire, seq, sched, &mut bufs, op, limit)).await;
        let (data, input) = (bufs.take_data(), bufs.take_input());
        self.keep(bufs);
        Ran { result: result.map_err(Box::new), data, input }
    }

    /// The future of rooted call `call` (a broadcast or a reduce) on `data` as `planned`
    /// says, started now where it can be ([`Communicator::start`]): a small one-step
    /// call (a one-level tree's root or leaf) whose sends UCX takes, or whose message
    /// already arrived, ends here (at 8 bytes the layers of a call's future cost as much
    /// as its messages). The rest of a call goes on in a boxed future, one for each kind
    /// so that a waiting one-step call's stays small. (Calls that exchange, as a 2-rank
    /// allreduce, rarely find their peer's message there when made, and the boxing costs
    /// them more than it saves.) A call that exchanges ready messages first
    /// ([`exec::ready::due`]) runs whole when polled.
    #[inline(always)]
    pub(crate) fn rooted_call<T: Element>(
        &self,
        call: Call<&Communicator>,
        planned: Arc<Planned>,
        data: Vec<T>,
        op: ReduceOp,
    ) -> CallFuture<T> {
        if exec::ready::due(call.seq) {
            let call = call.owned();
            return Either::Right(Box::pin(async move {
                let ran = call
                    .comm
                    .run(call.seq, &planned.sched, planned.one.as_ref(), data, Vec::new(), op, false)
                    .await;
                call.done(ran.data_back(true))
            }));
        }
        match self.start(call.seq, &planned.sched, planned.one.as_ref(), data, Vec::new(), op) {
            Started::Ended(ran) => ended(call.done(ran.data_back(true))),
            Started::Waiting(mut waiting, mut data, input) => {
                let call = call.owned();
                // The block works on what it captured, in place: moved into a nested
                // future as well, the waiting state took twice the room, and the box
                // outgrew the allocator's per-thread cache.
                Either::Right(Box::pin(async move {
                    let wire = call.comm.wire();
                    let r = exec::one::finish_one(&wire, &planned.sched, &mut waiting, &mut data, op).await;
                    call.done(Ran::ended(r, data, input).data_back(true))
                }))
            }
            Started::Steps(data, input) => {
                let call = call.owned();
                Either::Right(Box::pin(async move {
                    let ran = call.comm.run_steps(call.seq, &planned.sched, data, input, op, false).await;
                    call.done(ran.data_back(true))
                }))
            }
        }
    }
}
