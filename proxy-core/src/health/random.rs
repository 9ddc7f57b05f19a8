//! Injectable randomness for jitter and enforcement percentages, so tests are deterministic.

use std::sync::Mutex;

/// A source of uniform random numbers.
pub trait Random: Send + Sync + std::fmt::Debug {
    /// A value in `[0, bound)`; 0 when `bound` is 0.
    fn below(&self, bound: u64) -> u64;
}

/// [`Random`] backed by a seeded `fastrand` generator.
#[derive(Debug)]
pub struct SeededRandom(Mutex<fastrand::Rng>);

impl SeededRandom {
    /// A generator with a fixed seed (tests) ...
    pub fn with_seed(seed: u64) -> Self {
        Self(Mutex::new(fastrand::Rng::with_seed(seed)))
    }

    /// ... or seeded from the OS (production).
    pub fn from_entropy() -> Self {
        Self(Mutex::new(fastrand::Rng::new()))
    }
}

impl Random for SeededRandom {
    fn below(&self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let mut rng = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        rng.u64(0..bound)
    }
}

/// [`Random`] that always answers `bound - 1` (the largest jitter) or 0, for bound tests.
#[derive(Debug, Clone, Copy)]
pub struct ExtremeRandom {
    /// `true`: always the maximum `bound - 1`; `false`: always 0.
    pub max: bool,
}

impl Random for ExtremeRandom {
    fn below(&self, bound: u64) -> u64 {
        if self.max { bound.saturating_sub(1) } else { 0 }
    }
}
