//! When to re-resolve after a failure: Envoy's `prepareDnsRefreshStrategy`.
//!
//! With `dns_failure_refresh_rate` set, failures back off with a fully jittered exponential
//! strategy: the n-th consecutive failure waits a uniformly random time in `[0, bound)`, where
//! the bound starts at `base_interval`, doubles per failure and is capped at `max_interval`. A
//! success resets the bound. Without it, every failure waits exactly `dns_refresh_rate`.

use std::time::Duration;

use crate::config::sources::dns::DnsSettings;

/// The failure refresh strategy of one cluster (shared by all its targets, as in Envoy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureBackoff {
    /// Always this delay.
    Fixed(Duration),
    /// Jittered exponential backoff, in milliseconds.
    Jittered {
        /// First bound.
        base_ms: u64,
        /// Cap of the bound.
        max_ms: u64,
        /// Bound of the next delay.
        next_ms: u64,
    },
}

impl FailureBackoff {
    /// The strategy `settings` ask for (assumes they were validated).
    pub fn from_settings(settings: &DnsSettings) -> Self {
        match &settings.dns_failure_refresh_rate {
            None => Self::Fixed(settings.dns_refresh_rate),
            Some(rate) => {
                let base_ms = millis(rate.base_interval).max(1);
                let max_ms = millis(rate.effective_max_interval()).max(base_ms);
                Self::Jittered {
                    base_ms,
                    max_ms,
                    next_ms: base_ms,
                }
            }
        }
    }

    /// The delay before the next attempt after a failure; advances the bound.
    pub fn next_delay(&mut self, rng: &mut fastrand::Rng) -> Duration {
        match self {
            Self::Fixed(delay) => *delay,
            Self::Jittered {
                max_ms, next_ms, ..
            } => {
                let bound = *next_ms;
                *next_ms = if *next_ms < *max_ms / 2 {
                    *next_ms * 2
                } else {
                    *max_ms
                };
                Duration::from_millis(rng.u64(0..bound))
            }
        }
    }

    /// The current bound (exclusive) of the next jittered delay, if jittered.
    pub fn current_bound(&self) -> Option<Duration> {
        match self {
            Self::Fixed(_) => None,
            Self::Jittered { next_ms, .. } => Some(Duration::from_millis(*next_ms)),
        }
    }

    /// A success: the next failure starts again from `base_interval`.
    pub fn reset(&mut self) {
        if let Self::Jittered {
            base_ms, next_ms, ..
        } = self
        {
            *next_ms = *base_ms;
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::sources::dns::RefreshRate;

    fn jittered(base_ms: u64, max_ms: Option<u64>) -> FailureBackoff {
        let settings = DnsSettings {
            dns_failure_refresh_rate: Some(RefreshRate {
                base_interval: Duration::from_millis(base_ms),
                max_interval: max_ms.map(Duration::from_millis),
            }),
            ..DnsSettings::default()
        };
        FailureBackoff::from_settings(&settings)
    }

    #[test]
    fn bound_doubles_then_caps_at_max() {
        let mut backoff = jittered(1000, Some(10_000));
        let mut rng = fastrand::Rng::with_seed(7);
        let mut bounds = Vec::new();
        for _ in 0..7 {
            let bound = backoff.current_bound().unwrap();
            let delay = backoff.next_delay(&mut rng);
            assert!(delay < bound, "{delay:?} must be below {bound:?}");
            bounds.push(bound.as_millis());
        }
        assert_eq!(bounds, [1000, 2000, 4000, 8000, 10_000, 10_000, 10_000]);
    }

    #[test]
    fn max_defaults_to_ten_times_base() {
        let mut backoff = jittered(500, None);
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..10 {
            backoff.next_delay(&mut rng);
        }
        assert_eq!(backoff.current_bound(), Some(Duration::from_millis(5000)));
    }

    #[test]
    fn delays_cover_the_jitter_range() {
        let mut rng = fastrand::Rng::with_seed(42);
        let delays: Vec<u64> = (0..2000)
            .map(|_| jittered(1000, Some(1000)).next_delay(&mut rng).as_millis() as u64)
            .collect();
        assert!(delays.iter().all(|d| *d < 1000));
        assert!(
            delays.iter().any(|d| *d < 100),
            "low end of [0, base) is reached"
        );
        assert!(
            delays.iter().any(|d| *d >= 900),
            "high end of [0, base) is reached"
        );
    }

    #[test]
    fn reset_restarts_from_base() {
        let mut backoff = jittered(100, Some(1000));
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..5 {
            backoff.next_delay(&mut rng);
        }
        backoff.reset();
        assert_eq!(backoff.current_bound(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn unset_means_fixed_refresh_rate() {
        let settings = DnsSettings {
            dns_refresh_rate: Duration::from_secs(3),
            ..DnsSettings::default()
        };
        let mut backoff = FailureBackoff::from_settings(&settings);
        let mut rng = fastrand::Rng::with_seed(0);
        for _ in 0..3 {
            assert_eq!(backoff.next_delay(&mut rng), Duration::from_secs(3));
        }
    }
}
