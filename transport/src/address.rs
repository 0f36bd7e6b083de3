//! [`WorkerAddress`]: the bytes a peer needs to connect to a worker without a listener.
//!
//! ucxkit wraps UCX's opaque worker address in a small envelope so that bad bytes are an
//! error instead of undefined behaviour inside UCX, and so that the connecting side
//! knows whether the worker runs on its own host (which decides the error mode in
//! [`crate::ErrorMode::Auto`] and whether the peer can be watched):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `0x41584355` ("UCXA") |
//! | 4 | 1 | version (1) |
//! | 5 | 3 | zero |
//! | 8 | 36 | the worker's process identity |
//! | 44 | 4 | length N of the UCX address |
//! | 48 | 8 | FNV-1a 64 of bytes 0..48 and the UCX address |
//! | 56 | N | UCX worker address (`ucp_worker_get_address`) |

use std::fmt;

use crate::error::{Error, Result};
use crate::identity::{self, ProcessIdentity};

const MAGIC: u32 = 0x4158_4355;
const VERSION: u8 = 1;
const HEADER: usize = 56;
/// Largest UCX address accepted (UCX's are a few hundred bytes to a few KiB).
const MAX_UCX_LEN: usize = 1 << 20;

/// A worker's address: opaque bytes to exchange out of band (a file, a key-value store,
/// a TCP message), then [`crate::Worker::connect_address`].
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerAddress {
    bytes: Vec<u8>,
}

impl WorkerAddress {
    pub(crate) fn wrap(identity: &ProcessIdentity, ucx: &[u8]) -> WorkerAddress {
        let mut b = Vec::with_capacity(HEADER + ucx.len());
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&[VERSION, 0, 0, 0]);
        identity.encode(&mut b);
        b.extend_from_slice(&(ucx.len() as u32).to_le_bytes());
        let sum = fnv1a(&b, ucx);
        b.extend_from_slice(&sum.to_le_bytes());
        b.extend_from_slice(ucx);
        WorkerAddress { bytes: b }
    }

    /// Parses and checks bytes produced by [`WorkerAddress::as_bytes`] (on any host).
    pub fn from_bytes(bytes: &[u8]) -> Result<WorkerAddress> {
        let bad = |reason: String| Err(Error::BadAddress { reason });
        if bytes.len() < HEADER {
            return bad(format!("{} bytes, shorter than the {HEADER} byte header", bytes.len()));
        }
        let magic = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return bad(format!("bad magic {magic:#010x}"));
        }
        if bytes[4] != VERSION || bytes[5..8] != [0, 0, 0] {
            return bad(format!("unsupported version {}", bytes[4]));
        }
        let n = u32::from_le_bytes(bytes[44..48].try_into().expect("4 bytes")) as usize;
        if n == 0 || n > MAX_UCX_LEN || bytes.len() != HEADER + n {
            return bad(format!("UCX address length {n} does not match {} bytes", bytes.len()));
        }
        let sum = u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes"));
        if sum != fnv1a(&bytes[..48], &bytes[HEADER..]) {
            return bad("checksum mismatch (corrupted or truncated)".into());
        }
        Ok(WorkerAddress { bytes: bytes.to_vec() })
    }

    /// The encoded address.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// UCX's own address bytes inside the envelope.
    pub fn ucx_bytes(&self) -> &[u8] {
        &self.bytes[HEADER..]
    }

    /// The process the worker lives in.
    pub fn identity(&self) -> ProcessIdentity {
        ProcessIdentity::decode(&self.bytes[8..8 + identity::ENCODED_LEN])
            .expect("invariant: checked at construction")
    }

    /// A short fingerprint for logs and errors.
    pub fn fingerprint(&self) -> String {
        format!("{:016x}", u64::from_le_bytes(self.bytes[48..56].try_into().expect("8 bytes")))
    }
}

impl fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerAddress({}, {} bytes)", self.fingerprint(), self.bytes.len())
    }
}

pub(crate) fn fnv1a(a: &[u8], b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in a.iter().chain(b) {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_rejects() {
        let me = ProcessIdentity::current();
        let a = WorkerAddress::wrap(&me, b"ucx-address-bytes");
        let b = WorkerAddress::from_bytes(a.as_bytes()).unwrap();
        assert_eq!(a, b);
        assert_eq!(b.ucx_bytes(), b"ucx-address-bytes");
        assert_eq!(b.identity(), me);

        assert!(WorkerAddress::from_bytes(&[]).is_err());
        assert!(WorkerAddress::from_bytes(&a.as_bytes()[..a.as_bytes().len() - 1]).is_err());
        for i in 0..a.as_bytes().len() {
            let mut x = a.as_bytes().to_vec();
            x[i] ^= 0x40;
            assert!(WorkerAddress::from_bytes(&x).is_err(), "flip at {i} accepted");
        }
        let junk: Vec<u8> = (0..300u32).map(|i| (i * 7919 % 251) as u8).collect();
        assert!(matches!(WorkerAddress::from_bytes(&junk), Err(Error::BadAddress { .. })));
    }
}
