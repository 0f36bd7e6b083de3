//! Registered memory ([`MemRegion`]) and the keys that let peers reach it
//! ([`RemoteKey`]).
//!
//! A region is memory UCX has registered with every transport of its context
//! (`ucp_mem_map`): an owned buffer handed over to it, or memory UCX allocates. It stays
//! registered, and its memory alive, while any handle or operation uses it: operations
//! hold a clone, so dropping the caller's handle mid-operation is harmless.
//!
//! To let a peer read or write a region, pack its key ([`MemRegion::pack_key`]), send
//! the bytes (any way you like: a tag message, an active message), and unpack them on the
//! peer's endpoint ([`Endpoint::unpack_key`]). The packed form carries the region's
//! address and length and a checksum, and UCX's key layout is walked before UCX parses
//! it, so corrupt or truncated bytes are an error; every remote access is checked
//! against the region's bounds before it is posted. A key grants access to memory:
//! accept keys only from peers you trust, as UCX trusts its peers' wire data.
//!
//! A region stays alive while this process's operations use it, and while a key
//! unpacked in this process reaches it (the packed form names the process and region
//! that made it, so a key unpacked where it was packed holds its region; unpacking one
//! whose region is gone is an error). A peer process's accesses ucxkit cannot see: a
//! peer holding the key can reach the memory until the region is dropped, and over
//! transports that emulate remote access in software (TCP, shared memory's `cma`) UCX
//! does not refuse a key whose region is gone, so a late put lands in freed memory. Drop
//! a region only once every peer process given its key is done with it (it said so, or
//! its endpoint is closed), as with any RDMA library.
//!
//! Peers may write a region at any time, so its bytes are not exposed as Rust slices:
//! copy in and out with [`MemRegion::read_at`] and [`MemRegion::write_at`], or use the
//! region (or a [`RegionSlice`] of it) as the buffer of an operation. For the same
//! reason several operations may use one region, or overlapping slices of it, at once
//! (receives into one scratch buffer, say): that is memory-safe, and what the bytes hold
//! afterwards is up to the order in which the transfers land.

use std::ops::Range;
use std::sync::Arc;

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::context::{Context, ContextInner};
use crate::endpoint::Endpoint;
use crate::error::{Error, Peer, Result, Status};
use crate::front::auth::{Secret, MAC_LEN};
use crate::worker::WorkerInner;

/// Memory registered with UCX. Cheap to clone; clones share the registration.
#[derive(Clone)]
pub struct MemRegion {
    inner: Arc<MemInner>,
}

struct MemInner {
    ctx: Arc<ContextInner>,
    /// Unique in this process: names the region in the keys packed for it.
    id: u64,
    /// A key was packed: the region is listed in [`packed`].
    packed: std::sync::atomic::AtomicBool,
    memh: sys::ucp_mem_h,
    ptr: *mut u8,
    len: usize,
    /// The caller's buffer (`Box::into_raw`), freed after unmapping; None when UCX
    /// allocated the memory. Kept raw so that moving the region never asserts unique
    /// access to memory UCX and peers write.
    owned: Option<*mut [u8]>,
}

// SAFETY: the memory handle is used only through context-level calls, which are
// thread-safe (`mt_workers_shared`); the memory itself is accessed through raw copies
// (read_at/write_at) and by UCX, never through shared Rust references.
unsafe impl Send for MemInner {}
// SAFETY: as above.
unsafe impl Sync for MemInner {}

