//! CUDA device memory as operation buffers (feature `cuda`; needs a GPU): device to
//! device, host to device and device to host over tags, active messages and put/get,
//! slices of device buffers, typed device buffers, and the refusals a device buffer
//! meets where its context's transports cannot reach it.
//!
//! Without a CUDA driver, a device, or a UCX with CUDA transports, each test prints
//! `GPU test skipped: REASON` and passes (fails, with `UCXKIT_REQUIRE_GPU` set); the
//! test command runs these through scripts/gpu-check, which reports how many skipped.

use ucxkit_testkit as common;

use std::sync::Arc;
use std::time::Duration;

use common::{pair_with, payload};
use ucxkit::transport::cuda::{self, cudarc::driver::CudaContext, cudarc::driver::CudaStream};
use ucxkit::transport::{
    tag, Context, Endpoint, ErrorKind, ErrorMode, IoBuf, MemoryType, ProgressMode, Worker,
};

const T: Duration = Duration::from_secs(60);

/// Transports with UCX's CUDA ones, shared memory and TCP on loopback.
const TLS: &str = "cuda_copy,cuda_ipc,posix,cma,self,tcp";

/// Sizes from UCX's eager range to well into rendezvous.
const SIZES: [usize; 4] = [8, 64 << 10, 1 << 20, 16 << 20];

/// Prints why the test cannot run; with `UCXKIT_REQUIRE_GPU` set (scripts/gpu-check sets
/// it where the machine lists a GPU), fails instead.
fn skip(reason: &str) {
    if std::env::var_os("UCXKIT_REQUIRE_GPU").is_some() {
        panic!("a GPU is required here (UCXKIT_REQUIRE_GPU) but: {reason}");
    }
    println!("GPU test skipped: {reason}");
}

/// Device 0's stream, or `None` (the reason printed) where the test cannot run.
fn device() -> Option<Arc<CudaStream>> {
    if let Err(e) = cuda::probe() {
        skip(&e.to_string());
        return None;
    }
    let ctx = Context::builder().transports(TLS).config("NET_DEVICES", "lo").build().expect("context");
    if !ctx.supports(MemoryType::Cuda { device: 0 }) {
        let (a, b, c) = Context::ucx_version();
        skip(&format!("UCX {a}.{b}.{c} cannot reach CUDA memory (built without its CUDA transports?)"));
        return None;
    }
    Some(CudaContext::new(0).expect("device 0").default_stream())
}

async fn connected() -> (Worker, Worker, Endpoint, Endpoint) {
    pair_with(TLS, ErrorMode::Auto, ProgressMode::Event).await
}

/// The device bytes, copied back to the host.
fn host_copy(stream: &Arc<CudaStream>, dev: &cuda::cudarc::driver::CudaSlice<u8>) -> Vec<u8> {
    let v = stream.clone_dtoh(dev).expect("copy back");
    stream.synchronize().expect("synchronize");
    v
}

#[tokio::test]
async fn tagged_messages_device_to_device() {
    let Some(stream) = device() else { return };
    let (_s, _c, sep, cep) = connected().await;
    for (i, len) in SIZES.into_iter().enumerate() {
        let data = payload(i as u64, len);
        let src = stream.clone_htod(&data).unwrap();
        let dst = stream.alloc_zeros::<u8>(len).unwrap();
        let recv = sep.tag_recv(10 + i as u64, tag::EXACT, dst);
        let (r, src) = tokio::time::timeout(T, cep.tag_send(10 + i as u64, src)).await.unwrap();
        r.unwrap();
        let (info, dst) = tokio::time::timeout(T, recv).await.unwrap();
        assert_eq!(info.unwrap().len, len);
        assert!(host_copy(&stream, &dst) == data, "{len} bytes device to device");
        assert!(host_copy(&stream, &src) == data, "the source is unchanged");
    }
}

#[tokio::test]
async fn tagged_messages_between_host_and_device() {
    let Some(stream) = device() else { return };
    let (_s, _c, sep, cep) = connected().await;
    for (i, len) in SIZES.into_iter().enumerate() {
        let data = payload(100 + i as u64, len);
        // Host to device.
        let recv = sep.tag_recv(1, tag::EXACT, stream.alloc_zeros::<u8>(len).unwrap());
        tokio::time::timeout(T, cep.tag_send(1, data.clone())).await.unwrap().0.unwrap();
        let (info, dst) = tokio::time::timeout(T, recv).await.unwrap();
        assert_eq!(info.unwrap().len, len);
        assert!(host_copy(&stream, &dst) == data, "{len} bytes host to device");
        // Device to host.
        let recv = sep.tag_recv(2, tag::EXACT, Vec::with_capacity(len));
        tokio::time::timeout(T, cep.tag_send(2, dst)).await.unwrap().0.unwrap();
        let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
        assert_eq!(info.unwrap().len, len);
        assert!(got == data, "{len} bytes device to host");
    }
}

