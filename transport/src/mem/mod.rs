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
//! peer's endpoint ([`Endpoint::unpack_key`](crate::Endpoint::unpack_key)). The packed form carries the region's
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
//! Peers may write a region at any time, so its bytes are exposed as a Rust slice only
//! through a [`RegionView`], while nothing else of this process holds the region
//! ([`MemRegion::view`]); otherwise copy in and out with [`MemRegion::read_at`] and
//! [`MemRegion::write_at`], or use the region (or a [`RegionSlice`] of it) as the buffer
//! of an operation. For the same
//! reason several operations may use one region, or overlapping slices of it, at once
//! (receives into one scratch buffer, say): that is memory-safe, and what the bytes hold
//! afterwards is up to the order in which the transfers land.

use std::ops::Range;
use std::sync::Arc;

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, Status};

mod key;
mod stream;
mod view;

pub use key::RemoteKey;
pub use view::RegionView;

use key::{encode_key, next_region_id, packed, process_token, Origin};

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
    /// A [`RegionView`] is open.
    viewed: std::sync::atomic::AtomicBool,
    memh: sys::ucp_mem_h,
    ptr: *mut u8,
    len: usize,
    /// The caller's buffer (`Box::into_raw`), freed after unmapping; None when UCX
    /// allocated the memory. Kept raw so that moving the region never asserts unique
    /// access to memory UCX and peers write.
    owned: Option<*mut [u8]>,
    /// Where the bytes are: host memory, or a device's (`Context::register_device`).
    mem: crate::MemoryType,
    /// The device allocation of a device region, freed (dropped) after unmapping.
    _device: Option<Box<dyn std::any::Any + Send + Sync>>,
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
        Ok(MemRegion::new(self.inner.clone(), memh, ptr, len, Some(raw)))
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
        let region =
            MemRegion::new(self.inner.clone(), memh, attr.address.cast(), len.min(attr.length), None);
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

#[cfg(feature = "cuda")]
impl Context {
    /// Registers device buffer `buf` with UCX (`ucp_mem_map` with its memory type); the
    /// region owns it until the last handle and operation are gone. Operations on the
    /// region or its slices move device memory without UCX looking it up each time, and
    /// its key (`pack_ucx_key`) lets a UCX peer put and get it. Its bytes are read and
    /// written through the driver (`read_at`, `write_at`); it has no host view.
    ///
    /// ucxkit peers do not take keys of device memory yet: [`crate::Endpoint::unpack_key`]
    /// checks keys against the transports of host memory only.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the context's UCX cannot reach the memory;
    /// [`Error::ApiMisuse`] for an empty buffer; the device's error; [`Error::MemMap`]
    /// when UCX refuses the registration.
    pub fn register_device<T: bytemuck::Pod>(
        &self,
        buf: crate::cuda::cudarc::driver::CudaSlice<T>,
    ) -> Result<MemRegion> {
        let mem = buf.memory_type();
        if !self.supports(mem) {
            return Err(Error::Unsupported {
                what: format!("registering {mem} memory: this context's UCX cannot reach it"),
            });
        }
        let len = buf.num_bytes();
        if len == 0 {
            return Err(Error::ApiMisuse("cannot register an empty device buffer".into()));
        }
        buf.ready()?;
        let ptr = buf.stable_ptr().cast_mut();
        // UCX's CUDA domains register with the device's context current.
        let memh = crate::cuda::with_device(buf.ordinal(), || map_of(self, ptr, len, 0, mem))??;
        Ok(MemRegion::on_device(self.inner.clone(), memh, ptr, len, mem, Box::new(buf)))
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
    map_of(ctx, ptr, len, flags, crate::MemoryType::Host)
}

/// [`map`] of memory of type `mem` (passed to UCX when not host memory).
pub(crate) fn map_of(
    ctx: &Context,
    ptr: *mut u8,
    len: usize,
    flags: u32,
    mem: crate::MemoryType,
) -> Result<sys::ucp_mem_h> {
    let mut params = sys::ucp_mem_map_params_t {
        field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS.0
            | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH.0
            | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS.0) as u64,
        address: ptr.cast(),
        length: len,
        flags,
        ..Default::default()
    };
    if mem != crate::MemoryType::Host {
        params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE.0 as u64;
        params.memory_type = mem.ucs();
    }
    let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
    // SAFETY: the context is valid; ptr/len describe memory the caller keeps alive for
    // the registration (or NULL with ALLOCATE); memh is a valid out-pointer.
    Status(unsafe { sys::ucp_mem_map(ctx.inner.handle, &params, &mut memh) })
        .check()
        .map_err(|source| Error::MemMap { len, source })?;
    Ok(memh)
}

