//! UCX's packed worker address (`ucp_address_pack`, formats version 1 and 2, UCX 1.13 to
//! 1.22), walked and checked before an address from elsewhere reaches UCX's parser,
//! which trusts every length and value in it.
//!
//! The walk mirrors `ucp_address_unpack` with the flags `ucp_ep_create` uses (worker
//! uuid and name; no resource indices) outside UCX's unified mode, and refuses:
//! anything that would read past the end; an unknown format version (UCX aborts on
//! it) or header flag; a memory-domain index past what UCX has room for; interface
//! attributes that are not finite numbers (UCX scores lanes with them, and asserts on a
//! score that is not a number or negative); and, for each transport this worker also
//! has (UCX reads those addresses with that transport's code), device, interface and
//! endpoint addresses whose lengths differ from what that transport makes here. The
//! values inside a transport's address (a port, a shared-memory segment, a process id)
//! are the transport's to use: UCX connects to them, attaches them, reads and writes
//! the process they name. An address therefore gives its sender what a UCX peer has:
//! take addresses only from peers you trust, or seal them with a secret.

use std::collections::HashMap;
use std::ops::Range;

/// `UCP_NULL_RESOURCE`: an address with no device.
pub(crate) const NO_DEVICE: u8 = 0xff;
const FLAG_DEBUG_INFO: u8 = 1 << 0;
pub(crate) const FLAG_WORKER_UUID: u8 = 1 << 1;

/// The UCX worker uuid in a worker address in UCX's own form: after the header byte
/// (address format version 1, which always carries it) or the two header bytes (version
/// 2, when its flag says so).
pub(crate) fn uuid_of(ucx: &[u8]) -> Option<u64> {
    let at = match ucx.first()? & 0x0f {
        0 => 1,
        1 if ucx.get(1)? & FLAG_WORKER_UUID != 0 => 2,
        _ => return None,
    };
    Some(u64::from_ne_bytes(ucx.get(at..at + 8)?.try_into().ok()?))
}

/// The addresses of the tcp devices in a packed worker address, without repeats, at
/// most [`MAX_TCP_IPS`]: where a peer reached by that address may be. A loopback device
/// counts only for a peer on this host (`same_host`), as its family's loopback address;
/// link-local IPv6 addresses (which need an interface) do not count. Empty when the
/// walk fails.
pub(crate) fn tcp_ips(b: &[u8], same_host: bool) -> Vec<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let Ok(w) = walk(b) else { return Vec::new() };
    let mut ips = Vec::new();
    for e in w.entries.iter().filter(|e| e.tl_csum == crc16(b"tcp")) {
        // A tcp device address: flags, address family, the address.
        let d = &b[e.dev.clone()];
        let loopback = d.first().is_some_and(|f| f & TCP_LOOPBACK != 0);
        let ip = match (d.get(1).map(|&f| i32::from(f)), loopback) {
            (Some(libc::AF_INET), true) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            (Some(libc::AF_INET6), true) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            (Some(libc::AF_INET), false) => match d.get(2..6).and_then(|a| <[u8; 4]>::try_from(a).ok()) {
                Some(a) => IpAddr::from(a),
                None => continue,
            },
            (Some(libc::AF_INET6), false) => match d.get(2..18).and_then(|a| <[u8; 16]>::try_from(a).ok()) {
                Some(a) => IpAddr::from(a),
                None => continue,
            },
            _ => continue,
        };
        let link_local = matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
        if ip.is_unspecified() || link_local || (ip.is_loopback() && !same_host) || ips.contains(&ip) {
            continue;
        }
        ips.push(ip);
        if ips.len() == MAX_TCP_IPS {
            break;
        }
    }
    ips
}

