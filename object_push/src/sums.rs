//! [`Layout`]: how an object is cut in chunks, with the checksum of each chunk (64-bit
//! XXH3), computed once by the node that sealed it and checked by every receiver before
//! it seals. XXH3 rather than CRC-32C: twice as fast here (43-50 GB/s against 23 on one
//! core, chunks in cache), and 64 bits.

use crate::error::{Error, Result};

/// The smallest chunk: below it, per-chunk messages cost more than they pipeline.
pub const MIN_CHUNK: u32 = 4096;
/// The largest chunk.
pub const MAX_CHUNK: u32 = 1 << 30;
/// The most chunks an object may have (a receiver keeps a little per chunk).
pub const MAX_CHUNKS: u64 = 1 << 20;
/// The chunk size that grows with the object ([`chunk_for`]): the default of
/// `NodeOptions::chunk`.
pub const AUTO_CHUNK: u32 = 0;
/// An automatic chunk's smallest and largest size, and the chunk count above which it
/// doubles.
const AUTO_MIN: u32 = 1 << 20;
const AUTO_MAX: u32 = 4 << 20;
const AUTO_CHUNKS: u64 = 64;

/// An object's size, its chunk size and the checksum of every chunk (the last may be
/// short).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    size: u64,
    chunk: u32,
    sums: Vec<u64>,
}

impl Layout {
    /// The layout of `bytes` cut in chunks of `chunk` bytes, checksums computed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a chunk size outside [`MIN_CHUNK`]..=[`MAX_CHUNK`]
    /// or an object of more than [`MAX_CHUNKS`] chunks.
    pub fn of(bytes: &[u8], chunk: u32) -> Result<Layout> {
        let count = chunks(bytes.len() as u64, chunk)?;
        let sums: Vec<u64> = bytes.chunks(chunk as usize).map(sum).collect();
        debug_assert_eq!(sums.len() as u64, count);
        Ok(Layout { size: bytes.len() as u64, chunk, sums })
    }

    /// A layout received from a peer, checked: the chunk size in range and one checksum
    /// per chunk.
    ///
    /// # Errors
    /// [`Error::Protocol`] when the parts do not agree.
    pub fn from_parts(size: u64, chunk: u32, sums: Vec<u64>) -> Result<Layout> {
        let count = chunks(size, chunk).map_err(|e| Error::Protocol(e.to_string()))?;
        if sums.len() as u64 != count {
            return Err(Error::Protocol(format!(
                "{} checksums for {size} bytes in chunks of {chunk}",
                sums.len()
            )));
        }
        Ok(Layout { size, chunk, sums })
    }

    /// The object's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The chunk size in bytes.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// The checksums, one per chunk.
    pub fn sums(&self) -> &[u64] {
        &self.sums
    }

    /// How many chunks.
    pub fn count(&self) -> u64 {
        self.sums.len() as u64
    }

    /// The byte range of chunk `k` (within the object: `k` < [`Layout::count`]).
    pub fn range(&self, k: u64) -> std::ops::Range<usize> {
        let start = k * u64::from(self.chunk);
        let end = (start + u64::from(self.chunk)).min(self.size);
        start as usize..end as usize
    }

    /// Whether `bytes` are chunk `k` as sealed.
    pub fn verify(&self, k: u64, bytes: &[u8]) -> bool {
        self.sums.get(k as usize).is_some_and(|&s| bytes.len() == self.range(k).len() && sum(bytes) == s)
    }

    /// The checksum of the whole object, whose bytes are `bytes` (as an inline answer
    /// carries it), such that a byte changed since sealing shows: where it is one chunk,
    /// the checksum it was sealed with (the puller's check finds the change, and the
    /// holder does not hash the object again for every lookup); else computed, once
    /// every chunk is found as sealed (`None` when one is not).
    pub fn whole_sum(&self, bytes: &[u8]) -> Option<u64> {
        match self.sums[..] {
            [s] if bytes.len() as u64 == self.size => Some(s),
            _ if bytes.len() as u64 != self.size => None,
            _ => (0..self.count()).all(|k| self.verify(k, &bytes[self.range(k)])).then(|| sum(bytes)),
        }
    }
}

/// The checksum of `bytes` (64-bit XXH3, seed 0).
pub fn sum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// The chunk size for an object of `size` bytes: `want`, or larger where `want` would
/// cut it in more than [`MAX_CHUNKS`] chunks. [`AUTO_CHUNK`] wants 1 MiB, doubled while
/// the object would have more than 64 chunks, up to 4 MiB: a holder handles each chunk
/// it sends, and on one host of two cores 1 MiB chunks to two receivers kept it busy
/// enough to cost them a fifth of their time (docs/objects.md).
pub fn chunk_for(size: u64, want: u32) -> u32 {
    let mut want = want;
    if want == AUTO_CHUNK {
        want = AUTO_MIN;
        while want < AUTO_MAX && size > AUTO_CHUNKS * u64::from(want) {
            want *= 2;
        }
    }
    let least = size.div_ceil(MAX_CHUNKS).next_multiple_of(u64::from(MIN_CHUNK));
    u32::try_from(least.max(u64::from(want))).unwrap_or(MAX_CHUNK).min(MAX_CHUNK)
}

