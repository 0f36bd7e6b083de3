//! Streams: raw ordered bytes, the `AsyncRead + AsyncWrite` adapter carrying a framed
//! protocol, `tokio::io::copy`, end of stream, bytes that outlive their writer's close,
//! and failure.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use bytes::Bytes;
use common::{pair, pair_with, payload};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use ucxkit::transport::{Endpoint, ErrorKind, ErrorMode, ProgressMode, UcxStream};

const T: std::time::Duration = std::time::Duration::from_secs(20);

/// Many sends of varied sizes arrive in order and byte for byte, whatever the receive
/// sizes.
async fn raw_stream_in_order(tls: &str) {
    let (_s, _c, sep, cep) = pair(tls).await;
    let sizes = [1usize, 7, 100, 4096, 8192, 65536, 300_000, 3, 1 << 20];
    let total: usize = sizes.iter().sum();
    let mut expect = Vec::with_capacity(total);
    let mut sends = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p = payload(i as u64, n);
        expect.extend_from_slice(&p);
        sends.push(cep.stream_send(p));
    }
    let mut got = Vec::with_capacity(total);
    while got.len() < total {
        let (r, buf) = sep.stream_recv(Vec::with_capacity(50_000)).await;
        let n = r.unwrap();
        assert!(n > 0 && n <= 50_000);
        assert_eq!(buf.len(), n);
        got.extend_from_slice(&buf);
    }
    for s in sends {
        s.await.0.unwrap();
    }
    assert_eq!(got.len(), total);
    assert!(got == expect, "stream bytes differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_stream_tcp() {
    raw_stream_in_order("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_stream_shm() {
    raw_stream_in_order("posix,cma,tcp,self").await;
}

#[tokio::test]
async fn recv_exact_waits_for_all_bytes() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let recv = tokio::spawn(async move { sep.stream_recv_exact(Vec::with_capacity(10_000)).await });
    for i in 0..10u64 {
        cep.stream_send(payload(i, 1000)).await.0.unwrap();
    }
    let (r, buf) = recv.await.unwrap();
    assert_eq!(r.unwrap(), 10_000);
    let expect: Vec<u8> = (0..10u64).flat_map(|i| payload(i, 1000)).collect();
    assert_eq!(buf, expect);
}

/// A length-delimited framed protocol runs over the adapter unchanged, both ways.
async fn framed_echo(tls: &str) {
    let (_s, _c, sep, cep) = pair(tls).await;
    let server = tokio::spawn(async move {
        let mut f = Framed::new(UcxStream::new(sep), LengthDelimitedCodec::new());
        while let Some(frame) = f.next().await {
            let mut frame = frame.unwrap();
            frame.reverse();
            f.send(frame.freeze()).await.unwrap();
        }
        // The client shut its side down: end of stream reached.
    });
    let mut f = Framed::new(UcxStream::new(cep), LengthDelimitedCodec::new());
    for i in 0..200u64 {
        let len = [0usize, 1, 17, 4000, 70_000, 1 << 20][i as usize % 6];
        let p = payload(i, len);
        f.send(Bytes::from(p.clone())).await.unwrap();
        let back = f.next().await.unwrap().unwrap();
        let mut expect = p;
        expect.reverse();
        assert!(back[..] == expect[..], "frame {i} differs");
    }
    f.get_mut().shutdown().await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), server).await.expect("server sees end").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_protocol_tcp() {
    framed_echo("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_protocol_shm() {
    framed_echo("posix,cma,tcp,self").await;
}

/// `tokio::io::copy` and `read_to_end` see every byte and then the end of stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_and_read_to_end() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let data = payload(9, 5 * 1024 * 1024 + 123);
    let reader = tokio::spawn(async move {
        let mut s = UcxStream::new(sep).with_read_chunk(64 * 1024);
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        out
    });
    let mut w = UcxStream::new(cep);
    let mut src = &data[..];
    let n = tokio::io::copy(&mut src, &mut w).await.unwrap();
    assert_eq!(n as usize, data.len());
    w.shutdown().await.unwrap();
    let out = reader.await.unwrap();
    assert_eq!(out.len(), data.len());
    assert!(out == data);
    // Writing after shutdown is refused.
    assert!(w.write_all(b"late").await.is_err());
}

