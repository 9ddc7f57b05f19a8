//! Validation of a `ClusterLoadAssignment` and its mapping to a [`HostSet`], in Envoy's two
//! stages and with Envoy's rejection texts.
//!
//! 1. [`check_constraints`]: the rules of the API's proto validation (protoc-gen-validate),
//!    which Envoy applies when it decodes a resource: to every resource of a state-of-the-world
//!    response (subscribed or not, duplicate or not) and to every subscribed resource of a delta
//!    response. The text is Envoy's: `Proto constraint validation failed (<Type>ValidationError.
//!    <Field>: embedded message failed validation | caused by ... : <reason>)`, first broken
//!    rule in field-number order. The rules: a non-empty `cluster_name`;
//!    `load_balancing_weight` at least 1 on a locality or an endpoint; `priority` at most 128;
//!    an `Address` with one of its kinds set; a socket address with a non-empty `address`, a
//!    port specifier, and `port_value` at most 65535; a `policy.drop_overloads` entry with a
//!    non-empty `category` and a defined denominator; `policy.overprovisioning_factor` above 0;
//!    `policy.endpoint_stale_after` above 0 ([`constraints`]).
//! 2. [`hosts_from_cla`]: the host mapping, which Envoy's EDS cluster applies only to the
//!    assignment it uses. Rejected, with Envoy's words where Envoy rejects too: an `LbEndpoint`
//!    without an endpoint or an endpoint without an address ("Address must be set"), an address
//!    that is not an IP literal ("malformed IP address: ..."), a `named_port` ("IP resolver
//!    can't handle port specifier type 4"), a `resolver_name` ("Unknown address resolver: ..."),
//!    a locality with both LEDS and endpoints ("... cannot include both LEDS ..."). Rejected by
//!    us only: pipe and Envoy internal addresses (Envoy accepts them; we cannot connect to them)
//!    and LEDS localities (Envoy subscribes to LEDS; this daemon does not implement it), and
//!    what Envoy acts on and this daemon would ignore: an endpoint's `additional_addresses`.
//!    The policy's `overprovisioning_factor`, `weighted_priority_health` and `drop_overloads`
//!    are honoured ([`assignment_policy`]): they travel with the hosts to the cluster's
//!    routing; `drop_overloads` is refused as Envoy refuses it (more than one category, a
//!    fraction above 1: Envoy's texts). `endpoint_stale_after` ([`stale_after`]) is the
//!    assignment's lease: `EdsState` removes its hosts when it runs out without a new one.
//!
//! Accepted as Envoy accepts them:
//! * `port_value: 0`, and the unspecified, broadcast and multicast addresses: Envoy keeps such a
//!   host and every connection to it fails. Here it is a host of the assignment (counted in
//!   `membership_total`), and the cluster's loop leaves it out of routing, logs it and counts it
//!   in `hosts_refused` (see `config::host_guard`); the cluster's other hosts are used;
//! * a `health_status` outside the enum (Envoy has no `defined_only` rule there): UNKNOWN, which
//!   routes like HEALTHY (Envoy's admin shows such a host healthy);
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
//! * `health_check`: `endpoint.health_check_config` (`port_value`, an `address` that must be an
//!   IP literal like the endpoint's, `hostname`, `disable_active_health_check`), Envoy's order:
//!   the alternate address with its port, then `port_value` over the port;
//! * `locality`, `locality_weight`: the enclosing locality and its `load_balancing_weight`;
//! * `metadata`: the scalar values of `metadata.filter_metadata["envoy.lb"]` under their own key
//!   (strings as is, booleans as `true`/`false`, numbers in Rust's shortest form, e.g. `1` or
//!   `0.5`; lists, structs and nulls are skipped), then the locality's non-empty `region`,
//!   `zone` and `sub_zone` under [`LOCALITY_REGION`], [`LOCALITY_ZONE`] and
//!   [`LOCALITY_SUB_ZONE`] (these win over an `envoy.lb` key of the same name).

