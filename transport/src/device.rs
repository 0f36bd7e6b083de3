//! Buffers outside host memory: what an operation checks before it hands one to UCX,
//! and the memory type it passes.
//!
//! Host buffers pass through [`op_memory`] at no cost (their [`IoBuf::memory_type`] is a
//! constant the compiler folds). Any other buffer is checked on its own, cold path: the
//! context's UCX must reach that memory, the worker binds the device's context (UCX's
//! cuda_copy works only with one current on the calling thread, and the worker's lock
//! is where UCX runs), and the buffer's pending device work is waited for.

use ucx_sys as sys;

use crate::buf::{IoBuf, IoBufMut, MemoryType};
use crate::error::Error;
use crate::worker::WorkerInner;

/// The memory type to pass to UCX for `buf`, the buffer of operation `op` on `inner`'s
/// worker: `None` for host memory (nothing is passed); for other memory, once it is
/// checked and ready (see the module docs).
///
/// # Errors
/// [`Error::Unsupported`] when the context's UCX cannot reach the memory or the build
/// cannot bind its device; [`Error::ApiMisuse`] for a buffer of another device than the
/// one the worker serves; the buffer's own error from [`IoBuf::ready`].
#[inline(always)]
pub(crate) fn op_memory<B: IoBuf + ?Sized>(
    inner: &WorkerInner,
    op: &'static str,
    buf: &B,
) -> Result<Option<sys::ucs_memory_type_t>, Box<Error>> {
    match buf.memory_type() {
        MemoryType::Host => Ok(None),
        mem => prepare(inner, op, mem, &|| buf.ready()).map(Some),
    }
}

/// [`op_memory`] for several buffers of one operation (an iov list): all must be of one
/// memory type.
pub(crate) fn op_memory_all<B: IoBuf>(
    inner: &WorkerInner,
    op: &'static str,
    bufs: &[B],
) -> Result<Option<sys::ucs_memory_type_t>, Box<Error>> {
    let Some(first) = bufs.first() else { return Ok(None) };
    let mem = first.memory_type();
    if let Some(other) = bufs.iter().map(IoBuf::memory_type).find(|m| *m != mem) {
        return Err(Box::new(Error::ApiMisuse(format!(
            "{op}: the buffers of one operation must be of one memory type ({mem} and {other})"
        ))));
    }
    if mem == MemoryType::Host {
        return Ok(None);
    }
    // Checked and bound once for all of them; each buffer's own work waited for.
    prepare(inner, op, mem, &|| bufs.iter().try_for_each(IoBuf::ready)).map(Some)
}

/// Passes `mem` (from [`op_memory`]) to UCX in `param`.
#[inline(always)]
pub(crate) fn set(param: &mut sys::ucp_request_param_t, mem: Option<sys::ucs_memory_type_t>) {
    if let Some(m) = mem {
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE.0 as u32;
        param.memory_type = m;
    }
}

/// Refuses `op` on a buffer of `mem` where a host copy of ucxkit's own would touch it
/// (a received eager payload copied out, a region written in place): such copies are
/// host `memcpy`s, which device memory would crash.
#[inline(always)]
pub(crate) fn host_only(op: &'static str, mem: MemoryType) -> Result<(), Error> {
    match mem {
        MemoryType::Host => Ok(()),
        other => Err(not_host(op, other)),
    }
}

#[cold]
#[inline(never)]
fn not_host(op: &'static str, mem: MemoryType) -> Error {
    Error::Unsupported {
        what: format!("{op} copies on the host and takes host memory only, not {mem} memory"),
    }
}

