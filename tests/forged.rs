//! Forged worker addresses and remote keys (their UCX bytes changed, the envelope's
//! checksum computed anew, as anyone can) through the safe functions that take them,
//! `Worker::connect_address_with` and `Endpoint::unpack_key`: each is refused with an
//! error or works, and the process lives. Keys that unpack are used (a put and a get).
//!
//! The cases run in a child process (an abort fails the test instead of ending the test
//! runner) in a network namespace of its own with only loopback (`unshare -n`), so that
//! a changed TCP address cannot send anything beyond this test.

#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::{ctx, Rng};
use ucxkit::transport::{EndpointOptions, WorkerAddress};

/// Cases per kind and transport set in the test command; `UCXKIT_FORGE_CASES` sets
/// more, and `UCXKIT_FORGE_SEED` other ones (the long form, run by hand).
const DEFAULT_CASES: usize = 1000;

/// FNV-1a 64, as the envelopes' checksums.
fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A worker address envelope (see `WorkerAddress`'s format) around `ucx`, with the
/// identity and flags of `like`, its checksum right.
fn address_envelope(like: &[u8], ucx: &[u8]) -> Vec<u8> {
    let mut v = like[..44].to_vec();
    v[5] &= 1; // no MAC
    v.extend_from_slice(&(ucx.len() as u32).to_le_bytes());
    let mut sum_input = v.clone();
    sum_input.extend_from_slice(ucx);
    let sum = fnv1a(&sum_input);
    v.extend_from_slice(&sum.to_le_bytes());
    v.extend_from_slice(ucx);
    v
}

/// A key envelope (see `MemRegion::pack_key`'s format) with `ucx` in place of `like`'s
/// UCX key, and optionally another range, its checksum right.
fn key_envelope(like: &[u8], ucx: &[u8], range: Option<(u64, u64)>) -> Vec<u8> {
    let mut v = like[..40].to_vec();
    v[5] = 0; // no MAC
    if let Some((addr, len)) = range {
        v[8..16].copy_from_slice(&addr.to_le_bytes());
        v[16..24].copy_from_slice(&len.to_le_bytes());
    }
    v.extend_from_slice(&(ucx.len() as u32).to_le_bytes());
    v.extend_from_slice(ucx);
    let sum = fnv1a(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

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

/// The child: forged addresses, then forged keys, over `UCXKIT_FORGE_TLS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the forged-input tests; the parent runs it"]
async fn forge_target() {
    let Ok(tls) = std::env::var("UCXKIT_FORGE_TLS") else { return };
    let n: usize = std::env::var("UCXKIT_FORGE_CASES").unwrap().parse().unwrap();
    let c = ctx(&tls);
    let (victim, peer) = (c.create_worker().unwrap(), c.create_worker().unwrap());
    let genuine = peer.address().unwrap();
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

    // Keys, on a genuine connection to the peer.
    let ep = victim.connect_address(&genuine).await.unwrap();
    // (Not whole pages: UCX maps the last one past the end of its file.)
    let region = c.alloc(64 * 1024 - 100).unwrap();
    let key = region.pack_key().unwrap();
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

fn run_child(tls: &str, cases: usize) -> Option<String> {
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "ip link set lo up && exec {} --exact forge_target --ignored --nocapture --test-threads=1",
        exe.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .env("UCXKIT_FORGE_TLS", tls)
        .env("UCXKIT_FORGE_CASES", cases.to_string())
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("forged: skipped, cannot run unshare ({e})");
            return None;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if text.contains("unshare failed") || text.contains("Operation not permitted") {
        eprintln!("forged: skipped, no network namespace for the child:\n{text}");
        return None;
    }
    assert!(out.status.success(), "the child ended with {} over {tls}:\n{text}", out.status);
    assert!(text.contains(&format!("FORGED DONE {tls}")), "{text}");
    Some(text)
}

/// Thousands of forged addresses and keys over TCP and shared memory: each refused with
/// an error or harmless, and the process lives.
#[test]
fn forged_addresses_and_keys_do_not_kill_the_process() {
    let cases: usize =
        std::env::var("UCXKIT_FORGE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    for tls in ["tcp,self", "posix,cma,tcp,self"] {
        if let Some(text) = run_child(tls, cases) {
            for l in text.lines().filter(|l| l.contains("forged")) {
                eprintln!("{}", l.trim_start_matches("test forge_target ... "));
            }
        }
    }
}