use std::{
    collections::{BTreeMap, HashSet},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use envoy_types::pb::{
    envoy::config::{
        core::v3::{
            Address, HealthStatus, Locality, Metadata, SocketAddress, address,
            socket_address::PortSpecifier,
        },
        endpoint::v3::{
            ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints, endpoint::HealthCheckConfig,
            lb_endpoint::HostIdentifier, locality_lb_endpoints::LbConfig,
        },
    },
    google::protobuf::value::Kind,
};
use thiserror::Error;

use crate::{
    health::{
        AssignmentPolicy,
        drop_overload::{self, Denominator, DropOverloadError},
    },
    host::{EdsHealth, HealthCheckTarget, Host, HostSet},
};

mod constraints;

use self::constraints::violation;
pub use self::constraints::{Rule, Violation, check_constraints};

/// Metadata key of the locality's region.
pub const LOCALITY_REGION: &str = "locality.region";
/// Metadata key of the locality's zone.
pub const LOCALITY_ZONE: &str = "locality.zone";
/// Metadata key of the locality's sub-zone.
pub const LOCALITY_SUB_ZONE: &str = "locality.sub_zone";
/// The `filter_metadata` namespace whose values become host metadata (Envoy's subset LB key).
pub const LB_METADATA_NAMESPACE: &str = "envoy.lb";
/// The highest `LocalityLbEndpoints.priority` the API allows.
pub const MAX_PRIORITY: u32 = 128;

/// Why a `ClusterLoadAssignment` was rejected. `at` is the path of the offending element, e.g.
/// `endpoints[0].lb_endpoints[2]`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ClaError {
    /// A rule of the API's proto validation is broken (checked before anything else).
    #[error("Proto constraint validation failed ({violation})")]
    Constraint {
        /// Which rule, where.
        violation: Violation,
    },
    /// An `LbEndpoint` without an endpoint (e.g. only an `endpoint_name`), or an endpoint
    /// without an address.
    #[error("Address must be set: {at} has no {missing}")]
    MissingAddress {
        /// Path of the element.
        at: String,
        /// `endpoint` or `address`.
        missing: &'static str,
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
    #[error("malformed IP address: {address}. EDS endpoints must be IP literals ({at})")]
    InvalidIp {
        /// Path of the element.
        at: String,
        /// The address as sent.
        address: String,
    },
    /// A named port (Envoy's IP resolver names the `named_port` case by its number, 4).
    #[error(
        "IP resolver can't handle port specifier type 4: {at} has named_port {name:?}, use port_value"
    )]
    NamedPort {
        /// Path of the element.
        at: String,
        /// The name as sent.
        name: String,
    },
    /// A custom resolver.
    #[error(
        "Unknown address resolver: {name}. EDS endpoints must be IP literals without a resolver_name ({at})"
    )]
    CustomResolver {
        /// Path of the element.
        at: String,
        /// The resolver name as sent.
        name: String,
    },
    /// A locality with both a LEDS collection and endpoints of its own.
    #[error(
        "A ClusterLoadAssignment for cluster {cluster} cannot include both LEDS (resource: {resource}) and a list of endpoints."
    )]
    LedsWithEndpoints {
        /// The assignment's `cluster_name`.
        cluster: String,
        /// The LEDS collection name.
        resource: String,
    },
    /// A locality using LEDS.
    #[error("{at}: locality uses LEDS (leds_cluster_locality_config), which is not supported")]
    Leds {
        /// Path of the element.
        at: String,
    },
    /// `policy.drop_overloads` refused as Envoy refuses it.
    #[error(transparent)]
    DropOverload(#[from] DropOverloadError),
    /// A field Envoy honours and this daemon would ignore (ours: Envoy accepts it).
    #[error("{at}: field {field} is not supported by this daemon (it would be ignored)")]
    Unhonoured {
        /// Path of the element.
        at: String,
        /// The field.
        field: &'static str,
    },
}