/// At most this many addresses from [`tcp_ips`].
const MAX_TCP_IPS: usize = 8;
const FLAG_CLIENT_ID: u8 = 1 << 2;
const FLAG_AM_ONLY: u8 = 1 << 3;
/// Device length byte: last device; number of paths follows; system device follows.
const DEV_LAST: u8 = 0x80;
const DEV_NUM_PATHS: u8 = 0x40;
const DEV_SYS_DEVICE: u8 = 0x20;
const DEV_LEN_MASK: u8 = !(DEV_LAST | DEV_NUM_PATHS | DEV_SYS_DEVICE);
/// Memory-domain byte: a device without transports.
const MD_EMPTY_DEV: u8 = 0x80;
/// Version 1 kept two flags in the memory-domain byte (UCX 1.18 and older).
const MD_LEGACY_BITS: u8 = 0x40 | 0x20;
const MD_MASK_V1: u8 = !(MD_EMPTY_DEV | MD_LEGACY_BITS);
const MD_MASK_V2: u8 = !MD_EMPTY_DEV;
/// Interface length byte: last interface of the device; endpoint addresses follow.
const IFACE_LAST: u8 = 0x80;
const IFACE_HAS_EP: u8 = 0x40;
const IFACE_LEN_MASK: u8 = !(IFACE_LAST | IFACE_HAS_EP);
/// Interface attributes: four 32-bit fields (version 1), eight bytes (version 2).
const ATTR_V1: usize = 16;
const ATTR_V2: usize = 8;
/// `UCT_TCP_DEVICE_ADDR_FLAG_LOOPBACK`, in a tcp device address's first byte.
const TCP_LOOPBACK: u8 = 1;
/// Memory domains UCX indexes in a 64-bit map.
const MAX_MDS: u32 = 64;
/// Bounds of the walk itself (UCX refuses more, gracefully).
const MAX_ENTRIES: usize = 128;
const MAX_EP_ADDRS: usize = 64;

/// One transport address of a device in a packed worker address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// `ucs_crc16_string` of the transport's name.
    pub(crate) tl_csum: u16,
    pub(crate) md_index: u32,
    pub(crate) dev: Range<usize>,
    pub(crate) iface: Range<usize>,
    pub(crate) eps: Vec<Range<usize>>,
}

/// The result of a walk.
#[derive(Debug)]
pub(crate) struct Walked {
    /// The worker's uuid, where the address carries it.
    pub(crate) uuid: Option<u64>,
    pub(crate) entries: Vec<Entry>,
}

/// Reads an address's bytes, never past the end.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn byte(&mut self, what: &str) -> Result<u8, String> {
        let v = *self.b.get(self.at).ok_or_else(|| format!("the address ends before its {what}"))?;
        self.at += 1;
        Ok(v)
    }
    fn take(&mut self, n: usize, what: &str) -> Result<Range<usize>, String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("the address ends inside its {what} ({n} bytes)"))?;
        let r = self.at..end;
        self.at = end;
        Ok(r)
    }
    /// `ucp_address_unpack_byte_extended`: a value under `mask` in this byte; in format
    /// version 2 a value equal to the mask means the next byte holds it.
    fn extended(&mut self, mask: u8, v2: bool, what: &str) -> Result<u8, String> {
        let v = self.byte(what)? & mask;
        if v2 && v == mask {
            return self.byte(what);
        }
        Ok(v)
    }
}

/// Walks a packed worker address as `ucp_ep_create` of the UCX loaded here would read
/// it.
pub(crate) fn walk(b: &[u8]) -> Result<Walked, String> {
    walk_as(b, crate::Context::ucx_version().1)
}

/// How UCX 1.`minor` reads a version 1 address's memory-domain byte: before 1.19 the
/// index is its low 5 bits (the next two were flags); from 1.19 its low 7, the two
/// former flag bits cleared only for an address from UCX 1.18 or older (the release an
/// empty last device names, or none named).
fn v1_md_mask(minor: u32) -> u8 {
    if minor < 19 {
        MD_MASK_V1
    } else {
        MD_MASK_V2
    }
}

/// `ucp_address_unpack_release_version`: the UCX release a 4-bit packed one names, as
/// UCX 1.`minor` reads it (the one closest to its own).
fn release_version(packed: u32, minor: u32) -> u32 {
    const RANGE: i64 = 16;
    let delta = i64::from(minor) % RANGE - i64::from(packed);
    let base = i64::from(minor) / RANGE + i64::from(delta >= RANGE / 2) - i64::from(delta <= -RANGE / 2);
    packed + (base.max(0) * RANGE) as u32
}

