//! CUDA device memory as operation buffers (feature `cuda`).
//!
//! cudarc's device allocations are buffers: a [`CudaSlice`] of plain values
//! (`CudaSlice<u8>`, `CudaSlice<f32>`, ...) implements [`IoBuf`] and [`IoBufMut`], so it
//! is sent, received, put and got like a `Vec<u8>`, owned by the operation and given back
//! with its result; an `Arc<CudaSlice<T>>` is one that several operations may use at once
//! (many sends of one buffer, receives into one scratch buffer), as a
//! [`crate::MemRegion`] is. Each operation on one passes `UCS_MEMORY_TYPE_CUDA` to UCX, waits
//! first for the work queued on the slice's stream, and makes the worker serve the
//! slice's device: from then on the worker's calls into UCX run with the device's primary
//! context current (UCX's cuda_copy needs one). A worker serves one device.
//!
//! CUDA is loaded at run time (`libcuda.so.1`): a build with this feature runs on
//! machines without CUDA, where [`probe`] says what is missing and operations on device
//! buffers are refused with [`crate::ErrorKind::Unsupported`]. So is a UCX built without
//! its CUDA transports (Debian's 1.13): see [`crate::Context::supports`].
//!
//! ```no_run
//! use ucxkit_transport::cuda::{self, cudarc::driver::CudaContext};
//! # async fn f(ep: ucxkit_transport::Endpoint) -> ucxkit_transport::Result<()> {
//! cuda::probe()?;
//! let stream = CudaContext::new(0).map_err(cuda::error)?.default_stream();
//! let grads = stream.alloc_zeros::<f32>(1 << 20).map_err(cuda::error)?;
//! let (sent, grads) = ep.tag_send(7, grads).await;
//! sent?;
//! # drop(grads); Ok(()) }
//! ```

use std::sync::{Arc, OnceLock};

pub use cudarc;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr, DriverError};

use crate::buf::{IoBuf, IoBufMut, MemoryType};
use crate::error::{Error, Result};

/// The CUDA devices this machine has, after checking that CUDA can be used at all.
///
/// # Errors
/// [`Error::Unsupported`] naming what is missing: the driver library (`libcuda.so.1`),
/// a driver of CUDA 12.2 or newer, a driver that initialises, or a device.
pub fn probe() -> Result<usize> {
    static PROBED: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            // SAFETY: loads (and unloads) the driver library by its usual names to see
            // whether it is there; the driver's initialisers are meant to run in any
            // process that loads it.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("no CUDA driver library (libcuda.so.1) on this machine".into());
            }
            let mut version = 0;
            // SAFETY: writes one int; every driver has the function, callable before
            // cuInit.
            let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Err(format!("the CUDA driver does not say its version: {r:?}"));
            }
            if let Some(why) = too_old(version) {
                return Err(why);
            }
            match CudaContext::device_count() {
                Ok(n) if n > 0 => Ok(n as usize),
                Ok(_) => Err("the CUDA driver sees no device".into()),
                Err(e) => Err(format!("the CUDA driver does not initialise: {e}")),
            }
        })
        .clone()
        .map_err(|what| Error::Unsupported { what })
}

/// The oldest driver this build works with (`cuDriverGetVersion`'s form: 1000 x major +
/// 10 x minor): the CUDA bindings are those of 12.2 (cudarc's `cuda-12020`), which call
/// driver functions by their 12.2 names, and calling one an older driver lacks panics.
const OLDEST_DRIVER: i32 = 12020;

/// Why a driver of `version` is refused, if it is older than [`OLDEST_DRIVER`].
fn too_old(version: i32) -> Option<String> {
    let name = |v: i32| format!("{}.{}", v / 1000, (v % 1000) / 10);
    (version < OLDEST_DRIVER).then(|| {
        format!(
            "the CUDA driver supports CUDA {}; this build needs {} or newer",
            name(version),
            name(OLDEST_DRIVER)
        )
    })
}

/// A CUDA driver error as this crate's [`Error`] ([`crate::ErrorKind::Other`]).
pub fn error(e: DriverError) -> Error {
    Error::Device { what: e.to_string() }
}

