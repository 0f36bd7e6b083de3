//! The object protocol's messages and their encoding. Every message is the header of an
//! active message in the object namespace: a version byte, a kind byte and the kind's
//! fields (little-endian); what follows a message (an inline object, a layout's
//! checksums) is the active message's payload. Decoding checks every field; a message
//! that fails ends its transfer with [`Error::Protocol`], never a panic.
//!
//! | kind | from | fields | payload |
//! |---|---|---|---|
//! | `Lookup` | puller | request, id, largest inline size, wait (ms) | none |
//! | `Fetch` | puller | request, id, first chunk, chunk count, time limit (ms) | none |
//! | `Missing` | holder | request | none |
//! | `Inline` | holder | request, checksum | the object |
//! | `Layout` | holder | request, size, chunk size | one checksum per chunk (8 bytes) |
//! | `Failed` | holder | request, reason (UTF-8, at most 256 bytes) | none |
//! | `Offer` | pusher | request, id, size, relay count | the relays' socket addresses |
//! | `Done` | receiver of an offer | request | none |
//! | `Cancel` | puller | request | none |
//! | `Hello` | broadcaster | request | none |
//! | `Address` | node | request | the socket address it listens on (text) |
//!
//! A receiver of an `Offer` pulls the object from the relays it names (receivers of the
//! same broadcast, which pass the chunks on as they check out) or, without relays or
//! when they fail, from the pusher, and answers `Done` once it holds it, or `Failed` (no
//! room, say). A lookup with a wait is answered `Missing` only when the object has not
//! started arriving at the holder within it (a relay may get its own offer later than
//! the receivers it serves). A broadcaster asks each relay for the address it listens
//! on with `Hello`, to tell the receivers below it where to connect. A puller
//! sends `Cancel` to every holder of a transfer when the transfer ends, either way: the
//! holder stops sending that request's chunks.

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::id::ObjectId;

/// The protocol's version; a message of another version is refused.
pub const VERSION: u8 = 2;
/// The most chunks one `Fetch` asks for (a holder refuses more).
pub const MAX_FETCH: u32 = 1024;
/// The longest reason a `Failed` message carries.
pub const MAX_REASON: usize = 256;

/// One protocol message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Asks a holder for object `id`: inline when it is at most `inline_max` bytes,
    /// otherwise its layout.
    Lookup {
        /// The puller's request number, echoed in the answer.
        req: u32,
        /// The object.
        id: ObjectId,
        /// The largest object the puller takes inline.
        inline_max: u32,
        /// How long the holder waits for the object to start arriving before it answers
        /// `Missing` (0: it answers at once).
        wait_ms: u32,
    },
    /// Asks a holder to send chunks `first..first + count` of `id`, each as a tagged
    /// message of request `req` and its index, within `limit_ms` milliseconds.
    Fetch {
        /// The request number (the chunks' tags carry it).
        req: u32,
        /// The object.
        id: ObjectId,
        /// The first chunk.
        first: u32,
        /// How many chunks.
        count: u32,
        /// How long the holder keeps trying to send them.
        limit_ms: u32,
    },
    /// The holder does not have the object.
    Missing {
        /// The request answered.
        req: u32,
    },
    /// The object itself follows as the payload, with its checksum.
    Inline {
        /// The request answered.
        req: u32,
        /// The checksum of the payload ([`crate::sums::sum`]).
        sum: u64,
    },
    /// The object's layout; its checksums follow as the payload.
    Layout {
        /// The request answered.
        req: u32,
        /// The object's size.
        size: u64,
        /// Its chunk size.
        chunk: u32,
    },
    /// Offers object `id` of `size` bytes: the receiver pulls it from the sender.
    Offer {
        /// The pusher's request number, echoed in the answer.
        req: u32,
        /// The object.
        id: ObjectId,
        /// Its size, for the receiver's admission.
        size: u64,
        /// How many relays' addresses the payload carries ([`encode_addresses`]).
        relays: u8,
    },
    /// The receiver of an offer holds the object now.
    Done {
        /// The offer answered.
        req: u32,
    },
    /// The puller is done with request `req` (its transfer ended, either way): the
    /// holder stops sending its chunks.
    Cancel {
        /// The request ended.
        req: u32,
    },
    /// Asks a node for the socket address it listens on.
    Hello {
        /// The broadcaster's request number, echoed in the answer.
        req: u32,
    },
    /// The node's listening address follows as the payload (`ip:port`).
    Address {
        /// The request answered.
        req: u32,
    },
    /// The holder could not serve the request (or the receiver of an offer refused it).
    Failed {
        /// The request answered.
        req: u32,
        /// Why, for people.
        reason: String,
    },
}

