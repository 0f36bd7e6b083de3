//! ucxkit's envelopes forged as anyone can: the parts changed, the FNV-1a checksum
//! computed anew (a MAC, where a secret seals them, cannot be).

/// FNV-1a 64, as the envelopes' checksums.
pub fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A worker address envelope (see `WorkerAddress`'s format) around `ucx`, with the
/// identity and flags of `like`, its checksum right.
pub fn address_envelope(like: &[u8], ucx: &[u8]) -> Vec<u8> {
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
pub fn key_envelope(like: &[u8], ucx: &[u8], range: Option<(u64, u64)>) -> Vec<u8> {
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

/// Sets a key envelope's checksum right for its bytes as they are (its MAC, if any, is
/// left as it was).
pub fn fix_key_checksum(key: &mut [u8]) {
    let klen = u32::from_le_bytes(key[40..44].try_into().unwrap()) as usize;
    let sum_at = 44 + klen;
    let sum = fnv1a(&key[..sum_at]);
    key[sum_at..sum_at + 8].copy_from_slice(&sum.to_le_bytes());
}

/// `key` as if packed in the process whose token is `process` (its origin).
pub fn with_origin(key: &[u8], process: u64) -> Vec<u8> {
    let mut k = key.to_vec();
    k[24..32].copy_from_slice(&process.to_le_bytes());
    fix_key_checksum(&mut k);
    k
}
