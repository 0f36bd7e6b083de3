//! Connecting a worker to a peer: through a listener ([`Worker::connect`], by way of its
//! front, or UCX's connection manager without the handshake) or by worker address
//! ([`Worker::connect_address`]).

use std::net::SocketAddr;

use crate::address::WorkerAddress;
use crate::endpoint::{is_local_ip, Endpoint, Target};
use crate::error::{Error, Peer, Result};
use crate::worker::{EndpointOptions, Worker};

impl Worker {
    /// Connects to a [`crate::Listener`] at `addr` with this worker's default
    /// [`EndpointOptions`].
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Endpoint> {
        self.connect_with(addr, self.shared.endpoint.clone()).await
    }

    /// Connects to a [`crate::Listener`] at `addr`.
    ///
    /// With the handshake on (the default), goes through the listener's front (see
    /// [`crate::front`]) and returns once the peer has accepted the connection and
    /// answered; a closed port, an unreachable host, a refusal or a peer that never
    /// answers is an error ([`Error::Unreachable`], [`Error::Refused`],
    /// [`Error::Authentication`], [`Error::Timeout`]). With it off (a plain UCX server,
    /// reached through UCX's connection manager), returns once UCX has wired the
    /// endpoint up with the server, within `opts.timeout` as well.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_with(&self, addr: SocketAddr, opts: EndpointOptions) -> Result<Endpoint> {
        self.check_open("connect")?;
        if opts.handshake {
            return crate::front::client::connect(self, addr, &opts).await;
        }
        if !opts.connect_payload.is_empty() {
            return Err(no_payload("a connect without the handshake"));
        }
        let shm = is_local_ip(addr.ip()) && self.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let ep = self.create_ep(Target::Socket(&addr), Peer::Socket(addr), peer_mode)?;
        ep.await_wired(opts.timeout, "connect").await?;
        ep.check_required(&opts.require_transports)?;
        Ok(ep)
    }

    /// Connects to the worker whose address is `addr` with the default options.
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_address(&self, addr: &WorkerAddress) -> Result<Endpoint> {
        self.connect_address_with(addr, self.shared.endpoint.clone()).await
    }

    /// Connects to the worker whose address is `addr`. The other side needs no listener:
    /// its worker answers the handshake by itself. A worker whose context has a secret
    /// connects only to addresses sealed with it ([`Error::Authentication`] otherwise);
    /// the UCX address inside is checked before UCX parses it ([`Error::BadAddress`]).
    ///
    /// # Cancel safety
    /// Safe to drop: the half-made endpoint is closed.
    pub async fn connect_address_with(
        &self,
        addr: &WorkerAddress,
        opts: EndpointOptions,
    ) -> Result<Endpoint> {
        self.check_open("connect")?;
        if !opts.connect_payload.is_empty() {
            return Err(no_payload("a connect to a worker address"));
        }
        let peer = Peer::Address(addr.fingerprint());
        match self.context().secret() {
            // Sealed by a peer holding the secret: its header is checked (UCX aborts on
            // an unknown format), the rest is the peer's word.
            Some(secret) if addr.verify(secret) => {
                crate::address::check_ucx_address(addr.ucx_bytes())
                    .map_err(|reason| Error::BadAddress { reason })?;
            }
            Some(_) => {
                return Err(Error::Authentication {
                    peer,
                    reason: "the worker address carries no valid MAC under this context's secret".into(),
                })
            }
            None => self.check_peer_address(addr.ucx_bytes())?,
        }
        let shm = crate::identity::shares_memory(&addr.identity())
            && addr.has_shared_memory()
            && self.context().has_shared_memory();
        let peer_mode = opts.error_mode.peer_mode(shm);
        let ep = self.create_ep(Target::Address(addr.ucx_bytes()), peer, peer_mode)?;
        ep.set_peer_uuid(crate::ucx_address::uuid_of(addr.ucx_bytes()));
        if opts.handshake {
            let lane = ep.client_handshake(opts.timeout).await?;
            let same_host = addr.identity().same_host();
            ep.start_keepalive(lane, &crate::ucx_address::tcp_ips(addr.ucx_bytes(), same_host));
        }
        ep.check_required(&opts.require_transports)?;
        Ok(ep)
    }
}

/// The error for a connect payload where none can travel.
fn no_payload(what: &str) -> Error {
    Error::ApiMisuse(format!("{what} carries no connect payload (EndpointOptions::connect_payload)"))
}
