//! Errors of collective operations, and [`Failed`], which gives the caller's buffer back
//! with the error whenever it can.

use std::time::Duration;

/// Why a collective (or forming a communicator) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The call was malformed (lengths that do not fit the world size, a root out of
    /// range, a bitwise reduction of floats); nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The transport failed (a peer's endpoint reset, a message of the wrong size).
    #[error("rank {rank}: {source}")]
    Transport {
        /// The rank the failed operation talked to.
        rank: usize,
        /// What the transport reported.
        #[source]
        source: ucxkit_transport::Error,
    },
    /// A message from a peer did not have the length the schedule expects: the ranks
    /// called different collectives, or with different sizes.
    #[error(
        "rank {rank} sent {} where {want} bytes were expected (do all ranks call the same collective with the same sizes?)",
        .got.map_or_else(|| "more".to_string(), |g| format!("{g} bytes"))
    )]
    Mismatch {
        /// The sending rank.
        rank: usize,
        /// Bytes received (None: more than expected).
        got: Option<usize>,
        /// Bytes expected.
        want: usize,
    },
    /// A peer's message broke the collectives' protocol (malformed, or out of order).
    #[error("rank {rank} broke the protocol: {reason}")]
    Protocol {
        /// The sending rank.
        rank: usize,
        /// What was wrong.
        reason: String,
    },
    /// The communicator was aborted: a collective failed on some rank (see
    /// [`crate::abort`]). Every later call on it fails the same way; make a new one of
    /// the live ranks with [`crate::Communicator::shrink`].
    #[error("{}", describe(.0))]
    Aborted(crate::abort::Abort),
    /// The call's deadline passed before it finished, with transfers to or from
    /// `waiting_on` still pending (empty where the call waited on no rank in particular).
    #[error("the collective did not finish within {after:?}{}", still_waiting(waiting_on))]
    DeadlineExceeded {
        /// The deadline.
        after: Duration,
        /// The ranks the call was still waiting on, in order.
        waiting_on: Vec<usize>,
    },
    /// A broken invariant of this crate (a bug): reported rather than panicking.
    #[error("internal error: {0}")]
    Internal(String),
    /// Forming the group failed.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// Copying a device buffer to or from host memory failed (feature `cuda`).
    #[error("device: {0}")]
    Device(#[source] ucxkit_transport::Error),
}

fn still_waiting(ranks: &[usize]) -> String {
    match ranks {
        [] => String::new(),
        [r] => format!(", still waiting on rank {r}"),
        _ => {
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!(", still waiting on ranks {}", list.join(", "))
        }
    }
}

fn describe(a: &crate::abort::Abort) -> String {
    match a.failed {
        Some(f) => {
            format!("the communicator was aborted: rank {f} failed (seen by rank {}): {}", a.by, a.reason)
        }
        None => format!("the communicator was aborted by rank {}: {}", a.by, a.reason),
    }
}

impl Error {
    /// The rank this error is about, when it is about one.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::Transport { rank, .. } | Error::Mismatch { rank, .. } | Error::Protocol { rank, .. } => {
                Some(*rank)
            }
            Error::Aborted(a) => a.failed,
            _ => None,
        }
    }
}

/// Result of this crate's calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a collective call that takes buffers of `T` gives back: its result `V` (the
/// buffer), or what failed, boxed (it is large, and a result is moved several times on
/// its way to the caller).
pub type CallResult<T, V = Vec<T>> = std::result::Result<V, Box<Failed<T>>>;

/// A failed collective: the error, and the caller's buffer when it could be given back
/// (always for [`Error::InvalidArgument`]; after a failure in flight only once the
/// transport released every part of it, else it is kept until the transport does, and
/// then freed).
#[derive(Debug)]
pub struct Failed<T> {
    /// What went wrong.
    pub error: Error,
    /// The buffer, when it could be given back (for the calls that take two, the input).
    pub buf: Option<Vec<T>>,
    /// The output buffer of the calls that take one (`*_into`), when it could be given
    /// back.
    pub output: Option<Vec<T>>,
}

impl<T> Failed<T> {
    pub(crate) fn new(error: Error, buf: Option<Vec<T>>) -> Box<Failed<T>> {
        Box::new(Failed { error, buf, output: None })
    }
}

impl<T: std::fmt::Debug> std::fmt::Display for Failed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T: std::fmt::Debug> std::error::Error for Failed<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<Failed<T>> for Error {
    fn from(f: Failed<T>) -> Error {
        f.error
    }
}

impl<T> From<Box<Failed<T>>> for Error {
    fn from(f: Box<Failed<T>>) -> Error {
        f.error
    }
}
