//! `policy.endpoint_stale_after`, the lease of an assignment, as Envoy's EDS cluster keeps it:
//! every accepted assignment restarts it (or clears it, without the field); when it runs out
//! before the next one, the cluster's hosts are removed as an empty assignment would remove
//! them (the health matrix then applies its rules for hosts discovery dropped) and the policy
//! goes back to its defaults; `assignment_stale` counts it. The next assignment brings hosts
//! back. A response without the resource, or a delta removal, leaves the lease running.

use std::sync::{Arc, Mutex};

use tokio::{sync::Notify, time::Instant};

use super::{EdsState, Resource};
use crate::{
    discovery::{SourceStats, diff_hosts},
    health::AssignmentPolicy,
    host::HostSet,
};

impl EdsState {
    /// The earliest moment a held assignment's lease runs out.
    pub(crate) fn next_stale(&self) -> Option<Instant> {
        self.resources.values().filter_map(|r| r.stale_at).min()
    }

    /// Removes the hosts of every assignment whose lease ran out by `now`.
    pub(crate) fn expire_stale(&mut self, now: Instant) {
        for (name, resource) in &mut self.resources {
            if resource.stale_at.is_some_and(|at| at <= now) {
                resource.stale_at = None;
                tracing::warn!(resource = %name, "EDS assignment went stale (endpoint_stale_after) before a new one arrived; its hosts are removed");
                expire(resource);
            }
        }
    }

    /// What wakes [`watch_leases`] when a lease is set.
    pub(crate) fn leases(&self) -> Arc<Notify> {
        Arc::clone(&self.leases)
    }
}

/// Publishes an empty host set and the default policy in place of `resource`'s assignment.
fn expire(resource: &mut Resource) {
    let empty = HostSet::new();
    let policy = AssignmentPolicy::default();
    let held = resource.hosts.as_deref().unwrap_or_default();
    let changed = !held.is_empty() || resource.policy != policy;
    let (added, removed) = diff_hosts(held, &empty);
    for sink in &resource.sinks {
        let stats = &sink.stats;
        SourceStats::inc(&stats.assignment_stale);
        if !changed {
            continue;
        }
        SourceStats::inc(&stats.source.membership_change);
        stats.set_membership(&empty);
        sink.tx.send_modify(|update| {
            update.version += 1;
            update.hosts.clone_from(&empty);
            update.added.clone_from(&added);
            update.removed.clone_from(&removed);
            update.policy = Some(policy);
        });
    }
    resource.hosts = Some(empty);
    resource.policy = policy;
}

/// Sleeps until the earliest lease runs out and expires it; woken whenever a response sets one.
pub(crate) async fn watch_leases(state: Arc<Mutex<EdsState>>, leases: Arc<Notify>) {
    loop {
        let next = crate::discovery::xds::grpc::lock(&state).next_stale();
        match next {
            None => leases.notified().await,
            Some(at) => {
                tokio::select! {
                    () = leases.notified() => {}
                    () = tokio::time::sleep_until(at) => {
                        crate::discovery::xds::grpc::lock(&state).expire_stale(Instant::now());
                    }
                }
            }
        }
    }
}