impl Drop for MemInner {
    fn drop(&mut self) {
        if *self.packed.get_mut() {
            packed().remove(&self.id);
        }
        // SAFETY: no operation holds the region any more (each holds a clone); the handle
        // came from ucp_mem_map on this context and is unmapped once. The owned buffer is
        // dropped after this, so UCX never sees freed memory registered.
        let st = Status(unsafe { sys::ucp_mem_unmap(self.ctx.handle, self.memh) });
        if !st.is_ok() {
            tracing::warn!(status = %st, len = self.len, "ucp_mem_unmap failed");
        }
        if let Some(raw) = self.owned.take() {
            // SAFETY: raw came from Box::into_raw in `register` and is freed once, after
            // the registration is gone.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion").field("addr", &self.inner.ptr).field("len", &self.inner.len).finish()
    }
}

impl Context {
    /// Registers `buf` with UCX; the region owns it until the last handle and operation
    /// are gone.
    ///
    /// Works with any buffer and any transport, but UCX's shared-memory transports
    /// cannot map memory that was only registered, so a peer on the same host reaches it
    /// through slower paths (measured here: about a seventh of the put/get bandwidth at
    /// 64 KiB to 1 MiB). For regions peers on this host read or write, prefer
    /// [`Context::alloc`].
    ///
    /// # Errors
    /// [`Error::MemMap`] when UCX refuses the registration.
    pub fn register(&self, buf: impl Into<Box<[u8]>>) -> Result<MemRegion> {
        let owned: Box<[u8]> = buf.into();
        let len = owned.len();
        let raw = Box::into_raw(owned);
        let ptr = raw.cast::<u8>();
        let memh = match map(self, ptr, len, 0) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: raw came from Box::into_raw just above and was never registered.
                drop(unsafe { Box::from_raw(raw) });
                return Err(e);
            }
        };
        Ok(MemRegion {
            inner: Arc::new(MemInner {
                ctx: self.inner.clone(),
                id: next_region_id(),
                packed: false.into(),
                memh,
                ptr,
                len,
                owned: Some(raw),
            }),
        })
    }

    /// Lets UCX allocate and register `len` zeroed bytes (`UCP_MEM_MAP_ALLOCATE`), which
    /// picks memory its transports prefer: shared-memory transports map it directly, so
    /// same-host puts and gets run at memory-copy speed (as `ucx_perftest` measures).
    ///
    /// The region reads as zeros, but only pages that may hold something else are
    /// written: memory fresh from the kernel is left untouched. Where UCX maps anonymous
    /// memory (transports without shared memory), a large region then takes no time to
    /// allocate and occupies memory only as it is used; UCX's shared-memory allocations
    /// are filled by UCX itself when made. (Linux; where `/proc/self/pagemap` cannot be
    /// read or does not behave as expected, every byte is written.)
    ///
    /// # Errors
    /// [`Error::MemMap`] when UCX cannot allocate or register the memory;
    /// [`Error::ApiMisuse`] for `len == 0`.
    pub fn alloc(&self, len: usize) -> Result<MemRegion> {
        if len == 0 {
            return Err(Error::ApiMisuse("cannot allocate an empty memory region".into()));
        }
        let memh = map(self, std::ptr::null_mut(), len, sys::UCP_MEM_MAP_ALLOCATE.0 as u32)?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS.0 | sys::UCP_MEM_ATTR_FIELD_LENGTH.0) as u64,
            ..Default::default()
        };
        // SAFETY: memh was just mapped; attr is a valid out-parameter.
        let st = Status(unsafe { sys::ucp_mem_query(memh, &mut attr) });
        let region = MemRegion {
            inner: Arc::new(MemInner {
                ctx: self.inner.clone(),
                id: next_region_id(),
                packed: false.into(),
                memh,
                ptr: attr.address.cast(),
                len: len.min(attr.length),
                owned: None,
            }),
        };
        st.check().map_err(|source| Error::MemMap { len, source })?;
        if region.inner.ptr.is_null() {
            return Err(Error::MemMap { len, source: Status::INVALID_PARAM });
        }
        // SAFETY: UCX allocated at least `len` writable bytes at ptr for this region,
        // which nothing else knows of yet.
        unsafe { zero_used_pages(region.inner.ptr, region.inner.len) };
        Ok(region)
    }
}

