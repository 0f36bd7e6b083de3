//! The connection handshake's wire format.
//!
//! When the handshake is on, a connecting side sends `Hello` as an active message with
//! the reserved id [`AM_ID`] and the reply flag; the other side answers `Ack` (or `Nack`
//! with a reason) on the reply endpoint. `connect().await` returns only after the `Ack`,
//! so a returned endpoint means the peer is really there; an accepted endpoint is handed
//! out only after its `Hello`.
//!
//! Layout (little-endian, [`LEN`] bytes):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `0x484b4355` ("UCKH") |
//! | 4 | 1 | version: 2 with a keepalive lane, else 1 (without the last two fields) |
//! | 5 | 1 | kind: 1 hello, 2 ack, 3 nack, 4 stream end, 5 close first, 6 closing, 7 closed |
//! | 6 | 1 | error mode: 0 none, 1 peer |
//! | 7 | 1 | nack reason; for a hello, 1 when it follows a listener's front; 0 otherwise |
//! | 8 | 8 | nonce chosen by the connecting side, echoed; for stream end, the total bytes the sender wrote to the stream |
//! | 16 | 36 | sender's process identity |
//! | 52 | 2 | the sender's keepalive port (see [`crate::liveness`]); 0: none |
//! | 54 | 8 | the sender's keepalive token (0 without a port) |
//!
//! After the handshake the same message carries three notices: `StreamEnd`, sent on the
//! endpoint when its stream writer shuts down, so that the peer's reader can report end
//! of stream once it has read every byte written before it; and, for the close of a
//! connection made through a listener (see [`crate::Endpoint::close`]), `CloseFirst`,
//! asking the accepting side to close its end now (sent by the connecting side when it
//! closes, and as its answer to `Closing`), and `Closing`, sent by the accepting side
//! when it closes, so that the connecting side takes in what arrived before the
//! disconnect and answers `CloseFirst`; `Closed`, sent by the side that closes its end
//! on `CloseFirst`, just before it does (the peer's end is done then: UCX does not tell
//! an endpoint made from a worker address that its peer closed). Each goes after
//! everything the sender sent before it on the endpoint, so whoever receives one has
//! everything before it too.
//!
//! A connection made through a listener's front has its hello's nonce set to the
//! connection id the client chose in its request on the front (a random number the
//! listener checks is not in use), and the accepting side answers only once
//! it has taken over the endpoint the hello came through (see [`crate::pairing`]); a
//! hello that came through an endpoint already in use is refused as a collision, and
//! the connecting side tries again.
//!
//! Every field is validated; anything else is rejected with a reason, never trusted.

use crate::identity::{self, ProcessIdentity};
use crate::liveness::KeepaliveAddr;

/// Active-message id reserved for the handshake.
pub const AM_ID: u32 = 4095;

const MAGIC: u32 = 0x484b_4355;
const VERSION: u8 = 2;
/// Encoded length.
pub(crate) const LEN: usize = LEN_V1 + 10;
/// Encoded length of a version 1 message.
const LEN_V1: usize = 16 + identity::ENCODED_LEN;

/// Message kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Hello,
    /// A hello on a connection made through a listener's front: its nonce is the
    /// connection id of its request on the front, and only an accept waiting for that id
    /// answers.
    FrontHello,
    Ack,
    Nack(NackReason),
    /// The sender's stream writer shut down after writing `nonce` bytes.
    StreamEnd,
    /// Close this end now: the sender, which connected, is closing the connection (or
    /// answers [`Kind::Closing`]).
    CloseFirst,
    /// The sender, which accepted, is closing the connection: take in what arrived, and
    /// answer [`Kind::CloseFirst`].
    Closing,
    /// The sender closes its end now, as [`Kind::CloseFirst`] asked.
    Closed,
}

/// Why a hello was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NackReason {
    /// The two sides' error modes differ.
    ErrorModeMismatch,
    /// The hello was not understood.
    Malformed,
    /// The hello came through an endpoint the peer already uses for another connection
    /// between the two workers: connect again.
    Collision,
}

impl NackReason {
    fn code(self) -> u8 {
        match self {
            NackReason::ErrorModeMismatch => 1,
            NackReason::Malformed => 2,
            NackReason::Collision => 3,
        }
    }
    pub(crate) fn describe(self) -> &'static str {
        match self {
            NackReason::ErrorModeMismatch => {
                "the peer uses a different error mode (set the same ErrorMode on both sides)"
            }
            NackReason::Malformed => "the peer could not parse our hello",
            NackReason::Collision => {
                "the connection met another one between the same two workers and lost; connect again"
            }
        }
    }
}

/// One handshake message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Message {
    pub(crate) kind: Kind,
    /// Error handling the sender uses on this connection: true for UCX peer mode.
    pub(crate) peer_mode: bool,
    pub(crate) nonce: u64,
    pub(crate) identity: ProcessIdentity,
    /// The sender worker's keepalive lane, if it has one.
    pub(crate) lane: Option<KeepaliveAddr>,
}

