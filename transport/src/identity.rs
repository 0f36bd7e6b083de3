//! Who a process is, as far as a peer needs to know: the host's boot id, the pid
//! namespace, the pid and the process start time. Peers exchange it in worker addresses
//! and the connection handshake so that a peer on the same host can be watched through a
//! pidfd (see [`crate::liveness`]).

use std::sync::OnceLock;

/// Identity of one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ProcessIdentity {
    /// `/proc/sys/kernel/random/boot_id`: the same on every process of one running kernel.
    pub boot_id: [u8; 16],
    /// Inode of `/proc/self/ns/pid`: pids are comparable only within one namespace.
    pub pid_ns: u64,
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22): tells a process
    /// from a later one that reuses its pid.
    pub start_time: u64,
}

/// Encoded size of a [`ProcessIdentity`].
pub(crate) const ENCODED_LEN: usize = 16 + 8 + 4 + 8;

impl ProcessIdentity {
    /// This process (computed once).
    pub fn current() -> ProcessIdentity {
        static ME: OnceLock<ProcessIdentity> = OnceLock::new();
        *ME.get_or_init(|| {
            let pid = std::process::id();
            ProcessIdentity {
                boot_id: boot_id().unwrap_or_default(),
                pid_ns: pid_ns().unwrap_or(0),
                pid,
                start_time: start_time(pid).unwrap_or(0),
            }
        })
    }

    /// Runs on the same kernel as this process.
    pub fn same_host(&self) -> bool {
        let me = Self::current();
        self.boot_id != [0; 16] && self.boot_id == me.boot_id
    }

    /// Another process on this host whose pid this process can watch.
    pub fn watchable(&self) -> bool {
        let me = Self::current();
        self.same_host() && self.pid_ns != 0 && self.pid_ns == me.pid_ns && self.pid != me.pid
    }

    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.boot_id);
        out.extend_from_slice(&self.pid_ns.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.start_time.to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8]) -> Option<ProcessIdentity> {
        if b.len() < ENCODED_LEN {
            return None;
        }
        Some(ProcessIdentity {
            boot_id: b[0..16].try_into().ok()?,
            pid_ns: u64::from_le_bytes(b[16..24].try_into().ok()?),
            pid: u32::from_le_bytes(b[24..28].try_into().ok()?),
            start_time: u64::from_le_bytes(b[28..36].try_into().ok()?),
        })
    }
}

fn boot_id() -> Option<[u8; 16]> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: String = s.trim().chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn pid_ns() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// Field 22 of `/proc/PID/stat` (after the parenthesised command name, which may itself
/// contain spaces and parentheses).
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    // After ')' come fields 3.. ; field 22 is the 20th of them.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process with `identity` can share memory with this one: same kernel, same
/// pid namespace (UCX's shared-memory transports reach a peer process through them).
pub(crate) fn shares_memory(identity: &ProcessIdentity) -> bool {
    let me = ProcessIdentity::current();
    identity.same_host() && identity.pid_ns != 0 && identity.pid_ns == me.pid_ns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_is_sane_and_roundtrips() {
        let me = ProcessIdentity::current();
        assert_eq!(me.pid, std::process::id());
        assert_ne!(me.boot_id, [0; 16]);
        assert!(me.start_time > 0);
        assert!(me.same_host());
        assert!(!me.watchable(), "a process does not watch itself");
        let mut v = Vec::new();
        me.encode(&mut v);
        assert_eq!(v.len(), ENCODED_LEN);
        assert_eq!(ProcessIdentity::decode(&v), Some(me));
        assert_eq!(ProcessIdentity::decode(&v[..10]), None);
    }

    #[test]
    fn other_host_is_not_watchable() {
        let mut other = ProcessIdentity::current();
        other.boot_id[0] ^= 1;
        other.pid += 1;
        assert!(!other.same_host());
        assert!(!other.watchable());
    }

    #[test]
    fn this_process_shares_memory_with_itself_not_with_another_host() {
        assert!(shares_memory(&ProcessIdentity::current()));
        let mut other = ProcessIdentity::current();
        other.boot_id[0] ^= 1;
        assert!(!shares_memory(&other));
        let mut ns = ProcessIdentity::current();
        ns.pid_ns ^= 1;
        assert!(!shares_memory(&ns));
    }
}