/// Makes the `len` bytes at `ptr`, memory UCX has just allocated, read as zeros while
/// leaving alone the pages that already do.
///
/// Depending on its allocation methods UCX takes memory from the kernel (new anonymous
/// mappings, new shared-memory files or segments), whose pages read as zeros until
/// written, or from the heap, whose pages may hold old data. Writing zeros over all of it
/// would commit every page at once (a GiB region: a GiB resident, and a few hundred ms,
/// before its first use). The page map tells which pages are mapped in or swapped out;
/// only those are written. A page that is neither was never written since it was mapped
/// or discarded, except in a file mapping, where it shows what the file holds: UCX maps
/// only files it has just created, so they hold zeros too.
///
/// Where the page map cannot be read, or failed [`page_map_works`], every byte is
/// written.
///
/// # Safety
/// `ptr..ptr + len` must be writable memory that nothing else uses yet.
unsafe fn zero_used_pages(ptr: *mut u8, len: usize) {
    let start = ptr as usize;
    let end = start + len;
    let written = (|| -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let page = page_map_works().ok_or(std::io::ErrorKind::Unsupported)?;
        // Opened for each call, not kept: a descriptor kept open would, in a child forked
        // after it was opened, still read the parent's page map.
        let map = std::fs::File::open("/proc/self/pagemap")?;
        let (first, last) = (start / page, (end - 1) / page);
        let mut entries = vec![0u8; (last + 1 - first).min(PAGEMAP_BATCH) * 8];
        let mut p = first;
        while p <= last {
            let n = (last + 1 - p).min(PAGEMAP_BATCH);
            map.read_exact_at(&mut entries[..n * 8], (p * 8) as u64)?;
            // Pages that may hold data other than zeros are zeroed in runs.
            let mut run: Option<usize> = None;
            for (i, e) in entries[..n * 8].chunks_exact(8).enumerate() {
                match (entry_used(e), run) {
                    (true, None) => run = Some(p + i),
                    (false, Some(r)) => {
                        // SAFETY: within the caller's range (clamped), which is writable.
                        unsafe { zero_pages(start, end, page, r, p + i) };
                        run = None;
                    }
                    _ => {}
                }
            }
            if let Some(r) = run {
                // SAFETY: as above.
                unsafe { zero_pages(start, end, page, r, p + n) };
            }
            p += n;
        }
        Ok(())
    })();
    if written.is_err() {
        // SAFETY: the caller's range is writable.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
    }
}

/// The page size, if this process's page map tells written pages from untouched ones:
/// checked once on a mapping of its own (one page written, three not), so that a page map
/// that reads but does not mean what it should (an emulator passing the host's through)
/// makes [`zero_used_pages`] write everything.
fn page_map_works() -> Option<usize> {
    static WORKS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| {
        use std::os::unix::fs::FileExt;
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return None,
        };
        let m = SmallPageMapping::new(4 * page)?;
        // SAFETY: the second page lies inside the mapping.
        unsafe { m.ptr.add(page).write_volatile(1) };
        let mut entries = [0u8; 32];
        std::fs::File::open("/proc/self/pagemap")
            .and_then(|f| f.read_exact_at(&mut entries, (m.ptr as usize / page * 8) as u64))
            .ok()?;
        let used: Vec<bool> = entries.chunks_exact(8).map(entry_used).collect();
        (used == [false, true, false, false]).then_some(page)
    })
}

/// Whether a page-map entry (8 bytes) shows a page mapped in or swapped out.
fn entry_used(e: &[u8]) -> bool {
    let e = u64::from_ne_bytes(e.try_into().expect("8-byte page-map entry"));
    e & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED) != 0
}

/// A private anonymous mapping of small pages (no transparent huge pages), unmapped on
/// drop: the ground truth [`page_map_works`] checks the page map against.
struct SmallPageMapping {
    ptr: *mut u8,
    len: usize,
}

impl SmallPageMapping {
    fn new(len: usize) -> Option<SmallPageMapping> {
        // SAFETY: a new private anonymous mapping, owned by the value returned.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: the mapping just made. Failure leaves huge pages allowed, which only
        // makes the check fail (and every byte be written).
        unsafe { libc::madvise(m, len, libc::MADV_NOHUGEPAGE) };
        Some(SmallPageMapping { ptr: m.cast(), len })
    }
}

impl Drop for SmallPageMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping this value owns, no longer used.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Page-map entries read at a time (8 bytes each).
const PAGEMAP_BATCH: usize = 4096;
/// Page-map entry bit: the page is mapped in.
const PAGEMAP_PRESENT: u64 = 1 << 63;
/// Page-map entry bit: the page is swapped out.
const PAGEMAP_SWAPPED: u64 = 1 << 62;

/// Writes zeros over pages `from..to` (page numbers of size `page`), clamped to the
/// byte range `start..end`.
///
/// # Safety
/// `start..end` must be writable.
unsafe fn zero_pages(start: usize, end: usize, page: usize, from: usize, to: usize) {
    let a = (from * page).max(start);
    let b = (to * page).min(end);
    if a < b {
        // SAFETY: a..b lies within start..end, which the caller guarantees writable.
        unsafe { std::ptr::write_bytes(a as *mut u8, 0, b - a) };
    }
}

