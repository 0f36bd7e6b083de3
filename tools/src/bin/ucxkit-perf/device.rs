//! `--mem`: tag_lat and tag_bw with send or receive buffers on CUDA device 0, as
//! `ucx_perftest -m` runs them. The loops are `bench`'s own, generic over the buffer;
//! this module makes the device buffers (one send buffer, filled, and one receive
//! buffer, shared by every receive of a bandwidth run, as ucx_perftest's are) and picks
//! the instantiation for the memory types asked.
//!
//! Built without the `cuda` feature, `--mem` other than host is refused when the
//! arguments are read; these functions then say so if reached at all.

use crate::bench::Side;
use crate::clock::Clock;
use crate::window::Window;
use crate::AnyResult;
use ucxkit::transport::Endpoint;
use ucxkit_tools::cli::Mem;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use ucxkit::transport::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use ucxkit::transport::cuda::{self, error};
    use ucxkit_tools::cli::MemKind;

    use super::*;
    use crate::bench::{self, Test};

    /// A device buffer several operations may use at once.
    type Dev = Arc<CudaSlice<u8>>;

    /// Device 0's default stream.
    fn stream() -> AnyResult<Arc<CudaStream>> {
        cuda::probe()?;
        Ok(CudaContext::new(0).map_err(error)?.default_stream())
    }

    /// `size` bytes of `fill` on the device, in memory UCX's cuda_ipc can share with the
    /// other process (as ucx_perftest's `cudaMalloc` buffers are).
    fn filled(s: &Arc<CudaStream>, size: usize, fill: u8) -> AnyResult<Dev> {
        let d = zeroed(s, size)?;
        cuda::copy_from_host(&d, 0, &vec![fill; size])?;
        Ok(d)
    }

    /// A device receive buffer of `size` bytes (see [`filled`]).
    fn zeroed(s: &Arc<CudaStream>, size: usize) -> AnyResult<Dev> {
        Ok(Arc::new(cuda::alloc_shareable(s, size)?))
    }

    /// A send buffer of `size` bytes in `kind` memory; host buffers are the tool's
    /// usual payload.
    enum Send {
        Host(&'static [u8]),
        Dev(Dev),
    }

    fn send_buf(s: &Arc<CudaStream>, kind: MemKind, size: usize, fill: u8) -> AnyResult<Send> {
        Ok(match kind {
            MemKind::Host => Send::Host(bench::payload(size, fill, fill)),
            MemKind::Cuda => Send::Dev(filled(s, size, fill)?),
        })
    }

    /// Runs `$body` with `$s` bound to the send buffer and `$r` to a fresh receive
    /// buffer, each of its own type.
    macro_rules! with_bufs {
        ($stream:expr, $mem:expr, $size:expr, $fill:expr, |$s:ident, $r:ident| $body:expr) => {{
            let send = send_buf(&$stream, $mem.send, $size, $fill)?;
            match (send, $mem.recv) {
                (Send::Host($s), MemKind::Host) => {
                    let $r = Vec::with_capacity($size);
                    $body
                }
                (Send::Host($s), MemKind::Cuda) => {
                    let $r = zeroed(&$stream, $size)?;
                    $body
                }
                (Send::Dev($s), MemKind::Host) => {
                    let $r = Vec::with_capacity($size);
                    $body
                }
                (Send::Dev($s), MemKind::Cuda) => {
                    let $r = zeroed(&$stream, $size)?;
                    $body
                }
            }
        }};
    }

    pub(crate) async fn tag_lat_client(
        side: &Side<'_>,
        clock: &mut Clock,
        total: u64,
        size: usize,
    ) -> AnyResult<()> {
        let st = stream()?;
        with_bufs!(st, side.mem, size, 0x5a, |s, r| bench::tag_lat_client(side, clock, total, s, r).await)
    }

    pub(crate) async fn tag_lat_server(side: &Side<'_>, mem: Mem, total: u64, size: usize) -> AnyResult<()> {
        let st = stream()?;
        with_bufs!(st, mem, size, 0xa5, |s, r| bench::tag_lat_server(side, total, s, r).await)
    }

    /// tag_bw's client sending from device memory (a host sender takes the usual path).
    pub(crate) async fn tag_bw_client(run: Window<'_>, ep: &Endpoint, size: usize) -> AnyResult<()> {
        let d = filled(&stream()?, size, 0x5a)?;
        run.keep(|| Ok(false), || bench::send(Test::TagBw, ep, d.clone())).await
    }

    /// tag_bw's server receiving into device memory (a host receiver takes the usual
    /// path): every receive lands in one device buffer, as ucx_perftest's do.
    pub(crate) async fn tag_bw_server(
        side: &Side<'_>,
        total: u64,
        window: usize,
        size: usize,
    ) -> AnyResult<()> {
        let d = zeroed(&stream()?, size)?;
        bench::tag_bw_server(side, total, window, || d.clone()).await
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::*;

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    fn refused<T>() -> AnyResult<T> {
        Err("--mem cuda: this ucxkit-perf was built without the `cuda` feature".into())
    }

    pub(crate) async fn tag_lat_client(_: &Side<'_>, _: &mut Clock, _: u64, _: usize) -> AnyResult<()> {
        refused()
    }

    pub(crate) async fn tag_lat_server(_: &Side<'_>, _: Mem, _: u64, _: usize) -> AnyResult<()> {
        refused()
    }

    pub(crate) async fn tag_bw_client(_: Window<'_>, _: &Endpoint, _: usize) -> AnyResult<()> {
        refused()
    }

    pub(crate) async fn tag_bw_server(_: &Side<'_>, _: u64, _: usize, _: usize) -> AnyResult<()> {
        refused()
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) use imp::*;
