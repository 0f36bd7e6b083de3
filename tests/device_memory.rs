//! Buffers that say they live in device memory, on a context whose UCX cannot reach it
//! (Debian's UCX 1.13 has no CUDA transports; the 1.22 build has them but no driver
//! here): every operation refuses them with `Unsupported` before UCX sees the pointer,
//! gives the buffer back untouched, and the endpoint works on. Stream operations and a
//! region's host copies take host memory only, on any machine.
//!
//! A real device buffer's tests are in tests/gpu.rs (feature `cuda`, a GPU).

use ucxkit_testkit as common;

use std::time::Duration;

use common::{pair, payload};
use ucxkit::transport::{tag, ErrorKind, IoBuf, IoBufMut, MemoryType};

const T: Duration = Duration::from_secs(20);

/// Host bytes that claim a memory type (CUDA device 0 when made with [`cuda`]):
/// whatever UCX would do with them, no operation may hand them over where the context
/// cannot reach that memory.
#[derive(Debug, PartialEq)]
struct Claimed(Vec<u8>, MemoryType);

fn cuda(v: Vec<u8>) -> Claimed {
    Claimed(v, MemoryType::Cuda { device: 0 })
}

fn host(v: Vec<u8>) -> Claimed {
    Claimed(v, MemoryType::Host)
}

// SAFETY: the Vec's heap pointer is stable while an operation owns the value; only the
// memory type is a claim, and no test lets UCX act on it.
unsafe impl IoBuf for Claimed {
    fn stable_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.0.len()
    }
    fn memory_type(&self) -> MemoryType {
        self.1
    }
}

// SAFETY: as above; the length set is within the Vec's capacity, written by the caller.
unsafe impl IoBufMut for Claimed {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.0.capacity()
    }
    unsafe fn set_init(&mut self, n: usize) {
        // SAFETY: the caller wrote n bytes within capacity.
        unsafe { self.0.set_len(n) }
    }
}

fn unsupported(e: &ucxkit::transport::Error, what: &str) {
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{what}: {e}");
    assert!(e.to_string().contains("cuda:0"), "{what}: the error names the memory: {e}");
}

async fn refused_everywhere(tls: &str) {
    let (server, client, sep, cep) = pair(tls).await;
    if client.context().supports(MemoryType::Cuda { device: 0 }) {
        println!("skipped over {tls}: this context's UCX reaches CUDA memory (tests/gpu.rs covers it)");
        return;
    }
    let data = payload(1, 4096);

    let (r, back) = cep.tag_send(5, cuda(data.clone())).await;
    unsupported(&r.unwrap_err(), "tag_send");
    assert_eq!(back.0, data, "the send's buffer comes back untouched");

    let (r, back) = cep.tag_send_iov(5, vec![cuda(data.clone()), cuda(data.clone())]).await;
    unsupported(&r.unwrap_err(), "tag_send_iov");
    assert_eq!(back.len(), 2);

    let (r, back) = server.tag_recv(5, tag::EXACT, cuda(Vec::with_capacity(64))).await;
    unsupported(&r.unwrap_err(), "tag_recv");
    assert!(back.0.is_empty() && back.0.capacity() >= 64);

    let (r, _) = sep.tag_recv(5, tag::EXACT, cuda(Vec::with_capacity(64))).await;
    unsupported(&r.unwrap_err(), "tag_recv on an endpoint");

    let (r, _) = cep.am_send(3, b"h", cuda(data.clone())).await;
    unsupported(&r.unwrap_err(), "am_send");

    let (r, _) = cep.stream_send(cuda(data.clone())).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Unsupported, "stream_send takes host memory only");
    let (r, _) = sep.stream_recv(cuda(Vec::with_capacity(8))).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Unsupported, "stream_recv takes host memory only");

    // Put and get through a host region's key: the local buffer is the device one.
    let region = server.context().alloc(8192).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let (r, _) = cep.put(cuda(data.clone()), &key, 0).await;
    unsupported(&r.unwrap_err(), "put");
    let (r, _) = cep.get(cuda(Vec::with_capacity(4096)), 4096, &key, 0).await;
    unsupported(&r.unwrap_err(), "get");
    let e = region.write_from(0, &cuda(data.clone()), 0..16).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "write_from copies on the host");

    // An active message's payload, eager and rendezvous, into a device buffer. An eager
    // payload is copied by the CUDA driver, not by UCX: where there is a device, that
    // copy would run (onto these host bytes), so only the rendezvous one is tried there.
    let mut rx = server.am_recv(3).unwrap();
    let sizes: &[usize] = if device_present() { &[1 << 20] } else { &[16, 1 << 20] };
    for &len in sizes {
        let sent = cep.am_send(3, b"", payload(2, len));
        let m = tokio::time::timeout(T, rx.recv()).await.expect("message");
        let (r, back) = m.recv_data(cuda(Vec::with_capacity(len))).await;
        assert_eq!(r.unwrap_err().kind(), ErrorKind::Unsupported, "am recv_data of {len} bytes");
        assert!(back.0.is_empty());
        // The sender learns nothing went wrong on its side; a refused rendezvous fetch
        // released UCX's descriptor, so the send completes.
        tokio::time::timeout(T, sent).await.expect("the send completes").0.unwrap();
    }

    // One operation, buffers of two memory types: misuse.
    let mixed = vec![host(data.clone()), cuda(data.clone())];
    let (r, back) = cep.tag_send_iov(5, mixed).await;
    let e = r.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("one memory type"), "{e}");
    assert_eq!(back[0].0, data);

    // The endpoint works on.
    let recv = sep.tag_recv(6, tag::EXACT, Vec::with_capacity(4096));
    cep.tag_send(6, data.clone()).await.0.unwrap();
    let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, data.len());
    assert_eq!(got, data);
}

/// Whether this build can reach a CUDA device (feature `cuda` and a device present).
#[cfg(feature = "cuda")]
fn device_present() -> bool {
    ucxkit::transport::cuda::probe().is_ok()
}

/// Whether this build can reach a CUDA device: never without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn device_present() -> bool {
    false
}

#[tokio::test]
async fn device_buffers_are_refused_where_ucx_cannot_reach_them_tcp() {
    refused_everywhere("tcp,self").await;
}

#[tokio::test]
async fn device_buffers_are_refused_where_ucx_cannot_reach_them_shm() {
    refused_everywhere("posix,cma,self,tcp").await;
}

/// Host memory is what every buffer type says it is, and a slice says what its buffer
/// says.
#[test]
fn buffers_report_their_memory_type() {
    assert_eq!(vec![1u8].memory_type(), MemoryType::Host);
    assert_eq!(bytes::Bytes::from_static(b"x").memory_type(), MemoryType::Host);
    let s = cuda(vec![1, 2, 3]).into_slice(1..).unwrap();
    assert_eq!(s.memory_type(), MemoryType::Cuda { device: 0 });
    assert_eq!(MemoryType::Cuda { device: 2 }.to_string(), "cuda:2");
    assert_eq!(MemoryType::default(), MemoryType::Host);
}
