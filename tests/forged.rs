//! Forged worker addresses and remote keys (their UCX bytes changed, the envelope's
//! checksum computed anew, as anyone can) through the safe functions that take them,
//! `Worker::connect_address_with` and `Endpoint::unpack_key`: each is refused with an
//! error or works, and the process lives. Keys that unpack are used (a put and a get).
//!
//! The cases run in a child process (an abort fails the test instead of ending the test
//! runner), made from the address and a key of a peer in another process, both in a
//! network and pid namespace of their own with only loopback (`unshare -n -p`), so that
//! a changed TCP address cannot send anything beyond this test and both end with it.

#![forbid(unsafe_code)]

use ucxkit_testkit as common;

use std::time::Duration;

use common::forge::{address_envelope, key_envelope, with_origin};
use common::{ctx, Rng};
use ucxkit::transport::{EndpointOptions, WorkerAddress};

/// Cases per kind and transport set in the test command; `UCXKIT_FORGE_CASES` sets
/// more, and `UCXKIT_FORGE_SEED` other ones (the long form, run by hand).
const DEFAULT_CASES: usize = 1000;

/// `b` changed: bits flipped, bytes set, bytes cut, inserted or dropped, or all random.
fn mutate(rng: &mut Rng, b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    match rng.below(6) {
        0 => {
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = rng.below(v.len());
            v[i] = [0, 0xff, 0x7f, 0x80, rng.next() as u8][rng.below(5)];
        }
        2 => v.truncate(1 + rng.below(v.len())),
        3 => {
            let i = rng.below(v.len());
            let extra: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
            v.splice(i..i, extra);
        }
        4 => {
            let i = rng.below(v.len());
            v.drain(i..(i + 1 + rng.below(8)).min(v.len()));
            if v.is_empty() {
                v.push(0);
            }
        }
        _ => v = (0..1 + rng.below(200)).map(|_| rng.next() as u8).collect(),
    }
    v
}