#[tokio::test]
async fn slices_and_typed_device_buffers() {
    let Some(stream) = device() else { return };
    let (_s, _c, sep, cep) = connected().await;
    let len = 1 << 20;
    let data = payload(7, len + 64);
    // Bytes 32..32 + len of a larger device buffer, into bytes 16.. of another.
    let src = stream.clone_htod(&data).unwrap().into_slice(32..32 + len).unwrap();
    assert_eq!(src.memory_type(), MemoryType::Cuda { device: 0 });
    let dst = ucxkit::transport::IoBufMut::into_slice_mut(
        stream.alloc_zeros::<u8>(len + 64).unwrap(),
        16..16 + len,
    )
    .unwrap();
    let recv = sep.tag_recv(3, tag::EXACT, dst);
    tokio::time::timeout(T, cep.tag_send(3, src)).await.unwrap().0.unwrap();
    let (info, dst) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, len);
    let got = host_copy(&stream, &dst.into_inner());
    assert!(got[..16].iter().all(|&b| b == 0) && got[16 + len..].iter().all(|&b| b == 0));
    assert!(got[16..16 + len] == data[32..32 + len], "the slice landed in place");

    // f32 values keep their bits.
    let vals: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5 - 7.0).collect();
    let src = stream.clone_htod(&vals).unwrap();
    let recv = sep.tag_recv(4, tag::EXACT, stream.alloc_zeros::<f32>(vals.len()).unwrap());
    tokio::time::timeout(T, cep.tag_send(4, src)).await.unwrap().0.unwrap();
    let (info, dst) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, vals.len() * 4);
    let back = stream.clone_dtoh(&dst).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(back, vals);
}

#[tokio::test]
async fn active_message_payloads_into_device_memory() {
    let Some(stream) = device() else { return };
    let (server, _c, _sep, cep) = connected().await;
    let mut rx = server.am_recv(5).unwrap();
    for (i, len) in SIZES.into_iter().enumerate() {
        let data = payload(200 + i as u64, len);
        // From the device (rendezvous or eager by size), into the device.
        let sent = cep.am_send(5, b"hdr", stream.clone_htod(&data).unwrap());
        let m = tokio::time::timeout(T, rx.recv()).await.expect("message");
        assert_eq!(m.header(), b"hdr");
        let (r, dst) =
            tokio::time::timeout(T, m.recv_data(stream.alloc_zeros::<u8>(len).unwrap())).await.unwrap();
        assert_eq!(r.unwrap(), len);
        tokio::time::timeout(T, sent).await.unwrap().0.unwrap();
        assert!(host_copy(&stream, &dst) == data, "{len} byte active message");
    }
}

#[tokio::test]
async fn put_and_get_with_device_buffers() {
    let Some(stream) = device() else { return };
    let (server, _c, _sep, cep) = connected().await;
    let len = 4 << 20;
    let region = server.context().alloc(len).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let data = payload(9, len);
    let (r, _src) =
        tokio::time::timeout(T, cep.put(stream.clone_htod(&data).unwrap(), &key, 0)).await.unwrap();
    r.unwrap();
    tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
    assert!(region.to_vec() == data, "put from device memory");
    let (r, dst) =
        tokio::time::timeout(T, cep.get(stream.alloc_zeros::<u8>(len).unwrap(), len, &key, 0)).await.unwrap();
    assert_eq!(r.unwrap(), len);
    assert!(host_copy(&stream, &dst) == data, "get into device memory");
}

/// A context without UCX's CUDA transports refuses a real device buffer and gives it
/// back; stream operations refuse device memory on any context.
#[tokio::test]
async fn device_buffers_are_refused_where_the_transports_cannot_reach_them() {
    let Some(stream) = device() else { return };
    let data = payload(3, 4096);
    let (_s, _c, sep, cep) = pair_with("tcp,self", ErrorMode::Auto, ProgressMode::Event).await;
    assert!(!cep.worker().context().supports(MemoryType::Cuda { device: 0 }));
    let (r, back) = cep.tag_send(1, stream.clone_htod(&data).unwrap()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Unsupported);
    assert!(host_copy(&stream, &back) == data, "given back untouched");
    let (_s, _c, _sep2, cep2) = connected().await;
    let (r, _) = cep2.stream_send(stream.clone_htod(&data).unwrap()).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Unsupported);
    drop(sep);
}

