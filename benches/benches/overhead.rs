//! What ucxkit adds to raw UCX per operation, with the network taken out: one worker
//! sends to itself over UCX's `self` transport, so a receive posted before the send
//! completes inside the send call and no progress or other core is involved. Each
//! group times the same exchange through ucxkit's API and through raw `ucp_*` calls on
//! the same worker and endpoint; the difference is ucxkit's bookkeeping (locking,
//! request slots, futures).
//!
//! `cargo bench -p ucxkit-benches --bench overhead`

use std::cell::Cell;

use criterion::{criterion_group, criterion_main, Criterion};
use ucx_sys as sys;
use ucxkit_transport::{tag, Context, EndpointOptions, ErrorMode, ProgressMode, Worker};

mod raw;

const T: u64 = 42;

struct Loop {
    rt: tokio::runtime::Runtime,
    w: Worker,
    ep: ucxkit_transport::Endpoint,
}

fn setup(mode: ProgressMode) -> Loop {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let (w, ep) = rt.block_on(async {
        let ctx = Context::builder().transports("posix,self").build().expect("context");
        let w = ctx.worker().progress_mode(mode).build().expect("worker");
        let addr = w.address().expect("address");
        let opts =
            EndpointOptions { handshake: false, error_mode: ErrorMode::None, ..EndpointOptions::default() };
        let ep = w.connect_address_with(&addr, opts).await.expect("connect to self");
        (w, ep)
    });
    Loop { rt, w, ep }
}

/// One receive posted, then the matching send, both finished: raw UCX.
fn raw_exchange(w: sys::ucp_worker_h, ep: sys::ucp_ep_h, sbuf: &[u8], rbuf: &mut [u8]) {
    let done = Cell::new(false);
    // SAFETY: worker and endpoint stay valid (held by the ucxkit handles, which make no
    // call meanwhile); both buffers and `done` outlive the requests, which finish before
    // return.
    unsafe {
        let r = raw::post_tag_recv(w, rbuf.as_mut_ptr(), rbuf.len(), T, Some(&done));
        let s = raw::post_tag_send(ep, sbuf.as_ptr(), sbuf.len(), T);
        raw::wait(w, s);
        raw::wait_recv(w, r, &done);
    }
}

fn tag_exchange(c: &mut Criterion) {
    for (name, mode) in [("busy", ProgressMode::BusyPoll), ("event", ProgressMode::Event)] {
        let l = setup(mode);
        let mut g = c.benchmark_group(format!("tag_self_8B_{name}"));
        let payload: &'static [u8] = &[5u8; 8];
        g.bench_function("ucxkit", |b| {
            b.iter_custom(|iters| {
                l.rt.block_on(async {
                    let mut buf = Vec::with_capacity(8);
                    let t = std::time::Instant::now();
                    for _ in 0..iters {
                        let r = l.w.tag_recv(T, tag::EXACT, buf);
                        l.ep.tag_send(T, payload).await.0.expect("send");
                        let (res, b) = r.await;
                        res.expect("recv");
                        buf = b;
                    }
                    t.elapsed()
                })
            })
        });
        let (w, ep) = (l.w.as_raw(), l.ep.as_raw());
        g.bench_function("raw", |b| {
            let mut rbuf = [0u8; 8];
            b.iter(|| raw_exchange(w, ep, payload, &mut rbuf))
        });
        g.finish();
    }
}