/// The other process of the child's namespace: a worker and a region of its own, whose
/// address and key it writes to `UCXKIT_FORGE_PEER_OUT` (hex, a line each); then it
/// serves until the namespace ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the peer of the forged-input tests; the parent runs it"]
async fn forge_peer() {
    let Ok(out) = std::env::var("UCXKIT_FORGE_PEER_OUT") else { return };
    let c = ctx(&std::env::var("UCXKIT_FORGE_TLS").unwrap());
    let w = c.create_worker().unwrap();
    // (Not whole pages: UCX maps the last one past the end of its file.)
    let region = c.alloc(64 * 1024 - 100).unwrap();
    let text = format!("{}\n{}\n", hex(w.address().unwrap().as_bytes()), hex(&region.pack_key().unwrap()));
    let tmp = format!("{out}.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop((w, region));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

/// The peer's address and key, once it has written them.
async fn peer_output(path: &str) -> (Vec<u8>, Vec<u8>) {
    for _ in 0..300 {
        if let Ok(text) = std::fs::read_to_string(path) {
            let mut lines = text.lines();
            return (unhex(lines.next().unwrap()), unhex(lines.next().unwrap()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the peer wrote no address to {path}");
}

/// The child: forged addresses, then forged keys, over `UCXKIT_FORGE_TLS`, made from the
/// genuine ones of the peer process (`forge_peer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the forged-input tests; the parent runs it"]
async fn forge_target() {
    let Ok(tls) = std::env::var("UCXKIT_FORGE_TLS") else { return };
    let n: usize = std::env::var("UCXKIT_FORGE_CASES").unwrap().parse().unwrap();
    let c = ctx(&tls);
    let victim = c.create_worker().unwrap();
    let (address, key) = peer_output(&std::env::var("UCXKIT_FORGE_PEER_OUT").unwrap()).await;
    let genuine = WorkerAddress::from_bytes(&address).unwrap();
    let ucx = genuine.ucx_bytes().to_vec();
    // `UCXKIT_FORGE_SEED` picks other cases (the child inherits it from the parent).
    let seed = std::env::var("UCXKIT_FORGE_SEED").ok().and_then(|v| v.parse().ok());
    let mut rng = Rng::new(seed.unwrap_or(0x0f0f_1234_5678_9abc));
    let (mut refused, mut made) = (0, 0);
    let opts =
        EndpointOptions { handshake: false, timeout: Duration::from_millis(200), ..Default::default() };
    for _ in 0..n {
        let forged = address_envelope(genuine.as_bytes(), &mutate(&mut rng, &ucx));
        let addr = WorkerAddress::from_bytes(&forged).expect("a re-sealed envelope parses");
        match victim.connect_address_with(&addr, opts.clone()).await {
            Ok(ep) => {
                made += 1;
                // Whatever UCX does with it meanwhile (wire-up, connects) runs now.
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(ep);
            }
            Err(_) => refused += 1,
        }
    }
    println!("{tls}: {n} forged addresses: {refused} refused, {made} endpoints made");

    // Keys of the peer's region, on a genuine connection to the peer.
    let ep = victim.connect_address(&genuine).await.unwrap();
    ep.unpack_key(&key).expect("the genuine key");
    let klen = u32::from_le_bytes(key[40..44].try_into().unwrap()) as usize;
    let ucx_key = key[44..44 + klen].to_vec();
    let addr = u64::from_le_bytes(key[8..16].try_into().unwrap());
    let (mut refused, mut used) = (0, 0);
    // `UCXKIT_FORGE_TRACE` names each key that unpacks before it is used.
    let trace = std::env::var_os("UCXKIT_FORGE_TRACE").is_some();
    if trace {
        eprintln!("genuine key: {key:02x?}");
    }
    for i in 0..n {
        // The UCX key changed, or the range widened or moved (every third case).
        let forged = if i % 3 == 2 {
            let ranges = [(addr, 1u64 << 40), (addr - 4096, 64 * 1024), (0, 64 * 1024), (addr + 65536, 8)];
            key_envelope(&key, &ucx_key, Some(ranges[rng.below(4)]))
        } else {
            key_envelope(&key, &mutate(&mut rng, &ucx_key), None)
        };
        match ep.unpack_key(&forged) {
            Ok(k) => {
                if trace {
                    eprintln!("key case {i}: {forged:02x?}");
                }
                used += 1;
                let len = k.len().min(8) as usize;
                let _ = tokio::time::timeout(Duration::from_secs(5), ep.put(vec![0x5a; len], &k, 0)).await;
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), ep.get(Vec::with_capacity(len), len, &k, 0))
                        .await;
            }
            Err(_) => refused += 1,
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), ep.flush()).await;
    println!("{tls}: {n} forged keys: {refused} refused, {used} unpacked and used");
    println!("FORGED DONE {tls}");
}

/// Whether this machine gives a child network and pid namespaces of its own.
fn namespaces_available() -> Result<(), String> {
    match std::process::Command::new("unshare")
        .args(["-n", "-p", "-f", "--mount-proc", "--kill-child", "true"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        Err(e) => Err(format!("cannot run unshare: {e}")),
    }
}

/// Runs the peer and the forging child in a network and pid namespace of their own
/// (both end with it), within 10 minutes.
fn run_child(tls: &str, cases: usize) -> String {
    let exe = std::env::current_exe().unwrap();
    let out_file = std::env::temp_dir().join(format!("ucxkit-forge-{}-{}", std::process::id(), tls.len()));
    let _ = std::fs::remove_file(&out_file);
    let run = |name: &str| format!("{} --exact {name} --ignored --nocapture --test-threads=1", exe.display());
    let script = format!(
        "ip link set lo up && ({} >/dev/null 2>&1 &) && exec {}",
        run("forge_peer"),
        run("forge_target")
    );
    let out = std::process::Command::new("timeout")
        .args([
            "-s",
            "KILL",
            "600",
            "unshare",
            "-n",
            "-p",
            "-f",
            "--mount-proc",
            "--kill-child",
            "sh",
            "-c",
            &script,
        ])
        .env("UCXKIT_FORGE_TLS", tls)
        .env("UCXKIT_FORGE_CASES", cases.to_string())
        .env("UCXKIT_FORGE_PEER_OUT", &out_file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&out_file);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child ended with {} over {tls}:\n{text}", out.status);
    assert!(text.contains(&format!("FORGED DONE {tls}")), "{text}");
    text
}

/// Thousands of forged addresses and keys over TCP and shared memory: each refused with
/// an error or harmless, and the process lives.
#[test]
fn forged_addresses_and_keys_do_not_kill_the_process() {
    let cases: usize =
        std::env::var("UCXKIT_FORGE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    if let Err(e) = namespaces_available() {
        eprintln!("forged: skipped, no network and pid namespaces for the child ({e})");
        return;
    }
    for tls in ["tcp,self", "posix,cma,tcp,self"] {
        let text = run_child(tls, cases);
        for l in text.lines().filter(|l| l.contains("forged")) {
            eprintln!("{}", l.trim_start_matches("test forge_target ... "));
        }
    }
}

/// Keys and addresses that would make UCX copy into this process's memory for a forger:
/// on an endpoint to a worker of this process, a key that claims another process as its
/// origin (so no region of this process holds it) is refused; an address whose
/// shared-memory parts name this process but whose worker is none of its own, or that
/// borrows one of its workers' uuid with other transport parts, is refused; a key that
/// claims a region of this process reaches that region through this process's own key.
#[tokio::test]
async fn forgeries_aimed_at_this_process_are_refused() {
    let c = ctx("posix,cma,tcp,self");
    let (a, b) = (c.create_worker().unwrap(), c.create_worker().unwrap());
    let genuine = b.address().unwrap();
    let ep = a.connect_address(&genuine).await.unwrap();
    let region = c.alloc(4096).unwrap();
    let key = region.pack_key().unwrap();
    ep.unpack_key(&key).expect("a key of this process's region");
    let e = ep.unpack_key(&with_origin(&key, 0x1234_5678)).unwrap_err();
    assert!(e.to_string().contains("another process"), "{e}");
    // A key claiming one of this process's regions (origin and range anyone given a key
    // of this process can copy) with another region's UCX part: that part is not read;
    // the put lands in the region the key claims, and only there.
    let other = c.alloc(4096).unwrap();
    let other_key = other.pack_key().unwrap();
    let other_ucx = &other_key[44..44 + u32::from_le_bytes(other_key[40..44].try_into().unwrap()) as usize];
    let forged = ep.unpack_key(&key_envelope(&key, other_ucx, None)).expect("the region's own key is used");
    ep.put(b"claimed".to_vec(), &forged, 0).await.0.unwrap();
    ep.flush().await.unwrap();
    assert_eq!(&region.to_vec()[..7], b"claimed");
    assert!(other.to_vec().iter().all(|&b| b == 0), "the forged UCX part was used");

    let opts = EndpointOptions { handshake: false, ..Default::default() };
    let ucx = genuine.ucx_bytes();
    // Another worker uuid (the 8 bytes after the header), the transports this process's.
    let mut other_uuid = ucx.to_vec();
    let at = if ucx[0] & 0x0f == 0 { 1 } else { 2 };
    other_uuid[at] ^= 0x5a;
    let forged = WorkerAddress::from_bytes(&address_envelope(genuine.as_bytes(), &other_uuid)).unwrap();
    let e = a.connect_address_with(&forged, opts.clone()).await.unwrap_err();
    assert!(e.to_string().contains("name this process"), "{e}");
    // This process's worker uuid with other bytes (one more at the end, which UCX does
    // not read).
    let mut borrowed = ucx.to_vec();
    borrowed.push(0);
    let forged = WorkerAddress::from_bytes(&address_envelope(genuine.as_bytes(), &borrowed)).unwrap();
    let e = a.connect_address_with(&forged, opts).await.unwrap_err();
    assert!(e.to_string().contains("worker of this process"), "{e}");
}
