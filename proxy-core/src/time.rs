//! Deadlines from configured durations. A duration is as large as a user writes it (Envoy's own
//! limit is 10,000 years), and `Instant + Duration` panics past the clock's range: every deadline
//! taken from configuration goes through [`after`], which saturates at [`FAR`] instead.

use std::time::{Duration, Instant};

/// A deadline this far away never comes in practice (100 years).
pub const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, or `now + FAR` when `d` is larger than that (or the sum would overflow).
#[must_use]
pub fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(FAR)).unwrap_or(now)
}

/// [`after`] for tokio's clock.
#[must_use]
pub fn after_tokio(now: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(after(now.into_std(), d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates_instead_of_panicking() {
        let now = Instant::now();
        assert_eq!(
            after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        assert_eq!(after(now, Duration::MAX), now + FAR);
        assert_eq!(after(now, FAR + Duration::from_secs(1)), now + FAR);
        let t = tokio::time::Instant::now();
        assert_eq!(after_tokio(t, Duration::MAX), t + FAR);
    }
}