/// [`walk`] as UCX 1.`minor` reads the address.
fn walk_as(b: &[u8], minor: u32) -> Result<Walked, String> {
    let mut c = Cursor { b, at: 0 };
    let first = c.byte("header")?;
    let (v2, flags) = match first & 0x0f {
        0 => (false, first >> 4),
        1 => (true, c.byte("header")?),
        v => return Err(format!("UCX address format version {} (UCX knows 1 and 2)", v + 1)),
    };
    if flags & !(FLAG_DEBUG_INFO | FLAG_WORKER_UUID | FLAG_CLIENT_ID | FLAG_AM_ONLY) != 0 {
        return Err(format!("unknown address header flags {flags:#04x}"));
    }
    // Version 1 carries the uuid whatever its flags say (UCX before 1.12 set none).
    let uuid = if !v2 || flags & FLAG_WORKER_UUID != 0 {
        let r = c.take(8, "worker uuid")?;
        Some(u64::from_ne_bytes(b[r].try_into().expect("8 bytes")))
    } else {
        None
    };
    if flags & FLAG_CLIENT_ID != 0 {
        c.take(8, "client id")?;
    }
    if flags & FLAG_DEBUG_INFO != 0 {
        let n = c.byte("worker name")?;
        c.take(n as usize, "worker name")?;
    }
    if c.b.get(c.at) == Some(&NO_DEVICE) {
        return Ok(Walked { uuid, entries: Vec::new() });
    }
    let mut entries: Vec<Entry> = Vec::new();
    // The peer's UCX release, where a version 1 address names it.
    let mut release = 0;
    loop {
        let md_byte = *c.b.get(c.at).ok_or("the address ends before a device")?;
        let empty = md_byte & MD_EMPTY_DEV != 0;
        let md_index =
            c.extended(if v2 { MD_MASK_V2 } else { v1_md_mask(minor) }, v2, "memory domain")? as u32;
        let dev_byte = *c.b.get(c.at).ok_or("the address ends before a device length")?;
        let last_dev = dev_byte & DEV_LAST != 0;
        let dev_len = c.extended(DEV_LEN_MASK, v2, "device length")?;
        if dev_byte & DEV_NUM_PATHS != 0 {
            c.byte("number of paths")?;
        }
        if dev_byte & DEV_SYS_DEVICE != 0 {
            c.byte("system device")?;
        }
        let dev = c.take(dev_len as usize, "device address")?;
        if empty && last_dev {
            release = release_version(md_index & 0x0f, minor);
        }
        let mut last_tl = empty;
        while !last_tl {
            if entries.len() >= MAX_ENTRIES {
                return Err(format!("more than {MAX_ENTRIES} transport addresses"));
            }
            let csum = c.take(2, "transport name checksum")?;
            let tl_csum = u16::from_ne_bytes(b[csum].try_into().expect("2 bytes"));
            let attr = c.take(if v2 { ATTR_V2 } else { ATTR_V1 }, "interface attributes")?;
            check_attributes(&b[attr], v2)?;
            let iface_byte = *c.b.get(c.at).ok_or("the address ends before an interface length")?;
            last_tl = iface_byte & IFACE_LAST != 0;
            let iface_len = c.extended(IFACE_LEN_MASK, v2, "interface length")?;
            let iface = c.take(iface_len as usize, "interface address")?;
            let mut eps = Vec::new();
            let mut more = iface_byte & IFACE_HAS_EP != 0;
            while more {
                if eps.len() >= MAX_EP_ADDRS {
                    return Err(format!("more than {MAX_EP_ADDRS} endpoint addresses"));
                }
                let ep_len = c.byte("endpoint address length")?;
                eps.push(c.take(ep_len as usize, "endpoint address")?);
                more = c.byte("lane")? & IFACE_LAST == 0;
            }
            entries.push(Entry { tl_csum, md_index, dev: dev.clone(), iface, eps });
        }
        if last_dev {
            break;
        }
    }
    for e in &mut entries {
        if !v2 && minor >= 19 && release <= 18 {
            e.md_index &= !u32::from(MD_LEGACY_BITS);
        }
        // UCX indexes its memory domains in a 64-bit map (and a 64-entry array).
        if e.md_index >= MAX_MDS {
            return Err(format!("memory domain index {}, past UCX's {MAX_MDS}", e.md_index));
        }
    }
    Ok(Walked { uuid, entries })
}

