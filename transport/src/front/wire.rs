//! The listener front's wire format: length-prefixed frames over TCP, each one message,
//! versioned and validated field by field before anything acts on it.
//!
//! A frame is a little-endian `u32` body length (at most [`MAX_FRAME`]) and the body;
//! on an authenticated connection, after the proofs, a [`crate::auth::MAC_LEN`]-byte
//! tag follows each body. Every body starts with:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `0x464b4355` ("UCKF") |
//! | 4 | 1 | version (2) |
//! | 5 | 1 | kind (below) |
//!
//! | kind | message | fields after the kind |
//! |---|---|---|
//! | 1 | client hello | nonce (32), flags (1: bit 0, the client has a secret) |
//! | 2 | server hello | nonce (32), flags (1: bit 0, the server needs a secret) |
//! | 3 | proof | HMAC-SHA256 (32) |
//! | 4 | request | connection id (8), identity (36), worker uuid (8), flags (1: bit 0, shared memory; bit 1, UCX's connection manager), error mode (1), payload length (2: at most [`crate::MAX_CONNECT_PAYLOAD`]), payload |
//! | 5 | accept | identity (36), worker uuid (8), flags (1: bit 0, shared memory), peer mode (1: 0 or 1), connection-manager port (2: 0, none), address length (4), UCX worker address |
//! | 6 | reject | reason (1), text length (2), text (UTF-8) |
//! | 7 | abort | text length (2), text (UTF-8) |
//!
//! Error modes on the wire: 0 [`crate::ErrorMode::Auto`], 1 `Peer`, 2 `None`. Nothing
//! else is accepted: unknown kinds, flags, lengths that disagree with the body, trailing
//! bytes, text that is not UTF-8.

use crate::identity::{self, ProcessIdentity};
use crate::worker::ErrorMode;

use crate::auth::{MAC_LEN, NONCE_LEN};

pub(crate) const MAGIC: u32 = 0x464b_4355;
pub(crate) const VERSION: u8 = 2;
/// The largest frame body either side reads.
pub(crate) const MAX_FRAME: usize = 64 * 1024;
/// The longest text in a reject or abort.
const MAX_TEXT: usize = 512;
const HEADER: usize = 6;

/// One message of the front's protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    ClientHello { nonce: [u8; NONCE_LEN], has_secret: bool },
    ServerHello { nonce: [u8; NONCE_LEN], needs_secret: bool },
    Proof { tag: [u8; MAC_LEN] },
    Request(Request),
    Accept(Accept),
    Reject { reason: Reason, text: String },
    Abort { text: String },
}

/// The client's request to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// Names the connection in the UCX handshake that follows (its nonce).
    pub(crate) conn: u64,
    pub(crate) identity: ProcessIdentity,
    /// The client worker's UCX uuid (from its worker address).
    pub(crate) uuid: u64,
    pub(crate) shared_memory: bool,
    /// The client's context can connect through UCX's connection manager (tcp).
    pub(crate) connection_manager: bool,
    pub(crate) error_mode: ErrorMode,
    /// The application's connect payload (see [`crate::EndpointOptions::connect_payload`]).
    pub(crate) payload: Vec<u8>,
}

/// The server's answer when its application accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Accept {
    pub(crate) identity: ProcessIdentity,
    pub(crate) uuid: u64,
    pub(crate) shared_memory: bool,
    /// The error mode both sides use: UCX's peer mode, or none.
    pub(crate) peer_mode: bool,
    /// Nonzero: connect through UCX's connection manager to this port, on the address
    /// the client reached the listener at (see [`crate::front::server`]); zero: from
    /// the worker address.
    pub(crate) cm_port: u16,
    /// The server worker's address, in UCX's own form.
    pub(crate) address: Vec<u8>,
}

/// Why a server refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The application rejected the request, or dropped it unanswered.
    Rejected,
    /// Too many requests wait for the application already.
    Busy,
    /// The two sides asked for different error modes.
    ErrorMode,
    /// A secret is needed and the client's proof was wrong or missing.
    Authentication,
    /// The client broke the protocol.
    Protocol,
    /// The listener is gone.
    Closed,
    /// The client is the listener's own worker.
    SameWorker,
}

impl Reason {
    fn code(self) -> u8 {
        match self {
            Reason::Rejected => 1,
            Reason::Busy => 2,
            Reason::ErrorMode => 3,
            Reason::Authentication => 4,
            Reason::Protocol => 5,
            Reason::Closed => 6,
            Reason::SameWorker => 7,
        }
    }

