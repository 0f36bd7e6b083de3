//! Ports for servers whose address is handed out before they bind it (a launcher's
//! `MASTER_PORT`, a tool's store or server).

use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;

use crate::payload::Rng;

/// Where ports are drawn from when the system's range of ephemeral ports cannot be read.
const EPHEMERAL_LOW: u16 = 32768;

/// The lowest port drawn from.
const LOWEST: u16 = 10_000;

/// A TCP port on 127.0.0.1 that was free a moment ago. It is drawn at random below the
/// system's range of ephemeral ports (`/proc/sys/net/ipv4/ip_local_port_range`), because
/// the system never hands those out to a client socket. A port the system picks itself
/// comes from that range: a client socket opened between the check and the server's bind
/// (the ranks' own connections, say) could take it, and the bind then fails. Where no
/// such port is found, the system's pick.
///
/// # Errors
/// When no socket can be bound.
pub fn free_port() -> std::io::Result<u16> {
    let high = ephemeral_low().unwrap_or(EPHEMERAL_LOW);
    if high > LOWEST {
        let mut rng = Rng::new(std::collections::hash_map::RandomState::new().build_hasher().finish());
        for _ in 0..64 {
            let port = LOWEST + rng.below(usize::from(high - LOWEST)) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr().map(|a| a.port())
}

/// The first port of the system's ephemeral range.
fn ephemeral_low() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ports come from below the ephemeral range and can be bound.
    #[test]
    fn ports_are_free_and_below_the_ephemeral_range() {
        let high = ephemeral_low().unwrap_or(EPHEMERAL_LOW);
        for _ in 0..20 {
            let port = free_port().expect("port");
            if high > LOWEST {
                assert!((LOWEST..high).contains(&port), "{port} outside {LOWEST}..{high}");
            }
            TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
