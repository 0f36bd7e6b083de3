//! The notes a lane's sender sends its receiver, as bytes: what they say is checked
//! before anything is done with it, as everything from the network is.

use smallvec::SmallVec;

/// A note's fixed part: kind (1), zero (1), key length (2), piece length (4), offset in
/// the region (8), all little-endian.
pub(super) const NOTE_HEAD: usize = 16;

/// The longest note: the head and a key.
pub(super) const NOTE_MAX: usize = NOTE_HEAD + 4096;

/// What a note says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Note<'a> {
    /// The transfer's bytes follow as one data message.
    Plain,
    /// A piece of `len` bytes lies at `offset` in the sender's region, whose key comes
    /// along (non-empty) the first time.
    Piece { len: u32, offset: u64, key: &'a [u8] },
}

impl Note<'_> {
    /// The note as bytes.
    pub(crate) fn encode(&self) -> SmallVec<[u8; NOTE_HEAD]> {
        let mut out = SmallVec::new();
        match self {
            Note::Plain => out.extend_from_slice(&[0u8; NOTE_HEAD]),
            Note::Piece { len, offset, key } => {
                out.extend_from_slice(&[1, 0]);
                out.extend_from_slice(&(key.len() as u16).to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(key);
            }
        }
        out
    }

    /// A note from its bytes; what is wrong with them otherwise.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Note<'_>, String> {
        let head: &[u8; NOTE_HEAD] = b
            .get(..NOTE_HEAD)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| format!("a lane note of {} bytes, shorter than its head", b.len()))?;
        let key_len = usize::from(u16::from_le_bytes([head[2], head[3]]));
        if b.len() != NOTE_HEAD + key_len || head[1] != 0 {
            return Err(format!("a lane note of {} bytes whose head says {key_len} key bytes", b.len()));
        }
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&head[8..]);
        match head[0] {
            0 if key_len == 0 && len == 0 && offset == [0; 8] => Ok(Note::Plain),
            1 if len > 0 => Ok(Note::Piece { len, offset: u64::from_le_bytes(offset), key: &b[NOTE_HEAD..] }),
            k => Err(format!("a lane note of kind {k} with a piece of {len} bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_read_back_as_written() {
        let key = [7u8; 300];
        for note in [
            Note::Plain,
            Note::Piece { len: 1, offset: 0, key: &[] },
            Note::Piece { len: u32::MAX, offset: u64::MAX, key: &key },
        ] {
            assert_eq!(Note::decode(&note.encode()), Ok(note.clone()));
        }
    }

    /// Malformed notes are refused with a reason: short, long, a key length that does
    /// not match, an unknown kind, an empty piece, a plain note with fields.
    #[test]
    fn malformed_notes_are_refused() {
        let good = Note::Piece { len: 5, offset: 9, key: &[1, 2, 3] }.encode().to_vec();
        let mut cases: Vec<Vec<u8>> = vec![Vec::new(), good[..15].to_vec(), good[..18].to_vec()];
        let mut longer = good.clone();
        longer.push(0);
        cases.push(longer);
        for (at, v) in [(0, 2u8), (1, 1), (4, 0)] {
            let mut b = good.clone();
            b[at] = v;
            if at == 4 {
                b[5..8].fill(0);
            }
            cases.push(b);
        }
        let mut plain = Note::Plain.encode().to_vec();
        plain[9] = 1;
        cases.push(plain);
        for b in cases {
            assert!(Note::decode(&b).is_err(), "{b:?}");
        }
    }

    /// Random and mutated bytes never panic and decode only to notes that encode back
    /// to the same bytes.
    #[test]
    fn random_and_mutated_bytes_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let seed = Note::Piece { len: 64, offset: 4096, key: &[5; 40] }.encode().to_vec();
        for i in 0..20_000 {
            let b: Vec<u8> = if i % 2 == 0 {
                (0..(next() % 80) as usize).map(|_| next() as u8).collect()
            } else {
                let mut b = seed.clone();
                for _ in 0..1 + next() % 3 {
                    let at = (next() as usize) % b.len();
                    b[at] = next() as u8;
                }
                b.truncate(b.len() - (next() % 3) as usize);
                b
            };
            if let Ok(n) = Note::decode(&b) {
                assert_eq!(n.encode().as_slice(), &b[..]);
            }
        }
    }
}
