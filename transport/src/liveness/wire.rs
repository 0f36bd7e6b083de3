//! The keepalive lane's datagrams.
//!
//! Layout (little-endian, [`LEN`] bytes):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `0x414b4355` ("UCKA") |
//! | 4 | 1 | version (1) |
//! | 5 | 1 | kind: 1 ping, 2 answer |
//! | 6 | 2 | zero |
//! | 8 | 8 | the answering lane's token (from the handshake) |
//! | 16 | 8 | the pinging endpoint's cookie, echoed in the answer |
//!
//! A lane answers only pings that carry its own token, and an endpoint takes only
//! answers that carry its peer's token and its own cookie, from its peer's address: a
//! sender off the path between the two hosts would have to guess 128 random bits.

const MAGIC: u32 = 0x414b_4355;
const VERSION: u8 = 1;
/// Encoded length.
pub(crate) const LEN: usize = 24;

/// What a datagram asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Ping,
    Answer,
}

/// One keepalive datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Datagram {
    pub(crate) kind: Kind,
    /// The token of the lane that answers.
    pub(crate) token: u64,
    /// The pinging endpoint's cookie.
    pub(crate) cookie: u64,
}

impl Datagram {
    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = match self.kind {
            Kind::Ping => 1,
            Kind::Answer => 2,
        };
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.cookie.to_le_bytes());
        b
    }

    /// The datagram in `b`, or why it is not one.
    pub(crate) fn decode(b: &[u8]) -> Result<Datagram, &'static str> {
        let b: &[u8; LEN] = b.try_into().map_err(|_| "not 24 bytes")?;
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != MAGIC {
            return Err("bad magic");
        }
        if b[4] != VERSION {
            return Err("unknown version");
        }
        if b[6] != 0 || b[7] != 0 {
            return Err("reserved bytes set");
        }
        let kind = match b[5] {
            1 => Kind::Ping,
            2 => Kind::Answer,
            _ => return Err("unknown kind"),
        };
        Ok(Datagram { kind, token: word(8), cookie: word(16) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kinds_round_trip() {
        for kind in [Kind::Ping, Kind::Answer] {
            let d = Datagram { kind, token: 0x0123_4567_89ab_cdef, cookie: u64::MAX - 7 };
            assert_eq!(Datagram::decode(&d.encode()), Ok(d));
        }
    }

    #[test]
    fn anything_else_is_refused_field_by_field() {
        let good = Datagram { kind: Kind::Ping, token: 1, cookie: 2 }.encode();
        for (at, val) in [(0, 0u8), (3, 0), (4, 2), (5, 0), (5, 3), (6, 1), (7, 0x80)] {
            let mut b = good;
            b[at] = val;
            assert!(Datagram::decode(&b).is_err(), "byte {at}={val} accepted");
        }
        assert!(Datagram::decode(&good[..LEN - 1]).is_err());
        assert!(Datagram::decode(&[good.as_slice(), &[0]].concat()).is_err());
        assert!(Datagram::decode(&[]).is_err());
        assert!(Datagram::decode(&[0xff; 64]).is_err());
    }
}
