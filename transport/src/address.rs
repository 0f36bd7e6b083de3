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
//! | 4 | 1 | version (2) |
//! | 5 | 1 | flags: bit 0, the worker's context carries messages through shared memory; bit 1, a MAC follows |
//! | 6 | 2 | zero |
//! | 8 | 36 | the worker's process identity |
//! | 44 | 4 | length N of the UCX address |
//! | 48 | 8 | FNV-1a 64 of bytes 0..48 and the UCX address |
//! | 56 | N | UCX worker address (`ucp_worker_get_address`) |
//! | 56 + N | 32 | with flag bit 1: HMAC-SHA256 of bytes 0..56 + N under the context's secret |
//!
//! The checksum catches accidents; anyone can compute it. A worker whose context has a
//! secret ([`crate::ContextBuilder::secret`]) adds the MAC, and a worker with a secret
//! connects only to addresses whose MAC it verifies.

use std::fmt;

use crate::auth::{Secret, MAC_LEN};
use crate::error::{Error, Result};
use crate::identity::{self, ProcessIdentity};
use crate::worker::Worker;

const MAGIC: u32 = 0x4158_4355;
const VERSION: u8 = 2;
/// Flag: the worker's context has a shared-memory transport that carries messages.
const FLAG_SHARED_MEMORY: u8 = 1;
/// Flag: a MAC follows the UCX address.
const FLAG_MAC: u8 = 2;
/// The label of address MACs.
const MAC_LABEL: &[u8] = b"ucxkit worker address";
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
    pub(crate) fn wrap(identity: &ProcessIdentity, shared_memory: bool, ucx: &[u8]) -> WorkerAddress {
        let mut b = Vec::with_capacity(HEADER + ucx.len());
        b.extend_from_slice(&MAGIC.to_le_bytes());
        let flags = if shared_memory { FLAG_SHARED_MEMORY } else { 0 };
        b.extend_from_slice(&[VERSION, flags, 0, 0]);
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
        if bytes[4] != VERSION {
            return bad(format!("unsupported version {}", bytes[4]));
        }
        if bytes[5] & !(FLAG_SHARED_MEMORY | FLAG_MAC) != 0 || bytes[6..8] != [0, 0] {
            return bad(format!("unknown flags {:#04x} {:#04x} {:#04x}", bytes[5], bytes[6], bytes[7]));
        }
        let n = u32::from_le_bytes(bytes[44..48].try_into().expect("4 bytes")) as usize;
        let mac = if bytes[5] & FLAG_MAC != 0 { MAC_LEN } else { 0 };
        if n == 0 || n > MAX_UCX_LEN || bytes.len() != HEADER + n + mac {
            return bad(format!("UCX address length {n} does not match {} bytes", bytes.len()));
        }
        let sum = u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes"));
        if sum != fnv1a(&bytes[..48], &bytes[HEADER..HEADER + n]) {
            return bad("checksum mismatch (corrupted or truncated)".into());
        }
        Ok(WorkerAddress { bytes: bytes.to_vec() })
    }

    /// Wraps a worker address in UCX's own form, the bytes `ucp_worker_get_address`
    /// returns: the way to connect to a plain UCX program by address
    /// ([`crate::Worker::connect_address_with`], with the handshake off). The address
    /// carries no process identity, so [`crate::ErrorMode::Auto`] treats its worker as
    /// remote (peer error mode) and no liveness watch runs.
    ///
    /// # Errors
    /// [`Error::BadAddress`] for an empty address or one longer than any UCX makes.
    ///
    /// # Safety
    /// `bytes` must be a worker address exactly as `ucp_worker_get_address` returned it,
    /// from a UCX whose address format this one reads (any UCX release from 1.13 on), of
    /// a peer trusted with this process's memory: UCX parses it without checking lengths,
    /// and acts on what it names (shared-memory segments it maps, processes whose
    /// memory it reads and writes, network addresses it connects to). Corrupt bytes can
    /// make UCX read out of bounds or abort the process.
    pub unsafe fn from_ucx_bytes(bytes: &[u8]) -> Result<WorkerAddress> {
        if bytes.is_empty() || bytes.len() > MAX_UCX_LEN {
            return Err(Error::BadAddress {
                reason: format!("a UCX worker address of {} bytes", bytes.len()),
            });
        }
        Ok(WorkerAddress::wrap(&ProcessIdentity::default(), false, bytes))
    }

    /// The encoded address.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// UCX's own address bytes inside the envelope.
    pub fn ucx_bytes(&self) -> &[u8] {
        let n = u32::from_le_bytes(self.bytes[44..48].try_into().expect("4 bytes")) as usize;
        &self.bytes[HEADER..HEADER + n]
    }

    /// Adds a MAC under `secret` (replacing any).
    pub(crate) fn sealed(mut self, secret: &Secret) -> WorkerAddress {
        let end = HEADER + self.ucx_bytes().len();
        self.bytes.truncate(end);
        self.bytes[5] |= FLAG_MAC;
        // The flags are under the checksum.
        let sum = fnv1a(&self.bytes[..48], &self.bytes[HEADER..]);
        self.bytes[48..56].copy_from_slice(&sum.to_le_bytes());
        let mac = secret.mac(MAC_LABEL, &[&self.bytes]);
        self.bytes.extend_from_slice(&mac);
        self
    }

    /// Whether the address carries a MAC that `secret` verifies.
    pub(crate) fn verify(&self, secret: &Secret) -> bool {
        if self.bytes[5] & FLAG_MAC == 0 {
            return false;
        }
        let end = HEADER + self.ucx_bytes().len();
        secret.verify(MAC_LABEL, &[&self.bytes[..end]], &self.bytes[end..])
    }

    /// The process the worker lives in.
    pub fn identity(&self) -> ProcessIdentity {
        ProcessIdentity::decode(&self.bytes[8..8 + identity::ENCODED_LEN])
            .expect("invariant: checked at construction")
    }

    /// Whether the worker's context carries messages through shared memory (see
    /// [`crate::Context::has_shared_memory`]); false for an address in UCX's own form.
    pub fn has_shared_memory(&self) -> bool {
        self.bytes[5] & FLAG_SHARED_MEMORY != 0
    }

    /// A short fingerprint for logs and errors.
    pub fn fingerprint(&self) -> String {
        format!("{:016x}", u64::from_le_bytes(self.bytes[48..56].try_into().expect("8 bytes")))
    }
}

