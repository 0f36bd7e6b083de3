//! Which ranks share a host: [`Hosts`], the layout the planner prices links with (shared
//! memory inside a host, the network between hosts) and the two-level algorithms are
//! built on, and [`this_host`], the key by which ranks find out.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The ranks of a communicator grouped by host. Hosts are numbered in the order of their
/// first rank, and a host's ranks are listed in rank order; its first rank is its leader
/// unless an operation (a broadcast's root) names another.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Hosts {
    host: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Hosts {
    /// `n` ranks on one host.
    pub fn flat(n: usize) -> Hosts {
        Hosts::from_keys(&vec![0; n])
    }

    /// The layout in which ranks with equal `keys[r]` share a host.
    pub fn from_keys<K: Eq + Hash>(keys: &[K]) -> Hosts {
        let mut index: HashMap<&K, usize> = HashMap::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let host = keys
            .iter()
            .enumerate()
            .map(|(r, k)| {
                let h = *index.entry(k).or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
                members[h].push(r);
                h
            })
            .collect();
        Hosts { host, members }
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.host.len()
    }

    /// The number of hosts.
    pub fn count(&self) -> usize {
        self.members.len()
    }

    /// The host of rank `r`.
    pub fn of(&self, r: usize) -> usize {
        self.host[r]
    }

    /// The ranks of host `h`, in order.
    pub fn members(&self, h: usize) -> &[usize] {
        &self.members[h]
    }

    /// Whether ranks `a` and `b` share a host.
    pub fn same(&self, a: usize, b: usize) -> bool {
        self.host[a] == self.host[b]
    }

    /// Whether the ranks span several hosts and some host holds several of them: the
    /// layouts where a two-level algorithm differs from a flat one.
    pub fn two_level(&self) -> bool {
        1 < self.count() && self.count() < self.ranks()
    }

    /// The layout of the ranks `ranks` (in that order) alone, as a sub-communicator of
    /// them sees it.
    pub fn restrict(&self, ranks: &[usize]) -> Hosts {
        Hosts::from_keys(&ranks.iter().map(|&r| self.host[r]).collect::<Vec<_>>())
    }
}

/// A key equal for processes on one host and different across hosts: a hash of the
/// host name, the kernel's boot id and the network namespace, so that namespaces on one
/// machine (containers, test hosts) count as hosts of their own. A process that cannot
/// read one of them leaves it out.
pub fn this_host() -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for path in ["/proc/sys/kernel/hostname", "/proc/sys/kernel/random/boot_id"] {
        std::fs::read(path).unwrap_or_default().hash(&mut h);
    }
    std::fs::read_link("/proc/self/ns/net").map(|p| p.into_os_string()).unwrap_or_default().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_group_by_key_in_order_of_first_rank() {
        let h = Hosts::from_keys(&["b", "a", "b", "c", "a"]);
        assert_eq!((h.ranks(), h.count()), (5, 3));
        assert_eq!((h.members(0), h.members(1), h.members(2)), (&[0, 2][..], &[1, 4][..], &[3][..]));
        assert_eq!((h.of(4), h.same(0, 2), h.same(0, 1)), (1, true, false));
        assert!(h.two_level());
        assert!(!Hosts::flat(4).two_level());
        assert!(!Hosts::from_keys(&[1, 2, 3]).two_level());
        assert_eq!(h.restrict(&[4, 3, 1]), Hosts::from_keys(&[0, 1, 0]));
        assert_eq!(this_host(), this_host());
    }
}
