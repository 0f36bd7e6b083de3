//! [`ObjectId`]: the opaque name of an object, up to [`ObjectId::MAX_LEN`] bytes.

use std::fmt;

use crate::error::{Error, Result};

/// The name of an object: up to [`ObjectId::MAX_LEN`] opaque bytes (a hash, a UUID, a
/// runtime's own reference), compared byte for byte.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId {
    len: u8,
    bytes: [u8; ObjectId::MAX_LEN],
}

impl ObjectId {
    /// The longest id, in bytes.
    pub const MAX_LEN: usize = 32;

    /// The id made of `bytes`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `bytes` is empty or longer than
    /// [`ObjectId::MAX_LEN`].
    pub fn new(bytes: &[u8]) -> Result<ObjectId> {
        if bytes.is_empty() || bytes.len() > Self::MAX_LEN {
            return Err(Error::InvalidArgument(format!(
                "an object id has 1 to {} bytes, not {}",
                Self::MAX_LEN,
                bytes.len()
            )));
        }
        let mut id = ObjectId { len: bytes.len() as u8, bytes: [0; Self::MAX_LEN] };
        id.bytes[..bytes.len()].copy_from_slice(bytes);
        Ok(id)
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({self})")
    }
}

/// Printable ids as text, others as hex.
impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.as_bytes();
        if b.iter().all(|c| c.is_ascii_graphic()) {
            // All ASCII: valid UTF-8.
            f.write_str(std::str::from_utf8(b).unwrap_or_default())
        } else {
            b.iter().try_for_each(|c| write!(f, "{c:02x}"))
        }
    }
}

impl TryFrom<&str> for ObjectId {
    type Error = Error;

    fn try_from(s: &str) -> Result<ObjectId> {
        ObjectId::new(s.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_one_to_32_bytes_and_print_readably() {
        assert!(ObjectId::new(b"").is_err());
        assert!(ObjectId::new(&[7; 33]).is_err());
        let long = ObjectId::new(&[7; 32]).unwrap();
        assert_eq!(long.as_bytes(), &[7; 32]);
        let a = ObjectId::try_from("tensor/0").unwrap();
        assert_eq!(a.to_string(), "tensor/0");
        assert_eq!(ObjectId::new(&[0, 255]).unwrap().to_string(), "00ff");
        // Ids that differ only in length differ.
        assert_ne!(ObjectId::new(&[0]).unwrap(), ObjectId::new(&[0, 0]).unwrap());
    }
}