impl Worker {
    /// This worker's address, to hand to peers for [`Worker::connect_address`]; sealed
    /// with a MAC when the context has a secret.
    pub fn address(&self) -> Result<WorkerAddress> {
        let bytes = self.ucx_address()?;
        let ctx = self.context();
        let wa = WorkerAddress::wrap(&ProcessIdentity::current(), ctx.has_shared_memory(), &bytes);
        Ok(match ctx.secret() {
            Some(s) => wa.sealed(s),
            None => wa,
        })
    }
}

impl fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerAddress({}, {} bytes)", self.fingerprint(), self.bytes.len())
    }
}

/// Checks a worker address in UCX's own form from a peer that sealed it (its word for
/// the values inside) before UCX parses it: its layout, walked within bounds as UCX
/// reads it (a known format version: UCX aborts on others), and the worker uuid it must
/// carry.
pub(crate) fn check_ucx_address(ucx: &[u8]) -> std::result::Result<(), String> {
    if ucx.len() > MAX_UCX_LEN {
        return Err(format!("a UCX worker address of {} bytes", ucx.len()));
    }
    match crate::ucx_address::walk(ucx)?.uuid {
        Some(_) => Ok(()),
        None => Err("the UCX worker address carries no worker uuid".into()),
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
        let a = WorkerAddress::wrap(&me, true, b"ucx-address-bytes");
        let b = WorkerAddress::from_bytes(a.as_bytes()).unwrap();
        assert_eq!(a, b);
        assert!(b.has_shared_memory());
        assert!(!WorkerAddress::from_bytes(WorkerAddress::wrap(&me, false, b"x").as_bytes())
            .unwrap()
            .has_shared_memory());
        assert_eq!(b.ucx_bytes(), b"ucx-address-bytes");
        assert_eq!(b.identity(), me);

        assert!(WorkerAddress::from_bytes(&[]).is_err());
        assert!(WorkerAddress::from_bytes(&a.as_bytes()[..a.as_bytes().len() - 1]).is_err());
        for i in 0..a.as_bytes().len() {
            let mut x = a.as_bytes().to_vec();
            x[i] ^= 0x40;
            assert!(WorkerAddress::from_bytes(&x).is_err(), "flip at {i} accepted");
        }
        // A MAC: verified by its secret only, and part of what the checksum does not cover.
        let s = Secret::new([1u8; 32]).unwrap();
        let sealed = WorkerAddress::from_bytes(a.clone().sealed(&s).as_bytes()).unwrap();
        assert!(sealed.verify(&s));
        assert!(!a.verify(&s), "no MAC");
        assert!(!sealed.verify(&Secret::new([2u8; 32]).unwrap()));
        assert_eq!(sealed.ucx_bytes(), b"ucx-address-bytes");
        let mut forged = sealed.as_bytes().to_vec();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(!WorkerAddress::from_bytes(&forged).unwrap().verify(&s));
        let junk: Vec<u8> = (0..300u32).map(|i| (i * 7919 % 251) as u8).collect();
        assert!(matches!(WorkerAddress::from_bytes(&junk), Err(Error::BadAddress { .. })));
    }
}
