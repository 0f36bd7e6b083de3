//! How a collective's messages are tagged inside the collectives namespace (56 bits; see
//! `ucxkit_transport::namespace`), so that concurrent collectives, communicators and
//! steps never match each other's messages:
//!
//! | bits | field | width |
//! |---|---|---|
//! | 55-46 | communicator id | 10 |
//! | 45-30 | sequence number of the call on its communicator (wraps) | 16 |
//! | 29-16 | step of the schedule; [`CONTROL_STEP`] for `shrink`, [`P2P_STEP`] for point-to-point messages | 14 |
//! | 15-14 | what the message carries ([`Kind`]): data, a ready word, or a shared-memory lane's note or credit | 2 |
//! | 13-0 | source rank | 14 |
//!
//! A receive matches all 56 bits. Point-to-point messages carry the user's tag (16 bits)
//! in place of the sequence number.

/// Communicator ids: 0..MAX_COMMS.
pub const MAX_COMMS: u16 = 1 << 10;
/// Ranks per communicator: 0..MAX_RANKS.
pub const MAX_RANKS: usize = 1 << 14;
/// Steps per schedule: 0..MAX_STEPS (the two values above are [`CONTROL_STEP`] and
/// [`P2P_STEP`]).
pub const MAX_STEPS: usize = (1 << 14) - 2;
/// The step field of the messages of [`crate::Communicator::shrink`] (the sequence
/// field holds its round).
pub const CONTROL_STEP: u16 = (1 << 14) - 2;
/// The step field of point-to-point messages.
pub const P2P_STEP: u16 = (1 << 14) - 1;

/// What a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A transfer's bytes (every message but a lane's).
    Data = 0,
    /// A rank's word that it came to a call, to a peer that sends to it one way
    /// (empty; see `exec::ready`).
    Ready = 1,
    /// A shared-memory lane's note to the receiver: where the next piece lies.
    Note = 2,
    /// A shared-memory lane's credit to the sender: a piece was taken.
    Credit = 3,
}

/// The tag of the message of step `step` of call `seq` on communicator `comm` from rank
/// `src`. Fields are masked to their widths (callers check the limits).
#[inline]
pub fn tag(comm: u16, seq: u16, step: u16, src: usize) -> u64 {
    kind_tag(comm, seq, step, src, Kind::Data)
}

/// [`tag`] for a message of kind `kind`.
#[inline]
pub fn kind_tag(comm: u16, seq: u16, step: u16, src: usize, kind: Kind) -> u64 {
    comm_tag(comm)
        | u64::from(seq) << 30
        | (u64::from(step) & 0x3fff) << 16
        | u64::from(kind as u8) << 14
        | (src as u64 & 0x3fff)
}

/// The bits of a tag that hold the communicator id: with [`comm_tag`], every message of
/// one communicator.
pub const COMM_MASK: u64 = 0x3ff << 46;

/// The communicator id field of `comm`'s tags, the other fields 0.
#[inline]
pub fn comm_tag(comm: u16) -> u64 {
    (u64::from(comm) << 46) & COMM_MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_stay_in_their_bits() {
        let all = kind_tag(MAX_COMMS - 1, u16::MAX, P2P_STEP, MAX_RANKS - 1, Kind::Credit);
        assert_eq!(all, (1 << 56) - 1);
        assert_eq!(tag(0, 0, 0, MAX_RANKS), 0, "the rank stays out of the kind");
        let kinds = [Kind::Data, Kind::Note, Kind::Credit, Kind::Ready].map(|k| kind_tag(3, 7, 2, 5, k));
        let distinct: std::collections::HashSet<u64> = kinds.iter().copied().collect();
        assert_eq!(distinct.len(), kinds.len());
        assert_eq!(kinds[2] - kinds[0], 3 << 14);
        assert_eq!(tag(1, 0, 0, 0), 1 << 46);
        assert_eq!(tag(0, 1, 0, 0), 1 << 30);
        assert_eq!(tag(0, 0, 1, 0), 1 << 16);
        assert_eq!(tag(0, 0, 0, 1), 1);
        assert_ne!(tag(3, 7, 2, 5), tag(3, 7, 5, 2));
        let every = kind_tag(5, u16::MAX, P2P_STEP, MAX_RANKS - 1, Kind::Credit);
        assert_eq!(every & COMM_MASK, comm_tag(5), "a communicator's messages share its field");
        assert_ne!(tag(6, 0, 0, 0) & COMM_MASK, comm_tag(5));
        assert_eq!(comm_tag(MAX_COMMS - 1), COMM_MASK);
    }
}