/// The context that was current on a thread before a worker's call into UCX made its
/// own current.
pub(crate) struct Previous(cudarc::driver::sys::CUcontext);

/// The device context a worker serves, made current on the thread of each of its calls
/// into UCX, and the thread's own given back after.
pub(crate) struct Bound {
    ctx: Arc<CudaContext>,
}

impl Bound {
    /// The primary context of device `device`, retained (once per process and device:
    /// the driver copies of eager payloads and region bytes take it on every call).
    pub(crate) fn new(device: usize) -> Result<Bound> {
        static RETAINED: std::sync::Mutex<Vec<Option<Arc<CudaContext>>>> = std::sync::Mutex::new(Vec::new());
        let n = probe()?;
        if device >= n {
            return Err(Error::Unsupported {
                what: format!("cuda:{device}: this machine has {n} CUDA device(s)"),
            });
        }
        let mut held = RETAINED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.len() < n {
            held.resize(n, None);
        }
        let ctx = match &held[device] {
            Some(c) => c.clone(),
            None => {
                let c = CudaContext::new(device).map_err(error)?;
                held[device] = Some(c.clone());
                c
            }
        };
        Ok(Bound { ctx })
    }

    /// The device's ordinal.
    pub(crate) fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes the context current on this thread; the thread's own, to give back with
    /// [`Bound::unbind`], when it had another one. A thread that had none keeps this one
    /// (the runtime's threads, which call into UCX over and over, then bind it once, not
    /// twice a call). Through the driver directly: cudarc's `bind_to_thread` would first
    /// take (and clear) errors the context recorded, on every call into UCX.
    #[inline]
    pub(crate) fn bind(&self) -> Option<Previous> {
        let want = self.ctx.cu_ctx();
        let now = match cudarc::driver::result::ctx::get_current() {
            Ok(Some(c)) if c == want => return None,
            Ok(c) => c.unwrap_or(std::ptr::null_mut()),
            Err(_) => std::ptr::null_mut(),
        };
        // SAFETY: `want` is the primary context of a device, retained by `self.ctx` for
        // as long as this value lives.
        match unsafe { cudarc::driver::result::ctx::set_current(want) } {
            Ok(()) => (!now.is_null()).then_some(Previous(now)),
            Err(e) => {
                tracing::error!(error = %e, "binding the worker's CUDA context failed");
                None
            }
        }
    }

    /// Makes `prev` current again (the thread's own context, after a call into UCX).
    #[inline]
    pub(crate) fn unbind(prev: Previous) {
        // SAFETY: `prev.0` was current on this thread just before the call, and a context
        // current on a thread is not destroyed under it.
        if let Err(e) = unsafe { cudarc::driver::result::ctx::set_current(prev.0) } {
            tracing::error!(error = %e, "restoring the thread's CUDA context failed");
        }
    }
}

/// Runs `f` with the primary context of device `device` current on this thread, and
/// gives the thread its own context back after.
pub(crate) fn with_device<R>(device: usize, f: impl FnOnce() -> R) -> Result<R> {
    let ctx = Bound::new(device)?;
    let prev = ctx.bind();
    let r = f();
    if let Some(p) = prev {
        Bound::unbind(p);
    }
    Ok(r)
}

/// [`with_device`] for driver calls.
fn on_device<R>(device: usize, f: impl FnOnce() -> std::result::Result<R, DriverError>) -> Result<R> {
    with_device(device, f)?.map_err(error)
}

