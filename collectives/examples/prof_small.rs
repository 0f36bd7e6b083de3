//! Sizes of what a small collective call moves: its future (made by the call, moved into
//! the caller's own) and the error and transport types inside it. At a few bytes a call
//! costs little more than its messages, so these moves show in its time.
//!
//! `cargo run --release -p ucxkit-collectives --example prof_small`

use ucxkit_collectives::{Communicator, ReduceOp};
use ucxkit_transport::{namespace::COLLECTIVES, Context, EndpointOptions, ProgressMode};

fn main() {
    eprintln!(
        "TagRecv {} TagSend {} bytes",
        std::mem::size_of::<ucxkit_transport::TagRecv<Vec<u8>>>(),
        std::mem::size_of::<ucxkit_transport::TagSend<Vec<u8>>>()
    );
    eprintln!(
        "Error {} transport::Error {} CallResult {} bytes",
        std::mem::size_of::<ucxkit_collectives::Error>(),
        std::mem::size_of::<ucxkit_transport::Error>(),
        std::mem::size_of::<ucxkit_collectives::CallResult<f32>>()
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = Context::builder().transports("posix,cma,self").build().unwrap();
        let w: Vec<_> =
            (0..2).map(|_| ctx.worker().progress_mode(ProgressMode::BusyPoll).build().unwrap()).collect();
        let a1 = w[1].address().unwrap();
        let e01 = w[0].connect_address_with(&a1, EndpointOptions::default()).await.unwrap();
        let c0 =
            Communicator::from_endpoints(&w[0].namespace(COLLECTIVES).unwrap(), 0, 0, vec![None, Some(e01)])
                .unwrap();
        // Made and dropped unpolled (each drop aborts the communicator; nothing is sent).
        let f = c0.allreduce(vec![1f32; 2], ReduceOp::Sum);
        eprintln!("allreduce future: {} bytes", std::mem::size_of_val(&f));
        let f = c0.alltoall(vec![1f32; 2]);
        eprintln!("alltoall future: {} bytes", std::mem::size_of_val(&f));
        let f = c0.broadcast(vec![1f32; 2], 0);
        eprintln!("broadcast future: {} bytes", std::mem::size_of_val(&f));
        let f = c0.barrier();
        eprintln!("barrier future: {} bytes", std::mem::size_of_val(&f));
    });
}
