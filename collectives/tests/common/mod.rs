//! What the collectives' tests share: groups of in-process workers, each with a
//! communicator.

use ucxkit_collectives::Communicator;
use ucxkit_testkit::workers::{mesh, Mesh};
use ucxkit_transport::namespace::COLLECTIVES;

/// A communicator per worker of a fresh full mesh of `n` over TCP and shared memory;
/// the mesh holds the workers and endpoints for as long as the test keeps it.
pub(crate) async fn group(n: usize) -> (Mesh, Vec<Communicator>) {
    let mesh = mesh("tcp,posix,cma,self", n).await;
    let comms = (0..n)
        .map(|r| {
            let ns = mesh.workers[r].namespace(COLLECTIVES).expect("namespace");
            Communicator::from_endpoints(&ns, 0, r, mesh.eps[r].clone()).expect("communicator")
        })
        .collect();
    (mesh, comms)
}
