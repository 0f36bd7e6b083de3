//! Parts of buffers as operation buffers ([`Slice`]) and a region's bytes in place
//! ([`MemRegion::view`]): bytes land where the slice says, the rest of the buffer is
//! untouched, the whole buffer comes back, and a view is refused while anything else of
//! this process could use the region.

#![deny(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::{pair, payload};
use ucxkit::transport::{tag, ErrorKind, IoBuf, IoBufMut, SharedBuf};

const T: Duration = Duration::from_secs(20);

async fn tag_slices(tls: &str) {
    let (_s, _c, sep, cep) = pair(tls).await;
    for (i, len) in [8usize, 100_000, 2 << 20].into_iter().enumerate() {
        let tagv = 100 + i as u64;
        let data = payload(i as u64, len + 64);
        // Send bytes 32..32+len of a larger buffer.
        let src = data.clone().into_slice(32..32 + len).unwrap();
        // Receive into bytes 16..16+len of a buffer whose first 16 bytes stay.
        let mut dst = vec![7u8; 16];
        dst.reserve(len + 100);
        let dst = dst.into_slice_mut(16..16 + len).unwrap();
        let recv = sep.tag_recv(tagv, tag::EXACT, dst);
        let (r, back) = tokio::time::timeout(T, cep.tag_send(tagv, src)).await.unwrap();
        r.unwrap();
        assert_eq!(back.into_inner(), data, "the whole send buffer comes back");
        let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
        assert_eq!(info.unwrap().len, len);
        let got = got.into_inner();
        assert_eq!(got.len(), 16 + len);
        assert_eq!(&got[..16], &[7u8; 16]);
        assert!(got[16..] == data[32..32 + len], "{len} bytes over {tls}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_slices_tcp() {
    tag_slices("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_slices_shared_memory() {
    tag_slices("posix,cma,tcp,self").await;
}

/// A put from a slice of a Vec into a slice's place of a region, read back by a get
/// into a slice of a bigger buffer; the region viewed in place afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_with_slices_and_a_view() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let mut region = sep.worker().context().alloc(1 << 20).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let data = payload(3, 300_000);
    let (r, back) = cep.put(data.clone().into_slice(1000..).unwrap(), &key, 4096).await;
    r.unwrap();
    assert_eq!(back.into_inner().len(), data.len());
    cep.flush().await.unwrap();
    let (e, back) = vec![1u8; 10].into_slice_mut(10..10 + 299_000).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "past the capacity");
    assert_eq!(back, vec![1u8; 10], "a refused slice gave its buffer back");
    let mut buf = vec![9u8; 10];
    buf.reserve(299_000);
    let (n, got) = cep.get(buf.into_slice_mut(10..).unwrap(), 299_000, &key, 4096).await;
    assert_eq!(n.unwrap(), 299_000);
    let got = got.into_inner();
    assert_eq!(&got[..10], &[9u8; 10]);
    assert!(got[10..] == data[1000..]);
    drop(key);
    // The region's only handle now: its bytes in place, writable.
    let mut view = region.view().unwrap();
    assert!(view[4096..4096 + 299_000] == data[1000..]);
    assert!(view[..4096].iter().all(|&b| b == 0));
    view[0] = 42;
    drop(view);
    assert_eq!(region.to_vec()[0], 42);
}

/// A region staged from a part of a shared buffer while a receive holds another part,
/// read by a peer's get; ranges outside the buffer or the region copy nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_staged_from_a_shared_slice() {
    let (_s, _c, sep, cep) = pair("posix,cma,self").await;
    let region = sep.worker().context().alloc(64 << 10).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let data = payload(5, 40_000);
    let buf = SharedBuf::new(data.clone());
    let busy = buf.slice(0..100).unwrap();
    let part = buf.slice(1000..31_000).unwrap();
    region.write_from(100, &part, 5..29_005).unwrap();
    let (n, got) = cep.get(vec![0u8; 29_000], 29_000, &key, 100).await;
    assert_eq!(n.unwrap(), 29_000);
    assert!(got == data[1005..30_005]);
    let before = region.to_vec();
    // A range past the slice, one that ends before it starts, and two that miss the region.
    let backwards = std::ops::Range { start: 30_000, end: 29_000 };
    for (at, range) in [(0, 0..30_001), (0, backwards), ((64 << 10) - 10, 0..11), (usize::MAX, 0..1)] {
        let e = region.write_from(at, &part, range.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{at} {range:?}");
    }
    assert!(region.to_vec() == before, "a refused copy wrote nothing");
    region.write_from(0, &region, 100..200).unwrap();
    assert!(region.to_vec()[..100] == data[1005..1105], "a copy within the region");
    drop((busy, part));
}

/// A view is refused while a clone, a slice, an operation or a key unpacked in this
/// process holds the region, and a key cannot be unpacked here while a view is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_needs_the_only_handle() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let mut region = sep.worker().context().alloc(4096).unwrap();
    let clone = region.clone();
    assert_eq!(region.view().unwrap_err().kind(), ErrorKind::InvalidInput);
    drop(clone);
    let slice = region.slice(0..16);
    assert!(region.view().is_err());
    drop(slice);
    // A receive into the region, pending: the operation holds it.
    let recv = sep.tag_recv(5, tag::EXACT, region.clone());
    assert!(region.view().is_err());
    let (r, _) = cep.tag_send(5, b"hello".to_vec()).await;
    r.unwrap();
    let (info, r2) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, 5);
    drop(r2);
    assert_eq!(&region.view().unwrap()[..5], b"hello");
    // A key unpacked in this process holds the region.
    let packed = region.pack_key().unwrap();
    let key = sep.unpack_key(&packed).unwrap();
    assert!(region.view().is_err());
    drop(key);
    let view = region.view().unwrap();
    assert_eq!(sep.unpack_key(&packed).unwrap_err().kind(), ErrorKind::InvalidInput);
    drop(view);
    let _key = sep.unpack_key(&packed).unwrap();
}