/// Collectives on device buffers, staged through host memory: an allreduce writes the
/// sum back into each rank's buffer, an allgather (a longer result) gives a new one.
#[tokio::test]
async fn collectives_on_device_buffers() {
    use ucxkit::collectives::{device, Communicator, ReduceOp};
    use ucxkit::transport::namespace::COLLECTIVES;
    let Some(stream) = device() else { return };
    let mesh = common::workers::mesh_with(TLS, 2, ProgressMode::Event).await;
    let comms: Vec<Communicator> = (0..2)
        .map(|r| {
            let ns = mesh.workers[r].namespace(COLLECTIVES).unwrap();
            Communicator::from_endpoints(&ns, 0, r, mesh.eps[r].clone()).unwrap()
        })
        .collect();
    for count in [1usize, 1000, 1 << 20] {
        let calls = comms.iter().enumerate().map(|(r, comm)| {
            let vals: Vec<f32> = (0..count).map(|i| (i % 97) as f32 + r as f32).collect();
            let buf = stream.clone_htod(&vals).unwrap();
            async move {
                let sum = device::staged(buf, |v| comm.allreduce(v, ReduceOp::Sum)).await.unwrap();
                let all = device::staged(sum, |v| comm.allgather(v)).await.unwrap();
                (comm.rank(), all)
            }
        });
        for (r, all) in futures_util::future::join_all(calls).await {
            let got = stream.clone_dtoh(&all).unwrap();
            stream.synchronize().unwrap();
            assert_eq!(got.len(), 2 * count, "rank {r}: the allgather's longer result");
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, 2.0 * ((i % count) % 97) as f32 + 1.0, "rank {r}, element {i}");
            }
        }
    }
    assert_eq!(device::ROUTE, "host-staged");
}

/// Objects in device memory: pulled into a `DeviceStore` chunk by chunk (each checked
/// from a copy on the host), from a holder in host memory and from one in device
/// memory (served from the device), at sizes inline, one chunk and many.
#[tokio::test]
async fn objects_pulled_into_and_served_from_device_memory() {
    use ucxkit::object_push::device::DeviceStore;
    use ucxkit::object_push::{MemoryStore, NodeOptions, ObjectId, ObjectNode, Verify};
    let Some(stream) = device() else { return };
    let mesh = common::workers::mesh_with(TLS, 3, ProgressMode::Event).await;
    let opts = NodeOptions {
        chunk: 1 << 20,
        window: 4,
        inline_max: 1000,
        verify: Verify::Always,
        ..Default::default()
    };
    let host = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let dev_store = Arc::new(DeviceStore::new(stream.clone()));
    let dev = ObjectNode::new(&mesh.workers[1], dev_store.clone(), opts.clone()).unwrap();
    let back = ObjectNode::new(&mesh.workers[2], Arc::new(MemoryStore::new()), opts).unwrap();
    for (i, len) in [10usize, 5000, (1 << 20) + 1, 9 << 20].into_iter().enumerate() {
        let o = ObjectId::try_from(format!("o{i}").as_str()).unwrap();
        let data = payload(300 + i as u64, len);
        host.put(o, bytes::Bytes::from(data.clone())).unwrap();
        // Host to device.
        let got = tokio::time::timeout(T, dev.pull(o, mesh.ep(1, 0))).await.unwrap().unwrap();
        let d = got.device().expect("sealed in device memory");
        let copy = stream.clone_dtoh(d.as_ref()).unwrap();
        stream.synchronize().unwrap();
        assert!(copy == data, "{len} bytes pulled into device memory");
        assert_eq!(got.read(0..len as u64).unwrap(), &data[..], "read back through the object");
        // Device to host: served from device memory.
        let got = tokio::time::timeout(T, back.pull(o, mesh.ep(2, 1))).await.unwrap().unwrap();
        assert!(got.bytes().unwrap() == &data[..], "{len} bytes served from device memory");
    }
    assert_eq!(dev_store.used(), 10 + 5000 + (1 << 20) + 1 + (9 << 20));
    // An object put from device memory.
    let o = ObjectId::try_from("put").unwrap();
    let data = payload(9, 3 << 20);
    let buf = Arc::new(stream.clone_htod(&data).unwrap());
    dev.put_device(o, buf).await.unwrap();
    let got = tokio::time::timeout(T, back.pull(o, mesh.ep(2, 1))).await.unwrap().unwrap();
    assert!(got.bytes().unwrap() == &data[..]);
    for n in [&host, &dev, &back] {
        assert_eq!(n.stats().refetched, 0, "no chunk failed its check");
    }
}

