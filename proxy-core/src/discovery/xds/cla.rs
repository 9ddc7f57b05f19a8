//! Validation of a `ClusterLoadAssignment` and its mapping to a [`HostSet`], as Envoy's EDS does.
//!
//! What is rejected (the whole update is NACKed and nothing changes):
//! * an `LbEndpoint` without an `endpoint` (a named endpoint reference), or an endpoint without
//!   an address;
//! * a non-socket address (pipe, Envoy internal address): Envoy accepts them, we cannot connect
//!   to them;
//! * an address that is not an IP literal (Envoy: "malformed IP address"), a custom
//!   `resolver_name`, a `named_port`;
//! * `port_value` above 65535 (Envoy's proto validation) or 0 (stricter than Envoy, which accepts
//!   port 0 and then fails every connection);
//! * `load_balancing_weight` 0 on an endpoint or a locality (Envoy's proto validation: `gte: 1`
//!   when set);
//! * a `health_status` outside the enum (Envoy's `defined_only`);
//! * a locality that uses LEDS (not supported here; Envoy also rejects LEDS mixed with
//!   `lb_endpoints`).
//!
//! What is accepted as Envoy accepts it:
//! * gaps between priorities. The API says priorities "should range from 0 (highest) to N
//!   (lowest) without skipping", but Envoy does not enforce it: `PriorityStateManager` grows its
//!   per-priority table to the highest priority seen and leaves skipped levels empty. Hosts keep
//!   the priority number they were given;
//! * a duplicate address: only the first occurrence is kept (Envoy's `all_new_hosts` set);
//! * a `ClusterLoadAssignment` without endpoints: the cluster then has no hosts.
//!
//! Mapping of one `LbEndpoint` to a [`Host`]:
//! * `addr`: `endpoint.address.socket_address.{address, port_value}`;
//! * `weight`: `load_balancing_weight`, default 1;
//! * `priority`: the enclosing `LocalityLbEndpoints.priority`;
//! * `eds_health`: `health_status` (UNKNOWN, HEALTHY, UNHEALTHY, DRAINING, TIMEOUT, DEGRADED);
//! * `hostname`: `endpoint.hostname` when not empty;
//! * `metadata`: the scalar values of `metadata.filter_metadata["envoy.lb"]` under their own key
//!   (strings as is, booleans as `true`/`false`, numbers in Rust's shortest form, e.g. `1` or
//!   `0.5`; lists, structs and nulls are skipped), then the locality's non-empty `region`,
//!   `zone` and `sub_zone` under [`LOCALITY_REGION`], [`LOCALITY_ZONE`] and
//!   [`LOCALITY_SUB_ZONE`] (these win over an `envoy.lb` key of the same name).

