//! The discovery plane: where a cluster's hosts come from.
//!
//! Every source sits side by side here and implements [`DiscoverySource`]: [`fixed`] (STATIC),
//! [`dns`] (STRICT_DNS, LOGICAL_DNS and the DNS SRV custom type), [`consul`] (the Consul catalog
//! custom type) and [`xds`] (EDS over xDS v3). Each publishes [`SourceUpdate`]s itself on the
//! watch channel that the cluster's event loop (`crate::upstream`) reads; [`start`] is the one
//! place that maps a cluster's type to its source. Every source reduces to a [`HostSet`], and
//! [`diff_hosts`] is the one host diff they publish with.

pub mod consul;
pub mod dns;
pub mod fixed;
pub mod guard;
pub mod source;
pub mod xds;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use serde::{Deserialize, Serialize};

pub use self::source::{DiscoverySource, SourceError, SourceUpdate, start};

/// Health as reported by the discovery source itself (EDS `health_status`, Consul checks), before
/// active health checking. Envoy's `core.v3.HealthStatus`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EdsHealth {
    /// No information; treated as healthy.
    #[default]
    Unknown,
    /// Healthy.
    Healthy,
    /// Unhealthy; not routed.
    Unhealthy,
    /// Draining; treated as unhealthy for new connections.
    Draining,
    /// Health check timed out; treated as unhealthy.
    Timeout,
    /// Degraded: routed only when there are not enough healthy hosts.
    Degraded,
}

/// One upstream host of a cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Host {
    /// Address the kernel or the proxy connects to.
    pub addr: SocketAddr,
    /// Load-balancing weight, at least 1.
    pub weight: u32,
    /// Failover priority, 0 = highest.
    pub priority: u32,
    /// Health as the discovery source reports it.
    pub eds_health: EdsHealth,
    /// Host metadata (EDS metadata, Consul `Service.Meta`), used by subset filters.
    pub metadata: BTreeMap<String, String>,
    /// Hostname the address came from, if any (DNS-based clusters).
    pub hostname: Option<String>,
}

impl Host {
    /// A host with weight 1, priority 0, unknown health and no metadata.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            weight: 1,
            priority: 0,
            eds_health: EdsHealth::Unknown,
            metadata: BTreeMap::new(),
            hostname: None,
        }
    }
}

/// The hosts a discovery backend currently reports for one cluster.
pub type HostSet = Vec<Host>;

/// Hosts of `new` whose address is not in `old`, and hosts of `old` whose address is not in
/// `new`: every source fills [`SourceUpdate::added`] and [`SourceUpdate::removed`] with it. A
/// consumer that may have skipped versions (watch channels keep only the latest) diffs its
/// last-seen hosts against the current ones with this instead.
pub fn diff_hosts(old: &[Host], new: &[Host]) -> (Vec<Host>, Vec<Host>) {
    let old_addrs: BTreeSet<SocketAddr> = old.iter().map(|h| h.addr).collect();
    let new_addrs: BTreeSet<SocketAddr> = new.iter().map(|h| h.addr).collect();
    let added = new
        .iter()
        .filter(|h| !old_addrs.contains(&h.addr))
        .cloned()
        .collect();
    let removed = old
        .iter()
        .filter(|h| !new_addrs.contains(&h.addr))
        .cloned()
        .collect();
    (added, removed)
}