/// How many chunks of `chunk` bytes hold `size` bytes (an empty object has none).
///
/// # Errors
/// [`Error::InvalidArgument`] for a chunk size outside [`MIN_CHUNK`]..=[`MAX_CHUNK`] or
/// more than [`MAX_CHUNKS`] chunks.
pub fn chunks(size: u64, chunk: u32) -> Result<u64> {
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) {
        return Err(Error::InvalidArgument(format!(
            "chunk size {chunk} is outside {MIN_CHUNK}..={MAX_CHUNK}"
        )));
    }
    let count = size.div_ceil(u64::from(chunk));
    if count > MAX_CHUNKS {
        return Err(Error::InvalidArgument(format!(
            "{size} bytes in chunks of {chunk} are {count} chunks, over {MAX_CHUNKS}"
        )));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_object_and_checksums_catch_a_flipped_bit() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let l = Layout::of(&bytes, 4096).unwrap();
        assert_eq!((l.count(), l.range(0), l.range(2)), (3, 0..4096, 8192..10_000));
        for k in 0..3 {
            assert!(l.verify(k, &bytes[l.range(k)]));
        }
        let mut bad = bytes[l.range(1)].to_vec();
        bad[17] ^= 4;
        assert!(!l.verify(1, &bad));
        assert!(!l.verify(1, &bytes[..100]), "a short chunk");
        assert!(!l.verify(3, &[]), "no such chunk");
        assert_eq!(Layout::of(&[], 4096).unwrap().count(), 0);
    }

    #[test]
    fn a_one_chunk_objects_whole_sum_is_the_sealed_one() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 3) as u8).collect();
        let one = Layout::of(&bytes, 16_384).unwrap();
        assert_eq!(one.whole_sum(&bytes), Some(sum(&bytes)));
        // Changed since sealing: the sealed sum still tells.
        let mut changed = bytes.clone();
        changed[9] ^= 1;
        assert_eq!(one.whole_sum(&changed), Some(sum(&bytes)));
        assert_ne!(sum(&bytes), sum(&changed));
        // Several chunks: computed where every chunk is as sealed, none otherwise.
        let three = Layout::of(&bytes, 4096).unwrap();
        assert_eq!(three.whole_sum(&bytes), Some(sum(&bytes)));
        assert_eq!(three.whole_sum(&changed), None);
        // No chunks; bytes of another length.
        assert_eq!(Layout::of(&[], 4096).unwrap().whole_sum(&[]), Some(sum(&[])));
        assert_eq!(one.whole_sum(&bytes[..10]), None);
        assert_eq!(three.whole_sum(&bytes[..10]), None);
    }

    #[test]
    fn chunks_grow_for_objects_that_would_have_too_many_and_automatic_ones_with_size() {
        let table = [
            // (size, wanted chunk, chunk)
            (0, 4096, 4096),
            (1 << 30, 1 << 20, 1 << 20),
            (1 << 40, 1 << 20, 1 << 20),
            (1 << 42, 1 << 20, 1 << 22),
            ((1 << 40) + 1, 4096, (1 << 20) + 4096),
            (u64::MAX, 4096, MAX_CHUNK),
            // Automatic: 1 MiB up to 64 of them, doubling to 4 MiB, then as any.
            (0, AUTO_CHUNK, 1 << 20),
            (64 << 20, AUTO_CHUNK, 1 << 20),
            ((64 << 20) + 1, AUTO_CHUNK, 2 << 20),
            (256 << 20, AUTO_CHUNK, 4 << 20),
            (1 << 40, AUTO_CHUNK, 4 << 20),
            (1 << 43, AUTO_CHUNK, 8 << 20),
        ];
        for (size, want, chunk) in table {
            assert_eq!(chunk_for(size, want), chunk, "{size} {want}");
        }
    }

    #[test]
    fn layouts_from_peers_must_agree() {
        assert!(Layout::from_parts(10_000, 4096, vec![0; 3]).is_ok());
        for (size, chunk, n) in [(10_000, 4096, 2), (10_000, 4096, 4), (1, 100, 1), (u64::MAX, MAX_CHUNK, 1)]
        {
            assert!(
                matches!(Layout::from_parts(size, chunk, vec![0; n]), Err(Error::Protocol(_))),
                "{size} {chunk} {n}"
            );
        }
    }
}