/// Copies the bytes of `src` to `dst` at byte `at`, on the device, and waits for the
/// copy: for buffers several operations share (`Arc<CudaSlice<u8>>`), whose bytes only
/// the driver reaches, so a shared one can still be written in place.
///
/// # Errors
/// [`Error::ApiMisuse`] when the bytes do not fit `dst` at `at` or the two ranges
/// overlap (nothing is copied); the driver's error.
pub fn copy_into(dst: &Arc<CudaSlice<u8>>, at: usize, src: &crate::Slice<Arc<CudaSlice<u8>>>) -> Result<()> {
    let len = src.len();
    if !at.checked_add(len).is_some_and(|end| end <= dst.len()) {
        return Err(Error::ApiMisuse(format!(
            "copy_into: {len} bytes at {at} do not fit a {} byte device buffer",
            dst.len()
        )));
    }
    let (to, from) = (dst.stable_ptr() as usize + at, src.stable_ptr() as usize);
    if to < from + len && from < to + len && len > 0 {
        return Err(Error::ApiMisuse("copy_into: the source and destination overlap".into()));
    }
    // SAFETY: both ranges lie in live device allocations (checked above; `src`'s by its
    // Slice), kept by the references for the call; they do not overlap; no Rust
    // reference to device memory exists, so writing it cannot alias one.
    on_device(dst.ordinal(), || unsafe {
        cudarc::driver::result::memcpy_dtod_sync(to as u64, from as u64, len)
    })
}

/// Copies host bytes `data` to `dst` at byte `at` and waits for the copy (for shared
/// device buffers, as [`copy_into`]).
///
/// # Errors
/// [`Error::ApiMisuse`] when `data` does not fit `dst` at `at` (nothing is copied); the
/// driver's error.
pub fn copy_from_host(dst: &Arc<CudaSlice<u8>>, at: usize, data: &[u8]) -> Result<()> {
    if !at.checked_add(data.len()).is_some_and(|end| end <= dst.len()) {
        return Err(Error::ApiMisuse(format!(
            "copy_from_host: {} bytes at {at} do not fit a {} byte device buffer",
            data.len(),
            dst.len()
        )));
    }
    let to = (dst.stable_ptr() as usize + at) as *mut u8;
    // SAFETY: the range lies in a live device allocation of that device (checked above),
    // kept by the reference for the call.
    unsafe { copy_to_device(dst.ordinal(), to, data) }
}

/// Copies device memory at `src` on device `device` into `out`, synchronously.
///
/// # Safety
/// `src` must be device memory of `device` readable for `out.len()` bytes during the
/// call.
pub(crate) unsafe fn copy_from_device(device: usize, out: &mut [u8], src: *const u8) -> Result<()> {
    let src = src as usize as cudarc::driver::sys::CUdeviceptr;
    // SAFETY: src is readable for out's length (contract), in the device whose context
    // `on_device` makes current.
    on_device(device, || unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, src) })
}

/// Copies `data` into device memory at `dst` on device `device`, synchronously.
///
/// # Safety
/// `dst` must be device memory of `device` with room for `data.len()` bytes, not in
/// use by anything else during the call.
pub(crate) unsafe fn copy_to_device(device: usize, dst: *mut u8, data: &[u8]) -> Result<()> {
    let dst = dst as usize as cudarc::driver::sys::CUdeviceptr;
    // SAFETY: dst has room for data (contract), in the device whose context `on_device`
    // makes current.
    on_device(device, || unsafe { cudarc::driver::result::memcpy_htod_sync(dst, data) })
}

// SAFETY: a CudaSlice owns its device allocation, which lives (and keeps its address)
// until the slice is dropped; the operation owns the slice, so the pointer stays valid
// for `len * size_of::<T>()` bytes, which are initialized (a safe CudaSlice always is).
unsafe impl<T: bytemuck::Pod> IoBuf for CudaSlice<T> {
    fn stable_ptr(&self) -> *const u8 {
        let (ptr, _record) = self.device_ptr(self.stream());
        ptr as usize as *const u8
    }

    fn bytes_init(&self) -> usize {
        self.num_bytes()
    }

    #[inline]
    fn memory_type(&self) -> MemoryType {
        MemoryType::Cuda { device: self.ordinal() }
    }

    fn ready(&self) -> Result<()> {
        ready(self)
    }
}

/// Waits until no queued device work still writes or reads `s`: where cudarc tracks
/// the slice's uses across several streams (its events), the whole device is
/// synchronised, since a kernel on another stream may write it (before a send) or read
/// it (before a receive); otherwise the slice's own stream.
fn ready<T>(s: &CudaSlice<T>) -> Result<()> {
    if s.context().is_managing_stream_synchronization() {
        s.context().synchronize().map_err(error)
    } else {
        s.stream().synchronize().map_err(error)
    }
}