/// Whether an address's shared-memory parts name this process: cma's process id, or a
/// posix segment reached through this process's procfs entry. UCX would copy into the
/// named process for whoever holds a key of the endpoint.
pub(crate) fn names_this_process(b: &[u8], w: &Walked) -> bool {
    let u64_at = |at: usize| b.get(at..at + 8).map(|s| u64::from_ne_bytes(s.try_into().expect("8 bytes")));
    w.entries.iter().any(|e| {
        let at = e.iface.start;
        if e.tl_csum == crc16(b"cma") && e.iface.len() >= 4 {
            // `pid_t` with bit 31 saying a pid namespace follows (at offset 8).
            let id = u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
            let ns = (id & (1 << 31) != 0).then(|| u64_at(at + 8).unwrap_or(0));
            crate::ucx_posix::is_this_process(u64::from(id & !(1 << 31)), ns)
        } else if e.tl_csum == crc16(b"posix") && e.iface.len() >= 8 {
            u64_at(at).is_some_and(|seg| match crate::ucx_posix::posix_procfs_pid(seg) {
                Some(pid) => crate::ucx_posix::is_this_process(
                    pid,
                    (seg & crate::ucx_posix::POSIX_PID_NS != 0).then(|| u64_at(at + 8).unwrap_or(0)),
                ),
                None => false,
            })
        } else {
            false
        }
    })
}

/// Interface attributes UCX scores lanes with: finite, not negative (version 1's
/// bandwidth may be negative: older peers' way of saying "shared").
fn check_attributes(a: &[u8], v2: bool) -> Result<(), String> {
    if v2 {
        // Three 8-bit floats (4-bit exponent, 4-bit mantissa): an exponent of all ones
        // is infinity or not a number.
        for (i, name) in [(0, "overhead"), (1, "bandwidth"), (2, "latency")] {
            if a[i] & 0x0f == 0x0f {
                return Err(format!("interface {name} is not a finite number"));
            }
        }
        return Ok(());
    }
    let f = |i: usize| f32::from_ne_bytes(a[i..i + 4].try_into().expect("4 bytes"));
    let (overhead, bandwidth, latency) = (f(0), f(4), f(8));
    if !(overhead.is_finite() && overhead >= 0.0) {
        return Err(format!("interface overhead {overhead}"));
    }
    if !(bandwidth.is_finite() && bandwidth != 0.0) {
        return Err(format!("interface bandwidth {bandwidth}"));
    }
    if !latency.is_finite() {
        return Err(format!("interface latency {latency}"));
    }
    Ok(())
}

/// `ucs_crc16_string`: how UCX names a transport in an address.
pub(crate) fn crc16(s: &[u8]) -> u16 {
    let mut crc: u16 = 0xffff;
    for &x in s {
        crc ^= x as u16;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0u16.wrapping_sub(crc & 1) & 0x8408);
        }
    }
    !crc
}

/// The lengths of one transport address.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shape {
    dev: usize,
    iface: usize,
    eps: Vec<usize>,
    /// For tcp: the device address's loopback flag and address family.
    tcp_kind: Option<[u8; 2]>,
    /// For posix: how its segments are named (the mode bits of the interface address's
    /// segment id), which decides how UCX opens them: a segment named another way than
    /// this worker's makes UCX 1.13 abort (`mm_posix.c`, `dir != NULL`).
    posix_mode: Option<u64>,
}

/// Transports whose device address names the machine (`uct_sm_iface_is_reachable`):
/// UCX uses a peer's only when it is this machine's.
const SAME_MACHINE: [&[u8]; 5] = [b"posix", b"sysv", b"xpmem", b"cma", b"knem"];

/// What this worker's own address shows of each of its transports: the shapes UCX's code
/// for that transport makes and reads here.
#[derive(Debug, Default)]
pub(crate) struct Reference {
    shapes: HashMap<u16, Vec<Shape>>,
    /// The device address (this machine's) of each transport that reaches only peers on
    /// this machine.
    machine: HashMap<u16, Vec<u8>>,
    /// The size of this worker's posix receive segment: a peer's on this machine must be
    /// as large (UCX maps that much of it; past the file's end, a read is a SIGBUS).
    posix_segment: Option<u64>,
}

impl Reference {
    /// From this worker's own packed address.
    pub(crate) fn of(own: &[u8]) -> Result<Reference, String> {
        let w = walk(own).map_err(|e| format!("this worker's own address: {e}"))?;
        let mut r = Reference::default();
        for e in &w.entries {
            if SAME_MACHINE.iter().any(|name| crc16(name) == e.tl_csum) {
                r.machine.insert(e.tl_csum, own[e.dev.clone()].to_vec());
            }
            if e.tl_csum == crc16(b"posix") {
                r.posix_segment = posix_segment_of(own, e).and_then(crate::ucx_posix::posix_segment_len);
            }
            let s = shape(own, e);
            let v = r.shapes.entry(e.tl_csum).or_default();
            if !v.contains(&s) {
                v.push(s);
            }
        }
        Ok(r)
    }

