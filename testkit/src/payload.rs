//! Deterministic payloads and a small generator for generated test cases.

/// `len` bytes that depend on `seed` and the position.
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..len).map(|_| rng.next() as u8).collect()
}

/// A small deterministic generator (xorshift64), for payloads and generated test cases.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value; 0 is made nonzero).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// The next value.
    #[allow(clippy::should_implement_trait)] // an endless generator, not an iterator
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