/// A holder that loses the object in the middle of a pull into device memory: the
/// receives it had in their places are abandoned (UCX may still write there), those
/// chunks come from the other holder into pieces of their own, and the object is sealed
/// byte-exact from a copy of the buffer with them in their places.
#[tokio::test]
async fn a_holder_lost_mid_pull_into_device_memory() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use ucxkit::object_push::device::DeviceStore;
    use ucxkit::object_push::{MemoryStore, NodeOptions, Object, ObjectId, ObjectNode, ObjectStore, Verify};
    let Some(stream) = device() else { return };

    /// A store whose objects are gone after `reads` reads (its node then answers
    /// fetches with `Failed`).
    struct Forgetful {
        inner: MemoryStore,
        reads: AtomicU32,
    }
    impl ObjectStore for Forgetful {
        fn get(&self, id: &ObjectId) -> Option<Object> {
            let left = self.reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            left.ok().and_then(|_| self.inner.get(id))
        }
        fn reserve(&self, id: &ObjectId, size: u64) -> ucxkit::object_push::Result<()> {
            self.inner.reserve(id, size)
        }
        fn unreserve(&self, id: &ObjectId, size: u64) {
            self.inner.unreserve(id, size)
        }
        fn seal(&self, id: ObjectId, object: Object) -> ucxkit::object_push::Result<()> {
            self.inner.seal(id, object)
        }
        fn release(&self, id: &ObjectId) -> Option<Object> {
            self.inner.release(id)
        }
    }

    let mesh = common::workers::mesh_with(TLS, 3, ProgressMode::Event).await;
    let opts = NodeOptions { chunk: 64 << 10, window: 4, verify: Verify::Always, ..Default::default() };
    let forgetful = Arc::new(Forgetful { inner: MemoryStore::new(), reads: AtomicU32::new(u32::MAX) });
    let a = ObjectNode::new(&mesh.workers[0], Arc::new(MemoryStore::new()), opts.clone()).unwrap();
    let b = ObjectNode::new(&mesh.workers[1], forgetful.clone(), opts.clone()).unwrap();
    let dev = ObjectNode::new(&mesh.workers[2], Arc::new(DeviceStore::new(stream.clone())), opts).unwrap();
    let o = ObjectId::try_from("lost").unwrap();
    let data = payload(51, 64 * (64 << 10) + 7);
    a.put(o, bytes::Bytes::from(data.clone())).unwrap();
    b.put(o, bytes::Bytes::from(data.clone())).unwrap();
    // B answers its lookup and a few fetches, then has lost the object.
    forgetful.reads.store(4, Ordering::SeqCst);
    let holders = [mesh.ep(2, 0).clone(), mesh.ep(2, 1).clone()];
    let got = tokio::time::timeout(T, dev.pull_from(o, &holders)).await.unwrap().unwrap();
    assert_eq!(dev.stats().holders_failed, 1, "B failed mid-pull");
    let d = got.device().expect("sealed in device memory");
    let copy = stream.clone_dtoh(d.as_ref()).unwrap();
    stream.synchronize().unwrap();
    assert!(copy == data, "sealed byte-exact");
    assert_eq!(got.read(0..data.len() as u64).unwrap(), &data[..]);
}

/// Vectored messages of device buffers, and one shared device buffer (`Arc<CudaSlice>`)
/// sent by several operations at once.
#[tokio::test]
async fn vectored_and_shared_device_buffers() {
    let Some(stream) = device() else { return };
    let (_s, _c, sep, cep) = connected().await;
    let (a, b) = (payload(21, 100_000), payload(22, 3 << 20));
    let parts = vec![stream.clone_htod(&a).unwrap(), stream.clone_htod(&b).unwrap()];
    let into = vec![stream.alloc_zeros::<u8>(a.len()).unwrap(), stream.alloc_zeros::<u8>(b.len()).unwrap()];
    let recv = sep.tag_recv_iov(8, tag::EXACT, into);
    tokio::time::timeout(T, cep.tag_send_iov(8, parts)).await.unwrap().0.unwrap();
    let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, a.len() + b.len());
    assert!(host_copy(&stream, &got[0]) == a && host_copy(&stream, &got[1]) == b, "scattered in order");

    let shared = Arc::new(stream.clone_htod(&b).unwrap());
    let recvs: Vec<_> =
        (0..4).map(|i| sep.tag_recv(30 + i, tag::EXACT, Vec::with_capacity(b.len()))).collect();
    let sends: Vec<_> = (0..4).map(|i| cep.tag_send(30 + i, shared.clone())).collect();
    for s in futures_util::future::join_all(sends).await {
        s.0.unwrap();
    }
    for r in futures_util::future::join_all(recvs).await {
        assert!(r.0.unwrap().len == b.len() && r.1 == b, "each send of the shared buffer");
    }
}

