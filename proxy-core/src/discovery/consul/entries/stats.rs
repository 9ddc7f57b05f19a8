//! Counters and gauges of the config entry watch, named `consul_entries.<stat>` after the
//! catalog watch's `cluster.<name>.*` ones.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Shared between the five loops and readers.
#[derive(Debug, Default)]
pub struct EntriesStats {
    pub(crate) update_attempt: AtomicU64,
    pub(crate) update_success: AtomicU64,
    pub(crate) update_failure: AtomicU64,
    pub(crate) update_no_rebuild: AtomicU64,
    pub(crate) entries_change: AtomicU64,
    pub(crate) entries_total: AtomicU64,
    pub(crate) entries_skipped: AtomicU64,
    pub(crate) index_reset: AtomicU64,
    pub(crate) acl_denied: AtomicU64,
}

/// A point-in-time copy of [`EntriesStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntriesStatValues {
    /// Queries started (all kinds).
    pub update_attempt: u64,
    /// Queries answered with 200 and a JSON list.
    pub update_success: u64,
    /// Queries that failed (connection, timeout, status, body, ACLs); entries were kept.
    pub update_failure: u64,
    /// Successful answers that changed none of their kind's entries.
    pub update_no_rebuild: u64,
    /// Overlays published with a changed set of entries.
    pub entries_change: u64,
    /// Entries published now (gauge).
    pub entries_total: u64,
    /// Entries of the last answers left out as unusable (gauge).
    pub entries_skipped: u64,
    /// Times a returned `X-Consul-Index` went backwards and a loop restarted from 0.
    pub index_reset: u64,
    /// Answers not applied because Consul's ACLs refused the token (also in `update_failure`).
    pub acl_denied: u64,
}

impl EntriesStats {
    /// Current values.
    pub fn values(&self) -> EntriesStatValues {
        EntriesStatValues {
            update_attempt: self.update_attempt.load(Relaxed),
            update_success: self.update_success.load(Relaxed),
            update_failure: self.update_failure.load(Relaxed),
            update_no_rebuild: self.update_no_rebuild.load(Relaxed),
            entries_change: self.entries_change.load(Relaxed),
            entries_total: self.entries_total.load(Relaxed),
            entries_skipped: self.entries_skipped.load(Relaxed),
            index_reset: self.index_reset.load(Relaxed),
            acl_denied: self.acl_denied.load(Relaxed),
        }
    }

    /// `(consul_entries.<stat>, value)` pairs for `/stats`.
    pub fn named(&self) -> Vec<(String, u64)> {
        let v = self.values();
        [
            ("update_attempt", v.update_attempt),
            ("update_success", v.update_success),
            ("update_failure", v.update_failure),
            ("update_no_rebuild", v.update_no_rebuild),
            ("entries_change", v.entries_change),
            ("entries_total", v.entries_total),
            ("entries_skipped", v.entries_skipped),
            ("index_reset", v.index_reset),
            ("acl_denied", v.acl_denied),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("consul_entries.{stat}"), value))
        .collect()
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    pub(crate) fn set(gauge: &AtomicU64, value: u64) {
        gauge.store(value, Relaxed);
    }
}