/// A dropped read future loses nothing: the adapter keeps its receive.
#[tokio::test]
async fn dropped_read_loses_nothing() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    let mut r = UcxStream::new(sep);
    let mut buf = [0u8; 4];
    // Nothing sent yet: the read times out (its future is dropped mid-way).
    assert!(tokio::time::timeout(std::time::Duration::from_millis(50), r.read_exact(&mut buf))
        .await
        .is_err());
    cep.stream_send(b"abcdefgh".to_vec()).await.0.unwrap();
    let mut all = [0u8; 8];
    r.read_exact(&mut all).await.unwrap();
    assert_eq!(&all, b"abcdefgh");
}

/// Stream end needs the handshake; a raw receive after the end returns 0.
#[tokio::test]
async fn raw_recv_after_end_is_zero() {
    let (_s, _c, sep, cep) = pair("tcp,self").await;
    cep.stream_send(b"xyz".to_vec()).await.0.unwrap();
    cep.stream_shutdown().unwrap();
    let (r, b) = sep.stream_recv(Vec::with_capacity(16)).await;
    assert_eq!(r.unwrap(), 3);
    assert_eq!(b, b"xyz");
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !sep.stream_ended() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap();
    let (r, _) = sep.stream_recv(Vec::with_capacity(16)).await;
    assert_eq!(r.unwrap(), 0);
}

/// A pending stream receive ends with an error when its endpoint is closed.
#[tokio::test]
async fn pending_recv_fails_on_close() {
    let (_s, _c, sep, _cep) = pair("tcp,self").await;
    let recv = sep.stream_recv(Vec::with_capacity(16));
    sep.clone().close().await.unwrap();
    let (r, _) = tokio::time::timeout(std::time::Duration::from_secs(10), recv).await.unwrap();
    let e = r.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Canceled | ErrorKind::ConnectionReset), "{e}");
}

