//! UCX's packed remote keys (`ucp_rkey_pack`), walked and checked against the endpoint
//! that will use them before UCX parses them.
//!
//! A packed key is a 64-bit map of the packing side's memory domains, a memory type, and
//! for each domain in the map a size byte and that domain's transport key; UCX 1.14 and
//! later may add device data after. UCX hands each transport key to the unpacker of the
//! component it associates with that remote domain on the endpoint, trusting the sizes
//! and the values inside: a key whose map names another domain than the one it was
//! packed for makes another component's code read it (UCX 1.13 then aborts, or maps a
//! shared-memory segment of length 0), and a shared-memory key whose range is larger
//! than its segment makes UCX write past the mapping it makes in this process.
//!
//! So [`sanitize`] keeps only the transport keys of the remote domains the endpoint's
//! lanes use (`ucp_ep_print_info` names each lane's remote domain and its component),
//! requires each to have the size this context's own keys have for that component (and
//! a posix segment to be named the way this context names its own),
//! checks a shared-memory key's segment against the range the key is used for (posix:
//! the length in the key, which the segment's file must hold, and the file must be a
//! UCX segment's, not any descriptor the key's process id and number name; sysv: the
//! segment's size, asked of the kernel), leaves out
//! components it cannot check (xpmem), takes host memory only, and packs the rest anew
//! for UCX, with what UCX itself packs after the transport keys for host memory in
//! place of the peer's.

use std::collections::HashMap;
use std::ops::Range;

use ucx_sys as sys;

/// A walked key: the domain map, the memory type, each domain's transport key, and what
/// follows them.
#[derive(Debug)]
pub(crate) struct Walked {
    pub(crate) mem_type: u8,
    /// (remote domain index, transport key bytes).
    pub(crate) entries: Vec<(u32, Range<usize>)>,
    pub(crate) tail: Range<usize>,
}

/// Walks a packed key's layout, never past its end.
pub(crate) fn walk(ucx: &[u8]) -> Result<Walked, String> {
    if ucx.len() < 9 {
        return Err(format!("UCX key of {} bytes is too short", ucx.len()));
    }
    let md_map = u64::from_ne_bytes(ucx[..8].try_into().expect("8 bytes"));
    let mem_type = ucx[8];
    if mem_type as u32 >= sys::UCS_MEMORY_TYPE_LAST.0 as u32 {
        return Err(format!("unknown memory type {mem_type} in the UCX key"));
    }
    let mut at = 9usize;
    let mut entries = Vec::new();
    for md in (0..64u32).filter(|i| md_map & (1 << i) != 0) {
        let size = *ucx.get(at).ok_or("UCX key ends inside its domain list")? as usize;
        let start = at + 1;
        at = start + size;
        if at > ucx.len() {
            return Err("UCX key's domain sizes run past its length".into());
        }
        entries.push((md, start..at));
    }
    Ok(Walked { mem_type, entries, tail: at..ucx.len() })
}

/// The remote memory domains an endpoint's lanes use, with their components, from
/// `ucp_ep_print_info` lines like
/// `lane[0]:  8:posix/memory.0 md[4]  -> md[2]/posix/sysdev[255] rma_bw#0 am`.
pub(crate) fn lane_domains(info: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for line in info.lines().filter(|l| l.contains("lane[")) {
        let Some(dst) = line.split("-> md[").nth(1) else { continue };
        let Some((idx, rest)) = dst.split_once("]/") else { continue };
        let Ok(idx) = idx.trim().parse::<u32>() else { continue };
        let cmpt = rest.split(|c: char| c == '/' || c.is_whitespace()).next().unwrap_or("");
        if idx < 64 && !cmpt.is_empty() && !out.iter().any(|(i, _)| *i == idx) {
            out.push((idx, cmpt.to_string()));
        }
    }
    out
}