impl Message {
    /// Version 2 with a lane, else version 1, which ucxkit before the keepalive reads.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(LEN);
        v.extend_from_slice(&MAGIC.to_le_bytes());
        v.push(if self.lane.is_some() { VERSION } else { 1 });
        let (kind, reason) = match self.kind {
            Kind::Hello => (1, 0),
            Kind::FrontHello => (1, 1),
            Kind::Ack => (2, 0),
            Kind::Nack(r) => (3, r.code()),
            Kind::StreamEnd => (4, 0),
            Kind::CloseFirst => (5, 0),
            Kind::Closing => (6, 0),
            Kind::Closed => (7, 0),
        };
        v.push(kind);
        v.push(self.peer_mode as u8);
        v.push(reason);
        v.extend_from_slice(&self.nonce.to_le_bytes());
        self.identity.encode(&mut v);
        if let Some(l) = self.lane {
            v.extend_from_slice(&l.port.to_le_bytes());
            v.extend_from_slice(&l.token.to_le_bytes());
        }
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Message, String> {
        if b.len() < 5 {
            return Err(format!("handshake message is {} bytes", b.len()));
        }
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(format!("bad handshake magic {magic:#010x}"));
        }
        let len = match b[4] {
            1 => LEN_V1,
            VERSION => LEN,
            v => return Err(format!("unsupported handshake version {v}")),
        };
        if b.len() != len {
            return Err(format!(
                "handshake message of version {} is {} bytes, expected {len}",
                b[4],
                b.len()
            ));
        }
        let kind = match (b[5], b[7]) {
            (1, 0) => Kind::Hello,
            (1, 1) => Kind::FrontHello,
            (2, 0) => Kind::Ack,
            (3, 1) => Kind::Nack(NackReason::ErrorModeMismatch),
            (3, 2) => Kind::Nack(NackReason::Malformed),
            (4, 0) => Kind::StreamEnd,
            (5, 0) => Kind::CloseFirst,
            (6, 0) => Kind::Closing,
            (7, 0) => Kind::Closed,
            (3, 3) => Kind::Nack(NackReason::Collision),
            (k, r) => return Err(format!("bad handshake kind {k} / reason {r}")),
        };
        let peer_mode = match b[6] {
            0 => false,
            1 => true,
            m => return Err(format!("bad error mode {m} in handshake")),
        };
        let nonce = u64::from_le_bytes(b[8..16].try_into().map_err(|_| "short nonce")?);
        let identity = ProcessIdentity::decode(&b[16..LEN_V1]).ok_or("short identity")?;
        // Version 2: the length checked above holds the lane's port and token.
        let lane = match b.get(LEN_V1..).filter(|_| b[4] == VERSION) {
            Some(l) => {
                let port = u16::from_le_bytes([l[0], l[1]]);
                let token = u64::from_le_bytes(l[2..10].try_into().map_err(|_| "short token")?);
                match (port, token) {
                    (0, 0) => None,
                    (0, _) => return Err("a keepalive token without a port".into()),
                    (port, token) => Some(KeepaliveAddr { port, token }),
                }
            }
            None => None,
        };
        Ok(Message { kind, peer_mode, nonce, identity, lane })
    }
}

/// How many times a connection through a listener is tried again after it collided with
/// another one between the same two workers (see [`crate::pairing`]); the accepting side
/// queues no more hellos than that for one connection.
pub(crate) const MAX_COLLISIONS: u32 = 8;

/// Whether `e` says the peer refused a hello because the connection met another one
/// between the same two workers (the connecting side then tries again).
pub(crate) fn is_collision(e: &crate::error::Error) -> bool {
    matches!(e, crate::error::Error::Handshake { reason, .. } if reason == NackReason::Collision.describe())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kind: Kind) -> Message {
        Message {
            kind,
            peer_mode: true,
            nonce: 0xdead_beef_1234,
            identity: ProcessIdentity::current(),
            lane: Some(KeepaliveAddr { port: 40_000, token: 0x5eed }),
        }
    }

    #[test]
    fn roundtrip_all_kinds() {
        for k in [
            Kind::Hello,
            Kind::FrontHello,
            Kind::Ack,
            Kind::Nack(NackReason::ErrorModeMismatch),
            Kind::Nack(NackReason::Malformed),
            Kind::Nack(NackReason::Collision),
            Kind::StreamEnd,
            Kind::CloseFirst,
            Kind::Closing,
            Kind::Closed,
        ] {
            let m = sample(k);
            let b = m.encode();
            assert_eq!(b.len(), LEN);
            assert_eq!(b[4], 2);
            assert_eq!(Message::decode(&b), Ok(m));
        }
    }

    #[test]
    fn rejects_garbage_field_by_field() {
        let good = sample(Kind::Hello).encode();
        assert!(Message::decode(&good[..LEN - 1]).is_err());
        assert!(Message::decode(&[good.clone(), vec![0]].concat()).is_err());
        for (at, val) in [(0, 0u8), (4, 9), (4, 1), (5, 8), (6, 2), (7, 9)] {
            let mut b = good.clone();
            b[at] = val;
            assert!(Message::decode(&b).is_err(), "byte {at}={val} accepted");
        }
        assert!(Message::decode(&[]).is_err());
        assert!(Message::decode(&[0xff; LEN]).is_err());
        // A token needs a port.
        let mut b = good.clone();
        b[LEN_V1..LEN_V1 + 2].fill(0);
        assert!(Message::decode(&b).is_err());
    }

    /// A message without a lane goes out as version 1 (what an older ucxkit reads) and
    /// reads back the same; a version 2 message without a lane (port and token 0) reads
    /// as one without a lane.
    #[test]
    fn version_1_and_no_lane() {
        let mut m = sample(Kind::Hello);
        m.lane = None;
        let mut v1 = m.encode();
        assert_eq!((v1.len(), v1[4]), (LEN_V1, 1));
        assert_eq!(Message::decode(&v1), Ok(m));
        let mut v2 = v1.clone();
        v2[4] = 2;
        v2.extend_from_slice(&[0; 10]);
        assert_eq!(Message::decode(&v2), Ok(m));
        v1.push(0);
        assert!(Message::decode(&v1).is_err(), "a version 1 message of another length");
    }
}
