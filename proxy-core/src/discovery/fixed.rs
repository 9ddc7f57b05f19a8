//! STATIC clusters: the configured hosts, published once and never changed.

use tokio::sync::watch;

use super::{DiscoverySource, SourceUpdate};
use crate::host::HostSet;

/// A STATIC cluster's source: one initialized update with the configured hosts. It has no task;
/// it holds the sender so the channel stays open for as long as the cluster runs.
pub struct FixedSource {
    name: String,
    updates: watch::Sender<SourceUpdate>,
}

impl FixedSource {
    /// A source that publishes `hosts` for cluster `name`.
    pub fn new(name: impl Into<String>, hosts: HostSet) -> Self {
        let mut update = SourceUpdate::default();
        update.advance(hosts);
        Self {
            name: name.into(),
            updates: watch::Sender::new(update),
        }
    }
}

impl DiscoverySource for FixedSource {
    fn cluster_name(&self) -> &str {
        &self.name
    }

    fn updates(&self) -> watch::Receiver<SourceUpdate> {
        self.updates.subscribe()
    }

    fn named_stats(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}
