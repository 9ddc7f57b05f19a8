//! Jittered exponential backoff between control-plane reconnects, as Envoy's
//! `JitteredExponentialBackOffStrategy`: the n-th consecutive failure waits a random time in
//! `[0, min(base * 2^n, max))`; a successful response resets it.

use std::time::Duration;

/// Envoy's xDS gRPC stream retry base (`RetryInitialDelayMs`).
pub const DEFAULT_BASE_INTERVAL: Duration = Duration::from_millis(500);
/// Envoy's xDS gRPC stream retry cap (`RetryMaxDelayMs`).
pub const DEFAULT_MAX_INTERVAL: Duration = Duration::from_secs(30);

/// Backoff state of one control-plane connection.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    /// A backoff with these bounds (`max` is raised to `base` if smaller).
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max: max.max(base),
            attempt: 0,
            rng: fastrand::Rng::new(),
        }
    }

    /// The upper bound of the next delay.
    pub fn current_bound(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The next delay, and one more failure recorded.
    pub fn next_delay(&mut self) -> Duration {
        let bound = self.current_bound();
        self.attempt = self.attempt.saturating_add(1);
        let millis = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX).max(1);
        Duration::from_millis(self.rng.u64(0..millis))
    }

    /// Forgets the failures.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_doubles_up_to_max_and_reset_restarts() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let bounds: Vec<_> = (0..4)
            .map(|_| {
                let bound = backoff.current_bound();
                assert!(backoff.next_delay() < bound);
                bound.as_millis()
            })
            .collect();
        assert_eq!(bounds, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.current_bound(), Duration::from_millis(100));
    }
}
