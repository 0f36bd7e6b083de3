//! Packed remote keys: the envelope around UCX's key (address, length, origin, checksum,
//! MAC), the registry that lets a key unpacked in its own process hold its region, and
//! [`RemoteKey`], a peer's region as one endpoint reaches it.

use std::sync::Arc;

use ucx_sys as sys;

use super::{MemInner, MemRegion};
use crate::auth::{Secret, MAC_LEN};
use crate::endpoint::Endpoint;
use crate::error::{Error, Peer, Result, Status};
use crate::worker::WorkerInner;

const KEY_MAGIC: u32 = 0x524b_4355; // "UCKR"
const KEY_VERSION: u8 = 2;
const KEY_HEADER: usize = 4 + 1 + 3 + 8 + 8 + 8 + 8 + 4;

/// Where a packed key comes from: the process (a random token drawn once per process)
/// and the region in it. A key unpacked in the process that packed it holds its region
/// (see [`Endpoint::unpack_key`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Origin {
    pub(super) process: u64,
    pub(super) region: u64,
}

/// This process's token in [`Origin`].
pub(super) fn process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(crate::auth::nonce)
}

pub(super) fn next_region_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The regions of this process whose key was packed, by id, for keys unpacked here.
pub(super) fn packed(
) -> std::sync::MutexGuard<'static, std::collections::HashMap<u64, std::sync::Weak<MemInner>>> {
    static PACKED: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<u64, std::sync::Weak<MemInner>>>,
    > = std::sync::OnceLock::new();
    PACKED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
/// Packed UCX keys are a few hundred bytes; anything far larger is not one.
const MAX_UCX_KEY: usize = 64 * 1024;
/// Zero bytes after a key handed to `ucp_ep_rkey_unpack`: more than any transport's key
/// (each domain's size is one byte).
const KEY_PAD: usize = 256;

/// Layout (little-endian): magic u32, version u8, flags u8 (bit 0: a MAC follows), 2
/// zero bytes, address u64, length u64, origin process u64, origin region u64, UCX key
/// length u32, the UCX key, FNV-1a checksum u64 of everything before it; with the flag,
/// HMAC-SHA256 of everything before it under the packing context's secret.
pub(super) fn encode_key(
    addr: u64,
    len: u64,
    origin: Origin,
    rkey: &[u8],
    secret: Option<&Secret>,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(KEY_HEADER + rkey.len() + 8 + MAC_LEN);
    v.extend_from_slice(&KEY_MAGIC.to_le_bytes());
    v.push(KEY_VERSION);
    v.extend_from_slice(&[secret.is_some() as u8, 0, 0]);
    v.extend_from_slice(&addr.to_le_bytes());
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(&origin.process.to_le_bytes());
    v.extend_from_slice(&origin.region.to_le_bytes());
    v.extend_from_slice(&(rkey.len() as u32).to_le_bytes());
    v.extend_from_slice(rkey);
    let sum = crate::address::fnv1a(&v, &[]);
    v.extend_from_slice(&sum.to_le_bytes());
    if let Some(s) = secret {
        let mac = s.mac(KEY_MAC_LABEL, &[&v]);
        v.extend_from_slice(&mac);
    }
    v
}

/// The label of key MACs.
const KEY_MAC_LABEL: &[u8] = b"ucxkit remote key";

/// A parsed key envelope.
struct Decoded<'a> {
    addr: u64,
    len: u64,
    origin: Origin,
    ucx: &'a [u8],
    /// The MAC and what it covers.
    mac: Option<(&'a [u8], &'a [u8])>,
}

fn decode_key(b: &[u8]) -> Result<Decoded<'_>> {
    let bad = |reason: String| Error::BadRemoteKey { reason };
    if b.len() < KEY_HEADER + 8 {
        return Err(bad(format!("{} bytes is too short for a packed key", b.len())));
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if u32_at(0) != KEY_MAGIC {
        return Err(bad(format!("bad magic {:#010x}", u32_at(0))));
    }
    if b[4] != KEY_VERSION || b[5] > 1 || b[6..8] != [0, 0] {
        return Err(bad(format!("unsupported key version {} or flags {:#04x}", b[4], b[5])));
    }
    let mac_len = if b[5] == 1 { MAC_LEN } else { 0 };
    let (addr, len) = (u64_at(8), u64_at(16));
    let origin = Origin { process: u64_at(24), region: u64_at(32) };
    let klen = u32_at(40) as usize;
    if klen == 0 || klen > MAX_UCX_KEY || b.len() != KEY_HEADER + klen + 8 + mac_len {
        return Err(bad(format!("length field {klen} does not match the {} bytes given", b.len())));
    }
    let body = &b[..KEY_HEADER + klen];
    if crate::address::fnv1a(body, &[]) != u64_at(KEY_HEADER + klen) {
        return Err(bad("checksum mismatch".into()));
    }
    if addr.checked_add(len).is_none() {
        return Err(bad(format!("region {addr:#x}+{len} wraps around")));
    }
    let ucx = &b[KEY_HEADER..KEY_HEADER + klen];
    crate::ucx_key::walk(ucx).map_err(bad)?;
    let mac = (mac_len > 0).then(|| (&b[KEY_HEADER + klen + 8..], &b[..KEY_HEADER + klen + 8]));
    Ok(Decoded { addr, len, origin, ucx, mac })
}

