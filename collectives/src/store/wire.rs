//! The TCP store's messages: a 4-byte little-endian length, then the body. Requests:
//! `S key value` (set), `G key` (get), `W timeout_ms keys...` (wait), `A key delta`
//! (add); replies: `O` (ok), `V value` or `N` (get), `L values...` or `M keys...`
//! (wait: the values, or the keys still missing), `I n` (add), `E text` (refused).
//! Strings and byte strings are a 4-byte length then the bytes. Every field is
//! checked against the store's limits before it is used: a malformed or oversized
//! message is an error, and the server closes that connection.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{MAX_KEY, MAX_VALUE};

/// The longest message either side accepts: a wait for many keys, or a value.
pub(crate) const MAX_MESSAGE: usize = MAX_VALUE + 64 * 1024 * (MAX_KEY + 4);

/// A parsed message body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    Set(String, Vec<u8>),
    Get(String),
    Wait(u64, Vec<String>),
    Add(String, i64),
    Ok,
    Value(Option<Vec<u8>>),
    Values(Vec<Vec<u8>>),
    Missing(Vec<String>),
    Int(i64),
    Refused(String),
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_list(out: &mut Vec<u8>, items: &[impl AsRef<[u8]>]) {
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for i in items {
        put_bytes(out, i.as_ref());
    }
}

impl Msg {
    /// The body's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut o = Vec::new();
        match self {
            Msg::Set(k, v) => {
                o.push(b'S');
                put_bytes(&mut o, k.as_bytes());
                put_bytes(&mut o, v);
            }
            Msg::Get(k) => {
                o.push(b'G');
                put_bytes(&mut o, k.as_bytes());
            }
            Msg::Wait(t, keys) => {
                o.push(b'W');
                o.extend_from_slice(&t.to_le_bytes());
                put_list(&mut o, keys);
            }
            Msg::Add(k, d) => {
                o.push(b'A');
                put_bytes(&mut o, k.as_bytes());
                o.extend_from_slice(&d.to_le_bytes());
            }
            Msg::Ok => o.push(b'O'),
            Msg::Value(Some(v)) => {
                o.push(b'V');
                put_bytes(&mut o, v);
            }
            Msg::Value(None) => o.push(b'N'),
            Msg::Values(vs) => {
                o.push(b'L');
                put_list(&mut o, vs);
            }
            Msg::Missing(keys) => {
                o.push(b'M');
                put_list(&mut o, keys);
            }
            Msg::Int(n) => {
                o.push(b'I');
                o.extend_from_slice(&n.to_le_bytes());
            }
            Msg::Refused(t) => {
                o.push(b'E');
                put_bytes(&mut o, t.as_bytes());
            }
        }
        o
    }

    /// Parses a body; None when it is malformed (unknown kind, short, over a limit,
    /// trailing bytes, a key that is not UTF-8).
    pub(crate) fn decode(b: &[u8]) -> Option<Msg> {
        let mut r = Reader { b, at: 0 };
        let m = match r.u8()? {
            b'S' => Msg::Set(r.key()?, r.bytes(MAX_VALUE)?.to_vec()),
            b'G' => Msg::Get(r.key()?),
            b'W' => {
                let t = r.u64()?;
                let n = r.u32()? as usize;
                // Each key takes at least 5 bytes: a count beyond what is left is a lie.
                if n > b.len() / 5 {
                    return None;
                }
                Msg::Wait(t, (0..n).map(|_| r.key()).collect::<Option<_>>()?)
            }
            b'A' => Msg::Add(r.key()?, r.u64()? as i64),
            b'O' => Msg::Ok,
            b'V' => Msg::Value(Some(r.bytes(MAX_VALUE)?.to_vec())),
            b'N' => Msg::Value(None),
            b'L' => {
                let n = r.u32()? as usize;
                if n > b.len() / 4 {
                    return None;
                }
                Msg::Values((0..n).map(|_| r.bytes(MAX_VALUE).map(<[u8]>::to_vec)).collect::<Option<_>>()?)
            }
            b'M' => {
                let n = r.u32()? as usize;
                if n > b.len() / 5 {
                    return None;
                }
                Msg::Missing((0..n).map(|_| r.key()).collect::<Option<_>>()?)
            }
            b'I' => Msg::Int(r.u64()? as i64),
            b'E' => Msg::Refused(String::from_utf8_lossy(r.bytes(MAX_KEY)?).into_owned()),
            _ => return None,
        };
        (r.at == b.len()).then_some(m)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|s| u32::from_le_bytes(s.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|s| u64::from_le_bytes(s.try_into().unwrap_or_default()))
    }
    fn bytes(&mut self, limit: usize) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > limit {
            return None;
        }
        self.take(n)
    }
    fn key(&mut self) -> Option<String> {
        let k = self.bytes(MAX_KEY)?;
        if k.is_empty() {
            return None;
        }
        String::from_utf8(k.to_vec()).ok()
    }
}

/// Writes one message.
pub(crate) async fn send(w: &mut (impl AsyncWrite + Unpin), m: &Msg) -> std::io::Result<()> {
    let body = m.encode();
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await
}

/// Reads one message; an error for a closed connection or a malformed message.
pub(crate) async fn recv(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Msg> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "store message over the limit"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Msg::decode(&body)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed store message"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips_and_every_prefix_is_refused() {
        let msgs = [
            Msg::Set("k".into(), vec![1, 2]),
            Msg::Get("key".into()),
            Msg::Wait(5, vec!["a".into(), "bb".into()]),
            Msg::Add("n".into(), -3),
            Msg::Ok,
            Msg::Value(Some(vec![9])),
            Msg::Value(None),
            Msg::Values(vec![vec![], vec![1]]),
            Msg::Missing(vec!["x".into()]),
            Msg::Int(i64::MIN),
            Msg::Refused("no".into()),
        ];
        for m in msgs {
            let b = m.encode();
            assert_eq!(Msg::decode(&b).as_ref(), Some(&m));
            for cut in 0..b.len() {
                assert!(Msg::decode(&b[..cut]).is_none(), "{m:?} cut at {cut}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Msg::decode(&longer).is_none());
        }
    }

    #[test]
    fn lying_lengths_and_bad_keys_are_refused() {
        assert!(Msg::decode(b"G\xff\xff\xff\xff").is_none());
        assert!(Msg::decode(b"W\0\0\0\0\0\0\0\0\xff\xff\xff\x0f").is_none());
        assert!(Msg::decode(b"G\x00\x00\x00\x00").is_none(), "empty key");
        assert!(Msg::decode(b"G\x01\x00\x00\x00\xff").is_none(), "not UTF-8");
        assert!(Msg::decode(b"Z").is_none());
        // Arbitrary bytes never panic.
        let mut x = 0x1234_5678u32;
        for _ in 0..20_000 {
            let len = (x % 40) as usize;
            let b: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 7) as u8 + if x % 3 == 0 { b'A' } else { 0 }
                })
                .collect();
            let _ = Msg::decode(&b);
        }
    }
}
