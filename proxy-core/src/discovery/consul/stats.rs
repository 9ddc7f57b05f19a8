//! Counters and gauges of one Consul cluster: the discovery counters every source keeps
//! (`cluster.<name>.update_*`, `membership_*`) plus `cluster.<name>.consul.*` for what only a
//! Consul watch has.
//!
//! A query started is an `update_attempt`; one answered with 200 and a valid body an
//! `update_success`, and an `update_no_rebuild` when its host set equalled the previous one (a
//! blocking query that timed out, or a change elsewhere in the catalog); one that failed
//! (connection, timeout, status, body) an `update_failure`, the hosts kept.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::discovery::source_stats::{SourceStatValues, SourceStats};

/// Shared between the watch task and readers.
#[derive(Debug, Default)]
pub struct ConsulStats {
    pub(crate) source: SourceStats,
    pub(crate) index: AtomicU64,
    pub(crate) index_reset: AtomicU64,
    pub(crate) instances_skipped: AtomicU64,
    pub(crate) acl_denied: AtomicU64,
}

/// A point-in-time copy of [`ConsulStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsulStatValues {
    /// `update_*` and `membership_change`/`membership_total`, as every source has them.
    pub source: SourceStatValues,
    /// The index the next blocking query waits on (gauge; 0 = the next query does not block).
    pub index: u64,
    /// Times the returned `X-Consul-Index` went backwards and the watch restarted from 0.
    pub index_reset: u64,
    /// Instances of the last response that were left out (address not an IP literal, or an
    /// entry this daemon cannot use, such as a port out of range; gauge).
    pub instances_skipped: u64,
    /// Answers not applied because Consul's ACLs refused the token, or would show an empty
    /// answer to no token (see `acl`); the hosts were kept. Also counted in `update_failure`.
    pub acl_denied: u64,
}

impl ConsulStats {
    /// Current values.
    pub fn values(&self) -> ConsulStatValues {
        ConsulStatValues {
            source: self.source.values(),
            index: self.index.load(Relaxed),
            index_reset: self.index_reset.load(Relaxed),
            instances_skipped: self.instances_skipped.load(Relaxed),
            acl_denied: self.acl_denied.load(Relaxed),
        }
    }

    /// `(cluster.<name>.<stat>, value)` pairs for `/stats`.
    pub fn named(&self, cluster: &str) -> Vec<(String, u64)> {
        let v = self.values();
        v.source.named(
            cluster,
            [
                ("consul.index", v.index),
                ("consul.index_reset", v.index_reset),
                ("consul.instances_skipped", v.instances_skipped),
                ("consul.acl_denied", v.acl_denied),
            ],
        )
    }
}
