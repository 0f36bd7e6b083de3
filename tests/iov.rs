//! Vectored operations: a tag message gathered from several buffers and scattered into
//! several, in every combination with plain messages, eager and rendezvous sizes; a put
//! from several buffers.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use bytes::Bytes;
use common::{pair, payload};
use ucxkit::transport::{tag, ErrorKind};

const T: Duration = Duration::from_secs(20);

async fn gather_scatter(tls: &str) {
    let (server, _c, sep, cep) = pair(tls).await;
    for (round, sizes) in [[3usize, 0, 5], [1000, 2000, 3000], [300_000, 1 << 20, 17]].iter().enumerate() {
        let parts: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(i, &n)| payload((round * 10 + i) as u64, n)).collect();
        let whole: Vec<u8> = parts.concat();
        let t = round as u64;
        // Gathered send, plain receive.
        let recv = server.tag_recv(t, tag::EXACT, Vec::with_capacity(whole.len()));
        let bufs: Vec<Bytes> = parts.iter().cloned().map(Bytes::from).collect();
        let (r, back) = tokio::time::timeout(T, cep.tag_send_iov(t, bufs)).await.unwrap();
        r.unwrap();
        assert_eq!(back.len(), 3);
        let (info, buf) = tokio::time::timeout(T, recv).await.unwrap();
        assert_eq!(info.unwrap().len, whole.len());
        assert!(buf == whole);
        // Plain send, scattered receive into buffers of other sizes.
        let caps = [whole.len() / 3, 1, whole.len()];
        let recv = sep.tag_recv_iov(t, tag::EXACT, caps.iter().map(|&c| Vec::with_capacity(c)).collect());
        let send = cep.tag_send(t, whole.clone());
        let (info, bufs) = tokio::time::timeout(T, recv).await.unwrap();
        send.await.0.unwrap();
        assert_eq!(info.unwrap().len, whole.len());
        assert!(bufs.concat() == whole, "scattered bytes differ in round {round}");
        assert_eq!(bufs[0].len(), whole.len() / 3, "first buffer filled to capacity first");
        // Gathered to scattered.
        let recv = server.tag_recv_iov(
            t,
            tag::EXACT,
            vec![Vec::with_capacity(whole.len() / 2), Vec::with_capacity(whole.len())],
        );
        let send = cep.tag_send_iov(t, parts.clone());
        let (info, bufs) = tokio::time::timeout(T, recv).await.unwrap();
        send.await.0.unwrap();
        info.unwrap();
        assert!(bufs.concat() == whole);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_scatter_tcp() {
    gather_scatter("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_scatter_shm() {
    gather_scatter("posix,cma,tcp,self").await;
}

#[tokio::test]
async fn scattered_receive_too_small_is_truncated() {
    let (server, _c, _sep, cep) = pair("tcp,self").await;
    let recv = server.tag_recv_iov(1, tag::EXACT, vec![Vec::with_capacity(4), Vec::with_capacity(4)]);
    cep.tag_send(1, vec![0u8; 20]).await.0.unwrap();
    let (r, _) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Truncated);
    // The worker keeps working.
    let recv = server.tag_recv_iov(2, tag::EXACT, vec![Vec::with_capacity(8)]);
    cep.tag_send(2, b"fine".to_vec()).await.0.unwrap();
    let (r, b) = tokio::time::timeout(T, recv).await.unwrap();
    assert_eq!(r.unwrap().len, 4);
    assert_eq!(b[0], b"fine");
}

async fn put_iov(tls: &str) {
    let (_s, _c, sep, cep) = pair(tls).await;
    let region = sep.worker().context().register(vec![0u8; 3 << 20]).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    let parts = vec![payload(1, 10), payload(2, 1 << 20), payload(3, 100_000), Vec::new(), payload(4, 1)];
    let whole = parts.concat();
    let (r, back) = tokio::time::timeout(T, cep.put_iov(parts, &key, 1000)).await.unwrap();
    r.unwrap();
    assert_eq!(back.len(), 5);
    cep.flush().await.unwrap();
    let mut got = vec![0u8; whole.len()];
    region.read_at(1000, &mut got);
    assert!(got == whole);
    // The whole vector is checked against the bounds before anything is posted: the
    // first part would fit, but nothing of it is written.
    let (r, back) = cep.put_iov(vec![vec![0u8; 2 << 20], vec![0u8; 2 << 20]], &key, 0).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(back.len(), 2);
    cep.flush().await.unwrap();
    region.read_at(1000, &mut got);
    assert!(got == whole, "a refused put_iov wrote into the region");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_iov_tcp() {
    put_iov("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_iov_shm() {
    put_iov("posix,cma,tcp,self").await;
}
