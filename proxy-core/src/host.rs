//! One upstream host and its health as a source reports it: what every discovery source
//! (`crate::discovery`), a STATIC cluster's endpoints (`crate::config`), health checking and
//! load balancing share.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use serde::{Deserialize, Serialize};

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
///
/// What every host has is inline; what few hosts have (metadata, a hostname, a health check
/// config of their own, a locality) is one shared [`HostDetail`], absent when all of it is
/// empty. A host is copied into its source's update, its cluster's membership and each level of
/// its routing, so a copy costs 64 bytes and no allocation. Two hosts are equal when every
/// field is, an absent detail being equal to an empty one.
#[derive(Clone, Debug)]
pub struct Host {
    /// Address the kernel or the proxy connects to.
    pub addr: SocketAddr,
    /// Load-balancing weight, at least 1.
    pub weight: u32,
    /// Failover priority, 0 = highest.
    pub priority: u32,
    /// Health as the discovery source reports it.
    pub eds_health: EdsHealth,
    /// The enclosing `LocalityLbEndpoints.load_balancing_weight`, when set: the locality's
    /// weight under locality-weighted load balancing (the same on every host of a locality).
    pub locality_weight: Option<u32>,
    /// Metadata, hostname, health check config and locality, shared by the host's copies;
    /// `None` when all are empty. Read it with [`Host::detail`], set it with
    /// [`Host::with_detail`] (which keeps an empty one out).
    pub detail: Option<Arc<HostDetail>>,
}

/// The parts of a [`Host`] that most hosts leave empty, shared by every copy of the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostDetail {
    /// Host metadata (EDS metadata, Consul `Service.Meta`), used by subset filters.
    pub metadata: BTreeMap<String, String>,
    /// Hostname the address came from (DNS-based clusters), or the endpoint's `hostname` (EDS,
    /// the file): shown in `/clusters`, never resolved.
    pub hostname: Option<String>,
    /// Envoy's `Endpoint.health_check_config`: where and how active checks reach this host.
    pub health_check: HealthCheckTarget,
    /// Where the host runs (the enclosing `LocalityLbEndpoints.locality`); empty when the
    /// source names none.
    pub locality: Locality,
}

/// The detail of a host without one.
static NO_DETAIL: HostDetail = HostDetail {
    metadata: BTreeMap::new(),
    hostname: None,
    health_check: HealthCheckTarget {
        address: None,
        address_port: None,
        port: None,
        hostname: None,
        disabled: false,
    },
    locality: Locality {
        region: String::new(),
        zone: String::new(),
        sub_zone: String::new(),
    },
};

impl PartialEq for Host {
    fn eq(&self, other: &Self) -> bool {
        self.addr == other.addr
            && self.weight == other.weight
            && self.priority == other.priority
            && self.eds_health == other.eds_health
            && self.locality_weight == other.locality_weight
            && self.detail() == other.detail()
    }
}

impl Eq for Host {}

/// How a host serializes (`/clusters`, `/config_dump`): every field by name, as before the
/// detail was split off.
#[derive(Serialize)]
#[serde(rename = "Host")]
struct HostFields<'a> {
    addr: SocketAddr,
    weight: u32,
    priority: u32,
    eds_health: EdsHealth,
    metadata: &'a BTreeMap<String, String>,
    hostname: &'a Option<String>,
    health_check: &'a HealthCheckTarget,
    locality: &'a Locality,
    locality_weight: Option<u32>,
}

impl Serialize for Host {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let detail = self.detail();
        HostFields {
            addr: self.addr,
            weight: self.weight,
            priority: self.priority,
            eds_health: self.eds_health,
            metadata: &detail.metadata,
            hostname: &detail.hostname,
            health_check: &detail.health_check,
            locality: &detail.locality,
            locality_weight: self.locality_weight,
        }
        .serialize(serializer)
    }
}

/// Envoy's `core.v3.Locality`: region, zone and sub-zone, each empty when not named. Two hosts
/// are in one locality when all three are equal.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Locality {
    /// The region.
    #[serde(default)]
    pub region: String,
    /// The zone within the region.
    #[serde(default)]
    pub zone: String,
    /// The sub-zone within the zone.
    #[serde(default)]
    pub sub_zone: String,
}

/// Envoy's `Endpoint.HealthCheckConfig`: an active check of a host may go to another address or
/// port than its traffic, name it differently, or not run at all.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct HealthCheckTarget {
    /// `address`: the IP checks connect to instead of the host's.
    pub address: Option<IpAddr>,
    /// `address.socket_address.port_value`, when `address` is set: its port.
    pub address_port: Option<u16>,
    /// `port_value` (not 0): the port checks connect to, over any other.
    pub port: Option<u16>,
    /// `hostname`: the HTTP `Host` (gRPC `:authority`) of checks to this host, over the
    /// cluster's configured one.
    pub hostname: Option<String>,
    /// `disable_active_health_check`: this host is not checked, and routes without a check.
    pub disabled: bool,
}

impl HealthCheckTarget {
    /// Where checks of a host at `addr` connect, as Envoy resolves it: the alternate address
    /// (with its own port) when set, then `port_value` over the port.
    pub fn addr(&self, addr: SocketAddr) -> SocketAddr {
        let mut target = match self.address {
            Some(ip) => SocketAddr::new(ip, self.address_port.unwrap_or(addr.port())),
            None => addr,
        };
        if let Some(port) = self.port {
            target.set_port(port);
        }
        target
    }
}

