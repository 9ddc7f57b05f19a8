//! One interface over the custom discovery backends (Consul catalog, DNS SRV, ...): a watch of
//! host sets and Envoy-named stats, so the daemon consumes every backend the same way.
//!
//! A backend is a running object (it owns its tasks; dropping it stops them) that publishes
//! [`SourceUpdate`]s on a watch channel. The daemon reads the latest value, never waits on the
//! backend on the connect path, and merges [`DiscoverySource::named_stats`] into `/stats`.
//!
//! [`DnsSource`] adapts a running [`DnsCluster`] to this interface.

use tokio::{sync::watch, task::JoinHandle};

use super::{HostSet, dns::DnsCluster};

/// One published state of a backend's hosts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceUpdate {
    /// Increases with every publication; 0 is the initial state before any result.
    pub version: u64,
    /// True once the backend finished its first fetch (success or failure): Envoy's cluster
    /// initialization. Routing decisions are meaningful from then on.
    pub initialized: bool,
    /// All hosts the backend reports, with their weight, priority, health and metadata.
    pub hosts: HostSet,
}

/// A running discovery backend of one cluster.
pub trait DiscoverySource: Send + Sync {
    /// The cluster this backend discovers hosts for.
    fn cluster_name(&self) -> &str;

    /// A receiver of host-set updates; its current value is the latest state.
    fn updates(&self) -> watch::Receiver<SourceUpdate>;

    /// `(name, value)` pairs named as Envoy names them (`cluster.<name>.update_attempt`, ...).
    fn named_stats(&self) -> Vec<(String, u64)>;

    /// Whether connections to removed hosts are drained (Envoy: true for every type but
    /// LOGICAL_DNS).
    fn drain_on_change(&self) -> bool {
        true
    }
}

/// A [`DnsCluster`] (STRICT_DNS, LOGICAL_DNS or DNS SRV) seen as a [`DiscoverySource`]: a task
/// copies each DNS update into a [`SourceUpdate`]. Dropping it stops that task and the cluster.
pub struct DnsSource {
    cluster: DnsCluster,
    updates: watch::Receiver<SourceUpdate>,
    task: JoinHandle<()>,
}

impl DnsSource {
    /// Wraps `cluster`. Must be called within a tokio runtime.
    pub fn new(cluster: DnsCluster) -> Self {
        let mut dns = cluster.updates();
        let convert = |u: &super::dns::Update| SourceUpdate {
            version: u.version,
            initialized: u.initialized,
            hosts: u.hosts.clone(),
        };
        let (tx, updates) = watch::channel(convert(&dns.borrow_and_update()));
        let task = tokio::spawn(async move {
            while dns.changed().await.is_ok() {
                let update = convert(&dns.borrow_and_update());
                if tx.send(update).is_err() {
                    return;
                }
            }
        });
        Self {
            cluster,
            updates,
            task,
        }
    }

    /// The wrapped cluster.
    pub fn cluster(&self) -> &DnsCluster {
        &self.cluster
    }
}

impl Drop for DnsSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DiscoverySource for DnsSource {
    fn cluster_name(&self) -> &str {
        self.cluster.name()
    }

    fn updates(&self) -> watch::Receiver<SourceUpdate> {
        self.updates.clone()
    }

    fn named_stats(&self) -> Vec<(String, u64)> {
        self.cluster.named_stats()
    }

    fn drain_on_change(&self) -> bool {
        self.cluster.drain_on_change()
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;
    use crate::discovery::dns::{DnsEndpoint, DnsSettings, FakeResolver, spawn_strict_dns};

    #[tokio::test(start_paused = true)]
    async fn dns_cluster_updates_arrive_as_source_updates() {
        let resolver = Arc::new(FakeResolver::new());
        resolver.set("web.svc.test", &[("127.0.0.2", 5)]);
        let settings = DnsSettings {
            dns_refresh_rate: Duration::from_secs(1),
            ..DnsSettings::default()
        };
        let endpoints = vec![DnsEndpoint::new("web.svc.test", 8080)];
        let cluster = spawn_strict_dns("web", settings, endpoints, resolver).expect("valid");
        let source = DnsSource::new(cluster);
        let mut updates = source.updates();
        let wait = updates.wait_for(|u| u.initialized);
        let update = tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("initialized in time")
            .expect("source alive")
            .clone();
        assert!(update.version >= 1);
        let addrs: Vec<String> = update.hosts.iter().map(|h| h.addr.to_string()).collect();
        assert_eq!(addrs, ["127.0.0.2:8080"]);
        assert_eq!(source.cluster_name(), "web");
        assert!(source.drain_on_change());
        assert!(
            source
                .named_stats()
                .iter()
                .any(|(n, _)| n == "cluster.web.update_attempt")
        );
    }
}