/// The memory domains in `ucp_context_print_info` lines like
/// `#            md 2  :  component 3  posix`, as (domain index, component name).
pub(crate) fn context_domains(info: &str) -> Vec<(u32, String)> {
    info.lines()
        .filter_map(|l| {
            let rest = l.trim_start_matches('#').trim_start().strip_prefix("md ")?;
            let (idx, rest) = rest.split_once(':')?;
            let name = rest.split_whitespace().nth(2)?;
            Some((idx.trim().parse().ok()?, name.to_string()))
        })
        .collect()
}

/// Components whose transport keys name no memory of this machine: the copy runs over a
/// network (tcp, InfiniBand) or in the process the endpoint's peer address names (cma,
/// knem: never this process unless the endpoint is to a worker of it, which takes keys
/// of this process's regions only, see [`crate::Endpoint::unpack_key`]).
const PEER_SIDE: [&str; 3] = ["cma", "knem", "tcp"];

/// What this context's own key for host memory shows: each component's transport key,
/// and what UCX packs after them (nothing before UCX 1.20; then the memory's system
/// device, unknown for host memory).
#[derive(Debug, Default)]
pub(crate) struct OwnKey {
    pub(crate) by_component: HashMap<String, Vec<u8>>,
    pub(crate) tail: Vec<u8>,
}

/// `UCS_MEMORY_TYPE_HOST`: the memory type of every key ucxkit takes from a peer.
const HOST: u8 = 0;

