use std::time::Instant;
use ucxkit::transport::{sys, tag, Context, ProgressMode};

unsafe extern "C" fn cb(
    _r: *mut std::ffi::c_void,
    _s: sys::ucs_status_t,
    _i: *const sys::ucp_tag_recv_info_t,
    _u: *mut std::ffi::c_void,
) {
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = Context::builder().transports("posix,cma,tcp,self").build().unwrap();
        let a = ctx.worker().progress_mode(ProgressMode::BusyPoll).build().unwrap();
        let b = ctx.worker().progress_mode(ProgressMode::BusyPoll).build().unwrap();
        let l = a.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let (ba, ab) = tokio::join!(l.accept(), b.connect(l.local_addr()));
        let (ba, ab) = (ba.unwrap(), ab.unwrap());
        let n: u32 = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
        for round in 0..3 {
            // library ping-pong, both sides in one task (a half-step each)
            let payload: &'static [u8] = b"12345678";
            let mut rb = Vec::with_capacity(8);
            let mut ra = Vec::with_capacity(8);
            let t = Instant::now();
            for _ in 0..n {
                let r = a.tag_recv(1, tag::EXACT, ra);
                ab.tag_send(1, payload).await.0.unwrap();
                ra = r.await.1;
                let r = b.tag_recv(2, tag::EXACT, rb);
                ba.tag_send(2, payload).await.0.unwrap();
                rb = r.await.1;
            }
            let lib = t.elapsed().as_nanos() as f64 / n as f64 / 2.0;
            // raw
            let (wa, wb, eab, eba) = (a.as_raw(), b.as_raw(), ab.as_raw(), ba.as_raw());
            let mut buf = [0u8; 8];
            let t = Instant::now();
            unsafe {
                for _ in 0..n {
                    for (w, e, tg) in [(wa, eab, 1u64), (wb, eba, 2u64)] {
                        let mut p = sys::ucp_request_param_t::default();
                        p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK.0 as u32;
                        p.cb.recv = Some(cb);
                        let r = sys::ucp_tag_recv_nbx(w, buf.as_mut_ptr().cast(), 8, tg, u64::MAX, &p);
                        let p2 = sys::ucp_request_param_t::default();
                        let s = sys::ucp_tag_send_nbx(e, payload.as_ptr().cast(), 8, tg, &p2);
                        assert!(!sys::UCS_PTR_IS_PTR(s));
                        if sys::UCS_PTR_IS_PTR(r) {
                            while sys::ucp_request_check_status(r) == sys::UCS_INPROGRESS {
                                sys::ucp_worker_progress(w);
                            }
                            sys::ucp_request_free(r);
                        }
                    }
                }
            }
            let raw = t.elapsed().as_nanos() as f64 / n as f64 / 2.0;
            println!(
                "round {round}: library {lib:.1} ns per message, raw {raw:.1} ns, overhead {:.1} ns",
                lib - raw
            );
        }
    });
}
