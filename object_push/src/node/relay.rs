//! Reaching relays: a node listens on a socket address ([`ObjectNode::listen`]) so that
//! the receivers of a broadcast can connect to it and pull what it has; it keeps the
//! endpoints it accepted and those it connected to relays, for the next broadcasts.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use ucxkit_transport::{Endpoint, Listener};

use super::{Inner, ObjectNode};
use crate::error::{Error, Result};

/// The most relay endpoints a node keeps (more: those kept are dropped).
const MAX_RELAY_ENDPOINTS: usize = 256;
/// How long a connection to a relay may take (beyond it, the pull goes without it).
const RELAY_CONNECT: Duration = Duration::from_secs(5);
/// How long the accept loop waits after a failed connection request.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// The endpoints a node keeps for relaying: accepted from receivers, connected to relays.
#[derive(Default)]
pub(super) struct Links {
    accepted: Vec<Endpoint>,
    relays: HashMap<SocketAddr, Endpoint>,
}

impl ObjectNode {
    /// Listens on `addr` (port 0: any free port) for receivers that pull from this node
    /// as a relay of a broadcast, and returns the address bound. Without it, the
    /// receivers below this node in a broadcast pull from the owner instead. A node
    /// listens once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the node listens already; the transport's error
    /// when the address cannot be bound.
    pub fn listen(&self, addr: SocketAddr) -> Result<SocketAddr> {
        let inner = &self.inner;
        if inner.listening.get().is_some() {
            return Err(Error::InvalidArgument("the node listens already".into()));
        }
        let listener = inner.ns.worker().listen(addr)?;
        let bound = listener.local_addr();
        if inner.listening.set(bound).is_err() {
            return Err(Error::InvalidArgument("the node listens already".into()));
        }
        let task = tokio::spawn(accept(Arc::downgrade(inner), listener));
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner).push(task);
        Ok(bound)
    }
}

/// Accepts receivers' connections until the node goes, keeping the endpoints that work.
async fn accept(inner: Weak<Inner>, listener: Listener) {
    loop {
        let req = match listener.next().await {
            Ok(req) => req,
            Err(e) => {
                if inner.strong_count() == 0 {
                    return;
                }
                // A worker shut down answers at once, every time: look again later.
                tracing::debug!(%e, "a receiver's connection request failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let ep = match req.accept().await {
                Ok(ep) => ep,
                Err(e) => return tracing::debug!(%e, "a receiver's connection failed"),
            };
            let Some(node) = inner.upgrade() else { return };
            let mut l = node.links.lock().unwrap_or_else(PoisonError::into_inner);
            l.accepted.retain(|e| e.failure().is_none());
            if l.accepted.len() >= MAX_RELAY_ENDPOINTS {
                l.accepted.remove(0);
            }
            l.accepted.push(ep);
        });
    }
}

impl Inner {
    /// The address this node listens on for receivers, if it does.
    pub(super) fn listening(&self) -> Option<SocketAddr> {
        self.listening.get().copied()
    }

    /// An endpoint to the relay at `addr`: kept from an earlier offer while it works,
    /// connected otherwise; `None` for this node's own address or a relay that cannot
    /// be reached (the pull then goes without it).
    pub(super) async fn relay(&self, addr: SocketAddr) -> Option<Endpoint> {
        if self.listening().is_some_and(|own| is_self(own, addr)) {
            return None;
        }
        let kept = self.links.lock().unwrap_or_else(PoisonError::into_inner).relays.get(&addr).cloned();
        if let Some(ep) = kept.filter(|ep| ep.failure().is_none()) {
            return Some(ep);
        }
        let limit = RELAY_CONNECT.min(self.opts.deadline);
        let ep = match tokio::time::timeout(limit, self.ns.worker().connect(addr)).await {
            Ok(Ok(ep)) => ep,
            Ok(Err(e)) => {
                tracing::debug!(%addr, %e, "a relay could not be reached");
                return None;
            }
            Err(_) => return None,
        };
        let mut l = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        if l.relays.len() >= MAX_RELAY_ENDPOINTS {
            l.relays.clear();
        }
        l.relays.insert(addr, ep.clone());
        Some(ep)
    }
}

/// Whether `addr` is this node's listening address `own`: the same, or on this host's
/// addresses where the node listens on all of them (an address this host can bind to is
/// its own).
fn is_self(own: SocketAddr, addr: SocketAddr) -> bool {
    own.port() == addr.port()
        && (own.ip() == addr.ip()
            || (own.ip().is_unspecified()
                && std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0)).is_ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_knows_its_own_address() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let cases = [
            ("127.0.0.1:7000", "127.0.0.1:7000", true),
            ("127.0.0.1:7000", "127.0.0.1:7001", false),
            ("0.0.0.0:7000", "127.0.0.1:7000", true),
            // Another host's address, though the port is the same.
            ("0.0.0.0:7000", "192.0.2.7:7000", false),
            ("10.0.0.1:7000", "127.0.0.1:7000", false),
        ];
        for (own, addr, want) in cases {
            assert_eq!(is_self(at(own), at(addr)), want, "{own} {addr}");
        }
    }
}
