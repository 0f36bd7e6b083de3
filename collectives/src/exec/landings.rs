//! Landing vectors of one-step calls' receives (see [`super::one`]), kept by a
//! communicator from call to call so that a small call allocates none.

/// The most landing vectors a communicator keeps (one per one-step call in flight at
/// once, up to this many).
const LANDINGS: usize = 4;

/// Landing vectors of one-step calls' receives, kept from call to call (a reused one
/// costs no allocation): at most [`LANDINGS`], and small ones only.
#[derive(Default)]
pub(crate) struct Landings(std::sync::Mutex<Vec<Vec<u8>>>);

impl Landings {
    /// An empty vector with room for `bytes`: a kept one where there is one.
    #[inline]
    pub(crate) fn take(&self, bytes: usize) -> Vec<u8> {
        let mut v =
            self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop().unwrap_or_default();
        v.clear();
        v.reserve(bytes);
        v
    }

    /// Keeps `v` for a later [`Landings::take`], unless it is large or enough are kept.
    #[inline]
    pub(crate) fn give(&self, v: Vec<u8>) {
        if v.capacity() <= super::small::SMALL {
            let mut kept = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if kept.len() < LANDINGS {
                kept.push(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Landing vectors come back empty with the room asked for, reused; large ones and
    /// those beyond [`LANDINGS`] are let go.
    #[test]
    fn landings_are_reused_empty_and_bounded() {
        let l = Landings::default();
        let mut v = l.take(8);
        assert!(v.is_empty() && v.capacity() >= 8);
        v.extend_from_slice(&[1; 8]);
        let at = v.as_ptr();
        l.give(v);
        let again = l.take(4);
        assert!(again.is_empty() && again.as_ptr() == at, "the kept vector, emptied");
        l.give(Vec::with_capacity(super::super::small::SMALL + 1));
        assert_eq!(l.0.lock().unwrap().len(), 0, "a large vector is not kept");
        for _ in 0..LANDINGS + 2 {
            l.give(Vec::with_capacity(16));
        }
        assert_eq!(l.0.lock().unwrap().len(), LANDINGS);
    }
}