/// An 8-byte active message sent to this worker and received: ucxkit's `AmReceiver`
/// against a raw callback on another id that only counts.
fn am_exchange(c: &mut Criterion) {
    let l = setup(ProgressMode::BusyPoll);
    let mut g = c.benchmark_group("am_self_8B_busy");
    let payload: &'static [u8] = &[5u8; 8];
    let mut rx = l.w.am_recv(1).expect("am_recv");
    g.bench_function("ucxkit", |b| {
        b.iter_custom(|iters| {
            l.rt.block_on(async {
                let t = std::time::Instant::now();
                for _ in 0..iters {
                    l.ep.am_send(1, &[], payload).await.0.expect("send");
                    let m = rx.recv().await;
                    std::hint::black_box(m.data());
                }
                t.elapsed()
            })
        })
    });
    let count: &'static Cell<u64> = Box::leak(Box::new(Cell::new(0)));
    let (w, ep) = (l.w.as_raw(), l.ep.as_raw());
    // SAFETY: the worker is valid and no ucxkit call runs meanwhile.
    unsafe { raw::count_am(w, 2, Some(count)) };
    g.bench_function("raw", |b| {
        b.iter(|| {
            let before = count.get();
            // SAFETY: as in raw_exchange.
            unsafe {
                raw::wait(w, raw::post_am_send(ep, 2, payload.as_ptr(), 8));
                raw::wait_am(w, count, before + 1);
            }
        })
    });
    // SAFETY: as above.
    unsafe { raw::count_am(w, 2, None) };
    g.finish();
}

/// 8 bytes written to this endpoint's own stream and read back exactly.
fn stream_exchange(c: &mut Criterion) {
    let l = setup(ProgressMode::BusyPoll);
    let mut g = c.benchmark_group("stream_self_8B_busy");
    let payload: &'static [u8] = &[5u8; 8];
    g.bench_function("ucxkit", |b| {
        b.iter_custom(|iters| {
            l.rt.block_on(async {
                let mut buf: Box<[u8]> = vec![0u8; 8].into();
                let t = std::time::Instant::now();
                for _ in 0..iters {
                    l.ep.stream_send(payload).await.0.expect("send");
                    let (r, b) = l.ep.stream_recv_exact(buf).await;
                    r.expect("recv");
                    buf = b;
                }
                t.elapsed()
            })
        })
    });
    let (w, ep) = (l.w.as_raw(), l.ep.as_raw());
    g.bench_function("raw", |b| {
        let mut rbuf = [0u8; 8];
        b.iter(|| {
            // SAFETY: as in raw_exchange.
            unsafe {
                raw::wait(w, raw::post_stream_send(ep, payload.as_ptr(), 8));
                raw::stream_recv_exact(w, ep, rbuf.as_mut_ptr(), 8);
            }
        })
    });
    g.finish();
}

/// An 8-byte put into this worker's own region, awaited.
fn put_local(c: &mut Criterion) {
    let l = setup(ProgressMode::BusyPoll);
    let mut g = c.benchmark_group("put_self_8B_busy");
    let region = l.w.context().alloc(64).expect("alloc");
    let key = l.ep.unpack_key(&region.pack_key().expect("pack")).expect("unpack");
    let payload: &'static [u8] = &[5u8; 8];
    g.bench_function("ucxkit", |b| {
        b.iter_custom(|iters| {
            l.rt.block_on(async {
                let t = std::time::Instant::now();
                for _ in 0..iters {
                    l.ep.put(payload, &key, 0).await.0.expect("put");
                }
                t.elapsed()
            })
        })
    });
    let (w, ep) = (l.w.as_raw(), l.ep.as_raw());
    // SAFETY: the context, the region and the endpoint are alive; no ucxkit call is open.
    let raw_key =
        unsafe { raw::RawRkey::unpack(ep, &raw::pack_rkey(l.w.context().as_raw(), region.as_raw())) };
    g.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let t = std::time::Instant::now();
            for _ in 0..iters {
                // SAFETY: as above; the payload is 'static and the key covers the region.
                unsafe {
                    let s = raw::post_rma(ep, false, payload.as_ptr().cast_mut(), 8, region.addr(), &raw_key);
                    raw::wait(w, s);
                }
            }
            t.elapsed()
        })
    });
    drop(raw_key);
    g.finish();
}

criterion_group!(benches, tag_exchange, am_exchange, stream_exchange, put_local);
criterion_main!(benches);