/// Copies `data` to the start of `buf`, which has room for it, for operation `op`: a
/// host copy for host memory; for device memory, once the buffer is ready, a copy by
/// the device's driver.
///
/// # Errors
/// For device memory only: [`Error::Unsupported`] for a build without the `cuda`
/// feature or a machine without the device; the driver's or the buffer's error.
#[inline(always)]
pub(crate) fn copy_in<B: IoBufMut>(op: &'static str, buf: &mut B, data: &[u8]) -> Result<(), Error> {
    debug_assert!(data.len() <= buf.bytes_total());
    let dst = buf.stable_mut_ptr();
    match buf.memory_type() {
        MemoryType::Host => {
            // SAFETY: the caller checked that buf has room for data; an owned buffer
            // does not overlap the payload it receives.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
            Ok(())
        }
        mem => copy_to_device(op, mem, dst, data, &|| buf.ready()),
    }
}

#[cold]
#[inline(never)]
fn copy_to_device(
    op: &'static str,
    mem: MemoryType,
    dst: *mut u8,
    data: &[u8],
    ready: &dyn Fn() -> Result<(), Error>,
) -> Result<(), Error> {
    if data.is_empty() {
        return Ok(());
    }
    ready()?;
    #[cfg(not(feature = "cuda"))]
    let _ = dst;
    match mem {
        MemoryType::Host => unreachable!("host memory is copied inline"),
        #[cfg(feature = "cuda")]
        MemoryType::Cuda { device } => {
            // SAFETY: dst is the buffer's device memory, with room for data (the
            // caller's check), owned by the operation for the call.
            unsafe { crate::cuda::copy_to_device(device, dst, data) }
        }
        #[cfg(not(feature = "cuda"))]
        MemoryType::Cuda { .. } => Err(Error::Unsupported {
            what: format!("{op} into {mem} memory: ucxkit-transport was built without its `cuda` feature"),
        }),
    }
    .map_err(|e| match e {
        Error::Device { what } => Error::Device { what: format!("{op}: {what}") },
        e => e,
    })
}

#[cold]
#[inline(never)]
fn prepare(
    inner: &WorkerInner,
    op: &'static str,
    mem: MemoryType,
    ready: &dyn Fn() -> Result<(), Error>,
) -> Result<sys::ucs_memory_type_t, Box<Error>> {
    if !inner.ctx.supports(mem) {
        let (a, b, c) = crate::Context::ucx_version();
        return Err(Box::new(Error::Unsupported {
            what: format!(
                "{op} on {mem} memory: this context's UCX ({a}.{b}.{c}) cannot reach it ({})",
                why_unreachable(mem)
            ),
        }));
    }
    inner.bind_device(op, mem)?;
    ready().map_err(Box::new)?;
    Ok(mem.ucs())
}

/// Why a context's UCX reports no support for `mem`: what is missing, as far as this
/// build can tell.
fn why_unreachable(mem: MemoryType) -> String {
    match mem {
        MemoryType::Host => String::new(),
        MemoryType::Cuda { .. } => {
            #[cfg(feature = "cuda")]
            if let Err(e) = crate::cuda::probe() {
                return format!("{e}; and UCX needs its CUDA transports, cuda_copy and cuda_ipc");
            }
            "UCX needs its CUDA transports (cuda_copy, cuda_ipc) and a CUDA driver: a UCX built \
             without CUDA (Debian's) has none, and UCX_TLS or ContextBuilder::transports must \
             include them"
                .into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_passes_nothing_and_cuda_passes_its_type() {
        let mut p = sys::ucp_request_param_t::default();
        set(&mut p, None);
        assert_eq!(p.op_attr_mask, 0);
        set(&mut p, Some(MemoryType::Cuda { device: 0 }.ucs()));
        assert_eq!(p.op_attr_mask, sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE.0 as u32);
        assert_eq!(p.memory_type, sys::UCS_MEMORY_TYPE_CUDA);
        assert_eq!(MemoryType::Host.ucs(), sys::UCS_MEMORY_TYPE_HOST);
    }

    #[test]
    fn host_copies_refuse_device_memory() {
        assert!(host_only("x", MemoryType::Host).is_ok());
        let e = host_only("am recv_data", MemoryType::Cuda { device: 1 }).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Unsupported);
        assert!(e.to_string().contains("cuda:1"), "{e}");
    }
}