impl Host {
    /// A host with weight 1, priority 0, unknown health and no metadata.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            weight: 1,
            priority: 0,
            eds_health: EdsHealth::Unknown,
            locality_weight: None,
            detail: None,
        }
    }

    /// This host with `detail` (kept only when not empty).
    #[must_use]
    pub fn with_detail(mut self, detail: HostDetail) -> Self {
        self.detail = (detail != NO_DETAIL).then(|| Arc::new(detail));
        self
    }

    /// Metadata, hostname, health check config and locality (empty when the source gave none).
    pub fn detail(&self) -> &HostDetail {
        self.detail.as_deref().unwrap_or(&NO_DETAIL)
    }

    /// The detail to change; this host's own (copies made before keep theirs).
    pub fn detail_mut(&mut self) -> &mut HostDetail {
        Arc::make_mut(self.detail.get_or_insert_with(Arc::default))
    }

    /// Host metadata (EDS metadata, Consul `Service.Meta`), used by subset filters.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.detail().metadata
    }

    /// Hostname the address came from (DNS-based clusters), or the endpoint's `hostname`.
    pub fn hostname(&self) -> Option<&str> {
        self.detail().hostname.as_deref()
    }

    /// Envoy's `Endpoint.health_check_config` of this host.
    pub fn health_check(&self) -> &HealthCheckTarget {
        &self.detail().health_check
    }

    /// Where the host runs; empty when the source names none.
    pub fn locality(&self) -> &Locality {
        &self.detail().locality
    }

    /// This host with `metadata`.
    #[must_use]
    pub fn with_metadata(mut self, metadata: BTreeMap<String, String>) -> Self {
        if !metadata.is_empty() || self.detail.is_some() {
            self.detail_mut().metadata = metadata;
        }
        self
    }

    /// This host with `hostname`.
    #[must_use]
    pub fn with_hostname(mut self, hostname: Option<String>) -> Self {
        if hostname.is_some() || self.detail.is_some() {
            self.detail_mut().hostname = hostname;
        }
        self
    }

    /// This host with its own health check config.
    #[must_use]
    pub fn with_health_check(mut self, health_check: HealthCheckTarget) -> Self {
        if health_check != NO_DETAIL.health_check || self.detail.is_some() {
            self.detail_mut().health_check = health_check;
        }
        self
    }

    /// This host in `locality`.
    #[must_use]
    pub fn with_locality(mut self, locality: Locality) -> Self {
        if locality != NO_DETAIL.locality || self.detail.is_some() {
            self.detail_mut().locality = locality;
        }
        self
    }
}

/// The hosts a discovery backend currently reports for one cluster.
pub type HostSet = Vec<Host>;

// A host is copied into its source's update, its membership and each level of its routing:
// 64 bytes per copy (the detail is shared), not the 232 of every field inline.
const _: () = assert!(size_of::<Host>() <= 64);

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use serde_json::json;

    use super::{HealthCheckTarget, Host, HostDetail, Locality};

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 80))
    }

    #[test]
    fn an_empty_detail_is_kept_out_and_equals_none() {
        let plain = Host::new(addr());
        let empty = Host::new(addr()).with_detail(HostDetail::default());
        assert!(empty.detail.is_none());
        assert_eq!(plain, empty);
        let mut changed_back = Host::new(addr());
        changed_back.detail_mut().hostname = None;
        assert!(changed_back.detail.is_some());
        assert_eq!(changed_back, plain, "an empty detail equals none");
        let named = Host::new(addr()).with_hostname(Some("a".into()));
        assert_ne!(named, plain);
        assert_eq!(named.hostname(), Some("a"));
    }

    #[test]
    fn a_change_to_one_copy_leaves_the_others() {
        let first = Host::new(addr()).with_locality(Locality {
            zone: "z1".into(),
            ..Locality::default()
        });
        let mut second = first.clone();
        second.detail_mut().locality.zone = "z2".into();
        assert_eq!(first.locality().zone, "z1");
        assert_eq!(second.locality().zone, "z2");
    }

    #[test]
    fn a_host_serializes_every_field_by_name() {
        let host = Host {
            weight: 3,
            locality_weight: Some(2),
            ..Host::new(addr())
        }
        .with_metadata([("v".to_owned(), "1".to_owned())].into())
        .with_health_check(HealthCheckTarget {
            port: Some(9000),
            ..HealthCheckTarget::default()
        });
        let expected = json!({
            "addr": "127.0.0.1:80", "weight": 3, "priority": 0, "eds_health": "UNKNOWN",
            "metadata": {"v": "1"}, "hostname": null,
            "health_check": {"address": null, "address_port": null, "port": 9000,
                "hostname": null, "disabled": false},
            "locality": {"region": "", "zone": "", "sub_zone": ""}, "locality_weight": 2,
        });
        assert_eq!(serde_json::to_value(&host).expect("serializes"), expected);
        let keys: Vec<String> = serde_json::to_value(Host::new(addr()))
            .expect("serializes")
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys.len(), 9, "{keys:?}");
    }
}