/// A peer's region as reachable through one endpoint (`ucp_rkey_h`): the target of
/// [`Endpoint::put`], [`Endpoint::get`] and the atomics. Cheap to clone; holds the
/// endpoint.
#[derive(Clone)]
pub struct RemoteKey {
    pub(crate) inner: Arc<RkeyInner>,
}

/// Holds the worker weakly: a key parked with an operation UCX never completes must not
/// keep its worker (and endpoint) alive forever.
pub(crate) struct RkeyInner {
    worker: std::sync::Weak<WorkerInner>,
    ep_id: u64,
    peer: Peer,
    pub(crate) rkey: sys::ucp_rkey_h,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// The region, for a key unpacked in the process that packed it; held, never read,
    /// and released after the key is destroyed.
    _region: Option<Arc<MemInner>>,
}

// SAFETY: the rkey handle is only used under its endpoint's worker lock.
unsafe impl Send for RkeyInner {}
// SAFETY: as above.
unsafe impl Sync for RkeyInner {}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        let rkey = self.rkey;
        // A worker already being destroyed takes its keys' memory with it.
        if let Some(w) = self.worker.upgrade() {
            w.locked(|_| {
                // SAFETY: unpacked on an endpoint of this worker, destroyed once; no
                // operation uses it any more (each holds a clone); the lock is held.
                unsafe { sys::ucp_rkey_destroy(rkey) }
            });
        }
    }
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("peer", &self.inner.peer)
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .finish()
    }
}

impl RemoteKey {
    /// The remote region's length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Whether the remote region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The remote region's start address.
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }

    /// The peer whose region this is.
    pub fn peer(&self) -> &Peer {
        &self.inner.peer
    }

    /// The remote address of `len` bytes at `offset`, after checking they are inside the
    /// region, that the key belongs to `ep`, and (for atomics) 8-byte alignment.
    ///
    /// Inlined into every posting path, with the error built out of line: the checks
    /// are a few compares, and a boxed error keeps the result two words.
    #[inline(always)]
    pub(crate) fn target(
        &self,
        ep: &Endpoint,
        op: &'static str,
        offset: u64,
        len: u64,
        align: u64,
    ) -> std::result::Result<u64, Box<Error>> {
        let same_worker =
            std::ptr::eq(self.inner.worker.as_ptr(), Arc::as_ptr(&ep.inner.worker.shared.inner));
        let fits = offset.checked_add(len).is_some_and(|end| end <= self.inner.len);
        let addr = self.inner.addr.wrapping_add(offset);
        let aligned = align <= 1 || addr % align == 0;
        if same_worker && self.inner.ep_id == ep.inner.id && fits && aligned {
            Ok(addr)
        } else {
            Err(self.target_error(ep, op, offset, len))
        }
    }

    /// Why [`RemoteKey::target`] refused an access.
    #[cold]
    #[inline(never)]
    fn target_error(&self, ep: &Endpoint, op: &'static str, offset: u64, len: u64) -> Box<Error> {
        let same_worker =
            std::ptr::eq(self.inner.worker.as_ptr(), Arc::as_ptr(&ep.inner.worker.shared.inner));
        Box::new(if !same_worker || self.inner.ep_id != ep.inner.id {
            Error::ApiMisuse(format!(
                "{op}: the remote key was unpacked on another endpoint ({})",
                self.inner.peer
            ))
        } else {
            let fits = offset.checked_add(len).is_some_and(|end| end <= self.inner.len);
            let extra = if fits { " (atomics need an 8-byte aligned address)" } else { "" };
            Error::OutOfBounds { op, offset, len, region_len: self.inner.len, extra }
        })
    }

    pub(crate) fn keep(&self) -> crate::op::Extra {
        self.inner.clone()
    }
}

