//! Shared-secret authentication: HMAC-SHA256 proofs for the listener front's
//! challenge-response, per-frame MACs for the connection that follows, and MACs on the
//! worker addresses and remote keys a context with a secret hands out.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Length of every MAC and proof: a full HMAC-SHA256 output.
pub(crate) const MAC_LEN: usize = 32;

/// Length of the random nonces each side of a front connection draws.
pub(crate) const NONCE_LEN: usize = 32;

/// The shortest secret accepted, in bytes (128 bits).
pub const MIN_SECRET_LEN: usize = 16;

/// A secret shared by a listener and its clients (see [`crate::ContextBuilder::secret`]).
///
/// Cheap to clone; `Debug` does not show it.
#[derive(Clone)]
pub struct Secret {
    key: Arc<[u8]>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A secret from bytes: at least [`MIN_SECRET_LEN`] of them, best 32 random ones
    /// (`head -c 32 /dev/urandom | base64`, shared with the peers out of band).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] for a shorter secret.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Secret> {
        let b = bytes.as_ref();
        if b.len() < MIN_SECRET_LEN {
            return Err(Error::ApiMisuse(format!(
                "a secret of {} bytes is too short: use at least {MIN_SECRET_LEN} (32 random bytes is best)",
                b.len()
            )));
        }
        Ok(Secret { key: b.into() })
    }

    /// HMAC-SHA256 of `parts`, in order, under `label` (which keeps the MACs of
    /// different uses apart).
    pub(crate) fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        mac_with(&self.key, label, parts)
    }

    /// Whether `tag` is the MAC of `parts` under `label` (compared in constant time).
    pub(crate) fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        verify_with(&self.key, label, parts, tag)
    }
}

fn keyed(key: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("invariant: HMAC takes keys of any length");
    // The label's length first, so that label and data cannot run into each other.
    m.update(&(label.len() as u32).to_le_bytes());
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn mac_with(key: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    keyed(key, label, parts).finalize().into_bytes().into()
}

fn verify_with(key: &[u8], label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, label, parts).verify_slice(tag).is_ok()
}

/// Labels of the front's proofs and session key.
const CLIENT_PROOF: &[u8] = b"ucxkit front client proof";
const SERVER_PROOF: &[u8] = b"ucxkit front server proof";
const SESSION: &[u8] = b"ucxkit front session";
const FRAME: &[u8] = b"ucxkit front frame";

/// Which side of a front connection a proof comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

/// The proof that `side` knows the secret, bound to both nonces of this connection.
pub(crate) fn proof(secret: &Secret, side: Side, client: &[u8], server: &[u8]) -> [u8; MAC_LEN] {
    secret.mac(side_label(side), &[client, server])
}

/// Whether `tag` is `side`'s proof for these nonces.
pub(crate) fn check_proof(secret: &Secret, side: Side, client: &[u8], server: &[u8], tag: &[u8]) -> bool {
    secret.verify(side_label(side), &[client, server], tag)
}

fn side_label(side: Side) -> &'static [u8] {
    match side {
        Side::Client => CLIENT_PROOF,
        Side::Server => SERVER_PROOF,
    }
}

/// MACs on the frames of an authenticated front connection, after the proofs: a key
/// drawn from the secret and both nonces, and a sequence number per direction, so that
/// a frame cannot be changed, replayed, reordered or sent back the other way.
pub(crate) struct Session {
    key: [u8; MAC_LEN],
    /// This side: frames it sends are tagged with its direction.
    side: Side,
    sent: u64,
    received: u64,
}

impl Session {
    pub(crate) fn new(secret: &Secret, side: Side, client: &[u8], server: &[u8]) -> Session {
        Session { key: secret.mac(SESSION, &[client, server]), side, sent: 0, received: 0 }
    }

    /// The tag of the next frame this side sends.
    pub(crate) fn seal(&mut self, body: &[u8]) -> [u8; MAC_LEN] {
        let tag = mac_with(&self.key, FRAME, &[direction(self.side), &self.sent.to_le_bytes(), body]);
        self.sent += 1;
        tag
    }

    /// Whether `tag` is right for the next frame from the other side.
    pub(crate) fn open(&mut self, body: &[u8], tag: &[u8]) -> bool {
        let from = match self.side {
            Side::Client => Side::Server,
            Side::Server => Side::Client,
        };
        let ok = verify_with(&self.key, FRAME, &[direction(from), &self.received.to_le_bytes(), body], tag);
        self.received += 1;
        ok
    }
}

fn direction(side: Side) -> &'static [u8] {
    match side {
        Side::Client => b"c",
        Side::Server => b"s",
    }
}

/// A random 64-bit value, different at each call, that nobody off this host can
/// predict: SipHash, under the process's random keys, of a counter and the process id
/// (handshake nonces and connection ids, keepalive tokens and cookies, the process
/// token of packed memory keys).
pub(crate) fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// `N` bytes from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| Error::Io {
        op: "drawing random bytes",
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Secret {
        Secret::new(b"0123456789abcdef0123456789abcdef").unwrap()
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(Secret::new(b"short").is_err());
        assert!(Secret::new([7u8; MIN_SECRET_LEN]).is_ok());
        assert_eq!(format!("{:?}", secret()), "Secret(..)");
    }

    #[test]
    fn proofs_bind_side_nonces_and_secret() {
        let s = secret();
        let (c, v) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = proof(&s, Side::Client, &c, &v);
        assert!(check_proof(&s, Side::Client, &c, &v, &p));
        // The server's proof differs: a client's proof cannot be reflected back.
        assert!(!check_proof(&s, Side::Server, &c, &v, &p));
        assert!(!check_proof(&s, Side::Client, &v, &c, &p));
        let other = Secret::new([9u8; 32]).unwrap();
        assert!(!check_proof(&other, Side::Client, &c, &v, &p));
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!check_proof(&s, Side::Client, &c, &v, &bad));
        assert!(!check_proof(&s, Side::Client, &c, &v, &p[..31]));
    }

    #[test]
    fn session_frames_are_ordered_and_one_way() {
        let s = secret();
        let (c, v) = ([3u8; NONCE_LEN], [4u8; NONCE_LEN]);
        let mut client = Session::new(&s, Side::Client, &c, &v);
        let mut server = Session::new(&s, Side::Server, &c, &v);
        let t0 = client.seal(b"first");
        let t1 = client.seal(b"second");
        assert!(server.open(b"first", &t0));
        assert!(server.open(b"second", &t1));
        // Replayed, reordered or changed frames fail.
        let mut s2 = Session::new(&s, Side::Server, &c, &v);
        assert!(!s2.open(b"second", &t1));
        let mut s3 = Session::new(&s, Side::Server, &c, &v);
        assert!(!s3.open(b"firsT", &t0));
        // A frame sent back the way it came fails.
        let back = server.seal(b"reply");
        let mut c2 = Session::new(&s, Side::Server, &c, &v);
        assert!(!c2.open(b"reply", &back));
        assert!(client.open(b"reply", &back));
    }

    #[test]
    fn random_bytes_differ() {
        let a: [u8; 32] = random().unwrap();
        let b: [u8; 32] = random().unwrap();
        assert_ne!(a, b);
    }
}