/// Zero-copy receive: pieces borrowed from UCX's buffers add up to every byte sent, in
/// order; after the sender's shutdown the next call reports the end; an endpoint closed
/// while a piece is held keeps the piece readable and closes once it is dropped.
async fn zero_copy_receive(tls: &str) {
    let (_s, _c, sep, cep) = pair(tls).await;
    let sizes = [1usize, 100, 8192, 65536, 1 << 20, 3, 4 << 20];
    let total: usize = sizes.iter().sum();
    let mut expect = Vec::with_capacity(total);
    let mut sends = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p = payload(50 + i as u64, n);
        expect.extend_from_slice(&p);
        sends.push(cep.stream_send(p));
    }
    let mut got = Vec::with_capacity(total);
    let mut pieces = 0;
    while got.len() < total {
        let d =
            tokio::time::timeout(T, sep.stream_recv_data()).await.expect("data").unwrap().expect("not ended");
        assert!(!d.is_empty());
        got.extend_from_slice(&d);
        pieces += 1;
    }
    for s in sends {
        s.await.0.unwrap();
    }
    assert!(got == expect, "{tls}: zero-copy bytes differ ({pieces} pieces)");
    // End of stream.
    cep.stream_send(vec![9u8; 10]).await.0.unwrap();
    cep.stream_shutdown().unwrap();
    let held = tokio::time::timeout(T, sep.stream_recv_data()).await.unwrap().unwrap().expect("last bytes");
    assert_eq!(&held[..], &[9u8; 10]);
    let end = tokio::time::timeout(T, sep.stream_recv_data()).await.unwrap().unwrap();
    assert!(end.is_none(), "{tls}: end of stream after the shutdown");
    // Closing while a piece is held: the close completes, the piece stays readable, and
    // the endpoint is closed for new operations.
    let sep2 = sep.clone();
    tokio::time::timeout(T, sep.close()).await.unwrap().unwrap();
    assert_eq!(&held[..], &[9u8; 10], "still readable after close");
    assert!(sep2.stream_recv_data().await.is_err(), "closed endpoint");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_receive_tcp() {
    zero_copy_receive("tcp,self").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_receive_shm() {
    zero_copy_receive("posix,cma,tcp,self").await;
}

/// How the writer of [`bytes_outlive_the_writers_close`] goes away.
#[derive(Clone, Copy, Debug)]
enum Gone {
    /// `close().await`.
    Close,
    /// Dropping its last handle (the close runs in the background).
    Drop,
}

/// Everything a side wrote before it closed (or dropped) its endpoint can be read by the
/// peer afterwards, however late, in whichever direction, and then the end of stream:
/// UCX itself discards the unread stream bytes of an endpoint whose peer disconnected.
/// Also: a raw receive after the bytes returns them, and an exact receive larger than
/// what is left fails without taking any.
async fn bytes_outlive_the_writers_close(tls: &str, mode: ErrorMode) {
    for gone in [Gone::Close, Gone::Drop] {
        for accepting_writes in [false, true] {
            let (_s, _c, sep, cep) = pair_with(tls, mode, ProgressMode::Event).await;
            let (writer, reader) = if accepting_writes { (sep, cep) } else { (cep, sep) };
            let case = format!("{tls} {mode:?} {gone:?}, accepting side writes: {accepting_writes}");
            let data = payload(11, 300_000);
            let mut w = UcxStream::new(writer.clone());
            w.write_all(&data).await.unwrap();
            w.shutdown().await.unwrap();
            drop(w);
            match gone {
                Gone::Close => tokio::time::timeout(T, writer.close()).await.unwrap().unwrap(),
                Gone::Drop => drop(writer),
            }
            // The reader's end fails with the writer's close; read only then.
            let status = tokio::time::timeout(T, reader.failed()).await.unwrap();
            assert!(status.is_peer_failure(), "{case}: {status}");
            read_after_close(&reader, &data, &case).await;
        }
    }
}

/// Reads `data` from `ep` whose peer closed: a few bytes raw, an exact receive that asks
/// for too much (refused, nothing taken), the rest through the adapter, then the end.
async fn read_after_close(ep: &Endpoint, data: &[u8], case: &str) {
    let (r, head) = ep.stream_recv(Vec::with_capacity(10)).await;
    assert_eq!(r.unwrap(), 10, "{case}");
    assert_eq!(head, data[..10], "{case}");
    let (r, _) = ep.stream_recv_exact(vec![0u8; data.len()]).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{case}: more than is left");
    let mut rest = Vec::new();
    UcxStream::new(ep.clone()).read_to_end(&mut rest).await.unwrap();
    assert!(rest == data[10..], "{case}: {} of {} bytes after the close", rest.len() + 10, data.len());
    let (r, _) = ep.stream_recv(Vec::with_capacity(10)).await;
    assert_eq!(r.unwrap(), 0, "{case}: end of stream");
    assert!(ep.stream_recv_data().await.unwrap().is_none(), "{case}: end of stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_outlive_the_writers_close_tcp() {
    bytes_outlive_the_writers_close("tcp,self", ErrorMode::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_outlive_the_writers_close_shm() {
    bytes_outlive_the_writers_close("posix,cma,tcp,self", ErrorMode::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_outlive_the_writers_close_peer_mode() {
    bytes_outlive_the_writers_close("tcp,self", ErrorMode::Peer).await;
}

/// An exact receive still pending when the writer closes (or drops) its end fails, but
/// the bytes it had gathered are in the buffer it gives back, its length set to their
/// count; either side writing, shared memory and TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_exact_receive_keeps_what_it_gathered() {
    for tls in ["posix,cma,tcp,self", "tcp,self"] {
        for gone in [Gone::Close, Gone::Drop] {
            for accepting_writes in [false, true] {
                let (_s, _c, sep, cep) = pair(tls).await;
                let (writer, reader) = if accepting_writes { (sep, cep) } else { (cep, sep) };
                let case = format!("{tls} {gone:?}, accepting side writes: {accepting_writes}");
                let data = payload(13, 300_000);
                let recv = reader.stream_recv_exact(Vec::with_capacity(1_000_000));
                writer.stream_send(data.clone()).await.0.unwrap();
                match gone {
                    Gone::Close => tokio::time::timeout(T, writer.close()).await.unwrap().unwrap(),
                    Gone::Drop => drop(writer),
                }
                let (r, got) = tokio::time::timeout(T, recv).await.expect(&case);
                assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset, "{case}");
                assert!(got == data, "{case}: {} of {} bytes kept", got.len(), data.len());
            }
        }
    }
}

/// Zero-copy reads get what a closed peer wrote too (as one piece of ucxkit's memory),
/// and without the peer's shutdown, what follows the bytes is the failure, not an end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_read_after_close_and_no_end_without_shutdown() {
    let (_s, _c, sep, cep) = pair("posix,cma,tcp,self").await;
    let data = payload(12, 100_000);
    cep.stream_send(data.clone()).await.0.unwrap();
    tokio::time::timeout(T, cep.close()).await.unwrap().unwrap();
    tokio::time::timeout(T, sep.failed()).await.unwrap();
    let mut got = Vec::new();
    while got.len() < data.len() {
        let piece = tokio::time::timeout(T, sep.stream_recv_data()).await.unwrap().unwrap().expect("bytes");
        got.extend_from_slice(&piece);
    }
    assert!(got == data);
    let e = sep.stream_recv_data().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
    let (r, _) = sep.stream_recv(Vec::with_capacity(8)).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset);
}
