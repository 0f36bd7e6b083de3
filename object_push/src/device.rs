//! Objects in CUDA device memory (feature `cuda`).
//!
//! A store that hands out device allocations (`ObjectStore::device_for`, as
//! `DeviceStore` does) has its objects pulled straight into device memory: each
//! chunk is received into its place in the object's device buffer (UCX moves it with
//! its CUDA transports: cuda_ipc between processes of one GPU node, device to device,
//! without host staging), copied to the host only to be checked against the holder's
//! checksum where the node checks chunks ([`crate::Verify`]). A sealed device object
//! (`Object::on_device`, `ObjectNode::put_device`) is served from device memory the
//! same way. Such an object is not relayed while it arrives (as one arriving into a
//! file is not): receivers of a broadcast pull it from its holders.
//!
//! Without the feature the device types of this module are uninhabited, so the
//! transfer code that handles them compiles to nothing, and the items above do not
//! exist.

use bytes::BytesMut;
use ucxkit_transport::Either;

use crate::error::Result;
use crate::sums::Layout;

/// A chunk's receive buffer: host memory, or a part of a device buffer.
pub(crate) type Piece = Either<BytesMut, DevicePiece>;

/// The length of `p`.
pub(crate) fn piece_len(p: &Piece) -> usize {
    match p {
        Either::Left(b) => b.len(),
        Either::Right(d) => device_len(d),
    }
}

/// Whether chunk `k` in `p` checks out against `layout` (always, unless `verify`).
pub(crate) fn verify_piece(layout: &Layout, k: u64, p: &Piece, verify: bool) -> Result<bool> {
    if !verify {
        return Ok(true);
    }
    Ok(match p {
        Either::Left(b) => layout.verify(k, b),
        Either::Right(d) => layout.verify(k, &host_copy(d)?),
    })
}

#[cfg(feature = "cuda")]
pub(crate) use imp::*;
#[cfg(feature = "cuda")]
pub use imp::{DeviceBuf, DeviceStore};

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use ucxkit_transport::cuda::cudarc::driver::{CudaSlice, CudaStream};
    use ucxkit_transport::cuda::error as device_error;
    use ucxkit_transport::{IoBuf, Slice};

    use crate::error::{Error, Result};
    use crate::id::ObjectId;
    use crate::store::{ledger_methods, Ledger, Object, ObjectStore};

    /// A device buffer holding an object's bytes, shared by the transfers that read it.
    pub type DeviceBuf = Arc<CudaSlice<u8>>;

    /// A part of an object's device buffer (or of a buffer of its own).
    pub(crate) type DevicePiece = Slice<DeviceBuf>;

    fn failed(what: &str) -> impl Fn(ucxkit_transport::cuda::cudarc::driver::DriverError) -> Error + '_ {
        move |e| Error::Store(format!("{what}: {}", device_error(e)))
    }

    pub(crate) fn device_len(d: &DevicePiece) -> usize {
        d.len()
    }

    pub(crate) fn buf_len(d: &DeviceBuf) -> usize {
        d.len()
    }

    /// The bytes of `d`, copied to the host.
    pub(crate) fn host_copy(d: &DevicePiece) -> Result<Vec<u8>> {
        let whole = d.get_ref();
        let stream = whole.stream();
        let v =
            stream.clone_dtoh(&whole.slice(d.begin()..d.end())).map_err(failed("reading a chunk back"))?;
        stream.synchronize().map_err(failed("reading a chunk back"))?;
        Ok(v)
    }

    /// Bytes `range` of `buf` as a piece to receive into, in place.
    pub(crate) fn piece_of(buf: &DeviceBuf, range: std::ops::Range<usize>) -> Result<DevicePiece> {
        buf.clone().into_slice(range).map_err(|(e, _)| Error::Store(format!("a device chunk: {e}")))
    }

    /// A device piece of `len` bytes of its own, on `buf`'s stream (for a chunk whose
    /// place a receive abandoned may still write).
    pub(crate) fn fresh(buf: &DeviceBuf, len: usize) -> Result<DevicePiece> {
        let stream = buf.stream();
        let own = stream.alloc_zeros::<u8>(len.max(1)).map_err(failed("a device chunk"))?;
        stream.synchronize().map_err(failed("a device chunk"))?;
        Arc::new(own).into_slice(..len).map_err(|(e, _)| Error::Store(format!("a device chunk: {e}")))
    }

    /// Puts piece `d`, checked, at `at` in `buf`: nothing to do when it was received
    /// there. A piece of its own stands for a chunk whose receive in place was
    /// abandoned and may still write there: it is kept in `apart`, for [`sealed`].
    pub(crate) fn place(buf: &DeviceBuf, at: usize, d: DevicePiece, apart: &mut Vec<(usize, DevicePiece)>) {
        if !(Arc::ptr_eq(d.get_ref(), buf) && d.begin() == at) {
            apart.push((at, d));
        }
    }

    /// The buffer to seal an object received into `buf` in: `buf` itself, or, with
    /// chunks kept `apart` (see [`place`]), a copy of it in an allocation of its own with
    /// those chunks in their places, so that no late write of an abandoned receive
    /// reaches the sealed bytes.
    pub(crate) fn sealed(buf: &DeviceBuf, apart: &[(usize, DevicePiece)]) -> Result<DeviceBuf> {
        if apart.is_empty() || buf.is_empty() {
            return Ok(buf.clone());
        }
        let stream = buf.stream();
        let own = Arc::new(stream.alloc_zeros::<u8>(buf.len()).map_err(failed("a device copy"))?);
        stream.synchronize().map_err(failed("a device copy"))?;
        let copy = |at: usize, d: &DevicePiece| {
            ucxkit_transport::cuda::copy_into(&own, at, d)
                .map_err(|e| Error::Store(format!("sealing a device object: {e}")))
        };
        copy(0, &piece_of(buf, 0..buf.len())?)?;
        for (at, d) in apart {
            copy(*at, d)?;
        }
        Ok(own)
    }

    /// `buf`, its bytes `data` (an object that came inline).
    pub(crate) fn upload(buf: DeviceBuf, data: &[u8]) -> Result<DeviceBuf> {
        ucxkit_transport::cuda::copy_from_host(&buf, 0, data)
            .map_err(|e| Error::Store(format!("copying an object to the device: {e}")))?;
        Ok(buf)
    }

    /// The device buffer to pull object `id` of `size` bytes into, if the store gives one.
    pub(crate) fn dest(store: &dyn ObjectStore, id: &ObjectId, size: u64) -> Result<Option<DeviceBuf>> {
        store.device_for(id, size)
    }

    /// Chunk `range` of a sealed device object, to send from device memory.
    pub(crate) fn chunk_of(o: &Object, range: std::ops::Range<usize>) -> Option<Result<DevicePiece>> {
        o.device().map(|d| piece_of(d, range))
    }

    /// Objects in device memory, up to a capacity in bytes: pulls land in allocations
    /// on `stream`'s device that UCX's cuda_ipc can share with other processes
    /// ([`ucxkit_transport::cuda::alloc_shareable`]); empty objects stay in host memory.
    pub struct DeviceStore {
        ledger: Ledger,
        stream: Arc<CudaStream>,
    }

    impl std::fmt::Debug for DeviceStore {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DeviceStore").field("ledger", &self.ledger).finish()
        }
    }

    impl DeviceStore {
        /// A store without a limit, allocating on `stream`.
        pub fn new(stream: Arc<CudaStream>) -> DeviceStore {
            DeviceStore { ledger: Ledger::new(None), stream }
        }

        /// A store that holds at most `bytes` bytes, allocating on `stream`.
        pub fn with_capacity(stream: Arc<CudaStream>, bytes: u64) -> DeviceStore {
            DeviceStore { ledger: Ledger::new(Some(bytes)), stream }
        }

        /// Bytes held and reserved.
        pub fn used(&self) -> u64 {
            self.ledger.used()
        }
    }

    impl ObjectStore for DeviceStore {
        ledger_methods!();

        fn device_for(&self, _id: &ObjectId, size: u64) -> Result<Option<DeviceBuf>> {
            if size == 0 {
                return Ok(None);
            }
            let len =
                usize::try_from(size).map_err(|_| Error::Store(format!("{size} bytes do not fit memory")))?;
            // Memory cuda_ipc can share, so that other processes of this node pull it
            // device to device.
            let buf = ucxkit_transport::cuda::alloc_shareable(&self.stream, len)
                .map_err(|e| Error::Store(format!("allocating device memory: {e}")))?;
            Ok(Some(Arc::new(buf)))
        }
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) use none::*;