const LOOKUP: u8 = 1;
const FETCH: u8 = 2;
const MISSING: u8 = 3;
const INLINE: u8 = 4;
const LAYOUT: u8 = 5;
const FAILED: u8 = 6;
const OFFER: u8 = 7;
const DONE: u8 = 8;
const CANCEL: u8 = 9;
const HELLO: u8 = 10;
const ADDRESS: u8 = 11;
/// The most relays an offer names.
pub const MAX_RELAYS: usize = 8;

impl Msg {
    /// The request a message belongs to.
    pub fn req(&self) -> u32 {
        match self {
            Msg::Lookup { req, .. }
            | Msg::Fetch { req, .. }
            | Msg::Missing { req }
            | Msg::Inline { req, .. }
            | Msg::Layout { req, .. }
            | Msg::Offer { req, .. }
            | Msg::Done { req }
            | Msg::Cancel { req }
            | Msg::Hello { req }
            | Msg::Address { req }
            | Msg::Failed { req, .. } => *req,
        }
    }

    /// The message's kind on the wire.
    fn kind(&self) -> u8 {
        match self {
            Msg::Lookup { .. } => LOOKUP,
            Msg::Fetch { .. } => FETCH,
            Msg::Missing { .. } => MISSING,
            Msg::Inline { .. } => INLINE,
            Msg::Layout { .. } => LAYOUT,
            Msg::Offer { .. } => OFFER,
            Msg::Done { .. } => DONE,
            Msg::Cancel { .. } => CANCEL,
            Msg::Hello { .. } => HELLO,
            Msg::Address { .. } => ADDRESS,
            Msg::Failed { .. } => FAILED,
        }
    }

    /// The message's bytes: version, kind and request, then its own fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(48);
        b.extend([VERSION, self.kind()]);
        b.extend(self.req().to_le_bytes());
        let id = |b: &mut Vec<u8>, id: &ObjectId| {
            b.push(id.as_bytes().len() as u8);
            b.extend_from_slice(id.as_bytes());
        };
        match self {
            Msg::Lookup { id: o, inline_max, wait_ms, .. } => {
                id(&mut b, o);
                b.extend(inline_max.to_le_bytes());
                b.extend(wait_ms.to_le_bytes());
            }
            Msg::Fetch { id: o, first, count, limit_ms, .. } => {
                id(&mut b, o);
                b.extend(first.to_le_bytes());
                b.extend(count.to_le_bytes());
                b.extend(limit_ms.to_le_bytes());
            }
            // The messages that carry only their request.
            Msg::Missing { .. }
            | Msg::Hello { .. }
            | Msg::Address { .. }
            | Msg::Done { .. }
            | Msg::Cancel { .. } => {}
            Msg::Inline { sum, .. } => b.extend(sum.to_le_bytes()),
            Msg::Layout { size, chunk, .. } => {
                b.extend(size.to_le_bytes());
                b.extend(chunk.to_le_bytes());
            }
            Msg::Offer { id: o, size, relays, .. } => {
                id(&mut b, o);
                b.extend(size.to_le_bytes());
                b.push(*relays);
            }
            Msg::Failed { reason, .. } => {
                // Cut at a character boundary, within the limit.
                let mut end = reason.len().min(MAX_REASON);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                b.push(end as u8);
                b.push((end >> 8) as u8);
                b.extend_from_slice(&reason.as_bytes()[..end]);
            }
        }
        b
    }

    /// The message in `bytes`, checked field by field.
    ///
    /// # Errors
    /// [`Error::Protocol`] for another version, an unknown kind, a short or long
    /// message, an invalid id or a reason that is not UTF-8 or too long.
    pub fn decode(bytes: &[u8]) -> Result<Msg> {
        let mut r = Reader { b: bytes };
        let version = r.u8()?;
        if version != VERSION {
            return Err(Error::Protocol(format!("protocol version {version}, not {VERSION}")));
        }
        let kind = r.u8()?;
        let req = r.u32()?;
        let msg = match kind {
            LOOKUP => Msg::Lookup { req, id: r.id()?, inline_max: r.u32()?, wait_ms: r.u32()? },
            FETCH => Msg::Fetch { req, id: r.id()?, first: r.u32()?, count: r.u32()?, limit_ms: r.u32()? },
            MISSING => Msg::Missing { req },
            INLINE => Msg::Inline { req, sum: r.u64()? },
            LAYOUT => Msg::Layout { req, size: r.u64()?, chunk: r.u32()? },
            OFFER => {
                let (id, size, relays) = (r.id()?, r.u64()?, r.u8()?);
                if usize::from(relays) > MAX_RELAYS {
                    return Err(Error::Protocol(format!("an offer of {relays} relays, over {MAX_RELAYS}")));
                }
                Msg::Offer { req, id, size, relays }
            }
            HELLO => Msg::Hello { req },
            ADDRESS => Msg::Address { req },
            DONE => Msg::Done { req },
            CANCEL => Msg::Cancel { req },
            FAILED => {
                let len = usize::from(r.u8()?) | usize::from(r.u8()?) << 8;
                if len > MAX_REASON {
                    return Err(Error::Protocol(format!("a reason of {len} bytes, over {MAX_REASON}")));
                }
                let reason = std::str::from_utf8(r.take(len)?)
                    .map_err(|_| Error::Protocol("a reason that is not UTF-8".into()))?
                    .to_string();
                Msg::Failed { req, reason }
            }
            k => return Err(Error::Protocol(format!("unknown message kind {k}"))),
        };
        if !r.b.is_empty() {
            return Err(Error::Protocol(format!("{} bytes after a message of kind {kind}", r.b.len())));
        }
        Ok(msg)
    }
}