    /// Checks a peer's packed address: the walk, and for each transport of this worker
    /// that UCX would use with it, lengths this worker's transport reads.
    pub(crate) fn check(&self, b: &[u8]) -> Result<Walked, String> {
        let w = walk(b)?;
        for e in &w.entries {
            let Some(ours) = self.shapes.get(&e.tl_csum) else {
                // A transport this worker lacks: UCX skips it.
                continue;
            };
            if let Some(machine) = self.machine.get(&e.tl_csum) {
                if e.dev.len() == machine.len() && b[e.dev.clone()] != machine[..] {
                    // Another machine's shared memory: UCX skips it.
                    continue;
                }
            }
            let theirs = shape(b, e);
            let fits = match theirs.tcp_kind {
                // UCX's tcp goes on only with the kind of device address (family, loopback)
                // one of its own interfaces has.
                Some(kind) if e.tl_csum == crc16(b"tcp") => {
                    ours.iter().find(|s| s.tcp_kind == Some(kind)).map_or(true, |s| *s == theirs)
                }
                _ => ours.contains(&theirs),
            };
            if !fits {
                return Err(format!(
                    "a transport address (checksum {:#06x}) of {} / {} / {:?} bytes, where this \
                     worker's is {}",
                    e.tl_csum,
                    theirs.dev,
                    theirs.iface,
                    theirs.eps,
                    ours.iter()
                        .map(|s| format!("{} / {} / {:?}", s.dev, s.iface, s.eps))
                        .collect::<Vec<_>>()
                        .join(" or ")
                ));
            }
            if e.tl_csum == crc16(b"posix") {
                self.check_posix_segment(b, e)?;
            }
        }
        Ok(w)
    }

    /// A peer's posix receive segment on this machine (UCX attaches it) must open and
    /// hold as much as this worker's.
    fn check_posix_segment(&self, b: &[u8], e: &Entry) -> Result<(), String> {
        let Some(need) = self.posix_segment else {
            return Ok(());
        };
        let seg = posix_segment_of(b, e).ok_or("a posix address without a segment")?;
        match crate::ucx_posix::posix_segment_len(seg) {
            Some(n) if n >= need => Ok(()),
            Some(n) => Err(format!("its posix segment holds {n} bytes, where this worker's holds {need}")),
            None => Err("its posix segment cannot be opened here".into()),
        }
    }
}