impl MemRegion {
    /// The region of mapping `memh` of `len` bytes at `ptr`, owning the caller's buffer
    /// `owned` if any (freed after the unmapping).
    fn new(
        ctx: Arc<ContextInner>,
        memh: sys::ucp_mem_h,
        ptr: *mut u8,
        len: usize,
        owned: Option<*mut [u8]>,
    ) -> MemRegion {
        MemRegion {
            inner: Arc::new(MemInner {
                ctx,
                id: next_region_id(),
                packed: false.into(),
                viewed: false.into(),
                memh,
                ptr,
                len,
                owned,
                mem: crate::MemoryType::Host,
                _device: None,
            }),
        }
    }

    /// The region of mapping `memh` of device memory `mem`, `len` bytes at `ptr`,
    /// keeping `alloc` (the allocation) until after the unmapping.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(
        ctx: Arc<ContextInner>,
        memh: sys::ucp_mem_h,
        ptr: *mut u8,
        len: usize,
        mem: crate::MemoryType,
        alloc: Box<dyn std::any::Any + Send + Sync>,
    ) -> MemRegion {
        let mut r = MemRegion::new(ctx, memh, ptr, len, None);
        let inner = Arc::get_mut(&mut r.inner).expect("a region just made has one handle");
        inner.mem = mem;
        inner._device = Some(alloc);
        r
    }

    /// Where the region's bytes are: host memory, or a device's.
    pub fn memory_type(&self) -> crate::MemoryType {
        self.inner.mem
    }
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
        if self.inner.mem != crate::MemoryType::Host {
            return self.device_copy(offset, out.as_mut_ptr(), out.len(), false);
        }
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
        if self.inner.mem != crate::MemoryType::Host {
            return self.device_copy(offset, data.as_ptr().cast_mut(), data.len(), true);
        }
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.inner.ptr.add(offset), data.len()) }
    }

    /// The copies of [`MemRegion::read_at`] and [`MemRegion::write_at`] for a device
    /// region (`to_device`: `len` host bytes at `host` into the region at `offset`; else
    /// out of it), by the device's driver. A copy the driver fails is logged; a read then
    /// leaves zeros.
    #[cold]
    fn device_copy(&self, offset: usize, host: *mut u8, len: usize, to_device: bool) {
        #[cfg(feature = "cuda")]
        {
            let crate::MemoryType::Cuda { device } = self.inner.mem else { return };
            // SAFETY: the range was checked against the region, whose device memory lives
            // as long as self; `host` is the caller's distinct buffer of `len` bytes.
            let r = unsafe {
                let dev = self.inner.ptr.add(offset);
                if to_device {
                    crate::cuda::copy_to_device(device, dev, std::slice::from_raw_parts(host, len))
                } else {
                    crate::cuda::copy_from_device(device, std::slice::from_raw_parts_mut(host, len), dev)
                }
            };
            if let Err(e) = r {
                tracing::error!(error = %e, offset, len, "copying to or from a device region failed");
                if !to_device {
                    // SAFETY: the caller's buffer of `len` writable bytes.
                    unsafe { std::ptr::write_bytes(host, 0, len) };
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (offset, host, len, to_device);
    }

    /// Copies bytes `range` of an operation's buffer `src` into the region at `offset`,
    /// for a peer to read: staging a buffer that has no byte slice to give (a
    /// [`crate::SharedSlice`] while operations hold other parts of its buffer, say).
    /// Copies of 64 KiB and more bypass this core's cache (non-temporal stores on x86-64)
    /// so that the peer's core reads them from memory: one core reading lines another
    /// holds modified ran at 3 GB/s on a test machine, against 15-26 GB/s this way.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `range` is outside `src`'s bytes or the bytes do not fit
    /// the region at `offset`; [`Error::Unsupported`] for a `src` outside host memory;
    /// nothing is copied then.
    pub fn write_from<B: IoBuf>(&self, offset: usize, src: &B, range: Range<usize>) -> Result<()> {
        crate::device::host_only("write_from", src.memory_type())?;
        crate::device::host_only("write_from", self.inner.mem)?;
        let len = range.len();
        if range.start > range.end || range.end > src.bytes_init() {
            return Err(Error::ApiMisuse(format!(
                "write_from: bytes {range:?} are outside a {} byte buffer",
                src.bytes_init()
            )));
        }
        if !offset.checked_add(len).is_some_and(|end| end <= self.inner.len) {
            return Err(Error::ApiMisuse(format!(
                "write_from: {len} bytes at offset {offset} do not fit a {} byte region",
                self.inner.len
            )));
        }
        // SAFETY: both ranges were checked: `src` has `bytes_init()` readable bytes at
        // its stable pointer (IoBuf's contract), and the region is valid for its length
        // while self lives. `src` may be this region itself: the copy allows overlap.
        unsafe { stream::copy_for_peer(src.stable_ptr().add(range.start), self.inner.ptr.add(offset), len) }
        Ok(())
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
    #[inline]
    fn memory_type(&self) -> crate::MemoryType {
        self.inner.mem
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
    #[inline]
    fn memory_type(&self) -> crate::MemoryType {
        self.region.inner.mem
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
}
