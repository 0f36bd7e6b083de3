use ucxkit_collectives::{Communicator, ReduceOp};
use ucxkit_transport::{namespace::COLLECTIVES, Context, EndpointOptions, ProgressMode};

fn main() {
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
        let f = c0.allreduce(vec![1f32; 2], ReduceOp::Sum);
        eprintln!("allreduce future: {} bytes", std::mem::size_of_val(&f));
        let f2 = c0.alltoall(vec![1f32; 2]);
        eprintln!("alltoall future: {} bytes", std::mem::size_of_val(&f2));
        let f3 = c0.barrier();
        eprintln!("barrier future: {} bytes", std::mem::size_of_val(&f3));
    });
}