impl Endpoint {
    /// Unpacks a key a peer made with [`MemRegion::pack_key`](super::MemRegion::pack_key) (`ucp_ep_rkey_unpack`), for
    /// use on this endpoint. A key packed in this process (for a worker talking to
    /// another of the process, or to itself) holds its region alive for as long as the
    /// key lives.
    ///
    /// # Errors
    /// [`Error::BadRemoteKey`] for bytes that are not a packed key (envelope, checksum
    /// and UCX's own layout are checked before UCX parses them), that UCX refuses, or
    /// that were packed in this process for a region since dropped;
    /// [`Error::ConnectionReset`] or [`Error::ApiMisuse`] when the endpoint failed or was
    /// closed.
    pub fn unpack_key(&self, bytes: &[u8]) -> Result<RemoteKey> {
        let Decoded { addr, len, origin, ucx, mac } = decode_key(bytes)?;
        if let Some(secret) = self.worker().context().secret() {
            let sealed = mac.is_some_and(|(tag, body)| secret.verify(KEY_MAC_LABEL, &[body], tag));
            if !sealed {
                return Err(Error::Authentication {
                    peer: self.peer().clone(),
                    reason: "the remote key carries no valid MAC under this context's secret".into(),
                });
            }
        }
        let mut region = None;
        if origin.process == process_token() {
            // A region of this process: the key holds it, so that its memory outlives
            // every access through the key (no peer process is involved to promise it).
            let registry = packed();
            region = registry.get(&origin.region).and_then(std::sync::Weak::upgrade);
            let Some(r) = &region else {
                return Err(Error::BadRemoteKey {
                    reason: "the region of this process the key was packed for is gone".into(),
                });
            };
            if MemRegion::viewed(r) {
                return Err(Error::ApiMisuse(
                    "the region of this process the key was packed for is open in a view".into(),
                ));
            }
            drop(registry);
        }
        if let Some(r) = &region {
            // A key of this process's region reaches that region only.
            let (start, end) = (r.ptr as u64, r.ptr as u64 + r.len as u64);
            if addr < start || addr + len > end {
                return Err(Error::BadRemoteKey {
                    reason: format!(
                        "the key's range {addr:#x}+{len} is not inside its region {start:#x}+{}",
                        r.len
                    ),
                });
            }
        }
        let bad = |reason: String| Error::BadRemoteKey { reason };
        match &region {
            None if self.reaches_this_process() => {
                // UCX would copy into this process's memory wherever the key says.
                return Err(bad("a key of another process, for an endpoint that may reach this one".into()));
            }
            Some(_) if !self.reaches_this_process() => {
                return Err(bad(
                    "a key of a region of this process, for an endpoint to another process".into()
                ));
            }
            _ => {}
        }
        // A key of this process's region: its origin and range are the sender's word
        // (anyone given one key of this process can name its other regions), so the UCX
        // part is this process's own, packed anew; the sender's is not read.
        let own_ucx = match &region {
            Some(r) => Some(MemRegion { inner: r.clone() }.with_ucx_key(<[u8]>::to_vec)?),
            None => None,
        };
        let ucx = own_ucx.as_deref().unwrap_or(ucx);
        // Only the transport keys this endpoint's lanes use, each checked (see
        // `ucx_key`).
        let lanes = crate::ucx_key::lane_domains(&self.transport_info()?);
        let ctx = self.worker().context();
        let own = ctx.own_key().map_err(bad)?;
        let ucx =
            crate::ucx_key::sanitize(ucx, &lanes, own, addr..addr + len, region.is_some()).map_err(bad)?;
        self.unpack(addr, len, &ucx, region)
    }

    /// Unpacks a key as `ucp_rkey_pack` made it, from a plain UCX program (or
    /// [`MemRegion::pack_ucx_key`](super::MemRegion::pack_ucx_key)), for the `len` bytes at the peer's address `addr`,
    /// which the peer tells separately: puts, gets and atomics are then checked against
    /// that range.
    ///
    /// # Safety
    /// `bytes` must be a key UCX packed, and the `len` bytes at `addr` must lie inside
    /// the peer's region that it is the key of. ucxkit checks only the key's layout: UCX
    /// trusts the transport keys inside (a zeroed shared-memory key makes UCX 1.13 abort),
    /// and a UCX key carries no range. Over transports that emulate remote access in
    /// software (TCP, the `self` loopback) UCX writes wherever the address points, so a
    /// wrong range corrupts the peer's memory (this process's, when the peer is a worker
    /// of it). [`Endpoint::unpack_key`] takes the range from the peer's
    /// [`MemRegion::pack_key`](super::MemRegion::pack_key) and checks the bytes' checksum, and needs no such promise.
    ///
    /// # Errors
    /// [`Error::BadRemoteKey`] for a range that wraps around the address space, for bytes
    /// that do not follow UCX's key layout (checked before UCX parses them) or that UCX
    /// refuses; [`Error::ConnectionReset`] or [`Error::ApiMisuse`] when the endpoint
    /// failed or was closed.
    pub unsafe fn unpack_ucx_key(&self, bytes: &[u8], addr: u64, len: u64) -> Result<RemoteKey> {
        let bad = |reason: String| Error::BadRemoteKey { reason };
        if addr.checked_add(len).is_none() {
            return Err(bad(format!("region {addr:#x}+{len} wraps around")));
        }
        if bytes.len() > MAX_UCX_KEY {
            return Err(bad(format!("{} bytes is too long for a UCX key", bytes.len())));
        }
        crate::ucx_key::walk(bytes).map_err(bad)?;
        self.unpack(addr, len, bytes, None)
    }

