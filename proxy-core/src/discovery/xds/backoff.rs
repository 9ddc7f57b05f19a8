//! Jittered exponential backoff between control-plane reconnects, as Envoy's
//! `JitteredExponentialBackOffStrategy`: the n-th consecutive failure waits a random time in
//! `[0, min(base * 2^n, max))`; a successful response resets it.
//!
//! A response over the decode limit comes back on every new stream until the control plane
//! makes it smaller, often after smaller responses that were accepted and reset the backoff.
//! So it has its own count, which accepted responses do not reset, and waits
//! `[bound / 2, bound)` with `bound = min(base * 2^n, max)`: never a quick retry.

use std::time::Duration;

/// Backoff state of one control-plane connection.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
    oversized: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    /// A backoff with these bounds (`max` is raised to `base` if smaller).
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max: max.max(base),
            attempt: 0,
            oversized: 0,
            rng: fastrand::Rng::new(),
        }
    }

    /// The upper bound of the next delay.
    pub fn current_bound(&self) -> Duration {
        self.bound(self.attempt)
    }

    fn bound(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The delay after a response over the decode limit: in `[bound / 2, bound)`, the bound
    /// doubling with each such response in a row (see the module doc).
    pub fn next_oversized_delay(&mut self) -> Duration {
        let bound = self.bound(self.oversized);
        self.oversized = self.oversized.saturating_add(1);
        self.attempt = self.attempt.saturating_add(1);
        let millis = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX).max(2);
        Duration::from_millis(self.rng.u64(millis / 2..millis))
    }

    /// Forgets the responses over the limit: a stream ended for another reason.
    pub fn clear_oversized(&mut self) {
        self.oversized = 0;
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

    #[test]
    fn oversized_delays_grow_to_max_through_resets_and_never_go_below_half() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let lows = [50, 100, 175, 175];
        for (n, low) in lows.into_iter().enumerate() {
            backoff.reset();
            let delay = backoff.next_oversized_delay().as_millis();
            assert!((low..low * 2).contains(&delay), "{n}: {delay} ms");
        }
        backoff.clear_oversized();
        assert!(backoff.next_oversized_delay() < Duration::from_millis(100));
    }
}
