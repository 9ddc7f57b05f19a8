//! Which services run on an older host set than the daemon holds for them: the publish of their
//! newest set failed (a map full, say), so the kernel still serves the previous one (or nothing,
//! before a first publish succeeded).

use std::collections::HashMap;

use proxy_common::service::ServiceKey;

/// A service's publish record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublishState {
    /// The last publish failed: the kernel serves an older host set.
    pub stale: bool,
    /// Publishes that failed, since the service was first published by this daemon.
    pub failures: u64,
}

/// Publish records of the services that ever failed (the others are fresh, with no failure).
#[derive(Default)]
pub(super) struct StaleSets(HashMap<ServiceKey, PublishState>);

impl StaleSets {
    /// Records the outcome of a publish of `key`.
    pub(super) fn record(&mut self, key: ServiceKey, published: bool) {
        if published {
            if let Some(state) = self.0.get_mut(&key) {
                state.stale = false;
            }
            return;
        }
        let state = self.0.entry(key).or_default();
        state.stale = true;
        state.failures += 1;
    }

    /// Forgets a removed service.
    pub(super) fn forget(&mut self, key: &ServiceKey) {
        self.0.remove(key);
    }

    /// The record of `key`.
    pub(super) fn of(&self, key: &ServiceKey) -> PublishState {
        self.0.get(key).copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_marks_stale_until_a_publish_succeeds_and_is_counted() {
        let key = ServiceKey::default();
        let mut sets = StaleSets::default();
        assert_eq!(sets.of(&key), PublishState::default(), "never failed");
        sets.record(key, false);
        sets.record(key, false);
        assert_eq!(
            sets.of(&key),
            PublishState {
                stale: true,
                failures: 2
            }
        );
        sets.record(key, true);
        assert_eq!(
            sets.of(&key),
            PublishState {
                stale: false,
                failures: 2
            },
            "fresh again; the failures stay counted"
        );
        sets.forget(&key);
        assert_eq!(sets.of(&key), PublishState::default(), "removed");
    }
}
