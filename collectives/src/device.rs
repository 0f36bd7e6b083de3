//! Collectives on CUDA device buffers (feature `cuda`), staged through host memory.
//!
//! [`staged`] runs any operation of the crate on a device buffer: it copies the buffer to
//! the host, runs the call given on that copy, and copies the result back, into the same
//! device buffer when the result has its length (allreduce, broadcast, all-to-all,
//! scan, ...) and into a new one on the buffer's stream otherwise (allgather, gather,
//! reduce-scatter). Reductions thus run on the host's vectorised kernels
//! ([`crate::reduce`]) and transfers over the host paths the cost model measured; the
//! price is two copies over the device's link (PCIe or NVLink-C2C), which dominate
//! above a few MiB. That is the route this build takes for every device buffer, and
//! [`ROUTE`] names it for tools to report.

use std::future::Future;

use ucxkit_transport::cuda::cudarc::driver::{CudaSlice, DeviceRepr};
use ucxkit_transport::cuda::error as device_error;

use crate::dtype::Element;
use crate::error::{CallResult, Error};

/// How this build moves a collective's device buffer: through host memory.
pub const ROUTE: &str = "host-staged";

/// A collective on a device buffer that failed: the error, and the device buffer (as it
/// was when the call failed, the host copy it worked on dropped; when copying the result
/// back failed, partly written).
#[derive(Debug)]
pub struct DeviceFailed<T> {
    /// What went wrong.
    pub error: Error,
    /// The caller's device buffer.
    pub buf: CudaSlice<T>,
}

impl<T> std::fmt::Display for DeviceFailed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T: std::fmt::Debug> std::error::Error for DeviceFailed<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Runs `call` (one of the communicator's operations, on a host buffer) on device
/// buffer `buf`, staged through host memory (see the module docs), and returns the
/// result in device memory: `buf` itself when the result has its length, else a new
/// buffer on its stream.
///
/// ```no_run
/// # async fn f(comm: ucxkit_collectives::Communicator,
/// #     grads: ucxkit_transport::cuda::cudarc::driver::CudaSlice<f32>)
/// #     -> Result<(), ucxkit_collectives::device::DeviceFailed<f32>> {
/// use ucxkit_collectives::{device, ReduceOp};
/// let grads = device::staged(grads, |v| comm.allreduce(v, ReduceOp::Sum)).await?;
/// # let _ = grads; Ok(()) }
/// ```
///
/// # Errors
/// The call's error (with `buf` unchanged), or the device's ([`Error::Device`]: a copy
/// failed).
pub async fn staged<T, F, Fut>(mut buf: CudaSlice<T>, call: F) -> Result<CudaSlice<T>, DeviceFailed<T>>
where
    T: Element + DeviceRepr,
    F: FnOnce(Vec<T>) -> Fut,
    Fut: Future<Output = CallResult<T>>,
{
    let stream = buf.stream().clone();
    let host = match stream.clone_dtoh(&buf).and_then(|v| stream.synchronize().map(|()| v)) {
        Ok(v) => v,
        Err(e) => return Err(DeviceFailed { error: Error::Device(device_error(e)), buf }),
    };
    let out = match call(host).await {
        Ok(v) => v,
        Err(f) => return Err(DeviceFailed { error: f.error, buf }),
    };
    let written = if out.len() == buf.len() {
        stream.memcpy_htod(&out, &mut buf).map(|()| None)
    } else if out.is_empty() {
        // The driver allocates no zero bytes.
        stream.null::<T>().map(Some)
    } else {
        stream.clone_htod(&out).map(Some)
    };
    match written.and_then(|w| stream.synchronize().map(|()| w)) {
        Ok(None) => Ok(buf),
        Ok(Some(new)) => Ok(new),
        Err(e) => Err(DeviceFailed { error: Error::Device(device_error(e)), buf }),
    }
}
