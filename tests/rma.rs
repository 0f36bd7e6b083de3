//! Registered memory and one-sided operations: put, get and the atomics verified byte
//! for byte, bounds and key errors, and regions kept mapped while operations use them
//! (the `region_` tests also run under valgrind in the test command).

#![deny(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::{ctx, pair, pair_with, payload};
use ucxkit::transport::{Endpoint, ErrorKind, ErrorMode, MemRegion, ProgressMode, Worker};

const T: Duration = Duration::from_secs(20);

/// A server region of `len` bytes (UCX-allocated or registered), its key unpacked on the
/// client's endpoint.
async fn setup(tls: &str, len: usize, alloc: bool) -> (Worker, Worker, Endpoint, Endpoint, MemRegion) {
    let (s, c, sep, cep) = pair(tls).await;
    let ctx = sep.worker().context();
    let region = if alloc { ctx.alloc(len).unwrap() } else { ctx.register(vec![0u8; len]).unwrap() };
    assert_eq!(region.len(), len);
    (s, c, sep, cep, region)
}

async fn put_get_atomics(tls: &str, alloc: bool) {
    let len = 4 << 20;
    // Without peer error handling: UCX 1.16 and later have no atomics over TCP with it
    // (see `atomics_in_peer_mode_over_tcp`), which the default mode picks over TCP.
    let (_s, _c, sep, cep) = pair_with(tls, ErrorMode::None, ProgressMode::Event).await;
    let ctx = sep.worker().context();
    let region = if alloc { ctx.alloc(len).unwrap() } else { ctx.register(vec![0u8; len]).unwrap() };
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    assert_eq!(key.len(), len as u64);
    // Puts at several offsets and sizes, then a flush makes them visible.
    let mut expect = vec![0u8; len];
    for (i, &(off, n)) in
        [(0usize, 1usize), (1, 7), (4096, 65536), (100_000, 1 << 20), (len - 10, 10)].iter().enumerate()
    {
        let p = payload(i as u64, n);
        expect[off..off + n].copy_from_slice(&p);
        let (r, _) = tokio::time::timeout(T, cep.put(p, &key, off as u64)).await.unwrap();
        r.unwrap();
    }
    tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
    assert!(region.to_vec() == expect, "region differs after puts");
    // Gets read back what the server wrote locally.
    region.write_at(2_000_000, b"written by the owner");
    let (r, got) =
        tokio::time::timeout(T, cep.get(Vec::with_capacity(20), 20, &key, 2_000_000)).await.unwrap();
    r.unwrap();
    assert_eq!(got, b"written by the owner");
    let (r, got) =
        tokio::time::timeout(T, cep.get(Vec::with_capacity(1 << 20), 1 << 20, &key, 100_000)).await.unwrap();
    r.unwrap();
    assert!(got[..] == expect[100_000..100_000 + (1 << 20)]);
    // Atomics on the word at offset 64.
    let w = 64u64;
    region.write_at(64, &40u64.to_le_bytes());
    cep.atomic_add(&key, w, 2).await.unwrap();
    assert_eq!(cep.atomic_fetch_add(&key, w, 10).await.unwrap(), 42);
    assert_eq!(cep.atomic_swap(&key, w, 7).await.unwrap(), 52);
    assert_eq!(cep.atomic_compare_swap(&key, w, 6, 100).await.unwrap(), 7, "no swap: value differs");
    assert_eq!(cep.atomic_compare_swap(&key, w, 7, 100).await.unwrap(), 7, "swap");
    tokio::time::timeout(T, cep.worker().flush()).await.unwrap().unwrap();
    let mut word = [0u8; 8];
    region.read_at(64, &mut word);
    assert_eq!(u64::from_le_bytes(word), 100);
    cep.worker().fence().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_atomics_tcp() {
    put_get_atomics("tcp,self", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_atomics_shm() {
    put_get_atomics("posix,cma,tcp,self", true).await;
}

/// Allocated regions read as zeros, also where UCX hands back memory a dropped region
/// used, and allocating one does not write its pages (UCX fills shared-memory files
/// itself, through the file: that is not counted as this process's resident memory).
#[test]
fn allocated_regions_read_as_zeros() {
    for tls in ["tcp,self", "posix,cma,self"] {
        let c = ctx(tls);
        for round in 0..3 {
            for len in [1usize, 100, 4096, 100_000, 3 << 20, 16 << 20] {
                let r = c.alloc(len).unwrap();
                assert!(r.to_vec().iter().all(|&b| b == 0), "{tls} round {round}: {len} bytes not zeroed");
                // Dirty every byte before the region goes back to UCX.
                r.write_at(0, &vec![0xa5; len]);
            }
        }
        let before = resident_bytes();
        let big = c.alloc(256 << 20).unwrap();
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 32 << 20, "{tls}: a 256 MiB region made {grown} bytes resident");
        // Still zeros where read.
        let mut b = [1u8; 16];
        big.read_at((256 << 20) - 16, &mut b);
        assert_eq!(b, [0; 16]);
    }
}

/// This process's resident memory, from the `VmRSS` line of /proc/self/status (in KiB,
/// whatever the page size).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS in /proc/self/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[tokio::test]
async fn bad_keys_and_bounds_are_errors() {
    let (_s, _c, sep, cep, region) = setup("tcp,self", 4096, false).await;
    let packed = region.pack_key().unwrap();
    // Corrupt bytes: every single flipped byte is caught before UCX sees it.
    for i in 0..packed.len() {
        let mut b = packed.clone();
        b[i] ^= 0x5a;
        assert_eq!(cep.unpack_key(&b).unwrap_err().kind(), ErrorKind::InvalidInput, "byte {i}");
    }
    assert_eq!(cep.unpack_key(b"").unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(cep.unpack_key(&packed[..packed.len() / 2]).unwrap_err().kind(), ErrorKind::InvalidInput);
    let key = cep.unpack_key(&packed).unwrap();
    // Out of bounds: nothing is posted, the buffer comes back.
    let (r, b) = cep.put(vec![1u8; 100], &key, 4000).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(b.len(), 100);
    let (r, _) = cep.put(vec![1u8; 1], &key, u64::MAX).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    let (r, _) = cep.get(Vec::with_capacity(10), 10, &key, 4090).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    // A buffer smaller than the get.
    let (r, _) = cep.get(Vec::with_capacity(4), 10, &key, 0).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    // Misaligned and out-of-range atomics.
    assert_eq!(cep.atomic_add(&key, 3, 1).await.unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(cep.atomic_swap(&key, 4096, 1).await.unwrap_err().kind(), ErrorKind::InvalidInput);
    // A key used on another endpoint.
    let (r, _) = sep.put(vec![1u8; 1], &key, 0).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput);
    // Still working after all that.
    let (r, _) = cep.put(b"ok".to_vec(), &key, 0).await;
    r.unwrap();
    cep.flush().await.unwrap();
    let mut two = [0u8; 2];
    region.read_at(0, &mut two);
    assert_eq!(&two, b"ok");
}

/// Atomics over TCP in peer error mode: UCX 1.13 emulates them; UCX 1.22 has no protocol
/// for them there and fails the endpoint, and the operation ends as an `Unsupported` error
/// saying so, or as `ConnectionReset` when UCX failed the endpoint first; never as a bare
/// `Canceled`, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomics_in_peer_mode_over_tcp() {
    let (_s, _c, sep, cep) = pair_with("tcp,self", ErrorMode::Peer, ProgressMode::Event).await;
    let region = sep.worker().context().alloc(4096).unwrap();
    let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
    match tokio::time::timeout(T, cep.atomic_fetch_add(&key, 0, 5)).await.unwrap() {
        Ok(v) => {
            assert_eq!(v, 0);
            assert_eq!(tokio::time::timeout(T, cep.atomic_swap(&key, 0, 9)).await.unwrap().unwrap(), 5);
        }
        Err(e) => {
            assert!(!common::tcp_atomics_in_peer_mode(), "UCX before 1.16 emulates atomics over TCP: {e}");
            let text = e.to_string();
            match e.kind() {
                ErrorKind::Unsupported => assert!(text.contains("no protocol"), "{text}"),
                ErrorKind::ConnectionReset => {}
                _ => panic!("{text}"),
            }
            assert!(text.contains("atomic_fetch_add"), "{text}");
        }
    }
}

/// A key in UCX's own form (for and from plain UCX programs): the range the caller gives
/// bounds the operations, and bytes that do not follow UCX's layout, or a range that
/// wraps around, are errors before UCX parses anything.
#[tokio::test]
#[allow(unsafe_code)] // unpack_ucx_key: the caller vouches for the range
async fn ucx_keys_with_a_given_range() {
    let (_s, _c, _sep, cep, region) = setup("tcp,self", 8192, false).await;
    let raw = region.pack_ucx_key().unwrap();
    let enveloped = region.pack_key().unwrap();
    assert!(enveloped.windows(raw.len()).any(|w| w == raw), "pack_key wraps the same UCX key");
    // Only the second half of the region is offered.
    // SAFETY: the range is the second half of the region the key was packed for.
    let key = unsafe { cep.unpack_ucx_key(&raw, region.addr() + 4096, 4096) }.unwrap();
    assert_eq!(key.len(), 4096);
    let (r, _) = cep.put(payload(3, 4096), &key, 0).await;
    r.unwrap();
    cep.flush().await.unwrap();
    let all = region.to_vec();
    assert!(all[..4096].iter().all(|&b| b == 0), "the first half stays untouched");
    assert!(all[4096..] == payload(3, 4096)[..]);
    let (r, _) = cep.put(vec![1u8; 2], &key, 4095).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidInput, "past the range given");
    // Bad input.
    // SAFETY: each is refused before UCX sees it (no key comes of it).
    let bad = |b: &[u8], addr: u64, len: u64| unsafe { cep.unpack_ucx_key(b, addr, len) }.unwrap_err().kind();
    assert_eq!(bad(&raw, u64::MAX - 10, 100), ErrorKind::InvalidInput);
    assert_eq!(bad(b"", 0, 1), ErrorKind::InvalidInput);
    assert_eq!(bad(&raw[..8], region.addr(), 1), ErrorKind::InvalidInput);
    let mut long_domain = raw.clone();
    assert!(raw.len() < 9 + 1 + 0xff && raw[..8] != [0; 8], "a short key with a domain");
    long_domain[9] = 0xff; // the first domain's size byte
    assert_eq!(bad(&long_domain, region.addr(), 1), ErrorKind::InvalidInput);
    // Still working.
    let (r, got) = cep.get(Vec::with_capacity(16), 16, &key, 0).await;
    r.unwrap();
    assert!(got[..] == payload(3, 4096)[..16]);
}

/// The caller's region handle is dropped while a put from it and a get into it are in
/// flight: the operations' own references keep it registered and allocated.
#[tokio::test]
async fn region_outlives_dropped_handles() {
    let (_s, _c, _sep, cep, remote) = setup("tcp,self", 1 << 20, false).await;
    let key = cep.unpack_key(&remote.pack_key().unwrap()).unwrap();
    let ctx = cep.worker().context();
    let local = ctx.register(payload(5, 1 << 20)).unwrap();
    let put = cep.put(local.clone(), &key, 0);
    let sink = ctx.register(vec![0u8; 1 << 20]).unwrap();
    let get = cep.get(sink.slice(0..(1 << 20)), 1 << 20, &key, 0);
    drop(local);
    drop(sink);
    let (r, local) = tokio::time::timeout(T, put).await.unwrap();
    r.unwrap();
    let (r, sink) = tokio::time::timeout(T, get).await.unwrap();
    r.unwrap();
    assert_eq!(local.len(), 1 << 20);
    assert_eq!(sink.len(), 1 << 20);
    // Futures dropped mid-flight, with every handle: parked until UCX completes.
    let local = ctx.register(payload(6, 1 << 20)).unwrap();
    drop(cep.put(local, &key, 0));
    let sink = ctx.register(vec![0u8; 1 << 20]).unwrap();
    drop(cep.get(sink, 1 << 20, &key, 0));
    drop(key);
    tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
    assert!(remote.to_vec() == payload(6, 1 << 20));
}

/// A key unpacked in the process that packed it holds its region: the region's last
/// handle dropped, puts and gets through the key still reach live, registered memory
/// (the test command runs this under valgrind, which would report a write to freed
/// memory), and the memory goes once the key does. Registered and UCX-allocated regions.
#[tokio::test]
async fn region_kept_by_a_key_unpacked_in_its_own_process() {
    for alloc in [false, true] {
        let (_s, _c, _sep, cep, region) = setup("tcp,self", 1 << 16, alloc).await;
        let key = cep.unpack_key(&region.pack_key().unwrap()).unwrap();
        drop(region);
        let data = payload(7, 1 << 16);
        let (r, _) = tokio::time::timeout(T, cep.put(data.clone(), &key, 0)).await.unwrap();
        r.unwrap();
        tokio::time::timeout(T, cep.flush()).await.unwrap().unwrap();
        let (r, got) =
            tokio::time::timeout(T, cep.get(Vec::with_capacity(1 << 16), 1 << 16, &key, 0)).await.unwrap();
        r.unwrap();
        assert!(got == data, "alloc: {alloc}");
        drop(key);
    }
}

/// A key packed in this process for a region that is gone is refused when unpacked
/// here: its memory may belong to something else by now.
#[tokio::test]
async fn a_key_of_a_region_gone_is_refused() {
    let (_s, _c, _sep, cep, region) = setup("tcp,self", 4096, false).await;
    let packed = region.pack_key().unwrap();
    let kept = cep.unpack_key(&packed).unwrap();
    drop(region);
    // Still there through the first key.
    let again = cep.unpack_key(&packed).unwrap();
    drop((kept, again));
    let e = cep.unpack_key(&packed).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}
