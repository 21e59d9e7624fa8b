//! Seeded randomness: the same sequence on every run, so a failure
//! reproduces.

use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// xorshift64*: a deterministic sequence without a dependency.
///
/// `Rng::new(seed)` is the textbook generator (output multiplier
/// `0x2545_F491_4F6C_DD1D`); every test that drew from it keeps its exact
/// sequence.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
    multiplier: u64,
}

impl Rng {
    /// xorshift64* from `seed` (not 0: zero is a fixed point).
    pub fn new(seed: u64) -> Self {
        Self::with_multiplier(seed, 0x2545_F491_4F6C_DD1D)
    }

    /// The same shifts with another output multiplier (tests/algorithms/algorithms.rs's
    /// long sequence was drawn with `0x9E37_79B9_7F4A_7C15`).
    pub fn with_multiplier(seed: u64, multiplier: u64) -> Self {
        assert_ne!(seed, 0, "xorshift never leaves 0");
        Rng {
            state: seed,
            multiplier,
        }
    }

    pub fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(self.multiplier)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// An index in `0..len`.
    pub fn index(&mut self, len: usize) -> usize {
        (self.next() % len as u64) as usize
    }
}

/// A proptest runner of `cases` cases on a fixed ChaCha seed (`[seed; 32]`)
/// and without a regressions file: the same cases on every run.
pub fn seeded_runner(cases: u32, seed: u8) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}
