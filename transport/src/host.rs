//! What this host has, for the layers that size their work to it: its processors online
//! ([`host_cpus`]), which the worker's driver counts ready threads against and the
//! collectives count ranks against.

/// The processors this host has online (`/sys/devices/system/cpu/online`, as `0-3,6`),
/// or, where that cannot be read, those this process may run on. Not this process's
/// affinity first: a launcher that binds each process to one core does not crowd them.
pub fn host_cpus() -> usize {
    let online =
        std::fs::read_to_string("/sys/devices/system/cpu/online").ok().and_then(|s| cpu_list_len(&s));
    online.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// The number of processors in a kernel CPU list (`0-3,6`), None if malformed.
fn cpu_list_len(list: &str) -> Option<usize> {
    list.trim().split(',').try_fold(0usize, |n, part| {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        n.checked_add(b.checked_sub(a)?.checked_add(1)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_their_processors() {
        let table = [
            ("0", Some(1)),
            ("0-1\n", Some(2)),
            ("0-3,6,8-9", Some(7)),
            ("", None),
            ("3-1", None),
            ("0-x", None),
            ("0-18446744073709551615", None),
        ];
        for (list, want) in table {
            assert_eq!(cpu_list_len(list), want, "{list:?}");
        }
        assert!(host_cpus() >= 1);
    }
}