/// `policy.endpoint_stale_after`: how long the assignment may be used without a new one
/// (`None`: unset, for ever; the proto rules refuse 0 and below before this is read).
pub fn stale_after(cla: &ClusterLoadAssignment) -> Option<Duration> {
    let stale = cla.policy.as_ref()?.endpoint_stale_after.as_ref()?;
    let seconds = u64::try_from(stale.seconds).ok()?;
    let nanos = u32::try_from(stale.nanos).ok()?;
    Some(Duration::new(seconds, nanos)).filter(|d| !d.is_zero())
}

/// The routing part of `cla`'s `policy`, Envoy's defaults where unset (factor 140, no drop),
/// or Envoy's refusal of its `drop_overloads` (constraints checked before).
pub fn assignment_policy(cla: &ClusterLoadAssignment) -> Result<AssignmentPolicy, ClaError> {
    let default = AssignmentPolicy::default();
    let Some(policy) = &cla.policy else {
        return Ok(default);
    };
    let entries: Vec<(&str, u32, Denominator)> = policy
        .drop_overloads
        .iter()
        .map(|d| {
            let (numerator, denominator) = d
                .drop_percentage
                .as_ref()
                .map_or((0, 0), |p| (p.numerator, p.denominator));
            let denominator = Denominator::from_proto(denominator).unwrap_or_default();
            (d.category.as_str(), numerator, denominator)
        })
        .collect();
    Ok(AssignmentPolicy {
        overprovisioning_factor: policy
            .overprovisioning_factor
            .map_or(default.overprovisioning_factor, |f| f.value),
        weighted_priority_health: policy.weighted_priority_health,
        drop_overload: drop_overload::check(&entries)?,
    })
}

/// Validates `cla` (both stages) and maps it to hosts in assignment order (first occurrence of
/// an address wins).
pub fn hosts_from_cla(cla: &ClusterLoadAssignment) -> Result<HostSet, ClaError> {
    check_constraints(cla)?;
    map_hosts(cla)
}