    fn from_code(c: u8) -> Option<Reason> {
        Some(match c {
            1 => Reason::Rejected,
            2 => Reason::Busy,
            3 => Reason::ErrorMode,
            4 => Reason::Authentication,
            5 => Reason::Protocol,
            6 => Reason::Closed,
            7 => Reason::SameWorker,
            _ => return None,
        })
    }
}

fn mode_code(m: ErrorMode) -> u8 {
    match m {
        ErrorMode::Auto => 0,
        ErrorMode::Peer => 1,
        ErrorMode::None => 2,
    }
}

fn mode_from(c: u8) -> Option<ErrorMode> {
    Some(match c {
        0 => ErrorMode::Auto,
        1 => ErrorMode::Peer,
        2 => ErrorMode::None,
        _ => return None,
    })
}

/// Clips `text` to [`MAX_TEXT`] bytes at a character boundary.
fn clip(text: &str) -> &str {
    if text.len() <= MAX_TEXT {
        return text;
    }
    let mut end = MAX_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Msg {
    /// The frame body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&MAGIC.to_le_bytes());
        v.push(VERSION);
        match self {
            Msg::ClientHello { nonce, has_secret } => {
                v.push(1);
                v.extend_from_slice(nonce);
                v.push(*has_secret as u8);
            }
            Msg::ServerHello { nonce, needs_secret } => {
                v.push(2);
                v.extend_from_slice(nonce);
                v.push(*needs_secret as u8);
            }
            Msg::Proof { tag } => {
                v.push(3);
                v.extend_from_slice(tag);
            }
            Msg::Request(r) => {
                v.push(4);
                v.extend_from_slice(&r.conn.to_le_bytes());
                r.identity.encode(&mut v);
                v.extend_from_slice(&r.uuid.to_le_bytes());
                v.push(r.shared_memory as u8 | (r.connection_manager as u8) << 1);
                v.push(mode_code(r.error_mode));
                v.extend_from_slice(&(r.payload.len() as u16).to_le_bytes());
                v.extend_from_slice(&r.payload);
            }
            Msg::Accept(a) => {
                v.push(5);
                a.identity.encode(&mut v);
                v.extend_from_slice(&a.uuid.to_le_bytes());
                v.push(a.shared_memory as u8);
                v.push(a.peer_mode as u8);
                v.extend_from_slice(&a.cm_port.to_le_bytes());
                v.extend_from_slice(&(a.address.len() as u32).to_le_bytes());
                v.extend_from_slice(&a.address);
            }
            Msg::Reject { reason, text } => {
                v.push(6);
                v.push(reason.code());
                put_text(&mut v, text);
            }
            Msg::Abort { text } => {
                v.push(7);
                put_text(&mut v, text);
            }
        }
        v
    }

    /// Parses a frame body; every field is checked, nothing may follow the message.
    pub(crate) fn decode(b: &[u8]) -> Result<Msg, String> {
        let mut r = Reader { b, at: 0 };
        let magic = r.u32()?;
        if magic != MAGIC {
            return Err(format!("not a ucxkit front message (magic {magic:#010x})"));
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(format!("unsupported front protocol version {version} (this side speaks {VERSION})"));
        }
        let msg = match r.u8()? {
            1 => Msg::ClientHello { nonce: r.array()?, has_secret: r.flag()? },
            2 => Msg::ServerHello { nonce: r.array()?, needs_secret: r.flag()? },
            3 => Msg::Proof { tag: r.array()? },
            4 => {
                let conn = r.u64()?;
                let identity =
                    ProcessIdentity::decode(r.take(identity::ENCODED_LEN)?).ok_or("short identity")?;
                let uuid = r.u64()?;
                let flags = r.u8()?;
                if flags & !3 != 0 {
                    return Err(format!("request flags {flags:#04x}"));
                }
                let error_mode = mode_from(r.u8()?).ok_or("unknown error mode")?;
                let n = u16::from_le_bytes(r.array()?) as usize;
                if n > crate::MAX_CONNECT_PAYLOAD {
                    return Err(format!("connect payload of {n} bytes"));
                }
                let payload = r.take(n)?.to_vec();
                Msg::Request(Request {
                    conn,
                    identity,
                    uuid,
                    shared_memory: flags & 1 != 0,
                    connection_manager: flags & 2 != 0,
                    error_mode,
                    payload,
                })
            }
            5 => {
                let identity =
                    ProcessIdentity::decode(r.take(identity::ENCODED_LEN)?).ok_or("short identity")?;
                let uuid = r.u64()?;
                let shared_memory = r.flag()?;
                let peer_mode = r.flag()?;
                let cm_port = u16::from_le_bytes(r.array()?);
                let n = r.u32()? as usize;
                if n == 0 || n > MAX_FRAME {
                    return Err(format!("worker address of {n} bytes"));
                }
                let address = r.take(n)?.to_vec();
                Msg::Accept(Accept { identity, uuid, shared_memory, peer_mode, cm_port, address })
            }
            6 => {
                let reason = Reason::from_code(r.u8()?).ok_or("unknown reject reason")?;
                Msg::Reject { reason, text: r.text()? }
            }
            7 => Msg::Abort { text: r.text()? },
            k => return Err(format!("unknown front message kind {k}")),
        };
        if r.at != b.len() {
            return Err(format!("{} bytes after the message", b.len() - r.at));
        }
        Ok(msg)
    }

    /// The message's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Msg::ClientHello { .. } => "client hello",
            Msg::ServerHello { .. } => "server hello",
            Msg::Proof { .. } => "proof",
            Msg::Request(_) => "request",
            Msg::Accept(_) => "accept",
            Msg::Reject { .. } => "reject",
            Msg::Abort { .. } => "abort",
        }
    }
}

