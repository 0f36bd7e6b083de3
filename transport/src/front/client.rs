//! The connecting side of the front: the opening, the request, and on accept the UCX
//! endpoint created from the listener's address and its handshake.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::conn::{Broken, Conn};
use super::server::{front_error, gave_up};
use super::wire::{Msg, Request};
use crate::address::WorkerAddress;
use crate::endpoint::{Endpoint, Target};
use crate::error::{Error, Peer, Result, Status};
use crate::identity::ProcessIdentity;
use crate::worker::{EndpointOptions, ErrorMode, Worker};

/// Connects `worker` to the listener's front at `addr` (see [`super`]).
pub(crate) async fn connect(worker: &Worker, addr: SocketAddr, opts: &EndpointOptions) -> Result<Endpoint> {
    let peer = Peer::Socket(addr);
    if opts.connect_payload.len() > crate::MAX_CONNECT_PAYLOAD {
        return Err(Error::ApiMisuse(format!(
            "a connect payload of {} bytes is over the limit of {}",
            opts.connect_payload.len(),
            crate::MAX_CONNECT_PAYLOAD
        )));
    }
    let start = Instant::now();
    let left = || opts.timeout.saturating_sub(start.elapsed());
    let stream = match tokio::time::timeout(opts.timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(%addr, "connecting to the listener: {e}");
            return Err(Error::Unreachable { peer, source: Status::UNREACHABLE });
        }
        Err(_) => return Err(Error::Timeout { op: "connect", peer, after: opts.timeout }),
    };
    let mut conn = Conn::new(stream);
    let ctx = worker.context();
    let broken = |e: Broken| front_error(&peer, e);
    conn.open_client(ctx.secret(), left()).await.map_err(broken)?;
    let uuid = worker.uuid()?;
    let conn_id = crate::auth::nonce();
    let request = Request {
        conn: conn_id,
        identity: ProcessIdentity::current(),
        uuid,
        shared_memory: ctx.has_shared_memory(),
        connection_manager: super::has_connection_manager(&ctx),
        error_mode: opts.error_mode,
        payload: opts.connect_payload.clone(),
    };
    conn.send(&Msg::Request(request)).await.map_err(broken)?;
    let accept = match conn.recv_within(left()).await {
        Ok(Msg::Accept(a)) => a,
        Ok(m) => {
            return Err(Error::Handshake { peer, reason: format!("expected the accept, got a {}", m.name()) })
        }
        Err(e) => return Err(broken(e)),
    };
    // The listener's own claims are checked before UCX sees its address.
    let wrong = if crate::ucx_address::uuid_of(&accept.address) != Some(accept.uuid) {
        Some("its worker address does not name the worker it says".to_string())
    } else if accept.uuid == uuid {
        Some("it is this worker".to_string())
    } else if opts.error_mode != ErrorMode::Auto && (opts.error_mode == ErrorMode::Peer) != accept.peer_mode {
        Some(format!("it chose an error mode other than the {:?} this side asked for", opts.error_mode))
    } else if accept.cm_port != 0 {
        // Through UCX's connection manager: the address is not used.
        (!super::has_connection_manager(&ctx))
            .then(|| "it offers UCX's connection manager to a context without one".to_string())
    } else if conn.authenticated() {
        // From a listener that proved it holds the secret: its word, past the header.
        crate::address::check_ucx_address(&accept.address).err()
    } else {
        worker.check_peer_address(&accept.address).err().map(|e| e.to_string())
    };
    if let Some(reason) = wrong {
        let _ = conn.send(&Msg::Abort { text: format!("refused the accept: {reason}") }).await;
        return Err(Error::Handshake { peer, reason: format!("the listener's accept: {reason}") });
    }
    let address = WorkerAddress::wrap(&accept.identity, accept.shared_memory, &accept.address);
    let cm = (accept.cm_port != 0).then(|| SocketAddr::new(addr.ip(), accept.cm_port));
    let mut attempt = 0u32;
    loop {
        let target = match &cm {
            // Through UCX's connection manager, on the listener's one-shot port (see
            // `front::server`).
            Some(cm) => Target::Socket(cm),
            None => Target::Address(address.ucx_bytes()),
        };
        let ep = worker.create_ep(target, peer.clone(), accept.peer_mode)?;
        // The listener writes on the front only to give up (see `gave_up`).
        let outcome = tokio::select! {
            r = ep.client_handshake_with(conn_id, cm.is_none(), left()) => r,
            e = gave_up(&mut conn, &peer) => Err(e),
        };
        match outcome {
            Ok(_) => {
                ep.set_peer_uuid(Some(accept.uuid));
                ep.check_required(&opts.require_transports)?;
                tracing::debug!(%addr, "connected through the front");
                return Ok(ep);
            }
            Err(e) if crate::handshake::is_collision(&e) && attempt < super::MAX_COLLISIONS => {
                // The endpoint is another connection's peer now: kept for it, and this
                // connection tries its next number after a random pause (so that two
                // workers connecting to each other at once do not meet again).
                ep.hide();
                attempt += 1;
                let pause = crate::auth::nonce() % (1u64 << attempt.min(6));
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Err(e) => {
                let _ = conn.send(&Msg::Abort { text: e.to_string() }).await;
                return Err(e);
            }
        }
    }
}
