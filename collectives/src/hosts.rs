//! Which ranks share a host: [`Hosts`], the layout the planner prices links with (shared
//! memory inside a host, the network between hosts) and the two-level algorithms are
//! built on, [`this_host`], the key by which ranks find out, and [`host_cpus`], the
//! processors that say whether a host's ranks crowd it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The ranks of a communicator grouped by host. Hosts are numbered in the order of their
/// first rank, and a host's ranks are listed in rank order; its first rank is its leader
/// unless an operation (a broadcast's root) names another.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Hosts {
    host: Vec<usize>,
    members: Vec<Vec<usize>>,
    /// Processors online per host (0: not known).
    cpus: Vec<usize>,
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
        let cpus = vec![0; members.len()];
        Hosts { host, members, cpus }
    }

    /// This layout with the processors each rank reported for its host (`cpus[r]`; 0:
    /// not known); a host counts the fewest any of its ranks reported.
    pub fn with_cpus(mut self, cpus: &[usize]) -> Hosts {
        for (h, members) in self.members.iter().enumerate() {
            let known = members.iter().filter_map(|&r| cpus.get(r).copied()).filter(|&c| c > 0);
            self.cpus[h] = known.min().unwrap_or(0);
        }
        self
    }

    /// Whether host `h` runs more of the ranks than it has processors (known), so that
    /// the rank a message waits for is often not running.
    pub fn crowded(&self, h: usize) -> bool {
        let cpus = self.cpus.get(h).copied().unwrap_or(0);
        cpus > 0 && self.members.get(h).is_some_and(|m| m.len() > cpus)
    }

    /// The processors of rank `r`'s host (0: not known).
    pub fn cpus_of(&self, r: usize) -> usize {
        self.host.get(r).and_then(|&h| self.cpus.get(h)).copied().unwrap_or(0)
    }

    /// Whether any host is [`Hosts::crowded`].
    pub fn any_crowded(&self) -> bool {
        (0..self.count()).any(|h| self.crowded(h))
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
        let cpus: Vec<usize> = ranks.iter().map(|&r| self.cpus_of(r)).collect();
        Hosts::from_keys(&ranks.iter().map(|&r| self.host[r]).collect::<Vec<_>>()).with_cpus(&cpus)
    }

    /// The processors of the fewest-processor host holding `m` ranks (0: none known):
    /// what a group of `m` ranks of such a host has.
    pub fn cpus_of_size(&self, m: usize) -> usize {
        let of_size = (0..self.count()).filter(|&h| self.members[h].len() == m);
        of_size.map(|h| self.cpus[h]).filter(|&c| c > 0).min().unwrap_or(0)
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

/// The processors this host has online (see [`ucxkit_transport::host_cpus`]).
pub use ucxkit_transport::host_cpus;

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

    /// A host is crowded when it runs more ranks than the fewest processors any of its
    /// ranks reported; unknown counts (0) never crowd; sub-layouts keep the counts.
    #[test]
    fn crowding_follows_reported_processors() {
        let table: [(&[u8], &[usize], &[bool]); 5] = [
            (&[0, 0, 0, 0], &[2, 2, 2, 2], &[true]),
            (&[0, 0, 0, 0], &[4, 4, 4, 4], &[false]),
            (&[0, 0, 0, 0], &[8, 2, 8, 8], &[true]),
            (&[0, 1, 0, 1], &[1, 2, 1, 2], &[true, false]),
            (&[0, 0, 0], &[0, 0, 0], &[false]),
        ];
        for (keys, cpus, want) in table {
            let h = Hosts::from_keys(keys).with_cpus(cpus);
            let got: Vec<bool> = (0..h.count()).map(|i| h.crowded(i)).collect();
            assert_eq!(got, want, "{keys:?} with {cpus:?}");
            assert_eq!(h.any_crowded(), want.contains(&true));
        }
        let h = Hosts::from_keys(&[0, 1, 0, 1, 0]).with_cpus(&[2, 4, 2, 4, 2]);
        assert!(h.crowded(0) && !h.crowded(1));
        assert!(!h.restrict(&[0, 2]).any_crowded());
        assert!(h.restrict(&[0, 2, 4, 1]).crowded(0));
        assert_eq!((h.cpus_of_size(3), h.cpus_of_size(2), h.cpus_of_size(5)), (2, 4, 0));
        assert!(!Hosts::flat(64).any_crowded());
    }
}