/// The key to hand UCX for an access range `range` (the key's addresses) on an endpoint
/// whose lanes use `lanes`, where `own` is this context's own key (see the module
/// docs) and `here` says the key is of a region of this process (which the key holds,
/// and the range lies in). An error for a key that lies about itself; transport keys of
/// domains no lane uses, or of components not checked, are left out.
pub(crate) fn sanitize(
    ucx: &[u8],
    lanes: &[(u32, String)],
    own: &OwnKey,
    range: Range<u64>,
    here: bool,
) -> Result<Vec<u8>, String> {
    let w = walk(ucx)?;
    if w.mem_type != HOST {
        return Err(format!(
            "a key for memory of type {} (device memory?): keys of host memory only are taken from peers",
            w.mem_type
        ));
    }
    let mut map = 0u64;
    let mut body = Vec::new();
    for (md, tl) in &w.entries {
        let Some((_, cmpt)) = lanes.iter().find(|(i, _)| i == md) else { continue };
        let key = &ucx[tl.clone()];
        let Some(template) = own.by_component.get(cmpt) else { continue };
        let size = template.len();
        if key.len() != size {
            return Err(format!(
                "the {cmpt} key of remote domain {md} is {} bytes, where {cmpt} keys are {size}",
                key.len()
            ));
        }
        let usable = match cmpt.as_str() {
            "posix" => check_posix(key, template, &range, here)?,
            "sysv" => check_sysv(key, &range, here)?,
            // The worker's own memory: only a region of this process.
            "self" => here,
            c => PEER_SIDE.contains(&c) || c.starts_with("ib"),
        };
        if usable {
            map |= 1 << md;
            body.push(key.len() as u8);
            body.extend_from_slice(key);
        }
    }
    let mut out = map.to_ne_bytes().to_vec();
    out.push(w.mem_type);
    out.extend_from_slice(&body);
    // What follows is this UCX's own for host memory: the peer's system device and
    // distances are UCX's to trust (1.22 reads past a key that ends early, and takes
    // any device number), and host memory has none.
    out.extend_from_slice(&own.tail);
    Ok(out)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A posix key (`uct_posix_packed_rkey_t`: segment id, address, length, and a directory
/// name for segments in files): UCX opens the segment the way its id's mode bits say
/// (which must be this context's way, `own`'s: another makes UCX 1.13 abort), maps
/// `length` bytes of it, and reaches the key's addresses relative to `address`, so the
/// range must lie inside. A segment of this process is a region's of this process
/// only (`here`).
fn check_posix(key: &[u8], own: &[u8], range: &Range<u64>, here: bool) -> Result<bool, String> {
    if key.len() < 24 || own.len() < 8 {
        return Err(format!("a posix key of {} bytes, where this context's are {}", key.len(), own.len()));
    }
    let seg = u64_at(key, 0);
    let mode = crate::ucx_posix::POSIX_MODE_BITS;
    if seg & mode != u64_at(own, 0) & mode {
        return Err("the key's posix segment is named another way than this context's".into());
    }
    if let Some(pid) = crate::ucx_posix::posix_procfs_pid(seg) {
        // With the pid namespace after the packed key, where UCX adds one.
        let ns = (seg & crate::ucx_posix::POSIX_PID_NS != 0)
            .then(|| key.get(24..32).map_or(0, |_| u64_at(key, 24)));
        if !here && crate::ucx_posix::is_this_process(pid, ns) {
            return Err("the key's posix segment is this process's, and the key is not of its regions".into());
        }
    }
    let (address, length) = (u64_at(key, 8), u64_at(key, 16));
    let end = address.checked_add(length).ok_or("a posix segment that wraps around")?;
    // UCX maps `length` bytes of the file (the owner's length rounded up to whole pages,
    // where the file is as long as asked): a page wholly past its end is a SIGBUS.
    match crate::ucx_posix::posix_segment_len(seg) {
        Some(n) if page_align(n) >= length => {}
        Some(n) => return Err(format!("the key's posix segment holds {n} bytes, the key says {length}")),
        None => return Err("the key's posix segment cannot be opened here".into()),
    }
    if length == 0 || range.start < address || range.end > end {
        return Err(format!(
            "the range {:#x}..{:#x} is not inside the key's posix segment {address:#x}+{length}",
            range.start, range.end
        ));
    }
    Ok(true)
}

/// `n` rounded up to whole pages (a segment in huge pages lives on hugetlbfs, whose
/// files are whole huge pages long already).
fn page_align(n: u64) -> u64 {
    // SAFETY: sysconf reads a value; no memory is passed.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    };
    n.div_ceil(page).saturating_mul(page)
}

/// A sysv key (`uct_sysv_packed_rkey_t`: segment id, the owner's address): UCX attaches
/// the whole segment, whose size the kernel tells.
fn check_sysv(key: &[u8], range: &Range<u64>, here: bool) -> Result<bool, String> {
    if key.len() < 12 {
        return Err(format!("a sysv key of {} bytes", key.len()));
    }
    let shmid = i32::from_ne_bytes(key[..4].try_into().expect("4 bytes"));
    let owner = u64::from_ne_bytes(key[4..12].try_into().expect("8 bytes"));
    // SAFETY: shmid_ds is plain data; all-zero is a valid value for the kernel to fill.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one shmid_ds into `ds`, valid for the call.
    if unsafe { libc::shmctl(shmid, libc::IPC_STAT, &mut ds) } != 0 {
        return Err(format!("the key's sysv segment {shmid}: {}", std::io::Error::last_os_error()));
    }
    // As for posix: a segment this process made is a region's of this process only.
    // SAFETY: getpid has no preconditions.
    if !here && ds.shm_cpid == unsafe { libc::getpid() } {
        return Err("the key's sysv segment is this process's, and the key is not of its regions".into());
    }
    let end = owner.checked_add(ds.shm_segsz as u64).ok_or("a sysv segment that wraps around")?;
    if range.start < owner || range.end > end {
        return Err(format!(
            "the range {:#x}..{:#x} is not inside the key's sysv segment {owner:#x}+{}",
            range.start, range.end, ds.shm_segsz
        ));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_are_read_from_ucx_printouts() {
        let ep = "#                 lane[0]:  8:posix/memory.0 md[4]      -> md[2]/posix/sysdev[255] rma_bw#0 am am_bw#0\n\
                  #                 lane[1]:  3:cma/memory.0 md[1]        -> md[1]/cma/sysdev[255] rma_bw#1\n\
                  #                 lane[2]:  1:tcp/lo.0 md[0]  -> am\n\
                  #                 lane[3]:  1:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] rma_bw#2\n";
        assert_eq!(
            lane_domains(ep),
            [(2, "posix".to_string()), (1, "cma".to_string()), (0, "tcp".to_string())]
        );
        let ctx = "#\n#            md 0  :  component 0  self \n#            md 2  :  component 3  posix \n";
        assert_eq!(context_domains(ctx), [(0, "self".to_string()), (2, "posix".to_string())]);
    }

    fn key(entries: &[(u32, Vec<u8>)]) -> Vec<u8> {
        let map: u64 = entries.iter().map(|(m, _)| 1u64 << m).sum();
        let mut v = map.to_ne_bytes().to_vec();
        v.push(0);
        for (_, k) in entries {
            v.push(k.len() as u8);
            v.extend_from_slice(k);
        }
        v
    }

    /// A file of nearly 0x2000 bytes, opened and unlinked, and its procfs segment id.
    fn file(prefix: &str) -> (std::fs::File, u64) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}ucxkit-test-{}-{n}", std::process::id());
        let path = std::env::temp_dir().join(name);
        let file =
            std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        // UCX makes the file as long as asked and maps whole pages of it.
        file.set_len(0x2000 - 100).unwrap();
        let id = (1u64 << 63) | ((file.as_raw_fd() as u64) << 30) | u64::from(std::process::id());
        (file, id)
    }

    fn posix_key(seg: u64, address: u64, length: u64) -> Vec<u8> {
        [seg, address, length].iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    /// A file named the way UCX's posix segments are.
    fn segment() -> (std::fs::File, u64) {
        file(crate::ucx_posix::SEGMENT_PREFIX)
    }

    #[test]
    fn posix_segments_are_sized_through_procfs() {
        let (_other, other) = file("");
        assert_eq!(crate::ucx_posix::posix_segment_len(other), None, "a file that is no UCX segment");
        let (_file, id) = segment();
        assert_eq!(crate::ucx_posix::posix_segment_len(id), Some(0x2000 - 100));
        assert_eq!(page_align(0x2000 - 100) % page_align(1), 0);
        assert!(page_align(0x2000 - 100) >= 0x2000);
        assert_eq!(crate::ucx_posix::posix_segment_len(id ^ (1 << 63)), None, "neither procfs nor shm_open");
    }

    #[test]
    fn keys_keep_only_what_the_lanes_use_and_can_be_checked() {
        let (_file, seg) = segment();
        let posix_key = |address, length| posix_key(seg, address, length);
        let sizes = OwnKey {
            by_component: [("posix".to_string(), posix_key(0, 1)), ("cma".to_string(), vec![])].into(),
            // UCX 1.20 and later: host memory's system device, unknown.
            tail: vec![0xff],
        };
        let tailed = |k: Vec<u8>| [k, vec![0xff]].concat();
        let lanes = [(2, "posix".to_string()), (1, "cma".to_string())];
        let k = key(&[(1, vec![]), (2, posix_key(0x1000, 0x1000)), (5, vec![9; 3])]);
        let out = sanitize(&k, &lanes, &sizes, 0x1000..0x2000, true).unwrap();
        // The segment (a file of this process, as the test makes it) is refused for a key
        // that is not of a region of this process: UCX would write into this process.
        assert!(sanitize(&k, &lanes, &sizes, 0x1000..0x2000, false).unwrap_err().contains("this process"));
        // Domain 5 (no lane) left out; 1 and 2 kept; this UCX's tail after them.
        assert_eq!(out, tailed(key(&[(1, vec![]), (2, posix_key(0x1000, 0x1000))])));
        // Whatever the peer packed after the transport keys (here a system device with
        // UCX's flush bit, which UCX 1.22 takes and then crashes on) is replaced.
        let with_device = [k.clone(), vec![0x80, 1, 2]].concat();
        assert_eq!(sanitize(&with_device, &lanes, &sizes, 0x1000..0x2000, true).unwrap(), out);
        // Host memory only.
        let mut cuda = k.clone();
        cuda[8] = 1;
        assert!(sanitize(&cuda, &lanes, &sizes, 0x1000..0x2000, true).is_err());
        // The posix segment must hold the range.
        assert!(sanitize(&k, &lanes, &sizes, 0x1000..0x2001, true).is_err());
        assert!(sanitize(&k, &lanes, &sizes, 0xfff..0x1000, true).is_err());
        let empty = key(&[(2, posix_key(0x1000, 0))]);
        assert!(sanitize(&empty, &lanes, &sizes, 0x1000..0x1000, true).is_err());
        let mut renamed = posix_key(0x1000, 0x1000);
        renamed[7] ^= 0xc0;
        assert!(sanitize(&key(&[(2, renamed)]), &lanes, &sizes, 0x1000..0x1001, true).is_err());
        // A segment smaller than the key says is refused (an access past its end is a
        // SIGBUS in UCX's mapping).
        let long = key(&[(2, posix_key(0x1000, 0x2000 + page_align(1)))]);
        assert!(sanitize(&long, &lanes, &sizes, 0x1000..0x1001, true).is_err());
        // A key moved to another domain (its map changed) meets another component's size.
        let moved = key(&[(1, posix_key(0x1000, 0x1000))]);
        assert!(sanitize(&moved, &lanes, &sizes, 0x1000..0x2000, true).is_err());
        // The self transport reaches this worker's own memory: a region of this process only.
        let mut with_self = OwnKey { by_component: sizes.by_component.clone(), tail: sizes.tail.clone() };
        with_self.by_component.insert("self".to_string(), vec![]);
        let self_lanes = [(4, "self".to_string())];
        let k = key(&[(4, vec![])]);
        assert_eq!(sanitize(&k, &self_lanes, &with_self, 0..1, true).unwrap(), tailed(k.clone()));
        assert_eq!(sanitize(&k, &self_lanes, &with_self, 0..1, false).unwrap(), tailed(key(&[])));
        // A component with no size known here is left out.
        let lanes = [(3, "xpmem".to_string())];
        assert_eq!(
            sanitize(&key(&[(3, vec![1; 16])]), &lanes, &sizes, 0..1, true).unwrap(),
            tailed(key(&[]))
        );
    }

    #[test]
    fn layouts_are_walked_within_bounds() {
        let k = key(&[(0, vec![1, 2]), (3, vec![])]);
        let w = walk(&k).unwrap();
        assert_eq!(w.entries.len(), 2);
        for n in 0..k.len() {
            assert!(walk(&k[..n]).is_err(), "cut at {n}");
        }
        let mut bad = k.clone();
        bad[8] = 200;
        assert!(walk(&bad).is_err(), "memory type");
    }

    /// A sysv segment this process made is reachable by a key of its own regions only.
    #[test]
    fn sysv_segments_of_this_process() {
        // SAFETY: a private segment of one page, removed below; no memory is passed.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 4096, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
        let owner = 0x1000_0000u64;
        let key: Vec<u8> = [&id.to_ne_bytes()[..], &owner.to_ne_bytes()[..]].concat();
        let inside = owner..owner + 64;
        let other = check_sysv(&key, &inside, false);
        let here = check_sysv(&key, &inside, true);
        let outside = check_sysv(&key, &(owner..owner + 8192), true);
        // SAFETY: removes the segment made above, attached nowhere.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        assert!(other.unwrap_err().contains("this process's"));
        assert_eq!(here, Ok(true));
        assert!(outside.is_err());
    }
}