/// Reads fields off the front of a message.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(Error::Protocol(format!(
                "a message cut short ({} bytes left, {n} needed)",
                self.b.len()
            )));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn id(&mut self) -> Result<ObjectId> {
        let len = usize::from(self.u8()?);
        ObjectId::new(self.take(len)?).map_err(|e| Error::Protocol(e.to_string()))
    }
}

/// Decodes a layout's checksums (8 little-endian bytes each).
///
/// # Errors
/// [`Error::Protocol`] when the payload is not a whole number of checksums.
pub fn decode_sums(payload: &[u8]) -> Result<Vec<u64>> {
    if payload.len() % 8 != 0 {
        return Err(Error::Protocol(format!("checksums of {} bytes", payload.len())));
    }
    Ok(payload.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
}

/// The longest socket address an offer or an `Address` answer carries, as text.
pub const MAX_ADDRESS: usize = 64;

/// Encodes socket addresses for an offer's payload: each as its text's length (1 byte)
/// and its text (`ip:port`).
pub fn encode_addresses(addrs: &[SocketAddr]) -> Vec<u8> {
    let mut b = Vec::new();
    for a in addrs {
        let text = a.to_string();
        b.push(text.len() as u8);
        b.extend_from_slice(text.as_bytes());
    }
    b
}

/// Decodes one socket address's text (an `Address` answer's payload).
///
/// # Errors
/// [`Error::Protocol`] when it is too long or not a socket address.
pub fn decode_address(text: &[u8]) -> Result<SocketAddr> {
    if text.len() > MAX_ADDRESS {
        return Err(Error::Protocol(format!("an address of {} bytes, over {MAX_ADDRESS}", text.len())));
    }
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| Error::Protocol(format!("not a socket address: {:?}", String::from_utf8_lossy(text))))
}

/// Decodes an offer's `count` relay addresses, each checked.
///
/// # Errors
/// [`Error::Protocol`] when the payload holds another number of addresses, is cut short
/// or has bytes left over, or an address does not parse.
pub fn decode_addresses(payload: &[u8], count: u8) -> Result<Vec<SocketAddr>> {
    let mut r = Reader { b: payload };
    let mut addrs = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let len = usize::from(r.u8()?);
        addrs.push(decode_address(r.take(len)?)?);
    }
    if !r.b.is_empty() {
        return Err(Error::Protocol(format!("{} bytes after an offer's relays", r.b.len())));
    }
    Ok(addrs)
}