/// The device types without the `cuda` feature: uninhabited.
#[cfg(not(feature = "cuda"))]
mod none {
    use std::convert::Infallible;

    use crate::error::Result;
    use crate::id::ObjectId;
    use crate::store::{Object, ObjectStore};

    pub(crate) type DeviceBuf = Infallible;
    pub(crate) type DevicePiece = Infallible;

    pub(crate) fn device_len(d: &DevicePiece) -> usize {
        match *d {}
    }
    pub(crate) fn buf_len(d: &DeviceBuf) -> usize {
        match *d {}
    }
    pub(crate) fn host_copy(d: &DevicePiece) -> Result<Vec<u8>> {
        match *d {}
    }
    pub(crate) fn piece_of(buf: &DeviceBuf, _range: std::ops::Range<usize>) -> Result<DevicePiece> {
        match *buf {}
    }
    pub(crate) fn fresh(buf: &DeviceBuf, _len: usize) -> Result<DevicePiece> {
        match *buf {}
    }
    pub(crate) fn place(
        buf: &DeviceBuf,
        _at: usize,
        _d: DevicePiece,
        _apart: &mut Vec<(usize, DevicePiece)>,
    ) {
        match *buf {}
    }
    pub(crate) fn sealed(buf: &DeviceBuf, _apart: &[(usize, DevicePiece)]) -> Result<DeviceBuf> {
        match *buf {}
    }
    pub(crate) fn upload(buf: DeviceBuf, _data: &[u8]) -> Result<DeviceBuf> {
        match buf {}
    }
    pub(crate) fn dest(_: &dyn ObjectStore, _: &ObjectId, _: u64) -> Result<Option<DeviceBuf>> {
        Ok(None)
    }
    pub(crate) fn chunk_of(_: &Object, _: std::ops::Range<usize>) -> Option<Result<DevicePiece>> {
        None
    }
}