/// The second stage alone: the host mapping of an assignment whose constraints were checked.
pub(crate) fn map_hosts(cla: &ClusterLoadAssignment) -> Result<HostSet, ClaError> {
    refuse_unhonoured(cla)?;
    assignment_policy(cla)?;
    for (index, locality) in cla.endpoints.iter().enumerate() {
        if let Some(LbConfig::LedsClusterLocalityConfig(leds)) = &locality.lb_config {
            if !locality.lb_endpoints.is_empty() {
                return Err(ClaError::LedsWithEndpoints {
                    cluster: cla.cluster_name.clone(),
                    resource: leds.leds_collection_name.clone(),
                });
            }
            let at = format!("endpoints[{index}]");
            return Err(ClaError::Leds { at });
        }
    }
    let mut hosts = HostSet::new();
    let mut seen = HashSet::new();
    for (index, locality) in cla.endpoints.iter().enumerate() {
        for (lb_index, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let at = format!("endpoints[{index}].lb_endpoints[{lb_index}]");
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

/// An endpoint's extra addresses: Envoy acts on them, and this daemon would not.
fn refuse_unhonoured(cla: &ClusterLoadAssignment) -> Result<(), ClaError> {
    let refuse = |at: String, field| Err(ClaError::Unhonoured { at, field });
    for (index, locality) in cla.endpoints.iter().enumerate() {
        for (lb_index, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier else {
                continue;
            };
            let at = || format!("endpoints[{index}].lb_endpoints[{lb_index}].endpoint");
            if !endpoint.additional_addresses.is_empty() {
                return refuse(at(), "additional_addresses");
            }
        }
    }
    Ok(())
}

fn host_from_lb_endpoint(
    lb_endpoint: &LbEndpoint,
    locality: &LocalityLbEndpoints,
    at: &str,
) -> Result<Host, ClaError> {
    let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier else {
        let at = at.to_owned();
        return Err(ClaError::MissingAddress {
            at,
            missing: "endpoint",
        });
    };
    let addr = socket_addr(endpoint.address.as_ref(), at)?;
    let mut host = Host::new(addr);
    host.weight = lb_endpoint.load_balancing_weight.map_or(1, |w| w.value);
    host.priority = locality.priority;
    host.eds_health = eds_health(lb_endpoint.health_status);
    host.locality_weight = locality.load_balancing_weight.map(|w| w.value);
    let mut detail = crate::host::HostDetail {
        hostname: Some(endpoint.hostname.clone()).filter(|h| !h.is_empty()),
        metadata: metadata(lb_endpoint.metadata.as_ref(), locality.locality.as_ref()),
        ..Default::default()
    };
    if let Some(l) = &locality.locality {
        detail.locality = crate::host::Locality {
            region: l.region.clone(),
            zone: l.zone.clone(),
            sub_zone: l.sub_zone.clone(),
        };
    }
    if let Some(check) = &endpoint.health_check_config {
        detail.health_check = health_check(check, &format!("{at}.endpoint.health_check_config"))?;
    }
    Ok(host.with_detail(detail))
}

/// `Endpoint.health_check_config` as a [`HealthCheckTarget`]: its address must be an IP
/// literal like the endpoint's own (its port checked by [`check_constraints`]).
fn health_check(check: &HealthCheckConfig, at: &str) -> Result<HealthCheckTarget, ClaError> {
    let address = match &check.address {
        Some(address) => Some(socket_addr(Some(address), at)?),
        None => None,
    };
    Ok(HealthCheckTarget {
        address: address.map(|a| a.ip()),
        address_port: address.map(|a| a.port()).filter(|p| *p != 0),
        port: u16::try_from(check.port_value).ok().filter(|p| *p != 0),
        hostname: Some(check.hostname.clone()).filter(|h| !h.is_empty()),
        disabled: check.disable_active_health_check,
    })
}

/// The socket address of an endpoint, in the order Envoy's resolver checks it: the resolver,
/// the port specifier, then the IP literal.
fn socket_addr(address: Option<&Address>, at: &str) -> Result<SocketAddr, ClaError> {
    let at = format!("{at}.endpoint.address");
    let socket: &SocketAddress = match address.and_then(|a| a.address.as_ref()) {
        None => {
            let missing = "address";
            return Err(ClaError::MissingAddress { at, missing });
        }
        Some(address::Address::Pipe(_)) => {
            return Err(ClaError::UnsupportedAddress { at, kind: "pipe" });
        }
        Some(address::Address::EnvoyInternalAddress(_)) => {
            let kind = "envoy_internal";
            return Err(ClaError::UnsupportedAddress { at, kind });
        }
        Some(address::Address::SocketAddress(socket)) => socket,
    };
    if !socket.resolver_name.is_empty() {
        let name = socket.resolver_name.clone();
        return Err(ClaError::CustomResolver { at, name });
    }
    let port = match &socket.port_specifier {
        Some(PortSpecifier::PortValue(port)) => u16::try_from(*port).map_err(|_| Rule::PortRange),
        Some(PortSpecifier::NamedPort(name)) => {
            let name = name.clone();
            return Err(ClaError::NamedPort { at, name });
        }
        None => Err(Rule::PortSpecifier),
    };
    // Unreachable after `check_constraints`, which reports these with their place.
    let port = port.map_err(|rule| violation(None, None, rule))?;
    let ip: IpAddr = socket.address.parse().map_err(|_| ClaError::InvalidIp {
        at: at.clone(),
        address: socket.address.clone(),
    })?;
    Ok(SocketAddr::new(ip, port))
}

/// Envoy's `core.v3.HealthStatus` as [`EdsHealth`]; a value outside the enum is UNKNOWN.
fn eds_health(value: i32) -> EdsHealth {
    match HealthStatus::try_from(value) {
        Ok(HealthStatus::Unknown) => EdsHealth::Unknown,
        Ok(HealthStatus::Healthy) => EdsHealth::Healthy,
        Ok(HealthStatus::Unhealthy) => EdsHealth::Unhealthy,
        Ok(HealthStatus::Draining) => EdsHealth::Draining,
        Ok(HealthStatus::Timeout) => EdsHealth::Timeout,
        Ok(HealthStatus::Degraded) => EdsHealth::Degraded,
        Err(_) => {
            tracing::debug!(value, "health_status outside the enum, taken as UNKNOWN");
            EdsHealth::Unknown
        }
    }
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