/// A device buffer of `len` bytes on `stream`, allocated with `cuMemAlloc` rather than
/// from the device's memory pool, which cudarc's own allocations come from where the
/// device has one: UCX's cuda_ipc shares memory between processes through IPC handles
/// (`cuIpcGetMemHandle`), which memory of the default pool does not have, so a buffer
/// another process of this GPU node reads or writes moves device to device only when
/// allocated this way. Zeroed.
///
/// # Errors
/// The driver's error.
pub fn alloc_shareable(stream: &Arc<cudarc::driver::CudaStream>, len: usize) -> Result<CudaSlice<u8>> {
    // SAFETY: a context of the stream's device is current; the pointer returned is a
    // fresh allocation of `len` bytes (at least one), owned from here by the slice made
    // of it, which frees it once (cuMemFreeAsync frees cuMemAlloc memory too).
    on_device(stream.context().ordinal(), || unsafe {
        let ptr = cudarc::driver::result::malloc_sync(len.max(1))?;
        let slice = stream.upgrade_device_ptr::<u8>(ptr, len);
        cudarc::driver::result::memset_d8_sync(ptr, 0, len.max(1))?;
        Ok(slice)
    })
}

// SAFETY: as above, and every value of a Pod type is valid, so UCX may write any bytes;
// the slice's length never changes (a receive of fewer bytes leaves the rest as it was).
unsafe impl<T: bytemuck::Pod> IoBufMut for CudaSlice<T> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.stable_ptr().cast_mut()
    }

    fn bytes_total(&self) -> usize {
        self.num_bytes()
    }

    unsafe fn set_init(&mut self, _n: usize) {}
}

// SAFETY: the Arc keeps the allocation alive while an operation owns the clone; its
// pointer and length never change; as for CudaSlice.
unsafe impl<T: bytemuck::Pod> IoBuf for Arc<CudaSlice<T>> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ref().stable_ptr()
    }

    fn bytes_init(&self) -> usize {
        self.num_bytes()
    }

    #[inline]
    fn memory_type(&self) -> MemoryType {
        self.as_ref().memory_type()
    }

    fn ready(&self) -> Result<()> {
        ready(self.as_ref())
    }
}

// SAFETY: as above. Several operations may write one shared device buffer at once, as
// they may a MemRegion: no Rust reference to device memory exists (the host reaches it
// only through driver copies), so concurrent writes cannot break Rust's aliasing rules;
// what the buffer holds afterwards is up to the order in which the transfers land.
unsafe impl<T: bytemuck::Pod> IoBufMut for Arc<CudaSlice<T>> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.stable_ptr().cast_mut()
    }

    fn bytes_total(&self) -> usize {
        self.num_bytes()
    }

    unsafe fn set_init(&mut self, _n: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver or a device, `probe` says which is missing; with one it counts.
    #[test]
    fn probe_names_what_is_missing_or_counts_devices() {
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(e) => {
                assert_eq!(e.kind(), crate::ErrorKind::Unsupported);
                let s = e.to_string();
                assert!(s.contains("CUDA"), "{s}");
            }
        }
    }

    #[test]
    fn drivers_older_than_the_bindings_are_refused() {
        let table = [
            // (cuDriverGetVersion, refusal naming the version)
            (11080, Some("CUDA 11.8")),
            (12010, Some("CUDA 12.1")),
            (12020, None),
            (12080, None),
            (13000, None),
            (0, Some("CUDA 0.0")),
        ];
        for (version, want) in table {
            let got = too_old(version);
            assert_eq!(got.is_some(), want.is_some(), "{version}: {got:?}");
            if let (Some(g), Some(w)) = (got, want) {
                assert!(g.contains(w) && g.contains("12.2 or newer"), "{g}");
            }
        }
    }

    #[test]
    fn binding_a_device_without_cuda_is_refused_not_a_crash() {
        if probe().is_ok() {
            return;
        }
        let e = Bound::new(0).err().expect("no CUDA here");
        assert_eq!(e.kind(), crate::ErrorKind::Unsupported);
    }
}
