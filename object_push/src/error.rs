//! The errors of object operations.

use crate::id::ObjectId;

/// What went wrong with an object operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A malformed call (an id too long, a window of zero chunks).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No holder asked has the object.
    #[error("object {0} is not held by any holder asked")]
    NotFound(ObjectId),
    /// The store already holds an object of this id.
    #[error("object {0} already exists")]
    Exists(ObjectId),
    /// The operation did not end within its deadline.
    #[error("{what} did not end within {limit:?}")]
    DeadlineExceeded {
        /// The operation.
        what: String,
        /// Its deadline.
        limit: std::time::Duration,
    },
    /// Bytes of the object arrived different from what the holder sealed, again on
    /// every try.
    #[error("object {id}: chunk {chunk} arrived corrupt {tries} times")]
    Corrupt {
        /// The object.
        id: ObjectId,
        /// The chunk's index.
        chunk: u64,
        /// How many times it was fetched.
        tries: u32,
    },
    /// A peer sent a message that does not follow the protocol; the transfer ends.
    #[error("malformed message from a peer: {0}")]
    Protocol(String),
    /// The peer refused or failed the request.
    #[error("the peer failed the request: {0}")]
    Remote(String),
    /// The store has no room for the object now; it may later (a transfer waits for
    /// room up to the node's `room_wait`, then fails with this).
    #[error("store: {0}")]
    NoRoom(String),
    /// The store refused the object (larger than the store, an I/O error).
    #[error("store: {0}")]
    Store(String),
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] ucxkit_transport::Error),
}

/// The result of an object operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