fn map(ctx: &Context, ptr: *mut u8, len: usize, flags: u32) -> Result<sys::ucp_mem_h> {
    let params = sys::ucp_mem_map_params_t {
        field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS.0
            | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH.0
            | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS.0) as u64,
        address: ptr.cast(),
        length: len,
        flags,
        ..Default::default()
    };
    let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
    // SAFETY: the context is valid; ptr/len describe memory the caller keeps alive for
    // the registration (or NULL with ALLOCATE); memh is a valid out-pointer.
    Status(unsafe { sys::ucp_mem_map(ctx.inner.handle, &params, &mut memh) })
        .check()
        .map_err(|source| Error::MemMap { len, source })?;
    Ok(memh)
}

impl MemRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The start address (what peers address through the key).
    pub fn addr(&self) -> u64 {
        self.inner.ptr as u64
    }

    /// The raw memory handle (`ucp_mem_h`), for UCX calls ucxkit does not wrap (packing
    /// a key for a plain UCX peer, say): valid while this region, a slice of it or an
    /// operation using it is alive; do not unmap it.
    pub fn as_raw(&self) -> sys::ucp_mem_h {
        self.inner.memh
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: in bounds (checked); the region's memory lives as long as self, and out
        // is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.inner.ptr.add(offset), out.as_mut_ptr(), out.len()) }
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.inner.ptr.add(offset), data.len()) }
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v);
        v
    }

    /// A sub-range, usable as an operation's buffer.
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn slice(&self, range: Range<usize>) -> RegionSlice {
        assert!(range.start <= range.end, "slice start {} after end {}", range.start, range.end);
        self.check(range.start, range.end - range.start);
        RegionSlice { region: self.clone(), offset: range.start, len: range.end - range.start }
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.inner.len),
            "{len} bytes at offset {offset} are outside a {} byte region",
            self.inner.len
        );
    }

    /// Packs the key a peer needs to reach this region (`ucp_rkey_pack`), with the
    /// region's address and length, into bytes to send to it. Keep the region until
    /// every peer process given the key is done with it (see the module docs).
    ///
    /// # Errors
    /// [`Error::Worker`] when UCX cannot pack the key.
    pub fn pack_key(&self) -> Result<Vec<u8>> {
        if !self.inner.packed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            packed().insert(self.inner.id, Arc::downgrade(&self.inner));
        }
        let origin = Origin { process: process_token(), region: self.inner.id };
        let secret = self.inner.ctx.secret.as_ref();
        self.with_ucx_key(|rkey| encode_key(self.addr(), self.len() as u64, origin, rkey, secret))
    }

    /// The key exactly as `ucp_rkey_pack` makes it, without the address, length and
    /// checksum [`MemRegion::pack_key`] adds: for a plain UCX program, which unpacks it
    /// with `ucp_ep_rkey_unpack` and addresses the region at [`MemRegion::addr`] (up to
    /// [`MemRegion::len`] bytes). Between ucxkit processes use [`MemRegion::pack_key`].
    ///
    /// # Errors
    /// [`Error::Worker`] when UCX cannot pack the key.
    pub fn pack_ucx_key(&self) -> Result<Vec<u8>> {
        self.with_ucx_key(<[u8]>::to_vec)
    }

    /// Packs the region's key (`ucp_rkey_pack`) and hands the bytes to `f`.
    fn with_ucx_key<T>(&self, f: impl FnOnce(&[u8]) -> T) -> Result<T> {
        let mut buf: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memory handle are valid; out-pointers are valid.
        Status(unsafe { sys::ucp_rkey_pack(self.inner.ctx.handle, self.inner.memh, &mut buf, &mut size) })
            .check()
            .map_err(|source| Error::Worker { op: "ucp_rkey_pack", source })?;
        // SAFETY: UCX returned `size` readable bytes at buf.
        let out = f(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) });
        // SAFETY: releases the buffer UCX allocated above, once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(out)
    }
}

/// A sub-range of a [`MemRegion`]; holds the region alive.
#[derive(Clone, Debug)]
pub struct RegionSlice {
    region: MemRegion,
    offset: usize,
    len: usize,
}

impl RegionSlice {
    /// The region it is part of.
    pub fn region(&self) -> &MemRegion {
        &self.region
    }