    /// Unpacks UCX key bytes whose layout was checked, for `len` bytes at `addr`; the key
    /// holds `region` (the memory it reaches, when in this process).
    fn unpack(&self, addr: u64, len: u64, ucx: &[u8], region: Option<Arc<MemInner>>) -> Result<RemoteKey> {
        // Each transport's unpacker reads the size of its own key, whatever size byte the
        // layout gives it: zeros behind the bytes keep a short one inside the buffer.
        let mut padded = Vec::with_capacity(ucx.len() + KEY_PAD);
        padded.extend_from_slice(ucx);
        padded.resize(ucx.len() + KEY_PAD, 0);
        let rkey = self.with_handle("unpack_key", |_, h| {
            let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
            // SAFETY: h is live under the lock; padded holds a key whose layout was
            // checked, then KEY_PAD zero bytes; rkey is a valid out-pointer.
            Status(unsafe { sys::ucp_ep_rkey_unpack(h, padded.as_ptr().cast(), &mut rkey) })
                .check()
                .map_err(|s| Error::BadRemoteKey { reason: format!("UCX refused it: {s}") })?;
            Ok(rkey)
        })?;
        Ok(RemoteKey {
            inner: Arc::new(RkeyInner {
                worker: Arc::downgrade(&self.inner.worker.shared.inner),
                ep_id: self.inner.id,
                peer: self.inner.peer.clone(),
                rkey,
                addr,
                len,
                _region: region,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_envelope_roundtrip_and_rejects() {
        let key = ucx_key(&[5, 9]);
        let origin = Origin { process: 7, region: 11 };
        let k = encode_key(0x1000, 4096, origin, &key, None);
        let d = decode_key(&k).unwrap();
        assert_eq!((d.addr, d.len, d.origin, d.ucx), (0x1000, 4096, origin, &key[..]));
        assert!(d.mac.is_none());
        // Sealed: the MAC covers the rest, and only the secret verifies it.
        let secret = Secret::new([4u8; 32]).unwrap();
        let sealed = encode_key(0x1000, 4096, origin, &key, Some(&secret));
        let (tag, body) = decode_key(&sealed).unwrap().mac.unwrap();
        assert!(secret.verify(KEY_MAC_LABEL, &[body], tag));
        assert!(!Secret::new([5u8; 32]).unwrap().verify(KEY_MAC_LABEL, &[body], tag));
        assert!(decode_key(&k[..k.len() - 1]).is_err());
        assert!(decode_key(&[k.clone(), vec![0]].concat()).is_err());
        assert!(decode_key(&[]).is_err());
        for i in 0..k.len() {
            let mut b = k.clone();
            b[i] ^= 0x40;
            assert!(decode_key(&b).is_err(), "flipped byte {i} accepted");
        }
        let wrap = encode_key(u64::MAX - 1, 10, origin, &ucx_key(&[3]), None);
        assert!(decode_key(&wrap).is_err());
    }

    /// A well-formed UCX key with one domain per entry of `sizes`.
    fn ucx_key(sizes: &[u8]) -> Vec<u8> {
        let map: u64 = (1u64 << sizes.len()) - 1;
        let mut v = map.to_ne_bytes().to_vec();
        v.push(0);
        for &n in sizes {
            v.push(n);
            v.extend(std::iter::repeat(0xab).take(n as usize));
        }
        v
    }

    #[test]
    fn ucx_key_layout_is_walked() {
        assert!(crate::ucx_key::walk(&ucx_key(&[3, 0, 17])).is_ok());
        // Optional device data after the domains is allowed.
        assert!(crate::ucx_key::walk(&[ucx_key(&[3]), vec![1, 2, 3]].concat()).is_ok());
        let k = ucx_key(&[3, 17]);
        assert!(crate::ucx_key::walk(&k[..k.len() - 1]).is_err(), "size runs past the end");
        assert!(crate::ucx_key::walk(&k[..8]).is_err());
        let mut lying = k.clone();
        lying[9] = 200;
        assert!(crate::ucx_key::walk(&lying).is_err());
        let mut more_domains = k.clone();
        more_domains[0] = 0xff;
        assert!(crate::ucx_key::walk(&more_domains).is_err());
        let mut bad_type = k;
        bad_type[8] = 200;
        assert!(crate::ucx_key::walk(&bad_type).is_err());
    }
}
