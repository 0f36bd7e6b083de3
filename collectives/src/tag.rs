//! How a collective's messages are tagged inside the collectives namespace (56 bits; see
//! `ucxkit_transport::namespace`), so that concurrent collectives, communicators and
//! steps never match each other's messages:
//!
//! | bits | field | width |
//! |---|---|---|
//! | 55-46 | communicator id | 10 |
//! | 45-30 | sequence number of the call on its communicator (wraps) | 16 |
//! | 29-16 | step of the schedule; [`CONTROL_STEP`] for `shrink`, [`P2P_STEP`] for point-to-point messages | 14 |
//! | 15-0 | source rank | 16 |
//!
//! A receive matches all 56 bits. Point-to-point messages carry the user's tag (16 bits)
//! in place of the sequence number.

/// Communicator ids: 0..MAX_COMMS.
pub const MAX_COMMS: u16 = 1 << 10;
/// Ranks per communicator: 0..MAX_RANKS.
pub const MAX_RANKS: usize = 1 << 16;
/// Steps per schedule: 0..MAX_STEPS (the two values above are [`CONTROL_STEP`] and
/// [`P2P_STEP`]).
pub const MAX_STEPS: usize = (1 << 14) - 2;
/// The step field of the messages of [`crate::Communicator::shrink`] (the sequence
/// field holds its round).
pub const CONTROL_STEP: u16 = (1 << 14) - 2;
/// The step field of point-to-point messages.
pub const P2P_STEP: u16 = (1 << 14) - 1;

/// The tag of the message of step `step` of call `seq` on communicator `comm` from rank
/// `src`. Fields are masked to their widths (callers check the limits).
pub fn tag(comm: u16, seq: u16, step: u16, src: usize) -> u64 {
    (u64::from(comm) & 0x3ff) << 46
        | u64::from(seq) << 30
        | (u64::from(step) & 0x3fff) << 16
        | (src as u64 & 0xffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_stay_in_their_bits() {
        let all = tag(MAX_COMMS - 1, u16::MAX, P2P_STEP, MAX_RANKS - 1);
        assert_eq!(all, (1 << 56) - 1);
        assert_eq!(tag(1, 0, 0, 0), 1 << 46);
        assert_eq!(tag(0, 1, 0, 0), 1 << 30);
        assert_eq!(tag(0, 0, 1, 0), 1 << 16);
        assert_eq!(tag(0, 0, 0, 1), 1);
        assert_ne!(tag(3, 7, 2, 5), tag(3, 7, 5, 2));
    }
}