/// The segment id a posix interface address starts with.
fn posix_segment_of(b: &[u8], e: &Entry) -> Option<u64> {
    let at = e.iface.start;
    (e.iface.len() >= 8).then(|| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes")))
}

fn shape(b: &[u8], e: &Entry) -> Shape {
    // UCX's tcp tells device addresses apart by family and the loopback flag only
    // (`uct_tcp_iface_is_reachable`): other flag bits do not keep an address from it.
    let tcp_kind = (e.tl_csum == crc16(b"tcp") && e.dev.len() >= 2)
        .then(|| [b[e.dev.start] & TCP_LOOPBACK, b[e.dev.start + 1]]);
    let posix_mode = (e.tl_csum == crc16(b"posix"))
        .then(|| posix_segment_of(b, e))
        .flatten()
        .map(|s| s & crate::ucx_posix::POSIX_MODE_BITS);
    Shape {
        dev: e.dev.len(),
        iface: e.iface.len(),
        eps: e.eps.iter().map(Range::len).collect(),
        tcp_kind,
        posix_mode,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_names_are_checksummed_as_ucx_does() {
        // ucs_crc16 is the reflected CCITT polynomial with an initial all-ones register and
        // the result inverted (CRC-16/X-25): "123456789" gives 0x906e.
        assert_eq!(crc16(b"123456789"), 0x906e);
        assert_ne!(crc16(b"tcp"), crc16(b"posix"));
    }

    /// A version 1 address with one device and one transport: uuid 7, memory domain 1,
    /// a 2-byte device address, attributes (overhead, bandwidth, latency, flags), an
    /// 8-byte posix interface address (a segment id named through procfs).
    fn sample() -> Vec<u8> {
        let mut v = vec![0x20];
        v.extend_from_slice(&7u64.to_ne_bytes());
        v.push(1); // md index 1
        v.push(DEV_LAST | 2);
        v.extend_from_slice(&[0xaa, 0xbb]);
        v.extend_from_slice(&crc16(b"posix").to_ne_bytes());
        for f in [1e-9f32, 1e9, 1e-7] {
            v.extend_from_slice(&f.to_ne_bytes());
        }
        v.extend_from_slice(&0u32.to_ne_bytes());
        v.push(IFACE_LAST | 8);
        v.extend_from_slice(&((1u64 << 63) | 12345).to_ne_bytes());
        v
    }

    #[test]
    fn a_well_formed_address_is_walked() {
        let w = walk(&sample()).unwrap();
        assert_eq!(w.uuid, Some(7));
        assert_eq!(w.entries.len(), 1);
        let e = &w.entries[0];
        assert_eq!((e.tl_csum, e.md_index, e.dev.len(), e.iface.len()), (crc16(b"posix"), 1, 2, 8));
        let r = Reference::of(&sample()).unwrap();
        r.check(&sample()).unwrap();
    }

    /// Real addresses of this UCX, both formats, with and without debug names, several
    /// transport sets: walked whole, and one worker's checked against another's.
    #[tokio::test]
    async fn real_addresses_are_walked() {
        for tls in ["tcp,self", "posix,cma,tcp,self", "all"] {
            for version in ["v1", "v2"] {
                for debug in ["n", "y"] {
                    let ctx = crate::Context::builder()
                        .transports(tls)
                        .config("ADDRESS_VERSION", version)
                        .config("ADDRESS_DEBUG_INFO", debug)
                        .build()
                        .unwrap();
                    let (a, b) = (ctx.create_worker().unwrap(), ctx.create_worker().unwrap());
                    let (a, b) = (a.address().unwrap(), b.address().unwrap());
                    let case = format!("{tls} {version} debug={debug}");
                    let w = walk(a.ucx_bytes()).unwrap_or_else(|e| panic!("{case}: {e}"));
                    assert!(!w.entries.is_empty(), "{case}");
                    assert_eq!(w.uuid, uuid_of(a.ucx_bytes()), "{case}");
                    let r = Reference::of(a.ucx_bytes()).unwrap();
                    r.check(b.ucx_bytes()).unwrap_or_else(|e| panic!("{case}: {e}"));
                }
            }
        }
    }

    /// The tcp device addresses of a worker's own address: on loopback, the loopback
    /// address, for a peer on this host only; on the host's other devices, their
    /// addresses (the ones `ip` lists).
    #[tokio::test]
    async fn tcp_device_addresses_are_read() {
        let lo =
            crate::Context::builder().transports("tcp,self").config("NET_DEVICES", "lo").build().unwrap();
        let own = lo.create_worker().unwrap().address().unwrap();
        assert_eq!(tcp_ips(own.ucx_bytes(), true), vec![std::net::IpAddr::from([127, 0, 0, 1])]);
        assert!(tcp_ips(own.ucx_bytes(), false).is_empty());
        let all = crate::Context::builder().transports("tcp,self").build().unwrap();
        let own = all.create_worker().unwrap().address().unwrap();
        let ips = tcp_ips(own.ucx_bytes(), false);
        let listed = std::process::Command::new("ip").args(["-o", "addr"]).output().map(|o| o.stdout);
        if let Ok(listed) = listed {
            let listed = String::from_utf8_lossy(&listed);
            for ip in &ips {
                assert!(listed.contains(&format!(" {ip}/")), "{ip} is none of the host's: {listed}");
            }
        }
        assert!(tcp_ips(&[0xff; 8], false).is_empty());
    }

    /// A tcp device address with a flag bit UCX does not look at is still read by UCX's
    /// tcp (its kind is family and loopback flag): its lengths are checked all the same.
    #[tokio::test]
    async fn tcp_addresses_are_told_apart_as_ucx_does() {
        let ctx =
            crate::Context::builder().transports("tcp,self").config("NET_DEVICES", "lo").build().unwrap();
        let own = ctx.create_worker().unwrap().address().unwrap();
        let own = own.ucx_bytes();
        let r = Reference::of(own).unwrap();
        let w = walk(own).unwrap();
        let tcp = w.entries.iter().find(|e| e.tl_csum == crc16(b"tcp")).expect("a tcp entry");
        // The device address's length byte precedes it; cut the address by one byte there.
        let mut bad = own.to_vec();
        bad[tcp.dev.start] |= 0x80;
        let len_at = tcp.dev.start - 1;
        assert_eq!((bad[len_at] & DEV_LEN_MASK) as usize, tcp.dev.len(), "the length byte");
        bad[len_at] -= 1;
        bad.remove(tcp.dev.end - 1);
        assert!(walk(&bad).is_ok());
        assert!(r.check(&bad).is_err(), "a shorter tcp device address with an extra flag");
    }

    /// A version 1 memory-domain byte as each UCX reads it: UCX 1.19 and later keep
    /// 7 bits for an address that names a release after 1.18 (in an empty last device),
    /// where an index past 63 would overrun UCX's tables; older UCX keep 5.
    #[test]
    fn version_1_domain_indices_are_read_as_the_loaded_ucx_does() {
        let mut a = sample();
        a[9] = 0x7f; // memory domain byte: 127, or 31 with the two former flag bits cleared
        a[10] &= !DEV_LAST;
        a.extend_from_slice(&[MD_EMPTY_DEV | 6, DEV_LAST]); // names release 22 (22 % 16)
        assert!(walk_as(&a, 22).unwrap_err().contains("127"));
        assert_eq!(walk_as(&a, 13).unwrap().entries[0].md_index, 31);
        // Naming release 18, or none: the former flag bits are cleared.
        let mut old = a.clone();
        let n = old.len();
        old[n - 2] = MD_EMPTY_DEV | 2;
        assert_eq!(walk_as(&old, 22).unwrap().entries[0].md_index, 31);
        assert_eq!(walk_as(&sample(), 22).unwrap().entries[0].md_index, 1);
        assert_eq!((release_version(6, 22), release_version(2, 22), release_version(15, 22)), (22, 18, 15));
    }

    /// A peer address whose cma part names this process is told apart from another
    /// process's.
    #[tokio::test]
    async fn addresses_naming_this_process_are_found() {
        let ctx = crate::Context::builder().transports("posix,cma,self").build().unwrap();
        let own = ctx.create_worker().unwrap().shared.own_address.clone();
        let w = walk(&own).unwrap();
        assert!(names_this_process(&own, &w), "this process's own address");
        let cma = w.entries.iter().find(|e| e.tl_csum == crc16(b"cma")).expect("a cma entry");
        let posix = w.entries.iter().find(|e| e.tl_csum == crc16(b"posix")).expect("a posix entry");
        let mut other = own.clone();
        // Another pid in cma's part, and a posix segment named without procfs.
        other[cma.iface.start] ^= 1;
        other[posix.iface.start + 7] &= !0x80;
        assert!(!names_this_process(&other, &walk(&other).unwrap()));
    }

    #[test]
    fn cut_or_damaged_addresses_are_refused() {
        let good = sample();
        for n in 0..good.len() {
            assert!(walk(&good[..n]).is_err(), "cut at {n}");
        }
        let r = Reference::of(&good).unwrap();
        let mut bad = good.clone();
        bad[0] = 0x22; // format version 3
        assert!(walk(&bad).is_err());
        // Version 2 with a header flag UCX does not define.
        let mut v2 = vec![0x01, FLAG_WORKER_UUID];
        v2.extend_from_slice(&good[1..]);
        assert!(walk(&v2).is_err(), "version 2 reads other attributes: this one is cut");
        v2[1] |= 0x10;
        assert!(walk(&v2).unwrap_err().contains("flags"));
        // Attributes that are not finite numbers.
        let attr_at = 1 + 8 + 1 + 1 + 2 + 2;
        for (off, v) in [(0, f32::NAN), (4, f32::INFINITY), (4, 0.0), (8, f32::NEG_INFINITY), (0, -1.0)] {
            let mut bad = good.clone();
            bad[attr_at + off..attr_at + off + 4].copy_from_slice(&v.to_ne_bytes());
            assert!(walk(&bad).is_err(), "attribute at {off} = {v}");
        }
        // A posix segment named another way than this worker's.
        let mut bad = good.clone();
        let seg_top = attr_at + ATTR_V1 + 1 + 7;
        bad[seg_top] ^= 0xc0;
        assert!(walk(&bad).is_ok());
        assert!(r.check(&bad).is_err());
        // A posix interface address of another length than this worker's.
        let mut bad = good.clone();
        let len_at = attr_at + ATTR_V1;
        bad[len_at] = IFACE_LAST | 7;
        bad.pop();
        assert!(walk(&bad).is_ok());
        assert!(r.check(&bad).is_err());
    }
}