/// Sending a slice that ends past the data refuses it with the buffer; a slice of an
/// operation may also be empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_slices_and_empty_ones() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let v = b"abc".to_vec();
    let (e, v) = v.into_slice(1..4).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(v, b"abc");
    let recv = sep.tag_recv(9, tag::EXACT, Vec::with_capacity(8).into_slice_mut(0..0).unwrap());
    let (r, back) = cep.tag_send(9, v.into_slice(3..).unwrap()).await;
    r.unwrap();
    assert_eq!(back.bytes_init(), 0);
    let (info, got) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(info.unwrap().len, 0);
    assert_eq!(got.bytes_total(), 0);
}

/// A rendezvous send from a part of a `SharedBuf` whose future is dropped before the
/// peer receives keeps its slice parked with the worker: the owner can neither view the
/// values nor take the `Vec` back (UCX still reads them) until the peer has taken the
/// message, which then holds exactly those values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_send_keeps_its_shared_slice_until_ucx_is_done() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let len = 4 << 20;
    let mut buf = SharedBuf::new(payload(3, 2 * len));
    // Values len..2len, large enough for UCX's rendezvous: pending until the peer asks.
    let send = cep.tag_send(9, buf.slice(len..2 * len).unwrap());
    assert!(!send.completed_immediately(), "a rendezvous send waits for its receiver");
    drop(send);
    assert!(buf.in_use() && buf.view().is_none(), "the values are UCX's while the send is pending");
    let buf = buf.try_into_vec().expect_err("no Vec back while UCX may read it");
    let (r, got) =
        tokio::time::timeout(T, sep.tag_recv(9, tag::EXACT, Vec::with_capacity(len))).await.unwrap();
    assert_eq!(r.unwrap().len, len);
    let mut buf = buf;
    let deadline = std::time::Instant::now() + T;
    while buf.in_use() {
        assert!(std::time::Instant::now() < deadline, "the parked send never ended");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(got[..], buf.view().unwrap()[len..]);
}