/// Device memory registered as a region: its slices are operation buffers (put and get
/// between it and a peer's host region, tags), its bytes go through the driver
/// (`read_at`, `write_at`), it has no host view, and a ucxkit peer refuses its key.
#[tokio::test]
async fn device_regions() {
    let Some(stream) = device() else { return };
    let (server, client, sep, cep) = connected().await;
    let len = 2 << 20;
    let data = payload(41, len);
    let mut region = client.context().register_device(stream.clone_htod(&data).unwrap()).unwrap();
    assert_eq!(region.memory_type(), MemoryType::Cuda { device: 0 });
    let mut head = vec![0u8; 64];
    region.read_at(0, &mut head);
    assert_eq!(head, &data[..64], "read through the driver");
    region.write_at(len - 4, b"tail");
    assert!(region.view().is_err(), "no host view of device memory");
    // Put from the device region into a peer's host region, get back into it.
    let host = server.context().alloc(len).unwrap();
    let key = cep.unpack_key(&host.pack_key().unwrap()).unwrap();
    tokio::time::timeout(T, cep.put(region.slice(0..len), &key, 0)).await.unwrap().0.unwrap();
    tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
    let mut want = data.clone();
    want[len - 4..].copy_from_slice(b"tail");
    assert!(host.to_vec() == want, "put from device memory");
    host.write_at(0, b"from the host");
    let (r, _) = tokio::time::timeout(T, cep.get(region.slice(0..13), 13, &key, 0)).await.unwrap();
    assert_eq!(r.unwrap(), 13);
    let mut got = [0u8; 13];
    region.read_at(0, &mut got);
    assert_eq!(&got, b"from the host", "get into device memory");
    // Tagged messages from a region slice.
    let recv = sep.tag_recv(9, tag::EXACT, Vec::with_capacity(len));
    tokio::time::timeout(T, cep.tag_send(9, region.slice(0..len))).await.unwrap().0.unwrap();
    assert_eq!(tokio::time::timeout(T, recv).await.unwrap().0.unwrap().len, len);
    // Its key goes to plain UCX peers only.
    assert!(!region.pack_ucx_key().unwrap().is_empty());
    let e = sep.unpack_key(&region.pack_key().unwrap()).unwrap_err();
    assert!(e.to_string().contains("host memory only"), "{e}");
}

/// Futures of device operations dropped while UCX may still move their bytes: the
/// buffers stay with the workers until UCX lets go (the parked requests drain), the
/// device memory is freed only then, and the endpoints carry the next message whole.
#[tokio::test]
async fn dropped_device_operations_keep_their_buffers_until_ucx_is_done() {
    let Some(stream) = device() else { return };
    let (server, client, sep, cep) = connected().await;
    let len = 64 << 20;
    let data = payload(51, len);
    for round in 0..3u64 {
        let recv = sep.tag_recv(60 + round, tag::EXACT, stream.alloc_zeros::<u8>(len).unwrap());
        let send = cep.tag_send(60 + round, stream.clone_htod(&data).unwrap());
        // Let the rendezvous start (more each round), then drop both futures mid-flight.
        for _ in 0..round * 10 {
            tokio::task::yield_now().await;
        }
        drop(recv);
        drop(send);
    }
    // A receive canceled before its message matched leaves the message unexpected and
    // its send waiting: those are received here; matched ones drain by themselves.
    let deadline = std::time::Instant::now() + T;
    while server.parked_requests() + client.parked_requests() > 0 {
        for t in 60..63 {
            if server.tag_probe(t, tag::EXACT).is_some() {
                let (r, _) = server.tag_recv(t, tag::EXACT, Vec::with_capacity(len)).await;
                assert_eq!(r.unwrap().len, len);
            }
        }
        assert!(std::time::Instant::now() < deadline, "parked requests never drained");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let recv = sep.tag_recv(70, tag::EXACT, stream.alloc_zeros::<u8>(len).unwrap());
    tokio::time::timeout(T, cep.tag_send(70, stream.clone_htod(&data).unwrap())).await.unwrap().0.unwrap();
    let (info, dst) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, len);
    assert!(host_copy(&stream, &dst) == data, "the endpoint works on after the drops");
}