use std::{
    collections::{BTreeMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use envoy_types::pb::{
    envoy::config::{
        core::v3::{HealthStatus, Locality, Metadata, address, socket_address::PortSpecifier},
        endpoint::v3::{
            ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints, lb_endpoint::HostIdentifier,
            locality_lb_endpoints::LbConfig,
        },
    },
    google::protobuf::value::Kind,
};
use thiserror::Error;

use crate::discovery::{EdsHealth, Host, HostSet};

/// Metadata key of the locality's region.
pub const LOCALITY_REGION: &str = "locality.region";
/// Metadata key of the locality's zone.
pub const LOCALITY_ZONE: &str = "locality.zone";
/// Metadata key of the locality's sub-zone.
pub const LOCALITY_SUB_ZONE: &str = "locality.sub_zone";
/// The `filter_metadata` namespace whose values become host metadata (Envoy's subset LB key).
pub const LB_METADATA_NAMESPACE: &str = "envoy.lb";

/// Why a `ClusterLoadAssignment` was rejected. `at` is the path of the offending element, e.g.
/// `endpoints[0].lb_endpoints[2]`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ClaError {
    /// `cluster_name` is empty (Envoy's proto validation: `min_len: 1`).
    #[error("cluster load assignment has an empty cluster_name")]
    EmptyClusterName,
    /// An `LbEndpoint` without an endpoint.
    #[error("{at}: lb endpoint has no endpoint (named endpoint references are not supported)")]
    MissingEndpoint {
        /// Path of the element.
        at: String,
    },
    /// An endpoint without an address.
    #[error("{at}: endpoint has no address")]
    MissingAddress {
        /// Path of the element.
        at: String,
    },
    /// A pipe or internal address.
    #[error("{at}: only socket addresses are supported, not a {kind} address")]
    UnsupportedAddress {
        /// Path of the element.
        at: String,
        /// `pipe` or `envoy_internal`.
        kind: &'static str,
    },
    /// Not an IP literal.
    #[error("{at}: malformed IP address {address:?} (EDS endpoints must be IP literals)")]
    InvalidIp {
        /// Path of the element.
        at: String,
        /// The address as sent.
        address: String,
    },
    /// A socket address without a port.
    #[error("{at}: socket address has no port_value")]
    MissingPort {
        /// Path of the element.
        at: String,
    },
    /// A port outside 1..=65535.
    #[error("{at}: port {port} is out of range 1..=65535")]
    InvalidPort {
        /// Path of the element.
        at: String,
        /// The port as sent.
        port: u32,
    },
    /// A named port.
    #[error("{at}: named port {name:?} is not supported, use port_value")]
    NamedPort {
        /// Path of the element.
        at: String,
        /// The name as sent.
        name: String,
    },
    /// A custom resolver.
    #[error("{at}: custom resolver {name:?} is not supported")]
    CustomResolver {
        /// Path of the element.
        at: String,
        /// The resolver name as sent.
        name: String,
    },
    /// A load-balancing weight of 0.
    #[error("{at}: load_balancing_weight must be at least 1, got 0")]
    ZeroWeight {
        /// Path of the element.
        at: String,
    },
    /// A health status outside the enum.
    #[error("{at}: unknown health_status {value}")]
    UnknownHealth {
        /// Path of the element.
        at: String,
        /// The value as sent.
        value: i32,
    },
    /// A locality using LEDS.
    #[error("{at}: locality uses LEDS (leds_cluster_locality_config), which is not supported")]
    Leds {
        /// Path of the element.
        at: String,
    },
}

/// Validates `cla` and maps it to hosts in assignment order (first occurrence of an address
/// wins).
pub fn hosts_from_cla(cla: &ClusterLoadAssignment) -> Result<HostSet, ClaError> {
    if cla.cluster_name.is_empty() {
        return Err(ClaError::EmptyClusterName);
    }
    let mut hosts = HostSet::new();
    let mut seen = HashSet::new();
    for (index, locality) in cla.endpoints.iter().enumerate() {
        let at = format!("endpoints[{index}]");
        check_locality(locality, &at)?;
        for (lb_index, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let at = format!("{at}.lb_endpoints[{lb_index}]");
            let host = host_from_lb_endpoint(lb_endpoint, locality, &at)?;
            if seen.insert(host.addr) {
                hosts.push(host);
            } else {
                tracing::debug!(cluster = %cla.cluster_name, addr = %host.addr, "duplicate endpoint ignored");
            }
        }
    }
    Ok(hosts)
}

fn check_locality(locality: &LocalityLbEndpoints, at: &str) -> Result<(), ClaError> {
    if let Some(LbConfig::LedsClusterLocalityConfig(_)) = locality.lb_config {
        return Err(ClaError::Leds { at: at.to_owned() });
    }
    if locality.load_balancing_weight.is_some_and(|w| w.value == 0) {
        return Err(ClaError::ZeroWeight {
            at: format!("{at}.load_balancing_weight"),
        });
    }
    Ok(())
}

fn host_from_lb_endpoint(
    lb_endpoint: &LbEndpoint,
    locality: &LocalityLbEndpoints,
    at: &str,
) -> Result<Host, ClaError> {
    let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier else {
        return Err(ClaError::MissingEndpoint { at: at.to_owned() });
    };
    let addr = socket_addr(endpoint.address.as_ref(), &format!("{at}.endpoint.address"))?;
    let weight = match lb_endpoint.load_balancing_weight {
        None => 1,
        Some(w) if w.value == 0 => {
            return Err(ClaError::ZeroWeight {
                at: format!("{at}.load_balancing_weight"),
            });
        }
        Some(w) => w.value,
    };
    let mut host = Host::new(addr);
    host.weight = weight;
    host.priority = locality.priority;
    host.eds_health = eds_health(lb_endpoint.health_status, at)?;
    host.hostname = Some(endpoint.hostname.clone()).filter(|h| !h.is_empty());
    host.metadata = metadata(lb_endpoint.metadata.as_ref(), locality.locality.as_ref());
    Ok(host)
}

/// The socket address of an endpoint, validated.
fn socket_addr(
    address: Option<&envoy_types::pb::envoy::config::core::v3::Address>,
    at: &str,
) -> Result<SocketAddr, ClaError> {
    let at = at.to_owned();
    let socket = match address.and_then(|a| a.address.as_ref()) {
        None => return Err(ClaError::MissingAddress { at }),
        Some(address::Address::Pipe(_)) => {
            return Err(ClaError::UnsupportedAddress { at, kind: "pipe" });
        }
        Some(address::Address::EnvoyInternalAddress(_)) => {
            return Err(ClaError::UnsupportedAddress {
                at,
                kind: "envoy_internal",
            });
        }
        Some(address::Address::SocketAddress(socket)) => socket,
    };
    if !socket.resolver_name.is_empty() {
        let name = socket.resolver_name.clone();
        return Err(ClaError::CustomResolver { at, name });
    }
    let ip: IpAddr = socket.address.parse().map_err(|_| ClaError::InvalidIp {
        at: at.clone(),
        address: socket.address.clone(),
    })?;
    let port = match &socket.port_specifier {
        None => return Err(ClaError::MissingPort { at }),
        Some(PortSpecifier::NamedPort(name)) => {
            let name = name.clone();
            return Err(ClaError::NamedPort { at, name });
        }
        Some(PortSpecifier::PortValue(port)) => *port,
    };
    match u16::try_from(port) {
        Ok(port) if port != 0 => Ok(SocketAddr::new(ip, port)),
        _ => Err(ClaError::InvalidPort { at, port }),
    }
}

/// Envoy's `core.v3.HealthStatus` as [`EdsHealth`].
fn eds_health(value: i32, at: &str) -> Result<EdsHealth, ClaError> {
    let status = HealthStatus::try_from(value).map_err(|_| ClaError::UnknownHealth {
        at: format!("{at}.health_status"),
        value,
    })?;
    Ok(match status {
        HealthStatus::Unknown => EdsHealth::Unknown,
        HealthStatus::Healthy => EdsHealth::Healthy,
        HealthStatus::Unhealthy => EdsHealth::Unhealthy,
        HealthStatus::Draining => EdsHealth::Draining,
        HealthStatus::Timeout => EdsHealth::Timeout,
        HealthStatus::Degraded => EdsHealth::Degraded,
    })
}

/// Host metadata: `filter_metadata["envoy.lb"]` scalars, then the locality.
fn metadata(metadata: Option<&Metadata>, locality: Option<&Locality>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let lb = metadata.and_then(|m| m.filter_metadata.get(LB_METADATA_NAMESPACE));
    for (key, value) in lb.map(|s| &s.fields).into_iter().flatten() {
        let text = match &value.kind {
            Some(Kind::StringValue(s)) => s.clone(),
            Some(Kind::BoolValue(b)) => b.to_string(),
            Some(Kind::NumberValue(n)) => n.to_string(),
            _ => continue,
        };
        out.insert(key.clone(), text);
    }
    if let Some(locality) = locality {
        for (key, value) in [
            (LOCALITY_REGION, &locality.region),
            (LOCALITY_ZONE, &locality.zone),
            (LOCALITY_SUB_ZONE, &locality.sub_zone),
        ] {
            if !value.is_empty() {
                out.insert(key.to_owned(), value.clone());
            }
        }
    }
    out
}