/// Encodes a layout's checksums.
pub fn encode_sums(sums: &[u64]) -> Vec<u8> {
    sums.iter().flat_map(|s| s.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Msg> {
        let id = ObjectId::new(b"obj-1").unwrap();
        let long = ObjectId::new(&[0xab; 32]).unwrap();
        vec![
            Msg::Lookup { req: 1, id, inline_max: 65536, wait_ms: 0 },
            Msg::Lookup { req: 1, id, inline_max: 0, wait_ms: u32::MAX },
            Msg::Fetch { req: u32::MAX, id: long, first: 7, count: 3, limit_ms: 30_000 },
            Msg::Missing { req: 0 },
            Msg::Inline { req: 9, sum: 0xdead_beef_0bad_f00d },
            Msg::Layout { req: 2, size: u64::MAX, chunk: 1 << 20 },
            Msg::Failed { req: 3, reason: "no room".into() },
            Msg::Failed { req: 3, reason: String::new() },
            Msg::Offer { req: 4, id, size: 1 << 40, relays: 0 },
            Msg::Offer { req: 4, id, size: 0, relays: MAX_RELAYS as u8 },
            Msg::Hello { req: 7 },
            Msg::Address { req: 8 },
            Msg::Done { req: 5 },
            Msg::Cancel { req: 6 },
        ]
    }

    #[test]
    fn messages_round_trip() {
        for m in samples() {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
        let sums = [1, u64::MAX, 0];
        assert_eq!(decode_sums(&encode_sums(&sums)).unwrap(), sums);
    }

    #[test]
    fn long_reasons_are_cut_at_a_character() {
        let m = Msg::Failed { req: 1, reason: "é".repeat(200) };
        let Msg::Failed { reason, .. } = Msg::decode(&m.encode()).unwrap() else { panic!() };
        assert_eq!(reason, "é".repeat(128));
    }

    #[test]
    fn malformed_messages_are_errors() {
        let ok = Msg::Lookup { req: 1, id: ObjectId::new(b"x").unwrap(), inline_max: 4, wait_ms: 0 }.encode();
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![VERSION],
            vec![2, LOOKUP, 0, 0, 0, 0],
            vec![VERSION, 0, 0, 0, 0, 0],
            vec![VERSION, 77, 0, 0, 0, 0],
            vec![VERSION, MISSING, 0, 0, 0],
            vec![VERSION, MISSING, 0, 0, 0, 0, 0],
            // An id of length 0 and of 33.
            vec![VERSION, LOOKUP, 0, 0, 0, 0, 0, 4, 0, 0, 0],
            [vec![VERSION, LOOKUP, 0, 0, 0, 0, 33], vec![1; 37]].concat(),
            // A reason over the limit, and one not UTF-8.
            [vec![VERSION, FAILED, 0, 0, 0, 0, 1, 1], vec![b'a'; 257]].concat(),
            vec![VERSION, FAILED, 0, 0, 0, 0, 1, 0, 0xff],
            // Too many relays.
            [vec![VERSION, OFFER, 0, 0, 0, 0, 1, b'x'], vec![0; 8], vec![MAX_RELAYS as u8 + 1]].concat(),
        ];
        cases.push(ok[..ok.len() - 1].to_vec());
        cases.push([ok.clone(), vec![0]].concat());
        for c in &cases {
            assert!(matches!(Msg::decode(c), Err(Error::Protocol(_))), "{c:?}");
        }
        assert!(decode_sums(&[1, 2, 3]).is_err());
        assert!(decode_addresses(&[], 0).unwrap().is_empty());
        let two: Vec<SocketAddr> = vec!["10.0.0.2:7000".parse().unwrap(), "[::1]:1".parse().unwrap()];
        assert_eq!(decode_addresses(&encode_addresses(&two), 2).unwrap(), two);
        let cases: [(&[u8], u8); 6] = [
            (&[], 1),
            (b"\x0d10.0.0.2:70", 1),
            (b"\x0910.0.0.2:", 1),
            (b"\x0410.0.0.2:7000", 1),
            (b"\x0d10.0.0.2:7000", 0),
            (b"\x0d10.0.0.2:7000\x00", 1),
        ];
        for (payload, count) in cases {
            assert!(matches!(decode_addresses(payload, count), Err(Error::Protocol(_))), "{payload:?}");
        }
        assert!(decode_address(&[b'1'; 65]).is_err());
        assert!(decode_address(&[0xff, b':', b'1']).is_err());
    }

    /// Random bytes and every valid message with random changes: each decodes or is an
    /// error, and what decodes encodes back to the same bytes.
    #[test]
    fn random_and_mutated_input_never_panics() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let samples: Vec<Vec<u8>> = samples().iter().map(Msg::encode).collect();
        let mut decoded = 0;
        for i in 0..50_000 {
            let mut b = if i % 2 == 0 {
                (0..next() % 64).map(|_| next() as u8).collect::<Vec<u8>>()
            } else {
                samples[(next() % samples.len() as u64) as usize].clone()
            };
            for _ in 0..1 + next() % 3 {
                match next() % 3 {
                    0 if !b.is_empty() => {
                        let at = (next() % b.len() as u64) as usize;
                        b[at] ^= 1 << (next() % 8);
                    }
                    1 => b.truncate((next() % (b.len() as u64 + 1)) as usize),
                    _ => b.push(next() as u8),
                }
            }
            if i % 2 == 0 && b.len() > 1 {
                b[0] = VERSION;
            }
            if let Ok(m) = Msg::decode(&b) {
                decoded += 1;
                assert_eq!(m.encode(), b, "{m:?}");
            }
        }
        assert!(decoded > 1000, "the mutations reach valid messages too ({decoded})");
    }
}
