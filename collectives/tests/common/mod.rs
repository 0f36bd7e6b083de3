//! What the collectives' tests share: groups of in-process workers, each with a
//! communicator.

use ucxkit_collectives::Communicator;
use ucxkit_testkit::workers::{mesh_with, Mesh};
use ucxkit_transport::namespace::COLLECTIVES;
use ucxkit_transport::ProgressMode;

/// A communicator per worker of a fresh full mesh of `n` over TCP and shared memory;
/// the mesh holds the workers and endpoints for as long as the test keeps it.
#[allow(dead_code)] // Not every test crate uses both helpers.
pub(crate) async fn group(n: usize) -> (Mesh, Vec<Communicator>) {
    group_over("tcp,posix,cma,self", n, ProgressMode::default()).await
}

/// [`group`] over the transports `tls`, the workers progressed in `mode`.
pub(crate) async fn group_over(tls: &str, n: usize, mode: ProgressMode) -> (Mesh, Vec<Communicator>) {
    let mesh = mesh_with(tls, n, mode).await;
    let comms = (0..n)
        .map(|r| {
            let ns = mesh.workers[r].namespace(COLLECTIVES).expect("namespace");
            Communicator::from_endpoints(&ns, 0, r, mesh.eps[r].clone()).expect("communicator")
        })
        .collect();
    (mesh, comms)
}