fn put_text(v: &mut Vec<u8>, text: &str) {
    let t = clip(text);
    v.extend_from_slice(&(t.len() as u16).to_le_bytes());
    v.extend_from_slice(t.as_bytes());
}

/// Reads fields off a body, failing rather than reading past its end.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("message ends after {} bytes, {} more expected", self.b.len(), n))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn flag(&mut self) -> Result<bool, String> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            f => Err(format!("flag byte {f:#04x}")),
        }
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn text(&mut self) -> Result<String, String> {
        let n = u16::from_le_bytes(self.array()?) as usize;
        if n > MAX_TEXT {
            return Err(format!("text of {n} bytes"));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "text is not UTF-8".to_string())
    }
}

/// The length of a frame body from its 4-byte prefix, refused above [`MAX_FRAME`] (and
/// shorter than any message).
pub(crate) fn body_len(prefix: [u8; 4]) -> Result<usize, String> {
    let n = u32::from_le_bytes(prefix) as usize;
    if !(HEADER..=MAX_FRAME).contains(&n) {
        return Err(format!("frame of {n} bytes"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Msg> {
        let id = ProcessIdentity::current();
        vec![
            Msg::ClientHello { nonce: [1; NONCE_LEN], has_secret: true },
            Msg::ServerHello { nonce: [2; NONCE_LEN], needs_secret: false },
            Msg::Proof { tag: [3; MAC_LEN] },
            Msg::Request(Request {
                conn: 0x1234_5678_9abc,
                identity: id,
                uuid: 77,
                shared_memory: true,
                connection_manager: true,
                error_mode: ErrorMode::None,
                payload: b"rank 3".to_vec(),
            }),
            Msg::Accept(Accept {
                identity: id,
                uuid: 78,
                shared_memory: false,
                peer_mode: true,
                cm_port: 40000,
                address: vec![0x20, 1, 2, 3],
            }),
            Msg::Reject { reason: Reason::Busy, text: "too many".into() },
            Msg::Abort { text: "gave up".into() },
        ]
    }

    #[test]
    fn every_message_roundtrips() {
        for m in samples() {
            let b = m.encode();
            assert_eq!(Msg::decode(&b).as_ref(), Ok(&m), "{}", m.name());
            assert!(body_len((b.len() as u32).to_le_bytes()).is_ok());
        }
    }

    #[test]
    fn damaged_messages_are_refused_not_misread() {
        for m in samples() {
            let b = m.encode();
            // Every truncation and one byte more.
            for n in 0..b.len() {
                assert!(Msg::decode(&b[..n]).is_err(), "{} cut at {n}", m.name());
            }
            assert!(Msg::decode(&[b.clone(), vec![0]].concat()).is_err());
            // Every single-byte change either fails or decodes to something that
            // re-encodes to the changed bytes (a changed nonce, say): never a misread.
            for i in 0..b.len() {
                for x in [0x01u8, 0x80, 0xff] {
                    let mut c = b.clone();
                    c[i] ^= x;
                    if let Ok(d) = Msg::decode(&c) {
                        assert_eq!(d.encode(), c, "{} byte {i}", m.name());
                    }
                }
            }
        }
        assert!(Msg::decode(&[]).is_err());
        assert!(body_len([0, 0, 0, 0]).is_err());
        assert!(body_len(((MAX_FRAME + 1) as u32).to_le_bytes()).is_err());
    }

    #[test]
    fn texts_are_clipped_at_a_character_boundary() {
        let long = "é".repeat(MAX_TEXT);
        let b = Msg::Abort { text: long }.encode();
        match Msg::decode(&b).unwrap() {
            Msg::Abort { text } => assert!(text.len() <= MAX_TEXT && text.chars().all(|c| c == 'é')),
            m => panic!("{m:?}"),
        }
    }
}