    /// Offset into the region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

// SAFETY: a region's memory is fixed for its lifetime, which the value extends; all of
// it is initialized (zeroed or supplied by the caller).
unsafe impl IoBuf for MemRegion {
    fn stable_ptr(&self) -> *const u8 {
        self.inner.ptr
    }
    fn bytes_init(&self) -> usize {
        self.inner.len
    }
}

// SAFETY: as above; every byte is writable.
unsafe impl IoBufMut for MemRegion {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.inner.ptr
    }
    fn bytes_total(&self) -> usize {
        self.inner.len
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

// SAFETY: as for MemRegion, for the slice's bounds (checked when it was made).
unsafe impl IoBuf for RegionSlice {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: offset is within the region.
        unsafe { self.region.inner.ptr.add(self.offset) }
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for RegionSlice {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: offset is within the region.
        unsafe { self.region.inner.ptr.add(self.offset) }
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

const KEY_MAGIC: u32 = 0x524b_4355; // "UCKR"
const KEY_VERSION: u8 = 2;
const KEY_HEADER: usize = 4 + 1 + 3 + 8 + 8 + 8 + 8 + 4;

/// Where a packed key comes from: the process (a random token drawn once per process)
/// and the region in it. A key unpacked in the process that packed it holds its region
/// (see [`Endpoint::unpack_key`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Origin {
    process: u64,
    region: u64,
}

/// This process's token in [`Origin`].
fn process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(crate::endpoint::nonce)
}

fn next_region_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The regions of this process whose key was packed, by id, for keys unpacked here.
fn packed() -> std::sync::MutexGuard<'static, std::collections::HashMap<u64, std::sync::Weak<MemInner>>> {
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
fn encode_key(addr: u64, len: u64, origin: Origin, rkey: &[u8], secret: Option<&Secret>) -> Vec<u8> {
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
    /// Unpacks a key a peer made with [`MemRegion::pack_key`] (`ucp_ep_rkey_unpack`), for
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
            region = packed().get(&origin.region).and_then(std::sync::Weak::upgrade);
            if region.is_none() {
                return Err(Error::BadRemoteKey {
                    reason: "the region of this process the key was packed for is gone".into(),
                });
            }
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
        if region.is_none() && self.reaches_this_process() {
            // UCX would copy into this process's memory wherever the key says.
            return Err(bad("a key of another process, for an endpoint that may reach this one".into()));
        }
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
    /// [`MemRegion::pack_ucx_key`]), for the `len` bytes at the peer's address `addr`,
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
    /// [`MemRegion::pack_key`] and checks the bytes' checksum, and needs no such promise.
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
    fn used_pages_are_zeroed_and_untouched_ones_left_alone() {
        assert!(page_map_works().is_some(), "this machine's page map failed the check");
        // Written pages (mapped in) are zeroed, partial pages at both ends included.
        let mut v = vec![0xffu8; (1 << 20) + 3];
        let (a, b) = (v.len() / 3, v.len() - 5);
        // SAFETY: a slice of v, which nothing else uses.
        unsafe { zero_used_pages(v[a..b].as_mut_ptr(), b - a) };
        assert!(v[..a].iter().all(|&x| x == 0xff));
        assert!(v[a..b].iter().all(|&x| x == 0));
        assert!(v[b..].iter().all(|&x| x == 0xff));

        // A fresh anonymous mapping's pages are neither written nor mapped in. One page
        // written in the middle: only it is zeroed again.
        let m = SmallPageMapping::new(64 << 20).unwrap();
        // SAFETY: the page written lies inside the mapping, which nothing else uses.
        unsafe {
            m.ptr.add(m.len / 2).write(7);
            zero_used_pages(m.ptr, m.len);
        }
        // Counted before the bytes are read: reading maps in the zero page everywhere.
        let used = used_pages(m.ptr, m.len);
        // SAFETY: the mapping's bytes, which nothing writes meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(m.ptr, m.len) };
        assert!(bytes.iter().all(|&x| x == 0));
        assert_eq!(used, 1, "pages of a fresh mapping made resident");
    }

    /// Pages of `p..p + len` mapped in or swapped out, from the page map.
    fn used_pages(p: *mut u8, len: usize) -> usize {
        use std::os::unix::fs::FileExt;
        let page = page_map_works().unwrap();
        let map = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut buf = vec![0u8; len / page * 8];
        map.read_exact_at(&mut buf, (p as usize / page * 8) as u64).unwrap();
        buf.chunks_exact(8).filter(|e| entry_used(e)).count()
    }

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
